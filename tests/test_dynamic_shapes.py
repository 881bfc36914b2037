"""Sizes that change without recompiling (issue 30): the symbolic function two concrete
programs are instances of (dtm.compiler.generalize), and the front end running every later
size through it (dtm.tensor.dynamic): a sampling loop whose ids grow by a token, and
training over many sequence lengths, eager and under dtm.jit, compile at most twice. Values
against numpy, transformers and torch; a size the symbolic function does not fit runs its
own program, never a wrong one."""

from __future__ import annotations

import numpy as np
import pytest

import dtm
import dtm.nn.functional as NF
from dtm.compiler.generalize import generalize, instance, skeleton
from dtm.ir import parse
from dtm.ref import run as ref_run
from dtm.runtime import cpu

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_gpt2 import SMALL, hf_checkpoint  # noqa: E402

rng = np.random.default_rng(0)


def func(n: int, k: int = 4):
    """A small program over n rows, with the sizes of n in a reshape and a slice."""
    m = parse(f"""dtm 1.0

func @main(%x: f32[{n}, {k}], %w: f32[{k}, 3]) -> (f32[{n * 3}], f32[{n - 1}, 3], f32[3]) {{
  %y = matmul %x, %w : f32[{n}, 3]
  %r = reshape %y {{shape = [{n * 3}]}} : f32[{n * 3}]
  %s = slice %y {{start = [1, 0], stop = [{n}, 3], step = [1, 1]}} : f32[{n - 1}, 3]
  %t = reduce_sum %y {{axes = [0]}} : f32[3]
  return %r, %s, %t
}}
""")
    return m, m.funcs["main"]


def test_two_sizes_give_one_symbolic_function_that_runs_every_size():
    (_, a), (_, b) = func(3), func(5)
    assert skeleton(a) == skeleton(b) == skeleton(func(3, k=5)[1])  # sizes left out
    s = generalize(a, b)
    assert s is not None
    assert str(s.params[0].type) == "f32[S0, 4]"
    module = dtm.ir.Module()
    module.funcs["main"] = s
    for n in (1, 2, 4, 9):
        m, f = func(n)
        assert instance(s, f) == {"S0": n}
        x, w = rng.standard_normal((n, 4), dtype=np.float32), rng.standard_normal((4, 3), dtype=np.float32)
        got = dtm.runtime.backend.get_backend("cpu").run(module, "main", [x, w])
        for g, want in zip(got, ref_run(m, "main", [x, w])):
            np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
    assert instance(s, func(3, k=5)[1]) is None  # a dim both samples had equal stays static


def test_a_size_two_samples_guessed_wrong_runs_its_own_program():
    """y[: min(n - 1, 3)] of a computed y: at n = 2 and 3 the stop looks like n - 1; at n = 6
    it is 3. The symbolic function does not fit n = 6, which runs its own program, with
    numpy's values; the family is then generalized again from n = 6 and 7 (stop 3)."""
    plans = []
    for n in (2, 3, 6, 7, 5, 9):
        x = rng.standard_normal((n, 3)).astype(np.float32)
        before = cpu.STATS["plans"]
        got = (dtm.tensor(x) * 2.0)[: min(n - 1, 3)].sum(0).numpy()
        plans.append(cpu.STATS["plans"] - before)
        np.testing.assert_allclose(got, (x[: min(n - 1, 3)] * 2.0).sum(0), rtol=1e-6)
    assert plans[2] == 1 and plans[3] == 1 and plans[4:] == [0, 0], plans


def test_eager_values_over_many_sizes_compile_twice():
    w = rng.standard_normal((8, 5)).astype(np.float32)
    counts = []
    for n in range(1, 13):
        x = rng.standard_normal((2, n, 8)).astype(np.float32)
        before = cpu.STATS["plans"]
        got = NF.softmax(dtm.tensor(x) @ dtm.tensor(w), dim=-1).reshape(-1, 5)[1:].numpy()
        counts.append(cpu.STATS["plans"] - before)
        e = np.exp(x @ w - (x @ w).max(-1, keepdims=True))
        np.testing.assert_allclose(got, (e / e.sum(-1, keepdims=True)).reshape(-1, 5)[1:], rtol=1e-5, atol=1e-6)
    assert sum(counts) <= 2 and sum(counts[2:]) == 0, counts


def test_a_growing_sampling_loop_compiles_twice_and_matches_transformers(tmp_path):
    """nanoGPT's generate, as a user writes it: the whole ids through the model each token,
    cropped to the context, the logits outside the top k set to -inf in place, the next
    token appended with cat. Greedy, so the tokens can be compared with transformers'; the
    ids grow past n_positions (64), so the crop runs too."""
    hf = hf_checkpoint(tmp_path, seed=1, weight_std=0.3, **SMALL)
    model = dtm.models.gpt2.GPT2.from_pretrained(str(tmp_path)).eval()
    ids = dtm.tensor([[5, 17, 42]])
    want = torch.tensor([[5, 17, 42]])
    plans = []
    with dtm.no_grad(), torch.no_grad():
        for _ in range(70):
            before = cpu.STATS["plans"]
            logits = model(ids[:, -64:])[:, -1, :]  # a view of the model's output
            got_logits = logits.numpy().copy()
            v, _ = dtm.topk(logits, 10)
            logits[logits < v[:, [-1]]] = -float("inf")  # written through the view
            nxt = dtm.argmax(NF.softmax(logits, dim=-1), dim=-1, keepdim=True)
            ids = dtm.cat((ids, nxt), dim=1)
            ids.realize()
            plans.append(cpu.STATS["plans"] - before)
            hf_logits = hf(want[:, -64:]).logits[:, -1, :]
            want = torch.cat((want, hf_logits.argmax(-1, keepdim=True)), dim=1)
            np.testing.assert_allclose(got_logits, hf_logits.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(ids.numpy(), want.numpy())
    # two programs a token (the model; the crop, argmax and cat), each compiled at two sizes;
    # past 64 ids the crop's slice is another program, again twice
    assert sum(plans[4:]) <= 4, plans


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_training_over_twenty_lengths_compiles_at_most_twice(tmp_path, jitted):
    hf = hf_checkpoint(tmp_path, seed=3, **SMALL).train()
    model = dtm.models.gpt2.GPT2.from_pretrained(str(tmp_path)).train()
    opt = dtm.optim.AdamW(model.parameters(), lr=1e-3)
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-3)
    V = SMALL["vocab_size"]

    def step(x, y):
        loss = NF.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
        loss.backward()
        dtm.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    run = dtm.jit(step) if jitted else step
    data = np.random.default_rng(5)
    plans = []
    for T in data.permutation(np.arange(10, 50, 2)):
        d = data.integers(0, V, (2, T + 1))
        before = cpu.STATS["plans"]
        loss = run(dtm.tensor(d[:, :-1]), dtm.tensor(d[:, 1:])).item()
        plans.append(cpu.STATS["plans"] - before)
        want = torch.nn.functional.cross_entropy(hf(torch.from_numpy(d[:, :-1])).logits.reshape(-1, V),
                                                 torch.from_numpy(d[:, 1:]).reshape(-1))
        want.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        hf_opt.step()
        hf_opt.zero_grad()
        assert abs(loss - want.item()) < 2e-5 * abs(want.item()), (T, loss, want.item())
    assert sum(plans[2:]) == 0, plans


def test_dynamic_false_compiles_each_size(monkeypatch):
    step = dtm.jit(lambda x: (x * 2.0).sum(), dynamic=False)
    counts = []
    for n in (3, 4, 5):
        before = cpu.STATS["plans"]
        assert step(dtm.tensor(np.ones(n, np.float32))).item() == 2.0 * n
        counts.append(cpu.STATS["plans"] - before)
    assert counts == [1, 1, 1]
    monkeypatch.setenv("DTM_DYNAMIC", "0")
    counts = []
    for n in (13, 14, 15):
        before = cpu.STATS["plans"]
        assert (dtm.tensor(np.ones((n, 2), np.float32)) * 3.0).sum().item() == 6.0 * n
        counts.append(cpu.STATS["plans"] - before)
    assert counts == [1, 1, 1]


def test_a_symbolic_function_that_does_not_compile_leaves_its_family_static(monkeypatch):
    """Should the backend fail to compile a family's symbolic function, every size runs its
    own program, with the right values."""
    from dtm.tensor import dynamic

    def fail(*args, **kwargs):
        raise RuntimeError("no symbolic kernels today")

    monkeypatch.setattr(dynamic.execute, "compile", fail)
    for n in (11, 12, 13, 14):
        x = rng.standard_normal((n, 5)).astype(np.float32)
        before = cpu.STATS["plans"]
        got = (dtm.tensor(x).exp() * 3.0).sum(1).numpy()
        assert cpu.STATS["plans"] - before == 1
        np.testing.assert_allclose(got, (np.exp(x) * 3.0).sum(1), rtol=1e-5)
