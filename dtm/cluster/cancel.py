"""Cancelling a whole job (spec 9.4.10): the error every rank's operations end with, and the
request a client outside the mesh (`dtm cancel`) sends the coordinator.

    dtm.cancel("loss is nan")                 # any rank: every rank's operations end
    membership.cancel_job(("127.0.0.1", 29500), token, "out of time")   # the command line's

A cancel travels as an `Error` with code E1007 on the control connections: a rank's (or a
client's) request to the coordinator, which relays it once to every member, its `rank` the
rank that cancelled (-1: a client outside the mesh, "the command line") and its `message`
the reason. Neither side closes the connection for it, unlike any other `Error`.
"""

from __future__ import annotations

from ..errors import DTMError, ErrorCode as E
from ..protocol.messages import Error, cut_utf8
from ..protocol.payload import MAX_STR_BYTES

COMMAND_LINE = -1  # the `rank` of a cancel asked by a client outside the mesh


def canceller(by: int) -> str:
    """Who cancelled, in words: "rank 1" or "the command line"."""
    return "the command line" if by == COMMAND_LINE else f"rank {by}"


class Cancelled(DTMError):
    """E1007: the job was cancelled by `by` (a rank, or COMMAND_LINE) for `reason`; `op` is
    the operation of this rank that the cancel ended or refused ("" where none)."""

    def __init__(self, by: int, reason: str, op: str = ""):
        during = f"; it ended {op}" if op else ""
        super().__init__(E.JOB_CANCELLED, f"the job was cancelled by {canceller(by)}: {reason}{during}")
        self.by, self.reason, self.op = by, reason, op

    def during(self, op: str) -> "Cancelled":
        """The same cancel, naming the operation of this rank it ended."""
        return Cancelled(self.by, self.reason, op)


def notice(by: int, reason: str) -> Error:
    """The Error E1007 that asks for, or relays, a cancel by `by` for `reason`."""
    return Error(E.JOB_CANCELLED.value, cut_utf8(reason, MAX_STR_BYTES), by)


def is_cancel(msg: object) -> bool:
    return isinstance(msg, Error) and msg.code == E.JOB_CANCELLED.value
