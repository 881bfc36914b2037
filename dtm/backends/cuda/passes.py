"""The cuda backend's lowering: the shared passes (dtm/compiler/passes.py), then its own.

    widen .. lower_loops                     the passes every backend shares
    plan_memory   Program -> Program        temporaries share memory (the cpu backend's plan:
                                            device memory is planned the same way)
    render_cuda   Program -> Program        the CUDA C of every kernel, in one unit

    program = compile_func(module, "main")  # runs them all
    ptx = build(program)                    # NVRTC: the unit's PTX (dtm/toolchain/nvrtc.py)
"""

from __future__ import annotations

from typing import Any, Callable

from ...compiler.passes import PASSES as SHARED, run_passes
from ...compiler.program import Program
from ...ir.module import Module
from ...toolchain import nvrtc
from ..cpu.memory import plan_memory
from .render_cuda import render_program


def render_cuda(program: Program) -> Program:
    """The program's CUDA C (`program.unit`) and each kernel's launches (`program.launches`)."""
    program.unit, program.launches = render_program(program)
    return program


PASSES: list[tuple[str, Callable[[Any], Any]]] = SHARED + [
    ("plan_memory", plan_memory),
    ("render_cuda", render_cuda),
]


def compile_func(module: Module, func: str, upto: str | None = None, out=None) -> Any:
    """Run the passes on function `func` of `module` (through pass `upto`, default all)."""
    return run_passes(module, func, PASSES, upto, out)


def build(program: Program, arch: str = nvrtc.DEFAULT_ARCH) -> nvrtc.Ptx:
    """The PTX of a compiled program's unit for GPU architecture `arch`, with NVRTC's log."""
    names = [launch.symbol for ck in program.launches for launch in ck.launches if launch.symbol]
    what = f"{names[0]} .. {names[-1]}" if names else "(none)"
    return nvrtc.compile_ptx(program.unit, what, arch)


__all__ = ["PASSES", "build", "compile_func", "render_cuda"]
