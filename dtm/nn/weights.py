"""State dicts on disk as safetensors (never pickle), written atomically.

Saving uses safetensors' numpy adapter (ml_dtypes arrays carry bf16 and float8); loading
reads the raw bytes with `safetensors.deserialize` and maps its dtype names to DTM's, so
every DTM dtype round-trips."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from typing import Mapping

import numpy as np
from safetensors import deserialize
from safetensors.numpy import save

from ..errors import DTMError, ErrorCode
from ..ir.dtypes import DTYPES, from_numpy, numpy_dtype
from ..tensor import Tensor

# safetensors dtype names <-> DTM dtype names
_ST = {"BOOL": "bool", "I8": "i8", "I16": "i16", "I32": "i32", "I64": "i64", "U8": "u8", "U16": "u16",
       "U32": "u32", "U64": "u64", "F16": "f16", "BF16": "bf16", "F32": "f32", "F64": "f64",
       "F8_E4M3": "f8e4m3", "F8_E5M2": "f8e5m2"}
_TO_ST = {v: k for k, v in _ST.items()}
MAX_HEADER = 100 * 1024 * 1024


def save_safetensors(state: Mapping[str, Tensor | np.ndarray], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write `state` to `path`: to a temporary name, fsync, then rename, so a crash never
    leaves a half-written file under `path`."""
    arrays = {name: np.asarray(t.numpy() if isinstance(t, Tensor) else t, order="C")
              for name, t in state.items()}  # not np.ascontiguousarray: it makes 0-d arrays 1-d
    for name, arr in arrays.items():
        if from_numpy(arr.dtype).name not in _TO_ST:
            raise DTMError(ErrorCode.UNKNOWN_DTYPE, f"{name}: dtype {arr.dtype} cannot be stored in safetensors")
    blob = save(arrays, metadata=metadata)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".dtm-save-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_safetensors(path: str) -> dict[str, Tensor]:
    return read_safetensors(path)[0]


def read_safetensors(path: str) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors of the file at `path`, and the string metadata saved with them."""
    with open(path, "rb") as f:
        data = f.read()
    # The header length is bounded before the library reads (and allocates for) the header.
    if len(data) < 8 or (n := struct.unpack("<Q", data[:8])[0]) > min(MAX_HEADER, len(data) - 8):
        raise DTMError(ErrorCode.BAD_ENCODING, f"{path}: not a safetensors file (bad header length)")
    try:
        items = deserialize(data)
        metadata = json.loads(data[8:8 + n]).get("__metadata__") or {}
    except Exception as e:  # the library's own error types: report them as ours
        raise DTMError(ErrorCode.BAD_ENCODING, f"{path}: not a valid safetensors file: {e}") from None
    out = {}
    for name, info in items:
        st = info["dtype"]
        if st not in _ST:
            raise DTMError(ErrorCode.UNKNOWN_DTYPE, f"{path}: tensor {name!r} has dtype {st}, which DTM does not know")
        dt = numpy_dtype(DTYPES[_ST[st]])
        arr = np.frombuffer(bytes(info["data"]), dtype=dt.newbyteorder("<")).astype(dt).reshape(info["shape"])
        out[name] = Tensor.from_numpy(arr.copy())
    return out, metadata
