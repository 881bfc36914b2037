"""What a rank's heartbeat says, and how often (spec 9.6).

Every `heartbeat_ms` a rank sends the coordinator a `Heartbeat`: its CPU use since the last
one, its resident memory, the bytes it moved, the operations it completed and the one it is
in. The coordinator declares a rank lost when it hears nothing from it for `timeout_ms`, or
at once when its connection closes without `Leave`. So every surviving rank learns of a dead
or stuck peer within `timeout_ms` of that peer's last heartbeat (5 s by default), plus the
time a frame takes to reach it: `detection_bound`.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from collections.abc import Iterable
from dataclasses import dataclass

from ..protocol.messages import MAX_WORKER_NAME_BYTES, MAX_WORKER_STATE_BYTES, MAX_WORKERS, Heartbeat, WorkerRow, \
    cut_utf8
from .activity import Row

HEARTBEAT_MS = 500   # default interval (DTM_HEARTBEAT_MS)
TIMEOUT_MS = 5000    # default silence after which a rank is lost (DTM_HEARTBEAT_TIMEOUT_MS)
DELIVERY_S = 1.0     # allowance for a notice to cross the network and wake a waiting rank


def detection_bound(heartbeat_ms: int, timeout_ms: int) -> float:
    """Seconds from a rank's last heartbeat until every survivor knows it is lost: the
    coordinator's timeout, one interval of scheduling slack, and delivery."""
    return (timeout_ms + heartbeat_ms) / 1000 + DELIVERY_S


@dataclass
class Figures:
    """What the rest of the process reports through heartbeats (read on the heartbeat thread)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    ops_done: int = 0
    last_op: str = ""
    # Helper processes this one started that send no heartbeat of their own (ingest workers,
    # activity.py): their CPU and memory count as this rank's.
    helper_cpu_percent: float = 0.0
    helper_rss_bytes: int = 0
    workers: tuple[Row, ...] = ()   # those helpers one by one, for their own rows in `dtm top`


FiguresFn = Callable[[], Figures]

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident memory now (/proc), or the peak where /proc is missing."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class ProcessStats:
    """CPU use between two calls, in percent of one core."""

    def __init__(self) -> None:
        self._cpu, self._wall = time.process_time(), time.monotonic()

    def cpu_percent(self) -> float:
        cpu, wall = time.process_time(), time.monotonic()
        pct = 100.0 * (cpu - self._cpu) / max(wall - self._wall, 1e-6)
        self._cpu, self._wall = cpu, wall
        return max(pct, 0.0)


def worker_rows(rows: Iterable[Row]) -> tuple[WorkerRow, ...]:
    """`rows` as a Heartbeat carries them, cut to its bounds (spec 9.1.5): the first
    MAX_WORKERS by name, names and states cut to their byte limits. Cutting here, not
    refusing, keeps a rank with too many helpers heartbeating (its totals still count all)."""
    out: dict[str, WorkerRow] = {}
    for r in sorted(rows, key=lambda r: r.name):
        name = cut_utf8(r.name, MAX_WORKER_NAME_BYTES)
        if name and name not in out and len(out) < MAX_WORKERS:
            out[name] = WorkerRow(name, max(r.cpu_percent, 0.0), r.rss_bytes, r.ops, r.sent_bytes, r.received_bytes,
                                  cut_utf8(r.state, MAX_WORKER_STATE_BYTES))
    return tuple(out.values())


def heartbeat(rank: int, stats: ProcessStats, figures: Figures, *, with_workers: bool = False) -> Heartbeat:
    """This rank's Heartbeat now; its helpers' rows only `with_workers` (the coordinator
    announced CAP_WORKER_ROWS)."""
    return Heartbeat(rank, stats.cpu_percent() + figures.helper_cpu_percent, rss_bytes() + figures.helper_rss_bytes,
                     figures.bytes_sent, figures.bytes_received, figures.ops_done, figures.last_op[:1000],
                     worker_rows(figures.workers) if with_workers else ())
