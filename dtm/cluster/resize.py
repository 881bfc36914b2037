"""Live mesh resize, the coordinator's side (spec 9.6.7): an elastic job's coordinator
publishes a MeshView of a higher epoch when a member is lost or ranks wait to join.

    coord = ElasticCoordinator(4, token, axes=(("dp", 2), ("tp", 2)), elastic=(2, 8)).start()

The walk of one resize (the ranks' side is dtm/elastic):

1. A trigger: a member is lost (its E1001 notice goes out as in 9.6.4), or a process joins
   a mesh that has formed and the policy would give the mesh more ranks with it; then every
   member hears a resize notice (an `Error` E1009 that closes nothing, as a cancel's E1007).
2. Each member, at its next step boundary, sends `JoinMesh` again on its control connection
   (a **rejoin**): its new data address, its current rank as `rank`, world size 0.
3. Once every live member has rejoined (members that do not within `resize_timeout` are
   lost), the coordinator chooses the new shape (`shape_for`): the axes give way in the
   policy's order (DP first by default) to fit the ranks there are, up to `elastic`'s
   maximum; fewer than its minimum ends the job: every waiting rank gets E1010 naming the
   ranks. Members keep their order and come first, then joiners in the order they came;
   a member the new shape has no place for is told so (E1004) and ends.
4. The coordinator sends the chosen ranks the MeshView of epoch E+1; from then on it
   refuses their frames of epoch E (stale, 9.1.7). The ranks connect anew and move the
   training state between them (dtm/elastic).

When the coordinator itself is lost, the members agree on it at a step boundary and rank 0
starts a successor (`ElasticCoordinator.successor`) from the view of epoch E and the job's
policy (DTM_ELASTIC*, cluster/env.py); every member reconnects to it and rejoins, and the
successor publishes epoch E+1 as after any resize (spec 9.6.7, "Succession").
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

from ..errors import DTMError, ErrorCode as E
from ..protocol.messages import Error, Heartbeat, JoinMesh, Member, MeshView, Message
from .coordinator import JOINED, LOST, MEMBER, Coordinator, _Conn
from .env import ElasticPolicy

log = logging.getLogger("dtm.cluster")

RESIZE_TIMEOUT_S = 30.0  # every live member rejoins within this of the resize's start


def give_way_order(axes: Sequence[tuple[str, int]], first: Sequence[str] = ()) -> tuple[str, ...]:
    """The order in which axes shrink: those named in `first`, then `dp` (data parallel
    gives way before the model's axes), then the rest from the last one back."""
    names = [a for a, _ in axes]
    unknown = [a for a in first if a not in names]
    if unknown:
        raise DTMError(E.UNKNOWN_MESH_AXIS, f"the resize policy names axes {unknown}; the mesh's are {names}")
    rest = [a for a in (["dp"] if "dp" in names else []) + names[::-1] if a not in first]
    return tuple(dict.fromkeys([*first, *rest]))


def shape_for(axes: Sequence[tuple[str, int]], ranks: int, order: Sequence[str], most: int | None = None) -> \
        tuple[tuple[str, int], ...]:
    """The mesh shape for `ranks` available ranks (at most `most` used): the first axis of
    `order` takes whatever size fits with the others at their size in `axes`; where even
    size 1 does not fit, it is 1 and the next axis of `order` gives way too. Grows along
    the first axis alone. No axes: one flat axis of every rank."""
    n = min(ranks, most) if most is not None else ranks
    if n < 1:
        raise DTMError(E.INVALID_MESH, f"a mesh needs at least one rank, {ranks} are there")
    if not axes:
        return ()
    sizes = dict(axes)
    for name in order:
        others = math.prod(s for a, s in sizes.items() if a != name)
        if others <= n:
            sizes[name] = n // others
            break
        sizes[name] = 1
    return tuple((a, sizes[a]) for a, _ in axes)


class ElasticCoordinator(Coordinator):
    """A Coordinator whose mesh outlives its members (see the module doc). `elastic` is
    (fewest, most) ranks; `give_way` the axes that shrink first (give_way_order)."""

    def __init__(self, world_size: int, token: bytes | str, *, elastic: tuple[int, int],
                 give_way: Sequence[str] = (), resize_timeout: float = RESIZE_TIMEOUT_S, **kw):
        super().__init__(world_size, token, **kw)
        least, most = elastic
        if not 1 <= least <= most:
            raise DTMError(E.ATTRIBUTE_VALUE, f"an elastic job runs MIN:MAX ranks with 1 <= MIN <= MAX, not "
                           f"{least}:{most}")
        if not least <= world_size <= most:
            raise DTMError(E.ATTRIBUTE_VALUE, f"{world_size} ranks at the start is outside the elastic range "
                           f"{least}:{most}")
        self.least, self.most = least, most
        self.base_axes = self.axes
        self.order = give_way_order(self.axes, give_way)
        self.resize_timeout = resize_timeout
        self.epoch = 0
        self.resizes: list[str] = []        # what each resize did, for the launcher's report
        self.views: list[MeshView] = []     # every epoch's view (the launcher removes their segments)
        self._waiting: list[_Conn] = []     # processes that joined the formed mesh, in order
        self._rejoined: dict[_Conn, JoinMesh] = {}
        self._resize_deadline = math.inf   # set while a resize is in progress
        self._absent: set[int] | None = None  # a successor: the ranks of epoch E yet to reconnect

    @classmethod
    def successor(cls, view: MeshView, token: bytes | str, policy: ElasticPolicy, *, host: str, host_rank: int,
                  resize_timeout: float = RESIZE_TIMEOUT_S) -> "ElasticCoordinator":
        """The coordinator that a member starts when the job's own is lost (spec 9.6.7,
        "Succession"), not yet serving: it takes the mesh of `view` (epoch E) as formed,
        waits at most `resize_timeout` s for each member to reconnect and rejoin (one that
        does not is lost), then publishes epoch E+1 as after any resize, by `policy`."""
        c = cls(len(view.members), token, host=host, axes=view.axes, heartbeat_ms=view.heartbeat_ms,
                timeout_ms=view.timeout_ms, host_rank=host_rank, elastic=(policy.least, policy.most),
                resize_timeout=resize_timeout)
        c.base_axes = policy.axes or c.axes  # the shapes come from the job's first view, as the lost one's did
        c.order = give_way_order(c.base_axes, policy.give_way)
        c.view, c.epoch, c.views = view, view.epoch, [view]
        c.formed.set()
        c._absent = set(range(len(view.members)))
        c._resize_deadline = time.monotonic() + resize_timeout
        return c

    def _publish(self) -> None:
        super()._publish()
        self.epoch = self.view.epoch
        self.views.append(self.view)

    # --- triggers ---------------------------------------------------------------------------

    def _join(self, c: _Conn, j: JoinMesh) -> None:
        if self.view is None:
            return super()._join(c, j)
        if self._absent is not None and j.rank >= 0:
            return self._reconnect(c, j)
        if j.world_size != 0 or j.rank >= 0:
            err = DTMError(E.JOIN_REFUSED, f"{c.addr} (pid {j.pid}) asked to join the running elastic mesh as rank "
                           f"{j.rank} of {j.world_size}: a rank that joins a running mesh asks for none (-1, 0)")
            return self._say_and_close(c, err)
        c.join, c.state = j, JOINED
        self._pending.pop(c, None)
        self._waiting.append(c)
        log.info("coordinator: %s waits to join the mesh of epoch %d", c.addr, self.epoch)
        if self._resizing or self._grows():
            self._begin(f"{len(self._waiting)} rank(s) wait to join")

    def _grows(self) -> bool:
        """Whether the waiting ranks would make the mesh larger."""
        have = len(self._members())
        return self._shape(have + len(self._waiting))[1] > have

    def _shape(self, ranks: int) -> tuple[tuple[tuple[str, int], ...], int]:
        """The axes and the number of ranks of the mesh for `ranks` available ones."""
        axes = shape_for(self.base_axes, ranks, self.order, self.most)
        return axes, math.prod(n for _, n in axes) if axes else min(ranks, self.most)

    def _lose(self, c: _Conn, why: str) -> None:
        self._rejoined.pop(c, None)
        super()._lose(c, why)
        if self.view is not None and not self.finished.is_set():
            self._begin(f"rank {c.rank} was lost")

    def _message(self, c: _Conn, msg: Message) -> None:
        if c.state == MEMBER and isinstance(msg, JoinMesh):
            return self._rejoin(c, msg)
        if c.state == JOINED and isinstance(msg, Heartbeat):
            return  # a rank the last resize left waiting: nothing to relay
        return super()._message(c, msg)

    @property
    def _resizing(self) -> bool:
        return self._resize_deadline < math.inf

    def _begin(self, why: str) -> None:
        """Start a resize (or extend one in progress): every member hears the notice."""
        if not self._resizing:
            self._resize_deadline = time.monotonic() + self.resize_timeout
            log.warning("coordinator: resizing the mesh of epoch %d: %s", self.epoch, why)
            notice = Error.from_exception(DTMError(E.RESIZE, f"the mesh of epoch {self.epoch} resizes: {why}; "
                                                   "rejoin at the next step boundary"), -1)
            for o in self._members():
                self._send(o, o.control.encode(notice))
        self._check_rejoined()

    def _record_rejoin(self, c: _Conn, j: JoinMesh) -> None:
        """`c` rejoins at `j`'s address: E1004 when another rank rejoined at that address."""
        taken = [o for o, k in self._rejoined.items() if (k.host, k.port) == (j.host, j.port) and o is not c]
        if taken:
            raise DTMError(E.JOIN_REFUSED, f"rejoin at {j.host}:{j.port}, the address of {taken[0].name}")
        self._rejoined[c] = j

    def _rejoin(self, c: _Conn, j: JoinMesh) -> None:
        self._record_rejoin(c, j)
        if not self._resizing:
            self._begin(f"rank {c.rank} asked to")
        else:
            self._check_rejoined()

    def _reconnect(self, c: _Conn, j: JoinMesh) -> None:
        """A successor: member `j.rank` of epoch E reconnects and rejoins in one JoinMesh.
        It holds its rank (state JOINED: no heartbeats are due) until the view."""
        if j.world_size != 0 or j.rank not in self._absent:
            err = DTMError(E.JOIN_REFUSED, f"{c.addr} (pid {j.pid}) asked to rejoin as rank {j.rank} of the mesh of "
                           f"epoch {self.epoch}, whose successor coordinator waits for rank(s) "
                           f"{sorted(self._absent)} (each rejoining with world size 0)")
            return self._say_and_close(c, err)
        self._record_rejoin(c, j)
        self._absent.discard(j.rank)
        c.join, c.rank, c.state = j, j.rank, JOINED
        self._pending.pop(c, None)
        self._slots[j.rank] = c
        log.info("coordinator: rank %d of epoch %d reconnected to the successor (%d still to come)", j.rank,
                 self.epoch, len(self._absent))
        self._check_rejoined()

    # --- the new view -----------------------------------------------------------------------

    def _check_rejoined(self) -> None:
        if self._absent is not None:  # a successor publishes once every member of epoch E is back or late
            if not self._absent:
                self._absent = None
                back = sorted((c for c in self._rejoined if not c.closed), key=lambda c: c.rank)
                if not back:
                    return self._cannot_resize(list(self._waiting), "no member reconnected to the successor")
                self._publish_resized(back)
            return
        live = self._members()
        if self._resizing and not live:  # nobody holds the state any more: joiners alone cannot go on
            self._cannot_resize(list(self._waiting), "every member was lost while it resized")
        elif self._resizing and all(c in self._rejoined for c in live):
            self._publish_resized(live)

    def _publish_resized(self, live: list[_Conn]) -> None:
        members = sorted(live, key=lambda c: c.rank) + list(self._waiting)
        old = {id(c): c.rank for c in live}
        if len(members) < self.least:
            return self._cannot_resize(members, f"{len(members)} rank(s) are left, the job needs at least "
                                                f"{self.least}")
        axes, size = self._shape(len(members))
        chosen, spare = members[:size], members[size:]
        self.epoch += 1
        view = MeshView(self.epoch, self.heartbeat_ms, self.timeout_ms,
                        tuple(Member(self._address(c).host, self._address(c).port, self._address(c).node)
                              for c in chosen), axes)
        self.view, self.axes, self.world_size = view, axes, size
        self.views.append(view)
        self._slots = {r: c for r, c in enumerate(chosen)}
        # recorded before any rank has the view, so whoever watches the coordinator (the
        # launcher's report, a test) knows of the resize before a rank can act on it
        moved = ", ".join(f"{old[id(c)]}->{r}" if id(c) in old else f"new->{r}" for r, c in enumerate(chosen))
        said = f"epoch {self.epoch}: {dict(axes) or size} ({moved})" + (f"; {len(spare)} spare ended" if spare else "")
        self.resizes.append(said)
        now = time.monotonic()
        for r, c in enumerate(chosen):
            c.join, c.rank, c.state, c.last_heard = self._address(c), r, MEMBER, now
            c.control.epoch = c.control.decoder.expected_epoch = view.epoch
            self._send(c, c.control.encode(view))
        for c in spare:
            self._say_and_close(c, DTMError(E.JOIN_REFUSED, f"the mesh of epoch {self.epoch} ({dict(axes)}) has no "
                                            f"place for {c.name}: {len(members)} ranks for {size} places; it ends"))
        log.warning("coordinator: the mesh resized to %s", said)
        self._waiting.clear()
        self._rejoined.clear()
        self._resize_deadline = math.inf

    def _address(self, c: _Conn) -> JoinMesh:
        """Where a rank of the next view is reached: its rejoin's address, or its join's."""
        return self._rejoined.get(c, c.join)

    def _cannot_resize(self, members: list[_Conn], why: str) -> None:
        ranks = ", ".join(c.name for c in members) or "none"
        self.error = DTMError(E.RESIZE_FAILED, f"the mesh of epoch {self.epoch} cannot resize: {why} (ranks "
                                               f"there: {ranks}; lost: {sorted(self.lost)})")
        log.warning("coordinator: %s", self.error.message)
        for c in members:
            c.state = LOST  # (ended by the coordinator: not lost again as it closes)
            self._say_and_close(c, self.error)
        self._resize_deadline = math.inf
        self.finished.set()

    # --- time and the end -------------------------------------------------------------------

    def _next_deadline(self) -> float:
        return min(super()._next_deadline(), self._resize_deadline)

    def _check_deadlines(self, now: float) -> None:
        super()._check_deadlines(now)
        if self._absent is not None and now >= self._resize_deadline:
            for r in sorted(self._absent):
                self.lost[r] = f"rank {r} of epoch {self.epoch} did not reconnect to the successor coordinator " \
                               f"within {self.resize_timeout:g} s"
                log.warning("coordinator: %s", self.lost[r])
            self._absent.clear()
            return self._check_rejoined()
        if self._resizing and now >= self._resize_deadline:
            late = [c for c in self._members() if c not in self._rejoined]
            self._resize_deadline = now + self.resize_timeout  # (each loss restarts the wait of the others)
            for c in late:
                self._lose(c, f"it did not rejoin the resizing mesh within {self.resize_timeout:g} s")
            self._check_rejoined()

    def _check_finished(self) -> None:
        if self._resizing:  # the resize ends in a view or in E1010 (_check_rejoined)
            return
        if self.view is not None and not self._members():
            for c in self._waiting:
                self._say_and_close(c, DTMError(E.RESIZE_FAILED, f"the mesh finished (every member left) while "
                                                f"{c.name} waited to join"))
            self._waiting.clear()
        super()._check_finished()

    def _drop(self, c: _Conn, reason: str) -> None:
        if c in self._waiting:
            self._waiting.remove(c)
        if self._rejoined.pop(c, None) is not None:  # a successor's member that went before the view
            self._slots.pop(c.rank, None)
            self.lost[c.rank] = f"{c.name} went before the successor's view: {reason}"
        super()._drop(c, reason)


__all__ = ["ElasticCoordinator", "give_way_order", "shape_for", "RESIZE_TIMEOUT_S"]
