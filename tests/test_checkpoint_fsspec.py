"""Checkpoints behind an fsspec URL (spec 9.4.2): save, list, keep, load, verify and export
through fsspec's memory file system, whose files any fsspec user sees; an unfinished save
is invisible; the save lock is a lease (a live one refuses a second job, a stale one is
taken over). Values against numpy."""

from __future__ import annotations

import json
import time

import fsspec
import numpy as np
import pytest
from safetensors.numpy import load_file

import dtm
from dtm import nn
from dtm.ckpt.lock import LOCK, STALE_S
from dtm.errors import ErrorCode


@pytest.fixture
def url(request):
    name = f"memory://dtm-ckpt-{request.node.name}"
    yield name
    fsspec.filesystem("memory").rm(name.removeprefix("memory:/"), recursive=True)


def _model(seed: int) -> nn.Module:
    dtm.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_save_list_keep_load_verify_export_through_a_url(url, tmp_path):
    model = _model(0)
    want = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    for step in (1, 2, 3):
        dtm.checkpoint.save({"model": model, "step": step}, url, step=step, keep=2).wait()
    assert [c.step for c in dtm.checkpoint.list(url)] == [2, 3]
    fs = fsspec.filesystem("memory")
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url.removeprefix("memory:/"), detail=False))
    assert names == ["step-000000000002", "step-000000000003"]  # the lease went with the save
    other = _model(1)
    state = {"model": other, "step": None}
    dtm.checkpoint.load(state, url)
    assert state["step"] == 3
    for k, v in other.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), want[k])
    assert dtm.checkpoint.verify(url).ok
    files = dtm.checkpoint.export(url, tmp_path / "out")
    got = load_file(files["model"])
    np.testing.assert_array_equal(got["0.weight"], want["0.weight"])


def test_an_unfinished_save_behind_a_url_is_invisible(url):
    dtm.checkpoint.save({"w": np.ones(3, np.float32)}, url, step=1).wait()
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory:/")
    fs.pipe_file(f"{root}/step-000000000002/data/junk", b"half a save")  # no manifest
    assert [c.step for c in dtm.checkpoint.list(url)] == [1]
    state = {"w": np.zeros(3, np.float32)}
    dtm.checkpoint.load(state, url)
    assert state["w"].tolist() == [1, 1, 1]


def test_a_live_lease_refuses_a_second_job_and_a_stale_one_is_taken_over(url):
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory:/")
    lease = {"pid": 4242, "host": "elsewhere", "step": 9, "since": time.time(), "renewed": time.time(), "token": "x"}
    fs.pipe_file(f"{root}/{LOCK}", json.dumps(lease).encode())
    with pytest.raises(dtm.DTMError) as e:
        dtm.checkpoint.save({"w": np.ones(3, np.float32)}, url, step=1).wait()
    assert e.value.code is ErrorCode.CHECKPOINT_BUSY
    assert "process 4242 on host elsewhere, saving step 9" in e.value.message
    lease["renewed"] = time.time() - STALE_S - 1  # its holder died
    fs.pipe_file(f"{root}/{LOCK}", json.dumps(lease).encode())
    dtm.checkpoint.save({"w": np.ones(3, np.float32)}, url, step=1).wait()
    assert [c.step for c in dtm.checkpoint.list(url)] == [1]


def test_a_url_that_holds_nothing_is_not_a_checkpoint():
    with pytest.raises(dtm.DTMError) as e:
        dtm.checkpoint.load({"w": np.zeros(3, np.float32)}, "memory://dtm-ckpt-nothing-here")
    assert e.value.code is ErrorCode.NOT_A_CHECKPOINT
