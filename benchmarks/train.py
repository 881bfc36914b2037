"""Training steps: DTM eager, DTM with the whole step under dtm.jit, PyTorch eager and
torch.compile, in one run, each engine in its own process (so peak memory is its own).

One step: forward, cross-entropy loss, backward, gradient clipping to norm 1, AdamW, on
the same weights (GPT-2 layout, random, nothing downloaded) and the same batches:
- char: the nanoGPT-style character model (4 layers, 4 heads, 128 wide, vocabulary 65),
  batch 16, context 64;
- gpt2: GPT-2 124M, batch 2, context 128 (`--model gpt2`; minutes per engine).
Printed per engine: the median step time over --steps steps after --warmup, its ratio to
torch eager, the first step's time in a fresh process (DTM: with an empty kernel cache;
torch.compile: its compile), peak RSS, and the first step's loss (the engines agree on it).
DTM's runtime libraries (its own C: the matrix products, the launch loop; the same for every
program, built once per machine and compiler) are built before the engines run, timed and
printed; "dtm-jit-cold" is dtm-jit with nothing built at all, those libraries included.

    python benchmarks/train.py [--model char|gpt2] [--steps 20] [--warmup 3] [--engines ...] [--dropout 0.1]

--dropout P trains with dropout P everywhere (the first losses then differ between engines:
each draws its own masks); issue 30's goal: a step with dropout within 10% of one without.

Goals (issue 15): char eager >= 1.0x torch eager, char jit >= 2x torch eager and >= 1.0x
torch.compile; gpt2 jit >= 1.0x torch eager (goal 1.3x), peak RSS at most torch's; first
step with an empty cache <= 2 s (char), <= 8 s (gpt2).

    python benchmarks/train.py --model gpt2 --warm-memory 4   # the default for gpt2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

from gpt2 import load_weights, random_weights  # this folder is on sys.path when run as a script

MODELS = {  # GPT2Config fields, batch, context
    "char": (dict(vocab_size=65, n_positions=64, n_embd=128, n_layer=4, n_head=4), 16, 64),
    "gpt2": (dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12), 2, 128),
}
ENGINES = ["dtm-eager", "dtm-jit", "dtm-jit-cold", "torch-eager", "torch-compile"]
LR, CLIP = 3e-4, 1.0


def weights_and_batches(model: str, steps: int) -> tuple[dict, list]:
    """The same random weights (DTM's names) and batches in every process."""
    fields, batch, context = MODELS[model]
    rng = np.random.default_rng(1)
    data = [rng.integers(0, fields["vocab_size"], (batch, context + 1)) for _ in range(steps)]
    return random_weights(**fields), [(d[:, :-1], d[:, 1:]) for d in data]


def dtm_step(model: str, weights: dict, jitted: bool, dropout: float = 0.0):
    import dtm
    from dtm.models.gpt2 import GPT2, GPT2Config
    from dtm.nn.functional import cross_entropy

    fields = MODELS[model][0]
    m = GPT2(GPT2Config(**fields, dropout=dropout), init=False)
    m.train()
    load_weights(m, weights)
    opt = dtm.optim.AdamW(m.parameters(), lr=LR)

    def step(x, y):
        loss = cross_entropy(m(x).reshape(-1, fields["vocab_size"]), y.reshape(-1))
        loss.backward()
        dtm.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        return loss

    run = dtm.jit(step) if jitted else step
    return lambda x, y: run(dtm.tensor(x), dtm.tensor(y)).item()


def torch_step(model: str, weights: dict, compiled: bool, dropout: float = 0.0):
    import torch
    import transformers

    from dtm.models.gpt2 import GPT2, GPT2Config

    torch.set_num_threads(os.cpu_count() or 1)
    fields = MODELS[model][0]
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=fields["vocab_size"], n_positions=fields["n_positions"], n_embd=fields["n_embd"],
        n_layer=fields["n_layer"], n_head=fields["n_head"], resid_pdrop=dropout, embd_pdrop=dropout,
        attn_pdrop=dropout))
    m = GPT2(GPT2Config(**fields), init=False)
    for name, p in m.named_parameters():
        p._set_value(weights[name])
    hf.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in m.hf_state_dict().items()}, strict=False)
    del m
    hf.train()
    opt = torch.optim.AdamW(hf.parameters(), lr=LR)
    forward = torch.compile(hf) if compiled else hf

    def step(x, y):
        logits = forward(torch.from_numpy(x)).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, fields["vocab_size"]), torch.from_numpy(y).reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def worker(engine: str, args) -> dict:
    weights, batches = weights_and_batches(args.model, args.warmup + args.steps)
    t0 = time.perf_counter()
    if engine.startswith("dtm"):
        step = dtm_step(args.model, weights, engine.startswith("dtm-jit"), args.dropout)
    else:
        step = torch_step(args.model, weights, engine == "torch-compile", args.dropout)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    first_loss = step(*batches[0])
    first = time.perf_counter() - t0
    for x, y in batches[1:args.warmup]:
        step(x, y)
    times = []
    for x, y in batches[args.warmup:]:
        t0 = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t0)
    return {"engine": engine, "step_ms": float(np.median(times)) * 1e3, "first_s": first, "build_s": build,
            "first_loss": first_loss, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def warm_memory(gib: float) -> None:
    """Touch and free `gib` GiB in a child process. On a virtual machine the first touch of
    memory the host has not backed yet (clear_page in the guest kernel) can cost seconds per
    GiB (4-6 s here, 60% of the samples of DTM's first GPT-2 step under perf), and pages a
    process freed a moment ago come back backed: without this, each engine's first step
    depends on what ran before it."""
    code = f"import numpy as np; a = np.ones({int(gib * 2**30)}, np.uint8); a.fill(2)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)


def build_runtime(runtime: str) -> float:
    """Seconds to build DTM's runtime libraries a training step calls (the f32 products, the
    launch loop, the vector-math probe) into directory `runtime`, in a fresh process."""
    code = ("from dtm.compiler.build import runtime_library, vector_math\n"
            "runtime_library('f32'); runtime_library('move'); vector_math()")
    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], env=dict(os.environ, DTM_CACHE_DIR=cache, DTM_RUNTIME_DIR=runtime),
                       check=True, timeout=600)
        return time.perf_counter() - t0


def run_worker(engine: str, args, runtime: str) -> dict:
    # every DTM engine starts with an empty kernel cache; the cold one with no runtime library either
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as nothing:
        cmd = [sys.executable, __file__, "--worker", engine, "--model", args.model, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--dropout", str(args.dropout)]
        env = dict(os.environ, DTM_CACHE_DIR=cache, DTM_RUNTIME_DIR=nothing if engine.endswith("cold") else runtime)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=7200)
    if out.returncode != 0:
        sys.exit(f"{engine} worker failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="char")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default: 20 char, 3 gpt2)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=ENGINES)
    ap.add_argument("--warm-memory", type=float, default=None, metavar="GIB",
                    help="touch and free this much memory before each engine (default: 0 char, 4 gpt2; see warm_memory)")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="dropout probability in every engine's model (embeddings, attention, residuals)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 20 if args.model == "char" else 3
    if args.warm_memory is None:
        args.warm_memory = 0 if args.model == "char" else 4
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return
    results = {}
    with tempfile.TemporaryDirectory() as runtime:
        runtime_s = build_runtime(runtime) if any(e.startswith("dtm") for e in args.engines) else None
        for engine in args.engines:
            print(f"running {engine} ...", file=sys.stderr, flush=True)
            if args.warm_memory:
                warm_memory(args.warm_memory)
            results[engine] = run_worker(engine, args, runtime)
    base = results.get("torch-eager")
    fields, batch, context = MODELS[args.model]
    print(f"{args.model} training step (batch {batch}, context {context}, {fields['n_layer']} layers, "
          f"{fields['n_embd']} wide): forward, backward, clip_grad_norm_, AdamW; median of {args.steps} steps "
          f"after {args.warmup}; {os.cpu_count()} cores; {args.warm_memory:g} GiB touched and freed before each engine")
    print(f"{'':14} {'step ms':>9} {'vs torch eager':>15} {'first step s':>13} {'peak RSS MB':>12} {'first loss':>11}")
    for engine, r in results.items():
        ratio = f"{base['step_ms'] / r['step_ms']:14.2f}x" if base else f"{'':>15}"
        print(f"{engine:14} {r['step_ms']:9.1f} {ratio} {r['first_s']:13.2f} {r['peak_rss_mb']:12.0f} "
              f"{r['first_loss']:11.5f}")
    if runtime_s is not None:
        print(f"DTM's runtime libraries, built once per machine before the engines ran: {runtime_s:.2f} s "
              "(dtm-jit-cold's first step builds them too)")


if __name__ == "__main__":
    main()
