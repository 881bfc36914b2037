"""The lowering every backend shares, as a flat, named list of passes: each takes the
previous one's output. A backend's own list continues it (dtm/backends/cpu/passes.py:
plan_memory, share_kernels, render_c) and runs the whole with `run_passes`.

    widen         Func -> Func          ops on f16 / bf16 computed in f32, rounded once (the spec's rule)
    decompose     Func -> Func          composites into primitives (spec 3.9)
    simplify      Func -> Func          identities, constant folding, CSE, dead code
    fuse          Func -> Schedule      which values are stored, which kernel computes each
    lower_loops   Schedule -> Program   a loop-IR kernel per group, buffers, fallback steps

    DTM_DEBUG=passes python ...                  # prints each pass's name and output

A global-view function with shardings is first split into one function per rank; each
rank's function then goes through the list above (dtm.compiler.spmd):

    propagate_shardings  (Module, name) -> Func        every value gets a sharding
    partition            (Module, name, rank) -> Func  the rank's local view, collectives explicit

`run_passes` verifies (dtm.ir.verify) the function it starts from; with DTM_DEBUG=verify (the
test suite sets it) each IR-to-IR pass's result too, before the next pass runs.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from ..ir.module import Func, Module
from ..ir.printer import format as format_module
from ..ir.verifier import verify
from .decompose import decompose
from .irutil import debug_flags, with_func
from .lower import lower_loops
from .program import Program
from .schedule import Schedule, fuse
from .simplify import simplify
from .widen import widen
from .spmd import partition, propagate_shardings  # noqa: F401 - the SPMD passes, run before PASSES


PASSES: list[tuple[str, Callable[[Any], Any]]] = [
    ("widen", widen),
    ("decompose", decompose),
    ("simplify", simplify),
    ("fuse", fuse),
    ("lower_loops", lower_loops),
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


def run_passes(module: Module, func: str, passes: list[tuple[str, Callable[[Any], Any]]], upto: str | None = None,
               out=None) -> Any:
    """Run `passes` on function `func` of `module`, through pass `upto` (default: all)."""
    x: Any = module.funcs[func]
    flags = debug_flags()
    show = "passes" in flags
    out = out or sys.stderr
    verify(with_func(module, x))  # the program as given; each pass's output too with DTM_DEBUG=verify
    for name, fn in passes:
        x = fn(x)
        if isinstance(x, Func) and "verify" in flags:
            verify(with_func(module, x))
        if show:
            print(f"=== pass {name} ===\n{dump(x, module)}", file=out)
        if name == upto:
            break
    return x
