"""GPT-2 against Hugging Face transformers: random weights saved in HF layout (nothing is
downloaded), loaded with GPT2.from_pretrained, compared on logits, greedy decoding and a
training step's gradients."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dtm  # noqa: E402
import dtm.models.gpt2  # noqa: E402
from dtm.models.gpt2 import GPT2, hf_layout  # noqa: E402
from dtm.nn import functional as NF  # noqa: E402

SMALL = dict(vocab_size=101, n_positions=64, n_embd=64, n_layer=2, n_head=4)
# The real 124M shapes, with 2 of the 12 layers to keep the test short.
GPT2_124M_2L = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=2, n_head=12)


def hf_checkpoint(tmp_path, seed: int = 0, weight_std: float | None = None, **cfg):
    """A random HF GPT-2 saved to tmp_path. `weight_std` redraws every matrix with that
    spread: GPT-2's own init (0.02) makes a small model repeat one token forever, which
    would let decoding bugs in positions or masks go unseen."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(**cfg, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # non-trivial LayerNorm affine parameters and biases
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name or "ln_f" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif weight_std is not None and p.ndim == 2:
                p.normal_(0.0, weight_std)
    model.save_pretrained(tmp_path)
    return model


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("cfg", [SMALL, GPT2_124M_2L], ids=["small", "124M-shapes-2-layers"])
def test_logits_match_transformers(tmp_path, cfg):
    hf = hf_checkpoint(tmp_path, **cfg)
    model = GPT2.from_pretrained(str(tmp_path))
    ids = np.random.default_rng(0).integers(0, cfg["vocab_size"], size=(2, 17), dtype=np.int64)
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    got = model(ids)
    assert isinstance(got, dtm.Tensor) and got.shape == (2, 17, cfg["vocab_size"])
    assert rel_err(got.numpy(), want) < 1e-4


def test_greedy_continuation_matches_transformers(tmp_path):
    hf = hf_checkpoint(tmp_path, seed=1, **SMALL)
    model = GPT2.from_pretrained(str(tmp_path))
    prompt = np.array([[5, 17, 42, 8, 99, 3]], dtype=np.int64)
    with torch.no_grad():
        want = hf.generate(torch.from_numpy(prompt), max_new_tokens=32, do_sample=False,
                           pad_token_id=0, attention_mask=torch.ones_like(torch.from_numpy(prompt))).numpy()
    got = model.generate(prompt, max_new_tokens=32)
    assert got.shape == (1, 38)
    np.testing.assert_array_equal(got.numpy(), want)


def test_greedy_tokens_run_many_to_a_runtime_call(tmp_path, monkeypatch):
    """Greedy decoding runs up to REPEAT tokens per call of the runtime (Plan.repeat, each
    token's ids fed to the next step in C, rows that produced an eos id padded there). Its
    tokens are transformers' and those of the token-a-time loop (Plan.repeat refused)."""
    from dtm.runtime import cpu

    hf = hf_checkpoint(tmp_path, seed=3, weight_std=0.3, **SMALL)
    model = GPT2.from_pretrained(str(tmp_path))
    prompt = np.array([[5, 17, 42, 8], [9, 1, 77, 30]], dtype=np.int64)
    runs = []
    repeat = cpu.Plan.repeat
    monkeypatch.setattr(cpu.Plan, "repeat", lambda self, inputs, times, *a, **kw:
                        runs.append(times) or repeat(self, inputs, times, *a, **kw))

    def hf_greedy(**kw):
        with torch.no_grad():
            return hf.generate(torch.from_numpy(prompt), max_new_tokens=40, do_sample=False,
                               attention_mask=torch.ones_like(torch.from_numpy(prompt)), **kw).numpy()

    got = model.generate(prompt, max_new_tokens=40).numpy()
    assert runs == [16, 16, 7]  # the prompt's step, then 39 tokens in three calls
    np.testing.assert_array_equal(got, hf_greedy(pad_token_id=0))
    assert len(set(got[0, 4:].tolist())) > 3  # not one token repeated: positions and caches matter
    # an eos id row 0 produces at its 10th new token and row 1 later or never: row 0 is padded
    # from then on, and decoding stops where transformers' does
    eos = int(got[0, 4 + 9])
    later = [t for t in range(4 + 10, 44) if got[1, t] == eos]
    runs.clear()
    with_eos = model.generate(prompt, max_new_tokens=40, eos_token_id=eos, pad_token_id=7).numpy()
    np.testing.assert_array_equal(with_eos, hf_greedy(eos_token_id=eos, pad_token_id=7))
    assert (with_eos[0, 4 + 10:] == 7).all() and with_eos.shape[1] == (later[0] + 1 if later else 44)
    assert runs and sum(runs) >= with_eos.shape[1] - 5
    monkeypatch.setattr(cpu.Plan, "repeat", lambda *a, **kw: None)  # the token-a-time loop
    np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=40).numpy(), got)
    np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=40, eos_token_id=eos, pad_token_id=7).numpy(),
                                  with_eos)


# Three prompts of 3, 6 and 5 tokens, left-padded to 6 (pad id 0, never attended).
PADDED = np.array([[0, 0, 0, 5, 17, 42], [7, 3, 9, 1, 4, 2], [0, 11, 12, 13, 14, 15]], dtype=np.int64)
PADDED_MASK = (np.arange(6)[None] >= np.array([3, 0, 1])[:, None]).astype(np.int64)


def hf_generate(hf, ids: np.ndarray, mask: np.ndarray, **kw) -> np.ndarray:
    with torch.no_grad():
        return hf.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), do_sample=False,
                           **kw).numpy()


def test_left_padded_batch_matches_transformers(tmp_path):
    """Prompts of different lengths in one batch: positions count from each row's first token
    and padding is never attended, so every row continues as transformers continues it."""
    hf = hf_checkpoint(tmp_path, seed=5, weight_std=0.3, **SMALL)
    model = GPT2.from_pretrained(str(tmp_path))
    want = hf_generate(hf, PADDED, PADDED_MASK, max_new_tokens=20, pad_token_id=0)
    assert len({tuple(r) for r in want[:, 6:]}) == 3 and len(set(want[0, 6:])) > 3  # tokens that vary
    got = model.generate(PADDED, 20, attention_mask=PADDED_MASK)
    np.testing.assert_array_equal(got.numpy(), want)
    # an all-ones mask is the unpadded batch
    np.testing.assert_array_equal(model.generate(PADDED[1:2], 5, attention_mask=np.ones((1, 6))).numpy(),
                                  want[1:2, :11])


def test_eos_stops_each_row_then_the_batch(tmp_path):
    hf = hf_checkpoint(tmp_path, seed=5, weight_std=0.3, **SMALL)
    model = GPT2.from_pretrained(str(tmp_path))
    free = hf_generate(hf, PADDED, PADDED_MASK, max_new_tokens=20, pad_token_id=0)
    # rows 0 and 1 meet their eos early, row 2 never: every row runs to max_new_tokens
    eos = [int(free[0, 9]), int(free[1, 13])]
    for kw in ({"eos_token_id": eos, "pad_token_id": 1}, {"eos_token_id": eos[0]}):
        want = hf_generate(hf, PADDED, PADDED_MASK, max_new_tokens=20, **kw)
        got = model.generate(PADDED, 20, attention_mask=PADDED_MASK, **kw)
        np.testing.assert_array_equal(got.numpy(), want)
    # every row finished: decoding stops before max_new_tokens
    eos = [int(free[0, 7]), int(free[1, 8]), int(free[2, 9])]
    want = hf_generate(hf, PADDED, PADDED_MASK, max_new_tokens=20, eos_token_id=eos, pad_token_id=1)
    got = model.generate(PADDED, 20, attention_mask=PADDED_MASK, eos_token_id=eos, pad_token_id=1)
    assert got.shape[1] < 26
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, None, None), (1.0, 5, None), (1.0, None, 0.9),
                                                       (1.3, 20, 0.8), (0.5, 3, 0.0), (2.0, 200, 1.0)])
def test_sampling_filters_as_transformers_warpers(temperature, top_k, top_p):
    """The distribution sampled from is transformers' on the same logits: temperature, then
    top_k, then top_p, each as its LogitsWarper computes it."""
    from transformers.generation import (LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                                         TopPLogitsWarper)
    from dtm.models.sampling import warp_logits

    logits = np.random.default_rng(6).standard_normal((4, 101)).astype(np.float32) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else [])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    want = warpers(None, torch.from_numpy(logits)).numpy()
    got = warp_logits(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-6)
    if (top_k or 101) < 101 or (top_p if top_p is not None else 1.0) < 1.0:  # a filter that removes tokens
        assert (np.isfinite(got).sum(-1) < 101).all()


def test_sample_draws_from_the_softmax_of_the_warped_logits():
    """Evenly spaced draws pick each token as often as torch.softmax says, and never a
    token the warpers removed."""
    from dtm.models.sampling import sample, warp_logits

    scores = warp_logits(np.random.default_rng(9).standard_normal((1, 50)) * 2, 0.8, 10, 0.9)
    n = 20000
    picked = sample(np.repeat(scores, n, 0), (np.arange(n) + 0.5) / n)
    counts = np.bincount(picked[:, 0], minlength=50) / n
    want = torch.softmax(torch.from_numpy(scores.astype(np.float64)), -1).numpy()[0]
    assert np.abs(counts - want).max() < 2 / n
    assert np.isfinite(scores[0, np.unique(picked)]).all() and (want == 0).sum() >= 40


def test_sampling_is_reproducible_and_keeps_to_the_filter(tmp_path):
    hf = hf_checkpoint(tmp_path, seed=5, weight_std=0.3, **SMALL)
    model = GPT2.from_pretrained(str(tmp_path))
    kw = dict(max_new_tokens=12, attention_mask=PADDED_MASK, do_sample=True, temperature=1.5, top_p=0.95)
    first = model.generate(PADDED, generator=7, **kw).numpy()
    np.testing.assert_array_equal(model.generate(PADDED, generator=np.random.default_rng(7), **kw).numpy(), first)
    assert not np.array_equal(model.generate(PADDED, generator=8, **kw).numpy(), first)
    dtm.manual_seed(3)
    again = model.generate(PADDED, **kw).numpy()
    dtm.manual_seed(3)
    np.testing.assert_array_equal(model.generate(PADDED, **kw).numpy(), again)
    # top_k = 1 leaves one token to sample: transformers' greedy continuation
    want = hf_generate(hf, PADDED, PADDED_MASK, max_new_tokens=12, pad_token_id=0)
    got = model.generate(PADDED, 12, attention_mask=PADDED_MASK, do_sample=True, top_k=1, generator=0)
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("kw, code", [
    (dict(do_sample=True, temperature=0.0), "E0306"), (dict(do_sample=True, top_k=-1), "E0306"),
    (dict(do_sample=True, top_p=1.5), "E0306"), (dict(attention_mask=[[1, 1, 0]]), "E0306"),
    (dict(attention_mask=[[0, 0, 0]]), "E0306"), (dict(attention_mask=[[1, 1]]), "E0403")])
def test_generate_refuses_bad_arguments(kw, code):
    dtm.manual_seed(0)
    model = GPT2(dtm.models.gpt2.GPT2Config(**SMALL))
    with pytest.raises(dtm.DTMError) as e:
        model.generate([[1, 2, 3]], 2, **kw)
    assert e.value.code.value == code


def test_kv_cache_decoding_equals_full_recompute(tmp_path):
    hf_checkpoint(tmp_path, seed=2, **SMALL)
    model = GPT2.from_pretrained(str(tmp_path))
    ids = np.array([[1, 2, 3, 4, 5, 6, 7, 8]], dtype=np.int64)
    full = model(ids).numpy()[:, -1]
    from dtm.models.gpt2 import KVCache

    cache = KVCache(model.config, batch=1, max_len=10)  # longer than used: the mask hides the rest
    model(ids[:, :5], cache)  # prefill, then one token at a time
    for t in range(5, 8):
        last = model(ids[:, t:t + 1], cache).numpy()[:, -1]
    assert rel_err(last, full) < 1e-5


def test_training_step_gradients_match_torch(tmp_path):
    hf = hf_checkpoint(tmp_path, seed=3, **SMALL)
    hf.train()
    model = GPT2.from_pretrained(str(tmp_path)).train()
    rng = np.random.default_rng(3)
    ids = rng.integers(0, SMALL["vocab_size"], size=(2, 12), dtype=np.int64)
    targets = rng.integers(0, SMALL["vocab_size"], size=(2, 12), dtype=np.int64)
    targets[0, :3] = -100  # ignored positions

    logits = hf(torch.from_numpy(ids)).logits
    want_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, SMALL["vocab_size"]),
                                                  torch.from_numpy(targets).reshape(-1), ignore_index=-100)
    want_loss.backward()

    out = model(ids)
    loss = NF.cross_entropy(out.reshape(-1, SMALL["vocab_size"]), dtm.tensor(targets).reshape(-1))
    loss.backward()
    assert abs(loss.item() - want_loss.item()) < 1e-5 * abs(want_loss.item())

    hf_grads = {n.removeprefix("transformer."): p.grad.numpy() for n, p in hf.named_parameters()}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        g = hf_layout(name, p.grad.numpy(), SMALL["n_head"])  # Conv1D [in, out], c_attn's q, k, v rows
        assert rel_err(g, hf_grads[name]) < 1e-4, name


def test_save_pretrained_is_read_by_transformers(tmp_path):
    """The inverse direction: a DTM model written in HF layout loads into transformers."""
    dtm.manual_seed(4)
    model = GPT2(dtm.models.gpt2.GPT2Config(**SMALL)).eval()
    model.save_pretrained(str(tmp_path))
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    ids = np.arange(10, dtype=np.int64)[None] % SMALL["vocab_size"]
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    assert rel_err(model(ids).numpy(), want) < 1e-4


def test_decoding_replays_the_compiled_steps(tmp_path, monkeypatch):
    """The KV cache has a fixed size and the position is data: after the first generation
    compiled the prompt step and the one-token step, a longer one compiles nothing."""
    monkeypatch.setenv("DTM_BACKEND", "cpu")
    from dtm.runtime.cpu import STATS

    hf = hf_checkpoint(tmp_path, seed=4, **SMALL)
    model = GPT2.from_pretrained(str(tmp_path))
    prompt = np.array([[7, 3, 9, 1, 4, 2]], dtype=np.int64)
    model.generate(prompt, max_new_tokens=3)
    plans = STATS["plans"]
    got = model.generate(prompt, max_new_tokens=20)
    assert STATS["plans"] == plans
    with torch.no_grad():
        want = hf.generate(torch.from_numpy(prompt), max_new_tokens=20, do_sample=False, pad_token_id=0,
                           attention_mask=torch.ones_like(torch.from_numpy(prompt))).numpy()
    np.testing.assert_array_equal(got.numpy(), want)


SECOND_PROCESS = """
import json, numpy as np, dtm
from dtm import toolchain as build
from dtm.models.gpt2 import GPT2, GPT2Config
dtm.manual_seed(0)
model = GPT2(GPT2Config(vocab_size=101, n_positions=64, n_embd=64, n_layer=2, n_head=4))
out = model.generate(np.array([[5, 6, 7]]), max_new_tokens=4).numpy()
print(json.dumps({"compiles": build.STATS["compiles"], "tokens": out.tolist()}))
"""


def test_a_second_process_builds_no_kernel(tmp_path):
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, DTM_CACHE_DIR=str(tmp_path), DTM_BACKEND="cpu")
    runs = [json.loads(subprocess.run([sys.executable, "-c", SECOND_PROCESS], env=env, capture_output=True,
                                      text=True, timeout=300, check=True).stdout) for _ in range(2)]
    assert runs[0]["compiles"] > 0 and runs[1]["compiles"] == 0
    assert runs[0]["tokens"] == runs[1]["tokens"]


def test_attention_dropout_in_training_only():
    """config.dropout also drops attention weights (as HF's attn_pdrop), in train mode only:
    eval gives the dropout-free model's logits."""
    ids = [[1, 5, 9, 2, 7]]
    dtm.manual_seed(0)
    model = GPT2(dtm.models.gpt2.GPT2Config(**SMALL, dropout=0.5))
    plain = GPT2(dtm.models.gpt2.GPT2Config(**SMALL))
    plain.load_state_dict(model.state_dict())
    want = plain.eval()(ids).numpy()
    np.testing.assert_array_equal(model.eval()(ids).numpy(), want)
    attn = model.h[0].attn
    model.train()
    x = dtm.randn(1, 5, SMALL["n_embd"])
    attn.resid_dropout.p = 0.0  # leave only the attention weights' dropout
    first, second = attn(x).numpy(), attn(x).numpy()
    assert not np.allclose(first, second)
    attn.dropout = 0.0
    np.testing.assert_allclose(attn(x).numpy(), attn.eval()(x).numpy(), rtol=1e-6)
