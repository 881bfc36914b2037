"""Functions named for other processes: `module:qualname`, imported there, never pickled.
Task graphs' worker processes and Ray workers (dtm.tasks) and ingest workers (dtm.data)
find their functions so; each caller says which error a name that does not work is."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from ..errors import DTMError

Fail = Callable[[str], DTMError]  # the caller's error for a function that cannot be named


def name_of(fn: Callable[..., Any], fail: Fail) -> str:
    """"module:qualname" that `resolve` turns back into `fn`; `fail(why)` when there is none
    (a lambda, a nested function, a callable object, a plain script's function, a name that
    imports as another object)."""
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qual:
        raise fail(f"{fn!r} has no module and qualified name; pass a module-level function")
    if "<lambda>" in qual or "<locals>" in qual:
        raise fail(f"{module}.{qual} is a lambda or a function defined inside another, which another process "
                   "cannot import by name (nothing is pickled): define it at module level")
    if module == "__main__":
        # A script run with `python -m pkg.mod` has a real name; a plain script has none.
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is None or not spec.name:
            raise fail(f"{qual} is defined in the script __main__, which another process cannot import: move it "
                       "into a module")
        module = spec.name
    name = f"{module}:{qual}"
    if resolve(name, fail) is not fn:
        raise fail(f"{name} does not name {fn!r} when imported")
    return name


def resolve(name: str, fail: Fail) -> Callable[..., Any]:
    """The callable `name` ("module:qualname") names; `fail(why)` when it does not import."""
    module, sep, qual = name.partition(":")
    try:
        if not sep or not module or not qual:
            raise ValueError("expected MODULE:QUALNAME")
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except Exception as e:  # noqa: BLE001 - any import-time failure of user code is this one fault
        raise fail(f"cannot import {name!r}: {type(e).__name__}: {e}") from None
    if not callable(obj):
        raise fail(f"{name!r} names a {type(obj).__name__}, not a function")
    return obj
