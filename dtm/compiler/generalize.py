"""Automatic dynamic shapes: one symbolic function for programs that differ only in sizes.

A sampling loop whose sequence grows by a token, or training over batches of different
lengths, records the same program again and again with other sizes. Compiling each is what
made a 300-token loop take minutes. As torch.compile's "automatic dynamic" does after a
second distinct size, the front end asks this module for the symbolic function both
concrete ones are instances of, and compiles that once (the backend binds the symbols from
the input shapes at each run, dtm.runtime.cpu):

    key = skeleton(f)                      # equal for functions that differ only in sizes
    s = generalize(f1, f2)                 # None when no symbolic function fits both
    bindings = instance(s, f3)             # None unless s with these sizes is exactly f3

How sizes become symbols. A parameter dim that differs between the two functions is a
symbol; dims that differ by the same pair of values share one (torch's "duck sizing": the
[B, T] ids and the [B, T] mask are one B and one T), and one that is a multiple of a symbol
or of a product of two in both is that (the [B*T] targets beside the [B, T] ids). A quantized
(q8_0, q4_0) parameter whose sizes differ is another model's weight, not a size that varies:
no symbolic function is made (its products read a weight narrow only at static sizes, spec
2.2.1). Every other size that differs, in a
value's type or in an attribute (a reshape's shape, a slice's stop, an iota's length), is
written as the first expression over those symbols that gives both values: a dim of an
operand, a product of adjacent operand dims (a flatten), a dim seen earlier, that plus a
constant (`T - 1`), then `c*S + k` of one symbol. Sizes equal in both stay static.

Why this is safe. Two samples cannot tell `T` from `2*T - 7` everywhere; a guess is only a
guess. So the symbolic function is typechecked by the verifier (its types follow from its
attributes by the spec's type rules), and a function is run through it only when
`instance` shows that the symbolic function, with the symbols bound from this function's
parameter shapes, is exactly it: every type and every size attribute equal. Otherwise the
caller compiles the concrete function as before; a wrong guess costs a compile, never a
wrong value.
"""

from __future__ import annotations

from typing import Any

from ..errors import DTMError
from ..ir.module import Func, Module, Op, Value
from ..ir.registry import REGISTRY, AttrKind
from ..ir.symbolic import Dim, SymDim, dim_add, dim_mul, sym
from ..ir.types import TensorType
from ..ir.verifier import verify
from ..ref.interpreter import evaluate

_SIZE_KINDS = (AttrKind.DIM, AttrKind.DIMS)
_NO_GENERALIZING = (AttrKind.FUNC, AttrKind.REFS)  # calls into other functions: kept concrete
_MAX_POOL = 64  # symbolic dims remembered as candidates for later sizes


def _size_attrs(name: str) -> tuple[str, ...]:
    return tuple(a.name for a in REGISTRY[name].attrs if a.kind in _SIZE_KINDS)


def skeleton(f: Func) -> tuple | None:
    """The function with its sizes left out: equal for two functions that differ only in
    sizes (of parameters, of values, of size attributes). None for a function this module
    leaves alone: one with symbols already, shardings, or calls."""
    index: dict[int, int] = {}
    parts: list[Any] = []
    for p in f.params:
        if p.sharding is not None or not p.type.is_static:
            return None
        index[id(p)] = len(index)
        parts.append((p.type.dtype, p.type.rank))
    for op in f.ops:
        spec = REGISTRY[op.name].attr_index
        attrs = []
        for k, v in op.attrs.items():
            kind = spec[k].kind if k in spec else None
            if kind in _NO_GENERALIZING:
                return None
            if kind is AttrKind.DIMS:
                v = len(v)
            elif kind is AttrKind.DIM:
                v = None
            attrs.append((k, v))
        results = []
        for r in op.results:
            if r.sharding is not None or not r.type.is_static:
                return None
            index[id(r)] = len(index)
            results.append((r.type.dtype, r.type.rank))
        parts.append((op.name, tuple(index[id(v)] for v in op.operands), tuple(attrs), tuple(results)))
    parts.append(tuple(index[id(v)] for v in f.returns))
    return tuple(parts)


class _Fitter:
    """Writes the sizes of the second function over the symbols of the parameters."""

    def __init__(self):
        self.symbols: dict[tuple[int, int], SymDim] = {}
        self.first: dict[str, int] = {}   # the bindings that give the first function
        self.second: dict[str, int] = {}  # and the second
        self.pool: list[SymDim] = []
        self._pooled: set[SymDim] = set()

    def param_dims(self, pairs: list[tuple[int, int]]) -> dict[tuple[int, int], Dim]:
        """The parameters' dims that differ, smallest first: a multiple of a symbol or of a
        product of two (a flattened [B*T] beside the [B, T] it came from), else a new symbol."""
        dims: dict[tuple[int, int], Dim] = {}
        for a, b in sorted(set(pairs)):
            if a == b:
                dims[(a, b)] = a
                continue
            known = list(self.symbols.values())
            known += [dim_mul(x, y) for i, x in enumerate(known) for y in known[i:]]
            for d in known:
                x, y = evaluate(d, self.first), evaluate(d, self.second)
                if x and y and a % x == 0 and b % y == 0 and a // x == b // y:
                    dims[(a, b)] = dim_mul(a // x, d)
                    break
            else:
                name = f"S{len(self.symbols)}"
                s = self.symbols[(a, b)] = sym(name)
                self.first[name], self.second[name] = a, b
                dims[(a, b)] = s
            self._remember(dims[(a, b)])
        return dims

    def _remember(self, d: Dim) -> None:
        if isinstance(d, SymDim) and d not in self._pooled and len(self.pool) < _MAX_POOL:
            self._pooled.add(d)
            self.pool.append(d)

    def size(self, a: int, b: int, near: list[TensorType]) -> Dim | None:
        """The simplest expression that is `a` in the first function and `b` in the second:
        `near` are the operand types, whose dims and products of adjacent dims come first."""
        if a == b:
            return a
        candidates: list[Dim] = []
        for t in near:
            dims = [d for d in t.shape]
            candidates += [d for d in dims if isinstance(d, SymDim)]
            for i in range(len(dims)):
                prod: Dim = dims[i]
                for j in range(i + 1, len(dims)):
                    prod = dim_mul(prod, dims[j])
                    if isinstance(prod, SymDim):
                        candidates.append(prod)
        candidates += self.pool
        values = [(d, evaluate(d, self.first), evaluate(d, self.second)) for d in candidates]
        for d, x, y in values:
            if (x, y) == (a, b):
                return d
        for d, x, y in values:
            if x - y == a - b:
                return dim_add(d, a - x)
        for s in self.symbols.values():
            (name,) = s.symbols
            x, y = self.first[name], self.second[name]
            if (b - a) % (y - x) == 0:
                c = (b - a) // (y - x)
                return dim_add(dim_mul(c, s), a - c * x)
        return None

    def type(self, a: TensorType, b: TensorType, near: list[TensorType]) -> TensorType | None:
        if a == b:
            return a
        shape = []
        for x, y in zip(a.shape, b.shape):
            d = self.size(x, y, near)
            if d is None:
                return None
            self._remember(d)
            shape.append(d)
        return TensorType(a.dtype, tuple(shape))


def generalize(a: Func, b: Func) -> Func | None:
    """A symbolic function of which `a` and `b` (equal skeletons) are both instances, typechecked;
    None when the sizes that differ cannot all be written over the parameters' symbols."""
    if any(pa.type.dtype.is_quant and pa.type.shape != pb.type.shape for pa, pb in zip(a.params, b.params)):
        return None  # a quantized weight of another size is another weight: its products read it narrow only at static sizes
    fit = _Fitter()
    values: dict[int, Value] = {}
    params = []
    dims = fit.param_dims([(x, y) for pa, pb in zip(a.params, b.params) for x, y in zip(pa.type.shape, pb.type.shape)])
    for pa, pb in zip(a.params, b.params):
        t = TensorType(pa.type.dtype, tuple(dims[(x, y)] for x, y in zip(pa.type.shape, pb.type.shape)))
        params.append(values.setdefault(id(pa), Value(t, pa.name)))
    if not fit.symbols:
        return None
    ops = []
    for oa, ob in zip(a.ops, b.ops):
        operands = tuple(values[id(v)] for v in oa.operands)
        near = [v.type for v in operands]
        attrs = dict(oa.attrs)
        for k in _size_attrs(oa.name):
            x, y = oa.attrs[k], ob.attrs[k]
            if x == y:
                continue
            if isinstance(x, tuple):
                sizes = tuple(fit.size(i, j, near) for i, j in zip(x, y))
                if any(d is None for d in sizes):
                    return None
                attrs[k] = sizes
            else:
                attrs[k] = fit.size(x, y, near)
                if attrs[k] is None:
                    return None
        results = []
        for ra, rb in zip(oa.results, ob.results):
            t = fit.type(ra.type, rb.type, near)
            if t is None:
                return None
            results.append(values.setdefault(id(ra), Value(t, ra.name)))
        ops.append(Op(oa.name, operands, attrs, tuple(results), oa.loc))
    returns = [values[id(v)] for v in a.returns]
    s = Func(a.name, params, [(v.type, None) for v in returns], ops, returns, a.loc, a.return_loc)
    module = Module()
    module.funcs[s.name] = s
    try:
        verify(module)
    except DTMError:
        return None
    if instance(s, a) is None or instance(s, b) is None:
        return None
    return s


def instance(s: Func, c: Func) -> dict[str, int] | None:
    """The bindings under which symbolic `s` is exactly concrete `c` (whose skeleton equals
    s's), or None when no bindings make it so."""
    bindings: dict[str, int] = {}
    multiples = []
    for ps, pc in zip(s.params, c.params):
        for d, n in zip(ps.type.shape, pc.type.shape):
            if not isinstance(d, SymDim):
                if d != n:
                    return None
            elif len(d.terms) == 1 and d.terms[0][1] == 1 and len(d.terms[0][0]) == 1:  # one symbol
                if bindings.setdefault(d.terms[0][0][0], n) != n:
                    return None
            else:  # a multiple of symbols bound by other dims (generalize)
                multiples.append((d, n))
    if any(evaluate(d, bindings) != n for d, n in multiples):
        return None
    for os_, oc in zip(s.ops, c.ops):
        for k in _size_attrs(os_.name):
            v = os_.attrs[k]
            got = tuple(evaluate(d, bindings) for d in v) if isinstance(v, tuple) else evaluate(v, bindings)
            if got != oc.attrs[k]:
                return None
        for rs, rc in zip(os_.results, oc.results):
            t = rs.type
            if t.is_static:
                if t != rc.type:
                    return None
            elif tuple(evaluate(d, bindings) for d in t.shape) != rc.type.shape:
                return None
    return bindings
