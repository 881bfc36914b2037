"""Matrix product throughput: DTM's cpu backend against numpy and torch, square f32 products.

Prints GFLOP/s (2*n^3 / time, best of several runs, the three libraries measured in turn,
ROUNDS times, so they see the same machine load) at each size, and DTM's ratio to each.
torch runs with torch.set_num_threads(THREADS); DTM's kernels use OpenMP with
OMP_NUM_THREADS (default: all cores); numpy uses whatever BLAS it was built with.

Goal (issue 15): DTM >= 0.95x the better of numpy and torch at 256, 1024 and 2048 (the
last column).

    python benchmarks/matmul.py [--sizes 256 1024 2048] [--threads 2] [--dtype f32] [--record DIR]

--record DIR keeps the figures and their plot (GFLOP/s against the size) in DIR (record.py).
"""

from __future__ import annotations

import argparse

import numpy as np

from dtm.ir import parse
from dtm.runtime.backend import get_backend
from record import lines, record
from timing import best_time


ROUNDS = 3  # each engine is timed this many times, the engines in turn; the best counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["f32", "f64"], default="f32")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds per measurement")
    ap.add_argument("--record", metavar="DIR", help="keep the figures and their plot in DIR (record.py)")
    args = ap.parse_args()
    try:
        import torch

        torch.set_num_threads(args.threads)
    except ImportError:  # pragma: no cover
        torch = None
    np_dtype = np.float32 if args.dtype == "f32" else np.float64
    cpu = get_backend("cpu")
    gflops: dict[str, list[list[float]]] = {}
    print(f"{'n':>6} {'dtm':>9} {'numpy':>9} {'torch':>9}   dtm/numpy dtm/torch  dtm/better   (GFLOP/s, {args.dtype})")
    for n in args.sizes:
        m = parse(f"dtm 1.0\n\nfunc @mm(%a: {args.dtype}[{n}, {n}], %b: {args.dtype}[{n}, {n}]) -> "
                  f"({args.dtype}[{n}, {n}]) {{\n  %c = matmul %a, %b : {args.dtype}[{n}, {n}]\n  return %c\n}}\n")
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((n, n)).astype(np_dtype), rng.standard_normal((n, n)).astype(np_dtype)
        plan = cpu.plan(m, "mm")
        got = plan.run([a, b])[0]
        err = np.abs(got - a @ b).max() / np.abs(a @ b).max()
        assert err < (1e-5 if np_dtype == np.float32 else 1e-12), err
        flop = 2.0 * n ** 3
        engines = {"dtm": lambda: plan.run([a, b]), "numpy": lambda: a @ b}
        if torch is not None:
            ta, tb = torch.from_numpy(a), torch.from_numpy(b)
            engines["torch"] = lambda: ta @ tb
        best = dict.fromkeys(engines, float("inf"))
        for _ in range(ROUNDS):  # in turn, so a slow spell of the machine is not one engine's alone
            for name, fn in engines.items():
                best[name] = min(best[name], best_time(fn, args.budget / ROUNDS))
        rates = {name: flop / t / 1e9 for name, t in best.items()}
        for name, rate in rates.items():
            gflops.setdefault(name, []).append([n, rate])
        t = rates.get("torch", float("nan"))
        print(f"{n:>6} {rates['dtm']:>9.1f} {rates['numpy']:>9.1f} {t:>9.1f}   "
              f"{rates['dtm'] / rates['numpy']:>9.2f} {rates['dtm'] / t:>9.2f} {rates['dtm'] / max(rates['numpy'], t):>11.2f}")
    if args.record:
        record(args.record, "matmul", {"dtype": args.dtype, "threads": args.threads, "gflops": gflops}, draw)


def draw(figures: dict, fig) -> None:
    """GFLOP/s against the size, a line per library."""
    names = {"dtm": "DTM cpu", "numpy": "numpy", "torch": "torch"}
    sizes = [n for n, _ in figures["gflops"]["dtm"]]
    lines(fig.subplots(), {names[k]: v for k, v in figures["gflops"].items()}, logx=True,
          xticks=[(n, str(n)) for n in sizes], title=f"square {figures['dtype']} matmul, {figures['threads']} threads",
          xlabel="n (an n x n by n x n product)", ylabel="GFLOP/s")


if __name__ == "__main__":
    main()
