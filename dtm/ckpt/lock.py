"""The save lock of a checkpoint root (spec 9.4.3): one job saves into a root at a time.

In a directory, `ROOT/.save.lock` is held with an exclusive flock(2) by the process that
prepares a save (rank 0 of the job) until the save has ended, committed or not. The kernel
drops the lock when that process dies, SIGKILL included, so a killed job never leaves a
root locked; the file's text (who holds it, which step) is only for the error a second job
gets.

Behind a URL (an object store has no locks) the same file is a lease: its holder writes it
with a token and renews it every RENEW_S while it saves, and removes it when done; a lease
not renewed for STALE_S is a dead holder's and is taken over. Two jobs that write the lease
in the same instant are told apart by reading it back (the later write wins, the earlier
writer sees a token not its own): as good as an object store without conditional writes
allows.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import socket
import threading
import time
from typing import Any

from .errors import CheckpointBusy

LOCK = ".save.lock"
RENEW_S = 10.0   # a lease's renewal period behind a URL
STALE_S = 60.0   # a lease not renewed for this long belongs to a dead holder


def _holder(step: int, token: str = "") -> dict:
    """What the lock file says of its holder (spec 9.4.3)."""
    now = time.time()
    return {"pid": os.getpid(), "host": socket.gethostname(), "step": step, "since": now, "renewed": now,
            "token": token}


def _who(raw: bytes) -> str:
    """Who holds the lock, as its file says ("process 123 on host h, saving step 2,")."""
    try:
        doc = json.loads(raw or b"{}")
        return f"process {int(doc['pid'])} on host {doc['host']}, saving step {int(doc['step'])},"
    except (ValueError, KeyError, TypeError):
        return "another process"


def _busy(place: Any, holder: str) -> CheckpointBusy:
    return CheckpointBusy(f"{place.url}: {holder} is saving into this checkpoint root; nothing was written and the "
                          "earlier checkpoints are kept; wait for that save to end or save into another directory",
                          place.url)


class SaveLock:
    """The save lock of a checkpoint root (a `place.Place`), held from `acquire` until `release`."""

    def __init__(self, release: Any):
        self._release = release

    @classmethod
    def acquire(cls, place: Any, step: int) -> "SaveLock":
        """Take the lock without waiting: E1407 naming the holder when another process
        saves into the root now."""
        return cls._flock(place, step) if place.local else cls._lease(place, step)

    @classmethod
    def _flock(cls, place: Any, step: int) -> "SaveLock":
        fd = os.open(place.files.path(LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _who(os.pread(fd, 4096, 0))
            os.close(fd)
            raise _busy(place, holder) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder(step)).encode(), 0)
        return cls(lambda: os.close(fd))  # (closing the only descriptor drops the flock)

    @classmethod
    def _lease(cls, place: Any, step: int) -> "SaveLock":
        if place.exists(LOCK):
            raw = place.read(LOCK)
            with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
                if time.time() - float(json.loads(raw)["renewed"]) < STALE_S:
                    raise _busy(place, _who(raw))
        doc = _holder(step, secrets.token_hex(8))
        place.commit(LOCK, json.dumps(doc).encode())
        if json.loads(place.read(LOCK)).get("token") != doc["token"]:  # another job wrote it in the same instant
            raise _busy(place, _who(place.read(LOCK)))
        done = threading.Event()

        def renew() -> None:
            while not done.wait(RENEW_S):
                doc["renewed"] = time.time()
                with contextlib.suppress(OSError):
                    place.commit(LOCK, json.dumps(doc).encode())

        threading.Thread(target=renew, name="dtm-checkpoint-lease", daemon=True).start()

        def release() -> None:
            done.set()
            with contextlib.suppress(OSError):
                place.remove(LOCK)
        return cls(release)

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None
