"""Reverse-mode automatic differentiation as an IR-to-IR transform (docs/architecture.md: the backward
pass is IR too, so gradients fuse and shard like any other code).

    name = grad(module, "loss", wrt=[1, 2])          # adds @loss_grad to module
    # @loss_grad(same params) -> (loss's outputs..., d out / d param 1, d out / d param 2)

    name = grad(module, "f", wrt=[0], out_index=1, seed="param")
    # @f_grad(same params, cotangent of output 1) -> (f's outputs..., vjp w.r.t. param 0)

The new function is plain IR: `func`'s ops copied in order (effects included, in the same
order), then the backward ops, with dead backward code removed. The cotangent rules are
`VJP` (vjp_rules.py, one per op name); ops in `NON_DIFFERENTIABLE` pass no gradient.

Semantics:
- Only float values carry cotangents; a cotangent has its value's type. A param that does
  not influence the output (or is not float) gets a zero gradient of its own type.
- A value used several times gets the sum of its uses' cotangents.
- `assign` is copied but not differentiated: gradients reach its target parameter only
  through uses before the assign. The backward code may need the target's pre-assign value
  after the assign, where the verifier forbids using the parameter; such a parameter is
  copied (`reshape` to its own shape) just before the assign, and the backward code reads
  the copy.
- `call` is differentiated through a generated function `@<callee>_vjp(callee params...,
  cotangents of its float results...) -> (cotangents of its float params...)`, added to
  the module once; a callee with effects cannot be differentiated.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import DTMError, ErrorCode as E
from ..ir.builder import FuncBuilder
from ..ir.module import Func, Module, Op, Value
from ..ir.registry import REGISTRY
from ..ir.verifier import verify
from .vjp_rules import NON_DIFFERENTIABLE, VJP, zeros

__all__ = ["grad", "vjp_function", "VJP", "NON_DIFFERENTIABLE", "AutodiffError"]


class AutodiffError(DTMError):
    """A function that cannot be differentiated as asked."""


def _is_float(v: Value) -> bool:
    return v.type.dtype.is_float


class _Differentiator:
    """Copies `src` into the function that `b` builds, then emits its backward pass."""

    def __init__(self, b: FuncBuilder, src: Func):
        self.b = b
        self.src = src
        self.map: dict[Value, Value] = {}      # src value -> its copy
        self.snapshot: dict[Value, Value] = {}  # copied param -> its pre-assign copy
        self.varied: set[Value] = set()
        self.active: set[Op] = set()

    def copy_params(self) -> None:
        for p in self.src.params:
            self.map[p] = self.b.param(p.type, name=p.name, sharding=p.sharding)

    def analyse(self, seeds: Sequence[Value], wrt: Sequence[Value]) -> None:
        """Mark the float values that depend on `wrt` and the ops on a path from `wrt` to
        a seed: only those are differentiated."""
        varied = {p for p in wrt if _is_float(p)}
        for op in self.src.ops:
            if op.name in NON_DIFFERENTIABLE:
                continue
            if any(v in varied for v in op.operands):
                varied.update(r for r in op.results if _is_float(r))
        useful = set(seeds)
        for op in reversed(self.src.ops):
            if op.name in NON_DIFFERENTIABLE:
                continue
            if any(r in useful for r in op.results):
                ins = [v for v in op.operands if v in varied]
                if ins:
                    self.active.add(op)
                    useful.update(ins)
        self.varied = varied

    def copy_forward(self) -> None:
        b, m = self.b, self.map
        # Params read by the backward code that an assign overwrites on the way.
        needed = {v for op in self.active for v in op.operands}
        for op in self.src.ops:
            if op.name == "assign":
                target = op.operands[0]
                t = m[target]
                if target in needed and t not in self.snapshot and not t.type.dtype.is_quant:
                    self.snapshot[t] = b.reshape(t, shape=list(t.type.shape), name=f"{target.name}_pre_assign")
            results = tuple(Value(r.type, r.name, r.sharding) for r in op.results)
            b.func.ops.append(Op(op.name, tuple(m[v] for v in op.operands), dict(op.attrs), results,
                                 attrs_key=op.attrs_key))
            m.update(zip(op.results, results))

    def backward(self, seeds: Sequence[tuple[Value, Value]], wrt: Sequence[Value]) -> list[Value]:
        """Emit the backward pass from `seeds` (src value, its cotangent); return the
        gradient of each of `wrt` (zeros where none flows)."""
        b, m = self.b, self.map
        ct: dict[Value, Value] = {}

        def accumulate(v: Value, g: Value) -> None:
            ct[v] = b.add(ct[v], g) if v in ct else g

        for v, g in seeds:
            if v in self.varied:
                accumulate(v, g)
        for op in reversed(self.src.ops):
            if op not in self.active:
                continue
            cts = [ct.get(r) for r in op.results]
            if all(g is None for g in cts):
                continue
            rule = VJP.get(op.name)
            if rule is None:
                raise AutodiffError(E.UNKNOWN_OP, f"@{self.src.name}: op {op.name} has no VJP rule")
            view = Op(op.name, tuple(self.snapshot.get(m[v], m[v]) for v in op.operands), op.attrs,
                      tuple(m[r] for r in op.results), attrs_key=op.attrs_key)
            gs = rule(b, view, cts)
            if len(gs) != len(op.operands):
                raise AutodiffError(E.OPERAND_COUNT, f"VJP rule of {op.name} returned {len(gs)} cotangents "
                                    f"for {len(op.operands)} operands")
            for v, g in zip(op.operands, gs):
                if g is None or v not in self.varied:
                    continue
                if g.type != v.type:
                    raise AutodiffError(E.RESULT_TYPE_MISMATCH, f"VJP rule of {op.name} returned a cotangent "
                                        f"of type {g.type} for an operand of type {v.type}")
                accumulate(v, g)
        out = []
        for p in wrt:
            g = ct.get(p)
            if g is None:
                t = m[p].type
                if t.dtype.is_quant:
                    raise AutodiffError(E.QUANTIZED_MISUSE, f"@{self.src.name}: no gradient of quantized "
                                        f"parameter %{p.name} ({t})")
                g = zeros(b, t)
            out.append(g)
        return out


def _dce(f: Func, start: int) -> None:
    """Drop the ops from `start` on whose results nothing uses (effects always stay)."""
    live = set(f.returns)
    keep = []
    for op in reversed(f.ops[start:]):
        if REGISTRY[op.name].effect or any(r in live for r in op.results):
            keep.append(op)
            live.update(op.operands)
    f.ops[start:] = keep[::-1]


def _name_values(f: Func, start: int, grads: Sequence[Value], params: Sequence[Value]) -> None:
    """Name the values the backward pass made: each gradient d_<param>, the others g0, g1,
    .. (names that the copied forward code does not use)."""
    made = [r for op in f.ops[start:] for r in op.results]
    used = {v.name for v in f.params} | {r.name for op in f.ops[:start] for r in op.results}
    named: set[Value] = set()
    made_set = set(made)
    for g, p in zip(grads, params):
        if g in made_set and g not in named and p.name and f"d_{p.name}" not in used:
            g.name = f"d_{p.name}"
            used.add(g.name)
            named.add(g)
    k = 0
    for r in made:
        if r in named:
            continue
        while f"g{k}" in used:
            k += 1
        r.name = f"g{k}"
        used.add(r.name)


def _verify(module: Module) -> None:
    tmp = Module(module.version)
    tmp.meshes, tmp.funcs = module.meshes, module.funcs
    verify(tmp)


def grad(module: Module, func: str, wrt: Sequence[int], *, out_index: int = 0,
         new_name: str | None = None, seed: str = "ones") -> str:
    """Add to `module` a function computing `func`'s outputs and the gradient of output
    `out_index` with respect to the parameters `wrt` (indices); return its name.

    The new function (`new_name`, default f"{func}_grad") takes `func`'s parameters, plus,
    when seed == "param", a last parameter: the cotangent of output `out_index` (its type).
    With seed == "ones" the cotangent is all ones (the gradient of a scalar loss). It
    returns `func`'s outputs, then one gradient per entry of `wrt`, in order.
    """
    src = module.funcs.get(func)
    if src is None:
        raise AutodiffError(E.UNDEFINED_FUNC, f"grad: function @{func} is not defined")
    name = new_name if new_name is not None else f"{func}_grad"
    if name in module.funcs:
        raise AutodiffError(E.DUPLICATE_SYMBOL, f"grad: function @{name} already exists")
    if seed not in ("ones", "param"):
        raise AutodiffError(E.ATTRIBUTE_VALUE, f"grad: seed must be 'ones' or 'param', found {seed!r}")
    wrt = list(wrt)
    for i in wrt:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(src.params):
            raise AutodiffError(E.ATTRIBUTE_VALUE, f"grad: wrt index {i!r} is not a parameter of @{func} "
                                f"(it has {len(src.params)})")
    if not (isinstance(out_index, int) and 0 <= out_index < len(src.returns)):
        raise AutodiffError(E.ATTRIBUTE_VALUE, f"grad: out_index {out_index!r} is not an output of @{func} "
                            f"(it has {len(src.returns)})")
    out = src.returns[out_index]
    if not _is_float(out):
        raise AutodiffError(E.DTYPE_MISMATCH, f"grad: output {out_index} of @{func} is {out.type}; "
                            "only float outputs can be differentiated")
    b = FuncBuilder(module, name)
    try:
        d = _Differentiator(b, src)
        d.copy_params()
        seed_param = b.param(out.type, name=f"d_{out.name or 'out'}") if seed == "param" else None
        params = [src.params[i] for i in wrt]
        d.analyse([out], params)
        d.copy_forward()
        start = len(b.func.ops)
        seed_value = seed_param if seed_param is not None else b.full(type=out.type, value=1.0)
        grads = d.backward([(out, seed_value)], params)
        f = b.func
        f.returns = [d.map[r] for r in src.returns] + grads
        f.result_types = list(src.result_types) + [(g.type, None) for g in grads]
        _dce(f, start)
        _name_values(f, start, grads, params)
        _verify(module)
    except BaseException:
        module.funcs.pop(name, None)
        raise
    return name


def vjp_function(module: Module, callee: str) -> str:
    """The name of `@<callee>_vjp(callee's params..., cotangents of its float results...)
    -> (cotangents of its float params...)`, built and added to `module` on first use."""
    src = module.funcs[callee]
    float_results = [t for t, _ in src.result_types if t.dtype.is_float]
    want = [p.type for p in src.params] + float_results
    float_params = [p for p in src.params if _is_float(p)]
    base, n = f"{callee}_vjp", 0
    name = base
    while name in module.funcs:
        f = module.funcs[name]
        if [p.type for p in f.params] == want and [t for t, _ in f.result_types] == [p.type for p in float_params]:
            return name
        n += 1
        name = f"{base}_{n}"
    bad = [op.name for op in src.ops if REGISTRY[op.name].effect]
    if bad:
        raise AutodiffError(E.ATTRIBUTE_VALUE, f"call @{callee}: a function with effects ({bad[0]}) cannot be "
                            "differentiated through a call")
    b = FuncBuilder(module, name)
    try:
        d = _Differentiator(b, src)
        d.copy_params()
        seeds = [(v, b.param(v.type, name=f"d_{v.name or 'out'}")) for v in src.returns if _is_float(v)]
        d.analyse([v for v, _ in seeds], float_params)
        d.copy_forward()
        start = len(b.func.ops)
        grads = d.backward(seeds, float_params)
        f = b.func
        f.returns = list(grads)
        f.result_types = [(g.type, None) for g in grads]
        _name_values(f, start, grads, float_params)
        _dce(f, 0)  # an internal function: unused forward code goes too (it has no effects)
    except BaseException:
        module.funcs.pop(name, None)
        raise
    return name


def _call_rule(b: FuncBuilder, op: Op, cts: list) -> list:
    name = vjp_function(b.module, op.attrs["callee"])
    seeds = [g if g is not None else zeros(b, r.type) for r, g in zip(op.results, cts) if _is_float(r)]
    res = b.call(*op.operands, *seeds, callee=name)
    outs = iter(res if isinstance(res, tuple) else () if res is None else (res,))
    return [next(outs) if _is_float(v) else None for v in op.operands]


VJP["call"] = _call_rule
