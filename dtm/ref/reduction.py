"""The reductions of collectives and partial placements (spec 3.11, `all_reduce`; 2.7,
`partial`): sum, prod, max, min and avg on numpy buffers. The one table of what each
reduce op computes, used by the reference collectives, the in-process devices (L0) and
every algorithm of dtm.comm.

Narrow floats (f16, bf16, f8) are combined in f32 and rounded once at the end, so an
algorithm keeps its partial results in `work_dtype` and calls `finish` last. `avg` combines
like `sum`; `finish` divides by the group size (integers truncate toward zero, after the
wrapped sum). `max` and `min` propagate NaN. Combining `first` with `second` always puts the
lower group ranks' part first, so every rank that combines the same parts gets bitwise the
same result; `reduce_in_order` is the reference's order: left to right over the group.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import DTMError, ErrorCode as E
from ..ir.dtypes import NARROW_FLOATS
from ..ir.types import REDUCE_OPS

# How two partial results combine, per reduce op (avg: as sum, divided in `finish`).
UFUNCS: dict[str, np.ufunc] = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum,
                               "min": np.minimum}
assert set(UFUNCS) == set(REDUCE_OPS), "one ufunc per reduce op of the IR"


def check_reducible(dtype: np.dtype, op: str, where: str) -> None:
    if op not in UFUNCS:
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
    UFUNCS[op](first, second, out=out, casting="unsafe")


def finish(op: str, acc: np.ndarray, n: int, out: np.ndarray) -> None:
    """Write the final result of a reduction over `n` ranks from its partial `acc` (in the
    work dtype) to `out` (in the tensor's dtype): avg's division, then the single rounding.
    `acc` is the caller's own buffer and may be overwritten; `out` may be `acc` itself."""
    if op == "avg":
        if acc.dtype.kind in "iu":
            wide = np.dtype(np.uint64 if acc.dtype.kind == "u" else np.int64)
            q = acc.astype(wide)  # the wrapped sum, divided in a wide type (n may not fit i8)
            # Truncate toward zero: floor division, stepped back up for inexact negatives.
            div = np.floor_divide(q, wide.type(n))
            if acc.dtype.kind == "i":
                div += ((q < 0) & (np.remainder(q, wide.type(n)) != 0)).astype(wide)
            np.copyto(out, div, casting="unsafe")
            return
        np.divide(acc, acc.dtype.type(n), out=acc)
    if acc is not out:
        np.copyto(out, acc, casting="unsafe")


def reduce_in_order(xs: Sequence[np.ndarray], op: str) -> np.ndarray:
    """The reduction of the group members' values `xs`, combined left to right in group
    order (so float sums are deterministic), as a new array of their dtype."""
    acc = np.array(xs[0], dtype=work_dtype(xs[0].dtype), copy=True)
    for x in xs[1:]:
        combine(op, acc, x, out=acc)
    out = np.empty(xs[0].shape, xs[0].dtype)
    finish(op, acc, len(xs), out)
    return out


__all__ = ["UFUNCS", "REDUCE_OPS", "check_reducible", "work_dtype", "combine", "finish", "reduce_in_order"]
