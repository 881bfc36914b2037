"""Small helpers the IR-to-IR passes share: build ops with inferred types, copy a function,
wrap a function in a module so the verifier can check it, and check a pass's output where
DTM_DEBUG asks for it."""

from __future__ import annotations

import os
from typing import Any

from ..ir.attrs import normalize_attrs
from ..ir.module import Func, Module, Op, Value
from ..ir.registry import REGISTRY
from ..ir.types import TensorType
from ..ir.verifier import verify


class _Ctx:
    """What type rules see: the module's meshes and functions (composites need neither)."""

    def __init__(self, module: Module | None):
        self.meshes = module.meshes if module is not None else {}
        self.funcs = module.funcs if module is not None else {}


class Emitter:
    """Appends ops to `ops`, inferring result types with the registry's type rules.

        e = Emitter(ops)
        m = e("reduce_max", x, axes=[1], keepdims=True)
        y = e("div", a, b, result=old_value)     # reuse an existing Value as the result
    """

    def __init__(self, ops: list[Op], module: Module | None = None, prefix: str = "c"):
        self.ops = ops
        self.ctx = _Ctx(module)
        self.prefix = prefix
        self.count = 0

    def __call__(self, opname: str, *operands: Value, type: TensorType | None = None,
                 result: Value | None = None, **attrs: Any) -> Value:
        opdef = REGISTRY[opname]
        declared = (type,) if type is not None else ()
        dtype = type.dtype if type is not None else None
        norm = normalize_attrs(opname, opdef.attr_index, attrs, dtype)
        out = opdef.rule(opname, tuple(v.type for v in operands), norm, declared, self.ctx)
        if type is None and any(a.kind.value == "scalar" for a in opdef.attrs):
            norm = normalize_attrs(opname, opdef.attr_index, attrs, out[0].dtype)
        if result is not None:
            assert result.type == out[0], (opname, result.type, out[0])
            v = result
        else:
            self.count += 1
            v = Value(out[0], f"{self.prefix}{self.count}")
        self.ops.append(Op(opname, tuple(operands), norm, (v,)))
        return v

    def full(self, value: Any, t: TensorType) -> Value:
        return self("full", type=t, value=value)


def with_func(module: Module, func: Func) -> Module:
    """A module like `module` whose function `func.name` is `func` (for verify and print)."""
    m = Module(module.version)
    m.meshes = dict(module.meshes)
    m.funcs = dict(module.funcs)
    m.funcs[func.name] = func
    m.tasks = dict(module.tasks)
    return m


def new_func(src: Func, ops: list[Op], returns: list[Value]) -> Func:
    """A copy of `src` with new ops and returns (the same parameters and signature)."""
    return Func(src.name, list(src.params), list(src.result_types), ops, returns)


def debug_flags() -> set[str]:
    """The flags of DTM_DEBUG (dtm/debug.py lists them)."""
    return {s.strip() for s in os.environ.get("DTM_DEBUG", "").split(",") if s.strip()}


def verify_pass(module: Module) -> None:
    """Verify what a pass made, where DTM_DEBUG=verify asks for every pass's output to be
    (the test suite sets it). Otherwise a compile verifies only the program it starts from
    (run_passes): the passes' outputs are the compiler's own, and verifying each of them was
    a fifth of recompiling a training step after a resize (profiled: 6 verifications, 0.32 s
    of 1.59)."""
    if "verify" in debug_flags():
        verify(module)
