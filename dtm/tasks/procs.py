"""The parent's end of one task worker process (worker.py): start it, send it a task, read
its answer within a deadline, interrupt or kill it. Every wait is bounded."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

from ..errors import DTMError, ErrorCode

START_TIMEOUT_S = 120.0  # importing dtm in a fresh interpreter on a busy machine


class WorkerDied(Exception):
    """The worker process ended while it held a task; `how` says how (a signal, exit code)."""

    def __init__(self, how: str):
        super().__init__(how)
        self.how = how


class WorkerProcess:
    def __init__(self, store_url: str, name: str):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
        # its own session: a terminal's Ctrl-C reaches the parent, which cancels in order
        self.proc = subprocess.Popen([sys.executable, "-m", "dtm.tasks.worker", store_url], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, start_new_session=True)
        self.name = f"{name} (pid {self.proc.pid})"
        ready = self.receive(time.monotonic() + START_TIMEOUT_S)
        if ready is None or "ready" not in ready:
            self.kill()
            raise DTMError(ErrorCode.TIMEOUT, f"task worker {self.name} did not start within {START_TIMEOUT_S:g} s")

    def send(self, msg: dict[str, Any]) -> None:
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerDied(self._how()) from None

    def receive(self, deadline: float) -> dict[str, Any] | None:
        """The worker's next answer, or None at `deadline`; WorkerDied when it is gone."""
        wait = max(0.0, deadline - time.monotonic())
        if not select.select([self.proc.stdout], [], [], wait)[0]:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerDied(self._how())
        return json.loads(line)

    def _how(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "it closed its pipe"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def interrupt(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        """Let it finish: EOF on its stdin ends its loop; killed if it does not within 5 s."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
        self.proc.stdout.close()
