"""What this process is doing besides collectives, for its heartbeats (spec 9.6).

A rank's heartbeat carries its operations done, bytes moved and state. Collectives count
themselves in the communicator; the L2 services that run inside a rank (data ingest, the
loader feeding a training loop) count here, and `ProcessGroup.figures` adds this to what the
heartbeat sends. Helper processes that are not ranks (ingest workers) have no heartbeat of
their own: their parent adds their CPU and resident memory here, so the rank's heartbeat
carries the work it started.

The hook for helper processes (ingest workers, process-task workers): whoever watches them
calls `activity().report_worker(row)` about once a second with each worker's figures (a
`Row`: CPU, RSS, items done, bytes, state) and `drop_worker(name)` when it ends; the
helpers' CPU and memory totals that heartbeats add are the sums of those rows.

One process-wide `Activity`; writers are the service's own thread, the reader is the
heartbeat thread. Plain int fields updated by one writer each need no lock in CPython; the
worker table is replaced, never changed in place, so a reader iterates a stable one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Row:
    """One rank's or helper worker's figures at one moment (a row of `dtm top`)."""

    name: str
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    ops: int = 0                   # operations, items or tasks done
    sent_bytes: int = 0
    received_bytes: int = 0
    state: str = ""
    last_op: str = ""
    age_s: float = math.inf


@dataclass
class Activity:
    items: int = 0                 # items (files ingested, batches loaded) finished
    bytes_read: int = 0            # reported as bytes_received
    bytes_written: int = 0         # reported as bytes_sent
    state: str = ""                # what the service does now; "" leaves the rank's own
    workers: dict[str, Row] = field(default_factory=dict)   # helper processes by name (module doc)

    def report_worker(self, row: Row) -> None:
        """A helper process's figures now (called about once a second per worker)."""
        self.workers = {**self.workers, row.name: row}

    def drop_worker(self, name: str) -> None:
        """The helper process `name` ended: its figures leave the totals."""
        self.workers = {k: r for k, r in self.workers.items() if k != name}

    @property
    def helper_cpu_percent(self) -> float:
        """Helper processes' CPU, in percent of one core."""
        return sum(r.cpu_percent for r in self.workers.values())

    @property
    def helper_rss_bytes(self) -> int:
        """Helper processes' resident memory."""
        return sum(r.rss_bytes for r in self.workers.values())


_activity = Activity()


def activity() -> Activity:
    """This process's Activity (one per process)."""
    return _activity
