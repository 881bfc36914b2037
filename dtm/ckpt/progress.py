"""A progress bar on stderr for a long checkpoint save (rich): shown by the process that
commits the save (rank 0), once the save has run AFTER_S, until it ends."""

from __future__ import annotations

import sys
import threading
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn

AFTER_S = 2.0     # a save that ends sooner shows nothing
REFRESH_S = 0.25


def wanted(progress: bool | None) -> bool:
    """Draw a bar when asked, else when stderr is a terminal."""
    return sys.stderr.isatty() if progress is None else bool(progress)


def watch(h: Any) -> None:
    """Show save `h`'s bytes written (`h.progress()` of `h._total`) from AFTER_S on, on a
    daemon thread of its own, until `h` is done."""

    def run() -> None:
        if h._done.wait(AFTER_S):
            return
        bar = Progress(TextColumn(f"checkpoint step {h.step}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                       TimeElapsedColumn(), console=Console(file=sys.stderr), transient=False)
        task = bar.add_task("save", total=h._total)
        with bar:
            while not h._done.wait(REFRESH_S):
                bar.update(task, completed=h.progress() * h._total)
            bar.update(task, completed=h._total if h._error is None else h.progress() * h._total)

    threading.Thread(target=run, name=f"dtm-checkpoint-{h.step}-progress", daemon=True).start()
