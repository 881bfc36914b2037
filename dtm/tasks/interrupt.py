"""Stopping a running task from a signal, in a worker process (worker.py) or a Ray worker
(rayrun.py): SIGINT is a cancel, SIGALRM a timeout. Inside the task's own function the
handler raises at once; elsewhere `run_task` sees `stopped()` at its next store boundary, so
a task never stops between two of its output puts."""

from __future__ import annotations

import signal
from typing import Any

from .functions import Interrupted


class Flags:
    stop: str | None = None  # "cancel" or "timeout" once a signal came: stop the running task
    in_function = False  # the task's own code runs: interrupt it right away


def on_signal(signum: int, frame: Any) -> None:
    Flags.stop = "timeout" if signum == signal.SIGALRM else "cancel"
    if Flags.in_function:
        raise Interrupted


def stopped() -> bool:
    return Flags.stop is not None


class Guarded:
    """A task function whose call a cancel or timeout signal may interrupt."""

    def __init__(self, fn: Any):
        self.fn, self.name = fn, fn.name

    def __getattr__(self, name: str) -> Any:  # param_types of an IR function
        return getattr(self.fn, name)

    def __call__(self, arrays: list) -> list:
        Flags.in_function = True
        try:
            if Flags.stop:
                raise Interrupted
            return self.fn(arrays)
        finally:
            Flags.in_function = False
