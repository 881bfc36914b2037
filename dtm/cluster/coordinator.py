"""The coordinator (spec 9.6): admits ranks, assigns ranks and the epoch, publishes the
MeshView, and watches heartbeats.

    coord = Coordinator(world_size=4, token=b"...", port=29500).start()   # a thread
    ... ranks join ...
    coord.finished.wait(); coord.stop()

It runs as a thread of rank 0 (`dtm.init()` starts it there), of `dtm launch`, or alone
(`dtm coordinator`). One thread serves every connection from a selector:

- a new connection must finish the handshake (its cluster token proven) and send JoinMesh
  within `hello_timeout`; at most `max_pending` connections may be that far behind, and
  the oldest goes when another arrives, so a flood of connections that never say Hello
  holds a bounded amount of memory (each at most one control frame, 64 KiB);
- any fault of a frame or a message (9.1.3) drops that one connection with a logged reason;
  the others are served on;
- once `world_size` ranks have joined, every one of them gets the MeshView of epoch 1;
  if they have not all joined within `join_timeout`, every waiting rank gets an Error
  (E0802) naming the ranks that did not come, and the coordinator stops;
- a member is lost when its connection closes without Leave or it sends no Heartbeat for
  `timeout_ms`; every other member then gets an Error E1001 whose `rank` is the lost rank
  and whose message names it and its last operation. In a mesh of at most RELAY_MAX
  members heartbeats are relayed to every member (the sender included), so each rank sees
  its peers' figures and hears the coordinator at least once per interval; in a larger one
  (where relaying costs members^2 frames per interval) the coordinator sends each member a
  heartbeat of its own instead, four times per timeout, and a member's last operation
  reaches the others only in the notice of its loss. A Leave is relayed to the other members;
- a cancel (an Error E1007, spec 9.4.10) from a member, or from a connection that proved the
  token instead of joining (`dtm cancel`), is relayed once to every member (the first
  cancel counts; `cancelled` records it); the command line's connection then gets the same
  notice back, naming how many members heard it, and is closed. Members that join after it
  hear it right after the MeshView.
"""

from __future__ import annotations

import logging
import math
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import DTMError, ErrorCode as E
from ..protocol.frame import FLAG_RELAYED
from ..protocol.messages import MIN_MAX_PAYLOAD, Error, Heartbeat, JoinMesh, Leave, Member, MeshView, Message
from .cancel import COMMAND_LINE, canceller, is_cancel, notice
from .conn import Control, remote_error
from .heartbeat import HEARTBEAT_MS, TIMEOUT_MS, Figures, ProcessStats, heartbeat

log = logging.getLogger("dtm.cluster")

HELLO_TIMEOUT_S = 5.0      # a connection must prove the token and send JoinMesh within this
MAX_PENDING = 64           # connections that have not yet; past this the oldest is dropped
JOIN_TIMEOUT_S = 60.0      # all ranks must have joined within this of the coordinator's start
MAX_OUTBOX = 4 << 20       # bytes queued for a rank that does not read; past this it is lost
RELAY_MAX = 64             # members up to which every heartbeat is relayed to every member (spec 9.6.4)
BATCH_S = 0.01             # past RELAY_MAX members: how long the coordinator gathers frames before it serves them
OWN_BEAT_RANK = 0xFFFFFFFF  # the rank field of the coordinator's own heartbeat in a larger mesh
READ_SIZE = 64 << 10

# A connection's states, in order: proving the token, then sending JoinMesh, then waiting
# for the view with the other joined ranks, then a member; left and lost are final.
HELLO, JOINING, JOINED, MEMBER, LEFT, LOST = "hello", "joining", "joined", "member", "left", "lost"


@dataclass(frozen=True)
class RankStatus:
    rank: int
    state: str                  # joined, member, left or lost
    beat: Heartbeat | None      # the last heartbeat; None before the first
    age_s: float                # since it was last heard (inf before the view)
    name: str                   # "rank k (pid P at HOST:PORT)"


class _Conn:
    def __init__(self, sock: socket.socket, addr: str, control: Control, deadline: float):
        self.sock, self.addr, self.control, self.deadline = sock, addr, control, deadline
        self.state = HELLO
        self.join: JoinMesh | None = None
        self.rank = -1
        self.outbox = bytearray()
        self.writing = False  # registered for EVENT_WRITE
        self.last_heard = 0.0
        self.last_beat: Heartbeat | None = None
        self.closed = False
        self.failing: str | None = None  # why sending to it failed, until the coordinator settles it

    @property
    def name(self) -> str:
        if self.join is None:
            return self.addr
        rank = f"rank {self.rank}" if self.rank >= 0 else "a rank"
        return f"{rank} (pid {self.join.pid} at {self.join.host}:{self.join.port})"


class Coordinator:
    """See the module doc. `address` is where it listens; `formed` is set once the view is
    published, `finished` once the mesh has formed and every member has left or been lost,
    or formation failed (then `error` says why). `lost` maps lost ranks to the notice sent."""

    def __init__(self, world_size: int, token: bytes | str, *, host: str = "127.0.0.1", port: int = 0,
                 axes: Sequence[tuple[str, int]] = (), heartbeat_ms: int = HEARTBEAT_MS, timeout_ms: int = TIMEOUT_MS,
                 join_timeout: float = JOIN_TIMEOUT_S, host_rank: int = -1, max_pending: int = MAX_PENDING,
                 hello_timeout: float = HELLO_TIMEOUT_S, metrics: tuple[str, int] | None = None):
        if world_size < 1:
            raise DTMError(E.INVALID_MESH, f"a mesh needs at least one rank, the world size is {world_size}")
        axes = tuple((str(a), int(n)) for a, n in axes)
        if axes and math.prod(n for _, n in axes) != world_size:
            raise DTMError(E.INVALID_MESH, f"mesh axes {list(axes)} hold {math.prod(n for _, n in axes)} ranks, the "
                                           f"world size is {world_size}")
        if not 1 <= heartbeat_ms <= timeout_ms:
            raise DTMError(E.ATTRIBUTE_VALUE, f"heartbeat every {heartbeat_ms} ms with a timeout of {timeout_ms} ms: "
                                              "need 1 <= heartbeat <= timeout")
        self.world_size, self.axes = world_size, axes
        self.token = token.encode() if isinstance(token, str) else token
        self.heartbeat_ms, self.timeout_ms, self.join_timeout = heartbeat_ms, timeout_ms, join_timeout
        # a whole mesh may connect at once: that many may be in their handshake, or queued
        self.host_rank, self.max_pending, self.hello_timeout = host_rank, max(max_pending, world_size), hello_timeout
        try:
            self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host
                                                  else socket.AF_INET, backlog=max(128, world_size))
        except OSError as e:
            raise DTMError(E.NOT_INITIALIZED, f"the coordinator cannot listen at {host}:{port}: "
                                              f"{e.strerror or e}") from None
        self._listener.setblocking(False)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._pending: dict[_Conn, None] = {}   # HELLO and JOINING connections, oldest first
        self._slots: dict[int, _Conn] = {}      # joined ranks that asked for a rank, then all members
        self._unranked: list[_Conn] = []        # joined ranks that let the coordinator choose
        self.view: MeshView | None = None
        self.lost: dict[int, str] = {}
        self.lost_pids: dict[int, str] = {}     # the same notices by the process id each member joined with
        self.left: set[int] = set()
        self.cancelled: tuple[int, str] | None = None  # (who: a rank or COMMAND_LINE, reason) of the job's cancel
        self.error: DTMError | None = None
        self.formed, self.finished = threading.Event(), threading.Event()
        self.formed_at: float | None = None     # when the view of epoch 1 went out (wall clock)
        self.max_pending_seen = 0               # the most connections ever pending at once
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._join_deadline = math.inf
        self._next_scan = 0.0         # no member's heartbeat deadline comes before this (see _check_deadlines)
        self._failing: list[tuple[_Conn, str, bool]] = []  # connections to lose once the event is served
        self._next_own_beat = 0.0     # in a mesh larger than RELAY_MAX
        self._stats = ProcessStats()  # the figures of the coordinator's own heartbeat
        self.metrics = None  # the MetricsServer, when `metrics` names (host, port) to serve at
        if metrics is not None:
            from .metrics import MetricsServer  # prometheus_client only where metrics are served

            try:
                self.metrics = MetricsServer(self, host=metrics[0], port=metrics[1])
            except DTMError:
                self._listener.close()
                raise

    # --- running -----------------------------------------------------------------------------

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def last_heartbeats(self) -> dict[int, Heartbeat]:
        """The last Heartbeat of each rank that sent one (left and lost ranks included)."""
        return {r: c.last_beat for r, c in list(self._slots.items()) if c.last_beat is not None}

    def ranks(self) -> list[RankStatus]:
        """Every rank that joined, by rank: its state, last Heartbeat and how long ago it was
        heard (what the metrics endpoint serves; read from another thread)."""
        now = time.monotonic()
        return [RankStatus(r, c.state, c.last_beat, now - c.last_heard if c.last_heard else math.inf, c.name)
                for r, c in sorted(list(self._slots.items()))]

    def start(self) -> "Coordinator":
        """Serve on a daemon thread."""
        self._thread = threading.Thread(target=self.serve, name="dtm-coordinator", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close every connection."""
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self.metrics is not None:
            self.metrics.stop()

    def serve(self) -> None:
        """Serve until the mesh is finished, formation fails, or `stop`."""
        self._join_deadline = time.monotonic() + self.join_timeout
        log.debug("coordinator: listening at %s:%d for %d rank(s)", *self.address, self.world_size)
        try:
            while not self._stopping and not self.finished.is_set():
                wait = max(0.0, min(self._next_deadline() - time.monotonic(), 1.0))
                if self.world_size > RELAY_MAX and wait > 0:
                    # Many members' frames come one by one: gathered for a moment, each look
                    # serves dozens (a look, not a frame, is most of the cost); a frame waits
                    # BATCH_S at most, against heartbeat timeouts of seconds.
                    time.sleep(min(wait, BATCH_S))
                    wait = 0.0 if wait <= BATCH_S else wait - BATCH_S
                for key, events in self._sel.select(wait):
                    if key.data is None:
                        self._accept()
                    elif key.data == "wake":
                        self._wake_r.recv(64)
                    else:
                        self._ready(key.data, events)
                    self._settle()
                self._check_deadlines(time.monotonic())
                self._settle()
        finally:
            for c in list(self._pending) + list(self._slots.values()) + self._unranked:
                self._close(c)
            self._sel.close()
            self._listener.close()
            self._wake_r.close()
            self._wake_w.close()
            self.finished.set()
            if self.metrics is not None:
                self.metrics.stop()

    def _ready(self, c: _Conn, events: int) -> None:
        try:
            if events & selectors.EVENT_WRITE:
                self._flush(c)
            if events & selectors.EVENT_READ and not c.closed:
                self._read(c)
        except DTMError as err:  # ProtocolError included: this connection broke the protocol
            self._fault(c, err)

    # --- connections -------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of file descriptors: the pending cap frees some
                log.warning("coordinator: accept failed: %s", e)
                return
            sock.setblocking(False)
            if len(self._pending) >= self.max_pending:
                oldest = next(iter(self._pending))
                self._drop(oldest, f"more than {self.max_pending} connections have not joined yet; the oldest goes")
            name = f"{addr[0]}:{addr[1]}"
            control = Control("accept", self.token, rank=self.host_rank, name=f"coordinator at {self.address[0]}:"
                              f"{self.address[1]}", max_payload=MIN_MAX_PAYLOAD, peer=name)
            c = _Conn(sock, name, control, time.monotonic() + self.hello_timeout)
            self._pending[c] = None
            self.max_pending_seen = max(self.max_pending_seen, len(self._pending))
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            return self._gone(c, f"reading failed: {e.strerror or e}")
        if not data:
            try:
                c.control.decoder.close()  # E0905 when it ended inside a frame
            except DTMError as err:
                return self._fault(c, err)
            return self._gone(c, "its connection closed without Leave: the process ended or was killed")
        reply, messages = c.control.feed(data)
        if reply:
            self._send(c, reply)
        if c.state == HELLO and c.control.ready:
            c.state = JOINING
        for msg in messages:
            if c.closed:
                return
            self._message(c, msg)

    def _message(self, c: _Conn, msg: Message) -> None:
        if is_cancel(msg) and c.state in (JOINING, MEMBER):
            return self._cancel(c, msg.message)
        if isinstance(msg, Error):
            raise remote_error(msg, c.name)
        if c.state == JOINING and isinstance(msg, JoinMesh):
            return self._join(c, msg)
        if c.state == MEMBER and isinstance(msg, Heartbeat):
            return self._beat(c, msg)
        if c.state in (JOINED, MEMBER) and isinstance(msg, Leave):
            return self._leave(c, msg)
        want = {JOINING: "JoinMesh", JOINED: "nothing until the MeshView", MEMBER: "Heartbeat or Leave"}[c.state]
        raise DTMError(E.UNEXPECTED_MESSAGE, f"a {msg.TYPE.name} message; expected {want}")

    def _send(self, c: _Conn, data: bytes) -> None:
        if c.failing is not None:
            return
        c.outbox += data
        self._flush(c)
        if not c.closed and c.failing is None and len(c.outbox) > MAX_OUTBOX:
            self._fail_later(c, f"it did not read the {len(c.outbox)} bytes queued for it", drain=False)

    def _flush(self, c: _Conn) -> None:
        if c.closed or c.failing is not None:
            return
        try:
            n = c.sock.send(c.outbox) if c.outbox else 0
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as e:
            return self._fail_later(c, f"sending failed: {e.strerror or e}", drain=True)
        del c.outbox[:n]
        if bool(c.outbox) != c.writing:  # wait for room only while something is queued
            c.writing = bool(c.outbox)
            self._sel.modify(c.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if c.writing else 0), c)

    def _fail_later(self, c: _Conn, why: str, *, drain: bool) -> None:
        """Sending to `c` failed, or it reads too slowly: it is lost once the event in hand
        is served (`_settle`), not inside this send. A loss is told to every member, and a
        member whose send fails in turn would nest its loss in the first, as deep as the
        number of members gone at once (a host, a whole job's teardown)."""
        c.failing = why
        c.outbox.clear()
        self._failing.append((c, why, drain))

    def _settle(self) -> None:
        """The connections `_fail_later` queued, one after another (each may queue more)."""
        while self._failing:
            c, why, drain = self._failing.pop(0)
            if c.closed:
                continue
            if drain:
                self._broken(c, why)
            else:
                self._gone(c, why)

    def _broken(self, c: _Conn, why: str) -> None:
        """Sending to `c` failed; what it sent before it went (a Leave, say) still counts."""
        try:
            while not c.closed:
                data = c.sock.recv(READ_SIZE)
                if not data:
                    break
                for msg in c.control.feed(data)[1]:
                    if not c.closed:
                        self._message(c, msg)
        except (OSError, DTMError):
            pass
        if not c.closed:
            self._gone(c, why)

    def _close(self, c: _Conn) -> None:
        if c.closed:
            return
        c.closed = True
        self._pending.pop(c, None)
        try:
            self._sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()

    def _say_and_close(self, c: _Conn, err: DTMError) -> None:
        """Best effort: queue an Error for the peer, push once, close."""
        try:
            c.outbox += c.control.error_frame(err)
            c.sock.send(c.outbox)
        except (OSError, DTMError, ValueError):
            pass
        self._close(c)

    def _drop(self, c: _Conn, reason: str) -> None:
        """End a connection that is not a member, with a logged reason."""
        log.warning("coordinator: dropped the connection from %s: %s", c.name, reason)
        if c in self._unranked:
            self._unranked.remove(c)
        if c.rank < 0 and c.join is not None and self._slots.get(c.join.rank) is c:
            del self._slots[c.join.rank]
        self._close(c)

    def _fault(self, c: _Conn, err: DTMError) -> None:
        """`c` broke the protocol or reported an error: end it, telling it why."""
        self._say_and_close(c, err)
        if c.state == MEMBER:
            self._lose(c, f"its connection broke the protocol: {err}")
        else:
            self._drop(c, str(err))

    def _gone(self, c: _Conn, why: str) -> None:
        if c.state == MEMBER:
            self._lose(c, why)
        elif c.state in (HELLO, JOINING, JOINED):
            self._drop(c, why)

    # --- membership --------------------------------------------------------------------------

    def _join(self, c: _Conn, j: JoinMesh) -> None:
        n = self.world_size
        taken = next((o for o in list(self._slots.values()) + self._unranked
                      if (o.join.host, o.join.port) == (j.host, j.port)), None)
        asked = f"rank {j.rank}" if j.rank >= 0 else "any rank"
        problem = None
        if self.view is not None:
            problem = f"the mesh of {n} ranks formed already (epoch {self.view.epoch}); it takes no new members"
        elif j.world_size not in (0, n):
            problem = f"it expects a world of {j.world_size} ranks, this coordinator forms one of {n}"
        elif j.rank >= n:
            problem = f"rank {j.rank} is not below the world size {n}"
        elif j.rank >= 0 and j.rank in self._slots:
            problem = f"rank {j.rank} is taken by {self._slots[j.rank].name}"
        elif taken is not None:
            problem = f"its address {j.host}:{j.port} is that of {taken.name}"
        elif len(self._slots) + len(self._unranked) >= n:
            problem = f"all {n} ranks have joined"
        if problem:
            err = DTMError(E.JOIN_REFUSED, f"{c.addr} (pid {j.pid}) asked to join as {asked}: {problem}")
            log.warning("coordinator: refused a JoinMesh: %s", err)
            return self._say_and_close(c, err)
        c.join, c.state = j, JOINED
        self._pending.pop(c, None)
        if j.rank >= 0:
            self._slots[j.rank] = c
        else:
            self._unranked.append(c)
        joined = len(self._slots) + len(self._unranked)
        log.info("coordinator: %s joined as %s (%d of %d)", c.addr, asked, joined, n)
        if joined == n:
            self._publish()

    def _publish(self) -> None:
        free = (r for r in range(self.world_size) if r not in self._slots)
        for c in self._unranked:
            self._slots[next(free)] = c
        self._unranked.clear()
        members = []
        for r in range(self.world_size):
            c = self._slots[r]
            c.rank = r
            members.append(Member(c.join.host, c.join.port, c.join.node))
        self.view = MeshView(1, self.heartbeat_ms, self.timeout_ms, tuple(members), self.axes)
        self.formed.set()
        now = time.monotonic()
        for c in self._slots.values():
            c.state, c.last_heard = MEMBER, now
            c.control.epoch = c.control.decoder.expected_epoch = self.view.epoch
            self._send(c, c.control.encode(self.view))
            if self.cancelled is not None:
                self._send(c, c.control.encode(notice(*self.cancelled)))
        self.formed_at = time.time()
        log.info("coordinator: the mesh of %d rank(s) formed (epoch %d)", self.world_size, self.view.epoch)

    def _beat(self, c: _Conn, hb: Heartbeat) -> None:
        if hb.rank != c.rank:
            raise DTMError(E.UNEXPECTED_MESSAGE, f"a Heartbeat for rank {hb.rank} on the connection of rank {c.rank}")
        c.last_beat, c.last_heard = hb, time.monotonic()  # its worker rows too: kept per rank for the metrics
        if not self._relays():
            return
        relayed = hb.without_workers()  # members want a peer's last operation, not its helpers (spec 9.6.4)
        for o in self._members():
            self._send(o, o.control.encode(relayed, flags=FLAG_RELAYED))

    def _relays(self) -> bool:
        """Whether members' heartbeats are relayed to every member (spec 9.6.4): in a mesh of
        at most RELAY_MAX members; in a larger one the coordinator beats on its own."""
        return self.view is not None and len(self.view.members) <= RELAY_MAX

    def _own_beat(self, now: float) -> None:
        """Four times per timeout_ms, to every member of a mesh too large to relay: a
        heartbeat of the coordinator's own (rank OWN_BEAT_RANK), so that none takes the
        coordinator for lost (it would after timeout_ms of silence); no more often than
        the members beat."""
        self._next_own_beat = now + max(self.heartbeat_ms, self.timeout_ms / 4) / 1000
        beat = heartbeat(OWN_BEAT_RANK, self._stats, Figures())
        for o in self._members():
            self._send(o, o.control.encode(beat, flags=FLAG_RELAYED))

    def _leave(self, c: _Conn, msg: Leave) -> None:
        if c.state == JOINED:  # before the view: its place is free again
            return self._drop(c, f"it left before the mesh formed: {msg.reason}")
        c.state = LEFT
        self.left.add(c.rank)
        log.info("coordinator: %s left the mesh: %s", c.name, msg.reason)
        self._close(c)
        for o in self._members():  # so that they do not wait for a notice about it
            self._send(o, o.control.encode(msg, flags=FLAG_RELAYED))
        self._check_finished()

    def _cancel(self, c: _Conn, reason: str) -> None:
        """A member, or a client outside the mesh (a connection that proved the token and
        did not join), cancels the job: every member hears it once (spec 9.4.10)."""
        by = c.rank if c.state == MEMBER else COMMAND_LINE
        if self.cancelled is None:
            self.cancelled = (by, reason)
            log.warning("coordinator: the job was cancelled by %s: %s", canceller(by), reason)
            for o in self._members():
                self._send(o, o.control.encode(notice(by, reason)))
        if by == COMMAND_LINE:
            first_by, first_reason = self.cancelled
            heard = f"{len(self._members())} of {self.world_size} ranks heard it" if self.view is not None else \
                "the mesh has not formed yet: each rank hears it when it does"
            ack = f"the job was cancelled by {canceller(first_by)}: {first_reason}; {heard}"
            self._say_and_close(c, DTMError(E.JOB_CANCELLED, ack))

    def _lose(self, c: _Conn, why: str) -> None:
        c.state = LOST
        self._close(c)
        last = c.last_beat.last_op if c.last_beat is not None and c.last_beat.last_op else "none reported"
        notice = DTMError(E.PEER_LOST, f"the coordinator lost {c.name}: {why}; its last operation was {last}")
        self.lost[c.rank] = notice.message
        if c.join is not None:
            self.lost_pids[c.join.pid] = notice.message
        log.warning("coordinator: %s", notice.message)
        lost = Error.from_exception(notice, c.rank)
        for o in self._members():
            self._send(o, o.control.encode(lost))
        self._check_finished()

    def _members(self) -> list[_Conn]:
        return [c for c in self._slots.values() if c.state == MEMBER and not c.closed]

    def _check_finished(self) -> None:
        if self.view is not None and not self._members():
            log.info("coordinator: every rank has left or was lost (%d lost)", len(self.lost))
            self.finished.set()

    # --- time ----------------------------------------------------------------------------------

    def _next_deadline(self) -> float:
        oldest = next(iter(self._pending), None)  # the oldest pending has the earliest deadline
        times = [oldest.deadline] if oldest is not None else []
        if self.view is None:
            times.append(self._join_deadline)
        elif not self._relays():
            times.append(self._next_own_beat)
        times.append(self._next_scan)
        return min(times, default=math.inf)

    def _check_deadlines(self, now: float) -> None:
        for c in [c for c in self._pending if c.deadline <= now]:
            self._drop(c, f"it did not prove the cluster token and send JoinMesh within {self.hello_timeout:g} s")
        if self.view is None and now >= self._join_deadline:
            return self._formation_failed()
        if self.view is not None and not self._relays() and now >= self._next_own_beat:
            self._own_beat(now)
        if now < self._next_scan:  # no member can be silent too long yet: no look at each (a mesh may be large)
            return
        members = self._members()
        for c in members:
            silent = now - c.last_heard
            if silent > self.timeout_ms / 1000:
                self._lose(c, f"no Heartbeat for {silent:.1f} s (the limit is {self.timeout_ms / 1000:g} s): the "
                              "process is stuck or its host unreachable")
        # A member's last_heard only grows, and one that becomes a member later hears from now
        # on: none can pass its deadline before this.
        self._next_scan = min([c.last_heard for c in members if not c.closed] + [now]) + self.timeout_ms / 1000

    def _formation_failed(self) -> None:
        joined = sorted(self._slots)
        free = [r for r in range(self.world_size) if r not in self._slots]
        n_missing = self.world_size - len(joined) - len(self._unranked)
        who = ", ".join(map(str, free)) if not self._unranked else \
            f"{n_missing} of ranks {', '.join(map(str, free))} ({len(self._unranked)} joined without a rank)"
        self.error = DTMError(E.TIMEOUT, f"the mesh did not form within {self.join_timeout:g} s: "
                                         f"{len(joined) + len(self._unranked)} of {self.world_size} ranks joined; "
                                         f"missing: rank(s) {who}")
        log.warning("coordinator: %s", self.error.message)
        self.finished.set()
        for c in list(self._slots.values()) + self._unranked:
            self._say_and_close(c, self.error)
