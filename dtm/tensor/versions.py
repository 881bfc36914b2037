"""torch's version counter on the lazy Tensor: backward() refuses a value that an op saved
for its gradient and that an in-place op changed afterwards (spec 1.7).

DTM does not need the counter to compute: an in-place write rebinds the tensor, and the ops
recorded before it keep reading a snapshot of the old value (core.Tensor._snapshot), so the
gradient of the program as written could be computed. torch cannot (its saved tensor is
the changed storage) and raises; DTM raises the same error, so a script behaves as it does
under torch. A snapshot that replaced a value carries `_written` = (the live tensor when it
is a leaf, else None; what wrote it, "mul_ at train.py:12"; whether only the in-place op's
own computation reads it, which backward() accepts: torch saves that original value,
`original_self`). A snapshot's op that saved its own result is refused either way.

Which values an op's gradient reads is torch's (tools/autograd/derivatives.yaml, where a
value is saved only when a gradient that reads it is computed): `NEEDS[op][i]` lists what
the gradient of operand i reads, as paths from the op's result: () is the result itself,
(j,) its operand j, (j, k) operand k of operand j. An operand that is a movement op of
another (a reshape, a transpose, a slice: torch's views, which share their base's counter)
is changed when what it moves is. A tensor's `_saves`, when not None, replaces its op's row:
("relu", rows) where DTM computes a torch function from other ops (relu is `max` with 0 and
saves its result; clamp is `where` and saves its input). Ops not listed read no saved value.
"""

from __future__ import annotations

from typing import Any

from ..errors import ErrorCode, user_error as error

OUT, A, B, C = (), (0,), (1,), (2,)

NEEDS: dict[str, tuple[tuple[tuple[int, ...], ...], ...]] = {
    # the result: exp, sigmoid, tanh, sqrt, rsqrt, reciprocal, softmax, log_softmax
    **{op: ((OUT,),) for op in ("exp", "exp2", "sigmoid", "tanh", "sqrt", "rsqrt", "reciprocal", "softmax",
                               "log_softmax")},
    # an operand
    **{op: ((A,),) for op in ("log", "log2", "sin", "cos", "erf", "abs", "gelu", "silu")},
    "mul": ((B,), (A,)), "matmul": ((B,), (A,)), "div": ((B,), (A, B)),
    "pow": ((A, B), (A, B, OUT)), "mod": ((), (A, B)),
    "max": ((A, B), (A, B)), "min": ((A, B), (A, B)),
    "reduce_max": ((A, OUT),), "reduce_min": ((A, OUT),), "reduce_prod": ((A, OUT),),
    # (torch's CPU attention saves k and v, and a scaled copy of q; its flash kernels save q too)
    "layer_norm": ((A, B, C),) * 3, "scaled_dot_product_attention": ((B, C),) * 3,
    # an index or a condition
    "where": ((), (A,), (A,)), "gather": ((B,),), "scatter_add": ((), (), (B,)), "dynamic_slice": ((B,),),
    "dynamic_update_slice": ((C,), (C,)),
}

# Ops whose result is a torch view of operand 0: it changes when that operand does.
MOVES = frozenset(("reshape", "permute", "broadcast_to", "slice"))

# Rows of `_saves` for torch functions DTM computes from other ops (functional.py sets them).
RESULT = ((OUT,),)       # relu: `max(x, 0)`, saving its result
NOTHING = ()             # max(x, dim)'s values: torch saves the indices only
INPUT = ((A,),)          # pow(x, 0.5): `sqrt`, saving its input
CLAMP = ((), (A, C), (A, C))  # clamp: `where(x < lo, lo, x)`, saving x (operand 2) and its bounds


def _follow(t: Any, path: tuple[int, ...]) -> Any:
    for j in path:
        if j >= len(t._inputs):
            return None  # a computed value whose graph was dropped: nothing to check
        t = t._inputs[j]
    return t


def _changed(s: Any) -> str | None:
    """What wrote s's value, or the value s moves, after an op saved it; None when neither
    was changed. A snapshot read only by its in-place op's own computation was not."""
    while True:
        w = s._written
        if w is not None:
            return w[1] if not w[2] else None
        if s._op in MOVES and s._inputs:
            s = s._inputs[0]
            continue
        return None


def check(t: Any) -> None:
    """Raise if the gradient of the op that computed t (which requires grad) reads a saved
    value that an in-place op changed since."""
    if t._written is not None and not any(i.requires_grad for i in t._inputs):
        raise error(ErrorCode.USE_AFTER_ASSIGN,
                    f"backward(): one of the variables needed for gradient computation has been modified by an "
                    f"inplace operation: a {t._type} tensor with gradient history was changed by {t._written[1]} "
                    "under no_grad, or through .data or detach(). torch would let the gradient through as if it "
                    "had not changed; DTM refuses. Change it with gradient history, or after backward()")
    if t._saves is not None:
        name, needs = t._saves
    else:
        needs = NEEDS.get(t._op)
        if needs is None:
            return
        name = t._op
    inputs = t._inputs
    if t._written is not None and any(OUT in reads for reads in needs):  # (torch saves results unguarded)
        raise _refusal(name, OUT, t, t._written[1])
    for i, reads in enumerate(needs):
        if i >= len(inputs) or not inputs[i].requires_grad:
            continue
        for path in reads:
            if not path:
                continue
            s = _follow(t, path)
            what = _changed(s) if s is not None else None
            if what is not None:
                raise _refusal(name, path, s, what)


def _refusal(name: str, path: tuple[int, ...], s: Any, what: str):
    value = f"the {s._type} result of {name}" if not path else f"a {s._type} operand of {name}"
    return error(ErrorCode.USE_AFTER_ASSIGN,
                 f"backward(): one of the variables needed for gradient computation has been modified by an "
                 f"inplace operation: {value}, saved for its gradient, was changed afterwards by {what} (torch "
                 "raises here too: its version counter). Call backward() before the in-place op, use its "
                 "out-of-place form (y = y * 2 for y.mul_(2)), or change a clone() of the value")


def saves(t: Any, name: str, rows: tuple) -> Any:
    """t, marked as computed by torch's function `name`, whose gradient reads `rows` (in
    NEEDS's form) rather than what t's own op's row says."""
    t._saves = (name, rows)
    return t
