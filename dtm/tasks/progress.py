"""A live progress bar for a run on stderr (rich): done, running, failed and queued tasks."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class Bar:
    def __init__(self, total: int):
        self._progress = Progress(TextColumn("tasks"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[counts]}"), TimeElapsedColumn(),
                                  console=Console(file=sys.stderr), transient=False)
        self._id = self._progress.add_task("tasks", total=total, counts="")
        self._progress.start()

    def update(self, done: int, running: int, failed: int, queued: int) -> None:
        self._progress.update(self._id, completed=done,
                              counts=f"running {running}  failed {failed}  queued {queued}")

    def close(self) -> None:
        self._progress.stop()


def wanted(progress: bool | None) -> bool:
    """Draw a bar when asked, else when stderr is a terminal."""
    return sys.stderr.isatty() if progress is None else progress
