"""The on-disk form of one stored tensor (spec 9.2.3): a Zarr v3 array, `zarr.json` plus one
file per chunk, each chunk's raw little-endian bytes followed by their CRC32C (the `bytes`
and `crc32c` codecs), chunked along the first dim.

Dtypes Zarr v3 lacks are stored as their bit patterns: `bf16` as `uint16`, `f8e4m3` and
`f8e5m2` as `uint8`, and the quantized `q8_0`/`q4_0` as the `uint8` bytes of their blocks
(storage shape [..., K/32 * block bytes]); the DTM dtype and shape are in the attributes.
Pure functions on bytes and dicts: where the files live is the backends' job.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
from crc32c import crc32c

from ..ir.dtypes import DTYPES, DType, numpy_dtype
from ..ir.types import TensorType
from ..ref.quant import storage_shape as _quant_storage_shape

FORMAT_VERSION = 1
CRC_BYTES = 4
DEFAULT_CHUNK_BYTES = 1 << 30  # one chunk up to 1 GiB: a get maps it whole, without a copy

# DTM dtype name -> Zarr v3 data_type of the stored array
_ZARR_TYPE = {
    "bool": "bool", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
    "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
    "f16": "float16", "f32": "float32", "f64": "float64",
    "bf16": "uint16", "f8e4m3": "uint8", "f8e5m2": "uint8", "q8_0": "uint8", "q4_0": "uint8",
}


@dataclass(frozen=True)
class Layout:
    """How a tensor of `dtype`/`shape` is stored: the storage array's numpy dtype (little-
    endian), its shape, and `rows` (first-dim entries per chunk)."""

    dtype: DType
    shape: tuple[int, ...]
    storage_dtype: np.dtype
    storage_shape: tuple[int, ...]
    rows: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.storage_shape) * self.storage_dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return math.prod(self.storage_shape[1:]) * self.storage_dtype.itemsize

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        # Zarr requires positive chunk dims, also for zero-size dims (such arrays have no chunks)
        return (self.rows, *(max(d, 1) for d in self.storage_shape[1:])) if self.storage_shape else ()

    @property
    def nchunks(self) -> int:
        if not self.storage_shape:
            return 1
        if 0 in self.storage_shape:
            return 0
        return -(-self.storage_shape[0] // self.rows)

    @property
    def chunk_data_bytes(self) -> int:
        """Bytes of one encoded chunk before its CRC: Zarr stores edge chunks whole, padded."""
        return math.prod(self.chunk_shape) * self.storage_dtype.itemsize

    def chunk_key(self, i: int) -> str:
        """The chunk's key in Zarr's default encoding: `c/i/0/0...`, or `c` for a scalar."""
        return "/".join(["c", str(i)] + ["0"] * (len(self.storage_shape) - 1)) if self.storage_shape else "c"

    def chunk_rows(self, i: int) -> tuple[int, int]:
        """The first-dim range [start, stop) of the tensor that chunk i holds."""
        if not self.storage_shape:
            return 0, 1
        return i * self.rows, min((i + 1) * self.rows, self.storage_shape[0])


def storage_numpy_dtype(dtype: DType) -> np.dtype:
    return np.dtype(_ZARR_TYPE[dtype.name]).newbyteorder("<")


def _storage_shape(dtype: DType, shape: tuple[int, ...]) -> tuple[int, ...]:
    return _quant_storage_shape(TensorType(dtype, shape))


def plan(dtype: DType, shape: tuple[int, ...], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Layout:
    """The layout of a tensor: as few chunks as `chunk_bytes` allows, of near-equal rows so
    the padded edge chunk wastes at most one row per chunk."""
    sshape = _storage_shape(dtype, shape)
    sdtype = storage_numpy_dtype(dtype)
    if not sshape:
        return Layout(dtype, shape, sdtype, sshape, 1)
    row_bytes = max(math.prod(sshape[1:]) * sdtype.itemsize, 1)
    n0 = max(sshape[0], 1)
    nchunks = max(1, -(-(n0 * row_bytes) // chunk_bytes))
    return Layout(dtype, shape, sdtype, sshape, -(-n0 // nchunks))


def metadata(layout: Layout, checksum: str) -> bytes:
    """The array's `zarr.json` (spec 9.2.3), as UTF-8 JSON."""
    doc = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(layout.storage_shape),
        "data_type": _ZARR_TYPE[layout.dtype.name],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(layout.chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": False if layout.dtype.name == "bool" else 0,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        "attributes": {"dtm": {"format": FORMAT_VERSION, "dtype": layout.dtype.name,
                               "shape": list(layout.shape), "checksum": checksum}},
    }
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")  # (compact: the C encoder, 10x faster)


def parse_metadata(raw: bytes) -> tuple[Layout, str]:
    """The layout and checksum a `zarr.json` written by `metadata` describes; ValueError
    when it is not one (the store turns that into E1105)."""
    doc = json.loads(raw.decode("utf-8"))
    attrs = doc["attributes"]["dtm"]
    if attrs["format"] != FORMAT_VERSION:
        raise ValueError(f"format version {attrs['format']}, this reader reads {FORMAT_VERSION}")
    dtype = DTYPES[attrs["dtype"]]
    shape = tuple(int(d) for d in attrs["shape"])
    chunk_shape = doc["chunk_grid"]["configuration"]["chunk_shape"]
    layout = Layout(dtype, shape, storage_numpy_dtype(dtype), _storage_shape(dtype, shape),
                    int(chunk_shape[0]) if chunk_shape else 1)
    if list(layout.storage_shape) != doc["shape"] or list(layout.chunk_shape) != chunk_shape \
            or doc["data_type"] != _ZARR_TYPE[dtype.name]:
        raise ValueError("the Zarr shape, chunk shape or data type contradicts the DTM attributes")
    return layout, attrs["checksum"]


def to_storage(x: np.ndarray, dtype: DType) -> np.ndarray:
    """The C-contiguous little-endian storage array of `x` (a bit-pattern view for dtypes
    Zarr lacks)."""
    target = storage_numpy_dtype(dtype)
    if dtype.is_quant:
        return np.ascontiguousarray(x, dtype=np.uint8)
    want = numpy_dtype(dtype).newbyteorder("<")
    arr = np.ascontiguousarray(x.astype(want, copy=False))
    return arr.view(target) if arr.dtype.itemsize == target.itemsize and arr.dtype != target else arr


def from_storage(a: np.ndarray, dtype: DType) -> np.ndarray:
    """The inverse of `to_storage`: the tensor's own numpy dtype, viewed, never copied."""
    return a if dtype.is_quant else a.view(numpy_dtype(dtype).newbyteorder("<"))

