"""What a task runs, and how one task runs in whichever process holds it: read its inputs
from the store, call its function, write its outputs. The local scheduler's threads, its
worker processes and Ray's workers all call `run_task`, so a task means the same everywhere.

Two kinds of function:
* `PyFunction`: a Python function on dtm Tensors (jitted once per input signature unless
  `jit=False`). A worker process finds it by its qualified name (`module:qualname`), so
  nothing is pickled: only that name and store keys cross between processes.
* `IRFunction`: a `func` of an IR module, run on the runtime's backend with the inputs read
  as by `store_get` with the parameter types (spec 9.3).

Layer 8 may not import the user-facing Tensor (docs/architecture.md); `dtm/__init__.py` installs
`dtm.jit` and `Tensor.from_numpy` here with `install`.
"""

from __future__ import annotations

import inspect
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import ErrorCode
from ..ir.module import Module
from ..ir.types import TensorType
from ..runtime import execute
from ..store import scoped
from . import names
from .errors import GraphError

_jit: Callable[[Callable], Callable] = lambda fn: fn
_tensor: Callable[[np.ndarray], Any] = lambda a: a


def install(jit: Callable[[Callable], Callable], tensor: Callable[[np.ndarray], Any]) -> None:
    """Called by `dtm/__init__.py`: how to jit a function and wrap an array as a Tensor."""
    global _jit, _tensor
    _jit, _tensor = jit, tensor


class Interrupted(Exception):
    """Raised inside a task at a boundary once its run is stopping (cancel, failure)."""


@dataclass
class Outcome:
    """What one run of one task moved, and how long it took."""

    read: int = 0
    written: int = 0
    seconds: float = 0.0


def _not_importable(why: str) -> GraphError:
    return GraphError(ErrorCode.TASK_NOT_IMPORTABLE, f"a task that runs in another process imports its function by "
                      f"name: {why}")


def reference(fn: Callable) -> str:
    """`module:qualname` of a function a worker process can import, else E1204: lambdas,
    closures and functions of a plain script run only on threads."""
    return names.name_of(fn, _not_importable)


def resolve(ref: str) -> Callable:
    """The function named `module:qualname` (E1204 when it does not import)."""
    return names.resolve(ref, _not_importable)


@dataclass(eq=False)
class PyFunction:
    """A Python task function; `ref` is its importable name, for worker processes."""

    fn: Callable
    jit: bool
    ref: str | None = None
    _jitted: Callable | None = field(default=None, repr=False)
    _seen: set = field(default_factory=set, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))

    def arity(self) -> tuple[int, int | None]:
        """The fewest and most positional arguments it takes (None: any number)."""
        try:
            params = inspect.signature(self.fn).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature: trust the keys
            return 0, None
        kinds = [p.kind for p in params]
        if inspect.Parameter.VAR_POSITIONAL in kinds:
            most = None
        else:
            most = sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in kinds)
        least = sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
        return least, most

    def __call__(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        args = [_tensor(a) for a in arrays]
        if not self.jit or not arrays:  # nothing to trace on: a source or a side effect
            return _as_list(self.fn(*args))
        signature = tuple((a.dtype.str, a.shape) for a in arrays)
        if signature in self._seen:
            return _as_list(self._jitted(*args))
        with self._lock:  # the first call of a signature traces and builds: once, not per thread
            if self._jitted is None:
                self._jitted = _jit(self.fn)
            out = _as_list(self._jitted(*args))
            self._seen.add(signature)
            return out


@dataclass(eq=False)
class IRFunction:
    """`func` of an IR module, run on `backend` (None: DTM_BACKEND, else `cpu`)."""

    module: Module
    func: str
    backend: str | None = None

    @property
    def name(self) -> str:
        return f"@{self.func}"

    def param_types(self) -> list[TensorType]:
        return [p.type for p in self.module.funcs[self.func].params]

    def __call__(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(r) for r in execute.run(self.module, self.func, arrays, self.backend)]


def _as_list(out: Any) -> list[np.ndarray]:
    """A function's results as arrays: a tuple or list of them, one, or None for none."""
    outs = [] if out is None else list(out) if isinstance(out, (tuple, list)) else [out]
    return [np.asarray(o) for o in outs]  # a lazy Tensor computes here: a kernel boundary


def static_shape(t: TensorType) -> tuple[int, ...] | None:
    """A parameter type's shape when every dim is a number (else the store's shape is taken)."""
    return tuple(t.shape) if all(isinstance(d, int) for d in t.shape) else None


def run_task(store: Any, fn: PyFunction | IRFunction, inputs: tuple[str, ...], outputs: tuple[str, ...],
             stopping: Callable[[], bool]) -> Outcome:
    """Run one task against `store`: its reads and writes, and its function's own
    `store_get` / `store_put` (and `dtm.store.current()`) while it runs. `stopping()` is
    asked at every boundary (before the reads, before the call, before the writes): once
    true the task raises `Interrupted`.
    The outputs are written only after the function returned every one of them, so a task
    that fails or is interrupted leaves none (each put is atomic per key, spec 9.2.2)."""
    start, outcome = time.perf_counter(), Outcome()
    if stopping():
        raise Interrupted
    if isinstance(fn, IRFunction):
        arrays = [store.get_array(k, t.dtype, static_shape(t)) for k, t in zip(inputs, fn.param_types())]
    else:
        arrays = [store.get_array(k) for k in inputs]
    outcome.read = sum(a.nbytes for a in arrays)
    if stopping():
        raise Interrupted
    with scoped(store):  # the function's own store_get / store_put: this graph's store, not the process's
        results = fn(arrays)
    if len(results) != len(outputs):
        raise GraphError(ErrorCode.RESULT_COUNT, f"{fn.name} returned {len(results)} value(s) for "
                         f"{len(outputs)} output key(s) {list(outputs)}")
    if stopping():
        raise Interrupted
    for k, r in zip(outputs, results):
        outcome.written += store.put_array(k, r).nbytes
    outcome.seconds = time.perf_counter() - start
    return outcome
