"""dtm.save / dtm.load: nested structures of tensors and plain values round-trip through
one safetensors file (tensors) with the structure as JSON in its metadata, never pickle;
bad objects and damaged files raise DTMErrors."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch

import dtm
from dtm.nn.serialization import FORMAT


def test_nested_round_trip(tmp_path):
    shared = dtm.tensor([[1.0, 2.0]])
    obj = {
        "a": [dtm.arange(5), dtm.tensor(np.array([1.5, -2], dtype=ml_dtypes.bfloat16)), (1, "x", None)],
        "flags": {"on": True, "off": False, 3: -7, "inf": float("inf"), "big": 2 ** 70},
        "scalar": dtm.tensor(3.25, dtype="f64"),
        "mask": dtm.tensor([True, False]),
        "tied": [shared, shared],
        "empty": {}, "nothing": [],
    }
    path = str(tmp_path / "obj.safetensors")
    dtm.save(obj, path)
    back = dtm.load(path)
    assert list(back) == list(obj)
    assert back["flags"] == obj["flags"] and back["empty"] == {} and back["nothing"] == []
    assert back["a"][2] == (1, "x", None) and isinstance(back["a"][2], tuple)
    for got, want in ((back["a"][0], obj["a"][0]), (back["a"][1], obj["a"][1]), (back["scalar"], obj["scalar"]),
                      (back["mask"], obj["mask"]), (back["tied"][0], shared)):
        assert got.dtype is want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert back["tied"][0] is back["tied"][1]  # stored once, loaded as one tensor


def test_model_state_dict_round_trip(tmp_path):
    tm = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    dm = dtm.nn.Sequential(dtm.nn.Linear(4, 3), dtm.nn.LayerNorm(3))
    dm.load_state_dict({k: v.detach().numpy() for k, v in tm.state_dict().items()})
    path = str(tmp_path / "model.safetensors")
    dtm.save(dm.state_dict(), path)
    fresh = dtm.nn.Sequential(dtm.nn.Linear(4, 3), dtm.nn.LayerNorm(3))
    fresh.load_state_dict(dtm.load(path))
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_array_equal(fresh(dtm.tensor(x)).numpy(), dm(dtm.tensor(x)).numpy())
    np.testing.assert_allclose(fresh(dtm.tensor(x)).numpy(), tm(torch.tensor(x)).detach().numpy(), rtol=1e-5,
                               atol=1e-6)


def test_plain_safetensors_file_loads_as_its_tensors(tmp_path):
    path = str(tmp_path / "m.safetensors")
    dtm.nn.Linear(2, 3).save(path)
    assert sorted(dtm.load(path)) == ["bias", "weight"]


def test_unsupported_objects_are_errors_at_the_users_line(tmp_path):
    path = str(tmp_path / "x.safetensors")
    for obj, what in (({"f": np.zeros(2)}, "ndarray"), ([object()], "object"), ({(1, 2): 3}, "key (1, 2)"),
                      ({True: 1}, "key True")):
        with pytest.raises(dtm.TensorError) as e:
            dtm.save(obj, path)
        assert e.value.code is dtm.ErrorCode.ATTRIBUTE_TYPE and what in str(e.value)
        assert e.value.where.startswith(__file__)
    assert not (tmp_path / "x.safetensors").exists()


def _write(path, tensors, structure):
    safetensors.numpy.save_file(tensors, path, metadata={"format": FORMAT, "structure": structure})


@pytest.mark.parametrize("damage", ["truncated", "garbage", "header", "json", "shape", "missing-tensor", "entry",
                                    "pair", "deep", "version"])
def test_damaged_files_raise_naming_the_file(tmp_path, damage):
    path = str(tmp_path / "ckpt.safetensors")
    dtm.save({"w": dtm.ones(3), "n": 1}, path)
    good = open(path, "rb").read()
    arrays = {"0": np.ones(3, np.float32)}
    if damage == "truncated":
        open(path, "wb").write(good[:-5])
    elif damage == "garbage":
        open(path, "wb").write(b"not a checkpoint at all")
    elif damage == "header":
        open(path, "wb").write(struct.pack("<Q", 1 << 40) + good[8:])
    elif damage == "json":
        _write(path, arrays, '{"dict": [["w", {"tensor": "0"}]')
    elif damage == "shape":
        _write(path, arrays, '{"dict": [["w", {"tensor": "0"}], ["n", [1, 2]]]}')
    elif damage == "missing-tensor":
        _write(path, arrays, '{"dict": [["w", {"tensor": "7"}]]}')
    elif damage == "entry":
        _write(path, arrays, '{"set": [1]}')
    elif damage == "pair":
        _write(path, arrays, '{"dict": [["w"]]}')
    elif damage == "deep":
        _write(path, arrays, '{"list": [' * 300 + "1" + "]}" * 300)
    else:
        safetensors.numpy.save_file(arrays, path, metadata={"format": "dtm.save/99", "structure": json.dumps(1)})
    with pytest.raises(dtm.DTMError) as e:
        dtm.load(path)
    assert path in str(e.value)
