"""Looking inside the compiler.

    dtm.debug.count_kernels(fn, x, w)     # kernels the cpu backend runs for fn(x, w)
    dtm.debug.kernels(fn, x, w)           # their names, in order
    print(dtm.debug.explain(fn, x, w))    # every pass's output, as DTM_DEBUG=passes prints it

Environment:
    DTM_DEBUG=1        print each kernel and its time as it runs (cpu backend)
    DTM_DEBUG=2        also print each kernel's loop IR and C source when it is compiled
    DTM_DEBUG=passes   print every compiler pass's output (IR text or a readable dump)
    DTM_DEBUG=verify   verify every IR-to-IR pass's output, not only the program a compile
                       starts from (the test suite sets it)
Flags combine: DTM_DEBUG=passes,1.
"""

from __future__ import annotations

import io
from typing import Any, Callable

from .backends.cpu.passes import PASSES, compile_func
from .compiler.passes import dump
from .ir.module import Module
from .runtime.backend import get_backend
from .tensor import jit


def _module(fn: Callable | Module, args: tuple) -> Module:
    if isinstance(fn, Module):
        return fn
    return (fn if isinstance(fn, jit) else jit(fn)).ir(*args)


def plan(fn: Callable | Module, *args: Any, func: str = "main"):
    """The cpu backend's compiled plan for fn traced on args (or for a module's function)."""
    return get_backend("cpu").plan(_module(fn, args), func)


def count_kernels(fn: Callable | Module, *args: Any, func: str = "main") -> int:
    """How many kernels (compiled and fallback) the cpu backend runs for fn(*args)."""
    return plan(fn, *args, func=func).kernel_count


def kernels(fn: Callable | Module, *args: Any, func: str = "main") -> list[str]:
    """The names of those kernels, in the order they run."""
    return [s.name for s in plan(fn, *args, func=func).program.steps]


def explain(fn: Callable | Module, *args: Any, func: str = "main") -> str:
    """Every pass's output for fn traced on args, as text."""
    module = _module(fn, args)
    out = io.StringIO()
    x: Any = module.funcs[func]
    for name, p in PASSES:
        x = p(x)
        out.write(f"=== pass {name} ===\n{dump(x, module)}\n")
    return out.getvalue()


__all__ = ["count_kernels", "kernels", "explain", "plan", "compile_func"]
