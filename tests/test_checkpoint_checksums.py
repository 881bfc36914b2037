"""End-to-end checksums of checkpoints (spec 9.4.9): each tensor's CRC32C, computed at save
from the frozen copy and kept in the manifest, is checked on load after the tensor is read,
so a bit flipped in memory after a chunk's own CRC check is caught with E1008 naming the
tensor and the checkpoint, and the state is left as it was. CRCs from the crc32c package."""

from __future__ import annotations

import numpy as np
import pytest
from crc32c import crc32c

import dtm
from dtm.ir.types import Shard
from dtm.protocol.checksums import ENV, TensorChecksumMismatch
from test_checksums_store import flip_decoded_chunks  # this folder is on sys.path

W = (np.arange(40 * 30, dtype=np.float32) / 9).reshape(40, 30)


def test_the_manifest_carries_each_tensors_crc_from_the_frozen_copy(tmp_path):
    x = dtm.tensor(W)
    h = dtm.checkpoint.save({"w": x, "step": 3}, tmp_path / "run", step=3)
    x.copy_(dtm.zeros(40, 30))  # after save returned: the frozen copy is what is written
    h.wait()
    (t,) = dtm.checkpoint.read_manifest(tmp_path / "run")["tensors"]
    assert t["checksum"] == f"{crc32c(W.tobytes()):08x}"


def test_a_load_catches_a_bit_flipped_after_reading_and_changes_nothing(tmp_path, monkeypatch):
    dtm.checkpoint.save({"w": dtm.tensor(W), "step": 3}, tmp_path / "run", step=3).wait()
    state = {"w": dtm.zeros(40, 30), "step": 0}
    dtm.checkpoint.load(state, tmp_path / "run")
    np.testing.assert_array_equal(state["w"].numpy(), W)
    flip_decoded_chunks(monkeypatch)
    state = {"w": dtm.zeros(40, 30), "step": 0}
    with pytest.raises(TensorChecksumMismatch) as e:
        dtm.checkpoint.load(state, tmp_path / "run")
    damaged = W.copy()
    damaged.reshape(-1).view(np.uint8)[0] ^= 1
    assert (e.value.expected, e.value.found) == (crc32c(W.tobytes()), crc32c(damaged.tobytes()))
    for part in ("E1008", "load of tensor 'w' of checkpoint", "step-", "nothing in the state was changed"):
        assert part in str(e.value), (part, str(e.value))
    assert state["step"] == 0 and not state["w"].numpy().any()
    monkeypatch.setenv(ENV, "0")  # off: the damaged copy is what the check alone stopped
    dtm.checkpoint.load(state, tmp_path / "run")
    np.testing.assert_array_equal(state["w"].numpy(), damaged)


def test_a_distributed_load_checks_its_pieces(tmp_path, monkeypatch):
    mesh = dtm.Mesh({"x": 2})
    dtm.checkpoint.save({"w": dtm.distribute(W, mesh, [Shard(0)])}, tmp_path / "run", step=1).wait()
    flip_decoded_chunks(monkeypatch)
    state = {"w": dtm.distribute(np.zeros_like(W), mesh, [Shard(1)])}
    with pytest.raises(TensorChecksumMismatch) as e:
        dtm.checkpoint.load(state, tmp_path / "run")
    assert e.value.expected == crc32c(W.tobytes())
    assert "load of tensor 'w' of checkpoint" in str(e.value), str(e.value)
    assert not state["w"].numpy().any()
