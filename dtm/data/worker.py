"""What an ingest worker does with one file (`ingest_one`); the same function runs in a worker
process (worker_main.py) and, with `workers=0`, in the caller's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ErrorCode as E
from .errors import IngestError

MAX_ERROR_CHARS = 4000


def ingest_one(store, fn: Callable[[bytes], Any], path: str, key: str, worker: str) -> dict:
    """Read `path`, turn it into an array with `fn`, store it under `key`: the reply fields.
    IngestError (E1301 unreadable, E1302 fn raised or returned no numeric array) names the
    file and `worker`."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise IngestError(E.INGEST_INPUT_MISSING, f"{path}: cannot read: {e.strerror or e} ({worker})", path,
                          worker) from None
    try:
        out = np.asarray(fn(data))
    except Exception as e:  # noqa: BLE001 - the user's function: any exception is this file's fault
        raise IngestError(E.INGEST_FN_FAILED, f"{path}: the ingest function raised on it ({worker}): "
                                              f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS], path, worker) from None
    if out.dtype.kind not in "biuf" or out.ndim < 1:
        raise IngestError(E.INGEST_FN_FAILED, f"{path}: the ingest function returned {out.dtype}{list(out.shape)} "
                                              f"({worker}); expected a numeric array of at least one dimension",
                          path, worker)
    info = store.put_array(key, out)
    return {"ok": True, "dtype": str(info.dtype), "shape": list(info.shape), "checksum": info.checksum,
            "read": len(data), "written": info.nbytes}


