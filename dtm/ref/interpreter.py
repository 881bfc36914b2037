"""The reference interpreter: run one function of a module on numpy arrays, op by op.

    results = run(module, "f", [x, w])            # one device
    results = run(module, "f", inputs, ctx)       # with a rank, a store, a device group

Steps: check the inputs against the parameter types and bind the symbols of the parameter
dims from the input shapes; then for each op evaluate the symbolic dims of its result types
and attributes, call its implementation in `ops.IMPLS`, and check every result against its
type; last, return the function's results.

Arrays and aliasing: inputs are used as given, not copied, because `assign` writes the new
value into the caller's array in place (np.copyto): that is how KV caches and optimizer
state update, so an input that is assigned must be a writable array the caller owns. In a
function that can write in place (it has an `assign` or a `call`), a result that might
share memory with an operand (a view from reshape, say) is copied, so no later `assign`
can change a value already computed; elsewhere nothing is ever written in place and views
are kept (copying a transposed embedding on every step would dominate GPT-2's run time).
No returned array shares memory with an input, so a later in-place write to an input
never changes a result already handed out.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import DTMError, ErrorCode as E, TensorError, user_error
from ..ir.module import Func, Module, Value
from ..ir.symbolic import SymDim, format_dim
from ..ir.types import TensorType
from . import quant
from .context import RefContext
from .ops import IMPLS, TAKES_IN_TYPES, register

Bindings = dict[str, int]


def run(module: Module, func: str, inputs: Sequence[np.ndarray], ctx: RefContext | None = None) -> list[np.ndarray]:
    """Run function `func` of `module` on `inputs` (one numpy array per parameter, quantized
    ones as their uint8 block storage) and return its results as numpy arrays."""
    f = module.funcs.get(func)
    if f is None:
        raise DTMError(E.UNDEFINED_FUNC, f"run: module has no function @{func} (it has: "
                       f"{', '.join('@' + n for n in module.funcs) or 'none'})")
    ctx = ctx if ctx is not None else RefContext()
    outer = ctx.module
    ctx.module = module
    if not ctx.meshes:
        ctx.meshes = dict(module.meshes)
    try:
        with np.errstate(all="ignore"):
            return _run(f, inputs, ctx)
    finally:
        ctx.module = outer


def _run(f: Func, inputs: Sequence[np.ndarray], ctx: RefContext) -> list[np.ndarray]:
    if len(inputs) != len(f.params):
        raise DTMError(E.OPERAND_COUNT, f"@{f.name} takes {len(f.params)} input(s), found {len(inputs)}")
    inputs = [np.asarray(x) for x in inputs]
    for i, (p, x) in enumerate(zip(f.params, inputs)):
        check_array(x, p.type, f"@{f.name} input {i} (%{p.name})", shape=False)
    bindings = bind_symbols(f, inputs)
    env: dict[Value, np.ndarray] = {}
    for i, (p, x) in enumerate(zip(f.params, inputs)):
        check_array(x, resolve_type(p.type, bindings), f"@{f.name} input {i} (%{p.name})")
        env[p] = x
    writes = any(op.name in ("assign", "call") for op in f.ops)
    specs: dict[TensorType, _Spec] = {}  # each distinct result type, resolved once per run
    resolved: dict = {}                  # and each distinct attribute set
    for n, op in enumerate(f.ops):
        args = [env[v] for v in op.operands]
        rspecs = []
        for r in op.results:
            spec = specs.get(r.type)
            if spec is None:
                spec = specs[r.type] = _Spec(resolve_type(r.type, bindings))
                if ctx.check_memory is not None:
                    ctx.check_memory(quant.storage_bytes(spec.type), f"@{f.name} op {n} ({op.name})'s result {spec.type}")
            rspecs.append(spec)
        attrs = op.attrs
        if bindings:
            attrs = resolved.get(op.attrs_key)
            if attrs is None:
                attrs = resolved[op.attrs_key] = resolve_attrs(op.attrs, bindings)
        try:
            kw = {"in_types": tuple(resolve_type(v.type, bindings) for v in op.operands)} \
                if op.name in TAKES_IN_TYPES else {}
            outs = IMPLS[op.name](ctx, attrs, *args, out_types=tuple(sp.type for sp in rspecs), **kw)
        except DTMError as e:
            raise e.in_context(f"@{f.name} op {n} ({op.name})") from e
        except MemoryError:
            raise out_of_memory(f"@{f.name} op {n} ({op.name})", [sp.type for sp in rspecs]) from None
        for r, spec, x in zip(op.results, rspecs, outs):
            env[r] = spec.own(np.asarray(x), args if writes else (), op.name)
    results = []
    for v in f.returns:
        x = env[v]
        results.append(x.copy() if any(np.may_share_memory(x, a) for a in inputs) else x)
    return results


@register("call")
def _call(ctx: RefContext, attrs, *args, out_types):
    """`call` runs another function of the module being run, on the same context: the
    interpreter's own op (ops.py holds the ops that need no interpreter)."""
    return tuple(run(ctx.module, attrs["callee"], args, ctx))


def out_of_memory(where: str, types: Sequence[TensorType]) -> TensorError:
    """E0810 at the user's line for an op whose memory the system refused: numpy's
    MemoryError, raised where the op allocates its results or its own working arrays."""
    nbytes = sum(quant.storage_bytes(t) for t in types)
    return user_error(E.OUT_OF_MEMORY, f"{where}: out of memory: the system refused the memory for its results "
                      f"{', '.join(map(str, types))} ({nbytes / 2**30:.1f} GiB, {nbytes:,} bytes) or its work on them")


class _Spec:
    """A result type with static dims, and the numpy array that holds a value of it."""

    __slots__ = ("type", "shape", "dtype")

    def __init__(self, t: TensorType):
        self.type = t
        self.shape = quant.storage_shape(t)
        self.dtype = quant.storage_dtype(t.dtype)

    def own(self, x: np.ndarray, args: list[np.ndarray], opname: str) -> np.ndarray:
        """x checked against the type, copied when it might alias an operand."""
        if x.dtype != self.dtype or x.shape != self.shape:
            raise AssertionError(f"dtm.ref bug: {opname} returned a {x.dtype} array of shape {list(x.shape)} "
                                 f"for {self.type}")
        for a in args:
            if np.may_share_memory(x, a):
                return x.copy()
        return x


# --- symbols -------------------------------------------------------------------------------

def _single_symbol(d: SymDim) -> str | None:
    """The symbol when d is exactly one symbol (`B`), else None (`2*B`, `B*T`, `T - 1`)."""
    if len(d.terms) == 1:
        mono, coeff = d.terms[0]
        if coeff == 1 and len(mono) == 1:
            return mono[0]
    return None


def evaluate(d, bindings: Bindings) -> int:
    """A dim's value under `bindings`."""
    if isinstance(d, int):
        return d
    total = 0
    for mono, coeff in d.terms:
        term = coeff
        for s in mono:
            if s not in bindings:
                raise DTMError(E.UNBOUND_SYMBOL, f"symbol {s} in {format_dim(d)} is not bound by an input")
            term *= bindings[s]
        total += term
    return total


def _logical_shape(x: np.ndarray, t: TensorType) -> tuple[int, ...] | None:
    """The logical shape of array x as a value of t's dtype (quantized: from the storage)."""
    if not t.dtype.is_quant:
        return x.shape
    if x.ndim == 0 or x.shape[-1] % t.dtype.itemsize:
        return None
    return (*x.shape[:-1], x.shape[-1] // t.dtype.itemsize * t.dtype.block)


def bind_symbols(f: Func, inputs: Sequence[np.ndarray]) -> Bindings:
    """Bind the symbols of the parameter dims from the input shapes: a dim that is one
    symbol (`%x: f32[B, T]`) binds it, checking every occurrence agrees; then a dim linear
    in one still unbound symbol (`2*T + 1`) solves for it. Dims left over are checked by
    `check_array` once every symbol is bound."""
    bindings: Bindings = {}
    pending: list[tuple[SymDim, int, str]] = []
    for i, (p, x) in enumerate(zip(f.params, inputs)):
        shape = _logical_shape(x, p.type)
        if shape is None or len(shape) != p.type.rank:
            continue  # check_array reports it
        for j, (d, n) in enumerate(zip(p.type.shape, shape)):
            if not isinstance(d, SymDim):
                continue
            what = f"@{f.name} input {i} (%{p.name}) dim {j}"
            name = _single_symbol(d)
            if name is None:
                pending.append((d, int(n), what))
            elif name in bindings and bindings[name] != n:
                raise DTMError(E.SHAPE_MISMATCH, f"{what} is {name} = {n}, but an earlier input bound "
                               f"{name} = {bindings[name]}")
            else:
                bindings[name] = int(n)
    progress = True
    while progress:
        progress = False
        for d, n, what in pending:
            free = d.symbols - bindings.keys()
            if len(free) != 1:
                continue
            (s,) = free
            coeff = sum(c for mono, c in d.terms if mono == (s,))
            if coeff == 0 or any(s in mono and mono != (s,) for mono, _ in d.terms):
                continue  # not linear in s
            rest = evaluate(d, {**bindings, s: 0})
            if (n - rest) % coeff or (n - rest) // coeff < 0:
                raise DTMError(E.SHAPE_MISMATCH, f"{what} is {format_dim(d)} = {n}: no size of {s} fits")
            bindings[s] = (n - rest) // coeff
            progress = True
    return bindings


def resolve_type(t: TensorType, bindings: Bindings) -> TensorType:
    """t with every dim evaluated; a dim that comes out negative (`T - 2` with T = 1) is an error."""
    if t.is_static:
        return t
    shape = tuple(evaluate(d, bindings) for d in t.shape)
    if any(d < 0 for d in shape):
        raise DTMError(E.INVALID_DIM, f"{t} has a negative dim with "
                       f"{', '.join(f'{k} = {v}' for k, v in sorted(bindings.items()))}: {list(shape)}")
    return TensorType(t.dtype, shape)


def resolve_attrs(attrs: dict[str, Any], bindings: Bindings) -> dict[str, Any]:
    """attrs with every symbolic dim (reshape shape, slice start / stop, dynamic_slice size)
    evaluated."""
    out = {}
    for k, v in attrs.items():
        if isinstance(v, SymDim):
            v = evaluate(v, bindings)
        elif isinstance(v, tuple) and any(isinstance(d, SymDim) for d in v):
            v = tuple(evaluate(d, bindings) for d in v)
        out[k] = v
    return out


def check_array(x: np.ndarray, t: TensorType, what: str, shape: bool = True) -> None:
    """Raise DTMError unless x holds a value of type t: its dtype, its rank, and (for a
    static t, unless `shape` is false) its shape."""
    want = quant.storage_dtype(t.dtype)
    if x.dtype != want:
        raise DTMError(E.DTYPE_MISMATCH, f"{what}: expected {t} (a {want} array), found a {x.dtype} array")
    if x.ndim != t.rank:
        raise DTMError(E.RANK_MISMATCH, f"{what}: expected {t}, found an array of rank {x.ndim}")
    if shape and x.shape != quant.storage_shape(t):
        shape = _logical_shape(x, t)
        found = f"shape {list(shape)}" if shape == x.shape else f"storage shape {list(x.shape)}"
        raise DTMError(E.SHAPE_MISMATCH, f"{what}: expected {t}, found {found}")
