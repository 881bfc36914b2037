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
    python benchmarks/train.py --dynamic 300 --engines dtm-eager torch-eager torch-compile

--dynamic N runs nanoGPT's sampling loop for N tokens instead of training (the sequence grows
by one token each step: issue 30's goal, 300 tokens in under 5 s from an empty cache); the
engines dtm-eager, torch-eager and torch-compile. --eval N runs nanoGPT's estimate_loss over N
batches under no_grad instead (issue 30: DTM took 83 s to torch's 9 s in a user's trial).

--autocast bf16 runs each step's forward and loss under autocast: dtm.autocast("cpu",
dtype=dtm.bfloat16) for DTM, torch.autocast("cpu", dtype=torch.bfloat16) for torch eager and
torch.compile (products in bf16 on f32 master weights; issue 30's goal: a GPT-2 step at least
1.0x torch's own CPU autocast).

--dropout P trains with dropout P everywhere (the first losses then differ between engines:
each draws its own masks); issue 30's goal: a step with dropout within 10% of one without.

Goals (issue 15): char eager >= 1.0x torch eager, char jit >= 2x torch eager and >= 1.0x
torch.compile; gpt2 jit >= 1.0x torch eager (goal 1.3x), peak RSS at most torch's; first
step with an empty cache <= 2 s (char), <= 8 s (gpt2).

    python benchmarks/train.py --model gpt2 --warm-memory 4   # the default for gpt2

--record DIR keeps the training figures and their plot (step time and first step per engine)
in DIR, as train_char or train_gpt2 (record.py).
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
from record import bars, record

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


def dtm_model(fields: dict, weights: dict, dropout: float = 0.0):
    """DTM's GPT-2 with these weights."""
    from dtm.models.gpt2 import GPT2, GPT2Config

    m = GPT2(GPT2Config(**fields, dropout=dropout), init=False)
    load_weights(m, weights)
    return m


def hf_model(fields: dict, weights: dict, dropout: float = 0.0):
    """transformers' GPT2LMHeadModel with the same weights (through DTM's HF layout)."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=fields["vocab_size"], n_positions=fields["n_positions"], n_embd=fields["n_embd"],
        n_layer=fields["n_layer"], n_head=fields["n_head"], resid_pdrop=dropout, embd_pdrop=dropout,
        attn_pdrop=dropout))
    hf_weights = dtm_model(fields, weights).hf_state_dict()
    hf.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in hf_weights.items()}, strict=False)
    return hf


def dtm_step(model: str, weights: dict, jitted: bool, dropout: float = 0.0, autocast: str = "none"):
    import dtm

    fields = MODELS[model][0]
    m = dtm_model(fields, weights, dropout)
    m.train()
    opt = dtm.optim.AdamW(m.parameters(), lr=LR)
    step = dtm_train_step(m, opt, fields["vocab_size"], autocast)
    run = dtm.jit(step) if jitted else step
    return lambda x, y: run(dtm.tensor(x), dtm.tensor(y)).item()


def dtm_train_step(m, opt, vocab: int, autocast: str = "none"):
    """One training step of model `m` with optimizer `opt` on a batch (x, y) of token ids:
    forward, cross-entropy, backward, gradient clipping, the optimizer's step; the loss."""
    import dtm
    from dtm.nn.functional import cross_entropy

    def step(x, y):
        with dtm.autocast("cpu", dtype=dtm.bfloat16, enabled=autocast == "bf16"):
            loss = cross_entropy(m(x).reshape(-1, vocab), y.reshape(-1))
        loss.backward()
        dtm.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        return loss

    return step


def torch_step(model: str, weights: dict, compiled: bool, dropout: float = 0.0, autocast: str = "none"):
    import torch

    fields = MODELS[model][0]
    hf = hf_model(fields, weights, dropout)
    hf.train()
    opt = torch.optim.AdamW(hf.parameters(), lr=LR)
    forward = torch.compile(hf) if compiled else hf

    def step(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast == "bf16"):
            logits = forward(torch.from_numpy(x)).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, fields["vocab_size"]),
                                                     torch.from_numpy(y).reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def nanogpt_generate(torch_like, model, idx, new_tokens: int, block_size: int, top_k: int = 10):
    """nanoGPT's `generate`, line for line, on either library (`torch_like`: torch or dtm):
    the whole context through the model for every token, cropped to the block size, and the
    sampled token appended with cat; the sequence's length changes at every token."""
    F = torch_like.nn.functional
    for _ in range(new_tokens):
        idx_cond = idx if idx.size(1) <= block_size else idx[:, -block_size:]
        logits = model(idx_cond)
        logits = getattr(logits, "logits", logits)[:, -1, :]
        v, _ = torch_like.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("Inf")
        probs = F.softmax(logits, dim=-1)
        idx_next = torch_like.multinomial(probs, num_samples=1)
        idx = torch_like.cat((idx, idx_next), dim=1)
    return idx


def eval_worker(engine: str, args) -> dict:
    """--eval: nanoGPT's `estimate_loss`: under no_grad, N batches cut by get_batch (a stack
    of slices of a realized 100k-token tensor), the model's loss of each read with .item()
    into a preallocated tensor, then its mean; the first run (DTM: compiling into an empty
    cache) and the second."""
    weights, _ = weights_and_batches(args.model, 0)
    fields, batch, context = MODELS[args.model]
    tokens = np.random.default_rng(2).integers(0, fields["vocab_size"], 100_000)
    if engine.startswith("dtm"):
        import dtm as lib
        model = forward = dtm_model(fields, weights)
    else:
        import torch as lib
        model = hf_model(fields, weights)
        forward = lambda x: model(x).logits  # noqa: E731
    lib.manual_seed(0)
    data = lib.tensor(tokens)
    model.eval()

    def estimate_loss() -> float:
        with lib.no_grad():
            losses = lib.zeros(args.eval)
            for k in range(args.eval):
                ix = lib.randint(len(data) - context, (batch,))
                x = lib.stack([data[i:i + context] for i in ix])
                y = lib.stack([data[i + 1:i + 1 + context] for i in ix])
                logits = forward(x)
                loss = lib.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
                losses[k] = loss.item()
            return float(losses.mean())

    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        estimate_loss()
        times.append(time.perf_counter() - t0)
    return {"engine": engine, "first_s": times[0], "second_s": times[1],
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def sampling_worker(engine: str, args) -> dict:
    """--dynamic: the time of nanoGPT's sampling loop, from a fresh process (DTM: with an
    empty kernel cache), and its tokens per second."""
    weights, _ = weights_and_batches(args.model, 0)
    fields = MODELS[args.model][0]
    if engine.startswith("dtm"):
        import dtm as lib
        model = dtm_model(fields, weights).eval()
    else:
        import torch as lib
        model = hf_model(fields, weights).eval()
        model = lib.compile(model) if engine == "torch-compile" else model
    lib.manual_seed(0)
    start = lib.zeros((1, 1), dtype=lib.int64)
    t0 = time.perf_counter()
    with lib.no_grad():
        idx = nanogpt_generate(lib, model, start, args.dynamic, fields["n_positions"])
        tokens = idx.numpy() if hasattr(idx, "numpy") else idx
    seconds = time.perf_counter() - t0
    return {"engine": engine, "seconds": seconds, "tokens": int(tokens.shape[1] - 1),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def worker(engine: str, args) -> dict:
    if args.dynamic:
        return sampling_worker(engine, args)
    if args.eval:
        return eval_worker(engine, args)
    weights, batches = weights_and_batches(args.model, args.warmup + args.steps)
    t0 = time.perf_counter()
    if engine.startswith("dtm"):
        step = dtm_step(args.model, weights, engine.startswith("dtm-jit"), args.dropout, args.autocast)
    else:
        step = torch_step(args.model, weights, engine == "torch-compile", args.dropout, args.autocast)
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


def build_runtime(runtime: str, autocast: str = "none") -> float:
    """Seconds to build DTM's runtime libraries a training step calls (the f32 products, the
    launch loop, the vector-math probe) into directory `runtime`, in a fresh process."""
    code = ("from dtm.backends.cpu.build import runtime_library, vector_math\n"
            "runtime_library('f32'); runtime_library('move'); vector_math()"
            + ("; runtime_library('bf16')" if autocast == "bf16" else ""))
    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], env=dict(os.environ, DTM_CACHE_DIR=cache, DTM_RUNTIME_DIR=runtime),
                       check=True, timeout=600)
        return time.perf_counter() - t0


def run_worker(engine: str, args, runtime: str) -> dict:
    # every DTM engine starts with an empty kernel cache; the cold one with no runtime library either
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as nothing:
        cmd = [sys.executable, __file__, "--worker", engine, "--model", args.model, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--dropout", str(args.dropout), "--dynamic", str(args.dynamic), "--eval", str(args.eval),
               "--autocast", args.autocast]
        env = dict(os.environ, DTM_CACHE_DIR=cache, DTM_RUNTIME_DIR=nothing if engine.endswith("cold") else runtime)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=7200)
    if out.returncode != 0:
        sys.exit(f"{engine} worker failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_table(results: dict, time_key: str, columns: dict) -> None:
    """One row per engine: `columns` (name: value of a result), the ratio of torch eager's
    `time_key` to the engine's, and peak RSS."""
    base = results.get("torch-eager")
    print(f"{'':14} " + " ".join(f"{c:>9}" for c in columns) + f" {'vs torch eager':>15} {'peak RSS MB':>12}")
    for engine, r in results.items():
        ratio = f"{base[time_key] / r[time_key]:14.2f}x" if base else f"{'':>15}"
        print(f"{engine:14} " + " ".join(f"{get(r):9.2f}" for get in columns.values())
              + f" {ratio} {r['peak_rss_mb']:12.0f}")


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
    ap.add_argument("--dynamic", type=int, default=0, metavar="TOKENS",
                    help="instead of training: nanoGPT's sampling loop for this many tokens (its length changes "
                         "at every token), each engine from a fresh process")
    ap.add_argument("--autocast", choices=["none", "bf16"], default="none",
                    help="bf16: each step's forward and loss under CPU autocast (dtm.autocast / torch.autocast)")
    ap.add_argument("--eval", type=int, default=0, metavar="BATCHES",
                    help="instead of training: nanoGPT's estimate_loss over this many batches under no_grad, twice")
    ap.add_argument("--record", metavar="DIR", help="keep the training figures and their plot in DIR (record.py)")
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
        runtime_s = build_runtime(runtime, args.autocast) if any(e.startswith("dtm") for e in args.engines) else None
        for engine in args.engines:
            print(f"running {engine} ...", file=sys.stderr, flush=True)
            if args.warm_memory:
                warm_memory(args.warm_memory)
            results[engine] = run_worker(engine, args, runtime)
    base = results.get("torch-eager")
    fields, batch, context = MODELS[args.model]
    if args.eval:
        print(f"{args.model}: nanoGPT's estimate_loss, {args.eval} batches of {batch} x {context} under no_grad, "
              f"run twice in a fresh process (DTM: an empty kernel cache); {os.cpu_count()} cores")
        print_table(results, "second_s", {"first s": lambda r: r["first_s"], "second s": lambda r: r["second_s"]})
        return
    if args.dynamic:
        print(f"{args.model}: nanoGPT's sampling loop, {args.dynamic} tokens (context cropped to "
              f"{fields['n_positions']}), from a fresh process (DTM: an empty kernel cache); {os.cpu_count()} cores")
        print_table(results, "seconds", {"seconds": lambda r: r["seconds"],
                                         "tokens/s": lambda r: r["tokens"] / r["seconds"]})
        return
    print(f"{args.model} training step (batch {batch}, context {context}, {fields['n_layer']} layers, "
          f"{fields['n_embd']} wide): forward, backward, clip_grad_norm_, AdamW; median of {args.steps} steps "
          f"after {args.warmup}; {os.cpu_count()} cores; {args.warm_memory:g} GiB touched and freed before each engine"
          + ("; under bf16 autocast (every engine)" if args.autocast == "bf16" else ""))
    print(f"{'':14} {'step ms':>9} {'vs torch eager':>15} {'first step s':>13} {'peak RSS MB':>12} {'first loss':>11}")
    for engine, r in results.items():
        ratio = f"{base['step_ms'] / r['step_ms']:14.2f}x" if base else f"{'':>15}"
        print(f"{engine:14} {r['step_ms']:9.1f} {ratio} {r['first_s']:13.2f} {r['peak_rss_mb']:12.0f} "
              f"{r['first_loss']:11.5f}")
    compiled = results.get("torch-compile")
    if compiled and args.autocast != "none":
        print("vs torch.compile: " + ", ".join(f"{e} {compiled['step_ms'] / r['step_ms']:.2f}x"
                                               for e, r in results.items() if e.startswith("dtm")))
    if runtime_s is not None:
        print(f"DTM's runtime libraries, built once per machine before the engines ran: {runtime_s:.2f} s "
              "(dtm-jit-cold's first step builds them too)")
    if args.record:
        keep = ("step_ms", "first_s", "peak_rss_mb", "first_loss")
        record(args.record, "train", {"model": args.model, "batch": batch, "context": context,
                                      "autocast": args.autocast, "dropout": args.dropout,
                                      "engines": {e: {k: r[k] for k in keep} for e, r in results.items()}},
               draw, name=f"train_{args.model}")


def draw(figures: dict, fig) -> None:
    """Step time and first step (DTM: from an empty kernel cache) per engine, DTM's in blue."""
    engines = figures["engines"]
    step, first = fig.subplots(1, 2)
    what = f"{figures['model']} training step, batch {figures['batch']} x {figures['context']}"
    names = list(engines)
    bars(step, names, [engines[e]["step_ms"] for e in names], title=f"{what}: median step",
         ylabel="ms (lower is better)", highlight=lambda e: e.startswith("dtm"))
    bars(first, names, [engines[e]["first_s"] for e in names], title="first step in a fresh process",
         ylabel="s (lower is better)", highlight=lambda e: e.startswith("dtm"))


if __name__ == "__main__":
    main()
