"""What this process is doing besides collectives, for its heartbeats (spec 9.6).

A rank's heartbeat carries its operations done, bytes moved and state. Collectives count
themselves in the communicator; the L2 services that run inside a rank (data ingest, the
loader feeding a training loop) count here, and `ProcessGroup.figures` adds this to what the
heartbeat sends. Helper processes that are not ranks (ingest workers) have no heartbeat of
their own: their parent adds their CPU and resident memory here, so the rank's heartbeat
carries the work it started.

One process-wide `Activity`; writers are the service's own thread, the reader is the
heartbeat thread. Plain int fields updated by one writer each need no lock in CPython.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Activity:
    items: int = 0                 # items (files ingested, batches loaded) finished
    bytes_read: int = 0            # reported as bytes_received
    bytes_written: int = 0         # reported as bytes_sent
    state: str = ""                # what the service does now; "" leaves the rank's own
    helper_cpu_percent: float = 0.0   # helper processes' CPU, in percent of one core
    helper_rss_bytes: int = 0         # and their resident memory


_activity = Activity()


def activity() -> Activity:
    """This process's Activity (one per process)."""
    return _activity
