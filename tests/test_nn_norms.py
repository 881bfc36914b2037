"""nn.BatchNorm1d / BatchNorm2d / GroupNorm / RMSNorm and their functional forms, against
torch on both backends: values, gradients, running statistics, eval mode, state_dict, and a
jitted training step (issue 30)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dtm
from tests.test_inplace_views import backend  # noqa: F401 - the fixture, run on ref and cpu
from tests.test_tensor_ops import TOL

RNG = np.random.RandomState(30)

# name -> (module of a `nn` namespace, input shape); both torch.nn and dtm.nn build each
CASES = {
    "bn1d-2d": (lambda nn: nn.BatchNorm1d(3), (6, 3)),
    "bn1d-3d": (lambda nn: nn.BatchNorm1d(3, eps=1e-3), (4, 3, 5)),
    "bn1d-cumulative": (lambda nn: nn.BatchNorm1d(3, momentum=None), (4, 3, 5)),
    "bn1d-no-affine": (lambda nn: nn.BatchNorm1d(3, affine=False), (6, 3)),
    "bn1d-untracked": (lambda nn: nn.BatchNorm1d(3, track_running_stats=False), (6, 3)),
    "bn2d": (lambda nn: nn.BatchNorm2d(4, momentum=0.3), (2, 4, 3, 3)),
    "group": (lambda nn: nn.GroupNorm(2, 4), (3, 4, 5)),
    "group-2d-no-affine": (lambda nn: nn.GroupNorm(3, 6, eps=1e-3, affine=False), (2, 6, 2, 3)),
    "rms": (lambda nn: nn.RMSNorm(5), (3, 5)),
    "rms-2-dims": (lambda nn: nn.RMSNorm([4, 5], eps=1e-4), (2, 4, 5)),
    "rms-no-affine": (lambda nn: nn.RMSNorm(5, elementwise_affine=False), (2, 3, 5)),
}


def pair(name: str) -> tuple[torch.nn.Module, dtm.nn.Module]:
    """The case's torch module, its affine parameters made non-trivial, and a DTM module
    holding the same state."""
    make, _ = CASES[name]
    t, d = make(torch.nn), make(dtm.nn)
    with torch.no_grad():
        for p in t.parameters():
            p.copy_(torch.tensor(RNG.randn(*p.shape).astype(np.float32)))
    d.load_state_dict(as_numpy(t.state_dict()))
    return t, d


def as_numpy(state) -> dict[str, np.ndarray]:
    return {k: (v.detach().numpy() if isinstance(v, torch.Tensor) else v.numpy()) for k, v in state.items()}


def close(got, want, what: str = "") -> None:
    got = got.numpy() if isinstance(got, dtm.Tensor) else got
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else want
    np.testing.assert_allclose(got, want, err_msg=what, **TOL["f32"])


def batch(name: str, step: int = 0) -> np.ndarray:
    """Batch `step` of the case: shifted and scaled so the running stats move away from 0, 1."""
    shape = CASES[name][1]
    return (np.random.RandomState(step).randn(*shape) * (1 + step) + step).astype(np.float32)


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_gradients_match_torch(backend, name):
    t, d = pair(name)
    x = batch(name)
    seed = RNG.randn(*x.shape).astype(np.float32)  # a loss that weighs every output differently
    tx, dx = torch.tensor(x, requires_grad=True), dtm.tensor(x, requires_grad=True)
    tout, dout = t(tx), d(dx)
    close(dout, tout, "output")
    (tout * torch.tensor(seed)).sum().backward()
    (dout * dtm.tensor(seed)).sum().backward()
    close(dx.grad, tx.grad, "input grad")
    for (pname, tp), (_, dp) in zip(t.named_parameters(), d.named_parameters()):
        close(dp.grad, tp.grad, f"{pname} grad")


@pytest.mark.parametrize("name", [n for n in sorted(CASES) if n.startswith("bn")])
def test_running_stats_after_three_steps_and_eval_outputs_match_torch(backend, name):
    t, d = pair(name)
    for step in range(3):
        close(d(dtm.tensor(batch(name, step))), t(torch.tensor(batch(name, step))), f"train step {step}")
    assert list(d.state_dict()) == list(t.state_dict())
    for k, want in as_numpy(t.state_dict()).items():
        close(d.state_dict()[k].numpy(), want, k)
    t.eval(), d.eval()
    x = batch(name, 5)
    close(d(dtm.tensor(x)), t(torch.tensor(x)), "eval output")
    close(d(dtm.tensor(x)), t(torch.tensor(x)), "eval again: the running stats did not move")


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_dict_round_trips_with_torch(backend, name):
    t, d = pair(name)
    t(torch.tensor(batch(name)))  # torch's running stats move; DTM's take them on loading
    d.load_state_dict(as_numpy(t.state_dict()))
    back = CASES[name][0](torch.nn)
    back.load_state_dict({k: torch.tensor(v) for k, v in as_numpy(d.state_dict()).items()})
    for k, want in as_numpy(t.state_dict()).items():
        np.testing.assert_array_equal(as_numpy(back.state_dict())[k], want, err_msg=k)
    assert {k: v.dtype for k, v in back.state_dict().items()} == {k: v.dtype for k, v in t.state_dict().items()}


def test_functional_forms_match_torch(backend):
    x = batch("bn2d")
    tx, dx = torch.tensor(x), dtm.tensor(x)
    stats = RNG.randn(4).astype(np.float32), RNG.rand(4).astype(np.float32) + 0.5
    w, b = RNG.randn(4).astype(np.float32), RNG.randn(4).astype(np.float32)
    T, D = torch.nn.functional, dtm.nn.functional
    close(D.batch_norm(dx, *map(dtm.tensor, stats), dtm.tensor(w), dtm.tensor(b)),
          T.batch_norm(tx, *map(torch.tensor, stats), torch.tensor(w), torch.tensor(b)), "batch_norm eval")
    close(D.batch_norm(dx, None, None, training=True), T.batch_norm(tx, None, None, training=True), "batch_norm train")
    close(D.group_norm(dx, 2, dtm.tensor(w)), T.group_norm(tx, 2, torch.tensor(w)), "group_norm")
    close(D.rms_norm(dx, (3, 3)), T.rms_norm(tx, (3, 3)), "rms_norm")


def test_batch_norm_refuses_a_batch_of_one_per_channel_when_training():
    with pytest.raises(dtm.TensorError):
        dtm.nn.BatchNorm1d(3)(dtm.randn(1, 3))


def test_a_jitted_training_step_with_batch_norm_trains_as_torch(backend):
    """The running stats (and the count) are updated on every call of the traced step."""
    def net(nn):
        return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4, momentum=None), nn.ReLU(), nn.Linear(4, 1))

    t, d = net(torch.nn), net(dtm.nn)
    d.load_state_dict(as_numpy(t.state_dict()))
    topt, dopt = torch.optim.SGD(t.parameters(), lr=0.1), dtm.optim.SGD(d.parameters(), lr=0.1)

    @dtm.jit
    def step(x, y):
        loss = ((d(x) - y) ** 2).mean()
        loss.backward()
        dopt.step()
        dopt.zero_grad()
        return loss

    for i in range(3):
        x, y = RNG.randn(8, 5).astype(np.float32) + i, RNG.randn(8, 1).astype(np.float32)
        tloss = ((t(torch.tensor(x)) - torch.tensor(y)) ** 2).mean()
        tloss.backward()
        topt.step()
        topt.zero_grad()
        close(step(dtm.tensor(x), dtm.tensor(y)), tloss, f"loss {i}")
    assert len(step.cache) == 1
    for k, want in as_numpy(t.state_dict()).items():
        close(d.state_dict()[k].numpy(), want, k)
