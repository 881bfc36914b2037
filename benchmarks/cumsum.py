"""Running sums: DTM's cpu backend against torch and numpy, f32 cumsum.

Prints milliseconds per call (best of several runs, the engines measured in turn, ROUNDS
times, so they see the same machine load) and DTM's ratio to torch (time of torch / time of
DTM: above 1 is faster). DTM and torch both add left to right in double, so their results
are equal to the bit (checked); numpy adds in f32.

Shapes: a vector of N elements (one sequential loop) and an [R, N / R] matrix along each
dim (rows in parallel; down the columns, blocks of columns vectorised).

Goal (issue 37): DTM >= 0.5x torch on a vector of 2e7 elements.

    python benchmarks/cumsum.py [--n 20000000] [--rows 2000] [--threads 2]
"""

from __future__ import annotations

import argparse

import numpy as np

from dtm.ir import parse
from dtm.runtime.backend import get_backend
from timing import best_time

ROUNDS = 3  # each engine is timed this many times, the engines in turn; the best counts


def plan_for(shape: tuple[int, ...], axis: int):
    """The cpu backend's plan of one cumsum along `axis` of an f32 tensor of `shape`."""
    t = f"f32[{', '.join(map(str, shape))}]"
    m = parse(f"dtm 1.0\n\nfunc @f(%x: {t}) -> ({t}) {{\n  %y = cumsum %x {{axis = {axis}}} : {t}\n"
              f"  return %y\n}}\n")
    return get_backend("cpu").plan(m, "f")


def measure(shape: tuple[int, ...], axis: int, budget: float, torch) -> dict[str, float]:
    """Seconds per call of each engine, after checking DTM against torch bit for bit."""
    x = np.random.default_rng(0).random(shape, dtype=np.float32)
    plan = plan_for(shape, axis)
    tx = torch.from_numpy(x)
    np.testing.assert_array_equal(plan.run([x])[0], tx.cumsum(axis).numpy())
    engines = {"dtm": lambda: plan.run([x]), "torch": lambda: tx.cumsum(axis), "numpy": lambda: np.cumsum(x, axis)}
    best = dict.fromkeys(engines, float("inf"))
    for _ in range(ROUNDS):  # in turn, so a slow spell of the machine is not one engine's alone
        for name, fn in engines.items():
            best[name] = min(best[name], best_time(fn, budget / ROUNDS))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20_000_000, help="elements of each tensor")
    ap.add_argument("--rows", type=int, default=2000, help="rows of the matrix shapes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=float, default=2.0, help="seconds per measurement")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    cases = [((args.n,), 0), ((args.rows, args.n // args.rows), 1), ((args.rows, args.n // args.rows), 0)]
    print(f"{'shape':>16} {'dim':>4} {'dtm':>9} {'torch':>9} {'numpy':>9}   dtm/torch   (ms per call, f32)")
    for shape, axis in cases:
        t = measure(shape, axis, args.budget, torch)
        print(f"{str(list(shape)):>16} {axis:>4} {t['dtm'] * 1e3:>9.2f} {t['torch'] * 1e3:>9.2f} "
              f"{t['numpy'] * 1e3:>9.2f}   {t['torch'] / t['dtm']:>9.2f}x")


if __name__ == "__main__":
    main()
