"""GPT-2 124M on DTM's reference runtime beside PyTorch eager, in the same run: prefill of
128 tokens (ms) and greedy decoding with a KV cache (tokens/s, 64 new tokens after a
16-token prompt), batch 1, f32, random weights (nothing is downloaded).

The reference runtime is the numpy oracle, not the fast path (the compiler is): this
puts its baseline on record.

    python benchmarks/gpt2_ref.py [--new-tokens 64] [--layers 12]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import transformers

from dtm.models.gpt2 import GPT2, GPT2Config


def twin_models(n_layer: int):
    """The same random weights in a DTM GPT2 and an HF GPT2LMHeadModel."""
    config = GPT2Config(n_layer=n_layer)
    model = GPT2(config, init=False)
    rng = np.random.default_rng(0)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            value = np.zeros(p.shape, np.float32)
        elif ".ln_" in name or name.startswith("ln_f"):
            value = np.ones(p.shape, np.float32)
        else:
            value = rng.standard_normal(p.shape, dtype=np.float32) * 0.02
        p._set_value(value)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=n_layer, resid_pdrop=0.0, embd_pdrop=0.0,
                                                              attn_pdrop=0.0)).eval()
    hf.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in model.hf_state_dict().items()})
    return model.eval(), hf


def best_of(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)

    model, hf = twin_models(args.layers)
    prompt128 = np.random.default_rng(1).integers(0, 50257, size=(1, 128), dtype=np.int64)
    prompt16 = prompt128[:, :16]

    def dtm_prefill():
        model(prompt128)[:, -1].numpy()

    def torch_prefill():
        with torch.no_grad():
            hf(torch.from_numpy(prompt128)).logits[:, -1]

    def dtm_decode():
        return model.generate(prompt16, max_new_tokens=args.new_tokens).numpy()

    def torch_decode():
        with torch.no_grad():
            return hf.generate(torch.from_numpy(prompt16), max_new_tokens=args.new_tokens, do_sample=False,
                               pad_token_id=0, attention_mask=torch.ones_like(torch.from_numpy(prompt16))).numpy()

    same = np.array_equal(dtm_decode(), torch_decode())
    rows = [("prefill 128 tokens (ms)", best_of(dtm_prefill, args.runs) * 1e3, best_of(torch_prefill, args.runs) * 1e3),
            (f"decode {args.new_tokens} tokens (tokens/s)", args.new_tokens / best_of(dtm_decode, args.runs),
             args.new_tokens / best_of(torch_decode, args.runs))]
    print(f"GPT-2 124M shapes, {args.layers} layers, batch 1, f32; best of {args.runs}; "
          f"greedy tokens identical: {same}")
    print(f"{'':34} {'DTM ref':>12} {'torch eager':>12} {'ratio':>8}")
    for name, ours, theirs in rows:
        ratio = theirs / ours if "ms" in name else ours / theirs  # > 1 means DTM is faster
        print(f"{name:34} {ours:12.1f} {theirs:12.1f} {ratio:8.3f}x")


if __name__ == "__main__":
    main()
