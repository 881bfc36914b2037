"""The local scheduler: a task starts as soon as every task in its `after` has finished
(spec 9.3; keys do not order tasks). Thread tasks run on `workers` threads (compiled kernels
release the GIL), process tasks on `workers` worker processes, one lane thread driving each.
A finishing task, on whichever lane, releases its dependents itself, so a ready task waits
for no central loop. A monitor thread draws the progress bar and stops thread tasks past
their timeout."""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import DTMError, ErrorCode
from .errors import GraphError, TaskError, TaskFailed, TaskTimeout, WorkerLost
from .functions import Interrupted, Outcome, run_task
from .procs import WorkerDied, WorkerProcess, borrow, give_back
from .progress import Bar, wanted
from .run import RunBase
from .report import CANCELLED, DONE, FAILED, QUEUED, RUNNING
from .watch import forget, watched

if TYPE_CHECKING:
    from .graph import Graph

CANCEL_GRACE_S = RunBase.CANCEL_GRACE_S  # a worker process interrupted by a cancel gets this long before SIGKILL
TICK_S = 0.05  # how often the monitor and the process lanes look at the clock


class LocalRun(RunBase):
    """The handle `Graph.run()` returns: wait, status, cancel, report."""

    def __init__(self, graph: "Graph", deps: list[list[int]], workers: int, progress: bool | None):
        super().__init__(graph, deps)
        tasks = self.tasks
        self.store = graph.store
        n = len(tasks)
        self.deadlines: dict[int, float] = {}  # thread tasks with a timeout, while they run
        self.left, self.running = n, 0

        has_process = any(t.process for t in tasks)
        if has_process and getattr(self.store, "url", "").startswith("memory://"):
            raise GraphError(ErrorCode.ATTRIBUTE_VALUE, "process tasks need a store worker processes can open "
                             f"(a directory or fsspec URL), not the process-local {self.store.url}")
        self.queues = {False: queue.SimpleQueue(), True: queue.SimpleQueue()}  # by Task.process
        self.lanes = {False: workers if any(not t.process for t in tasks) else 0, True: workers if has_process else 0}
        for k in range(self.lanes[False]):
            threading.Thread(target=self._thread_lane, args=(f"thread {k}",), name=f"dtm-task-{k}", daemon=True).start()
        for k in range(self.lanes[True]):
            threading.Thread(target=self._process_lane, args=(k,), name=f"dtm-task-proc-{k}", daemon=True).start()
        self.bar = Bar(n) if wanted(progress) and n else None
        with self.lock:
            for i in range(n):
                if self.waiting[i] == 0:
                    self.queues[tasks[i].process].put(i)
            if n == 0:
                self._end()
        self.monitor = threading.Thread(target=self._monitor, name="dtm-task-monitor", daemon=True)
        self.monitor.start()

    # --- the handle -----------------------------------------------------------------------

    def _joined(self) -> None:
        self.monitor.join(1.0)  # the progress bar's last frame, before the caller prints

    def cancel(self) -> None:
        """Start no task any more; running ones stop at their next boundary (their outputs
        are not written). Returns at once: `wait()` for the end."""
        with self.lock:
            if self.ended.is_set():
                return
            self.cancelled = self.stop = True
            if self.running == 0:
                self._end()

    # --- bookkeeping (every method below holds self.lock) -----------------------------------

    def _claim(self, i: int, worker: str) -> bool:
        if self.stop:
            return False
        self.state[i] = RUNNING
        self.running += 1
        self.worker[i] = worker
        self.attempts[i] += 1
        t = self.tasks[i]
        if t.timeout is not None and not t.process:
            self.deadlines[i] = time.monotonic() + t.timeout
        return True

    def _settle(self, i: int, state: int, outcome: Outcome | None = None, error: TaskError | None = None) -> None:
        """Task i ended (unless a timeout settled it already)."""
        if self.state[i] != RUNNING:
            return
        self.deadlines.pop(i, None)
        self.running -= 1
        self.left -= 1
        self._ended(i, state, outcome, error, lambda j: self.queues[self.tasks[j].process].put(j))
        if self.left == 0 or (self.stop and self.running == 0):
            self._end()

    def _requeue(self, i: int) -> None:
        """Task i's worker died: run it again, on another worker."""
        self.state[i] = QUEUED
        self.running -= 1
        if self.stop and self.running == 0:
            self._end()
        else:
            self.queues[True].put(i)

    def _end(self) -> None:
        if self.ended.is_set():
            return
        self.ended_at = time.perf_counter()
        for process, lanes in self.lanes.items():
            for _ in range(lanes):
                self.queues[process].put(None)
        self.ended.set()

    # --- lanes ------------------------------------------------------------------------------

    def _thread_lane(self, worker: str) -> None:
        q, stopping = self.queues[False], lambda: self.stop
        while (i := q.get()) is not None:
            with self.lock:
                if not self._claim(i, worker):
                    continue
            t = self.tasks[i]
            try:
                outcome = run_task(self.store, t.fn, t.inputs, t.outputs, stopping)
            except Interrupted:
                with self.lock:
                    self._settle(i, CANCELLED)
            except Exception as e:  # the task's own fault, never retried
                failure = _failure(t, worker, type(e).__name__, e.message if isinstance(e, DTMError) else str(e),
                                   e.code if isinstance(e, DTMError) else None)
                failure.__cause__ = e
                with self.lock:
                    self._settle(i, FAILED, error=failure)
            else:
                with self.lock:
                    self._settle(i, DONE, outcome)

    def _process_lane(self, lane: int) -> None:
        q, proc, generation = self.queues[True], None, 0
        while (i := q.get()) is not None:
            if proc is None:
                generation += 1
                try:
                    proc = borrow(self.store, f"process {lane}.{generation}")
                except DTMError as e:
                    with self.lock:
                        if self._claim(i, f"process {lane}.{generation}"):
                            self._settle(i, FAILED, error=_failure(self.tasks[i], None, type(e).__name__, e.message,
                                                                   e.code))
                    continue
            with self.lock:
                if not self._claim(i, proc.name):
                    continue
            if not self._on_process(i, proc):
                forget(proc)
                proc = None  # killed or died: the next task gets a fresh worker
        if proc is not None:
            forget(proc)
            give_back(self.store, proc)

    def _on_process(self, i: int, proc: WorkerProcess) -> bool:
        """Run task i on `proc` to its end; False when the worker is gone afterwards."""
        t = self.tasks[i]
        start = time.monotonic()
        deadline = start + t.timeout if t.timeout is not None else None
        interrupted_at = None
        try:
            proc.send({"task": i, "fn": t.fn.ref, "jit": t.fn.jit, "inputs": t.inputs, "outputs": t.outputs})
            while (reply := proc.receive(time.monotonic() + TICK_S)) is None:
                now = time.monotonic()
                watched(proc).tick(now, f"task {t.name}")
                if self.stop and interrupted_at is None:
                    proc.interrupt()
                    interrupted_at = now
                if interrupted_at is not None and now - interrupted_at > CANCEL_GRACE_S:
                    proc.kill()
                    with self.lock:
                        self._settle(i, CANCELLED)
                    return False
                if deadline is not None and now > deadline:
                    proc.kill()
                    with self.lock:
                        self._settle(i, FAILED, error=TaskTimeout(t.name, t.inputs, proc.name, t.timeout))
                    return False
        except WorkerDied as e:
            with self.lock:
                if self.stop:
                    self._settle(i, CANCELLED)
                elif self.attempts[i] <= t.retries:
                    self._requeue(i)
                else:
                    self._settle(i, FAILED, error=WorkerLost(t.name, t.inputs, proc.name, self.attempts[i], e.how))
            return False
        with self.lock:
            if reply["ok"]:
                watched(proc).finished(reply["read"], reply["written"])
                self._settle(i, DONE, Outcome(reply["read"], reply["written"], reply["seconds"]))
            elif reply.get("cancelled"):
                self._settle(i, CANCELLED)
            else:
                code = ErrorCode(reply["code"]) if reply.get("code") else None
                self._settle(i, FAILED, error=_failure(t, proc.name, reply["type"], reply["message"], code))
        return True

    def _monitor(self) -> None:
        while not self.ended.wait(TICK_S if self.bar or self.deadlines else 4 * TICK_S):
            now = time.monotonic()
            with self.lock:
                for i, deadline in list(self.deadlines.items()):
                    if now > deadline:
                        t = self.tasks[i]  # a thread cannot be killed: its late results are dropped
                        self._settle(i, FAILED, error=TaskTimeout(t.name, t.inputs, self.worker[i], t.timeout))
            if self.bar:
                s = self.status()
                self.bar.update(s["done"], s["running"], s["failed"], s["queued"])
        if self.bar:
            s = self.status()
            self.bar.update(s["done"], s["running"], s["failed"], s["queued"])
            self.bar.close()


def _failure(t: Any, worker: str | None, error_type: str, detail: str, code: ErrorCode | None) -> TaskFailed:
    return TaskFailed(t.name, t.inputs, worker, error_type, detail, code or ErrorCode.TASK_FAILED)
