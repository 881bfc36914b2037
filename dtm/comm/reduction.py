"""Elementwise reductions of collectives (spec 3.11, `all_reduce`): sum, prod, max, min and
avg on numpy buffers, in place.

Narrow floats (f16, bf16, f8) are combined in f32 and rounded once at the end, so an
algorithm keeps its partial results in `work_dtype` and calls `finish` last. `avg` combines
like `sum`; `finish` divides by the group size (integers truncate toward zero, after the
wrapped sum, as the reference does). `max` and `min` propagate NaN.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..errors import DTMError, ErrorCode as E

REDUCE_OPS = ("sum", "prod", "max", "min", "avg")
_UFUNC = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}
NARROW_FLOATS = frozenset(np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
                                                 ml_dtypes.float8_e5m2))


def check_reducible(dtype: np.dtype, op: str, where: str) -> None:
    if op not in _UFUNC:
        raise DTMError(E.ATTRIBUTE_VALUE, f"{where}: unknown reduction {op!r}; expected one of {', '.join(REDUCE_OPS)}")
    if dtype.kind not in "iuf" and dtype not in NARROW_FLOATS:
        raise DTMError(E.DTYPE_MISMATCH, f"{where}: reductions need a numeric dtype, found {dtype}")


def work_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype partial results are kept in: f32 for narrow floats, else the dtype itself."""
    return np.dtype(np.float32) if np.dtype(dtype) in NARROW_FLOATS else np.dtype(dtype)


def combine(op: str, first: np.ndarray, second: np.ndarray, out: np.ndarray) -> None:
    """out = first (op) second, elementwise; `first` holds the lower group ranks' part, so
    every rank that combines the same two parts gets bitwise the same result. `out` may be
    either operand; narrow-float operands are widened by the ufunc (out is f32)."""
    _UFUNC[op](first, second, out=out, casting="unsafe")


def finish(op: str, acc: np.ndarray, n: int, out: np.ndarray) -> None:
    """Write the final result of a reduction over `n` ranks from its partial `acc` (in the
    work dtype) to `out` (in the tensor's dtype): avg's division, then the single rounding.
    `acc` is the algorithm's own buffer and may be overwritten."""
    if op == "avg":
        if acc.dtype.kind in "iu":
            wide = np.dtype(np.uint64 if acc.dtype.kind == "u" else np.int64)
            q = acc.astype(wide)
            # Truncate toward zero: floor division, stepped back up for inexact negatives.
            div = np.floor_divide(q, wide.type(n))
            if acc.dtype.kind == "i":
                div += ((q < 0) & (np.remainder(q, wide.type(n)) != 0)).astype(wide)
            np.copyto(out, div, casting="unsafe")
            return
        np.divide(acc, acc.dtype.type(n), out=acc)
    if acc is not out:
        np.copyto(out, acc, casting="unsafe")
