"""What checking computed indices costs (issue 37): an embedding lookup whose ids the
program computes, as torch checks them and DTM now does too.

Three ways DTM meets such ids, each timed with and without its check, beside torch eager
doing the same lookup (torch checks every index inside its kernel):

- eager: `F.embedding(ids * 2, W)` realized; the ids are pending when recorded, so the
  program carries a `check` op (spec 3.15: a fallback step on the cpu backend).
- jit, hoisted: the same inside `dtm.jit` with ids an argument; the ids are a small
  function of arguments, so the check runs in numpy before each call (the program has none).
- jit, inside: ids from an argmax over a [T, 8192] argument; the check is in the program.

"Baseline" is, for eager, the same lookup with ids computed in numpy (known when recorded,
checked then); for jit, the same traced program with its checks taken out (a check op's
result replaced by its operand, no numpy check before the call): the difference is the
check's own cost. Prints microseconds per call and the ratio to torch.

Then nanoGPT's `get_batch` (issue 30): B windows of T tokens cut at random offsets from a
realized int64 tensor of 1M tokens and stacked, inputs and targets, as the script writes
it (`for i in ix`, `data[i:i + T]`); DTM does it in numpy at once, recording no program.

    python benchmarks/checks.py [--tokens 16] [--vocab 50257] [--dim 768] [--batch 12] [--block 64]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import dtm
import dtm.nn.functional as F
from dtm.ir.module import Func, Module, Op
from timing import best_time


def without_checks(module: Module) -> Module:
    """The module with every `check` removed: readers of its result read its operand."""
    f = module.funcs["main"]
    alias: dict = {}
    ops = []
    for op in f.ops:
        if op.name == "check":
            alias[op.results[0]] = alias.get(op.operands[0], op.operands[0])
        else:
            ops.append(Op(op.name, tuple(alias.get(v, v) for v in op.operands), op.attrs, op.results))
    out = Module()
    out.meshes = dict(module.meshes)
    out.funcs["main"] = Func(f.name, f.params, f.result_types, ops, [alias.get(v, v) for v in f.returns])
    return out


def timed_jit(fn, args: list, budget: float) -> tuple[float, float, int]:
    """Seconds per call of dtm.jit(fn): as it is, then with its checks taken out (the
    program's `check` ops and the numpy checks made before each call), and how many
    checks it has."""
    jitted = dtm.jit(fn)
    with_t = best_time(lambda: jitted(*args).numpy(), budget)
    traced, _ = jitted._trace(tuple(args))
    n = str(traced.module).count(" = check ") + len(traced.checks)
    traced.module, traced.checks = without_checks(traced.module), []
    without_t = best_time(lambda: jitted(*args).numpy(), budget)
    return with_t, without_t, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--budget", type=float, default=1.0, help="seconds per measurement")
    ap.add_argument("--batch", type=int, default=12, help="get_batch's B")
    ap.add_argument("--block", type=int, default=64, help="get_batch's T")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((args.vocab, args.dim)).astype(np.float32)
    ids = rng.integers(0, args.vocab // 2, args.tokens)
    scores = rng.standard_normal((args.tokens, 8192)).astype(np.float32)
    W, tW = dtm.tensor(w), torch.tensor(w)
    d_ids, t_ids = dtm.tensor(ids), torch.tensor(ids)
    d_scores, t_scores = dtm.tensor(scores), torch.tensor(scores)

    print(f"{'case':<16} {'dtm':>9} {'baseline':>9} {'torch':>9}  checks  check cost  dtm/torch  (us per call)")

    def row(name: str, with_t: float, without_t: float, torch_t: float, n: int) -> None:
        print(f"{name:<16} {with_t * 1e6:9.1f} {without_t * 1e6:9.1f} {torch_t * 1e6:9.1f}  {n:6d} "
              f"{(with_t - without_t) * 1e6:8.1f} us {torch_t / with_t:9.2f}x")

    eager = best_time(lambda: F.embedding(d_ids * 2, W).numpy(), args.budget)
    eager_bare = best_time(lambda: F.embedding(dtm.tensor(ids * 2), W).numpy(), args.budget)
    torch_eager = best_time(lambda: torch.nn.functional.embedding(t_ids * 2, tW).numpy(), args.budget)
    row("eager", eager, eager_bare, torch_eager, 1)

    hoisted, hoisted_bare, n = timed_jit(lambda i: F.embedding(i * 2, W), [d_ids], args.budget)
    row("jit, hoisted", hoisted, hoisted_bare, torch_eager, n)

    inside, inside_bare, n = timed_jit(lambda s: F.embedding(s.argmax(-1) * 2, W), [d_scores], args.budget)
    torch_inside = best_time(lambda: torch.nn.functional.embedding(t_scores.argmax(-1) * 2, tW).numpy(), args.budget)
    row("jit, inside", inside, inside_bare, torch_inside, n)

    tokens = rng.integers(0, args.vocab, 1_000_000)
    B, T = args.batch, args.block

    def get_batch(M, data):
        ix = M.randint(len(data) - T, (B,))
        x = M.stack([data[i:i + T] for i in ix])
        y = M.stack([data[i + 1:i + 1 + T] for i in ix])
        return x.numpy(), y.numpy()

    d_data, t_data = dtm.tensor(tokens).realize(), torch.tensor(tokens)
    dtm_t = best_time(lambda: get_batch(dtm, d_data), args.budget)
    torch_t = best_time(lambda: get_batch(torch, t_data), args.budget)
    print(f"\nget_batch B={B} T={T}: dtm {dtm_t * 1e6:.1f} us, torch {torch_t * 1e6:.1f} us per call, "
          f"dtm/torch {torch_t / dtm_t:.2f}x")


if __name__ == "__main__":
    main()
