"""dtm.jit of a whole training step (forward, backward, clipping, the optimizer's step):
traced once, replayed as one program whose `assign` effects update the weights and the
optimizer's state in place. Every check compares with the same steps run eagerly, which
tests/test_nn_optim.py compares with torch."""

from __future__ import annotations

import numpy as np
import pytest

import dtm
from dtm import optim
from dtm.models.gpt2 import GPT2, GPT2Config
from dtm.nn.functional import cross_entropy
from dtm.parallel import DDP, GPT2_PLAN, fsdp, tensor_parallel

CONFIG = GPT2Config(vocab_size=29, n_positions=16, n_embd=32, n_layer=2, n_head=4)
RNG = np.random.default_rng(3)
BATCHES = [(RNG.integers(0, 29, (4, 16)), RNG.integers(0, 29, (4, 16))) for _ in range(4)]


def model():
    dtm.manual_seed(0)
    m = GPT2(CONFIG)
    m.train()
    return m


def loss_of(net, x, y):
    return cross_entropy(net(x).reshape(-1, CONFIG.vocab_size), y.reshape(-1))


def eager_steps(net, params, make_opt, clip=None, scheduled=False):
    opt = make_opt(params)
    sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4) if scheduled else None
    losses = []
    for x, y in BATCHES:
        loss = loss_of(net, dtm.tensor(x), dtm.tensor(y))
        opt.zero_grad()
        loss.backward()
        if clip:
            dtm.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())
    return losses


def jitted_steps(net, params, make_opt, clip=None, scheduled=False):
    opt = make_opt(params)
    sched = optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4) if scheduled else None

    @dtm.jit
    def step(x, y):
        loss = loss_of(net, x, y)
        loss.backward()
        if clip:
            dtm.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad()
        return loss

    losses = []
    for x, y in BATCHES:
        losses.append(step(dtm.tensor(x), dtm.tensor(y)).item())
        if sched:
            sched.step()
    assert len(step.cache) == 1  # traced once, replayed three times
    return losses


def assert_same_training(a, b, losses_a, losses_b, tol=1e-6):
    np.testing.assert_allclose(losses_a, losses_b, rtol=tol)
    wa, wb = a.state_dict(), b.state_dict()
    for name in wa:
        np.testing.assert_allclose(wa[name].numpy(), wb[name].numpy(), rtol=tol * 10, atol=tol, err_msg=name)


OPTIMIZERS = {
    "adamw": lambda ps: optim.AdamW(ps, lr=3e-3, weight_decay=0.1),
    "sgd": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.2, weight_decay=1e-3),
    "nesterov": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_jitted_step_trains_as_eager_steps_do(name):
    """The learning rate a scheduler changes between calls, SGD's first momentum step and
    AdamW's bias corrections are replayed right: the same losses and weights."""
    a, b = model(), model()
    want = eager_steps(a, list(a.parameters()), OPTIMIZERS[name], clip=0.5, scheduled=True)
    got = jitted_steps(b, list(b.parameters()), OPTIMIZERS[name], clip=0.5, scheduled=True)
    assert_same_training(a, b, want, got)


@pytest.mark.parametrize("layout", ["ddp", "tp", "fsdp", "dp2_tp2"])
def test_a_jitted_step_on_a_mesh_trains_as_eager_steps_do(layout):
    dtm.devices(4)

    def wrap(m):
        if layout == "ddp":
            return DDP(m, dtm.Mesh({"dp": 2}))
        if layout == "tp":
            return tensor_parallel(m, dtm.Mesh({"tp": 2}), GPT2_PLAN)
        if layout == "fsdp":
            return fsdp(m, dtm.Mesh({"dp": 2}))
        mesh = dtm.Mesh({"dp": 2, "tp": 2})
        return DDP(tensor_parallel(m, mesh, GPT2_PLAN, axis="tp"), mesh, axis="dp")

    a, b = model(), model()
    want = eager_steps(wrap(a), list(a.parameters()), OPTIMIZERS["adamw"])
    got = jitted_steps(wrap(b), list(b.parameters()), OPTIMIZERS["adamw"])
    assert_same_training(a, b, want, got, tol=1e-4)
    p = next(iter(b.parameters()))
    assert p.device_mesh is not None and p.placements == next(iter(a.parameters())).placements


def test_gradients_kept_after_a_jitted_step_come_back_as_grad():
    """A step that zeroes the gradients first and keeps them: after each call every
    parameter's .grad holds the call's gradient (clipped), as after an eager step."""
    a, b = model(), model()
    pa, pb = list(a.parameters()), list(b.parameters())
    oa, ob = optim.SGD(pa, lr=0.05), optim.SGD(pb, lr=0.05)

    @dtm.jit
    def step(x, y):
        ob.zero_grad()
        loss = loss_of(b, x, y)
        loss.backward()
        dtm.nn.utils.clip_grad_norm_(pb, 0.1)
        ob.step()
        return loss

    for x, y in BATCHES[:3]:
        oa.zero_grad()
        loss_of(a, dtm.tensor(x), dtm.tensor(y)).backward()
        dtm.nn.utils.clip_grad_norm_(pa, 0.1)
        oa.step()
        step(dtm.tensor(x), dtm.tensor(y))
        for p, q in zip(pa, pb):
            assert q.grad is not None and q.grad._buffer is not None
            np.testing.assert_allclose(q.grad.numpy(), p.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_reading_a_weight_after_the_step_updated_it_is_an_error():
    m = model()
    opt = optim.SGD(m.parameters(), lr=0.1)

    @dtm.jit
    def step(x, y):
        loss_of(m, x, y).backward()
        opt.step()
        return loss_of(m, x, y)  # the forward again, after the update: not one program's meaning

    x, y = BATCHES[0]
    with pytest.raises(dtm.TensorError) as e:
        step(dtm.tensor(x), dtm.tensor(y))
    assert e.value.code is dtm.ErrorCode.USE_AFTER_ASSIGN and e.value.where.startswith(__file__)


def test_updates_in_place_keep_pending_values_and_read_only_weights():
    """A value recorded before a call and read after it sees the weights of before, as in
    eager mode; weights whose arrays are read-only (a loaded file's) are updated too."""
    m = model()
    for p in m.parameters():
        p._buffer.flags.writeable = False
    opt = optim.SGD(m.parameters(), lr=0.5)

    @dtm.jit
    def step(x, y):
        loss = loss_of(m, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x, y = (dtm.tensor(v) for v in BATCHES[0])
    before = loss_of(m, x, y).item()
    pending = loss_of(m, x, y)  # recorded, not run
    first = step(x, y).item()
    second = step(x, y).item()
    assert pending.item() == pytest.approx(before, rel=1e-6) and first == pytest.approx(before, rel=1e-6)
    assert second < first


def test_eager_steps_of_one_structure_reuse_the_first_steps_program(monkeypatch):
    """The second eager step records the same structure: its walk finds the program built,
    differentiated and compiled for the first one; no IR is rebuilt, differentiated or
    hashed again. Another batch shape is another structure."""
    from dtm.ir import module as ir_module
    from dtm.tensor import core

    calls = {"grad": 0, "encode": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(core, "_PROGRAMS", type(core._PROGRAMS)())  # this test's steps start the cache
    monkeypatch.setattr(core, "grad", counting("grad", core.grad))
    monkeypatch.setattr(ir_module, "encode", counting("encode", ir_module.encode))
    m = model()
    params = list(m.parameters())
    opt = optim.AdamW(params, lr=1e-3)
    seen = []
    for x, y in BATCHES[:3] + [(b[:, :8], c[:, :8]) for b, c in BATCHES[:1]]:
        loss = loss_of(m, dtm.tensor(x), dtm.tensor(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
        seen.append(dict(calls))
    assert seen[0]["grad"] == 1 and seen[0]["encode"] > 0
    assert seen[2] == seen[1] == seen[0]  # steps 2 and 3: nothing rebuilt or hashed
    assert seen[3]["grad"] == 2  # a new structure


def test_a_jitted_step_with_dropout_draws_what_eager_steps_draw():
    """Dropout in a compiled step: each call draws a fresh mask (its key is a parameter of
    the program, drawn before each replay), the same masks eager steps draw from the same
    seed, so training is the same; without fresh draws every step would drop the same."""
    config = GPT2Config(vocab_size=29, n_positions=16, n_embd=32, n_layer=2, n_head=4, dropout=0.3)

    def dropped():
        dtm.manual_seed(0)
        m = GPT2(config)
        m.train()
        return m

    a, b, c = dropped(), dropped(), model()
    dtm.manual_seed(11)
    want = eager_steps(a, list(a.parameters()), OPTIMIZERS["adamw"])
    dtm.manual_seed(11)
    got = jitted_steps(b, list(b.parameters()), OPTIMIZERS["adamw"])
    # (AdamW scales the rounding noise of near-zero gradients, the key bias's, up to steps
    # of about lr: 1e-5 absolute where eager and compiled kernels round differently)
    assert_same_training(a, b, want, got, tol=1e-5)
    without = eager_steps(c, list(c.parameters()), OPTIMIZERS["adamw"])
    assert not np.allclose(want, without, rtol=1e-3)  # dropout did drop


def test_dropout_in_a_jitted_function_draws_a_new_mask_each_call():
    x = dtm.ones(8, 16)
    dtm.manual_seed(3)
    eager = [dtm.nn.functional.dropout(x, 0.5).numpy() for _ in range(3)]
    dtm.manual_seed(3)
    f = dtm.jit(lambda x: dtm.nn.functional.dropout(x, 0.5))
    jitted = [f(x).numpy() for _ in range(3)]
    for e, j in zip(eager, jitted):
        np.testing.assert_array_equal(e, j)
    assert not np.array_equal(jitted[0], jitted[1])
    assert set(np.unique(jitted[0])) <= {0.0, 2.0} and 0.3 < (jitted[0] == 0).mean() < 0.7
