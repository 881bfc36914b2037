"""The errors a task graph raises: each a `DTMError` with its spec code (chapter 10). A
fault of one task names the task, its input keys and the worker it ran on, so a failed
graph of 100,000 tasks says which one to look at."""

from __future__ import annotations

from typing import Sequence

from ..errors import DTMError, ErrorCode


class TaskError(DTMError):
    """Base of the task graph's errors; `task`, `inputs` and `worker` name what failed
    (None where the fault is the graph's own, such as a cycle)."""

    def __init__(self, code: ErrorCode, message: str, task: str | None = None, inputs: Sequence[str] = (),
                 worker: str | None = None):
        super().__init__(code, message)
        self.task, self.inputs, self.worker = task, tuple(inputs), worker


def where(task: str, inputs: Sequence[str], worker: str | None) -> str:
    """`task 'tok' (inputs ['raw/0']) on thread 1`: the part every task fault's message shares."""
    return f"task {task!r} (inputs {list(inputs)})" + (f" on {worker}" if worker else "")


class TaskFailed(TaskError):
    """A task's function raised. `code` is the raised DTMError's code, else E1201;
    `error_type` names the exception's class (it may have been raised in another process)."""

    def __init__(self, task: str, inputs: Sequence[str], worker: str | None, error_type: str, detail: str,
                 code: ErrorCode = ErrorCode.TASK_FAILED):
        super().__init__(code, f"{where(task, inputs, worker)} failed: {error_type}: {detail}", task, inputs, worker)
        self.error_type, self.detail = error_type, detail


class WorkerLost(TaskError):
    """A task's worker process died under it on every attempt (E1202)."""

    def __init__(self, task: str, inputs: Sequence[str], worker: str, attempts: int, how: str):
        super().__init__(ErrorCode.WORKER_LOST, f"{where(task, inputs, worker)}: the worker died ({how}) "
                         f"on each of {attempts} attempt(s)", task, inputs, worker)


class TaskTimeout(TaskError):
    """A task ran longer than its `timeout` (E0802); its worker was stopped."""

    def __init__(self, task: str, inputs: Sequence[str], worker: str, seconds: float):
        super().__init__(ErrorCode.TIMEOUT, f"{where(task, inputs, worker)} ran past its timeout of {seconds:g} s",
                         task, inputs, worker)


class Cancelled(TaskError):
    """The run was cancelled (E1203): `run.cancel()` or Ctrl-C."""

    def __init__(self, summary: str):
        super().__init__(ErrorCode.TASK_CANCELLED, f"the task graph was cancelled: {summary}")


class GraphError(TaskError, ValueError):
    """A graph that cannot run: a cycle (E0209), a repeated name (E0204), an `after` that
    names no task (E0208), inputs or outputs that do not fit the function (E0302, E0307),
    a missing input key (E0804), a function a worker process cannot import (E1204)."""
