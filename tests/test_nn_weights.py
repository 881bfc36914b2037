"""dtm.nn.weights.SafetensorsFile: a safetensors file read tensor by tensor (or rows of
one), against the safetensors library's own writer and reader; and a clear error for every
header that does not describe the file (no read past it, nothing allocated for a lie)."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dtm.errors import DTMError, ErrorCode
from dtm.nn.weights import SafetensorsFile, save_safetensors

ARRAYS = {"a": np.arange(24, dtype=np.float32).reshape(6, 4), "b": np.array(3, np.int64),
          "c": np.arange(10, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(5, 2),
          "d": np.zeros((0, 3), np.uint8)}


def test_reads_what_the_library_wrote(tmp_path):
    path = str(tmp_path / "w.safetensors")
    save_file({k: v for k, v in ARRAYS.items() if k != "c"}, path, metadata={"format": "pt", "note": "x"})
    want = load_file(path)
    with SafetensorsFile(path) as f:
        assert sorted(f.names) == sorted(want) and f.metadata == {"format": "pt", "note": "x"}
        for name, arr in want.items():
            got = f.read(name)
            assert got.dtype == arr.dtype and got.shape == arr.shape and np.array_equal(got, arr), name
        assert np.array_equal(f.read("a", rows=(2, 5)), want["a"][2:5])


def test_reads_bf16_that_dtm_wrote(tmp_path):
    """bf16, which the library's numpy reader cannot give: as DTM's writer stored it."""
    path = str(tmp_path / "w.safetensors")
    save_safetensors({"c": ARRAYS["c"]}, path)
    with SafetensorsFile(path) as f:
        got = f.read("c")
    assert got.dtype == ARRAYS["c"].dtype and np.array_equal(got.view(np.uint16), ARRAYS["c"].view(np.uint16))


def _file(tmp_path, header: dict, data: bytes, length: int | None = None) -> str:
    text = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return str(path)


@pytest.mark.parametrize("header,data,length,code,words", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, 1 << 40, ErrorCode.BAD_ENCODING,
     "bad header length"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}, b"\0" * 12, None, ErrorCode.BAD_ENCODING,
     "12 bytes for F32[2]"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, b"\0" * 12, None, ErrorCode.BAD_ENCODING,
     "gap or overlap"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, None, ErrorCode.BAD_ENCODING,
     "the file at"),
    ({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8, None, ErrorCode.UNKNOWN_DTYPE,
     "dtype C64"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None, ErrorCode.BAD_ENCODING,
     "shape [-1]"),
    ({"__metadata__": {"k": 1}}, b"", None, ErrorCode.BAD_ENCODING, "__metadata__"),
])
def test_a_header_that_does_not_describe_the_file_is_refused(tmp_path, header, data, length, code, words):
    with pytest.raises(DTMError) as e:
        SafetensorsFile(_file(tmp_path, header, data, length))
    assert e.value.code == code and words in str(e.value), str(e.value)
