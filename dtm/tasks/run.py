"""What every backend's run handle shares (local.py, rayrun.py): each task's state, worker,
outcome and attempts, the dependents a finished task releases, and the handle's `wait`,
`status` and `report`. A backend starts its tasks and settles them; this keeps the books."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..cluster.cancel import Cancelled as JobCancelled
from ..errors import DTMError, ErrorCode
from ..runtime import process_group
from .errors import Cancelled, TaskError
from .functions import Outcome
from .report import CANCELLED, DONE, FAILED, QUEUED, RUNNING, STATE_NAMES, Report, TaskRecord

if TYPE_CHECKING:
    from .graph import Graph


class RunBase:
    """The books of one run of a graph whose task i waits for the tasks `deps[i]`."""

    CANCEL_GRACE_S = 5.0  # a cancelled task gets this long to stop before its worker is killed

    def __init__(self, graph: "Graph", deps: list[list[int]]):
        self.tasks = graph.tasks
        n = len(self.tasks)
        self.state = bytearray(n)  # QUEUED ...
        self.waiting = [len(d) for d in deps]
        self.dependents: list[list[int]] = [[] for _ in range(n)]
        for i, d in enumerate(deps):
            for j in d:
                self.dependents[j].append(i)
        self.worker: list[str | None] = [None] * n
        self.outcome: list[Outcome | None] = [None] * n
        self.attempts = [0] * n
        self.errors: dict[int, str] = {}
        self.error: TaskError | None = None
        self.cancelled = False
        self.stop = False  # no task starts any more; running ones stop at their next boundary
        self.lock = threading.Lock()
        self.ended = threading.Event()
        self.started_at = time.perf_counter()
        self.ended_at: float | None = None
        self.job_cancel: JobCancelled | None = None  # the job's cancel (spec 9.4.10) that cancelled this run
        process_group.check_cancelled("starting a task graph's run")  # a cancelled job starts none
        process_group.on_cancel(self._job_cancelled)

    def _job_cancelled(self, cancel: JobCancelled) -> None:
        self.job_cancel = cancel
        self.cancel()

    def _ended(self, i: int, state: int, outcome: Outcome | None, error: TaskError | None,
               ready: Callable[[int], None]) -> None:
        """Task i ended in `state` (the caller holds the lock): record it; the first error
        stops the run; a finished task hands each dependent it was the last wait of to `ready`."""
        self.state[i], self.outcome[i] = state, outcome
        if error is not None:
            self.errors[i] = str(error)
            if self.error is None:
                self.error, self.stop = error, True
        if state == DONE and not self.stop:
            for j in self.dependents[i]:
                self.waiting[j] -= 1
                if self.waiting[j] == 0:
                    ready(j)

    def wait(self, timeout: float | None = None) -> Report:
        """Wait for the run to end and return its report; raise the failing task's error,
        Cancelled (E1203) after a cancel, E0802 when it has not ended within `timeout` s.
        Ctrl-C while waiting cancels the run (bounded) and raises KeyboardInterrupt."""
        try:
            ended = self.ended.wait(timeout)
        except KeyboardInterrupt:
            self.cancel()
            self.ended.wait(self.CANCEL_GRACE_S + 5)
            raise
        if not ended:
            raise DTMError(ErrorCode.TIMEOUT, f"the task graph did not finish within {timeout:g} s: "
                           f"{self.report().summary()}")
        self._joined()
        if self.error is not None:
            raise self.error
        if self.cancelled and self.job_cancel is not None:  # E1203, naming the job's cancel
            raise Cancelled(f"{self.report().summary()}; {self.job_cancel.message}") from self.job_cancel
        if self.cancelled:
            raise Cancelled(self.report().summary())
        return self.report()

    def cancel(self) -> None:
        raise NotImplementedError

    def _joined(self) -> None:
        """After the end: let the backend's own threads draw their last frame."""

    def status(self) -> dict[str, Any]:
        counts = [0] * 5
        for s in bytes(self.state):
            counts[s] += 1
        return {"state": self._run_state(), "done": counts[DONE], "running": counts[RUNNING],
                "failed": counts[FAILED], "cancelled": counts[CANCELLED], "queued": counts[QUEUED]}

    def report(self) -> Report:
        end = self.ended_at if self.ended_at is not None else time.perf_counter()
        records = []
        for i, t in enumerate(self.tasks):
            o = self.outcome[i]
            records.append(TaskRecord(t.name, STATE_NAMES[self.state[i]], self.worker[i], o.seconds if o else 0.0,
                                      o.read if o else 0, o.written if o else 0, self.attempts[i], self.errors.get(i)))
        return Report(self._run_state(), end - self.started_at, records)

    def _run_state(self) -> str:
        if not self.ended.is_set():
            return "running"
        return "failed" if self.error else "cancelled" if self.cancelled else "finished"
