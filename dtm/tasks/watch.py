"""Process-task workers as rows of `dtm top` (spec 9.6.6): the lane that drives a worker
process reports its CPU and memory (from /proc, as the ingest parent does) about once a
second through the activity hook, with the tasks it finished and the bytes they moved, and
drops its row when the lane lets the worker go.

    watched(proc).tick(now, "task load_shard")      # on each wait of the lane's loop
    watched(proc).finished(read, written)           # a task's reply
    forget(proc)                                    # killed, died, or handed back idle
"""

from __future__ import annotations

import threading

from ..cluster.activity import Row, activity
from ..data.procstat import ProcStat
from .procs import WorkerProcess

REPORT_S = 1.0  # the hook wants a row about once a second (activity.py)


class WorkerFigures:
    """One worker's row, kept by the lane thread that drives it (the only writer)."""

    def __init__(self, proc: WorkerProcess):
        self.stat = ProcStat(proc.proc.pid)
        self.row = Row(proc.name)
        self._due = 0.0

    def tick(self, now: float, state: str) -> None:
        """Report the row if a second has passed since the last report."""
        if now < self._due:
            return
        self._due = now + REPORT_S
        self.row.cpu_percent, self.row.rss_bytes = self.stat.sample()
        self.row.state = state
        activity().report_worker(Row(**vars(self.row)))  # a copy: the table's rows are never changed in place

    def finished(self, read: int, written: int) -> None:
        """A task ended on this worker: count it and its bytes (shown at the next tick)."""
        self.row.ops += 1
        self.row.received_bytes += read
        self.row.sent_bytes += written


_watched: dict[WorkerProcess, WorkerFigures] = {}
_lock = threading.Lock()  # lanes add and remove their workers concurrently


def watched(proc: WorkerProcess) -> WorkerFigures:
    """`proc`'s figures, started at its first call."""
    with _lock:
        if proc not in _watched:
            _watched[proc] = WorkerFigures(proc)
        return _watched[proc]


def forget(proc: WorkerProcess) -> None:
    """`proc` leaves this run: its row leaves the heartbeats."""
    with _lock:
        _watched.pop(proc, None)
    activity().drop_worker(proc.name)
