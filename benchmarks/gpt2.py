"""GPT-2 124M on DTM's `cpu` backend, DTM's `ref` backend and PyTorch eager f32, in one run.

Batch 1, f32, random weights (nothing is downloaded), the same weights everywhere:
- prefill: one forward pass over 128 tokens (ms, best of --runs), jitted in DTM;
- decode: greedy generation with a KV cache, 64 new tokens after a 16-token prompt
  (tokens/s, best of --runs); the greedy tokens of every engine are compared;
- peak RSS of each engine's process (each engine runs in its own process, so one's memory
  does not count against another);
- first compile: DTM `cpu` in a fresh process with an empty kernel cache, the time of the
  first prefill plus the first generation (tracing, compiling and building every kernel);
- cached: the same in a second fresh process that finds the kernels on disk;
- narrow weights: DTM with its Linear and Embedding weights quantized by dtm.quant.quantize
  to q8_0, q4_0 and bf16, against torch's int8 dynamic quantization (quantize_dynamic on
  nn.Linear; HF's Conv1D projections are made nn.Linear first, so that all are quantized).
  "same tokens" compares with torch f32; narrow engines may differ after a few tokens on
  random weights, whose logits are nearly tied (tests/test_quant.py states the accuracy).

    python benchmarks/gpt2.py [--new-tokens 64] [--layers 12] [--runs 3] [--no-ref] [--no-quant]
                              [--peer llamacpp]

--peer llamacpp adds llama.cpp (llama-cpp-python and gguf: pip install -e '.[llamacpp]', built
from source) as engines llamacpp:f32, :q8_0 and :q4_0 (q8_0 and q4_0 unless --no-quant): each
worker writes the same random weights as a GGUF file (benchmarks/gguf_gpt2.py; its matmul
weights quantized by the gguf package's numpy quantizer, norms and biases f32) and loads it
with llama_cpp.Llama (mmap'd, os.cpu_count() threads). Prefill evaluates the 128 ids after a
reset and copies the last position's logits; decode feeds the prompt, then one token at a
time, each the argmax of the last logits (no sampler). A "vs llama.cpp" table follows the
main one, DTM cpu f32 / q8_0 / q4_0 against llama.cpp's same type: prefill ratio (llama ms /
DTM ms), decode ratio (DTM tok/s / llama tok/s) and the RSS right after loading (peak RSS
counts the random f32 weights every worker makes first: for narrow types, the resident
memory after load is the one to compare). Batch 1 only.

--batch N runs N sequences at once instead (prompts of one length, no padding): decode
tokens/s counts all N; DTM's products of a few rows go unpacked, as one row's do.

--accuracy N (no speed rows): the narrow types' accuracy against f32 on the same weights.
The f32 model generates N tokens greedily after the 16-token prompt; each of q8_0, q4_0
and bf16 then reads the same N + 16 tokens (one forward pass), and at each of the N
positions the f32 model predicted, the max abs difference of the logits and whether the
top-1 token agrees are taken: printed as max / mean / 99th percentile and the agreement.

    python benchmarks/gpt2.py --accuracy 256

--record DIR keeps the speed figures and their plot (prefill and decode per engine) in DIR
(record.py).
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

from record import bars, record
from timing import best_of

PROMPT_LEN, PREFILL_LEN = 16, 128


def random_weights(**config) -> dict[str, np.ndarray]:
    """GPT-2-shaped weights under DTM's names (124M's unless `config`, GPT2Config's fields,
    says otherwise), the same in every process: biases 0, layer norms 1, the rest N(0, 0.02)."""
    from dtm.models.gpt2 import GPT2, GPT2Config

    model = GPT2(GPT2Config(**config), init=False)
    rng = np.random.default_rng(0)
    out = {}
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            out[name] = np.zeros(p.shape, np.float32)
        elif ".ln_" in name or name.startswith("ln_f"):
            out[name] = np.ones(p.shape, np.float32)
        else:
            out[name] = rng.standard_normal(p.shape, dtype=np.float32) * 0.02
    return out



def load_weights(model, weights: dict[str, np.ndarray]) -> None:
    """Load `weights` into the DTM `model` as a user would (load_state_dict copies each
    into memory of the model's own), taking them out of `weights` one by one, so that the
    process never holds the model twice (its peak RSS is measured)."""
    for name, _ in list(model.named_parameters()):
        model.load_state_dict({name: weights.pop(name)}, strict=False)


def dtm_engine(backend: str, n_layer: int, weights: dict[str, np.ndarray], narrow: str | None = None):
    """(prefill, decode) closures on a DTM GPT-2 running on `backend` (weights quantized to
    `narrow` when given); `weights` is emptied (load_weights)."""
    import dtm
    from dtm.models.gpt2 import GPT2, GPT2Config

    os.environ["DTM_BACKEND"] = backend
    model = GPT2(GPT2Config(n_layer=n_layer), init=False).eval()
    load_weights(model, weights)
    if narrow:
        dtm.quant.quantize(model, narrow)
    forward = dtm.jit(lambda ids: model(ids)[:, -1])

    def prefill(ids):
        return forward(dtm.tensor(ids)).numpy()

    def decode(prompt, n):
        return model.generate(prompt, max_new_tokens=n).numpy()

    return prefill, decode


def _linear_from_conv1d(module) -> None:
    """Replace HF's Conv1D layers (weight [in, out]) by equal nn.Linear ones, in place."""
    import torch
    from transformers.pytorch_utils import Conv1D

    for name, child in module.named_children():
        if isinstance(child, Conv1D):
            n_in, n_out = child.weight.shape
            lin = torch.nn.Linear(n_in, n_out)
            with torch.no_grad():
                lin.weight.copy_(child.weight.t())
                lin.bias.copy_(child.bias)
            setattr(module, name, lin)
        else:
            _linear_from_conv1d(child)


def torch_engine(n_layer: int, weights: dict[str, np.ndarray], int8: bool = False):
    import torch
    import transformers

    from dtm.models.gpt2 import GPT2, GPT2Config

    torch.set_num_threads(os.cpu_count() or 1)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=n_layer, resid_pdrop=0.0, embd_pdrop=0.0,
                                                              attn_pdrop=0.0)).eval()
    model = GPT2(GPT2Config(n_layer=n_layer), init=False)
    for name, p in model.named_parameters():
        p._set_value(weights[name])
    hf.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in model.hf_state_dict().items()})
    del model
    if int8:
        _linear_from_conv1d(hf)
        hf = torch.ao.quantization.quantize_dynamic(hf, {torch.nn.Linear}, dtype=torch.qint8)

    def prefill(ids):
        with torch.no_grad():
            return hf(torch.from_numpy(ids)).logits[:, -1].numpy()

    def decode(prompt, n):
        with torch.no_grad():
            p = torch.from_numpy(prompt)
            return hf.generate(p, max_new_tokens=n, do_sample=False, pad_token_id=0,
                               attention_mask=torch.ones_like(p)).numpy()

    return prefill, decode


def llamacpp_engine(weights: dict[str, np.ndarray], dtype: str, n_ctx: int):
    """(prefill, decode) closures on llama.cpp running GPT-2 from a GGUF file of `weights`
    (gguf_gpt2.write_gguf, in a temporary directory), its matmul weights in `dtype` (f32,
    q8_0, q4_0); `weights` is emptied."""
    import llama_cpp
    from gguf_gpt2 import write_gguf

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"gpt2-{dtype}.gguf")
        write_gguf(weights, path, dtype)
        # llama.cpp maps the file: its pages stay mapped after the directory is removed
        llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=PREFILL_LEN, n_threads=os.cpu_count(), logits_all=False,
                              verbose=False)
    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        """The logits of the last position evaluated: a view of llama.cpp's own buffer (with
        logits_all=False, Llama.eval keeps none of its own)."""
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

    def prefill(ids):
        llm.reset()
        llm.eval(ids[0].tolist())
        return last_logits()[None].copy()

    def decode(prompt, n):
        # greedy as the other engines: argmax of the logits, no sampler; the KV cache holds
        # the prompt and every token fed since, so each step evaluates one token
        llm.reset()
        llm.eval(prompt[0].tolist())
        out = prompt[0].tolist()
        for i in range(n):
            out.append(int(np.argmax(last_logits())))
            if i + 1 < n:
                llm.eval(out[-1:])
        return np.array([out])

    return prefill, decode


def require_llamacpp() -> None:
    """Exit with one line saying how to install llama.cpp's Python packages when either is missing."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as e:
        sys.exit(f"--peer llamacpp needs llama-cpp-python and gguf ({e}): pip install -e '.[llamacpp]' "
                 "(llama.cpp is built from source, several minutes)")


def rss_mb() -> float:
    """This process's resident memory now, in MiB (Linux's /proc; NaN elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def accuracy(n_new: int, n_layer: int) -> None:
    """--accuracy: see the module docstring."""
    import dtm
    from dtm.models.gpt2 import GPT2, GPT2Config

    weights = random_weights(n_layer=n_layer)
    prompt = np.random.default_rng(1).integers(0, 50257, size=(1, PROMPT_LEN), dtype=np.int64)

    def model_of(narrow):
        model = GPT2(GPT2Config(n_layer=n_layer), init=False).eval()
        model.load_state_dict({name: weights[name] for name, _ in model.named_parameters()})
        return dtm.quant.quantize(model, narrow) if narrow else model

    f32 = model_of(None)
    t0 = time.perf_counter()
    ids = f32.generate(prompt, max_new_tokens=n_new).numpy()
    print(f"f32 greedy: {n_new} tokens in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    seq = ids[:, :-1]  # the positions whose next token f32 predicted: PROMPT_LEN - 1 ... end
    want = dtm.jit(lambda x: f32(x))(dtm.tensor(seq)).numpy()[0, PROMPT_LEN - 1:]
    same = (want.argmax(-1) == ids[0, PROMPT_LEN:]).mean()  # one forward pass vs the cached decode, both f32
    print(f"GPT-2 124M shapes, {n_layer} layers, random weights (benchmarks/gpt2.py random_weights), "
          f"{n_new} greedy f32 tokens after a {PROMPT_LEN}-token prompt; each type reads the same tokens; "
          f"f32 logits: std {want.std():.3f}, max |logit| {np.abs(want).max():.3f}; f32's forward pass picks "
          f"the greedy decode's token at {same * 100:.1f}% of positions")
    print(f"{'type':6} {'max |dlogit|':>13} {'mean':>8} {'p99':>8} {'top-1 agreement':>16}")
    for narrow in ("q8_0", "q4_0", "bf16"):
        got = dtm.jit(lambda x, m=model_of(narrow): m(x))(dtm.tensor(seq)).numpy()[0, PROMPT_LEN - 1:]
        per_token = np.abs(got - want).max(-1)
        agree = (got.argmax(-1) == want.argmax(-1)).mean()
        print(f"{narrow:6} {per_token.max():13.4f} {per_token.mean():8.4f} {np.percentile(per_token, 99):8.4f} "
              f"{agree * 100:15.1f}%")


def worker(engine: str, args) -> dict:
    """Measure one engine in this process; the result as a dict (printed as JSON)."""
    weights = random_weights(n_layer=args.layers)
    ids = np.random.default_rng(1).integers(0, 50257, size=(args.batch, PREFILL_LEN), dtype=np.int64)
    prompt = ids[:, :PROMPT_LEN]
    base, _, narrow = engine.partition(":")  # "cpu:q8_0", "torch:int8", "llamacpp:f32"
    if base == "torch":
        prefill, decode = torch_engine(args.layers, weights, int8=narrow == "int8")
    elif base == "llamacpp":
        prefill, decode = llamacpp_engine(weights, narrow, n_ctx=max(256, PROMPT_LEN + args.new_tokens))
    else:
        prefill, decode = dtm_engine(base, args.layers, weights, narrow or None)
    load_rss = rss_mb()
    t0 = time.perf_counter()
    prefill(ids)
    decode(prompt, 2)  # traces and builds both decoding steps (the prompt's and one token's)
    first = time.perf_counter() - t0
    tokens = decode(prompt, args.new_tokens)
    runs = 1 if engine == "ref" else args.runs
    return {"engine": engine, "first_s": first, "load_rss_mb": load_rss,
            "prefill_ms": best_of(lambda: prefill(ids), runs) * 1e3,
            "decode_tok_s": args.batch * args.new_tokens / best_of(lambda: decode(prompt, args.new_tokens), runs),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "tokens": tokens.tolist()}


def run_worker(engine: str, args, cache_dir: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", engine, "--layers", str(args.layers),
           "--new-tokens", str(args.new_tokens), "--runs", str(args.runs), "--batch", str(args.batch)]
    env = dict(os.environ, DTM_CACHE_DIR=cache_dir)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        sys.exit(f"{engine} worker failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_vs_llamacpp(results: list[tuple[str, dict]]) -> None:
    """The "vs llama.cpp" table: DTM cpu f32 / q8_0 / q4_0 (f32: the cached run) against
    llama.cpp's same type; ratios above 1 have DTM ahead."""
    import llama_cpp

    by_engine = {r["engine"]: r for _, r in results}  # the later "cpu" run, with cached kernels, wins
    print(f"vs llama.cpp (llama-cpp-python {llama_cpp.__version__}; {llama_cpp.llama_print_system_info().decode().strip()})")
    print(f"{'':6} {'prefill ms: DTM':>16} {'llama':>7} {'llama/DTM':>10} {'decode tok/s: DTM':>18} {'llama':>7} "
          f"{'DTM/llama':>10} {'RSS after load MB: DTM':>23} {'llama':>6} {'peak RSS MB: DTM':>17} {'llama':>6}")
    for dtype in ("f32", "q8_0", "q4_0"):
        ours, theirs = by_engine.get("cpu" if dtype == "f32" else f"cpu:{dtype}"), by_engine.get(f"llamacpp:{dtype}")
        if ours is None or theirs is None:
            continue
        print(f"{dtype:6} {ours['prefill_ms']:16.1f} {theirs['prefill_ms']:7.1f} "
              f"{theirs['prefill_ms'] / ours['prefill_ms']:9.2f}x {ours['decode_tok_s']:18.2f} "
              f"{theirs['decode_tok_s']:7.2f} {ours['decode_tok_s'] / theirs['decode_tok_s']:9.2f}x "
              f"{ours['load_rss_mb']:23.0f} {theirs['load_rss_mb']:6.0f} {ours['peak_rss_mb']:17.0f} "
              f"{theirs['peak_rss_mb']:6.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded at once")
    ap.add_argument("--no-ref", action="store_true", help="skip the (slow) reference backend")
    ap.add_argument("--no-quant", action="store_true", help="skip the narrow-weight rows")
    ap.add_argument("--peer", choices=["llamacpp"], help="add llama.cpp's engines (pip install -e '.[llamacpp]')")
    ap.add_argument("--accuracy", type=int, metavar="N", help="narrow types vs f32 over N greedy tokens, no speed")
    ap.add_argument("--record", metavar="DIR", help="keep the speed figures and their plot in DIR (record.py)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.accuracy:
        accuracy(args.accuracy, args.layers)
        return
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return
    if args.peer:
        require_llamacpp()
        if args.batch != 1:
            sys.exit("--peer llamacpp: batch 1 only")

    with tempfile.TemporaryDirectory() as cache:
        narrow = [] if args.no_quant else ["cpu:q8_0", "cpu:q4_0", "cpu:bf16", "torch:int8"]
        peer = [f"llamacpp:{t}" for t in (["f32"] if args.no_quant else ["f32", "q8_0", "q4_0"])] if args.peer else []
        engines = ["cpu", "cpu", "torch"] + narrow + peer + ([] if args.no_ref else ["ref"])
        labels = {"llamacpp:f32": "llama.cpp f32", "llamacpp:q8_0": "llama.cpp q8_0", "llamacpp:q4_0": "llama.cpp q4_0",
                  "ref": "DTM ref", "torch": "torch eager", "torch:int8": "torch int8 dynamic",
                  "cpu:q8_0": "DTM cpu q8_0", "cpu:q4_0": "DTM cpu q4_0", "cpu:bf16": "DTM cpu bf16"}
        results = []
        for i, engine in enumerate(engines):
            label = {0: "DTM cpu (empty cache)", 1: "DTM cpu (cached)"}.get(i) or labels[engine]
            print(f"running {label} ...", file=sys.stderr, flush=True)
            results.append((label, run_worker(engine, args, cache)))
    cold, warm, torch_r = results[0][1], results[1][1], results[2][1]
    print(f"GPT-2 124M shapes, {args.layers} layers, batch {args.batch}, f32 unless named, random weights; best of {args.runs}; "
          f"{os.cpu_count()} cores")
    print(f"{'':24} {'prefill ms':>11} {'vs torch':>9} {'decode tok/s':>13} {'vs torch':>9} "
          f"{'peak RSS MB':>12} {'first call s':>13} {'same tokens':>12}")
    for label, r in results:
        print(f"{label:24} {r['prefill_ms']:11.1f} {torch_r['prefill_ms'] / r['prefill_ms']:8.2f}x "
              f"{r['decode_tok_s']:13.2f} {r['decode_tok_s'] / torch_r['decode_tok_s']:8.2f}x "
              f"{r['peak_rss_mb']:12.0f} {r['first_s']:13.2f} {str(r['tokens'] == torch_r['tokens']):>12}")
    print(f"DTM cpu first compile (empty cache): {cold['first_s']:.2f} s (goal < 30 s); "
          f"second process, cached kernels: {warm['first_s']:.2f} s (goal < 3 s)")
    print("matmul path: DTM's own tiled C kernels (no BLAS); torch uses its bundled BLAS")
    if args.peer:
        print_vs_llamacpp(results)
    if args.record:
        keep = ("prefill_ms", "decode_tok_s", "peak_rss_mb", "first_s")
        record(args.record, "gpt2", {"layers": args.layers, "batch": args.batch, "new_tokens": args.new_tokens,
                                     "engines": {label: {k: r[k] for k in keep} for label, r in results}}, draw)


def draw(figures: dict, fig) -> None:
    """Prefill time and decode rate per engine, DTM's in blue."""
    engines = figures["engines"]
    names = list(engines)
    prefill, decode = fig.subplots(1, 2)
    model = "GPT-2 124M" if figures["layers"] == 12 else f"GPT-2 shapes, {figures['layers']} layers,"
    bars(prefill, names, [engines[e]["prefill_ms"] for e in names], ylabel="ms (lower is better)",
         title=f"{model} prefill, {PREFILL_LEN} tokens, batch {figures['batch']}")
    bars(decode, names, [engines[e]["decode_tok_s"] for e in names], ylabel="tokens/s (higher is better)",
         title=f"greedy decode, {figures['new_tokens']} tokens")


if __name__ == "__main__":
    main()
