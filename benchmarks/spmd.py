"""SPMD on the in-process devices (runtime L0): a tensor-parallel MLP on 2 devices against
1 device, and the redistributions against a plain copy of the same bytes.

1. MLP y = gelu(x @ W1) @ W2, x [batch, d], W1 [d, hidden], W2 [hidden, d] (Megatron's
   split on 2 devices: W1 by columns, W2 by rows, one all_reduce), f32. Every kernel is
   single-threaded (OMP_NUM_THREADS=1, set before DTM loads), so 1 device uses one core and
   2 devices two. Both run as dtm.jit functions (traced once, replayed); prints the time
   per call and the speedup. Goal (issue 5): >= 1.6x on 2 cores.
2. Each redistribution of a 64 MiB f32 tensor on 2 devices (Partial->Replicate: all_reduce,
   Partial->Shard: reduce_scatter, Shard->Replicate: all_gather, Shard(0)->Shard(1):
   all_to_all), a whole realize each (capture, cached partition and plan, the run), against
   np.copyto of the same 64 MiB on one core.

    python benchmarks/spmd.py [--batch 64] [--d 1024] [--hidden 4096] [--mib 64]
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before libgomp loads: one thread per device

import argparse  # noqa: E402
import threading  # noqa: E402

import numpy as np  # noqa: E402

import dtm  # noqa: E402
from dtm import Partial, Replicate, Shard  # noqa: E402
from dtm.ir.registry import COLLECTIVES  # noqa: E402
from timing import best_time  # noqa: E402



def free_cores(budget: float) -> float:
    """The control: how much faster two threads of GIL-free numpy work finish than one does
    the same work twice. About 2 on two idle cores; less when other programs share them, and
    the MLP's speedup can be no better."""
    a = np.random.default_rng(0).standard_normal(1 << 20)

    def work():
        np.sin(a)

    def two():
        threads = [threading.Thread(target=work) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return 2 * best_time(work, budget) / best_time(two, budget)


def mlp_speedup(batch: int, d: int, hidden: int, budget: float) -> None:
    rng = np.random.default_rng(0)
    x = dtm.tensor(rng.standard_normal((batch, d)).astype(np.float32))
    w1 = dtm.tensor((rng.standard_normal((d, hidden)) / np.sqrt(d)).astype(np.float32))
    w2 = dtm.tensor((rng.standard_normal((hidden, d)) / np.sqrt(hidden)).astype(np.float32))

    def mlp(x, w1, w2):
        return dtm.nn.functional.gelu(x @ w1) @ w2

    one = dtm.jit(mlp)
    want = one(x, w1, w2).numpy()
    t1 = best_time(lambda: one(x, w1, w2).numpy(), budget)

    mesh = dtm.Mesh({"tp": 2})
    xs = dtm.distribute(x, mesh, [Replicate()])
    w1s, w2s = dtm.distribute(w1, mesh, [Shard(1)]), dtm.distribute(w2, mesh, [Shard(0)])
    two = dtm.jit(lambda x, a, b: mlp(x, a, b).redistribute([Replicate()]))
    got = two(xs, w1s, w2s)
    assert np.allclose(got.numpy(), want, rtol=1e-4, atol=1e-4), "the tensor-parallel MLP differs"
    n_ar = str(two.ir(xs, w1s, w2s, view="local", rank=0)).count("all_reduce")
    t2 = best_time(lambda: two(xs, w1s, w2s).local_shards(), budget)
    gflop = 2 * 2 * batch * d * hidden / 1e9
    print(f"MLP x[{batch}, {d}] @ [{d}, {hidden}] @ [{hidden}, {d}], f32, single-threaded kernels "
          f"({n_ar} all_reduce per call)")
    print(f"  1 device : {t1 * 1e3:8.2f} ms  ({gflop / t1:6.1f} GFLOP/s)")
    print(f"  2 devices: {t2 * 1e3:8.2f} ms  ({gflop / t2:6.1f} GFLOP/s)   speedup {t1 / t2:.2f}x (goal >= 1.6x)")


def redistributions(mib: int, budget: float) -> None:
    n = mib * (1 << 20) // 4
    rows = 2048
    shape = (rows, n // rows)
    a = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    dst = np.empty_like(a)
    t_copy = best_time(lambda: np.copyto(dst, a), budget)
    mesh = dtm.Mesh({"x": 2})
    cases = [("Partial -> Replicate", Partial("sum"), Replicate()),
             ("Partial -> Shard(0)", Partial("sum"), Shard(0)),
             ("Shard(0) -> Replicate", Shard(0), Replicate()),
             ("Shard(0) -> Shard(1)", Shard(0), Shard(1))]
    print(f"\nredistribution of f32{list(shape)} ({mib} MiB) on 2 devices; numpy copy of {mib} MiB: "
          f"{t_copy * 1e3:.2f} ms")
    for name, src, dst_p in cases:
        t = dtm.distribute(dtm.tensor(a), mesh, [src])
        t.realize()
        got = t.redistribute([dst_p])
        assert np.allclose(got.numpy(), a, rtol=1e-6, atol=1e-6), name
        local = dtm.jit(lambda t: t.redistribute([dst_p])).ir(t, view="local", rank=0).funcs["main"]
        coll = ", ".join(op.name for op in local.ops if op.name in COLLECTIVES)  # what the partitioner chose
        sec = best_time(lambda: t.redistribute([dst_p]).realize(), budget)
        print(f"  {name:<22} {coll:<15} {sec * 1e3:8.2f} ms   {sec / t_copy:5.2f}x the copy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--budget", type=float, default=2.0, help="seconds per measurement")
    args = ap.parse_args()
    dtm.devices(2)
    print(f"control: two numpy threads do {free_cores(args.budget / 2):.2f}x the work of one (2.0: two idle cores)")
    mlp_speedup(args.batch, args.d, args.hidden, args.budget)
    redistributions(args.mib, args.budget)


if __name__ == "__main__":
    main()
