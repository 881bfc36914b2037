"""A rank's process as a launcher handles it, wherever it runs (`dtm launch`'s own host, or a
Ray actor's node: ray_ranks.py): the command that starts it, signals to its process group,
its output line by line, and how it ended."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import IO

from ..errors import DTMError, ErrorCode as E


def rank_command(argv: Sequence[str]) -> list[str]:
    """How a launcher runs a rank's command: `script.py args` under this Python, `-m module
    args` too, anything else as is."""
    argv = list(argv)
    if not argv:
        raise DTMError(E.NOT_INITIALIZED, "dtm launch needs a script (or -m module, or a command) to run")
    if argv[0].endswith(".py") or argv[0] == "-m":
        return [sys.executable, *argv]
    return argv


def signal_group(pid: int, sig: int) -> None:
    """`sig` to the process group of rank process `pid` (each runs in its own session), then
    SIGCONT after SIGTERM: a stopped rank handles it now, not at SIGKILL after the grace."""
    try:
        os.killpg(pid, sig)
        if sig == signal.SIGTERM:
            os.killpg(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def exit_status(code: int | None) -> str:
    """How a process with return code `code` ended, for a launcher's report."""
    return f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"


def read_lines(pipe: IO[bytes], emit: Callable[[str], None]) -> None:
    """Each line of `pipe` to `emit` (decoded, without its newline) until it ends; then close it."""
    for raw in iter(pipe.readline, b""):
        emit(raw.decode("utf-8", "replace").rstrip("\n"))
    pipe.close()


def print_line(out: IO[str], lock: threading.Lock, prefix: str, line: str) -> None:
    """One line of a rank's output on the launcher's `out`, after `prefix` ("[rank 1] "),
    whole (the ranks' lines share `out`: `lock`)."""
    with lock:
        out.write(f"{prefix}{line}\n")
        out.flush()
