"""One ingest worker process, forked by the fork server (dtm/store/forkserver.py), which
calls `main` with its task and reply pipes, the function's name (`MOD:QUAL`) and the store's URL.

It imports the function by name, opens the store, then reads one JSON line per file from the
tasks pipe, `{"i": 3, "path": "...", "key": "corpus/shard/RUN/000003"}`, and answers on the
replies pipe with one JSON line:

    {"i": 3, "ok": true, "dtype": "u16", "shape": [n], "checksum": "...", "read": B, "written": B}
    {"i": 3, "ok": false, "code": "E1302", "error": "ValueError: ..."}

Its first line says it is ready (`{"ready": true}`) or why it is not (`{"ready": false, ...}`).
It exits when the tasks pipe closes. The pipes are their own file descriptors, so the
function's prints on stdout and stderr reach the terminal and cannot garble a reply.
"""

from __future__ import annotations

import json
import os

from ..errors import DTMError
from .worker import MAX_ERROR_CHARS, ingest_one

MAX_TASK_LINE = 64 << 10  # a task names one path and one key


def _send(out, body: dict) -> None:
    out.write(json.dumps(body).encode("utf-8") + b"\n")
    out.flush()


def main(fds: list[int], fn_name: str, store_url: str) -> int:
    """Ingest the files named on the task pipe `fds[0]` with the function `fn_name` into the
    store at `store_url`, answering on the reply pipe `fds[1]`, until the task pipe closes."""
    task_fd, replies = fds[0], os.fdopen(fds[1], "wb")
    worker = f"worker pid {os.getpid()}"
    try:
        from .. import store as stores
        from .fnref import resolve

        fn = resolve(fn_name)
        st = stores.open(store_url)
    except DTMError as e:
        _send(replies, {"ready": False, "code": e.code.value, "error": e.message[:MAX_ERROR_CHARS]})
        return 1
    _send(replies, {"ready": True})
    with os.fdopen(task_fd, "rb") as tasks:
        for line in iter(lambda: tasks.readline(MAX_TASK_LINE), b""):
            task = json.loads(line)
            try:
                reply = ingest_one(st, fn, task["path"], task["key"], worker)
            except DTMError as e:
                reply = {"ok": False, "code": e.code.value, "error": e.message[:MAX_ERROR_CHARS]}
            _send(replies, {"i": task["i"], **reply})
    st.close()
    return 0
