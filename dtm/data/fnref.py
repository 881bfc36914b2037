"""Functions named for worker processes: `module:qualname`, imported there, never pickled."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from ..errors import ErrorCode as E
from .errors import DataError


def name_of(fn: Callable[..., Any]) -> str:
    """"module:qualname" that `resolve` turns back into `fn`; E1304 when there is none (a
    lambda, a nested function, a callable object, a module that cannot be imported)."""
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qual:
        raise DataError(E.INGEST_FN_NOT_IMPORTABLE, f"{fn!r} has no module and qualified name: ingest workers import "
                                                    "the function by name; pass a module-level function")
    if "<lambda>" in qual or "<locals>" in qual:
        raise DataError(E.INGEST_FN_NOT_IMPORTABLE, f"{module}.{qual} is a lambda or nested function, which worker "
                                                    "processes cannot import by name (nothing is pickled): define it "
                                                    "at module level")
    if module == "__main__":
        # A script run with `python -m pkg.mod` has a real name; a plain script has none.
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is None or not spec.name:
            raise DataError(E.INGEST_FN_NOT_IMPORTABLE, f"{qual} is defined in the script __main__, which worker "
                                                        "processes cannot import: move it into a module")
        module = spec.name
    name = f"{module}:{qual}"
    if resolve(name) is not fn:
        raise DataError(E.INGEST_FN_NOT_IMPORTABLE, f"{name} does not name {fn!r} when imported")
    return name


def resolve(name: str) -> Callable[..., Any]:
    """The callable `name` ("module:qualname") names; E1304 when it does not import."""
    module, sep, qual = name.partition(":")
    try:
        if not sep or not module or not qual:
            raise ValueError("expected MODULE:QUALNAME")
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except Exception as e:  # noqa: BLE001 - any import-time failure of user code is this one fault
        raise DataError(E.INGEST_FN_NOT_IMPORTABLE, f"cannot import the ingest function {name!r}: "
                                                    f"{type(e).__name__}: {e}") from None
    if not callable(obj):
        raise DataError(E.INGEST_FN_NOT_IMPORTABLE, f"{name!r} names a {type(obj).__name__}, not a function")
    return obj
