"""`Graph`: tasks over a tensor store, each a function whose inputs and outputs are store
keys, ordered by `after` (spec 9.3). Building checks what can be checked without running:
names, keys, the function's arity and, for process tasks, that a worker can import it.
`order()` is Kahn's algorithm, iterative, so 100,000 tasks (or a chain of them) need no
recursion and memory linear in the graph."""

from __future__ import annotations

import os
from collections import deque
from typing import Any, Callable, Iterable, Sequence

from ..errors import ErrorCode
from ..ir.module import Module
from ..ir.verifier import verify
from ..store.keys import check_key
from .errors import GraphError
from .functions import IRFunction, PyFunction, reference
from .local import LocalRun


class Task:
    """One node: `fn` on the store keys `inputs`, writing `outputs`, after the tasks in
    `after` (Task handles or names, resolved when the graph runs)."""

    __slots__ = ("index", "name", "fn", "inputs", "outputs", "after", "process", "timeout", "retries")

    def __init__(self, index: int, name: str, fn: PyFunction | IRFunction, inputs: tuple[str, ...],
                 outputs: tuple[str, ...], after: tuple["Task | str", ...], process: bool, timeout: float | None,
                 retries: int):
        self.index, self.name, self.fn = index, name, fn
        self.inputs, self.outputs, self.after = inputs, outputs, after
        self.process, self.timeout, self.retries = process, timeout, retries

    def __repr__(self) -> str:
        return f"Task({self.name!r})"


class Graph:
    """A task graph over `store` (a `dtm.store` Store). See `dtm/tasks/__init__.py`."""

    def __init__(self, store: Any):
        self.store = store
        self.tasks: list[Task] = []
        self._by_name: dict[str, Task] = {}
        self._functions: dict[tuple[int, bool, bool], PyFunction] = {}  # one per function: its jit cache

    def __len__(self) -> int:
        return len(self.tasks)

    def task(self, fn: Callable | IRFunction, inputs: Sequence[str] = (), outputs: Sequence[str] = (), *,
             after: Iterable["Task | str"] = (), name: str | None = None, process: bool = False,
             jit: bool | None = None, timeout: float | None = None, retries: int = 2) -> Task:
        """Add a task and return its handle (for other tasks' `after`).

        `process=True` runs it on a worker process (for Python-heavy functions that hold
        the GIL); it must then be importable by `module:qualname`. `jit` (default: True on
        threads, False on processes) traces it once per input signature with dtm.jit.
        `timeout` bounds one attempt in seconds; `retries` is how often a task whose worker
        process died is run again on a fresh one."""
        inputs, outputs = tuple(check_key(k) for k in inputs), tuple(check_key(k) for k in outputs)
        name = f"{getattr(fn, 'name', None) or getattr(fn, '__name__', 'task')}#{len(self.tasks)}" if name is None else name
        if name in self._by_name:
            raise GraphError(ErrorCode.DUPLICATE_SYMBOL, f"two tasks are named {name!r}", name, inputs)
        if timeout is not None and not timeout > 0:
            raise GraphError(ErrorCode.ATTRIBUTE_VALUE, f"task {name!r}: timeout is seconds > 0, not {timeout!r}", name)
        if not isinstance(retries, int) or retries < 0:
            raise GraphError(ErrorCode.ATTRIBUTE_VALUE, f"task {name!r}: retries is a count >= 0, not {retries!r}", name)
        if isinstance(fn, IRFunction):
            if process:
                raise GraphError(ErrorCode.ATTRIBUTE_VALUE, f"task {name!r}: an IR function runs on a thread "
                                 "(its compiled kernels release the GIL), not process=True", name)
            _check_count(name, fn.name, len(fn.param_types()), len(fn.param_types()), inputs)
        else:
            fn = self._function(fn, process, (not process) if jit is None else jit)
            _check_count(name, fn.name, *fn.arity(), inputs)
        for a in after:
            if isinstance(a, Task) and self._by_name.get(a.name) is not a:
                raise GraphError(ErrorCode.UNDEFINED_TASK, f"task {name!r}: after names {a!r} of another graph", name)
        t = Task(len(self.tasks), name, fn, inputs, outputs, tuple(after), process, timeout, retries)
        self.tasks.append(t)
        self._by_name[name] = t
        return t

    def _function(self, fn: Callable, process: bool, jit: bool) -> PyFunction:
        """One PyFunction per (function, placement, jit), so its traces are shared by its tasks."""
        key = (id(fn), process, jit)
        found = self._functions.get(key)
        if found is None or found.fn is not fn:
            if not callable(fn):
                raise GraphError(ErrorCode.ATTRIBUTE_TYPE, f"a task runs a function, not {type(fn).__name__}")
            found = self._functions[key] = PyFunction(fn, jit, reference(fn) if process else None)
        return found

    @classmethod
    def from_module(cls, module: Module, store: Any, backend: str | None = None) -> "Graph":
        """The graph of an IR module's `task` declarations (verified first: E0203, E0208,
        E0209, E0302, E0307 as the verifier reports them)."""
        verify(module)
        g = cls(store)
        for t in module.tasks.values():
            g.task(IRFunction(module, t.func, backend), t.inputs, t.outputs, after=t.after, name=t.name)
        return g

    def dependencies(self) -> list[list[int]]:
        """For each task, the indices of the tasks in its `after` (E0208 for an unknown name)."""
        deps = []
        for t in self.tasks:
            row = []
            for a in t.after:
                found = self._by_name.get(a) if isinstance(a, str) else a
                if found is None:
                    raise GraphError(ErrorCode.UNDEFINED_TASK, f"task {t.name!r}: after names {a!r}, which is not a "
                                     "task of this graph", t.name, t.inputs)
                row.append(found.index)
            deps.append(row)
        return deps

    def order(self) -> list[int]:
        """Task indices in an order where every task follows its `after` (E0209 on a cycle)."""
        return topological_order(self.dependencies(), [t.name for t in self.tasks])

    def external_inputs(self) -> list[tuple[Task, str]]:
        """(task, key) for every input key no task of the graph writes: the store must hold it."""
        written = {k for t in self.tasks for k in t.outputs}
        return [(t, k) for t in self.tasks for k in t.inputs if k not in written]

    def check_inputs(self) -> None:
        """Every input no task writes is in the store (E0804), and of an IR parameter's type
        (E0402, E0403), before anything runs."""
        for t, k in self.external_inputs():
            if k not in self.store:
                raise GraphError(ErrorCode.STORE_KEY_MISSING, f"task {t.name!r} reads {k!r}, which the store "
                                 f"{getattr(self.store, 'url', '')} does not hold and no task writes", t.name, t.inputs)
            if isinstance(t.fn, IRFunction):
                _check_type(t, k, self.store.info(k))

    def run(self, workers: int | None = None, *, backend: str = "local", progress: bool | None = None) -> Any:
        """Start the graph and return its `Run` handle at once. `workers`: threads (and, when
        the graph has process tasks, worker processes) (default: the CPU count); on
        `backend="ray"`, the most tasks handed to Ray at once (default: the cluster's CPUs),
        each run by a Ray worker (dtm/tasks/rayrun.py). `progress`: a progress bar on
        stderr (default: when stderr is a terminal)."""
        deps = self.dependencies()
        topological_order(deps, [t.name for t in self.tasks])
        self.check_inputs()
        if backend == "local":
            return LocalRun(self, deps, workers or os.cpu_count() or 1, progress)
        if backend == "ray":
            from .rayrun import RayRun  # imports ray when a Ray run starts: an optional dependency

            return RayRun(self, deps, workers, progress)
        raise GraphError(ErrorCode.UNKNOWN_BACKEND, f"unknown task backend {backend!r}; available: local, ray")


def _check_count(task: str, fn: str, least: int, most: int | None, inputs: tuple[str, ...]) -> None:
    if len(inputs) < least or (most is not None and len(inputs) > most):
        takes = f"{least}" if least == most else f"{least} to {most}" if most is not None else f"at least {least}"
        raise GraphError(ErrorCode.OPERAND_COUNT, f"task {task!r}: {fn} takes {takes} input(s), the task gives "
                         f"{len(inputs)} key(s) {list(inputs)}", task, inputs)


def _check_type(t: Task, key: str, info: Any) -> None:
    i = t.inputs.index(key)
    want = t.fn.param_types()[i]
    if info.dtype is not want.dtype:
        raise GraphError(ErrorCode.DTYPE_MISMATCH, f"task {t.name!r}: {key!r} holds {info.dtype}{list(info.shape)}, "
                         f"parameter {i} of {t.fn.name} is {want}", t.name, t.inputs)
    shape = tuple(want.shape)
    if len(shape) != len(info.shape) or any(isinstance(d, int) and d != s for d, s in zip(shape, info.shape)):
        raise GraphError(ErrorCode.SHAPE_MISMATCH, f"task {t.name!r}: {key!r} holds {info.dtype}{list(info.shape)}, "
                         f"parameter {i} of {t.fn.name} is {want}", t.name, t.inputs)


def topological_order(deps: list[list[int]], names: list[str]) -> list[int]:
    """Kahn's algorithm over `deps` (task -> tasks it waits for); E0209 names a task on a
    cycle when some tasks never become ready."""
    waiting = [len(d) for d in deps]
    dependents: list[list[int]] = [[] for _ in deps]
    for i, d in enumerate(deps):
        for j in d:
            dependents[j].append(i)
    ready = deque(i for i, n in enumerate(waiting) if n == 0)
    order = []
    while ready:
        i = ready.popleft()
        order.append(i)
        for j in dependents[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    if len(order) < len(deps):
        raise GraphError(ErrorCode.TASK_CYCLE, f"task {names[_on_cycle(deps, waiting)]!r} depends on itself through "
                         "after")
    return order


def _on_cycle(deps: list[list[int]], waiting: list[int]) -> int:
    """A task on a cycle: from any task left waiting, follow waiting predecessors (each has
    one) until a task repeats."""
    seen: set[int] = set()
    i = next(k for k, n in enumerate(waiting) if n)
    while i not in seen:
        seen.add(i)
        i = next(j for j in deps[i] if waiting[j])
    return i
