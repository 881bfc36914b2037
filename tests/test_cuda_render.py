"""Issue 35 without a GPU: GPT-2's forward, training and decoding steps through the cuda
backend's passes. Their CUDA C compiles to PTX for sm_90 with NVRTC without a warning, and
their kernels, run on the CPU by the emulator (dtm/backends/cuda/emulate.py: every block and
thread of each launch, a block's threads meeting at its barriers, the products as cuBLAS
would make them, then their epilogues), give
the cpu backend's results. Every registry op goes the same way in tests/test_compiler_ops.py.
The GPU itself is benchmarks/gpu_check.py's."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import dtm
from dtm import optim
from dtm.backends.cuda import passes as cuda
from dtm.backends.cuda.render_cuda import blocks
from dtm.models.gpt2 import GPT2, GPT2Config
from dtm.nn.functional import cross_entropy
from dtm.runtime.backend import get_backend
from dtm.toolchain import nvrtc

from cuda_emulation import run_cuda_emulated

CONFIG = GPT2Config(vocab_size=29, n_positions=16, n_embd=32, n_layer=2, n_head=4)
RNG = np.random.default_rng(5)


def steps() -> dict:
    """name -> (the jitted function, its arguments)."""
    dtm.manual_seed(0)
    model = GPT2(CONFIG)
    model.train()
    opt = optim.AdamW(model.parameters(), lr=1e-2)

    def train(x, y):
        loss = cross_entropy(model(x).reshape(-1, CONFIG.vocab_size), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    ids = dtm.tensor(RNG.integers(0, 29, (4, 16)))
    targets = dtm.tensor(RNG.integers(0, 29, (4, 16)))
    kv = [dtm.tensor(RNG.standard_normal((1, 4, 16, 8)).astype(np.float32)) for _ in range(2 * CONFIG.n_layer)]
    return {"forward": (dtm.jit(lambda x: model(x)), (ids,)),
            "train": (dtm.jit(train), (ids, targets)),
            "decode": (model._jitted_step(padded=False, greedy=False), (dtm.tensor(np.array([[3]])),
                                                                      dtm.tensor(np.array(5)), *kv))}


STEPS = steps()


@pytest.mark.parametrize("name", sorted(STEPS))
def test_gpt2_step_compiles_for_sm90_and_runs_emulated(name):
    fn, args = STEPS[name]
    module = fn.ir(*args)
    traced, values = fn._bind(args)
    values = [np.asarray(v) for v in values]
    program = cuda.compile_func(module, "main")
    kinds = Counter(launch.kind for ck in program.launches for launch in ck.launches)
    assert kinds["gemm"] >= 12 * CONFIG.n_layer // 2  # the products are cuBLAS calls
    # no kernel of a GPT-2 step runs on one thread: a batch of rows spreads over a grid; one
    # row (decoding) or a loss's sum over one block, its reductions through shared memory
    assert kinds["serial"] == 0, kinds
    assert name == "forward" or kinds["block"] >= 1, kinds
    ptx = cuda.build(program)
    assert ptx.log == "" and ".target sm_90" in ptx.text
    for ck in program.launches:
        for launch in ck.launches:
            if launch.symbol:
                assert f".entry {launch.symbol}(" in ptx.text

    cpu_inputs = [v.copy() for v in values]
    want = get_backend("cpu").run(module, "main", cpu_inputs)
    emulated_inputs = [v.copy() for v in values]
    got = run_cuda_emulated(module, "main", emulated_inputs)
    for w, g in zip(list(want) + cpu_inputs, list(got) + emulated_inputs):  # (the training step's updates too)
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)


def test_launch_geometry():
    assert [blocks(n) for n in (0, 1, 256, 257, 10**9)] == [1, 1, 1, 2, 65535]


def test_nvrtc_refuses_bad_cuda_with_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DTM_CACHE_DIR", str(tmp_path))
    with pytest.raises(dtm.DTMError) as e:
        nvrtc.compile_ptx('extern "C" __global__ void k(float *x) { x[0] = undefined_name; }', "k")
    assert e.value.code == "E0806" and "undefined_name" in str(e.value) and str(tmp_path) in str(e.value)
    with pytest.raises(dtm.DTMError, match="sm_<number>"):
        nvrtc.options("volta")


def test_nvrtc_missing_names_what_installs_it(monkeypatch):
    monkeypatch.setattr(nvrtc, "_lib", None)
    monkeypatch.setattr(nvrtc, "library_path", lambda: None)
    with pytest.raises(dtm.DTMError, match=r"pip install -e '\.\[cuda\]'"):
        nvrtc.compile_ptx("", "k")
