"""all_reduce (or send/recv) between processes on this host: DTM over TCP, DTM over shared
memory, and torch.distributed's gloo, measured in the same run.

For each rank count, each backend gets its own processes, and the backends take turns size
by size; every iteration starts after a barrier, its time is the slowest rank's, and the
figure is the median over iterations.
Definitions are nccl-tests': algbw = bytes / time, busbw = algbw * 2(n-1)/n. The 8-byte
row is the latency figure. All traffic stays on the loopback interface: the benchmark runs
itself in a network namespace of its own (`unshare -n`) when it may, else gloo is bound to
`lo` with GLOO_SOCKET_IFNAME. Every backend reduces in place (gloo's semantics; DTM with
`out=x`).

`tcp-q8_0` and `tcp-bf16` are DTM over TCP with `compress=` (issue 19, spec 9.5.1): the
ring's chunks travel as q8_0 blocks (34 bytes per 32 values) or bf16; the result is
approximate (the spec's bound). Not in the default set: name them, e.g.

    python benchmarks/collectives.py --sizes 16M 64M --ranks 2 4 --backends gloo tcp tcp-q8_0 tcp-bf16

Goals (issue 6): TCP >= 1.0x gloo busbw from 1 MiB up; shared memory >= 2x gloo; 8-byte
latency no worse than gloo.

The `floor` backend is the same pipelined ring written in C (`tcp_floor.c`) over plain
loopback sockets: no frame headers, no checksum, no Python. It is what the kernel's two
copies of every byte and the additions cost on this host, the least any TCP all_reduce
pays. `floor-crc` adds what DTM's frames must carry (spec 9.1): a CRC32C of every chunk,
computed by the sender and checked by the receiver with the crc32c package's own routine.
So floor-crc is the most DTM over TCP can reach, and DTM / floor-crc is the cost of the rest
(headers, Python).

`--op sendrecv` measures point-to-point instead: ranks 2k and 2k+1 play ping-pong (2k sends
and then receives the tensor back, 2k+1 receives and sends it back); the time is a round
trip and algbw = 2 * bytes / time.

    python benchmarks/collectives.py                       # 4K .. 256M, 2 and 4 ranks
    python benchmarks/collectives.py --sizes 8 1M 16M --ranks 2 --iters 5   # a quick run
    python benchmarks/collectives.py --op sendrecv --ranks 2
    python benchmarks/collectives.py --sizes 16M 64M --ranks 4 --backends gloo tcp floor floor-crc

`--hosts H --ranks-per-host R --link RATE[,DELAY][,LOSS%]` measures across hosts instead:
tests/hosts.py makes H network namespaces joined by a bridge, each link shaped (tc tbf for
a rate; netem for a delay or a loss, where the kernel has it: where not, the benchmark says
so and shapes the rate alone), and each backend's H*R ranks run R per host: gloo, DTM
(`dtm`: shared memory inside a host, TCP between hosts, all_reduce hierarchical, spec
9.5.2) and DTM with one flat ring over all ranks (`dtm-flat`). Besides busbw it prints
`link%`: the bytes that must cross each host's link (2(H-1)/H of the tensor, whatever the
algorithm) per second, as a share of the link's rate. Needs root.

    python benchmarks/collectives.py --hosts 2 --ranks-per-host 2 --link 10gbit,50us
    python benchmarks/collectives.py --hosts 2 --ranks-per-host 2 --link 1gbit --sizes 8 1M 64M

`--record DIR` keeps the figures and their plot (busbw against the size, a panel per rank
count or host layout) in DIR (record.py).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from record import lines, record

BACKENDS = ("gloo", "tcp", "shm", "floor", "floor-crc", "tcp-q8_0", "tcp-bf16")
COMPRESSED = {"tcp-q8_0": "q8_0", "tcp-bf16": "bf16"}  # DTM over TCP with compress= (spec 9.5.1), not in the default set
FLOOR_SOURCE = Path(__file__).with_name("tcp_floor.c")
DEFAULT_SIZES = ["8", "4K", "64K", "1M", "16M", "64M", "256M"]


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(t[:-1]) * units[t[-1]]) if t[-1] in units else int(t)


def show_size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def iterations(nbytes: int, cap: int) -> int:
    """Fewer iterations for large sizes: about a second's worth, at least 3."""
    return max(3, min(cap, (256 << 20) // max(nbytes, 1) * 3))


# --- workers ----------------------------------------------------------------------------------------
# Each backend's ranks stay up for the whole run and measure one size when told to, so the
# backends take turns size by size and see the same machine load.

def dtm_worker(kind, rank, n, q_port, q_addrs, q_cmd, q_out, opts):
    from dtm.comm import Communicator
    from dtm.comm.shm import connect_local
    from dtm.comm.tcp import connect_mesh, listen
    listener = listen()
    q_port.put((rank, listener.getsockname()[1]))
    addresses = q_addrs.get(timeout=120)
    if kind == "shm":
        transport = connect_local(rank, n, addresses, b"bench", listener=listener, timeout=600,
                                  slot_bytes=opts["slot"])
    else:
        transport = connect_mesh(rank, n, addresses, b"bench", listener=listener, timeout=600)
    comm = Communicator(transport, chunk_bytes=opts["chunk"])
    check = comm.all_reduce(np.full(1000, rank + 1, np.float32))
    assert (check == n * (n + 1) / 2).all(), "all_reduce gave a wrong sum"
    if opts["op"] == "sendrecv":
        op = ping_pong(rank, comm.send, lambda x, peer: comm.recv(peer, out=x))
    elif kind in COMPRESSED:
        op = lambda x: comm.all_reduce(x, out=x, compress=COMPRESSED[kind])  # noqa: E731
    else:
        op = lambda x: comm.all_reduce(x, out=x)  # noqa: E731
    serve(rank, q_cmd, q_out, op, comm.barrier, np.zeros)
    comm.close()


def gloo_worker(kind, rank, n, q_port, q_addrs, q_cmd, q_out, opts):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    port = 0
    if rank == 0:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    q_port.put((rank, port))
    addresses = q_addrs.get(timeout=120)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{addresses[0][1]}", rank=rank, world_size=n)
    check = torch.full((1000,), float(rank + 1))
    dist.all_reduce(check)
    assert bool((check == n * (n + 1) / 2).all()), "all_reduce gave a wrong sum"
    op = ping_pong(rank, dist.send, dist.recv) if opts["op"] == "sendrecv" else dist.all_reduce
    serve(rank, q_cmd, q_out, op, dist.barrier, lambda k, dtype: torch.zeros(k))
    dist.destroy_process_group()


def floor_worker(kind, rank, n, q_port, q_addrs, q_cmd, q_out, opts):
    import socket
    from dtm.comm.pump import crc32c_routine
    from dtm.toolchain import load
    ring = load(Path(opts["floor_library"])).floor_all_reduce
    ring.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int,
                     ctypes.c_long, ctypes.c_void_p]
    ring.restype = ctypes.c_int
    crc = crc32c_routine() if kind == "floor-crc" else None  # DTM's own: the one its C ring calls
    if kind == "floor-crc" and crc is None:
        raise SystemExit("floor-crc: this crc32c package has no hardware routine to call from C")
    listener = socket.create_server(("127.0.0.1", 0))
    q_port.put((rank, listener.getsockname()[1]))
    addresses = q_addrs.get(timeout=120)
    right = socket.create_connection(tuple(addresses[(rank + 1) % n]), timeout=120)  # the backlog takes it
    listener.settimeout(120)
    left, _ = listener.accept()
    for s in (left, right):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)

    def all_reduce(x: np.ndarray) -> None:
        rc = ring(left.fileno(), right.fileno(), x.ctypes.data, x.size, rank, n, opts["chunk"] // 4, crc)
        if rc:
            raise OSError(-rc, os.strerror(-rc))

    check = np.full(1000, rank + 1, np.float32)
    all_reduce(check)
    assert (check == n * (n + 1) / 2).all(), "all_reduce gave a wrong sum"
    serve(rank, q_cmd, q_out, all_reduce, lambda: all_reduce(np.zeros(n, np.float32)), np.zeros)


def ping_pong(rank: int, send, recv):
    """One round trip between ranks 2k and 2k+1 (`send(x, peer)`, `recv(x, peer)` into x):
    the even rank sends first, the odd one sends the tensor back."""
    peer = rank ^ 1

    def op(x):
        if rank % 2 == 0:
            send(x, peer)
            recv(x, peer)
        else:
            recv(x, peer)
            send(x, peer)
    return op


def serve(rank, q_cmd, q_out, op, barrier, zeros) -> None:
    """Measure sizes on command until told to stop: after a barrier, time each op."""
    while True:
        cmd = q_cmd.get(timeout=3600)
        if cmd is None:
            return
        size, iters = cmd
        x = zeros(max(1, size // 4), dtype=np.float32)
        op(x)
        times = []
        for _ in range(iters):
            barrier()
            t = time.perf_counter()
            op(x)
            times.append(time.perf_counter() - t)
        del x
        q_out.put((rank, times))


class Group:
    """One backend's n ranks."""

    def __init__(self, backend: str, n: int, opts: dict, worker=None):
        """`worker`: the ranks' function (a module-level one, as dtm_worker), else the backend's."""
        ctx = mp.get_context("spawn")
        self.n = n
        q_port, self.q_out = ctx.Queue(), ctx.Queue()
        q_addrs = [ctx.Queue() for _ in range(n)]
        self.q_cmd = [ctx.Queue() for _ in range(n)]
        target = worker or {"gloo": gloo_worker, "floor": floor_worker, "floor-crc": floor_worker}.get(backend,
                                                                                                      dtm_worker)
        self.procs = [ctx.Process(target=target, args=(backend, r, n, q_port, q_addrs[r], self.q_cmd[r], self.q_out,
                                                       opts), daemon=True) for r in range(n)]
        for p in self.procs:
            p.start()
        ports = dict(q_port.get(timeout=120) for _ in range(n))
        for q in q_addrs:
            q.put([("127.0.0.1", ports[r]) for r in range(n)])

    def measure(self, size: int, iters: int) -> float:
        """Median over iterations of the slowest rank's time."""
        for q in self.q_cmd:
            q.put((size, iters))
        per_rank = dict(self.q_out.get(timeout=1800) for _ in range(self.n))
        return statistics.median(max(per_rank[r][i] for r in range(self.n)) for i in range(iters))

    def stop(self) -> None:
        for q in self.q_cmd:
            q.put(None)
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


# --- report ------------------------------------------------------------------------------------------

def report(op: str, n: int, sizes: list[int], times: dict[str, dict[int, float]],
           link: tuple[int, float] | None = None) -> None:
    """One row per size; `link` (hosts, bytes per second of each host's link) adds link%."""
    factor = 2 * (n - 1) / n if op == "all_reduce" else 1.0
    moved = 1 if op == "all_reduce" else 2  # a ping-pong moves the tensor there and back
    backends = [b for b in (*BACKENDS, *HOST_BACKENDS) if b in times]
    head = f"{'size':>6}"
    for b in backends:
        head += f" | {b + ' time':>14} {'algbw':>7} {'busbw':>7}" + ("" if b == "gloo" else f" {'x gloo':>6}")
        head += f" {'link%':>5}" if link else ""
    what = "all_reduce" if op == "all_reduce" else "send/recv ping-pong (time: a round trip)"
    print(f"\n{what} f32, {n} ranks (time: median of the slowest rank; bandwidth in GB/s)")
    print(head)
    for s in sizes:
        row = f"{show_size(s):>6}"
        for b in backends:
            t = times[b][s]
            alg = moved * s / t / 1e9
            row += f" | {t * 1e6:>12.0f}us {alg:>7.3f} {alg * factor:>7.3f}"
            if b != "gloo":
                row += f" {times['gloo'][s] / t:>6.2f}" if "gloo" in times else f" {'-':>6}"
            if link:
                hosts, rate = link
                row += f" {100 * s * 2 * (hosts - 1) / hosts / t / rate:>5.0f}"
        print(row, flush=True)


def in_own_netns() -> bool:
    """Re-run this script in a network namespace with only loopback, when allowed; True
    when this process should go on measuring (inside, or where unshare is refused)."""
    if os.environ.get("DTM_BENCH_NETNS") or not shutil.which("unshare"):
        return True
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        print("unshare -n is not permitted here: gloo is bound to lo (GLOO_SOCKET_IFNAME=lo)")
        return True
    env = dict(os.environ, DTM_BENCH_NETNS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", sys.executable, *sys.argv]
    sys.exit(subprocess.run(cmd, env=env).returncode)


# --- across hosts (--hosts): each rank a process in a network namespace of tests/hosts.py --------

HOST_BACKENDS = ("dtm", "dtm-flat")  # with gloo; "tcp"/"shm" do not apply: a host's ranks share memory, hosts talk TCP
GLOO_PORT, DTM_PORT = 29500, 29611   # on host 0's address, in namespaces of their own: free


def hosts_worker(backend: str, sizes: list[int], iters_cap: int) -> None:
    """One rank of `backend` (its rank, world and host 0's address in DTM_* variables): check
    one all_reduce, then time each size; rank 0 prints {size: median of the slowest rank}."""
    rank, n = int(os.environ["DTM_RANK"]), int(os.environ["DTM_WORLD_SIZE"])
    if backend == "gloo":
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        master = os.environ["DTM_COORDINATOR"].rsplit(":", 1)[0]
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{GLOO_PORT}", rank=rank, world_size=n)
        op, barrier, zeros = dist.all_reduce, dist.barrier, lambda k: torch.zeros(k)

        def slowest(t: list[float]) -> list[float]:
            x = torch.tensor(t, dtype=torch.float64)
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
            return x.tolist()
    else:
        import dtm
        comm = dtm.init(timeout=600).comm
        comm.hierarchical = backend == "dtm"
        op, barrier, zeros = (lambda x: comm.all_reduce(x, out=x)), comm.barrier, (lambda k: np.zeros(k, np.float32))

        def slowest(t: list[float]) -> list[float]:
            return comm.all_reduce(np.array(t), op="max").tolist()
    check = zeros(1000) + (rank + 1)
    op(check)
    assert float(check[0]) == float(check[-1]) == n * (n + 1) / 2, f"{backend}: all_reduce gave a wrong sum"
    medians = {}
    for size in sizes:
        x = zeros(max(1, size // 4))
        op(x)
        times = []
        for _ in range(iterations(size, iters_cap)):
            barrier()
            t = time.perf_counter()
            op(x)
            times.append(time.perf_counter() - t)
        medians[size] = statistics.median(slowest(times))
    if rank == 0:
        print("RESULT " + json.dumps(medians), flush=True)


def parse_link(text: str) -> dict[str, str]:
    """"10gbit,50us,1%" -> {"rate": "10gbit", "delay": "50us", "loss": "1%"}."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key = "loss" if part.endswith("%") else "rate" if part.endswith(("bit", "bps")) else "delay"
        out[key] = part
    return out


def rate_bytes(rate: str) -> float:
    """tc's rate ("10gbit", "500mbit") in bytes per second."""
    scale = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    unit = next(u for u in scale if rate.endswith(u))
    return float(rate[: -len(unit)]) * scale[unit] / 8


def hosts_main(args) -> None:
    """--hosts: each backend's ranks in turn on the same hosts and links (see the module doc)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from hosts import Hosts, Link, netem_missing, why_not
    why = why_not()
    if why:
        sys.exit(f"--hosts needs network namespaces: {why}")
    shape = parse_link(args.link)
    if set(shape) - {"rate"} and netem_missing():
        print(f"this kernel has no netem qdisc: the links are shaped by rate alone, without "
              f"{', '.join(f'{k} {v}' for k, v in shape.items() if k != 'rate')}")
        shape = {k: v for k, v in shape.items() if k == "rate"}
    sizes = [parse_size(s) for s in args.sizes]
    n = args.hosts * args.ranks_per_host
    backends = args.backends or ["gloo", *HOST_BACKENDS]
    print(f"host: {os.cpu_count()} cores; {args.hosts} hosts x {args.ranks_per_host} ranks, each host's link: "
          f"{', '.join(shape.values()) or 'unshaped'}")
    times: dict[str, dict[int, float]] = {}
    with Hosts(args.hosts, Link(**shape)) as hosts:
        for b in backends:
            env = {k: v for k, v in os.environ.items() if not k.startswith("DTM_")}
            procs = []
            for rank in range(n):
                host = rank // args.ranks_per_host
                env.update(DTM_COORDINATOR=f"{hosts.address(0)}:{DTM_PORT}", DTM_RANK=str(rank),
                           DTM_WORLD_SIZE=str(n), DTM_TOKEN="bench", DTM_HOST=hosts.address(host),
                           GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                           TORCH_CPP_LOG_LEVEL="ERROR")  # (c10d warns that a namespace's peer has no hostname)
                procs.append(hosts.run(host, [sys.executable, __file__, "--worker", b, "--iters", str(args.iters),
                                              "--sizes", *args.sizes], dict(env), stdout=subprocess.PIPE, text=True))
            outs = [p.communicate(timeout=3600)[0] for p in procs]
            if any(p.returncode for p in procs):
                sys.exit(f"{b}: a rank failed (exit codes {[p.returncode for p in procs]})")
            line = next(x for x in outs[0].splitlines() if x.startswith("RESULT "))
            times[b] = {int(k): v for k, v in json.loads(line[7:]).items()}
    link = (args.hosts, rate_bytes(shape["rate"])) if "rate" in shape else None
    report("all_reduce", n, sizes, times, link)
    if args.record:
        layout = f"{args.hosts} hosts x {args.ranks_per_host} ranks, links {', '.join(shape.values()) or 'unshaped'}"
        record(args.record, "collectives", {"op": "all_reduce", "runs": [run_figures(n, times, layout)]}, draw)


def run_figures(n: int, times: dict[str, dict[int, float]], layout: str) -> dict:
    """One rank count's medians, as record() keeps them: (bytes, seconds) pairs per backend."""
    return {"ranks": n, "layout": layout, "times": {b: [[s, t] for s, t in ts.items()] for b, ts in times.items()}}


def draw(figures: dict, fig) -> None:
    """busbw (all_reduce) or algbw (send/recv) against the size from 1 KiB (the 8-byte row is
    latency), a panel per run, a line per backend."""
    all_reduce = figures["op"] == "all_reduce"
    axes = fig.subplots(1, len(figures["runs"]), squeeze=False)[0]
    for ax, run in zip(axes, figures["runs"]):
        n = run["ranks"]
        factor = 2 * (n - 1) / n if all_reduce else 2.0  # busbw; a ping-pong's round trip moves it twice
        series = {_label(b): [[s, factor * s / t / 1e9] for s, t in pairs if s >= 1024]
                  for b, pairs in run["times"].items()}
        sizes = [s for s, _ in next(iter(series.values()))]
        lines(ax, series, logx=True, xticks=[(s, show_size(s)) for s in sizes],
              title=f"{'all_reduce' if all_reduce else 'send/recv'} f32, {run['layout']}", xlabel="bytes",
              ylabel="busbw, GB/s" if all_reduce else "algbw, GB/s")


def _label(backend: str) -> str:
    """A backend's name in a plot: DTM's own named so, the peer and the floors as they are."""
    return backend if backend == "gloo" or backend.startswith("floor") else f"DTM {backend}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, help="bytes, with K/M/G suffixes")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--backends", nargs="+", default=None, choices=(*BACKENDS, *HOST_BACKENDS),
                    help="default: all (floor only measures all_reduce)")
    ap.add_argument("--iters", type=int, default=100, help="iterations at small sizes (fewer for large ones)")
    ap.add_argument("--chunk", type=parse_size, default=1 << 20, help="DTM's largest Data frame over TCP")
    ap.add_argument("--slot", type=parse_size, default=1 << 20, help="DTM's shared-memory slot per rank")
    ap.add_argument("--op", default="all_reduce", choices=["all_reduce", "sendrecv"])
    ap.add_argument("--hosts", type=int, default=None, help="measure across this many hosts (network namespaces)")
    ap.add_argument("--ranks-per-host", type=int, default=2)
    ap.add_argument("--link", default="10gbit", help="each host's link: RATE[,DELAY][,LOSS%%], e.g. 10gbit,50us")
    ap.add_argument("--record", metavar="DIR", help="keep the figures and their plot in DIR (record.py)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a rank of --hosts (run by it)
    args = ap.parse_args()
    if args.worker is not None:
        return hosts_worker(args.worker, [parse_size(s) for s in args.sizes], args.iters)
    if args.hosts is not None:
        if args.op != "all_reduce" or (args.backends and set(args.backends) - {"gloo", *HOST_BACKENDS}):
            ap.error("--hosts measures all_reduce of gloo, dtm and dtm-flat")
        return hosts_main(args)
    if args.op == "sendrecv" and any(n % 2 for n in args.ranks):
        ap.error("--op sendrecv pairs ranks 2k and 2k+1: give even rank counts")
    if args.backends is None:
        args.backends = [b for b in BACKENDS if b not in COMPRESSED and (not b.startswith("floor")
                                                                          or args.op == "all_reduce")]
    elif any(b.startswith("floor") for b in args.backends) and args.op != "all_reduce":
        ap.error("the floor backends measure all_reduce only")
    in_own_netns()
    sizes = [parse_size(s) for s in args.sizes]
    opts = {"chunk": args.chunk, "slot": args.slot, "op": args.op}
    if any(b.startswith("floor") for b in args.backends):  # built once here, loaded by each rank
        from dtm.comm.pump import FLAGS
        from dtm.toolchain import build
        opts["floor_library"] = str(build(FLOOR_SOURCE.read_text(), "tcp_floor", FLAGS))
    print(f"host: {os.cpu_count()} cores; {'own network namespace' if os.environ.get('DTM_BENCH_NETNS') else 'host'}"
          f" loopback; DTM chunk {show_size(args.chunk)}, shm slot {show_size(args.slot)}")
    runs = []
    for n in args.ranks:
        groups = {b: Group(b, n, opts) for b in args.backends}
        try:
            times = {b: {} for b in args.backends}
            for s in sizes:
                for b, g in groups.items():
                    times[b][s] = g.measure(s, iterations(s, args.iters))
            report(args.op, n, sizes, times)
            runs.append(run_figures(n, times, f"{n} ranks, one host"))
        finally:
            for g in groups.values():
                g.stop()
    if args.record:
        record(args.record, "collectives", {"op": args.op, "runs": runs}, draw)


if __name__ == "__main__":
    main()
