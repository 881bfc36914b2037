"""The errors of data ingest and loading (spec chapter 10, E13xx)."""

from __future__ import annotations

from ..errors import DTMError, ErrorCode


class DataError(DTMError):
    """A fault of `dtm.data`: the message names the file, worker or prefix concerned."""


class IngestError(DataError):
    """Ingest failed on one file; `path` names it, `worker` the worker ("pid N", or "inline")."""

    def __init__(self, code: ErrorCode, message: str, path: str = "", worker: str = ""):
        super().__init__(code, message)
        self.path, self.worker = path, worker
