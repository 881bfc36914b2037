"""Matrix-vector products on narrow weights: GB/s of weights read, against memory bandwidth.

For a 768x3072 and a 3072x768 weight (a Linear's [out, in], GPT-2's c_fc and mlp c_proj),
x [1, in] @ W^T in f32, bf16, q8_0 and q4_0, compiled by DTM (dtm/backends/cpu/c_narrow.py
for the narrow ones): microseconds per product (best of --runs timings of --reps products
each) and the weight bytes it reads per second. The limit is memory bandwidth (ANCHORS.md:
~23 GB/s read+write traffic on the 2-core EPYC, 11.4 GB/s for a numpy copy), measured here
as a numpy copy of 256 MiB. The weights (2.4 M elements: 9.4 MB f32, 2.5 MB q8_0) fit in
a large L3 only partly; the product cycles through 8 weights so that each one is read from
memory, not cache.

    python benchmarks/quant.py [--runs 5] [--reps 50]
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from timing import best_of

SHAPES = ((768, 3072), (3072, 768))
DTYPES = ("f32", "bf16", "q8_0", "q4_0")
COPIES = 8  # weights cycled through: 8 x 2.5-9.4 MB, more than the caches hold


def copy_bandwidth() -> float:
    """GB/s of a 256 MiB numpy copy, counting bytes read + written."""
    a = np.ones(64 << 20, np.float32)
    b = np.empty_like(a)
    t = best_of(lambda: np.copyto(b, a), 3)
    return 2 * a.nbytes / t / 1e9


def product(dtype: str, n: int, k: int):
    """(call, weight bytes per product): x @ W^T on one of COPIES weights, in turn."""
    import dtm
    from dtm import functional as F
    from dtm.ir.dtypes import DTYPES as ALL
    from dtm.ir.types import TensorType

    rng = np.random.default_rng(0)
    steps = []
    for _ in range(COPIES):
        w = rng.standard_normal((n, k), dtype=np.float32) * 0.02
        if dtype == "f32":
            t = dtm.tensor(w)
            steps.append(dtm.jit(lambda x, t=t: F.linear(x, t)))
        else:
            t = dtm.Tensor(TensorType(ALL[dtype], (n, k)), buffer=dtm.quant.quantize_weight(w, dtype))
            steps.append(dtm.jit(lambda x, t=t: F.linear(x, F.cast(t, dtm.float32))))
    nbytes = n * k * {"f32": 4, "bf16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32}[dtype]
    x = dtm.tensor(rng.standard_normal((1, k), dtype=np.float32))
    for s in steps:
        s(x)  # trace and build
    state = {"i": 0}

    def call():
        s = steps[state["i"] % COPIES]
        state["i"] += 1
        return s(x)

    return call, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"matrix-vector products x[1, in] @ W^T, {os.cpu_count()} cores; numpy copy {bw:.1f} GB/s (read+write)")
    print(f"{'W [out, in]':>12} {'dtype':>6} {'MB':>7} {'us':>9} {'GB/s':>7} {'of copy':>8} {'vs f32':>7}")
    for n, k in SHAPES:
        base = None
        for dtype in DTYPES:
            call, nbytes = product(dtype, n, k)
            t = best_of(lambda: [call() for _ in range(args.reps)], args.runs) / args.reps
            base = base or t
            gbs = nbytes / t / 1e9
            print(f"{f'{n}x{k}':>12} {dtype:>6} {nbytes / 1e6:7.2f} {t * 1e6:9.1f} {gbs:7.1f} {gbs / bw:7.0%} "
                  f"{base / t:6.2f}x")
    print("each time includes the call from Python (~10-20 us of dispatch): GB/s is a lower bound")


if __name__ == "__main__":
    main()
