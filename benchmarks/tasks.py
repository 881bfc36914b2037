"""Task-graph overhead against peers, in one run (issue 18): N trivial tasks in two shapes,
a chain (each task after the one before) and a fan-out (one root, N-1 tasks after it).

* `store add`: each task reads a 4-element f32 key, adds one, writes the next key, on one
  memory:// store. DTM runs it as a task (a jitted function on dtm Tensors); Dask's
  threads scheduler runs a delayed function doing the same get_array + add + put_array on
  the same store.
* `no-op`: tasks with no inputs or outputs that do nothing: the scheduler's own cost per
  task, which is what the "under 50 us per task" goal is about.
* Dask's processes scheduler and Ray (`@ray.remote`) run in other processes, which a
  memory:// store does not reach: they pass the arrays as their own objects instead (their
  best case) and are timed on `--peer-tasks` tasks, as they are far slower per task.
* `process no-op`: `--process-tasks` independent no-op `process=True` tasks on a store in
  /dev/shm against the same no-ops on a `concurrent.futures.ProcessPoolExecutor`, each
  timed on its first run (workers starting) and on warm workers.
* `DTM on Ray`: DTM's own Ray backend (`backend="ray"`) on a directory store, timed on
  `--peer-tasks` tasks: Ray's cost per task plus a store read and write in its worker;
  beside it DTM's threads on the same kind of store (its fsynced puts dominate a store add).

Ratios are peer time per task / DTM's: above 1.0, DTM is faster. A peer that is not
installed is skipped with a message (`pip install 'dtm[bench]'`). Run Ray in a
loopback-only namespace: unshare -n sh -c 'ip link set lo up && exec "$@"' sh python benchmarks/tasks.py

    python benchmarks/tasks.py                 # about a minute
    python benchmarks/tasks.py --tasks 2000    # a quick run
    python benchmarks/tasks.py --only-process  # process=True against ProcessPoolExecutor
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])  # Ray's workers import dtm
import dtm  # noqa: E402


def add_one(a):
    return a + 1


def nothing():
    return None


def dtm_graph(st, n: int, shape: str, noop: bool) -> dtm.tasks.Graph:
    g = dtm.tasks.Graph(st)
    root = g.task(nothing, name="root") if noop else g.task(add_one, ["x/0"], ["x/1"])
    prev = root
    for i in range(1, n):
        after = [prev if shape == "chain" else root]
        if noop:
            prev = g.task(nothing, after=after, name=f"t{i}")
        else:
            src = f"x/{i}" if shape == "chain" else "x/1"
            prev = g.task(add_one, [src], [f"x/{i + 1}"], after=after)
    return g


def time_dtm(n: int, shape: str, noop: bool, workers: int) -> float:
    st = dtm.store.open(f"memory://bench-tasks-{uuid.uuid4().hex}")
    st.put("x/0", np.zeros(4, np.float32))
    dtm_graph(st, 2, shape, noop).run(workers=workers).wait(timeout=60)  # trace + build outside the timing
    g = dtm_graph(st, n, shape, noop)
    t = time.perf_counter()
    g.run(workers=workers).wait(timeout=600)
    dt = time.perf_counter() - t
    if not noop:
        want = n if shape == "chain" else 2
        assert st.get_array(f"x/{n}")[0] == want, "wrong result"
    st.close()
    return dt / n


def time_dask_threads(n: int, shape: str, noop: bool, workers: int) -> float:
    import dask

    st = dtm.store.open(f"memory://bench-dask-{uuid.uuid4().hex}")
    st.put("x/0", np.zeros(4, np.float32))

    def step(src: str, dst: str, _after=None) -> None:
        st.put_array(dst, st.get_array(src) + 1)

    def noop_step(_after=None) -> None:
        return None

    graph, root = {}, "t0"
    graph[root] = (noop_step,) if noop else (step, "x/0", "x/1")
    for i in range(1, n):
        dep = f"t{i - 1}" if shape == "chain" else root
        if noop:
            graph[f"t{i}"] = (noop_step, dep)
        else:
            src = f"x/{i}" if shape == "chain" else "x/1"
            graph[f"t{i}"] = (step, src, f"x/{i + 1}", dep)
    t = time.perf_counter()
    dask.threaded.get(graph, list(graph), num_workers=workers)
    dt = time.perf_counter() - t
    st.close()
    return dt / n


def native_graph(n: int, shape: str, noop: bool) -> dict:
    """Arrays as the engine's own objects: for schedulers in other processes."""
    graph = {"t0": (nothing,) if noop else (add_one, np.zeros(4, np.float32))}
    for i in range(1, n):
        dep = f"t{i - 1}" if shape == "chain" else "t0"
        graph[f"t{i}"] = (_noop_after, dep) if noop else (add_one, dep)
    return graph


def _noop_after(_dep):
    return None


def time_dask_processes(n: int, shape: str, noop: bool, workers: int) -> float:
    import dask.multiprocessing

    graph = native_graph(n, shape, noop)
    t = time.perf_counter()
    dask.multiprocessing.get(graph, list(graph), num_workers=workers,
                             optimize_graph=False)  # its chain fusion nests every call: too deep to pickle
    return (time.perf_counter() - t) / n


def time_ray(n: int, shape: str, noop: bool, workers: int) -> float:
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    add = ray.remote(add_one)
    after = ray.remote(_noop_after)
    root = ray.remote(nothing).remote() if noop else add.remote(np.zeros(4, np.float32))
    ray.get(after.remote(root))  # workers up before the timing
    t = time.perf_counter()
    root = ray.remote(nothing).remote() if noop else add.remote(np.zeros(4, np.float32))
    refs, prev = [root], root
    for _ in range(1, n):
        dep = prev if shape == "chain" else root
        prev = after.remote(dep) if noop else add.remote(dep)
        refs.append(prev)
    ray.get(refs)
    return (time.perf_counter() - t) / n


def time_dtm_dir(n: int, shape: str, noop: bool, workers: int, backend: str = "local") -> float:
    """The same graph on a directory store (its puts are fsynced: most of a store add's time
    there), on DTM's threads or its own Ray backend (graph.run(backend="ray"): each task a
    Ray task whose worker opens the store and imports the function by name, so from this
    file as the module `benchmarks.tasks`)."""
    import benchmarks.tasks as named  # this file under an importable name: Ray workers import it

    if backend == "ray":
        import ray

        if not ray.is_initialized():
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as d, dtm.store.open(d) as st:
        st.put("x/0", np.zeros(4, np.float32))
        named.dtm_graph(st, 2, shape, noop).run(workers=workers, backend=backend).wait(timeout=120)  # warm up
        g = named.dtm_graph(st, n, shape, noop)
        t = time.perf_counter()
        g.run(workers=workers, backend=backend).wait(timeout=600)
        dt = time.perf_counter() - t
        if not noop:
            assert st.get_array(f"x/{n}")[0] == (n if shape == "chain" else 2), "wrong result"
    return dt / n


def shm_dir() -> str | None:
    """/dev/shm where it exists: a store whose syncs cost nothing, so process tasks time the
    workers' own overhead."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def time_dtm_process(n: int, workers: int) -> tuple[float, float]:
    """`n` independent no-op `process=True` tasks on a store in /dev/shm, per task: the first
    run (its workers start: each a fork of the fork server) and a second run over
    the same store (the workers the first gave back)."""
    import benchmarks.tasks as named  # the workers import `nothing` from this file by that name

    times = []
    with tempfile.TemporaryDirectory(dir=shm_dir()) as d, dtm.store.open(d) as st:
        for _ in range(2):
            g = dtm.tasks.Graph(st)
            for i in range(n):
                g.task(named.nothing, process=True, name=f"t{i}")
            t = time.perf_counter()
            g.run(workers=workers, progress=False).wait(timeout=600)
            times.append((time.perf_counter() - t) / n)
    return times[0], times[1]


def time_process_pool(n: int, workers: int) -> tuple[float, float]:
    """The same no-ops on a ProcessPoolExecutor, per task: with its start (forked workers)
    and on its warm workers."""
    from concurrent.futures import ProcessPoolExecutor

    times = []
    with ProcessPoolExecutor(workers) as ex:
        for _ in range(2):
            t = time.perf_counter()
            for f in [ex.submit(nothing) for _ in range(n)]:
                f.result()
            times.append((time.perf_counter() - t) / n)
    return times[0], times[1]


def compare_process_tasks(n: int, workers: int) -> None:
    ours, theirs = time_dtm_process(n, workers), time_process_pool(n, workers)
    print(f"process no-op ({n} independent tasks, store in {shm_dir() or 'a temporary directory'}):")
    for what, a, b in (("first run", ours[0], theirs[0]), ("warm workers", ours[1], theirs[1])):
        print(f"  {what:<13} DTM process=True {a * 1e3:7.3f} ms  ProcessPoolExecutor {b * 1e3:7.3f} ms  "
              f"ratio {b / a:5.2f}")


def peer(name: str, module: str, fn: Callable[..., float], *args) -> float | None:
    try:
        __import__(module)
    except ImportError:
        print(f"  {name:<22} skipped: {module} is not installed (pip install 'dtm[bench]')")
        return None
    return fn(*args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=10_000)
    ap.add_argument("--peer-tasks", type=int, default=2_000, help="tasks for the peers in other processes")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--process-tasks", type=int, default=1_000, help="no-op process=True tasks")
    ap.add_argument("--only-process", action="store_true", help="only process=True against ProcessPoolExecutor")
    args = ap.parse_args()
    n, w = args.tasks, args.workers
    compare_process_tasks(args.process_tasks, w)
    if args.only_process:
        return
    print(f"{n} tasks ({args.peer_tasks} for peers in other processes), {w} workers; "
          "us/task (tasks/s); ratio = peer / DTM")
    for shape in ("chain", "fan-out"):
        for noop in (True, False):
            what = "no-op" if noop else "store add"
            ours = time_dtm(n, shape, noop, w)
            print(f"{shape} {what}:")
            print(f"  {'DTM (threads)':<22} {ours * 1e6:8.1f} us  ({1 / ours:9.0f}/s)")
            peers = [("Dask threads", "dask", time_dask_threads, n)]
            peers += [("Dask processes", "dask", time_dask_processes, args.peer_tasks),
                      ("Ray @ray.remote", "ray", time_ray, args.peer_tasks),
                      ("DTM threads, dir store", "dtm", time_dtm_dir, args.peer_tasks),
                      ("DTM on Ray, dir store", "ray", lambda *a: time_dtm_dir(*a, backend="ray"), args.peer_tasks)]
            for name, module, fn, count in peers:
                theirs = peer(name, module, fn, count, shape, noop, w)
                if theirs is not None:
                    print(f"  {name:<22} {theirs * 1e6:8.1f} us  ({1 / theirs:9.0f}/s)  ratio {theirs / ours:6.2f}")


if __name__ == "__main__":
    main()
