"""Data parallel training against one process, and against torch's DDP, in the same run
(issue 34's goal: a DP=2 GPT-2 124M step over 2 processes within 1.2x of the
single-process step time, the processes given half the batch each).

One step: forward, cross-entropy, backward, gradient clipping to norm 1, AdamW (the step of
benchmarks/train.py, the same weights and batches). Per engine:
- one process: the whole batch, all cores (OpenMP / torch threads: one per core);
- DP=2: two processes of one thread each (two cores), each computing half of the batch,
  the gradients all-reduced: DTM's `dtm.parallel.DDP` under `dtm launch -n 2` with the
  whole step under `dtm.jit` (every rank is given the global batch, as DTM's global view
  has it, and keeps its rows); torch's `DistributedDataParallel` over gloo (eager, each
  rank given its half), started with the environment torchrun gives, in a network
  namespace with only loopback.
Printed: each one's median step, and DP=2 / one process per engine (1.0: the gradients'
exchange costs nothing; the goal is at most 1.2), with the first step's loss of each (the
runs agree; torch's DP=2 loss is the mean of its two halves').

    python benchmarks/ddp.py [--model char|gpt2] [--steps 10] [--warmup 2] [--engines dtm torch]

(It starts its own processes of itself with --worker.)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
from train import CLIP, LR, MODELS, dtm_model, dtm_train_step, hf_model, weights_and_batches  # noqa: E402

PORT = 29531  # torch's rendezvous, inside a network namespace of its own
NETNS = 'ip link set lo up && exec "$@"'


def worker(engine: str, model: str, steps: int, warmup: int) -> None:
    """One process of a run (DTM_RANK / RANK and the world size in the environment; one
    process alone without them): its step times and the first loss, as a RESULT line."""
    weights, batches = weights_and_batches(model, steps + warmup)
    world = int(os.environ.get("DTM_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
    if engine == "dtm":
        import dtm

        pg = dtm.init() if world > 1 else None
        rank = pg.rank if pg is not None else 0
        m = dtm_model(MODELS[model][0], weights)
        m.train()
        net = dtm.parallel.DDP(m, dtm.Mesh({"dp": world})) if world > 1 else m
        opt = dtm.optim.AdamW(m.parameters(), lr=LR)
        run = dtm.jit(dtm_train_step(net, opt, MODELS[model][0]["vocab_size"]))
        step = lambda x, y: run(dtm.tensor(x), dtm.tensor(y)).item()  # noqa: E731
    else:
        import torch
        import torch.distributed as dist

        rank = int(os.environ.get("RANK", "0"))
        if world > 1:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        hf = hf_model(MODELS[model][0], weights)  # (it sets one thread per core)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        hf.train()
        net = torch.nn.parallel.DistributedDataParallel(hf) if world > 1 else hf
        opt = torch.optim.AdamW(hf.parameters(), lr=LR)
        vocab = MODELS[model][0]["vocab_size"]

        def step(x, y) -> float:
            logits = net(torch.from_numpy(x)).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), torch.from_numpy(y).reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            return loss.item()

    rows = len(batches[0][0]) // world
    times, first = [], None
    for i, (x, y) in enumerate(batches):
        if engine == "torch":  # (DTM's DDP takes the global batch on every rank and each keeps its rows)
            x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        t0 = time.perf_counter()
        loss = step(x, y)
        times.append(time.perf_counter() - t0)
        first = loss if first is None else first
        if rank == 0:
            print(f"  {engine} {world} process(es) step {i} {1e3 * times[-1]:.1f} ms loss {loss:.4f}",
                  file=sys.stderr, flush=True)  # long work shows progress
    print("RESULT " + json.dumps({"rank": rank, "step_ms": 1e3 * statistics.median(times[warmup:]),
                                  "first_loss": first}), flush=True)
    if engine == "dtm" and world > 1:
        dtm.shutdown()
    elif engine == "torch" and world > 1:
        dist.destroy_process_group()


def results(out: subprocess.CompletedProcess, what: str) -> list[dict]:
    rows = [json.loads(line.split("RESULT ", 1)[1]) for line in out.stdout.splitlines() if "RESULT " in line]
    if out.returncode or not rows:
        sys.exit(f"{what} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return rows


def run(engine: str, world: int, args) -> dict:
    """One run of `engine` on `world` processes: rank 0's figures, and the slowest rank's step."""
    me = [sys.executable, str(HERE), "--worker", engine, "--model", args.model, "--steps", str(args.steps),
          "--warmup", str(args.warmup)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent.parent), str(HERE.parent)]))
    env.pop("OMP_NUM_THREADS", None)
    if world == 1:
        out = subprocess.run(me, env=env, capture_output=True, text=True, timeout=3600)
    elif engine == "dtm":
        env["DTM_HOST"] = "127.0.0.1"
        cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", str(world), *me[1:]]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    else:  # torchrun's environment, each rank a process, in a namespace with only loopback (gloo probes the rest)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(PORT), WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo")
        ranks = " ".join(f"RANK={r} LOCAL_RANK={r} {' '.join(me)} &" for r in range(world))
        script = f"ip link set lo up && {ranks} wait"
        wrap = ["unshare", "-n", "sh", "-c", script] if _netns() else ["sh", "-c", script.split("&& ", 1)[1]]
        out = subprocess.run(wrap, env=env, capture_output=True, text=True, timeout=3600)
    rows = results(out, f"{engine} on {world} process(es)")
    return {"step_ms": max(r["step_ms"] for r in rows), "first_loss": statistics.mean(r["first_loss"] for r in rows)}


def _netns() -> bool:
    return bool(shutil.which("unshare")) and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="char")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--engines", nargs="+", choices=("dtm", "torch"), default=["dtm", "torch"])
    ap.add_argument("--worker", choices=("dtm", "torch"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.model, args.steps, args.warmup)
    fields, batch, context = MODELS[args.model]
    print(f"{args.model}: batch {batch} x {context} tokens; one process (all {os.cpu_count()} cores) against "
          f"DP=2 (two processes of one thread, {batch // 2} rows each); median of {args.steps} steps "
          f"after {args.warmup}; the slowest rank's", flush=True)
    for engine in args.engines:
        one = run(engine, 1, args)
        two = run(engine, 2, args)
        print(f"  {engine:5}: one process {one['step_ms']:8.1f} ms (loss {one['first_loss']:.4f}); DP=2 "
              f"{two['step_ms']:8.1f} ms (loss {two['first_loss']:.4f}); DP=2 / one process "
              f"{two['step_ms'] / one['step_ms']:.2f}", flush=True)


if __name__ == "__main__":
    main()
