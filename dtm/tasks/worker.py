"""A task worker process, forked by the fork server (dtm/store/forkserver.py), which calls
`serve`. It opens the store the parent names and runs tasks it is sent as JSON lines on its
task pipe, one at a time, answering each with one JSON line on its reply pipe. Only function names (`module:qualname`) and store keys
cross the pipe; tensors go through the store, and nothing is pickled.

    -> {"task": 3, "fn": "mymod:tokenize", "jit": false, "inputs": ["raw/0"], "outputs": ["tok/0"]}
    <- {"task": 3, "ok": true, "read": 4096, "written": 1024, "seconds": 0.01}
    <- {"task": 3, "ok": false, "cancelled": false, "code": "E0403", "type": "TensorError", "message": "..."}

SIGINT asks the running task to stop (the parent's cancel): at once inside its function,
at the next store boundary otherwise, and never between two of its output puts.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

from ..errors import DTMError
from ..store import open as open_store
from .functions import Interrupted, PyFunction, resolve, run_task
from .interrupt import Flags, Guarded, on_signal, stopped


def _answer(out: Any, reply: dict) -> None:
    out.write(json.dumps(reply) + "\n")
    out.flush()


def serve(fds: list[int], url: str) -> int:
    """The worker's loop over its task pipe and reply pipe (`fds`), on the store at `url`;
    it ends when the task pipe closes. The task's own prints reach the parent's stdout and
    stderr, apart from the replies."""
    tasks, out = os.fdopen(fds[0], "r"), os.fdopen(fds[1], "w")
    signal.signal(signal.SIGINT, on_signal)
    store = open_store(url)
    functions: dict[tuple[str, bool], Guarded] = {}
    _answer(out, {"ready": os.getpid()})
    for line in tasks:
        msg = json.loads(line)
        Flags.stop = None
        reply: dict[str, Any] = {"task": msg["task"]}
        try:
            key = (msg["fn"], bool(msg["jit"]))
            if key not in functions:
                functions[key] = Guarded(PyFunction(resolve(msg["fn"]), bool(msg["jit"]), msg["fn"]))
            outcome = run_task(store, functions[key], tuple(msg["inputs"]), tuple(msg["outputs"]),
                               stopped)
            reply.update(ok=True, read=outcome.read, written=outcome.written, seconds=outcome.seconds)
        except (Interrupted, KeyboardInterrupt):
            reply.update(ok=False, cancelled=True)
        except Exception as e:  # the task's own fault: reported to the parent, never retried
            reply.update(ok=False, cancelled=False, code=e.code.value if isinstance(e, DTMError) else None,
                         type=type(e).__name__, message=e.message if isinstance(e, DTMError) else str(e))
        _answer(out, reply)
    store.close()
    return 0
