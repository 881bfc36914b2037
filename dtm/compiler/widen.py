"""The widening pass: ops on f16 and bf16 values computed in f32, as the spec defines them.

The reference computes every op on a narrow float in f32 and rounds its result once to the
result dtype (dtm.ref.ops). This pass writes exactly that into the IR, so the compiler's f32
kernels compute it, instead of the reference running each op as a fallback step: an
autocast training step holds hundreds of bf16 ops (its products, their biases and
activations, attention, and all of their gradients).

    y = op(x1, x2)          (bf16)
 -> y = cast(op(wide(x1), wide(x2)), bf16)

`wide(x)` is an f32 value equal to x exactly: cast(x, f32), made once per value where it is
first read, or, for the result of a movement op (exact on any dtype) or of reduce_max /
reduce_min, the f32 op's own result, so that chains of views (a head split, a transpose) stay
in f32 and a product reads its operand as a strided view of cast(x, f32) with x stored in
bf16 (which the compiler's bf16 product reads itself: schedule.bf16_operands, c_bf16.py).
Ops whose result is not a narrow float (compare, argmax) take the wide operands and keep
their result. The rounded narrow results are kept as the original Values (the rest of the
function, its returns and assigns, are untouched); those no op reads any more are removed
by simplify's dead-code pass.

A cast of a permute or reshape of an f32 value to a narrow float (autocast's cast of a
transposed weight) is made the cast of the value in its own layout, then the movement ops
(in f32, exactly): the narrow copy is then written in order and read through strides.

Left as they are (the reference runs them, as before): ops the spec computes in f64 for
narrow floats (erf, exact gelu), and ops with no f32 rewrite here (gather, scatter_add,
dynamic slices, argsort, random draws, collectives, store ops). f8 dtypes are not widened.
"""

from __future__ import annotations

from ..ir.dtypes import DTYPES
from ..ir.module import Func, Op, Value
from ..ir.registry import REGISTRY, Category
from ..ir.types import TensorType
from .irutil import Emitter, new_func

WIDENED = frozenset(("f16", "bf16"))
F32 = DTYPES["f32"]
_ELEMENTWISE = (Category.UNARY, Category.BINARY, Category.COMPARE, Category.TERNARY)
_NOT_WIDENED = frozenset(("cast", "bitcast", "erf"))
_MOVES = frozenset(("reshape", "permute", "broadcast_to", "slice", "pad", "concat", "flip"))
_REDUCES = frozenset(("reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "argmax", "argmin", "cumsum"))
_EXACT = frozenset(("reduce_max", "reduce_min"))  # their result is one of their operand's values
_COMPOSITES = frozenset(("softmax", "log_softmax", "layer_norm", "silu", "gelu", "scaled_dot_product_attention"))


def _narrow(v: Value) -> bool:
    return v.type.dtype.name in WIDENED


def widenable(op: Op) -> bool:
    """Whether the pass computes `op` in f32 (see the module docstring)."""
    if not any(_narrow(v) for v in (*op.operands, *op.results)):
        return False
    name = op.name
    if name in _NOT_WIDENED:
        return False
    if name == "gelu":
        return op.attrs["approximate"] != "none"  # exact gelu: f64 in the spec
    if name in _COMPOSITES or name in _MOVES or name in _REDUCES or name == "matmul":
        return True
    return REGISTRY[name].category in _ELEMENTWISE


_BIJECTIVE = frozenset(("permute", "reshape"))  # movement ops that neither drop nor repeat elements


def _narrowed_view(op: Op, producer: dict) -> bool:
    """Whether op casts a permute (or a reshape) of an f32 value to f16 or bf16."""
    if op.name != "cast" or not _narrow(op.results[0]) or op.operands[0].type.dtype is not F32:
        return False
    p = producer.get(op.operands[0])
    return p is not None and p.name in _BIJECTIVE


def widen(func: Func) -> Func:
    """`func` with its f16 and bf16 ops computed in f32 (see the module docstring)."""
    if not any(widenable(op) for op in func.ops):
        return func
    ops: list[Op] = []
    e = Emitter(ops, prefix="w")
    wide: dict[Value, Value] = {}

    def w(v: Value) -> Value:
        if not _narrow(v):
            return v
        if v not in wide:
            wide[v] = e("cast", v, type=TensorType(F32, v.type.shape), to=F32)
        return wide[v]

    producer: dict[Value, Op] = {}
    for op in func.ops:
        if _narrowed_view(op, producer):
            # cast(permute(W), bf16), autocast's cast of `W.T` (a tied lm_head): the cast of W in its
            # own layout, then the permute in f32, which a product reads as strides (a transposing
            # cast of GPT-2's 50257 x 768 embedding took 335 ms of a 6.7 s step)
            y, chain, base = op.results[0], [], op.operands[0]
            while producer.get(base) is not None and producer[base].name in _BIJECTIVE:
                chain.append(producer[base])
                base = producer[base].operands[0]
            r = w(e("cast", base, type=TensorType(y.type.dtype, base.type.shape), to=y.type.dtype))
            for m in reversed(chain):
                r = e(m.name, r, **m.attrs)
            e("cast", r, type=y.type, result=y, to=y.type.dtype)
            wide[y] = r
            continue
        producer.update((r, op) for r in op.results)
        if op.name == "cast" and _narrow(op.operands[0]) and op.results[0].type.dtype is F32:
            ops.append(op)
            wide.setdefault(op.operands[0], op.results[0])  # the program's own widening cast
            continue
        if not widenable(op):
            ops.append(op)
            continue
        y = op.results[0]
        args = [w(x) for x in op.operands]
        if not _narrow(y):  # compare, argmax: f32 operands, the result as it was
            e(op.name, *args, result=y, **op.attrs)
            continue
        r = e(op.name, *args, **op.attrs)
        e("cast", r, type=y.type, result=y, to=y.type.dtype)
        if op.name in _MOVES or op.name in _EXACT:
            wide[y] = r  # the f32 op's values are y's exactly
    return new_func(func, ops, list(func.returns))
