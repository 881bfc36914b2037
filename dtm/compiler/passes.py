"""The cpu lowering as a flat, named list of passes: each takes the previous one's output.

    widen         Func -> Func          ops on f16 / bf16 computed in f32, rounded once (the spec's rule)
    decompose     Func -> Func          composites into primitives (spec 3.9)
    simplify      Func -> Func          identities, constant folding, CSE, dead code
    fuse          Func -> Schedule      which values are stored, which kernel computes each
    lower_loops   Schedule -> Program   a loop-IR kernel per group, buffers, fallback steps
    plan_memory   Program -> Program    temporaries share memory; in-place kernels
    share_kernels Program -> Program    kernels that differ only in integer literals share a body
    render_c      Program -> Program    the C source of every kernel

    program = compile_func(module, "main")       # runs them all
    DTM_DEBUG=passes python ...                  # prints each pass's name and output

A global-view function with shardings is first split into one function per rank; each
rank's function then goes through the list above (dtm.compiler.spmd):

    propagate_shardings  (Module, name) -> Func        every value gets a sharding
    partition            (Module, name, rank) -> Func  the rank's local view, collectives explicit

The IR-to-IR passes' results are verified (dtm.ir.verify) before the next pass runs.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from ..ir.module import Func, Module
from ..ir.printer import format as format_module
from ..ir.verifier import verify
from .build import prebuild_runtime
from .decompose import decompose
from .irutil import with_func
from .lower import lower_loops
from .memory import plan_memory
from .program import Program, is_move
from .render_c import render_kernel, render_unit
from .schedule import Schedule, fuse, gemm_dtype
from .share import share_kernels
from .simplify import simplify
from .widen import widen
from .spmd import partition, propagate_shardings  # noqa: F401 - the SPMD passes, run before PASSES


def render_c(program: Program) -> Program:
    for i, step in enumerate(program.kernels):
        step.cfunc = render_kernel(step.kernel, f"dtm_k{i}")
        step.source = render_unit([step.cfunc])
    return program


PASSES: list[tuple[str, Callable[[Any], Any]]] = [
    ("widen", widen),
    ("decompose", decompose),
    ("simplify", simplify),
    ("fuse", fuse),
    ("lower_loops", lower_loops),
    ("plan_memory", plan_memory),
    ("share_kernels", share_kernels),
    ("render_c", render_c),
]


def dump(x: Any, module: Module | None = None) -> str:
    """A pass's output as text: IR for functions, a readable listing otherwise."""
    if isinstance(x, Func):
        return format_module(with_func(module, x) if module is not None else _alone(x))
    if isinstance(x, Program):
        parts = [str(x)]
        for step in x.kernels:
            parts.append(str(step.kernel) if not step.source else f"// {step.name}\n{step.source}")
        return "\n\n".join(parts)
    if isinstance(x, Schedule):
        return str(x)
    return str(x)


def _alone(f: Func) -> Module:
    m = Module()
    m.funcs[f.name] = f
    return m


def debug_flags() -> set[str]:
    return {s.strip() for s in os.environ.get("DTM_DEBUG", "").split(",") if s.strip()}


def compile_func(module: Module, func: str, upto: str | None = None, out=None) -> Any:
    """Run the passes on function `func` of `module` (through pass `upto`, default all)."""
    x: Any = module.funcs[func]
    if upto is None:  # the runtime libraries it calls compile on another core while the passes run
        prebuild_runtime({op.results[0].type.dtype.name for op in x.ops if op.name == "matmul" and gemm_dtype(op)}
                         | ({"move"} if any(is_move(op) for op in x.ops) else set()))
    show = "passes" in debug_flags()
    out = out or sys.stderr
    for name, fn in PASSES:
        x = fn(x)
        if isinstance(x, Func):
            verify(with_func(module, x))
        if show:
            print(f"=== pass {name} ===\n{dump(x, module)}", file=out)
        if name == upto:
            break
    return x
