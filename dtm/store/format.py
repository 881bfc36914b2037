"""The on-disk form of one stored tensor (spec 9.2.3): a Zarr v3 array, `zarr.json` plus one
file per chunk, each chunk's raw little-endian bytes followed by their CRC32C (the `bytes`
and `crc32c` codecs), on a regular chunk grid: along the first dim for a tensor put whole,
along the pieces of a distributed tensor put piece by piece.

Dtypes Zarr v3 lacks are stored as their bit patterns: `bf16` as `uint16`, `f8e4m3` and
`f8e5m2` as `uint8`, and the quantized `q8_0`/`q4_0` as the `uint8` bytes of their blocks
(storage shape [..., K/32 * block bytes]); the DTM dtype and shape are in the attributes.
Pure functions on bytes and dicts: where the files live is the backends' job.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
from crc32c import crc32c

from ..errors import DTMError, ErrorCode
from ..ir.dtypes import DTYPES, DType, numpy_dtype
from ..ir.types import TensorType
from ..ref.quant import storage_shape as _quant_storage_shape, whole_blocks
from .crc import checksum

FORMAT_VERSION = 1
CRC_BYTES = 4
DEFAULT_CHUNK_BYTES = 1 << 30  # one chunk up to 1 GiB: a get maps it whole, without a copy
# A tensor put whole of at most this many storage bytes is kept inline, in its index row, not
# as a Zarr array (spec 9.2.3): on ext4 a 16-byte tensor's three directories (its key's, its
# version's, `c/`) and two files took 20 KiB of disk and 8 syncs a put; a row takes ~100
# bytes and one sync.
INLINE_BYTES = 4096
INLINE_CHUNK = "inline"  # the chunk that errors name for a tensor kept inline: its row's bytes

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
    endian), its shape, and the shape of its chunks, a regular grid over the storage array
    (spec 9.2.3). Chunk ids are tuples, one index per storage dim (`()` for a scalar). Its
    sizes are worked out once (`plan` hands the same Layout to every put of a type)."""

    dtype: DType
    shape: tuple[int, ...]
    storage_dtype: np.dtype
    storage_shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]

    @functools.cached_property
    def nbytes(self) -> int:
        return math.prod(self.storage_shape) * self.storage_dtype.itemsize

    @functools.cached_property
    def grid(self) -> tuple[int, ...]:
        """Chunks along each dim (0 along a zero-size dim: such a tensor has no chunks)."""
        return tuple(-(-n // c) for n, c in zip(self.storage_shape, self.chunk_shape))

    @functools.cached_property
    def nchunks(self) -> int:
        return math.prod(self.grid)

    @functools.cached_property
    def chunk_data_bytes(self) -> int:
        """Bytes of one encoded chunk before its CRC: Zarr stores edge chunks whole, padded."""
        return math.prod(self.chunk_shape) * self.storage_dtype.itemsize

    def chunks(self) -> Iterator[tuple[int, ...]]:
        """Every chunk id, in row-major order."""
        return itertools.product(*(range(g) for g in self.grid))

    def chunks_over(self, box: Sequence[tuple[int, int]]) -> Iterator[tuple[int, ...]]:
        """The ids of the chunks that overlap `box` ([start, stop) per storage dim), and of
        no other: an empty box overlaps none."""
        if any(a >= b for a, b in box):
            return iter(())
        return itertools.product(*(range(a // c, -(-b // c)) for (a, b), c in zip(box, self.chunk_shape)))

    def chunk_key(self, i: tuple[int, ...]) -> str:
        """The chunk's key in Zarr's default encoding: `c/i/j/...`, or `c` for a scalar."""
        return "/".join(["c", *map(str, i)])

    def chunk_keys(self) -> Iterator[str]:
        """Every chunk's key (its file's path in the version directory), in row-major order."""
        return (self.chunk_key(i) for i in self.chunks())

    def chunk_box(self, i: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """The [start, stop) of the tensor that chunk i holds along each storage dim."""
        return tuple((k * c, min((k + 1) * c, n)) for k, c, n in zip(i, self.chunk_shape, self.storage_shape))


def storage_numpy_dtype(dtype: DType) -> np.dtype:
    return np.dtype(_ZARR_TYPE[dtype.name]).newbyteorder("<")


def _storage_shape(dtype: DType, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The storage shape of a tensor of `dtype` and logical `shape` (spec 9.2.4); E0408 for
    a quantized shape whose last dim is not whole blocks (spec 2.2), which has none."""
    if not whole_blocks(dtype, shape):
        raise DTMError(ErrorCode.QUANTIZED_MISUSE, f"a {dtype.name} tensor of shape {list(shape)}: its last dim must "
                       f"be a multiple of {dtype.block} (whole blocks, spec 2.2), so it has no storage size")
    return _quant_storage_shape(TensorType(dtype, shape))


@functools.lru_cache(maxsize=1024)
def plan(dtype: DType, shape: tuple[int, ...], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Layout:
    """The layout of a tensor put whole: chunks split the first dim only, as few as
    `chunk_bytes` allows, of near-equal rows so the padded edge chunk wastes at most one row
    per chunk."""
    sshape = _storage_shape(dtype, shape)
    sdtype = storage_numpy_dtype(dtype)
    if not sshape:
        return Layout(dtype, shape, sdtype, sshape, ())
    row_bytes = max(math.prod(sshape[1:]) * sdtype.itemsize, 1)
    n0 = max(sshape[0], 1)
    nchunks = max(1, -(-(n0 * row_bytes) // chunk_bytes))
    # Zarr requires positive chunk dims, also for zero-size dims (such arrays have no chunks)
    return Layout(dtype, shape, sdtype, sshape, (-(-n0 // nchunks), *(max(d, 1) for d in sshape[1:])))


def plan_grid(dtype: DType, shape: tuple[int, ...], block: tuple[int, ...]) -> Layout:
    """The layout whose chunks are `block` (logical dims: the piece shape of a distributed
    tensor, spec 9.2.10), so that each piece is one chunk."""
    sblock = _storage_shape(dtype, block)
    return Layout(dtype, shape, storage_numpy_dtype(dtype), _storage_shape(dtype, shape),
                  tuple(max(c, 1) for c in sblock))


def metadata(layout: Layout, checksum: str) -> bytes:
    """The array's `zarr.json` (spec 9.2.3), as UTF-8 JSON: the layout's text, made once
    per layout (encoding the document was a tenth of a small put), around the checksum."""
    head, tail = _metadata_text(layout)
    return head + checksum.encode("ascii") + tail


@functools.lru_cache(maxsize=1024)
def _metadata_text(layout: Layout) -> tuple[bytes, bytes]:
    """The `zarr.json` of `layout` before and after its checksum."""
    mark = "0" * 8
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
                               "shape": list(layout.shape), "checksum": mark}},
    }
    text = json.dumps(doc, separators=(",", ":")).encode("utf-8")  # (compact: the C encoder, 10x faster)
    head, tail = text.rsplit(b'"checksum":"' + mark.encode("ascii") + b'"', 1)
    return head + b'"checksum":"', b'"' + tail


@functools.lru_cache(maxsize=1024)
def parse_metadata(raw: bytes) -> tuple[Layout, str]:
    """The layout and checksum a `zarr.json` written by `metadata` describes; ValueError
    when it is not one (the store turns that into E1105). Cached by the bytes: a get reads
    the file every time, and parses what it has not seen (a third of a small get)."""
    doc = json.loads(raw.decode("utf-8"))
    attrs = doc["attributes"]["dtm"]
    if attrs["format"] != FORMAT_VERSION:
        raise ValueError(f"format version {attrs['format']}, this reader reads {FORMAT_VERSION}")
    dtype = DTYPES[attrs["dtype"]]
    shape = tuple(int(d) for d in attrs["shape"])
    sshape = _storage_shape(dtype, shape)
    grid = doc["chunk_grid"]
    chunk = grid["configuration"]["chunk_shape"]
    # bounded by the array: a chunk never exceeds its dim (at least 1, as Zarr wants)
    if grid["name"] != "regular" or len(chunk) != len(sshape) \
            or not all(type(c) is int and 1 <= c <= max(n, 1) for c, n in zip(chunk, sshape)):
        raise ValueError(f"chunk grid {grid} is not a regular grid of chunks within shape {list(sshape)}")
    if list(sshape) != doc["shape"] or doc["data_type"] != _ZARR_TYPE[dtype.name]:
        raise ValueError("the Zarr shape or data type contradicts the DTM attributes")
    return Layout(dtype, shape, storage_numpy_dtype(dtype), sshape, tuple(chunk)), attrs["checksum"]


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



def encode_chunk(layout: Layout, block: np.ndarray) -> tuple[list[memoryview | bytes], int]:
    """The parts of the file of a chunk that holds `block` (its storage elements, at most
    the chunk shape along each dim), and the chunk's CRC32C: the bytes, zero padding up to
    the chunk shape (spec 9.2.3), then the CRC. A block short along the first dim alone
    is padded at its end, without a copy."""
    block = np.asarray(block)
    if block.shape[1:] == layout.chunk_shape[1:]:
        body = memoryview(np.ascontiguousarray(block).reshape(-1).view(np.uint8))
        pad = bytes(layout.chunk_data_bytes - len(body))
    else:
        whole = np.zeros(layout.chunk_shape, layout.storage_dtype)
        whole[tuple(slice(0, n) for n in block.shape)] = block
        body, pad = memoryview(whole.reshape(-1).view(np.uint8)), b""
    crc = crc32c(pad, checksum(body))
    return [body, pad, crc.to_bytes(CRC_BYTES, "little")], crc


def decode_chunk(layout: Layout, body: np.ndarray) -> np.ndarray:
    """A chunk's data bytes (CRC checked and cut off) as its storage array, padding included."""
    return body.view(layout.storage_dtype).reshape(layout.chunk_shape)
