"""In-memory snapshots (issue 31's goal: a snapshot of the char model's state under 10% of
its training step): the char model of train.py (4 layers, 128 wide, batch 16, context 64)
trained with DDP over 2 processes, AdamW. Printed per rank: the median time of a training
step without snapshots and of a step followed by a snapshot (the two kinds in alternating
blocks of 5 steps, against the drift of a busy machine), and of the call
`dtm.checkpoint.snapshot` of {model, optimizer, step} with replicas=1 (each rank's pieces
copied, then put on the other rank on a background thread while the next step runs; the
call also completes the snapshot before it).

    python benchmarks/snapshot.py [--steps 30] [--warmup 3] [--jit]

(It starts its own `dtm launch -n 2` of itself.)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve()
BLOCK = 5  # steps with snapshots and steps without alternate in blocks of this many


def rank_main(args) -> None:
    import dtm
    from gpt2 import random_weights  # this folder is on sys.path when run as a script
    from train import LR, MODELS, dtm_model, dtm_train_step

    pg = dtm.init(timeout=120, op_timeout=120)
    fields, batch, context = MODELS["char"]
    mesh = dtm.Mesh({"dp": 2})
    model = dtm.parallel.DDP(dtm_model(fields, random_weights(**fields)), mesh, axis="dp")
    model.train()
    opt = dtm.optim.AdamW(model.parameters(), lr=LR)
    step = dtm_train_step(model, opt, fields["vocab_size"])
    run = dtm.jit(step) if args.jit else step
    rng = np.random.default_rng(pg.rank)

    def train(n: int, snapshot: bool) -> tuple[list[float], list[float]]:
        """n steps (each followed by a snapshot when `snapshot`): each one's time, and each
        snapshot call's."""
        steps, snaps, last = [], [], None
        for _ in range(n):
            d = rng.integers(0, fields["vocab_size"], (batch // 2, context + 1))
            t0 = time.perf_counter()
            run(dtm.tensor(d[:, :-1]), dtm.tensor(d[:, 1:])).item()
            t1 = time.perf_counter()
            if snapshot:
                last = dtm.checkpoint.snapshot({"model": model, "optim": opt, "step": len(steps)}, replicas=1)
            steps.append(t1 - t0)
            snaps.append(time.perf_counter() - t1)
        if last is not None:
            last.wait()  # (each snapshot completed the one before it)
        return steps, snaps

    train(args.warmup, True)
    plain, with_steps, with_snaps = [], [], []
    for _ in range(-(-args.steps // BLOCK)):  # blocks of each kind in turn: the machine's drift on both
        plain += train(BLOCK, False)[0]
        a, b = train(BLOCK, True)
        with_steps += a
        with_snaps += b
    base = statistics.median(plain)
    total = statistics.median([a + b for a, b in zip(with_steps, with_snaps)])
    nbytes = importlib.import_module("dtm.ckpt.snapshot").find().doc["bytes"]  # every tensor of the state
    print("RESULT " + json.dumps({"rank": pg.rank, "step_ms": 1e3 * base, "with_ms": 1e3 * total,
                                  "snapshot_ms": 1e3 * statistics.median(with_snaps), "state_mb": nbytes / 2**20}),
          flush=True)
    dtm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--jit", action="store_true", help="the training step under dtm.jit")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        return rank_main(args)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent.parent), str(HERE.parent)]),
               DTM_HOST="127.0.0.1")
    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", "2", str(HERE), "--rank", "--steps", str(args.steps),
           "--warmup", str(args.warmup)] + (["--jit"] if args.jit else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    rows = [json.loads(line.split("RESULT ", 1)[1]) for line in out.stdout.splitlines() if "RESULT " in line]
    if out.returncode or len(rows) != 2:
        sys.exit(f"the run failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    print(f"char model, DDP over 2 processes, {'dtm.jit' if args.jit else 'eager'}, "
          f"state {rows[0]['state_mb']:.1f} MiB (weights + AdamW), median of {args.steps} steps:")
    for r in sorted(rows, key=lambda r: r["rank"]):
        print(f"  rank {r['rank']}: step {r['step_ms']:.1f} ms without snapshots, {r['with_ms']:.1f} ms with one "
              f"after each ({100 * (r['with_ms'] / r['step_ms'] - 1):+.1f}%); the snapshot call "
              f"{r['snapshot_ms']:.2f} ms ({100 * r['snapshot_ms'] / r['step_ms']:.1f}% of the step)")


if __name__ == "__main__":
    main()
