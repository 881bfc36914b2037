"""A compiled function, before it is built: buffers and the steps that fill them.

`lower_loops` makes it from a Schedule, `plan_memory` assigns the temporary buffers to
memory slots, `render_c` gives every kernel its C source. The executor (dtm/runtime/cpu.py)
runs the steps in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..ir.module import Func, Op, Value
from ..ir.symbolic import format_dim
from ..ir.types import TensorType
from . import loopir


@dataclass(eq=False)
class Buffer:
    """One array. kind: param (the caller's input `index`), const (a literal, `data`),
    temp (an intermediate), output (returned), fallback (made by a fallback step)."""

    name: str
    type: TensorType
    kind: str
    value: Value | None = None
    index: int | None = None
    data: Any = None
    slot: int | None = None         # memory slot (temps), from plan_memory
    alias: "Buffer | None" = None   # in place: shares the memory of this (dead) input, or of the
                                    # parameter an assign gives this value (plan_memory)

    def __str__(self) -> str:
        return f"{self.name}: {self.type} ({self.kind})"


@dataclass(eq=False)
class KernelStep:
    """A compiled kernel; `args` are its buffers in the order of `kernel.params`."""

    name: str
    kernel: loopir.Kernel
    args: list
    group: Any = None
    ops: list = field(default_factory=list)
    source: str = ""                # its C source, alone in a unit (render_c)
    cfunc: Any = None               # render_c.CFunction, what the build compiles

    @property
    def inputs(self) -> list:
        return [b for p, b in zip(self.kernel.params, self.args) if not p.output]

    @property
    def outputs(self) -> list:
        return [b for p, b in zip(self.kernel.params, self.args) if p.output]


@dataclass(eq=False)
class FallbackStep:
    name: str
    op: Op
    inputs: list
    outputs: list


@dataclass(eq=False)
class MoveStep:
    """A movement op whose index is data (`MOVE_OPS`), run by the runtime's C (c_move.py):
    copies of whole rows of bytes. Its result is planned memory like a kernel's; a
    dynamic_update_slice's is its operand's own when this is the operand's last use (the
    window alone is written)."""

    name: str
    op: Op
    inputs: list
    outputs: list


MOVE_OPS = ("gather", "dynamic_slice", "dynamic_update_slice")


def is_move(op: Op) -> bool:
    return op.name in MOVE_OPS


# Fallback ops whose reference has an in-place form (`ref.ops.scatter_add_into`): their
# result is planned memory like a kernel's (a slot, or a dead operand's slot), not a fresh
# array per call, whose pages the OS faults in and zeroes every step (an embedding
# gradient: 154 MB for GPT-2).
INTO_FALLBACKS = ("scatter_add",)
_WIDE_ENOUGH = ("f32", "f64")  # narrow floats accumulate in f32 and round once: a fresh array


def writes_into(op: Op) -> bool:
    t = op.results[0].type.dtype if op.results else None
    return op.name in INTO_FALLBACKS and t is not None and (t.is_int or t.name in _WIDE_ENOUGH)


@dataclass(eq=False)
class Program:
    func: Func
    buffers: list
    steps: list
    returns: list
    symbols: list                      # every symbol of the function, sorted
    slots: list = field(default_factory=list)   # per slot: its size in bytes, a dim
    frees: list = field(default_factory=list)   # per step: the buffers whose last use it is
    done_in_place: set = field(default_factory=set)  # ids of assign steps whose kernel wrote the target
    unit: str = ""                     # the whole program's source, where a backend builds one (cuda)
    launches: list = field(default_factory=list)  # per kernel, what a backend launches for it (cuda)

    @property
    def kernels(self) -> list:
        return [s for s in self.steps if isinstance(s, KernelStep)]

    @property
    def fallbacks(self) -> list:
        return [s for s in self.steps if isinstance(s, FallbackStep)]

    @property
    def moves(self) -> list:
        return [s for s in self.steps if isinstance(s, MoveStep)]

    def __str__(self) -> str:
        lines = [f"program @{self.func.name}: {len(self.kernels)} kernel(s), {len(self.moves)} move(s), "
                 f"{len(self.fallbacks)} fallback(s)"]
        for b in self.buffers:
            extra = ""
            if b.slot is not None:
                extra += f" slot {b.slot}"
            if b.alias is not None:
                extra += f" in place of {b.alias.name}"
            lines.append(f"  {b}{extra}")
        for i, s in enumerate(self.steps):
            ins = ", ".join(b.name for b in s.inputs)
            outs = ", ".join(b.name for b in s.outputs)
            kind = "kernel" if isinstance(s, KernelStep) else "move" if isinstance(s, MoveStep) else "fallback"
            lines.append(f"  step {i} {kind} {s.name}: ({ins}) -> ({outs})")
            if self.frees and self.frees[i]:
                lines.append(f"    frees {', '.join(b.name for b in self.frees[i])}")
        if self.slots:
            lines.append("  slots: " + ", ".join(f"{i}: {format_dim(n)} bytes" for i, n in enumerate(self.slots)))
        lines.append("  returns " + ", ".join(b.name for b in self.returns))
        return "\n".join(lines)
