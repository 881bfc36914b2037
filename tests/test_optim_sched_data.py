"""Issue 30's optim, schedule and data items against torch 2.13: RMSprop and Adagrad take
torch's steps (eagerly and inside a dtm.jit step) and read and write torch's state_dict;
MultiStepLR, ExponentialLR, ConstantLR, OneCycleLR (over RMSprop's momentum) and
ReduceLROnPlateau give torch's learning rates, also into jitted steps; dtm.utils.data's
Dataset, TensorDataset, DataLoader (shuffle, drop_last, workers) and default_collate give
torch's batches, and a DataLoader reads a dtm.data.Loader."""

from __future__ import annotations

import collections
import os
import time

import numpy as np
import pytest
import torch
import torch.utils.data as tdata
from test_optim_parity import (assert_same_params, backend, batch, models, optimizers,  # noqa: F401 - a fixture
                               train, train_torch, trajectory)

import dtm
import dtm.nn.functional as F
from dtm.optim import lr_scheduler as dsched
from dtm.utils import data as ddata

tsched = torch.optim.lr_scheduler

OPTIMIZERS = {
    "rmsprop": ("RMSprop", dict(lr=0.01)),
    "rmsprop-all": ("RMSprop", dict(lr=0.01, alpha=0.9, eps=1e-6, weight_decay=0.1, momentum=0.9, centered=True)),
    "rmsprop-momentum": ("RMSprop", dict(lr=0.005, momentum=0.5)),
    "adagrad": ("Adagrad", dict(lr=0.1)),
    "adagrad-all": ("Adagrad", dict(lr=0.1, lr_decay=0.05, weight_decay=0.1, initial_accumulator_value=0.5,
                                    eps=1e-8)),
}


def both(name, dm, tm):
    cls, kw = OPTIMIZERS[name]
    return getattr(dtm.optim, cls)(dm.parameters(), **kw), getattr(torch.optim, cls)(tm.parameters(), **kw)


def train_jitted(dm, dopt, steps, dsch=None, plateau=False):
    """`train`'s steps as one dtm.jit program, the schedule stepped between calls (with the
    loss, for ReduceLROnPlateau)."""
    @dtm.jit
    def step(x, y):
        loss = F.mse_loss(dm(x), y)
        loss.backward()
        dopt.step()
        dopt.zero_grad()
        return loss

    for i in range(steps):
        x, y, _, _ = batch(i)
        loss = step(x, y)
        if dsch is not None:
            dsch.step(loss.item()) if plateau else dsch.step()
    assert len(step.cache) == 1  # traced once, replayed after


def train_torch_plateau(tm, topt, tsch, steps):
    for i in range(steps):
        _, _, x, y = batch(i)
        topt.zero_grad()
        loss = torch.nn.functional.mse_loss(tm(x), y)
        loss.backward()
        topt.step()
        tsch.step(loss.item())


# --- RMSprop and Adagrad ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_steps_match_torch(backend, name, dtype):
    dm, tm = models(dtype)
    dopt, topt = both(name, dm, tm)
    train(dm, dopt, 6, dtype=dtype)
    train_torch(tm, topt, 6, dtype=dtype)
    assert_same_params(dm, tm, 1e-9 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("name", ["rmsprop-all", "adagrad-all"])
def test_jitted_steps_match_torch(backend, name):
    """The step inside dtm.jit, with an lr changed by ExponentialLR between calls (and
    Adagrad's lr_decay from the step count) replayed right."""
    dm, tm = models()
    dopt, topt = both(name, dm, tm)
    train_jitted(dm, dopt, 5, dsch=dsched.ExponentialLR(dopt, 0.8))
    train_torch(tm, topt, 5, tsch=tsched.ExponentialLR(topt, 0.8))
    assert_same_params(dm, tm, 1e-9)


@pytest.mark.parametrize("name", ["rmsprop-all", "adagrad-all"])
def test_state_dict_is_torchs_and_resumes_from_torchs(backend, name):
    """Three steps: the same state_dict as torch's; a fresh optimizer loaded from torch's
    takes steps four to six as torch does."""
    dm, tm = models()
    dopt, topt = both(name, dm, tm)
    if name.startswith("adagrad"):  # as torch, Adagrad's state exists before the first step
        assert dopt.state_dict()["state"][0]["step"] == topt.state_dict()["state"][0]["step"].item() == 0
    train(dm, dopt, 3)
    train_torch(tm, topt, 3)
    ds, ts = dopt.state_dict(), topt.state_dict()
    assert list(ds["state"]) == list(ts["state"])
    for i, entry in ds["state"].items():
        assert set(entry) == set(ts["state"][i])
        for k, v in entry.items():
            want = ts["state"][i][k]
            np.testing.assert_allclose(v if k == "step" else v.numpy(), want.numpy(), rtol=1e-9, atol=1e-15)
    for dg, tg in zip(ds["param_groups"], ts["param_groups"]):
        assert {k: v for k, v in tg.items() if k in dg} == dg

    resumed, _ = models()
    resumed.load_state_dict({k: v.detach().numpy() for k, v in tm.state_dict().items()})
    ropt = getattr(dtm.optim, OPTIMIZERS[name][0])(resumed.parameters(), lr=1.0)
    ropt.load_state_dict(ts)
    train(resumed, ropt, 3, first=3)
    _, straight = models()  # torch's six steps in one run
    train_torch(straight, both(name, dm, straight)[1], 6)
    assert_same_params(resumed, straight, 1e-9)


# --- schedules ------------------------------------------------------------------------------

SCHEDULES = {
    "multistep": lambda s, o: s.MultiStepLR(o, milestones=[12, 3, 7, 7], gamma=0.5),
    "exponential": lambda s, o: s.ExponentialLR(o, gamma=0.9),
    "constant": lambda s, o: s.ConstantLR(o, factor=0.25, total_iters=4),
    "onecycle-cos": lambda s, o: s.OneCycleLR(o, max_lr=[1.0, 2.0], total_steps=30, base_momentum=0.8),
    "onecycle-linear": lambda s, o: s.OneCycleLR(o, max_lr=0.5, total_steps=30, anneal_strategy="linear"),
    "onecycle-3phase": lambda s, o: s.OneCycleLR(o, max_lr=0.5, epochs=3, steps_per_epoch=10, pct_start=0.25,
                                                 three_phase=True),
    "onecycle-no-momentum": lambda s, o: s.OneCycleLR(o, max_lr=0.5, total_steps=30, cycle_momentum=False),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedules_match_torch(name):
    """30 steps of each schedule over RMSprop (whose momentum OneCycleLR cycles)."""
    dopt, topt = optimizers("RMSprop", groups=2, momentum=0.9)
    make = SCHEDULES[name]
    trajectory(dopt, topt, make(dsched, dopt), make(tsched, topt), 30, keys=("lr", "momentum"))


def test_onecycle_over_adagrad_without_momentum():
    dopt, topt = optimizers("Adagrad")
    make = SCHEDULES["onecycle-no-momentum"]
    trajectory(dopt, topt, make(dsched, dopt), make(tsched, topt), 30)
    with pytest.raises(dtm.TensorError):
        dsched.OneCycleLR(dopt, max_lr=0.5, total_steps=30)  # torch: ValueError, no momentum to cycle


def test_onecycle_cycles_rmsprops_momentum_into_jitted_steps(backend):
    dm, tm = models()
    dopt, topt = both("rmsprop-momentum", dm, tm)
    train_jitted(dm, dopt, 8, dsch=dsched.OneCycleLR(dopt, max_lr=0.02, total_steps=8))
    train_torch(tm, topt, 8, tsch=tsched.OneCycleLR(topt, max_lr=0.02, total_steps=8))
    assert dopt.param_groups[0]["momentum"] == pytest.approx(topt.param_groups[0]["momentum"], rel=1e-12)
    assert_same_params(dm, tm, 1e-9)


PLATEAUS = {
    "min-rel": dict(),
    "min-abs-cooldown": dict(patience=2, threshold=0.05, threshold_mode="abs", cooldown=3, factor=0.5),
    "max-rel-floor": dict(mode="max", patience=1, factor=0.3, min_lr=[0.02, 0.05]),
    "max-abs-eps": dict(mode="max", patience=0, threshold=0.1, threshold_mode="abs", min_lr=0.0999, eps=1e-3),
}


@pytest.mark.parametrize("name", list(PLATEAUS))
def test_reduce_lr_on_plateau_matches_torch(name):
    """A metric with improvements, plateaus and noise: the same lrs at each of 40 steps;
    a scheduler loaded from a state_dict halfway goes on alike."""
    metrics = np.concatenate([np.linspace(1, 0.5, 8), np.full(6, 0.5), 0.5 + 0.01 * np.sin(np.arange(12)),
                              np.linspace(0.5, 2, 14)])
    dopt, topt = optimizers("RMSprop", groups=2)
    dsch, tsch = dsched.ReduceLROnPlateau(dopt, **PLATEAUS[name]), tsched.ReduceLROnPlateau(topt, **PLATEAUS[name])
    got, want = [], []
    for t, m in enumerate(metrics):
        if t == 20:
            saved = dsch.state_dict()
            dsch = dsched.ReduceLROnPlateau(dopt)
            dsch.load_state_dict(saved)
        dsch.step(dtm.tensor(m))
        tsch.step(m)
        got.append([g["lr"] for g in dopt.param_groups])
        want.append([g["lr"] for g in topt.param_groups])
        assert dsch.get_last_lr() == got[-1]
    assert got == want
    assert len({tuple(lrs) for lrs in want}) > 1  # it did reduce


def test_reduce_lr_on_plateau_into_jitted_steps(backend):
    dm, tm = models()
    dopt, topt = both("rmsprop-momentum", dm, tm)
    kw = dict(mode="max", patience=1, factor=0.5)  # the loss falls: every step is a bad one
    train_jitted(dm, dopt, 6, dsch=dsched.ReduceLROnPlateau(dopt, **kw), plateau=True)
    train_torch_plateau(tm, topt, tsched.ReduceLROnPlateau(topt, **kw), 6)
    assert dopt.param_groups[0]["lr"] == topt.param_groups[0]["lr"] < OPTIMIZERS["rmsprop-momentum"][1]["lr"]
    assert_same_params(dm, tm, 1e-9)


def test_schedule_errors():
    dopt, _ = optimizers()
    for bad in (lambda: dsched.ConstantLR(dopt, factor=1.5), lambda: dsched.ReduceLROnPlateau(dopt, factor=1.0),
                lambda: dsched.ReduceLROnPlateau(dopt, mode="up"),
                lambda: dsched.ReduceLROnPlateau(dopt, threshold_mode="x"),
                lambda: dsched.ReduceLROnPlateau(dopt, min_lr=[0.1, 0.2]), lambda: dsched.ExponentialLR(None, 0.5)):
        with pytest.raises(dtm.TensorError) as e:
            bad()
        assert e.value.where.startswith(__file__)


# --- dtm.utils.data -----------------------------------------------------------------------

X = np.arange(22 * 3, dtype=np.float32).reshape(22, 3)
Y = np.arange(22, dtype=np.int64) % 4
WAIT = 60  # seconds: no test waits longer for a worker


def datasets():
    return (ddata.TensorDataset(dtm.tensor(X), dtm.tensor(Y)),
            tdata.TensorDataset(torch.tensor(X), torch.tensor(Y)))


def as_numpy(batch):
    """A batch with its dtm or torch tensors as numpy, for comparing structures."""
    if isinstance(batch, (dtm.Tensor, torch.Tensor)):
        return batch.numpy()
    if isinstance(batch, dict):
        return {k: as_numpy(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(as_numpy(v) for v in batch) if not hasattr(batch, "_fields") else \
            type(batch)(*(as_numpy(v) for v in batch))
    return batch


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_equal(as_numpy(g), as_numpy(w))
        for a, b in zip(g, w):
            assert a.numpy().dtype == b.numpy().dtype


@pytest.mark.parametrize("kw", [dict(batch_size=5), dict(batch_size=5, drop_last=True), dict(batch_size=None),
                                dict(batch_size=22), dict(batch_size=4, num_workers=2, timeout=WAIT)],
                         ids=["5", "5-drop", "unbatched", "all", "workers"])
def test_tensor_dataset_batches_match_torch(kw):
    dset, tset = datasets()
    assert len(dset) == len(tset) == 22
    got, want = ddata.DataLoader(dset, **kw), tdata.DataLoader(tset, **kw)
    assert len(got) == len(want)
    assert_same_batches(list(got), list(want))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffle_is_a_permutation_repeatable_from_a_seed(num_workers):
    dset, _ = datasets()

    def passes(generator, n=2):
        loader = ddata.DataLoader(dset, batch_size=4, shuffle=True, generator=generator, num_workers=num_workers,
                                  timeout=WAIT)
        return [np.concatenate([x.numpy()[:, 0] // 3 for x, _ in loader]).astype(int) for _ in range(n)]

    first, second = passes(7)
    assert sorted(first) == sorted(second) == list(range(22))
    assert list(first) != list(second) != list(range(22))  # a fresh order each pass
    for again in (passes(7), passes(dtm.Generator().manual_seed(7))):
        np.testing.assert_array_equal(again, [first, second])
    assert list(passes(8, 1)[0]) != list(first)


Point = collections.namedtuple("Point", "x y")


def test_default_collate_matches_torch():
    samples = [{"a": i, "b": float(i) / 3, "c": np.full((2,), i, np.int32), "name": f"s{i}", "ok": i % 2 == 0,
                "pair": (i, [np.float32(i), dtm.tensor([i, i])]), "pt": Point(i, 2.5 * i)} for i in range(3)]
    torch_samples = [{**s, "pair": (s["pair"][0], [s["pair"][1][0], torch.tensor([i, i])])}
                     for i, s in enumerate(samples)]
    got, want = ddata.default_collate(samples), tdata.default_collate(torch_samples)
    assert isinstance(got["pair"], list) and isinstance(got["pt"], Point)
    np.testing.assert_equal(as_numpy(got), as_numpy(want))
    for k in ("a", "b", "c", "ok"):
        assert got[k].numpy().dtype == want[k].numpy().dtype
    with pytest.raises(dtm.TensorError):
        ddata.default_collate([[1, 2], [3]])


class Items(ddata.Dataset):
    """Item i is (i, i squared as numpy); item `bad` raises, `die` kills its worker and
    `slow` sleeps."""

    def __init__(self, bad=-1, die=-1, slow=-1):
        self.bad, self.die, self.slow = bad, die, slow

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == self.bad:
            raise KeyError(f"no item {i}")
        if i == self.die:
            os._exit(3)
        if i == self.slow:
            time.sleep(30)
        return i, np.array([i * i])


def test_a_custom_dataset_in_workers_matches_torch():
    got = list(ddata.DataLoader(Items(), batch_size=3, num_workers=2, timeout=WAIT))
    want = list(tdata.DataLoader(Items(), batch_size=3))
    assert_same_batches(got, want)


def test_a_worker_exception_is_raised_with_its_type_and_worker():
    with pytest.raises(KeyError, match="no item 5") as e:
        list(ddata.DataLoader(Items(bad=5), batch_size=2, num_workers=2, timeout=WAIT))
    assert "DataLoader worker 0" in str(e.value)  # batch 2 of [4, 5] went to worker 0


def test_a_dead_worker_is_named():
    start = time.monotonic()
    with pytest.raises(dtm.DTMError) as e:
        list(ddata.DataLoader(Items(die=3), batch_size=2, num_workers=2, timeout=WAIT))
    assert e.value.code == dtm.ErrorCode.WORKER_LOST and "worker 1" in e.value.message
    assert "exit code 3" in e.value.message and time.monotonic() - start < WAIT


def test_a_silent_worker_times_out_naming_it():
    with pytest.raises(dtm.DTMError) as e:
        list(ddata.DataLoader(Items(slow=2), batch_size=2, num_workers=2, timeout=1))
    assert e.value.code == dtm.ErrorCode.TIMEOUT and "worker 1" in e.value.message and "batch 1" in e.value.message


def test_a_data_loader_reads_a_dtm_data_loader(tmp_path):
    from dtm.data import Loader, ingest
    from test_data_ingest import ints

    files = []
    for i in range(2):
        files.append(str(tmp_path / f"f{i}.txt"))
        open(files[-1], "w").write(" ".join(str(100 * i + j) for j in range(50)))
    st = dtm.store.open(str(tmp_path / "store"))
    ingest(files, ints, "corpus", workers=0, store=st)
    with Loader(st, "corpus", batch_size=2, block_size=8, seed=3) as loader, \
            Loader(st, "corpus", batch_size=2, block_size=8, seed=3, numpy=True) as same:
        dl = ddata.DataLoader(loader)
        assert len(dl) == loader.windows // 2
        stream = [x.numpy() for _ in range(2) for x, _ in dl]
        assert len(stream) == 2 * len(dl)
        np.testing.assert_array_equal(stream, [next(same)[0] for _ in range(2 * len(dl))])
        with pytest.raises(dtm.TensorError):
            ddata.DataLoader(loader, num_workers=2)
