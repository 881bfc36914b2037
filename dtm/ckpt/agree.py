"""How the ranks of a mesh of processes agree on a checkpoint written in the background
(spec 9.4.11), through small files in the step directory instead of collectives, so that a
save never runs a collective beside the training's own on the process group.

Each rank, once its pieces are written and synced, writes its status
(`.status-R.json`: an error code and message, or its CRC parts of the distributed tensors).
Process rank 0 waits for every rank's status; then it commits the checkpoint (the manifest)
or, when a rank failed, writes the outcome (`.outcome.json`, naming that rank), waits for
each other rank's acknowledgement (`.seen-R`) and removes the step directory. The other
ranks wait for the manifest or the outcome. Every wait is bounded and ends early when the
process group hears that a rank was lost.
"""

from __future__ import annotations

import time
from typing import Callable

from ..errors import DTMError, ErrorCode
from . import manifest as mf
from .errors import CheckpointInvalid
from .place import Place

OUTCOME = ".outcome.json"
MAX_STATUS_BYTES = 16 << 20   # a status or outcome file is bounded before it is read
POLL_S = (0.002, 0.05)        # the first and the longest pause between looks at the directory
BASE_TIMEOUT_S = 60.0         # a wait's bound: this plus the save's bytes at MIN_RATE
MIN_RATE = 10e6               # bytes per second a rank writes at the slowest


def status_name(rank: int) -> str:
    return f".status-{rank}.json"


def seen_name(rank: int) -> str:
    return f".seen-{rank}"


def timeout_for(nbytes: int) -> float:
    """How long a rank waits for the others, for a save of `nbytes` tensor bytes in all."""
    return BASE_TIMEOUT_S + nbytes / MIN_RATE


def read_json(step_dir: str, name: str) -> dict:
    """A status or outcome file, bounded and checked to be a JSON object (E1403 else)."""
    path = f"{step_dir}/{name}"
    doc = mf.read_json(step_dir, name, MAX_STATUS_BYTES, "a rank's status")
    if not isinstance(doc, dict):
        raise CheckpointInvalid(f"{path}: expected a JSON object, found {type(doc).__name__}", path)
    return doc


def status(rank: int, error: DTMError | None, parts: list[int | None]) -> dict:
    """Rank `rank`'s status: code 0 and its CRC part of each item (None: not a distributed
    tensor), or the code and message of its error."""
    if error is None:
        return {"rank": rank, "code": 0, "message": "", "parts": parts}
    return {"rank": rank, "code": int(error.code.value[1:]), "message": error.message, "parts": []}


def checked_status(doc: dict, rank: int, items: int, path: str) -> dict:
    """A status file's document, checked against what rank `rank` writes for `items` items."""
    parts = doc.get("parts")
    ok = doc.get("rank") == rank and isinstance(doc.get("code"), int) and isinstance(doc.get("message"), str) \
        and isinstance(parts, list) and (doc["code"] != 0 or len(parts) == items) \
        and all(p is None or (isinstance(p, int) and 0 <= p < 1 << 32) for p in parts)
    if not ok:
        raise CheckpointInvalid(f"{path}: expected rank {rank}'s status (rank, code, message, {items} CRC parts), "
                                f"found {str(doc)[:200]}", path)
    return doc


def error_of(doc: dict, step_dir: str) -> DTMError:
    """The error a failed rank's status or an outcome names, as the code it carries."""
    try:
        code = ErrorCode(f"E{int(doc['code']):04d}")
    except (ValueError, KeyError, TypeError):
        code = ErrorCode.STORE_IO_ERROR
    return DTMError(code, f"process rank {doc.get('rank')} could not write its part of {step_dir}: "
                    f"{str(doc.get('message', ''))[:2000]}")


class Waiter:
    """Bounded waits for files in a step directory, ended early when `lost()` names a lost
    rank ((rank, notice) or None)."""

    def __init__(self, step_dir: str, timeout: float, lost: Callable[[], tuple[int, str] | None]):
        self.step_dir, self.timeout, self.lost = step_dir, timeout, lost
        self.place = Place.of(step_dir)

    def until(self, what: str, ready: Callable[[], bool]) -> None:
        """Return once `ready()`; E0802 after the timeout, E1001 when a rank is lost."""
        deadline = time.monotonic() + self.timeout
        pause = POLL_S[0]
        while not ready():
            gone = self.lost()
            if gone is not None:
                raise DTMError(ErrorCode.PEER_LOST, f"process rank {gone[0]} was lost while waiting for {what} in "
                               f"{self.step_dir}: {gone[1]}")
            if time.monotonic() > deadline:
                raise DTMError(ErrorCode.TIMEOUT, f"waited {self.timeout:.0f} s for {what} in {self.step_dir}")
            time.sleep(pause)
            pause = min(pause * 2, POLL_S[1])

    def statuses(self, world_size: int, items: int) -> list[dict]:
        """Every rank's status but rank 0's, in rank order, once all are there."""
        names = [status_name(r) for r in range(1, world_size)]
        self.until("every rank's status", lambda: all(self.place.exists(n) for n in names))
        return [checked_status(read_json(self.step_dir, n), r, items, f"{self.step_dir}/{n}")
                for r, n in enumerate(names, start=1)]

    def outcome(self) -> dict | None:
        """None once the manifest is there (committed), else the outcome rank 0 wrote; a
        step directory that vanished without either is a failure of rank 0's."""
        exists = self.place.exists
        self.until("the manifest or rank 0's outcome",
                   lambda: exists(mf.MANIFEST) or exists(OUTCOME) or not self.place.is_there())
        if exists(mf.MANIFEST):
            return None
        if exists(OUTCOME):
            return read_json(self.step_dir, OUTCOME)
        return {"rank": 0, "code": int(ErrorCode.STORE_IO_ERROR.value[1:]),
                "message": "the step directory was removed before a manifest or outcome was written"}
