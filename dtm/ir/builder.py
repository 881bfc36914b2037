"""Build modules from Python without writing text.

    b = Builder()
    b.mesh("m", dp=2, tp=2)
    f = b.func("mlp")
    x = f.param("f32[B, 784]", name="x", sharding="@m[shard(0), replicate]")
    w = f.param("f32[784, 256]", name="w")
    h = f.matmul(x, w)                      # result type inferred by the op's type rule
    f.ret(f.all_reduce(h, mesh="m", axes=["tp"]))
    module = b.build()                      # verified

Every registry op is a method of `FuncBuilder` (`f.add`, `f.reduce_sum(x, axes=[1])`);
ops whose result type cannot be inferred (constant, full, iota, random, recv, store_get)
take `type=`. Types and shardings may be given as text or as objects.
"""

from __future__ import annotations

from typing import Any

from ..errors import ErrorCode as E
from .attrs import normalize_attrs
from .diagnostics import IRError
from .module import Func, Module, Op, Task, Value
from .parser import _Tokens
from .registry import REGISTRY, TASK_ATTRS
from .typerules import TypeRuleError
from .types import Mesh, Sharding, TensorType
from .verifier import verify


def tensor_type(spec: str | TensorType) -> TensorType:
    """`"f32[B, 128]"` (or a TensorType) as a TensorType."""
    if isinstance(spec, TensorType):
        return spec
    toks = _Tokens(spec, 1)
    t = toks.tensor_type()
    toks.expect_end()
    return t


def sharding(spec: str | Sharding | None) -> Sharding | None:
    """`"@m[shard(0), replicate]"` (or a Sharding, or None) as a Sharding."""
    if spec is None or isinstance(spec, Sharding):
        return spec
    toks = _Tokens(spec, 1)
    sh = toks.sharding()
    toks.expect_end()
    return sh


class FuncBuilder:
    """Builds one function of a Builder's module: `param` adds a parameter; every registry
    op is a method (`f.matmul(x, w)`, or `f.op("matmul", x, w)`) that appends the op and
    returns its result, typed by the op's type rule unless `type=` is given; `ret` sets
    what it returns. Unnamed values are named v0, v1, ...."""

    def __init__(self, module: Module, name: str):
        self.func = Func(name, [], [])
        self.module = module
        module.funcs[name] = self.func
        self._count = 0

    def _name(self, name: str | None) -> str:
        if name is not None:
            return name
        self._count += 1
        return f"v{self._count - 1}"

    def param(self, type: str | TensorType, name: str | None = None, sharding: str | Sharding | None = None) -> Value:
        v = Value(tensor_type(type), self._name(name), globals()["sharding"](sharding))
        self.func.params.append(v)
        return v

    def op(self, opname: str, *operands: Value, type: str | TensorType | list | None = None,
           name: str | None = None, sharding: str | Sharding | None = None, **attrs: Any) -> Value | tuple[Value, ...] | None:
        """Append op `opname`; returns its result (a tuple for several, None for none)."""
        opdef = REGISTRY.get(opname)
        if opdef is None:
            raise IRError(E.UNKNOWN_OP, f"unknown op {opname!r}")
        for i, v in enumerate(operands):
            if not isinstance(v, Value):
                raise IRError(E.OPERAND_COUNT, f"{opname}: operand {i} is {v.__class__.__name__} {v!r}; operands are "
                              "Values (make a constant with f.full(type=..., value=...) first)")
        lo, hi = opdef.arity
        if len(operands) < lo or (hi is not None and len(operands) > hi):
            raise IRError(E.OPERAND_COUNT, f"{opname} takes {lo if lo == hi else f'{lo} or more'} operand(s) "
                          f"({', '.join(opdef.operands)}), found {len(operands)}")
        declared = () if type is None else tuple(tensor_type(t) for t in (type if isinstance(type, list) else [type]))
        in_types = tuple(v.type for v in operands)
        try:
            norm = normalize_attrs(opname, opdef.attr_index, attrs, declared[0].dtype if declared else None)
            if not declared:
                # SCALAR attributes take the result dtype; infer once to learn it, then renormalise.
                declared = tuple(opdef.rule(opname, in_types, norm, (), self.module))
                norm = normalize_attrs(opname, opdef.attr_index, attrs, declared[0].dtype if declared else None)
        except TypeRuleError as e:
            raise IRError(e.code, e.message) from None
        sh = globals()["sharding"](sharding)
        results = tuple(Value(t, self._name(name if len(declared) == 1 else None), sh) for t in declared)
        self.func.ops.append(Op(opname, tuple(operands), norm, results))
        return results[0] if len(results) == 1 else (results or None)

    def ret(self, *values: Value) -> None:
        """Return `values`; the signature's result types are theirs."""
        self.func.returns = list(values)
        self.func.result_types = [(v.type, v.sharding) for v in values]

    def __getattr__(self, opname: str):
        if opname in REGISTRY:
            return lambda *operands, **kw: self.op(opname, *operands, **kw)
        raise AttributeError(opname)


class Builder:
    """Builds a Module in code (see the module doc): `mesh` declares a mesh, `func` starts a
    FuncBuilder, `task` declares a task, and `build` returns the module, verified."""

    def __init__(self, version: tuple[int, int] | None = None):
        self.module = Module(version)

    def mesh(self, name: str, **axes: int) -> Mesh:
        mesh = Mesh(name, tuple(axes.items()))
        self.module.meshes[name] = mesh
        return mesh

    def func(self, name: str) -> FuncBuilder:
        return FuncBuilder(self.module, name)

    def task(self, name: str, func: str, inputs, outputs, after=()) -> Task:
        try:
            a = normalize_attrs(f"task @{name}", TASK_ATTRS, {"inputs": inputs, "outputs": outputs, "after": after}, None)
        except TypeRuleError as e:
            raise IRError(e.code, e.message) from None
        t = Task(name, func.lstrip("@"), a["inputs"], a["outputs"], a["after"])
        self.module.tasks[name] = t
        return t

    def build(self) -> Module:
        """The module, verified."""
        return verify(self.module)
