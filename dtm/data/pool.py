"""The ingest parent's side of its worker processes (worker_main.py): start one, hand it files,
read its replies, watch its CPU and memory, end it.

Workers are forks of the fork server (dtm/store/forkserver.py), not of the parent: the server
was forked before the parent opened SQLite (whose lock state a fork of the parent would
inherit), so a worker starts in milliseconds with dtm imported and opens the store itself.
It shares nothing with the parent's threads (a heartbeat thread, a loader's prefetch thread)
and receives only JSON on its own pipes, so nothing is pickled. It imports the function by
name, as the parent does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import deque

from ..cluster.activity import Row
from ..store import forkserver
from .procstat import ProcStat

MAX_REPLY_LINE = 64 << 10  # replies are a few hundred bytes; error texts are cut at 4000 chars
END_GRACE_S = 2.0


class Worker:
    """One worker process; `inflight` holds the indices of the files sent to it, the first
    being the one it works on now (it answers in order)."""

    def __init__(self, slot: int, fn: str, store_url: str):
        task_r, self._task_w = os.pipe()
        self.fd, reply_w = os.pipe()
        try:
            self.proc = forkserver.server().spawn("dtm.data.worker_main:main", [fn, store_url], [task_r, reply_w],
                                                  new_session=False)
        except BaseException:
            os.close(self._task_w)
            os.close(self.fd)
            raise
        finally:
            os.close(task_r)
            os.close(reply_w)
        os.set_blocking(self.fd, False)
        self.slot, self.pid = slot, self.proc.pid
        self.started = time.monotonic()
        self.ready = False
        self.inflight: deque[int] = deque()
        self.head_since = 0.0           # when the file it works on now reached it
        self.items = self.read_bytes = self.written_bytes = 0
        self.state = "starting"
        self._buf = bytearray()
        self._stat = ProcStat(self.pid)
        self.cpu_percent, self.rss_bytes = 0.0, 0

    @property
    def name(self) -> str:
        return f"worker {self.slot} (pid {self.pid})"

    def send(self, i: int, path: str, key: str) -> None:
        if not self.inflight:
            self.head_since = time.monotonic()
        self.inflight.append(i)
        os.write(self._task_w, json.dumps({"i": i, "path": path, "key": key}).encode("utf-8") + b"\n")

    def done(self) -> int:
        """The file it worked on is answered; the next one in flight is its work now."""
        i = self.inflight.popleft()
        self.head_since = time.monotonic()
        return i

    def replies(self) -> list[dict] | None:
        """The complete reply lines that arrived; None once the process closed its end."""
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        if not data:
            return None
        self._buf += data
        if b"\n" not in self._buf and len(self._buf) > MAX_REPLY_LINE:
            raise ValueError(f"{self.name} sent a reply line longer than {MAX_REPLY_LINE} bytes")
        *lines, rest = self._buf.split(b"\n")
        self._buf = bytearray(rest)
        return [json.loads(line) for line in lines]

    @property
    def row_name(self) -> str:
        """Its name in `dtm top`'s table and this process's activity."""
        return f"w{self.slot} {self.pid}"

    def sample(self) -> Row:
        """Its figures now, CPU since the last sample (the parent's tick)."""
        self.cpu_percent, self.rss_bytes = self._stat.sample()
        return Row(self.row_name, self.cpu_percent, self.rss_bytes, self.items, self.written_bytes,
                   self.read_bytes, self.state, age_s=0.0)

    def status(self) -> str:
        """How the process ended, once it has ("exit code 1", "killed by SIGKILL")."""
        try:
            code = self.proc.wait(END_GRACE_S)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def close_tasks(self) -> None:
        """Close its task pipe: it exits once it has answered the files it holds."""
        try:
            os.close(self._task_w)
        except OSError:
            pass

    def finish(self) -> None:
        """Close its task pipe; wait for it to exit, SIGKILL if it has not after a grace."""
        self.close_tasks()
        try:
            self.proc.wait(END_GRACE_S)
        except subprocess.TimeoutExpired:
            self.kill()
        try:
            os.close(self.fd)
        except OSError:
            pass

    def kill(self) -> None:
        self.proc.kill()
        try:
            self.proc.wait(END_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
