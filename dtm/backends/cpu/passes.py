"""The cpu backend's lowering: the shared passes (dtm/compiler/passes.py), then its own.

    widen .. lower_loops                     the passes every backend shares
    plan_memory   Program -> Program        temporaries share memory; in-place kernels
    share_kernels Program -> Program        kernels that differ only in integer literals share a body
    render_c      Program -> Program        the C source of every kernel

    program = compile_func(module, "main")   # runs them all; dtm/runtime/cpu.py runs the program
"""

from __future__ import annotations

from typing import Any, Callable

from ...compiler.passes import PASSES as SHARED, run_passes
from ...compiler.program import Program, is_move
from ...compiler.schedule import gemm_dtype
from ...compiler.share import share_kernels
from ...ir.module import Module
from .build import prebuild_runtime
from .memory import plan_memory
from .render_c import render_kernel, render_unit


def render_c(program: Program) -> Program:
    """Each kernel's C function and its translation unit."""
    for i, step in enumerate(program.kernels):
        step.cfunc = render_kernel(step.kernel, f"dtm_k{i}")
        step.source = render_unit([step.cfunc])
    return program


PASSES: list[tuple[str, Callable[[Any], Any]]] = SHARED + [
    ("plan_memory", plan_memory),
    ("share_kernels", share_kernels),
    ("render_c", render_c),
]


def compile_func(module: Module, func: str, upto: str | None = None, out=None) -> Any:
    """Run the passes on function `func` of `module` (through pass `upto`, default all)."""
    if upto is None:  # the runtime libraries it calls compile on another core while the passes run
        ops = module.funcs[func].ops
        prebuild_runtime({op.results[0].type.dtype.name for op in ops if op.name == "matmul" and gemm_dtype(op)}
                         | ({"move"} if any(is_move(op) for op in ops) else set()))
    return run_passes(module, func, PASSES, upto, out)


__all__ = ["PASSES", "compile_func", "render_c"]
