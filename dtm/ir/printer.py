"""`Module` to canonical text (spec section "Canonical text").

Canonical means: the header, then meshes, functions and tasks each sorted by name, a blank
line between declarations, two-space indentation, attributes sorted by name with defaults
left out, numbers in their shortest exact form, no comments. Value names are kept; a value
with no name (or a clashing one) gets the next free number.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .attrs import format_attrs
from .registry import REGISTRY, TASK_ATTRS
from .types import Sharding, TensorType
from .version import SPEC_VERSION
from .versioning import check_target

if TYPE_CHECKING:  # the printer only reads a module's fields; module.py imports it for str(module)
    from .module import Func, Module, Value


def _typed(t: TensorType, sh: Sharding | None) -> str:
    return f"{t} {sh}" if sh is not None else str(t)


_VALUE_NAME = re.compile(r"[A-Za-z0-9_.]+")


class _Names:
    def __init__(self):
        self.names: dict[int, str] = {}
        self.used: set[str] = set()
        self.counter = 0

    def define(self, v: Value) -> str:
        name = v.name
        if name is None or name in self.used or not _VALUE_NAME.fullmatch(name):
            while str(self.counter) in self.used:
                self.counter += 1
            name = str(self.counter)
        self.used.add(name)
        self.names[id(v)] = "%" + name
        return "%" + name

    def __getitem__(self, v: Value) -> str:
        return self.names.get(id(v)) or f"%<undefined {v.name}>"


def _func(f: Func) -> str:
    names = _Names()
    params = ", ".join(f"{names.define(p)}: {_typed(p.type, p.sharding)}" for p in f.params)
    results = ", ".join(_typed(t, sh) for t, sh in f.result_types)
    out = [f"func @{f.name}({params}) -> ({results}) {{"]
    for op in f.ops:
        opdef = REGISTRY.get(op.name)
        line = "  "
        if op.results:
            line += ", ".join(names.define(r) for r in op.results) + " = "
        line += op.name
        if op.operands:
            line += " " + ", ".join(names[v] for v in op.operands)
        dtype = op.results[0].type.dtype if op.results else None
        attrs = format_attrs(opdef.attr_index, op.attrs, dtype) if opdef else ""
        if attrs:
            line += " " + attrs
        if op.results:
            line += " : " + ", ".join(_typed(r.type, r.sharding) for r in op.results)
        out.append(line)
    out.append("  return" + (" " + ", ".join(names[v] for v in f.returns) if f.returns else ""))
    out.append("}")
    return "\n".join(out)


def format(module: Module, target: tuple[int, int] | None = None) -> str:
    """Canonical text of `module`, written for spec version `target` (default: the module's
    own version). Refuses (IRError E0602) a module that uses an op newer than `target`."""
    version = check_target(module, target)
    blocks = [f"dtm {version[0]}.{version[1]}"]
    for name in sorted(module.meshes):
        mesh = module.meshes[name]
        blocks.append(str(mesh))
    for name in sorted(module.funcs):
        blocks.append(_func(module.funcs[name]))
    for name in sorted(module.tasks):
        t = module.tasks[name]
        attrs = format_attrs(TASK_ATTRS, {"inputs": t.inputs, "outputs": t.outputs, "after": t.after})
        blocks.append(f"task @{t.name} = @{t.func} {attrs}")
    return "\n\n".join(blocks) + "\n"


__all__ = ["format", "SPEC_VERSION"]
