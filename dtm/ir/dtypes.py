"""Element types of DTM IR: one table, `DTYPES`, read by the parser, the verifier, the
encoder and (through `numpy_dtype`) every runtime.

Quantized block types (q8_0, q4_0) pack `block` logical elements into `block_bytes` bytes:
a float16 scale followed by the packed integers (spec, "Quantized block types"). They are
declared by spec 1.0 and executed once CAP_QUANT lands.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class Kind(enum.Enum):
    BOOL = "bool"
    SIGNED = "signed"
    UNSIGNED = "unsigned"
    FLOAT = "float"
    QUANT = "quant"


@dataclass(frozen=True, eq=False)
class DType:
    """One element type. Instances are the singletons of `DTYPES`, compared by identity."""

    name: str
    kind: Kind
    bits: int  # bits per element; for quantized types, bits per block
    block: int = 1  # logical elements per storage unit (1 except for quantized types)

    @property
    def is_float(self) -> bool:
        return self.kind is Kind.FLOAT

    @property
    def is_int(self) -> bool:
        return self.kind in (Kind.SIGNED, Kind.UNSIGNED)

    @property
    def is_numeric(self) -> bool:
        return self.kind in (Kind.SIGNED, Kind.UNSIGNED, Kind.FLOAT)

    @property
    def is_quant(self) -> bool:
        return self.kind is Kind.QUANT

    @property
    def itemsize(self) -> int:
        """Bytes per element (per block for quantized types)."""
        return self.bits // 8

    def __repr__(self) -> str:
        return self.name

    __str__ = __repr__


def _table(*dtypes: DType) -> dict[str, DType]:
    return {d.name: d for d in dtypes}


DTYPES: dict[str, DType] = _table(
    DType("bool", Kind.BOOL, 8),
    DType("i8", Kind.SIGNED, 8),
    DType("i16", Kind.SIGNED, 16),
    DType("i32", Kind.SIGNED, 32),
    DType("i64", Kind.SIGNED, 64),
    DType("u8", Kind.UNSIGNED, 8),
    DType("u16", Kind.UNSIGNED, 16),
    DType("u32", Kind.UNSIGNED, 32),
    DType("u64", Kind.UNSIGNED, 64),
    DType("f16", Kind.FLOAT, 16),
    DType("bf16", Kind.FLOAT, 16),
    DType("f32", Kind.FLOAT, 32),
    DType("f64", Kind.FLOAT, 64),
    DType("f8e4m3", Kind.FLOAT, 8),
    DType("f8e5m2", Kind.FLOAT, 8),
    # 32 elements: f16 scale + 32 x int8            = 34 bytes per block
    DType("q8_0", Kind.QUANT, 34 * 8, block=32),
    # 32 elements: f16 scale + 32 x 4-bit (packed)  = 18 bytes per block
    DType("q4_0", Kind.QUANT, 18 * 8, block=32),
)

bool_ = DTYPES["bool"]
i64 = DTYPES["i64"]
u32 = DTYPES["u32"]
f32 = DTYPES["f32"]

_NUMPY = {
    "bool": np.dtype(np.bool_),
    "i8": np.dtype(np.int8), "i16": np.dtype(np.int16),
    "i32": np.dtype(np.int32), "i64": np.dtype(np.int64),
    "u8": np.dtype(np.uint8), "u16": np.dtype(np.uint16),
    "u32": np.dtype(np.uint32), "u64": np.dtype(np.uint64),
    "f16": np.dtype(np.float16), "f32": np.dtype(np.float32), "f64": np.dtype(np.float64),
}
_FROM_NUMPY = {v: k for k, v in _NUMPY.items()}
# bf16 and the f8 types come from ml_dtypes, imported when first needed: its import takes
# half a second (0.7.0), half of `import dtm`, which every worker process pays
_ML_DTYPES = {"bf16": "bfloat16", "f8e4m3": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}


def _load_ml_dtypes() -> None:
    import ml_dtypes

    for name, attr in _ML_DTYPES.items():
        dt = np.dtype(getattr(ml_dtypes, attr))
        _NUMPY[name], _FROM_NUMPY[dt] = dt, name


class _NarrowFloats:
    """Floats narrower than f32 (f16, bf16, f8e4m3, f8e5m2), as numpy dtypes: every
    computation on them (reference ops, reductions of collectives) runs in f32 and rounds
    once at the end. `dtype in NARROW_FLOATS` asks by name, so it needs no ml_dtypes."""

    NAMES = frozenset({"float16", *_ML_DTYPES.values()})

    def __contains__(self, dtype) -> bool:
        return np.dtype(dtype).name in self.NAMES


NARROW_FLOATS = _NarrowFloats()


def numpy_dtype(dtype: DType) -> np.dtype:
    """The numpy dtype holding one element of `dtype` (quantized types have none)."""
    if dtype.is_quant:
        raise TypeError(f"quantized dtype {dtype} has no element-wise numpy dtype")
    if dtype.name in _ML_DTYPES and dtype.name not in _NUMPY:
        _load_ml_dtypes()
    return _NUMPY[dtype.name]


def from_numpy(dtype: np.dtype) -> DType:
    """The DTM dtype of a numpy dtype; KeyError when DTM has none."""
    dtype = np.dtype(dtype)
    if dtype not in _FROM_NUMPY and dtype.name in _NarrowFloats.NAMES:
        _load_ml_dtypes()  # an ml_dtypes array: its module is already imported
    return DTYPES[_FROM_NUMPY[dtype]]
