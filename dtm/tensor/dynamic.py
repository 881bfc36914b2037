"""Sizes that change without recompiling: which program runs for a concrete one.

Programs the front end records (a realize, a backward, a dtm.jit trace) are compiled by
their structure and sizes. The first of a family (functions equal but for sizes,
dtm.compiler.generalize) runs as it is; at the second distinct size the family's symbolic
function is made and compiled, and every later size it is exactly an instance of runs
through that one plan (torch.compile's automatic dynamic). A size it does not fit (a guess
two samples could not tell apart) runs its own concrete program, and the family is
generalized again from the last two, a few times at most.

DTM_DYNAMIC=0 turns this off (every size compiles its own program); `dtm.jit(fn,
dynamic=False)` for one function.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import OrderedDict

from ..compiler.generalize import generalize, instance, skeleton
from ..ir.module import Func, Module
from ..runtime import execute

_MAX_FAMILIES = 256
_MAX_TRIES = 3  # generalizations a family may try before it stays concrete


class _Family:
    __slots__ = ("last", "symbolic", "tries")

    def __init__(self, last: Func):
        self.last = last                      # the last concrete function seen
        self.symbolic: Module | None = None   # the family's symbolic function, compiled
        self.tries = 0


_FAMILIES: OrderedDict[tuple, _Family] = OrderedDict()
_LOCK = threading.Lock()


def enabled() -> bool:
    return os.environ.get("DTM_DYNAMIC", "1") != "0"


def program(module: Module, func: str, backend: str | None = None) -> tuple[Module, str]:
    """The module to run for concrete `module`'s @func: itself, or its family's symbolic one."""
    if module.meshes or not enabled():
        return module, func
    f = module.funcs[func]
    key = skeleton(f)
    if key is None:
        return module, func
    key = (func, key)
    with _LOCK:  # (a loader's thread may realize too)
        family = _FAMILIES.get(key)
        if family is None:
            _FAMILIES[key] = _Family(f)
            while len(_FAMILIES) > _MAX_FAMILIES:
                _FAMILIES.popitem(last=False)
            return module, func
        _FAMILIES.move_to_end(key)
        symbolic = family.symbolic
        if symbolic is None or instance(symbolic.funcs[func], f) is None:
            last, family.last = family.last, f
            if family.tries >= _MAX_TRIES:
                return module, func
            family.tries += 1
            symbolic = None
    if symbolic is not None:
        return symbolic, func
    s = generalize(last, f)
    if s is None:
        return module, func
    symbolic = Module()
    symbolic.funcs[func] = s
    try:
        execute.compile(symbolic, func, backend)
    except Exception as e:  # noqa: BLE001 - the concrete program is always right: run it instead
        family.tries = _MAX_TRIES
        if os.environ.get("DTM_DEBUG"):
            print(f"dtm: sizes kept static for @{func}: its symbolic form did not compile ({e})", file=sys.stderr)
        return module, func
    family.symbolic = symbolic
    return symbolic, func
