"""Checkpoints against their peers, in one run (issue 31):

(a) 2 processes: `dtm.checkpoint.save` / `load` of GPT-2 124M's weights with AdamW's state
    (exp_avg, exp_avg_sq: about 1.5 GB of f32 in all), every tensor sharded by rows over the
    two ranks (each writes and reads its half), against torch.distributed.checkpoint (DCP,
    gloo on 127.0.0.1) `save`, `async_save` and `load` of the same tensors as DTensors
    sharded the same way. Both sync their files (DCP's FileSystemWriter does by default).
    Loads are warm (the files just written are in the page cache) for every engine.
(b) 1 process: the same state whole (numpy), `dtm.checkpoint.save` (wait) / `load` against
    `torch.save` + fsync / `torch.load` and safetensors `save_file` + fsync / `load_file`.
(c) 2 processes: a training step while an async save of (a)'s state is in progress against
    a step without one (goal: at most 1.1x). The step: the char model's forward, backward,
    clipping and AdamW in each rank, and an all_reduce of its gradients' size between the
    ranks (DDP's collective, the one a background save must not collide with). The save's
    own time to return (the copies) is printed apart.

Each engine runs in fresh processes, DTM and its peer alternating, --repeats times; the best
of the runs is printed. Ratios are peer time / DTM time: above 1.0, DTM is faster. Goals:
save and load at least 1.5x DCP; a step during an async save at most 1.1x a normal one.

    python benchmarks/checkpoint.py                        # GPT-2 124M, 3 runs each: ~10 minutes
    python benchmarks/checkpoint.py --model char --repeats 1 --steps 5   # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(ROOT))

from train import MODELS, dtm_step, weights_and_batches  # noqa: E402 - this folder is on sys.path
from gpt2 import random_weights  # noqa: E402

RANKS = 2
RUN_TIMEOUT_S = 1800  # one engine's run, its processes together


def state_arrays(model: str) -> dict[str, dict[str, np.ndarray]]:
    """The model's weights and AdamW's moments, the same in every process, flat by name."""
    weights = random_weights(**MODELS[model][0])
    return {"model": weights,
            "exp_avg": {k: w * np.float32(0.1) for k, w in weights.items()},
            "exp_avg_sq": {k: w * w for k, w in weights.items()}}


def nested(flat: dict, make) -> dict:
    """The state dict a training run saves: {"model": {...}, "optim": AdamW's state_dict
    shape}, each array through `make`."""
    names = list(flat["model"])
    return {"model": {k: make(v) for k, v in flat["model"].items()},
            "optim": {"state": {i: {"step": 1.0, "exp_avg": make(flat["exp_avg"][k]),
                                    "exp_avg_sq": make(flat["exp_avg_sq"][k])} for i, k in enumerate(names)},
                      "param_groups": [{"lr": 3e-4, "betas": [0.9, 0.999], "params": list(range(len(names)))}]}}


def state_bytes(model: str) -> int:
    """The bytes of the model's f32 weights (its parameters' shapes, nothing drawn)."""
    from dtm.models.gpt2 import GPT2, GPT2Config

    shapes = [p.shape for _, p in GPT2(GPT2Config(**MODELS[model][0]), init=False).named_parameters()]
    return 4 * sum(int(np.prod(s)) for s in shapes)


def fresh(d: Path) -> Path:
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


def say(what: str) -> None:
    print(f"  ... {what}", file=sys.stderr, flush=True)


# --- (a) and (c): DTM on two processes --------------------------------------------------------

def dtm_rank(args) -> None:
    import dtm

    pg = dtm.runtime.process_group.init(timeout=120, op_timeout=600)
    mesh = dtm.Mesh({"dp": RANKS})
    flat = state_arrays(args.model)
    state = nested(flat, lambda a: dtm.distribute(a, mesh, [dtm.Shard(0)]))
    del flat
    d = Path(args.dir) / "dtm-mesh"
    if pg.rank == 0:
        fresh(d)
    pg.barrier()
    out = {}
    t0 = time.perf_counter()
    h = dtm.checkpoint.save(state, d, step=1)
    out["save_return_s"] = time.perf_counter() - t0
    h.wait()
    pg.barrier()
    out["save_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    dtm.checkpoint.load(state, d)
    pg.barrier()
    out["load_s"] = time.perf_counter() - t0
    if args.steps:
        out.update(steps_beside_save(dtm, pg, state, d, args))
    if pg.rank == 0:
        Path(args.out).write_text(json.dumps(out))


def steps_beside_save(dtm, pg, state: dict, d: Path, args) -> dict:
    """Median step time without a save and while an async save of `state` runs."""
    weights, batches = weights_and_batches("char", 4)
    grads = np.ones(sum(w.size for w in weights.values()), np.float32)  # (before dtm_step takes the weights)
    step = dtm_step("char", weights, jitted=True)

    def one(done: bool) -> tuple[float, bool]:
        """One step; and whether every rank's save is done (so all ranks stop together)."""
        t0 = time.perf_counter()
        x, y = batches[0]
        step(x, y)
        pg.all_reduce(grads)
        every = bool(pg.all_gather(np.array([[done]], np.int64), dim=0).all())
        return time.perf_counter() - t0, every
    for _ in range(3):
        one(True)  # (warm-up: the first steps build and cache their plans)
    normal = [one(True)[0] for _ in range(args.steps)]
    t0 = time.perf_counter()
    h = dtm.checkpoint.save(state, d, step=2)
    returned = time.perf_counter() - t0
    during, every = [], False
    while not every:
        took, every = one(h.done())
        during.append(took)
    h.wait()
    return {"step_s": statistics.median(normal), "step_during_save_s": statistics.median(during),
            "steps_during_save": len(during), "async_save_return_s": returned}


# --- (a): DCP on two processes -------------------------------------------------------------------

def dcp_rank(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (RANKS,))

    def make(a: np.ndarray):
        n = -(-a.shape[0] // RANKS)  # torch's Shard(0) chunks, as DTM's: ceil(D / n) rows each
        local = torch.from_numpy(np.ascontiguousarray(a[rank * n:(rank + 1) * n]))
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(a.shape),
                                  stride=torch.empty(a.shape, device="meta").stride())
    flat = state_arrays(args.model)
    state = nested(flat, make)
    del flat
    out = {}
    for what in ("save", "async_save"):
        d = Path(args.dir) / f"dcp-{what}"
        if rank == 0:
            fresh(d)
        dist.barrier()
        t0 = time.perf_counter()
        if what == "save":
            dcp.save(state, checkpoint_id=str(d))
        else:
            future = dcp.async_save(state, checkpoint_id=str(d))
            out["async_save_return_s"] = time.perf_counter() - t0
            future.result()
        dist.barrier()
        out[f"{what}_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=str(Path(args.dir) / "dcp-save"))
    dist.barrier()
    out["load_s"] = time.perf_counter() - t0
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mesh(engine: str, args, out: Path) -> dict:
    """One run of `engine` on two processes; rank 0's figures."""
    base = [sys.executable, str(HERE), "--role", f"{engine}-rank", "--model", args.model, "--dir", args.dir,
            "--out", str(out), "--steps", str(args.steps if engine == "dtm" else 0)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), DTM_HOST="127.0.0.1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), WORLD_SIZE=str(RANKS), GLOO_SOCKET_IFNAME="lo")
    if engine == "dtm":
        procs = [subprocess.Popen([sys.executable, "-m", "dtm.cli", "launch", "-n", str(RANKS), *base[1:]],
                                  cwd=ROOT, env=env)]
    else:
        procs = [subprocess.Popen(base, cwd=ROOT, env=dict(env, RANK=str(r))) for r in range(RANKS)]
    for p in procs:
        if p.wait(RUN_TIMEOUT_S) != 0:
            raise SystemExit(f"{engine} on {RANKS} processes failed (exit code {p.returncode})")
    return json.loads(out.read_text())


# --- (b): one process -----------------------------------------------------------------------------

def single(args) -> None:
    import torch
    from safetensors.numpy import load_file, save_file

    import dtm
    from dtm.store.files import fsync_dir as synced  # (opens read-only: a file too)

    flat = state_arrays(args.model)
    state = nested(flat, np.array)
    tstate = nested(flat, torch.from_numpy)
    named = {f"{g}.{k}": a for g, group in flat.items() for k, a in group.items()}
    d = fresh(Path(args.dir) / "single")
    out: dict[str, float] = {}

    def timed(key: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        out[key] = min(out.get(key, float("inf")), time.perf_counter() - t0)

    for run in range(args.repeats):  # the engines alternate
        fresh(d / "dtm")
        timed("dtm_save_s", lambda: dtm.checkpoint.save(state, d / "dtm", step=1).wait())
        timed("dtm_load_s", lambda: dtm.checkpoint.load(state, d / "dtm"))
        pt = d / "state.pt"
        timed("torch_save_s", lambda: (torch.save(tstate, pt), synced(pt)))
        timed("torch_load_s", lambda: torch.load(pt, weights_only=True))
        st = d / "state.safetensors"
        timed("safetensors_save_s", lambda: (save_file(named, st), synced(st)))
        timed("safetensors_load_s", lambda: load_file(st))
        say(f"one process, run {run + 1}/{args.repeats}: " + ", ".join(f"{k} {v:.2f}" for k, v in out.items()))
    Path(args.out).write_text(json.dumps(out))


# --- the table ----------------------------------------------------------------------------------------

def row(what: str, dtm_s: float, peer: str, peer_s: float) -> None:
    print(f"{what:34} {dtm_s:9.2f} s   {peer:26} {peer_s:9.2f} s   {peer_s / dtm_s:6.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="training steps timed without and during a save (0: none)")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a new directory in ~/.cache)")
    ap.add_argument("--parts", default="mesh,single", help="mesh (a and c), single (b)")
    ap.add_argument("--role", default="main", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role != "main":
        {"dtm-rank": dtm_rank, "dcp-rank": dcp_rank, "single": single}[args.role](args)
        return
    cache = Path.home() / ".cache"
    cache.mkdir(exist_ok=True)
    made = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="dtm-bench-checkpoint-", dir=cache)
    size = 3 * state_bytes(args.model)
    print(f"checkpoint benchmark: {args.model} with AdamW's moments, {size / 1e9:.2f} GB, in {args.dir}, "
          f"best of {args.repeats} runs")
    try:
        parts = args.parts.split(",")
        best: dict[str, dict[str, float]] = {"dtm": {}, "dcp": {}}
        if "mesh" in parts:
            for run in range(args.repeats):
                for engine in ("dtm", "dcp"):  # alternating: the machine is noisy
                    got = run_mesh(engine, args, Path(args.dir) / f"{engine}.json")
                    say(f"{engine} on {RANKS} processes, run {run + 1}/{args.repeats}: "
                        + ", ".join(f"{k} {v:.3g}" for k, v in got.items()))
                    for k, v in got.items():
                        best[engine][k] = min(best[engine].get(k, float("inf")), v)
        one = {}
        if "single" in parts:
            out = Path(args.dir) / "single.json"
            subprocess.run([sys.executable, str(HERE), "--role", "single", "--model", args.model, "--dir", args.dir,
                            "--out", str(out), "--repeats", str(args.repeats)], check=True, cwd=ROOT)
            one = json.loads(out.read_text())
        print(f"\n{'':34} {'DTM':>11}   {'peer':26} {'':>11}   {'peer/DTM':>7}")
        dtm_, dcp = best["dtm"], best["dcp"]
        if dtm_ and dcp:
            row(f"save, {RANKS} processes", dtm_["save_s"], "DCP save", dcp["save_s"])
            row(f"save, {RANKS} processes", dtm_["save_s"], "DCP async_save (to done)", dcp["async_save_s"])
            row("  of which: until save returns", dtm_["save_return_s"], "DCP async_save returns",
                dcp["async_save_return_s"])
            row(f"load, {RANKS} processes", dtm_["load_s"], "DCP load", dcp["load_s"])
        if one:
            row("save, 1 process", one["dtm_save_s"], "torch.save + fsync", one["torch_save_s"])
            row("save, 1 process", one["dtm_save_s"], "safetensors + fsync", one["safetensors_save_s"])
            row("load, 1 process", one["dtm_load_s"], "torch.load", one["torch_load_s"])
            row("load, 1 process", one["dtm_load_s"], "safetensors load_file", one["safetensors_load_s"])
        if "step_s" in dtm_:
            print(f"\ntraining step ({RANKS} processes, char model + gradient all_reduce): "
                  f"{dtm_['step_s'] * 1e3:.1f} ms alone, {dtm_['step_during_save_s'] * 1e3:.1f} ms during an async "
                  f"save ({dtm_['step_during_save_s'] / dtm_['step_s']:.2f}x, goal <= 1.1x); the save returned "
                  f"after {dtm_['async_save_return_s']:.2f} s (its copies)")
    finally:
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
