"""IR throughput: parse, verify, format, hash, encode and decode a generated module of
20,000 ops (a stack of transformer-like blocks with symbolic batch and sequence dims and
sharding annotations), printing ops per second for each step, the best of several runs.

Goal (issue 2): parse + verify >= 100,000 ops/s.

    python benchmarks/ir_bench.py [--ops 20000] [--runs 5]
"""

from __future__ import annotations

import argparse
import gc
import time

from dtm import ir

GOAL_PARSE_VERIFY = 100_000


def block(i: int, x: str) -> list[str]:
    """One transformer-style block: 16 ops on f32[B, T, 768] with its weights as parameters."""
    p = f"%b{i}_"
    return [
        f"  {p}ln = layer_norm {x}, %g, %beta {{eps = 1e-05}} : f32[B, T, 768]",
        f"  {p}q = matmul {p}ln, %wq : f32[B, T, 768]",
        f"  {p}k = matmul {p}ln, %wk : f32[B, T, 768]",
        f"  {p}v = matmul {p}ln, %wv : f32[B, T, 768]",
        f"  {p}q4 = reshape {p}q {{shape = [B, T, 12, 64]}} : f32[B, T, 12, 64]",
        f"  {p}k4 = reshape {p}k {{shape = [B, T, 12, 64]}} : f32[B, T, 12, 64]",
        f"  {p}v4 = reshape {p}v {{shape = [B, T, 12, 64]}} : f32[B, T, 12, 64]",
        f"  {p}qh = permute {p}q4 {{perm = [0, 2, 1, 3]}} : f32[B, 12, T, 64]",
        f"  {p}kh = permute {p}k4 {{perm = [0, 2, 1, 3]}} : f32[B, 12, T, 64]",
        f"  {p}vh = permute {p}v4 {{perm = [0, 2, 1, 3]}} : f32[B, 12, T, 64]",
        f"  {p}att = scaled_dot_product_attention {p}qh, {p}kh, {p}vh {{causal = true}} : f32[B, 12, T, 64]",
        f"  {p}ap = permute {p}att {{perm = [0, 2, 1, 3]}} : f32[B, T, 12, 64]",
        f"  {p}a = reshape {p}ap {{shape = [B, T, 768]}} : f32[B, T, 768]",
        f"  {p}o = matmul {p}a, %wo : f32[B, T, 768] @m[shard(0), partial(sum)]",
        f"  {p}r = all_reduce {p}o {{axes = [\"tp\"], mesh = @m}} : f32[B, T, 768]",
        f"  {p}y = add {x}, {p}r : f32[B, T, 768]",
    ]


def generate(n_ops: int) -> str:
    lines = ["dtm 1.0", "", "mesh @m[dp = 2, tp = 2]", "",
             "func @net(%x: f32[B, T, 768] @m[shard(0), replicate], %g: f32[768], %beta: f32[768], "
             "%wq: f32[768, 768], %wk: f32[768, 768], %wv: f32[768, 768], %wo: f32[768, 768]) -> (f32[B, T, 768]) {"]
    x = "%x"
    for i in range(n_ops // 16):
        lines += block(i, x)
        x = f"%b{i}_y"
    lines += [f"  return {x}", "}", ""]
    return "\n".join(lines)


def timed(fn, runs: int) -> float:
    """Best seconds of `runs` calls (as timeit advises: slower runs measure the other load
    on the machine, not the code). As timeit does, the cyclic garbage collector is run
    before and kept off during each call, so one step does not pay for collecting the
    previous step's 300,000 objects."""
    times = []
    for _ in range(runs):
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - t0)
            del result  # freeing the module is not part of the step
        finally:
            gc.enable()
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=20_000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    text = generate(args.ops)
    module = ir.verify(ir.parse(text))
    n = sum(len(f.ops) for f in module.funcs.values())
    blob = ir.encode(module)
    steps = {
        "parse": lambda: ir.parse(text),
        "verify": lambda: ir.verify(module),
        "parse+verify": lambda: ir.verify(ir.parse(text)),
        "format": lambda: ir.format(module),
        "hash": lambda: module.hash(),
        "encode": lambda: ir.encode(module),
        "decode": lambda: ir.decode(blob),
    }
    print(f"module: {n} ops, {len(text) / 1e6:.2f} MB of text, {len(blob) / 1e6:.2f} MB encoded; "
          f"best of {args.runs} runs")
    print(f"{'step':14} {'seconds':>9} {'ops/s':>12}")
    results = {}
    for name, fn in steps.items():
        s = timed(fn, args.runs)
        results[name] = n / s
        print(f"{name:14} {s:9.4f} {n / s:12,.0f}")
    ratio = results["parse+verify"] / GOAL_PARSE_VERIFY
    print(f"parse+verify: {results['parse+verify']:,.0f} ops/s = {ratio:.2f}x the goal of {GOAL_PARSE_VERIFY:,} ops/s")


if __name__ == "__main__":
    main()
