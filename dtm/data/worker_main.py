"""One ingest worker process: `python -m dtm.data.worker_main --fn MOD:QUAL --store URL
--tasks FD --replies FD`.

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

import argparse
import json
import os
import sys

from ..errors import DTMError
from .worker import MAX_ERROR_CHARS, ingest_one

MAX_TASK_LINE = 64 << 10  # a task names one path and one key


def _send(out, body: dict) -> None:
    out.write(json.dumps(body).encode("utf-8") + b"\n")
    out.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dtm.data.worker")
    ap.add_argument("--fn", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--tasks", type=int, required=True)
    ap.add_argument("--replies", type=int, required=True)
    args = ap.parse_args(argv)
    replies = os.fdopen(args.replies, "wb")
    worker = f"worker pid {os.getpid()}"
    try:
        from .. import store as stores
        from .fnref import resolve

        fn = resolve(args.fn)
        st = stores.open(args.store)
    except DTMError as e:
        _send(replies, {"ready": False, "code": e.code.value, "error": e.message[:MAX_ERROR_CHARS]})
        return 1
    _send(replies, {"ready": True})
    with os.fdopen(args.tasks, "rb") as tasks:
        for line in iter(lambda: tasks.readline(MAX_TASK_LINE), b""):
            task = json.loads(line)
            try:
                reply = ingest_one(st, fn, task["path"], task["key"], worker)
            except DTMError as e:
                reply = {"ok": False, "code": e.code.value, "error": e.message[:MAX_ERROR_CHARS]}
            _send(replies, {"i": task["i"], **reply})
    st.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
