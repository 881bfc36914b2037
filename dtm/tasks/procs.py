"""The parent's end of one task worker process (worker.py): start it, send it a task, read
its answer within a deadline, interrupt or kill it. Every wait is bounded.

A worker is a fork of the fork server (dtm/store/forkserver.py), which has dtm imported: a
few milliseconds, where a fresh interpreter took about 0.7 s. Opening the store is still
its own, so a run hands its healthy workers back (`give_back`) and the next run over the
same Store object borrows them (`borrow`): they already hold that store open. They end
with the Store object (its pipes close: EOF ends a worker's loop) or at exit."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import threading
import time
import weakref
from typing import Any

from ..errors import DTMError, ErrorCode
from ..store import forkserver

START_TIMEOUT_S = 120.0  # a fork, then opening the store, on a busy machine


class WorkerDied(Exception):
    """The worker process ended while it held a task; `how` says how (a signal, exit code)."""

    def __init__(self, how: str):
        super().__init__(how)
        self.how = how


class WorkerProcess:
    def __init__(self, store_url: str, name: str):
        task_r, task_w = os.pipe()
        reply_r, reply_w = os.pipe()
        try:
            # its own session: a terminal's Ctrl-C reaches the parent, which cancels in order
            self.proc = forkserver.server().spawn("dtm.tasks.worker:serve", [store_url], [task_r, reply_w],
                                                  new_session=True)
        except BaseException:
            os.close(task_w)
            os.close(reply_r)
            raise
        finally:
            os.close(task_r)
            os.close(reply_w)
        self._tasks, self._replies = os.fdopen(task_w, "wb"), os.fdopen(reply_r, "rb")
        self.name = f"{name} (pid {self.proc.pid})"
        ready = self.receive(time.monotonic() + START_TIMEOUT_S)
        if ready is None or "ready" not in ready:
            self.kill()
            raise DTMError(ErrorCode.TIMEOUT, f"task worker {self.name} did not start within {START_TIMEOUT_S:g} s")

    def send(self, msg: dict[str, Any]) -> None:
        try:
            self._tasks.write((json.dumps(msg) + "\n").encode())
            self._tasks.flush()
        except (BrokenPipeError, OSError):
            raise WorkerDied(self._how()) from None

    def receive(self, deadline: float) -> dict[str, Any] | None:
        """The worker's next answer, or None at `deadline`; WorkerDied when it is gone."""
        wait = max(0.0, deadline - time.monotonic())
        if not select.select([self._replies], [], [], wait)[0]:
            return None
        line = self._replies.readline()
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
        self.proc.send_signal(signal.SIGINT)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        """Let it finish: EOF on its task pipe ends its loop; killed if it does not within 5 s."""
        try:
            self._tasks.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
        self._replies.close()


_idle: "weakref.WeakKeyDictionary[Any, list[WorkerProcess]]" = weakref.WeakKeyDictionary()  # by Store object
_idle_lock = threading.Lock()


def borrow(store: Any, name: str) -> WorkerProcess:
    """A worker on `store`: one an earlier run gave back and still alive, else a fresh one
    named `name`."""
    with _idle_lock:
        idle = _idle.get(store, [])
        while idle:
            w = idle.pop()
            if w.proc.poll() is None:
                return w
            w.kill()  # died while idle: reap it
    return WorkerProcess(store.url, name)


def give_back(store: Any, w: WorkerProcess) -> None:
    """`w` finished a run in good health: keep it for the next run over `store`."""
    with _idle_lock:
        _idle.setdefault(store, []).append(w)


@atexit.register
def _close_idle() -> None:
    with _idle_lock:
        workers = [w for idle in _idle.values() for w in idle]
        _idle.clear()
    for w in workers:
        w.close()
