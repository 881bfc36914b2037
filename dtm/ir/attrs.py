"""Attribute values: how each `AttrKind` is checked, normalised, and written as text.

The parser produces already-typed values; the builder hands Python values to
`normalize_attrs`, which checks kinds and fills defaults, so both paths end in the same
canonical in-memory form (tuples, not lists; floats, not ints, for float scalars).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from ..errors import ErrorCode as E
from .dtypes import DTYPES, DType, Kind, numpy_dtype
from .registry import REQUIRED, AttrKind, AttrSpec
from .symbolic import SymDim, format_dim, sym
from .typerules import TypeRuleError, fail
from .types import Literal

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
MAX_RANK = 64
U64_MAX = 2**64 - 1
MAX_DIM = 2**62


def normalize_scalar(op: str, name: str, value: Any, dtype: DType) -> int | float | bool:
    """A scalar attribute as a value of `dtype`: floats for float dtypes, ints for integer
    dtypes, bools for bool, so `0` and `0.0` in an f32 `full` mean and hash the same."""
    if dtype.kind is Kind.BOOL:
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)) and value in (0, 1):  # pad's default 0.0 is `false`
            return bool(value)
    elif isinstance(value, bool):
        pass
    elif dtype.is_float and isinstance(value, (int, float)):
        if math.isnan(value):
            return math.nan
        with np.errstate(over="ignore"):
            rounded = float(np.array(value, dtype=np.float64).astype(numpy_dtype(dtype)).astype(np.float64))
        if not math.isfinite(rounded) and not math.isinf(value):  # f8e4m3 has no inf: it overflows to NaN
            fail(E.ATTRIBUTE_VALUE, f"{op}: {name} = {value!r} overflows {dtype}")
        return rounded  # the value the dtype holds: 0.1 and 0.10000000149011612 are one f32
    elif dtype.is_int and (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
        info = np.iinfo(numpy_dtype(dtype))
        if not info.min <= value <= info.max:
            fail(E.ATTRIBUTE_VALUE, f"{op}: {name} = {value!r} does not fit {dtype}")
        return int(value)
    fail(E.ATTRIBUTE_TYPE, f"{op}: {name} = {value!r} is not a {dtype} value")


def literal_from_nested(op: str, value: Any, dtype: DType) -> Literal:
    """A Literal of `dtype` from nested lists of Python scalars (shape from the nesting)."""
    if dtype.is_quant:
        fail(E.QUANTIZED_MISUSE, f"{op}: a literal cannot have quantized dtype {dtype}")
    shape: list[int] = []
    probe = value
    while isinstance(probe, (list, tuple)):
        shape.append(len(probe))
        if not probe:
            break
        probe = probe[0]
    flat: list[Any] = []

    def walk(v: Any, depth: int) -> None:
        if depth == len(shape):
            if isinstance(v, (list, tuple)):
                fail(E.LITERAL_MISMATCH, f"{op}: the literal's nesting is ragged")
            flat.append(normalize_scalar(op, "value element", v, dtype))
            return
        if not isinstance(v, (list, tuple)) or len(v) != shape[depth]:
            fail(E.LITERAL_MISMATCH, f"{op}: the literal's nesting is ragged")
        for item in v:
            walk(item, depth + 1)

    walk(value, 0)
    npdt = numpy_dtype(dtype)
    if dtype.is_int:
        info = np.iinfo(npdt)
        bad = [x for x in flat if not info.min <= x <= info.max]
        if bad:
            fail(E.LITERAL_MISMATCH, f"{op}: {bad[0]} does not fit {dtype}")
    if dtype.is_float:
        wide = np.array(flat, dtype=np.float64)
        with np.errstate(over="ignore"):
            arr = wide.astype(npdt)
        overflow = np.isfinite(wide) & ~np.isfinite(arr.astype(np.float64))
        if overflow.any():
            fail(E.LITERAL_MISMATCH, f"{op}: {wide[overflow][0]!r} overflows {dtype}")
    else:
        arr = np.array(flat, dtype=npdt) if flat else np.zeros(0, npdt)
    return Literal.from_numpy(arr.reshape(shape))


def _check_int(name: str, v: Any) -> int:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool) and I64_MIN <= int(v) <= I64_MAX:
        return int(v)
    fail(E.ATTRIBUTE_TYPE, f"attribute {name} expects an i64 integer, found {v!r}")


def _check_dim(name: str, v: Any):
    if isinstance(v, str):
        return sym(v)
    if isinstance(v, SymDim):
        return v
    d = _check_int(name, v)
    if not 0 <= d < MAX_DIM:
        fail(E.INVALID_DIM, f"attribute {name}: dim {d} is out of range [0, 2^62)")
    return d


def _check_str(name: str, v: Any) -> str:
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            fail(E.ATTRIBUTE_VALUE, f"attribute {name}: string {v!r} is not valid Unicode (a lone surrogate)")
        return v
    fail(E.ATTRIBUTE_TYPE, f"attribute {name} expects a string, found {v!r}")


def _check_seq(name: str, v: Any) -> tuple:
    if isinstance(v, (list, tuple)):
        return tuple(v)
    fail(E.ATTRIBUTE_TYPE, f"attribute {name} expects a list, found {v!r}")


def check_value(spec: AttrSpec, v: Any) -> Any:
    """A Python value as the canonical value of an attribute of kind `spec.kind`.
    SCALAR and LITERAL values are left for `normalize_scalar` / `literal_from_nested`."""
    k, n = spec.kind, spec.name
    if k is AttrKind.INT:
        return _check_int(n, v)
    if k in (AttrKind.FLOAT, AttrKind.OPT_FLOAT):
        if v is None and k is AttrKind.OPT_FLOAT:
            return None
        if isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool):
            return math.nan if math.isnan(v) else float(v)  # one NaN: the sign and payload carry no meaning
        fail(E.ATTRIBUTE_TYPE, f"attribute {n} expects a float, found {v!r}")
    if k is AttrKind.BOOL:
        if isinstance(v, (bool, np.bool_)):
            return bool(v)
        fail(E.ATTRIBUTE_TYPE, f"attribute {n} expects true or false, found {v!r}")
    if k is AttrKind.ENUM:
        s = _check_str(n, v)
        if s not in spec.choices:
            fail(E.ATTRIBUTE_VALUE, f"attribute {n} must be one of {', '.join(map(repr, spec.choices))}, found {s!r}")
        return s
    if k in (AttrKind.STRING, AttrKind.MESH, AttrKind.FUNC):
        return _check_str(n, v).lstrip("@") if k is not AttrKind.STRING else _check_str(n, v)
    if k is AttrKind.DTYPE:
        if isinstance(v, DType):
            return v
        if isinstance(v, str) and v in DTYPES:
            return DTYPES[v]
        fail(E.UNKNOWN_DTYPE, f"attribute {n} expects a dtype, found {v!r}")
    if k is AttrKind.INTS:
        return tuple(_check_int(n, x) for x in _check_seq(n, v))
    if k is AttrKind.DIM:
        return _check_dim(n, v)
    if k is AttrKind.DIMS:
        return tuple(_check_dim(n, x) for x in _check_seq(n, v))
    if k is AttrKind.STRINGS:
        return tuple(_check_str(n, x) for x in _check_seq(n, v))
    if k is AttrKind.REFS:  # a set of names: sorted and without repeats, so it has one canonical form
        return tuple(sorted({_check_str(n, x).lstrip("@") for x in _check_seq(n, v)}))
    return v  # SCALAR, LITERAL: need the result dtype


def normalize_attrs(op: str, specs: dict[str, AttrSpec], given: dict[str, Any], dtype: DType | None) -> dict[str, Any]:
    """Check `given` against `specs`, fill defaults, and normalise every value.
    `dtype` is the result dtype that SCALAR and LITERAL attributes take."""
    for name in given:
        if name not in specs:
            fail(E.UNKNOWN_ATTRIBUTE, f"{op} has no attribute {name!r} (it has: {', '.join(specs) or 'none'})")
    out: dict[str, Any] = {}
    for name, spec in specs.items():
        if name not in given and spec.default is REQUIRED:
            fail(E.MISSING_ATTRIBUTE, f"{op} needs attribute {name!r} ({spec.kind.value})")
        try:
            v = check_value(spec, given[name]) if name in given else spec.default
            if spec.kind is AttrKind.SCALAR and dtype is not None:
                v = normalize_scalar(op, name, v, dtype)
            elif spec.kind is AttrKind.LITERAL:
                if isinstance(v, Literal):
                    v = Literal.from_numpy(v.to_numpy())  # canonical bytes: one NaN, bools 0 or 1
                elif dtype is None:
                    fail(E.RESULT_COUNT, f"{op} needs a declared result type for its literal")
                else:
                    v = literal_from_nested(op, v, dtype)
        except TypeRuleError as e:
            e.attr = name
            raise
        out[name] = v
    return out


# --- text -------------------------------------------------------------------------------

def format_float(x: float) -> str:
    """Shortest text that reads back to the same f64 (Python's repr: 1e-05, 0.5, inf, nan)."""
    return repr(float(x))


def format_element(x: Any, dtype: DType) -> str:
    """One literal element, canonically: the shortest decimal that reads back to the same
    value of `dtype` (for bf16 and f8: of f32, which holds them exactly), written as
    Python's repr writes a float (1.0, 0.001, 1e-05, 1e+16, inf, nan)."""
    if dtype.kind is Kind.BOOL:
        return "true" if x else "false"
    if dtype.is_int:
        return str(int(x))
    if dtype.name == "f64":
        return repr(float(x))
    narrow = np.float16(x) if dtype.name == "f16" else np.float32(x)
    if not np.isfinite(narrow):
        return repr(float(narrow))
    # At most 9 significant digits: repr of that decimal as an f64 keeps exactly those digits.
    return repr(float(np.format_float_scientific(narrow, unique=True)))


def _format_literal(lit: Literal) -> str:
    arr = lit.to_numpy()
    if arr.ndim == 0:
        return format_element(arr[()], lit.dtype)

    def rec(a) -> str:
        if a.ndim == 1:
            return "[" + ", ".join(format_element(x, lit.dtype) for x in a.tolist()) + "]"
        return "[" + ", ".join(rec(s) for s in a) + "]"

    return rec(arr)


def format_value(spec: AttrSpec, v: Any, dtype: DType | None = None) -> str:
    """`v` as text; `dtype` is the result dtype that SCALAR values are written for."""
    k = spec.kind
    if k is AttrKind.INT:
        return str(v)
    if k in (AttrKind.FLOAT, AttrKind.OPT_FLOAT):
        return format_float(v)
    if k is AttrKind.BOOL:
        return "true" if v else "false"
    if k in (AttrKind.ENUM, AttrKind.STRING):
        return json.dumps(v)
    if k is AttrKind.DTYPE:
        return v.name
    if k in (AttrKind.MESH, AttrKind.FUNC):
        return "@" + v
    if k is AttrKind.INTS:
        return "[" + ", ".join(map(str, v)) + "]"
    if k is AttrKind.DIM:
        return format_dim(v)
    if k is AttrKind.DIMS:
        return "[" + ", ".join(format_dim(d) for d in v) + "]"
    if k is AttrKind.STRINGS:
        return "[" + ", ".join(json.dumps(s) for s in v) + "]"
    if k is AttrKind.REFS:
        return "[" + ", ".join("@" + s for s in v) + "]"
    if k is AttrKind.SCALAR:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float) and dtype is not None:
            return format_element(v, dtype)  # shortest text for the dtype: 0.1, not 0.10000000149011612
        return format_float(v) if isinstance(v, float) else str(v)
    if k is AttrKind.LITERAL:
        return _format_literal(v)
    raise AssertionError(k)


def format_attrs(specs: dict[str, AttrSpec], attrs: dict[str, Any], dtype: DType | None = None) -> str:
    """`{a = 1, b = [0]}` with names sorted and defaults left out; "" when nothing is left.
    `dtype` is the op's first result dtype, which SCALAR values are written for."""
    parts = []
    for name in sorted(attrs):
        spec = specs[name]
        v = attrs[name]
        if spec.default is not REQUIRED and _same(v, spec.default, loose=spec.kind is AttrKind.SCALAR):
            continue
        parts.append(f"{name} = {format_value(spec, v, dtype)}")
    return "{" + ", ".join(parts) + "}" if parts else ""


def _same(a: Any, b: Any, loose: bool) -> bool:
    """Is `a` the default `b`? A SCALAR default (0.0) matches in any dtype (0, false)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if loose:
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return type(a) is type(b) and a == b


__all__ = ["normalize_attrs", "normalize_scalar", "literal_from_nested", "check_value", "format_attrs",
           "format_value", "format_float", "TypeRuleError"]
