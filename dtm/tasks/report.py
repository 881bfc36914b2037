"""What a run did: each task's state, worker, time and bytes moved, and the lists a
cancelled or failed run is judged by (finished, failed, cancelled, never started)."""

from __future__ import annotations

from dataclasses import dataclass, field

# A task's state during a run. QUEUED covers waiting for `after` and waiting for a worker.
QUEUED, RUNNING, DONE, FAILED, CANCELLED = range(5)
STATE_NAMES = ("never started", "running", "finished", "failed", "cancelled")


@dataclass
class TaskRecord:
    name: str
    state: str
    worker: str | None
    seconds: float
    bytes_read: int
    bytes_written: int
    attempts: int
    error: str | None = None


@dataclass
class Report:
    """`tasks` in the graph's order; `state` is the run's: running, finished, failed, cancelled."""

    state: str
    seconds: float
    tasks: list[TaskRecord] = field(default_factory=list)

    def _named(self, state: str) -> list[str]:
        return [t.name for t in self.tasks if t.state == state]

    @property
    def finished(self) -> list[str]:
        return self._named("finished")

    @property
    def failed(self) -> list[str]:
        return self._named("failed")

    @property
    def cancelled(self) -> list[str]:
        return self._named("cancelled")

    @property
    def never_started(self) -> list[str]:
        return self._named("never started")

    def summary(self) -> str:
        counts = {s: 0 for s in STATE_NAMES}
        for t in self.tasks:
            counts[t.state] += 1
        parts = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        return f"{self.state} in {self.seconds:.3f} s: {parts or 'no tasks'}"

    def __str__(self) -> str:
        rows = [self.summary(), f"{'task':<24} {'state':<13} {'worker':<24} {'seconds':>9} {'read':>10} {'written':>10}"]
        rows += [f"{t.name:<24} {t.state:<13} {t.worker or '-':<24} {t.seconds:>9.4f} {t.bytes_read:>10} "
                 f"{t.bytes_written:>10}" + (f"  {t.error}" if t.error else "") for t in self.tasks]
        return "\n".join(rows)
