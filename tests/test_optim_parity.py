"""The optim additions of issue 16 against torch 2.13: Adam (L2 weight decay, amsgrad) and
AdamW with amsgrad take torch's steps; optimizer state_dict() has torch's layout and a
save/load round trip resumes a run exactly; LambdaLR, StepLR, LinearLR, OneCycleLR (with
its momentum cycle) and SequentialLR give torch's learning rates step by step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dtm
import dtm.nn.functional as F
from dtm.optim import lr_scheduler as dsched
from dtm.runtime.backend import BACKENDS

tsched = torch.optim.lr_scheduler


@pytest.fixture(params=["ref"] + (["cpu"] if "cpu" in BACKENDS else []))
def backend(request, monkeypatch):
    monkeypatch.setenv("DTM_BACKEND", request.param)
    return request.param


def models(dtype=torch.float64):
    """A torch MLP and a dtm one holding the same weights."""
    torch.manual_seed(1)
    tm = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).to(dtype)
    dm = dtm.nn.Sequential(dtm.nn.Linear(3, 5), dtm.nn.Tanh(), dtm.nn.Linear(5, 2)).to(str(dtype).split(".")[1])
    dm.load_state_dict({k: v.detach().numpy() for k, v in tm.state_dict().items()})
    return dm, tm


def batch(i, dtype=torch.float64):
    rng = np.random.default_rng(100 + i)
    x, y = rng.standard_normal((8, 3)), rng.standard_normal((8, 2))
    return (dtm.tensor(x, dtype=str(dtype).split(".")[1]), dtm.tensor(y, dtype=str(dtype).split(".")[1]),
            torch.tensor(x, dtype=dtype), torch.tensor(y, dtype=dtype))


def train(dm, dopt, steps, first=0, dsch=None, dtype=torch.float64):
    for i in range(first, first + steps):
        x, y, _, _ = batch(i, dtype)
        dopt.zero_grad()
        F.mse_loss(dm(x), y).backward()
        dopt.step()
        if dsch is not None:
            dsch.step()


def train_torch(tm, topt, steps, tsch=None, dtype=torch.float64):
    for i in range(steps):
        _, _, x, y = batch(i, dtype)
        topt.zero_grad()
        torch.nn.functional.mse_loss(tm(x), y).backward()
        topt.step()
        if tsch is not None:
            tsch.step()


def assert_same_params(dm, tm, rtol):
    for (n, p), (_, tp) in zip(dm.named_parameters(), tm.named_parameters()):
        np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=rtol, atol=rtol * 1e-2, err_msg=n)


ADAM = {
    "adam": ("Adam", dict(lr=0.01)),
    "adam-l2": ("Adam", dict(lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)),
    "adam-amsgrad": ("Adam", dict(lr=0.05, weight_decay=0.01, amsgrad=True)),
    "adamw-amsgrad": ("AdamW", dict(lr=0.05, amsgrad=True)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(ADAM))
def test_adam_steps_match_torch(backend, name, dtype):
    cls, kw = ADAM[name]
    dm, tm = models(dtype)
    dopt, topt = getattr(dtm.optim, cls)(dm.parameters(), **kw), getattr(torch.optim, cls)(tm.parameters(), **kw)
    train(dm, dopt, 6, dtype=dtype)
    train_torch(tm, topt, 6, dtype=dtype)
    assert_same_params(dm, tm, 1e-9 if dtype == torch.float64 else 1e-5)


def test_state_dict_has_torchs_layout(backend):
    dm, tm = models()
    def groups(m):
        return [{"params": list(m[0].parameters()), "lr": 0.03}, {"params": list(m[2].parameters())}]

    dopt = dtm.optim.Adam(groups(dm), lr=0.01, amsgrad=True)
    topt = torch.optim.Adam(groups(tm), lr=0.01, amsgrad=True)
    train(dm, dopt, 3)
    train_torch(tm, topt, 3)
    ds, ts = dopt.state_dict(), topt.state_dict()
    assert list(ds) == list(ts) == ["state", "param_groups"]
    assert [g["params"] for g in ds["param_groups"]] == [g["params"] for g in ts["param_groups"]] == [[0, 1], [2, 3]]
    for dg, tg in zip(ds["param_groups"], ts["param_groups"]):
        assert {k: v for k, v in tg.items() if k in dg} == dg
    assert list(ds["state"]) == list(ts["state"])
    for i, entry in ds["state"].items():
        assert set(entry) == set(ts["state"][i]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
        assert entry["step"] == ts["state"][i]["step"].item() == 3
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            np.testing.assert_allclose(entry[k].numpy(), ts["state"][i][k].numpy(), rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("cls,kw", [("SGD", dict(lr=0.1, momentum=0.9, nesterov=True)), ("AdamW", dict(lr=0.02)),
                                    ("Adam", dict(lr=0.02, amsgrad=True))])
def test_state_dict_round_trip_resumes_identically(backend, tmp_path, cls, kw):
    """Three steps, a checkpoint through dtm.save, a fresh model and optimizer loaded from
    it and three more steps: the same weights as six steps in one run, bit for bit; the
    schedule resumes too."""
    dm, _ = models()
    dopt = getattr(dtm.optim, cls)(dm.parameters(), **kw)
    dsch = dsched.StepLR(dopt, step_size=2, gamma=0.5)
    train(dm, dopt, 3, dsch=dsch)
    path = str(tmp_path / "ckpt.safetensors")
    dtm.save({"model": dm.state_dict(), "optim": dopt.state_dict(), "sched": dsch.state_dict()}, path)
    train(dm, dopt, 3, first=3, dsch=dsch)

    resumed, _ = models()
    ropt = getattr(dtm.optim, cls)(resumed.parameters(), lr=1.0)
    rsch = dsched.StepLR(ropt, step_size=2, gamma=0.5)
    ckpt = dtm.load(path)
    resumed.load_state_dict(ckpt["model"])
    ropt.load_state_dict(ckpt["optim"])
    rsch.load_state_dict(ckpt["sched"])
    assert ropt.param_groups[0]["lr"] == dopt.state_dict()["param_groups"][0]["lr"] * 4  # two halvings to come
    train(resumed, ropt, 3, first=3, dsch=rsch)
    for (n, p), (_, q) in zip(dm.named_parameters(), resumed.named_parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=n)
    assert ropt.state_dict()["param_groups"] == dopt.state_dict()["param_groups"]


@pytest.mark.parametrize("cls,kw", [("Adam", dict(lr=0.02, weight_decay=0.1, amsgrad=True)),
                                    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1))])
def test_resume_from_torchs_state_dict(backend, cls, kw):
    """torch trains three steps; dtm takes its weights and optimizer state_dict and both go
    on for three more: the same weights."""
    dm, tm = models()
    topt = getattr(torch.optim, cls)(tm.parameters(), **kw)
    train_torch(tm, topt, 3)
    dm.load_state_dict({k: v.detach().numpy() for k, v in tm.state_dict().items()})
    dopt = getattr(dtm.optim, cls)(dm.parameters(), lr=1.0)
    dopt.load_state_dict(topt.state_dict())
    train(dm, dopt, 3, first=3)
    for i in range(3, 6):
        _, _, x, y = batch(i)
        topt.zero_grad()
        torch.nn.functional.mse_loss(tm(x), y).backward()
        topt.step()
    assert_same_params(dm, tm, 1e-9)


def test_load_state_dict_errors():
    dm, _ = models()
    opt = dtm.optim.Adam(dm.parameters())
    train(dm, opt, 1)
    state = opt.state_dict()
    other = dtm.optim.Adam(list(dm.parameters())[:2])
    for bad, target in ((state, other), ({"state": {}}, opt),
                        ({"state": {9: {}}, "param_groups": state["param_groups"]}, opt),
                        ({"state": {0: {"exp_avg": dtm.zeros(2)}}, "param_groups": state["param_groups"]}, opt)):
        with pytest.raises(dtm.TensorError) as e:
            target.load_state_dict(bad)
        assert e.value.where.startswith(__file__)


# --- learning-rate schedules --------------------------------------------------------------

def optimizers(cls="SGD", groups=1, **kw):
    """A dtm and a torch optimizer over one parameter per group, the second group at 3x lr."""
    def make(lib, param):
        ps = [param(lib.zeros(1)) for _ in range(groups)]
        return getattr(lib.optim, cls)([{"params": [p], "lr": 0.1 * (1 + 2 * i)} for i, p in enumerate(ps)], **kw)
    return make(dtm, dtm.nn.Parameter), make(torch, torch.nn.Parameter)


def trajectory(dopt, topt, dsch, tsch, steps, keys=("lr",)):
    got, want = [], []
    for t in range(steps + 1):
        if t:
            topt.step()
            tsch.step()
            dsch.step()
        got.append([[g[k] for k in keys] for g in dopt.param_groups])
        want.append([[g[k] for k in keys] for g in topt.param_groups])
        assert dsch.get_last_lr() == [g["lr"] for g in dopt.param_groups]
    np.testing.assert_allclose(np.array(got, dtype=np.float64), np.array(want, dtype=np.float64), rtol=1e-12,
                               atol=1e-15)


SCHEDULES = {
    "lambda": lambda s, o: s.LambdaLR(o, lambda t: 0.95 ** t + 0.1 * (t % 3)),
    "lambda-per-group": lambda s, o: s.LambdaLR(o, [lambda t: 1 / (t + 1), lambda t: 0.5 ** t]),
    "step": lambda s, o: s.StepLR(o, step_size=3, gamma=0.5),
    "linear": lambda s, o: s.LinearLR(o),
    "linear-decay": lambda s, o: s.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=12),
    "onecycle": lambda s, o: s.OneCycleLR(o, max_lr=[1.0, 2.0], total_steps=30),
    "onecycle-linear-3phase": lambda s, o: s.OneCycleLR(o, max_lr=0.5, epochs=3, steps_per_epoch=10, pct_start=0.25,
                                                        anneal_strategy="linear", three_phase=True),
    "cosine": lambda s, o: s.CosineAnnealingLR(o, T_max=10, eta_min=0.01),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedules_match_torch(name):
    dopt, topt = optimizers(groups=2, momentum=0.9)
    make = SCHEDULES[name]
    trajectory(dopt, topt, make(dsched, dopt), make(tsched, topt), 30,
               keys=("lr", "momentum") if "onecycle" in name else ("lr",))


def test_warmup_then_cosine_like_nanogpt():
    """nanoGPT's schedule: linear warm-up, then cosine decay to a floor."""
    dopt, topt = optimizers(groups=2)

    def make(s, o):
        return s.SequentialLR(o, [s.LinearLR(o, start_factor=0.01, total_iters=5),
                                  s.CosineAnnealingLR(o, T_max=20, eta_min=1e-3), s.StepLR(o, 4)],
                              milestones=[5, 25])
    trajectory(dopt, topt, make(dsched, dopt), make(tsched, topt), 40)


def test_onecycle_cycles_adams_beta1_into_the_steps(backend):
    """OneCycleLR with Adam: lr and beta1 change every step, and the replayed step
    program reads both (the weights follow torch's)."""
    dm, tm = models()
    dopt, topt = dtm.optim.Adam(dm.parameters()), torch.optim.Adam(tm.parameters())
    dsch = dsched.OneCycleLR(dopt, max_lr=0.05, total_steps=8)
    tsch = tsched.OneCycleLR(topt, max_lr=0.05, total_steps=8)
    assert dopt.param_groups[0]["betas"] == topt.param_groups[0]["betas"] == (0.95, 0.999)
    train(dm, dopt, 8, dsch=dsch)
    train_torch(tm, topt, 8, tsch=tsch)
    assert dopt.param_groups[0]["betas"] == pytest.approx(topt.param_groups[0]["betas"], rel=1e-12)
    assert_same_params(dm, tm, 1e-9)


def test_schedule_errors():
    dopt, _ = optimizers()
    for bad in (lambda: dsched.StepLR(dopt, 0), lambda: dsched.LinearLR(dopt, start_factor=0),
                lambda: dsched.OneCycleLR(dopt, 1.0), lambda: dsched.OneCycleLR(dopt, 1.0, 10, anneal_strategy="x"),
                lambda: dsched.OneCycleLR(dtm.optim.Optimizer([dtm.nn.Parameter(dtm.zeros(1))], dict(lr=0.1)), 1.0, 9),
                lambda: dsched.SequentialLR(dopt, [dsched.StepLR(dopt, 2)], milestones=[3]),
                lambda: dsched.LambdaLR(dopt, [lambda t: 1.0] * 2)):
        with pytest.raises(dtm.TensorError) as e:
            bad()
        assert e.value.where.startswith(__file__)
    sched = dsched.OneCycleLR(dopt, 1.0, total_steps=2)
    sched.step()
    sched.step()
    with pytest.raises(dtm.TensorError):
        sched.step()
