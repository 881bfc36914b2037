"""The tensor store against its peers, in one run (issue 17):

(a) 512 MiB of f32: `st.put` / `st.get_array` of a directory store against
    `safetensors.numpy.save_file` / `load_file` of the same array in the same directory.
    A DTM put is durable (every file fsynced, then renamed into the index); save_file is
    not, so the safetensors figure also gets an fsync of its file ("+fsync") for a like
    comparison. Gets are timed cold where the page cache can be emptied for the files read
    (posix_fadvise DONTNEED after an fsync: no root needed), and warm.
(b) small objects: put + get of a 1 KiB f32 tensor, microseconds per pair, over
    `--pairs` pairs on a memory:// store and on a directory store in /dev/shm, and over
    `--durable-pairs` on a directory store on disk (each put fsyncs its files: the disk's
    sync latency, not DTM's code, sets that figure); the peer is save_file + load_file of
    the same 1 KiB to one file.
(c) only when `ray` is importable (`pip install dtm[bench]`): a second process gets a
    256 MiB tensor the first put, DTM through a directory store in /dev/shm and one on the
    disk's file system (where the default store lives; `--dir`) against ray.put / ray.get on
    a local Ray; each engine's best of FRESH gets, each of an object the getting process has
    not read before (Ray's worker started before the timing). Run
    the whole benchmark in a loopback-only namespace so Ray's ports stay local: unshare -n sh -c 'ip link set lo up && exec "$@"' sh python benchmarks/store.py

(d) across two ranks over TCP (`dtm launch -n 2` of this file): rank 1 gets a 64 MiB tensor
    that only rank 0 holds from the mesh's store with share_memory=False (StoreRequest,
    StoreReply and Data frames, every frame's CRC32C checked), against the same bytes
    asked for and sent over a plain loopback TCP socket between the same two processes.

Ratios are peer time / DTM time: above 1.0, DTM is faster.

    python benchmarks/store.py                    # about a minute
    python benchmarks/store.py --mib 64 --pairs 1000 --durable-pairs 50   # a quick run
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dtm  # noqa: E402
from timing import best_of  # noqa: E402 - this folder is on sys.path when run as a script

MIB = 1 << 20


def evict(paths: list[Path]) -> bool:
    """Drop `paths` from the page cache (they are fsynced first, so their pages are clean);
    False where the platform has no posix_fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def files_under(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file()]


def row(what: str, dtm_s: float, peer: str, peer_s: float, unit: str = "s") -> None:
    scale, fmt = (1e6, "{:9.1f} us") if unit == "us" else (1.0, "{:9.3f} s ")
    print(f"  {what:<34} DTM {fmt.format(dtm_s * scale)}   {peer:<26} {fmt.format(peer_s * scale)}"
          f"   ratio {peer_s / dtm_s:5.2f}x")


def large(root: Path, mib: int, runs: int) -> None:
    x = np.random.default_rng(0).standard_normal(mib * MIB // 4, dtype=np.float32)
    st = dtm.store.open(root / "store")
    st_file = root / "x.safetensors"

    def st_save_synced() -> None:
        save_file({"x": x}, st_file)
        fd = os.open(st_file, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    # One untimed round first: fresh page-cache memory is slow to get the first time here
    # (1.5 s instead of 0.4 s for 512 MiB, whichever writer comes first); then the writers
    # take turns, so each sees the same machine.
    st.put("x", x)
    st_save_synced()
    rounds = [(best_of(lambda: st.put("x", x), 1), best_of(lambda: save_file({"x": x}, st_file), 1),
               best_of(st_save_synced, 1)) for _ in range(runs)]
    put, save, save_synced = (min(r[k] for r in rounds) for k in range(3))
    print(f"(a) {mib} MiB f32")
    row("put (durable)", put, "save_file", save)
    row("put (durable)", put, "save_file + fsync", save_synced)

    def get() -> None:
        a = st.get_array("x")
        assert a.shape == x.shape

    def cold(paths: list[Path], fn) -> float:
        """The best of `runs` calls of fn, each after `paths` left the page cache (untimed)."""
        best = float("inf")
        for _ in range(runs):
            evict(paths)
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    store_files = files_under(root / "store" / "data")
    if evict(store_files):
        row("get, cold cache (fadvise)", cold(store_files, get), "load_file, cold cache",
            cold([st_file], lambda: load_file(st_file)))
    else:
        print("  (the page cache cannot be emptied here: warm cache only)")
    row("get, warm cache", best_of(get, runs), "load_file, warm cache", best_of(lambda: load_file(st_file), runs))
    np.testing.assert_array_equal(st.get_array("x"), x)


def small(root: Path, pairs: int, durable_pairs: int) -> None:
    x = np.random.default_rng(1).standard_normal(256).astype(np.float32)  # 1 KiB

    def per_pair(st: dtm.store.Store, n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            st.put_array("small/x", x)
            st.get_array("small/x")
        return (time.perf_counter() - t0) / n

    path = root / "small.safetensors"

    def st_pairs(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            save_file({"x": x}, path)
            load_file(path)
        return (time.perf_counter() - t0) / n

    peer = st_pairs(min(pairs, 2000))
    print("(b) 1 KiB f32, put + get per pair")
    row(f"memory://, {pairs} pairs", per_pair(dtm.store.open(f"memory://bench-{os.getpid()}"), pairs),
        "save_file + load_file", peer, "us")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as shm:
        row(f"directory in /dev/shm, {pairs} pairs", per_pair(dtm.store.open(shm), pairs),
            "save_file + load_file", peer, "us")
    row(f"directory on disk, {durable_pairs} pairs", per_pair(dtm.store.open(root / "durable"), durable_pairs),
        "save_file + load_file", peer, "us")
    # the like peer of a durable put: a file of its own, synced, read back (issue 29)
    row(f"directory on disk, {durable_pairs} pairs", per_pair(dtm.store.open(root / "durable"), durable_pairs),
        "np.save + fsync + load", npy_pairs(root / "small.npy", x, durable_pairs), "us")
    put_many_rate(root / "many", x)


def npy_pairs(path: Path, x: np.ndarray, n: int) -> float:
    """Seconds per np.save + fsync + np.load of `x` to `path`."""
    t0 = time.perf_counter()
    for _ in range(n):
        with open(path, "wb") as f:
            np.save(f, x)
            f.flush()
            os.fsync(f.fileno())
        np.load(path)
    return (time.perf_counter() - t0) / n


def put_many_rate(root: Path, x: np.ndarray, keys: int = 10_000, batch: int = 1000) -> None:
    """Keys a second that put_many commits durably on disk, `batch` a call, against np.savez
    of each batch to one file + fsync (one sync a batch too)."""
    st = dtm.store.open(root)
    t0 = time.perf_counter()
    for b in range(0, keys, batch):
        st.put_many((f"many/{i}", x) for i in range(b, b + batch))
    dtm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for b in range(0, keys, batch):
        with open(root / f"batch{b}.npz", "wb") as f:
            np.savez(f, **{str(i): x for i in range(b, b + batch)})
            f.flush()
            os.fsync(f.fileno())
    peer_s = time.perf_counter() - t0
    print(f"  put_many on disk, {keys} keys of {x.nbytes} B in batches of {batch}: {keys / dtm_s:,.0f} keys/s   "
          f"np.savez + fsync {keys / peer_s:,.0f} keys/s   ratio {peer_s / dtm_s:5.2f}x")


FRESH = 3  # (c) times each engine's get of this many objects the getting process has not read yet: the best


def _dtm_getter(path: str, q) -> None:
    st = dtm.store.open(path)
    q.put("ready")
    q.get()
    times = []
    for i in range(FRESH):
        t0 = time.perf_counter()
        a = st.get_array(f"big{i}")
        float(a[-1])  # the bytes are there, checked
        t1 = time.perf_counter()
        float(a.sum())  # ... and read
        times.append((t1 - t0, time.perf_counter() - t0))
        del a
    q.put(min(times))


def _dtm_between(x: np.ndarray, d: str) -> tuple[float, float]:
    """(get, get + sum) seconds of a second process getting what this one put into a
    directory store at `d`: the best of FRESH keys."""
    st = dtm.store.open(d)
    for i in range(FRESH):
        st.put(f"big{i}", x)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_dtm_getter, args=(d, q))
    p.start()
    assert q.get(timeout=120) == "ready"
    q.put("go")
    got = q.get(timeout=120)
    p.join(timeout=60)
    return got


def between_processes(mib: int, root: Path) -> None:
    try:
        import ray
    except ImportError:
        print("(c) skipped: ray is not installed (pip install 'dtm[bench]')")
        return
    x = np.random.default_rng(2).standard_normal(mib * MIB // 4, dtype=np.float32)
    # the store in /dev/shm (tmpfs), and on the disk's file system, where the default store
    # (~/.cache/dtm/store) lives: the getter maps the put's pages from the page cache either
    # way, but the kernel maps a tmpfs file in 4 KiB pages here (shmem_enabled: never) and a
    # file of ext4 (Linux 6.18: large folios) in 2 MiB ones, which a sum reads twice as fast
    stores = {}
    if os.path.isdir("/dev/shm"):
        with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
            stores["directory in /dev/shm"] = _dtm_between(x, d)
    with tempfile.TemporaryDirectory(dir=root) as d:
        stores["directory on disk"] = _dtm_between(x, d)

    ray.init(num_cpus=1, include_dashboard=False, ignore_reinit_error=True)

    @ray.remote
    def ray_getter(refs):
        t0 = time.perf_counter()
        a = ray.get(refs[0])
        float(a[-1])
        t1 = time.perf_counter()
        float(a.sum())
        return t1 - t0, time.perf_counter() - t0

    refs = [ray.put(x) for _ in range(FRESH)]
    ray.get(ray_getter.remote([ray.put(x[:1024])]))  # the worker process starts once, outside the timing
    # each timed get is of an object the worker has not read (its pages not yet mapped there),
    # as DTM's: a second get of the same object would find its pages mapped from the first
    ray_s = min(ray.get(ray_getter.remote([ref])) for ref in refs)
    ray.shutdown()
    print(f"(c) {mib} MiB f32 got by another process")
    # ray.get maps the object without reading it; DTM's get checks every chunk's CRC32C
    for where, dtm_s in stores.items():
        row(f"get ({where})", dtm_s[0], "ray.get", ray_s[0])
        row("  then sum every element", dtm_s[1], "ray.get, then sum", ray_s[1])


def _raw_server(sock, data: memoryview) -> None:
    conn, _ = sock.accept()
    with conn:
        while conn.recv(1):
            conn.sendall(data)


def _raw_get(address, buf: memoryview, runs: int) -> float:
    import socket

    with socket.create_connection(address) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def once() -> None:
            c.sendall(b"g")
            got = 0
            while got < len(buf):
                got += c.recv_into(buf[got:])
        return best_of(once, runs)


def mesh_rank(mib: int, runs: int) -> None:
    """One rank of (d); run by `dtm launch -n 2 benchmarks/store.py --mesh-rank`."""
    import socket
    import threading

    from dtm.store.mesh_store import placement

    pg = dtm.runtime.process_group.init(timeout=60)
    st = dtm.store.mesh(replicas=1, share_memory=False)
    key = next(f"big/{i}" for i in range(100) if placement(f"big/{i}", 2)[0] == 0)
    x = np.random.default_rng(3).standard_normal(mib * MIB // 4, dtype=np.float32)
    raw = socket.create_server(("127.0.0.1", 0))
    if pg.rank == 0:
        st.put(key, x)
        threading.Thread(target=_raw_server, args=(raw, memoryview(x.view(np.uint8))), daemon=True).start()
    port = int(pg.all_gather(np.array([raw.getsockname()[1]], np.int64))[0])
    if pg.rank == 1:
        st.get_array(key)  # the connection opens once, outside the timing
        dtm_s = best_of(lambda: st.get_array(key), runs)
        assert np.array_equal(st.get_array(key), x)
        raw_s = _raw_get(("127.0.0.1", port), memoryview(np.empty(x.nbytes, np.uint8)), runs)
        gbs = lambda t: x.nbytes / t / 1e9  # noqa: E731
        print(f"(d) {mib} MiB f32 from the other rank over loopback TCP")
        print(f"    mesh store get (wire)              {dtm_s * 1e3:8.1f} ms  {gbs(dtm_s):5.2f} GB/s   "
              f"raw socket {raw_s * 1e3:8.1f} ms  {gbs(raw_s):5.2f} GB/s   ratio {raw_s / dtm_s:5.2f}x", flush=True)
    pg.barrier()


def across_ranks(mib: int, runs: int) -> None:
    import subprocess

    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", "2", __file__, "--mesh-rank", "--mesh-mib", str(mib),
           "--runs", str(runs)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    print("".join(line.split("] ", 1)[-1] + "\n" for line in out.stdout.splitlines()), end="")
    if out.returncode:
        print(out.stderr[-3000:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="size of (a)'s tensor")
    ap.add_argument("--runs", type=int, default=2, help="timed runs of each (a) figure (the best is shown)")
    ap.add_argument("--pairs", type=int, default=10_000, help="(b)'s pairs on memory:// and /dev/shm stores")
    ap.add_argument("--durable-pairs", type=int, default=200, help="(b)'s pairs on a directory store on disk")
    ap.add_argument("--ray-mib", type=int, default=256, help="size of (c)'s tensor")
    ap.add_argument("--dir", default=None, help="where the on-disk stores and files go (default: a temp dir)")
    ap.add_argument("--mesh-mib", type=int, default=64, help="size of (d)'s tensor")
    ap.add_argument("--mesh-rank", action="store_true", help="run as one rank of (d) (dtm launch does this)")
    ap.add_argument("--only", choices=["a", "b", "c", "d"], default=None, help="run only this part")
    args = ap.parse_args()
    if args.mesh_rank:
        mesh_rank(args.mesh_mib, max(args.runs, 3))
        return
    if args.only == "d":
        across_ranks(args.mesh_mib, max(args.runs, 3))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        if args.only in (None, "a"):
            large(Path(d), args.mib, args.runs)
        if args.only in (None, "b"):
            small(Path(d), args.pairs, args.durable_pairs)
        if args.only in (None, "c"):
            between_processes(args.ray_mib, Path(d))
    if args.only is None:
        across_ranks(args.mesh_mib, max(args.runs, 3))


if __name__ == "__main__":
    main()
