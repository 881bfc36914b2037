"""The front end's dtypes: torch's names for them (dtm.float32, dtm.bfloat16, ...),
`as_dtype` (a DTM dtype from a name, a numpy or a torch dtype) and torch's promotion
between two dtypes (`result_type`, over tensors and Python scalars, is in core.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ErrorCode, user_error as error
from ..ir import DTYPES, DType
from ..ir.dtypes import Kind
from ..ir.dtypes import from_numpy as dtype_of_numpy

float16, bfloat16, float32, float64 = (DTYPES[n] for n in ("f16", "bf16", "f32", "f64"))
float8_e4m3, float8_e5m2 = DTYPES["f8e4m3"], DTYPES["f8e5m2"]
int8, int16, int32, int64 = (DTYPES[n] for n in ("i8", "i16", "i32", "i64"))
uint8, uint16, uint32, uint64 = (DTYPES[n] for n in ("u8", "u16", "u32", "u64"))
bool_ = DTYPES["bool"]
DEFAULT_FLOAT = float32

_DTYPE_ALIASES = {"float16": float16, "half": float16, "bfloat16": bfloat16, "float32": float32, "float": float32,
                  "float64": float64, "double": float64, "int8": int8, "int16": int16, "int32": int32,
                  "int64": int64, "long": int64, "uint8": uint8, "bool": bool_}


def as_dtype(d: Any) -> DType:
    """A DTM dtype from a DType, a name ("f32", "float32", "bfloat16"), a numpy or torch dtype."""
    if isinstance(d, DType):
        return d
    if isinstance(d, str):
        if d in DTYPES:
            return DTYPES[d]
        if d in _DTYPE_ALIASES:
            return _DTYPE_ALIASES[d]
    name = getattr(d, "__module__", "")
    if name == "torch":  # torch.float32 -> "float32"
        return as_dtype(str(d).replace("torch.", ""))
    try:
        return dtype_of_numpy(np.dtype(d))
    except (TypeError, KeyError):
        raise error(ErrorCode.UNKNOWN_DTYPE, f"unknown dtype {d!r}") from None


def _category(d: DType) -> int:
    return {Kind.BOOL: 0, Kind.UNSIGNED: 1, Kind.SIGNED: 1, Kind.FLOAT: 2}[d.kind]


def promote_types(a: DType, b: DType) -> DType:
    """PyTorch's promotion between two tensor dtypes."""
    if a is b:
        return a
    ca, cb = _category(a), _category(b)
    if ca != cb:
        return a if ca > cb else b
    if ca == 2:
        if {a.name, b.name} == {"f16", "bf16"} or a.bits == b.bits:
            return float32
        return a if a.bits > b.bits else b
    if a.kind is b.kind:
        return a if a.bits > b.bits else b
    s, u = (a, b) if a.kind is Kind.SIGNED else (b, a)
    if s.bits > u.bits:
        return s
    return {8: int16, 16: int32, 32: int64, 64: int64}[u.bits]


def _combine(higher: DType | None, lower: DType | None) -> DType | None:
    """A lower promotion tier counts only where it is of a higher category."""
    if higher is None or lower is None:
        return higher if lower is None else lower
    return promote_types(higher, lower) if _category(lower) > _category(higher) else higher
