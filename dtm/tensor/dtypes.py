"""The front end's dtypes: torch's names for them (dtm.float32, dtm.bfloat16, ...),
`as_dtype` (a DTM dtype from a name, a numpy or a torch dtype) and torch's promotion
between two dtypes (`result_type`, over tensors and Python scalars, is in core.py)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import ErrorCode, user_error as error
from ..ir import DTYPES, DType
from ..ir.dtypes import Kind
from ..ir.dtypes import from_numpy as dtype_of_numpy
from ..ir.dtypes import numpy_dtype

float16, bfloat16, float32, float64 = (DTYPES[n] for n in ("f16", "bf16", "f32", "f64"))
float8_e4m3, float8_e5m2 = DTYPES["f8e4m3"], DTYPES["f8e5m2"]
float8_e4m3fn = float8_e4m3  # torch's name: finite, NaN but no infinities (OCP FP8 E4M3)
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


_CATEGORIES = {Kind.BOOL: 0, Kind.UNSIGNED: 1, Kind.SIGNED: 1, Kind.FLOAT: 2}
_CATEGORY: dict[DType, int] = {}  # by dtype (hashed by identity: quicker than the Kind enum's hash)


def _category(d: DType) -> int:
    c = _CATEGORY.get(d)
    if c is None:
        c = _CATEGORY[d] = _CATEGORIES[d.kind]
    return c


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


def convert_scalar(value: bool | int | float, dtype: DType) -> bool | int | float:
    """A Python scalar as a value of `dtype`, as torch converts it: True is 1 in a number
    tensor, an int wraps into an unsigned or narrow dtype (u8 tensor * -1 -> 255 * x), and
    a float rounds to the dtype, overflowing to an infinity (f16 tensor * 1e6 -> inf)."""
    if dtype is bool_:
        return bool(value)
    if dtype.is_float:
        with np.errstate(over="ignore"):
            return float(np.array(value, np.float64).astype(numpy_dtype(dtype)))
    return int(np.array(int(value)).astype(numpy_dtype(dtype)))


def _largest(d: DType) -> float:
    """The largest finite value of float dtype d: numpy's finfo knows f16, f32 and f64,
    ml_dtypes' (which numpy_dtype(d) has imported for them) bf16 and the f8 types."""
    if d.name in ("f16", "f32", "f64"):
        return float(np.finfo(numpy_dtype(d)).max)
    import ml_dtypes
    return float(ml_dtypes.finfo(numpy_dtype(d)).max)


def fits(value: bool | int | float, d: DType) -> bool:
    """Whether a Python number converts to dtype d without overflow, by torch's rule
    (c10::overflows): anything fits bool; an int fits a signed dtype within its range and
    an unsigned one within -max..max (a negative one wraps: torch takes -1 for a uint8 as
    255); a float fits an integer dtype when it is a number within the range, and a float
    dtype when it is an infinity, a NaN or no larger in size than the dtype's largest."""
    if d is bool_ or isinstance(value, bool):
        return True
    if d.is_float:
        return (isinstance(value, float) and not math.isfinite(value)) or abs(value) <= _largest(d)
    if isinstance(value, float) and math.isnan(value):
        return False
    info = np.iinfo(numpy_dtype(d))
    low = -int(info.max) if d.kind is Kind.UNSIGNED and isinstance(value, int) else int(info.min)
    return low <= value <= int(info.max)


def check_fits(op: str, value: bool | int | float, d: DType) -> None:
    """Raise E0410 at the user's line when `value` does not fit d (`fits`), as torch
    raises "value cannot be converted to type ... without overflow"."""
    if not fits(value, d):
        raise error(ErrorCode.LITERAL_MISMATCH, f"{op}: the value {value!r} cannot be converted to {d} without "
                    "overflow (torch raises too)")
