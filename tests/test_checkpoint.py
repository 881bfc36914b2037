"""dtm.checkpoint (spec 9.4): save, load with resharding, list, keep, the errors a damaged
or mismatched checkpoint gives, and the `dtm checkpoint` commands."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

import dtm
from dtm import nn
from dtm.ckpt import (CheckpointChunkError, CheckpointExists, CheckpointKeyError, CheckpointTypeError,
                      CheckpointVersionError, NotACheckpoint)
from dtm.cli import main
from dtm.errors import DTMError, ErrorCode


def _model(seed: int) -> nn.Module:
    dtm.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


_X = np.random.default_rng(0).standard_normal((6, 16, 4)).astype(np.float32)
_Y = np.random.default_rng(1).standard_normal((6, 16, 2)).astype(np.float32)


def _train(model, opt, steps) -> list[float]:
    losses = []
    for i in steps:
        loss = nn.functional.mse_loss(model(dtm.tensor(_X[i])), dtm.tensor(_Y[i]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_model_and_adamw_resume_exactly(tmp_path):
    m = _model(0)
    opt = dtm.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    want = _train(m, opt, range(6))

    m = _model(0)
    opt = dtm.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    first = _train(m, opt, range(3))
    h = dtm.checkpoint.save({"model": m, "optim": opt, "step": 3, "extra": {"names": ["a", "b"], "lr": 0.5}},
                            tmp_path / "run", step=3)
    h.wait()
    assert h.done() and h.progress() == 1.0
    saved = {k: v.numpy().copy() for k, v in m.state_dict().items()}

    m2 = _model(7)  # other initial values, a fresh optimizer without state
    opt2 = dtm.optim.AdamW(m2.parameters(), lr=1.0, weight_decay=0.0)
    state = {"model": m2, "optim": opt2, "step": 0, "extra": None}
    dtm.checkpoint.load(state, tmp_path / "run")
    assert state["step"] == 3 and state["extra"] == {"names": ["a", "b"], "lr": 0.5}
    for k, v in m2.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), saved[k])
    assert opt2.param_groups[0]["lr"] == 1e-2
    rest = _train(m2, opt2, range(3, 6))
    assert first + rest == want  # exactly, step by step


def _distributed(a, axes, placements):
    dtm.devices(4)
    return dtm.distribute(dtm.tensor(a), dtm.Mesh(axes), placements)


def test_reshard_on_load_from_l0_mesh(tmp_path):
    w = np.arange(6 * 5, dtype=np.float32).reshape(6, 5)
    b = np.arange(7, dtype=np.int64)  # 7 not divisible by 2 or 3
    state = {"w": _distributed(w, {"dp": 2, "tp": 2}, [dtm.Shard(0), dtm.Shard(1)]),
             "b": _distributed(b, {"x": 2}, [dtm.Shard(0)]), "r": _distributed(w, {"x": 2}, [dtm.Replicate()])}
    dtm.checkpoint.save(state, tmp_path, step=10).wait()
    man = json.loads((tmp_path / "step-000000000010" / "manifest.json").read_text())
    t = {e["name"]: e for e in man["tensors"]}
    assert t["w"]["mesh"] == {"axes": [["dp", 2], ["tp", 2]]} and t["w"]["placements"] == ["shard(0)", "shard(1)"]
    assert len(t["w"]["chunks"]) == 4 and len(t["r"]["chunks"]) == 1  # a replica is written once

    other = {"w": _distributed(np.zeros_like(w), {"x": 3}, [dtm.Shard(1)]),
             "b": _distributed(np.zeros_like(b), {"x": 3}, [dtm.Shard(0)]),
             "r": _distributed(np.zeros_like(w), {"a": 2, "b": 2}, [dtm.Shard(1), dtm.Shard(0)])}
    dtm.checkpoint.load(other, tmp_path)
    assert other["w"].placements == (dtm.Shard(1),) and other["w"].device_mesh.shape == {"x": 3}
    np.testing.assert_array_equal(other["w"].numpy(), w)
    np.testing.assert_array_equal(other["b"].numpy(), b)
    np.testing.assert_array_equal(other["r"].numpy(), w)

    plain = {"w": dtm.zeros(6, 5), "b": dtm.zeros(7, dtype=dtm.int64), "r": dtm.zeros(6, 5)}
    dtm.checkpoint.load(plain, tmp_path)
    assert plain["w"].device_mesh is None
    np.testing.assert_array_equal(plain["w"].numpy(), w)
    np.testing.assert_array_equal(plain["b"].numpy(), b)


def test_list_and_keep(tmp_path):
    for step in (1, 2, 3, 4):
        dtm.checkpoint.save({"v": dtm.tensor(np.full(3, step, np.float32)), "s": step}, tmp_path, step=step,
                            keep=2).wait()
    got = dtm.checkpoint.list(tmp_path)
    assert [c.step for c in got] == [3, 4]
    assert all(c.size == 12 and c.time > 0 for c in got)
    assert sorted(os.listdir(tmp_path)) == [".save.lock", "step-000000000003", "step-000000000004"]
    state = {"v": dtm.zeros(3), "s": 0}
    dtm.checkpoint.load(state, tmp_path)
    assert state["s"] == 4 and state["v"].numpy().tolist() == [4, 4, 4]
    dtm.checkpoint.load(state, tmp_path, step=3)
    assert state["s"] == 3
    with pytest.raises(NotACheckpoint, match="step 2"):
        dtm.checkpoint.load(state, tmp_path, step=2)
    with pytest.raises(CheckpointExists):
        dtm.checkpoint.save({"s": 1}, tmp_path, step=4).wait()


def test_incomplete_checkpoint_is_invisible(tmp_path):
    dtm.checkpoint.save({"v": dtm.ones(2)}, tmp_path, step=1).wait()
    dtm.checkpoint.save({"v": dtm.full((2,), 2.0)}, tmp_path, step=2).wait()
    os.remove(tmp_path / "step-000000000002" / "manifest.json")  # as a save killed before its commit
    assert [c.step for c in dtm.checkpoint.list(tmp_path)] == [1]
    state = {"v": dtm.zeros(2)}
    dtm.checkpoint.load(state, tmp_path)
    assert state["v"].numpy().tolist() == [1, 1]
    dtm.checkpoint.save({"v": dtm.full((2,), 3.0)}, tmp_path, step=2).wait()  # the leftover is replaced
    dtm.checkpoint.load(state, tmp_path)
    assert state["v"].numpy().tolist() == [3, 3]


def test_background_error_raises_from_wait_and_next_save(tmp_path):
    (tmp_path / "file").write_text("x")
    h = dtm.checkpoint.save({"v": dtm.ones(2)}, tmp_path / "file", step=1)
    with pytest.raises(DTMError):
        h.wait()
    assert h.done()
    h = dtm.checkpoint.save({"v": dtm.ones(2)}, tmp_path / "file", step=2)
    with pytest.raises(DTMError):  # not waited for: the next save raises it
        dtm.checkpoint.save({"v": dtm.ones(2)}, tmp_path / "ok", step=1)
    dtm.checkpoint.save({"v": dtm.ones(2)}, tmp_path / "ok", step=1).wait()


def test_values_copied_before_save_returns(tmp_path):
    v = dtm.tensor(np.arange(4, dtype=np.float32))
    h = dtm.checkpoint.save({"v": v}, tmp_path, step=1)
    v.add_(100.0)
    v.realize()
    h.wait()
    state = {"v": dtm.zeros(4)}
    dtm.checkpoint.load(state, tmp_path)
    assert state["v"].numpy().tolist() == [0, 1, 2, 3]


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_background_writer_runs_on_idle_cpu_time(tmp_path, monkeypatch):
    import threading
    from dtm.ckpt import manifest

    seen = []
    write = manifest.write
    monkeypatch.setattr(manifest, "write", lambda *a: seen.append(
        (threading.current_thread().name, os.sched_getscheduler(0))) or write(*a))
    dtm.checkpoint.save({"v": dtm.ones(2)}, tmp_path, step=1).wait()
    assert seen == [("dtm-checkpoint-1", os.SCHED_IDLE)]  # the manifest, written on the writer thread
    assert os.sched_getscheduler(0) == os.SCHED_OTHER     # the caller's thread keeps its policy


# --- bad input ---------------------------------------------------------------------------

@pytest.fixture
def ckpt(tmp_path):
    m = _model(0)
    dtm.checkpoint.save({"model": m, "step": 5}, tmp_path, step=5).wait()
    return tmp_path, tmp_path / "step-000000000005"


def _entry(step_dir, name):
    man = json.loads((step_dir / "manifest.json").read_text())
    return next(e for e in man["tensors"] if e["name"] == name)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(NotACheckpoint) as e:
        dtm.checkpoint.load({"s": 0}, tmp_path)
    assert e.value.code is ErrorCode.NOT_A_CHECKPOINT and str(tmp_path) in str(e.value)
    with pytest.raises(NotACheckpoint):
        dtm.checkpoint.load({"s": 0}, tmp_path / "absent")
    with pytest.raises(NotACheckpoint):
        dtm.checkpoint.list(tmp_path / "absent")


def test_newer_major_version(ckpt):
    root, d = ckpt
    man = json.loads((d / "manifest.json").read_text())
    man["format_version"] = "2.0"
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CheckpointVersionError, match="2.0") as e:
        dtm.checkpoint.load({"model": _model(1), "step": 0}, root)
    assert e.value.code is ErrorCode.UNSUPPORTED_VERSION


def test_manifest_that_does_not_parse(ckpt):
    root, d = ckpt
    (d / "manifest.json").write_text("{not json")
    with pytest.raises(DTMError) as e:
        dtm.checkpoint.load({"model": _model(1), "step": 0}, root)
    assert e.value.code is ErrorCode.CHECKPOINT_INVALID and "manifest.json" in str(e.value)


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped"])
def test_damaged_chunk_is_named_and_nothing_loaded(ckpt, damage):
    root, d = ckpt
    chunk = _entry(d, "model/0.weight")["chunks"][0]["file"]
    path = d / chunk
    raw = bytearray(path.read_bytes())
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(raw[:-5])
    else:
        raw[3] ^= 0x10
        path.write_bytes(raw)
    m = _model(1)
    before = {k: v.numpy().copy() for k, v in m.state_dict().items()}
    state = {"model": m, "step": 0}
    with pytest.raises(CheckpointChunkError) as e:
        dtm.checkpoint.load(state, root)
    assert e.value.code is ErrorCode.STORE_CHUNK_CORRUPT
    assert "model/0.weight" in str(e.value) and chunk in str(e.value)
    assert state["step"] == 0  # nothing was loaded
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), before[k])
    r = CliRunner().invoke(main, ["checkpoint", "verify", str(root)])
    assert r.exit_code == 1 and "model/0.weight" in r.output


def test_missing_and_unexpected_keys(ckpt):
    root, _ = ckpt
    with pytest.raises(CheckpointKeyError) as e:
        dtm.checkpoint.load({"model": nn.Sequential(nn.Linear(4, 8)), "other": 1}, root)
    assert e.value.code is ErrorCode.CHECKPOINT_KEYS
    assert e.value.missing == ["other"]
    assert e.value.unexpected == ["model/2.bias", "model/2.weight", "step"]
    state = {"model": nn.Sequential(nn.Linear(4, 8)), "other": 1}
    dtm.checkpoint.load(state, root, strict=False)  # loads what both hold
    assert state["other"] == 1


def test_shape_and_dtype_mismatch(ckpt):
    root, _ = ckpt
    with pytest.raises(CheckpointTypeError) as e:
        dtm.checkpoint.load({"model": nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 2)), "step": 0}, root)
    assert e.value.code is ErrorCode.SHAPE_MISMATCH and "model/0.weight" in str(e.value)
    assert "[8, 4]" in str(e.value) and "[9, 4]" in str(e.value)
    with pytest.raises(CheckpointTypeError) as e:
        dtm.checkpoint.load({"model": _model(1).double(), "step": 0}, root)
    assert e.value.code is ErrorCode.DTYPE_MISMATCH and "f32" in str(e.value) and "f64" in str(e.value)


# --- the commands ------------------------------------------------------------------------

def test_cli_ls_info_verify(ckpt):
    root, _ = ckpt
    dtm.checkpoint.save({"w": _distributed(np.ones((4, 2), np.float32), {"dp": 2}, [dtm.Shard(0)])}, root,
                        step=7).wait()
    r = CliRunner().invoke(main, ["checkpoint", "ls", str(root)])
    assert r.exit_code == 0, r.output
    assert "5" in r.output and "7" in r.output and "dp=2" in r.output
    r = CliRunner().invoke(main, ["checkpoint", "info", str(root), "--step", "5"])
    assert r.exit_code == 0 and "model/0.weight" in r.output and "f32[8, 4]" in r.output
    r = CliRunner().invoke(main, ["checkpoint", "info", str(root)])
    assert r.exit_code == 0 and "shard(0)" in r.output
    r = CliRunner().invoke(main, ["checkpoint", "verify", str(root)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["checkpoint", "ls", str(root / "nothing")])
    assert r.exit_code == 1 and "E1401" in r.output


def test_a_sharded_model_loads_its_pieces_without_gathering(tmp_path, monkeypatch):
    """FSDP over 2 L0 devices, saved and loaded into another FSDP model: each parameter takes
    the pieces read for its own layout; no value is gathered whole on the way."""
    from dtm.parallel.fsdp import fsdp

    mesh = dtm.Mesh({"dp": 2})
    m = fsdp(_model(0), mesh)
    want = {k: v.numpy().copy() for k, v in m.state_dict().items()}
    dtm.checkpoint.save({"model": m}, tmp_path, step=1).wait()
    m2 = fsdp(_model(5), mesh)
    gathered = []
    numpy = dtm.Tensor.numpy
    monkeypatch.setattr(dtm.Tensor, "numpy", lambda t: gathered.append(t.device_mesh) or numpy(t))
    dtm.checkpoint.load({"model": m2}, tmp_path)
    monkeypatch.undo()
    assert not [g for g in gathered if g is not None]
    for k, v in m2.state_dict().items():
        assert v.device_mesh is not None and v.placements == m.state_dict()[k].placements
        np.testing.assert_array_equal(v.numpy(), want[k])


def test_adamw_state_loads_into_a_fresh_optimizer_piece_by_piece(tmp_path, monkeypatch):
    """A fresh AdamW holds no state tensors to lay the saved ones out by: each is read for
    its parameter's layout (the optimizer's `checkpoint_layouts`), with no value gathered
    whole; training then goes on as the uninterrupted run does."""
    from dtm.parallel.fsdp import fsdp

    mesh = dtm.Mesh({"dp": 2})
    m = fsdp(_model(0), mesh)
    opt = dtm.optim.AdamW(m.parameters(), lr=1e-2)
    _train(m, opt, [0, 1])
    dtm.checkpoint.save({"model": m, "optim": opt}, tmp_path, step=2).wait()
    want = _train(m, opt, [2, 3])
    m2 = fsdp(_model(5), mesh)
    opt2 = dtm.optim.AdamW(m2.parameters(), lr=1e-2)
    from dtm.store.store import Store

    gathered, whole = [], []
    numpy, get_array = dtm.Tensor.numpy, Store.get_array
    monkeypatch.setattr(dtm.Tensor, "numpy", lambda t: gathered.append(t.device_mesh) or numpy(t))
    monkeypatch.setattr(Store, "get_array", lambda st, key, *a, **k: whole.append(key) or get_array(st, key, *a, **k))
    dtm.checkpoint.load({"model": m2, "optim": opt2}, tmp_path)
    monkeypatch.undo()
    assert not [g for g in gathered if g is not None]
    read_whole = {t["name"] for t in dtm.checkpoint.read_manifest(tmp_path)["tensors"] if t["key"] in whole}
    assert not {n for n in read_whole if n.endswith(("exp_avg", "exp_avg_sq"))}, read_whole
    for s in opt2.state_dict()["state"].values():
        assert s["exp_avg"].device_mesh is mesh and s["exp_avg"].placements == (dtm.Shard(0),)
    np.testing.assert_allclose(_train(m2, opt2, [2, 3]), want, rtol=1e-6)


def test_export_writes_safetensors_and_a_gpt2_transformers_loads(tmp_path):
    """`dtm checkpoint export`: a GPT-2 and its AdamW state saved in training; the model comes
    out as a directory transformers' GPT2LMHeadModel.from_pretrained reads (same logits), the
    optimizer as a safetensors file with its state."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    from dtm.models.gpt2 import GPT2, GPT2Config

    dtm.manual_seed(0)
    m = GPT2(GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4))
    opt = dtm.optim.AdamW(m.parameters(), lr=1e-2)
    ids = np.random.default_rng(0).integers(0, 50, (2, 16))
    nn.functional.cross_entropy(m(dtm.tensor(ids[:, :-1])).reshape(-1, 50), dtm.tensor(ids[:, 1:]).reshape(-1)).backward()
    opt.step()
    dtm.checkpoint.save({"model": m, "optim": opt, "step": 1}, tmp_path / "run", step=1).wait()

    result = CliRunner().invoke(main, ["checkpoint", "export", str(tmp_path / "run"), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "out" / "model")).eval()
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    with dtm.no_grad():
        got = m(dtm.tensor(ids)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    optim = load_file(str(tmp_path / "out" / "optim.safetensors"))
    n = len(list(m.parameters()))
    assert sum(k.endswith(".exp_avg") for k in optim) == sum(k.endswith(".exp_avg_sq") for k in optim) == n, \
        sorted(optim)[:6]
