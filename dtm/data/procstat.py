"""CPU and resident memory of another process, from /proc (Linux): how the ingest parent
watches workers that send no heartbeat of their own."""

from __future__ import annotations

import os
import time

_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


class ProcStat:
    """`sample()` gives (CPU % of one core since the last sample, RSS bytes); zeros once the
    process is gone or where /proc is missing."""

    def __init__(self, pid: int):
        self.pid = pid
        self._cpu, self._at = self._cpu_seconds(), time.monotonic()

    def _cpu_seconds(self) -> float:
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                # the command name (field 2) may hold spaces: count fields after its ')'
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
        except (OSError, IndexError, ValueError):
            return 0.0

    def rss_bytes(self) -> int:
        try:
            with open(f"/proc/{self.pid}/statm", "rb") as f:
                return int(f.read().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            return 0

    def sample(self) -> tuple[float, int]:
        cpu, at = self._cpu_seconds(), time.monotonic()
        pct = 100.0 * max(cpu - self._cpu, 0.0) / max(at - self._at, 1e-6)
        self._cpu, self._at = cpu, at
        return pct, self.rss_bytes()
