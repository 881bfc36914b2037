"""State dicts on disk as safetensors (never pickle), written atomically.

Saving uses safetensors' numpy adapter (ml_dtypes arrays carry bf16 and float8); loading
reads the file tensor by tensor (`SafetensorsFile`) and maps its dtype names to DTM's, so
every DTM dtype round-trips."""

from __future__ import annotations

import json
import mmap
import os
import struct
import tempfile
from typing import Mapping

import numpy as np
from safetensors.numpy import save

from .. import quant
from ..errors import DTMError, ErrorCode
from ..ir.dtypes import DTYPES, from_numpy, numpy_dtype
from ..ir.types import TensorType
from ..tensor import Tensor

# safetensors dtype names <-> DTM dtype names
_ST = {"BOOL": "bool", "I8": "i8", "I16": "i16", "I32": "i32", "I64": "i64", "U8": "u8", "U16": "u16",
       "U32": "u32", "U64": "u64", "F16": "f16", "BF16": "bf16", "F32": "f32", "F64": "f64",
       "F8_E4M3": "f8e4m3", "F8_E5M2": "f8e5m2"}
_TO_ST = {v: k for k, v in _ST.items()}
MAX_HEADER = 100 * 1024 * 1024


def save_safetensors(state: Mapping[str, Tensor | np.ndarray], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write `state` to `path`: to a temporary name, fsync, then rename, so a crash never
    leaves a half-written file under `path`. A q8_0 or q4_0 tensor (a quantized model's
    weight) is written as its block bytes and listed in the metadata (dtm.quant.pack), so
    read_safetensors gives it back as the same quantized tensor."""
    blocks = {name: (t.numpy(), t.dtype, t.shape) for name, t in state.items()
              if isinstance(t, Tensor) and t.dtype.is_quant}
    if blocks:
        packed, listed = quant.pack(blocks)
        state = {**state, **packed}
        metadata = {**(metadata or {}), **listed}
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


class SafetensorsFile:
    """One safetensors file read tensor by tensor (or rows of one): each read is a seek and
    a read into the array returned, so a model is converted piece by piece without the
    whole file in memory; or mapped (`map`), a view whose pages are read when touched. The
    header is bounded before it is read and checked whole before anything else: each
    tensor's dtype, shape and byte range, which must tile the data after the header.

        with SafetensorsFile(path) as f:
            f.metadata, f.names, f.shape("wte.weight")
            f.read("wte.weight", rows=(0, 4096))
            f.map("wte.weight")
    """

    def __init__(self, path: str):
        self.path = path
        self._map: mmap.mmap | None = None
        self._f = open(path, "rb")
        try:
            self._parse(os.fstat(self._f.fileno()).st_size)
        except BaseException:
            self._f.close()
            raise

    def _bad(self, why: str) -> DTMError:
        return DTMError(ErrorCode.BAD_ENCODING, f"{self.path}: not a valid safetensors file: {why}")

    def _parse(self, size: int) -> None:
        head = self._f.read(8)
        if len(head) < 8 or (n := struct.unpack("<Q", head)[0]) > min(MAX_HEADER, size - 8):
            raise DTMError(ErrorCode.BAD_ENCODING, f"{self.path}: not a safetensors file (bad header length)")
        try:
            header = json.loads(self._f.read(n))
        except ValueError as e:
            raise self._bad(f"its header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._bad("its header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._bad("__metadata__ must map names to strings")
        self.metadata: dict[str, str] = metadata
        self._base, self._info = 8 + n, {}
        spans = []
        for name, info in header.items():
            st = info.get("dtype") if isinstance(info, dict) else None
            if st not in _ST:
                raise DTMError(ErrorCode.UNKNOWN_DTYPE, f"{self.path}: tensor {name!r} has dtype {st}, which DTM "
                                                        "does not know")
            shape, offsets = info.get("shape"), info.get("data_offsets")
            if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                    and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
                raise self._bad(f"tensor {name!r}: shape {shape!r} and data_offsets {offsets!r}")
            dt = numpy_dtype(DTYPES[_ST[st]])
            if offsets[1] - offsets[0] != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
                raise self._bad(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for {st}{shape}")
            self._info[name] = (dt, tuple(shape), offsets[0])
            spans.append(tuple(offsets))
        at = 0
        for lo, hi in sorted(spans):  # the tensors' bytes tile the data: no gap, no overlap, no excess
            if lo != at:
                raise self._bad(f"its tensors' bytes leave a gap or overlap at data offset {at}")
            at = hi
        if self._base + at != size:
            raise self._bad(f"its tensors end at byte {self._base + at}, the file at {size}")

    @property
    def names(self) -> list[str]:
        """The tensors' names, in name order (as the safetensors library lists them)."""
        return sorted(self._info)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[name][1]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Tensor `name`, or its rows [lo, hi) along the first dim, as a new array."""
        dt, shape, start = self._info[name]
        lo, hi = (0, shape[0] if shape else 1) if rows is None else rows
        row = int(np.prod(shape[1:], dtype=np.int64)) * dt.itemsize if shape else dt.itemsize
        out = np.empty(((hi - lo),) + shape[1:] if shape else (), dt.newbyteorder("<"))
        self._f.seek(self._base + start + lo * row)
        if self._f.readinto(memoryview(out.reshape(-1).view(np.uint8))) != out.nbytes:
            raise self._bad(f"tensor {name!r} ends early")
        return out.astype(dt, copy=False)

    def map(self, name: str) -> np.ndarray:
        """Tensor `name` as a read-only view of the file mapped into memory: nothing is read
        until its pages are touched (a weight still on disk; dtm.quant.quantize_weight gives
        the pages back as it converts them). The mapping lives as long as a view of it."""
        if self._map is None:
            self._map = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ)
        dt, shape, start = self._info[name]
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self._map, dt.newbyteorder("<"), count, self._base + start).reshape(shape).view(dt)

    def close(self) -> None:
        self._map = None  # (the views made keep it mapped)
        self._f.close()

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_safetensors(path: str, mmap: bool = False) -> dict[str, Tensor]:
    """The tensors of the file at `path`, in name order. mmap=True: read-only views of the file
    mapped into memory, read from disk only as they are used (SafetensorsFile.map); an
    in-place update copies one first, as it does any read-only value."""
    return read_safetensors(path, mmap)[0]


def read_safetensors(path: str, mmap: bool = False) -> tuple[dict[str, Tensor], dict[str, str]]:
    """load_safetensors, and the string metadata saved with the tensors. The tensors the
    metadata lists as quantized (save_safetensors, GPT2.save_pretrained) come back as such:
    their block bytes, checked against the listed dtype and shape, as a q8_0 or q4_0 tensor."""
    with SafetensorsFile(path) as f:
        listed = quant.unpack(f.metadata)
        out = {}
        for name in f.names:
            value = f.map(name) if mmap else f.read(name)
            if name in listed and listed[name][0].is_quant:
                dt, shape = listed[name]
                quant.check_storage(name, value, dt, shape)
                out[name] = Tensor(TensorType(dt, shape), buffer=value)
            else:
                out[name] = Tensor.from_numpy(value)
        return out, f.metadata
