"""A rank's side of membership (spec 9.6): join the mesh through the coordinator, then keep
a heartbeat thread that reports this rank's figures and hears about lost peers.

    m, listener = join(("127.0.0.1", 29500), token, rank=-1, world_size=4, timeout=60)
    m.start(figures)           # heartbeats from now on
    ... m.view, m.rank; m.watch_lost(lambda rank, message: ...)
    m.leave("done")

`join` connects (retrying while the coordinator is not up yet), proves the token, opens this
rank's data listener on the address it reaches the coordinator from, sends JoinMesh with
that address, and returns once the MeshView arrives; its rank is the index of its address in
the view. Every wait is bounded by `timeout`; an Error from the coordinator (a refused join,
a mesh that did not form in time, naming the missing ranks) is raised with its code.

The heartbeat thread owns the control connection from `start` to `leave`. It sends a
Heartbeat every `heartbeat_ms`, records the relayed heartbeats of every member (`peers`; in a
mesh of at most 64: a larger one's coordinator relays none, spec 9.6.4) and
the coordinator's E1001 notices (`lost`, then each function given to `watch_lost` is called
with (rank, message) on that thread, so that whatever waits for the lost rank is woken: the
collectives' transport and the mesh's store each watch). A coordinator that is silent for
`timeout_ms` while it runs inside a rank (its Hello names that rank) counts as that rank
lost, and so does one that closes its connection before that rank said Leave; otherwise
losing the coordinator only ends failure detection on this rank.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable

from ..comm.tcp import listen
from ..errors import DTMError, ErrorCode as E
from ..protocol.caps import Cap
from ..protocol.errors import ProtocolError
from ..protocol.messages import MIN_MAX_PAYLOAD, Error, Heartbeat, JoinMesh, Leave, MeshView, Message
from .cancel import COMMAND_LINE, Cancelled, is_cancel, notice
from .conn import Control, remote_error
from .heartbeat import Figures, FiguresFn, ProcessStats, detection_bound, heartbeat

log = logging.getLogger("dtm.cluster")

VIEW_MAX_PAYLOAD = 16 << 20  # the largest control frame a rank takes from its coordinator (a MeshView)
VIEW_GRACE_S = 2.0  # a rank waits this much longer than the coordinator's own formation timeout
RETRY_S = 0.05
CANCEL_TIMEOUT_S = 10.0  # `dtm cancel`: reaching the coordinator and hearing its answer


def node_id() -> str:
    """Equal on ranks of one host and one boot, so that they may share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}" if boot else socket.gethostname()


def _dial(address: tuple[str, int], deadline: float, start: float, during: str = "joining the mesh") -> socket.socket:
    """Connect to the coordinator, retrying until `deadline` (it may not listen yet)."""
    why = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DTMError(E.TIMEOUT, f"{during}: could not reach the coordinator at {address[0]}:"
                                      f"{address[1]} in {time.monotonic() - start:.1f} s: {why}")
        try:
            sock = socket.create_connection(address, timeout=min(left, 5.0))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as e:
            why = e.strerror or str(e)
            time.sleep(min(RETRY_S, max(left, 0)))


class _Reader:
    """Blocking, deadline-bounded reads of messages from one control connection."""

    def __init__(self, sock: socket.socket, control: Control, who: str):
        self.sock, self.control, self.who = sock, control, who
        self.queue: list[Message] = []

    def next(self, deadline: float, start: float, during: str) -> Message | None:
        """The next message, or None once the handshake is done and nothing is queued."""
        while not self.queue:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DTMError(E.TIMEOUT, f"{during}: waited {time.monotonic() - start:.1f} s for {self.who}")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 16)
            except socket.timeout:
                continue
            except OSError as e:
                raise DTMError(E.PEER_LOST, f"{during}: {self.who}: {e.strerror or e}") from None
            if not data:
                raise DTMError(E.PEER_LOST, f"{during}: {self.who} closed the connection")
            ready = self.control.ready
            reply, messages = self.control.feed(data)
            if reply:
                self.sock.sendall(reply)
            self.queue += messages
            if not ready and self.control.ready and not self.queue:
                return None
        return self.queue.pop(0)


def _control(token: bytes, rank: int, who: str) -> Control:
    # The coordinator's MeshView lists every member: past MIN_MAX_PAYLOAD from about 1,300
    # of them. Once the coordinator has proven the token, frames up to VIEW_MAX_PAYLOAD are
    # taken (a view of some 25,000 members); before, MIN_MAX_PAYLOAD (Control).
    return Control("connect", token, rank=rank, name=f"{socket.gethostname()}:{os.getpid()}",
                   max_payload=VIEW_MAX_PAYLOAD, peer=who)


def _handshake(sock: socket.socket, control: Control, reader: "_Reader", deadline: float, start: float,
               during: str) -> None:
    """Prove the token to the coordinator and hear it prove its own."""
    sock.sendall(control.start())
    while not control.ready:
        msg = reader.next(deadline, start, f"{during} (handshake)")
        if msg is not None:
            raise DTMError(E.UNEXPECTED_MESSAGE, f"a {msg.TYPE.name} message during the handshake")


def _ask_view(sock: socket.socket, control: Control, reader: "_Reader", ask: JoinMesh, deadline: float, start: float,
              during: str) -> MeshView:
    """Send `ask` (a join or a rejoin) and wait for the MeshView that lists its address; the
    coordinator's Error (a refusal, its own formation timeout naming the missing ranks,
    which should arrive first) is raised."""
    sock.sendall(control.encode(ask))
    msg = reader.next(deadline + VIEW_GRACE_S, start, f"{during} as {ask.host}:{ask.port}, waiting for the view")
    if isinstance(msg, Error):
        raise remote_error(msg, reader.who)
    if not isinstance(msg, MeshView):
        raise DTMError(E.UNEXPECTED_MESSAGE, f"{reader.who} sent {msg.TYPE.name}; expected the MeshView")
    if (ask.host, ask.port) not in [(m.host, m.port) for m in msg.members]:
        raise DTMError(E.BAD_PAYLOAD, f"the MeshView from {reader.who} does not list this rank's address "
                                      f"{ask.host}:{ask.port}")
    return msg


def join(coordinator: tuple[str, int], token: bytes, *, rank: int = -1, world_size: int = 0, timeout: float,
         host: str | None = None) -> tuple["Membership", socket.socket]:
    """Join the mesh (see the module doc): the Membership, not yet started, and this rank's
    listening socket for its peers' data connections."""
    start = time.monotonic()
    deadline = start + timeout
    who = f"the coordinator at {coordinator[0]}:{coordinator[1]}"
    sock = _dial(coordinator, deadline, start)
    listener = None
    control = _control(token, rank, who)
    reader = _Reader(sock, control, who)
    try:
        _handshake(sock, control, reader, deadline, start, "joining the mesh")
        host = host or sock.getsockname()[0]
        listener = listen(host, 0)
        port = listener.getsockname()[1]
        msg = _ask_view(sock, control, reader, JoinMesh(rank, world_size, host, port, node_id(), os.getpid()),
                        deadline, start, "joining the mesh")
        me = [(m.host, m.port) for m in msg.members].index((host, port))
        if rank >= 0 and me != rank:
            raise DTMError(E.BAD_PAYLOAD, f"asked for rank {rank}, the MeshView from {who} lists this rank as {me}")
    except DTMError as err:
        if isinstance(err, ProtocolError):
            try:
                sock.sendall(control.error_frame(err))
            except OSError:
                pass
            err = err.at(who, "joining the mesh")
        sock.close()
        if listener is not None:
            listener.close()
        raise err from None
    control.epoch = control.decoder.expected_epoch = msg.epoch
    log.info("rank %d: joined the mesh of %d rank(s) (epoch %d)", me, len(msg.members), msg.epoch)
    return Membership(sock, control, msg, me, who, reader.queue), listener


def cancel_job(coordinator: tuple[str, int], token: bytes | str, reason: str,
               timeout: float = CANCEL_TIMEOUT_S) -> str:
    """Ask the coordinator at `coordinator` to cancel its job, as the command line (spec
    9.4.10); returns its acknowledgement, sent once it has relayed the cancel to every
    member. E1006 when it did not announce CAP_CANCEL; its own error (E0909: a wrong token)
    otherwise."""
    start = time.monotonic()
    deadline = start + timeout
    who = f"the coordinator at {coordinator[0]}:{coordinator[1]}"
    control = Control("connect", token.encode() if isinstance(token, str) else token, name="dtm cancel",
                      max_payload=MIN_MAX_PAYLOAD, peer=who)
    sock = _dial(coordinator, deadline, start, "cancelling the job")
    try:
        reader = _Reader(sock, control, who)
        _handshake(sock, control, reader, deadline, start, "cancelling the job")
        if not control.hs.peer.caps & Cap.CANCEL:
            raise DTMError(E.MISSING_CAPABILITY, f"{who} did not announce CAP_CANCEL: it cannot cancel its job")
        sock.sendall(control.encode(notice(COMMAND_LINE, reason)))
        reply = reader.next(deadline, start, "cancelling the job, waiting for the coordinator's answer")
    except ProtocolError as err:
        raise err.at(who, "cancelling the job") from None
    finally:
        sock.close()
    if not is_cancel(reply):
        raise remote_error(reply, who) if isinstance(reply, Error) else \
            DTMError(E.UNEXPECTED_MESSAGE, f"{who} answered a cancel with {reply.TYPE.name}")
    return reply.message


class Membership:
    """This rank in the mesh (see the module doc)."""

    def __init__(self, sock: socket.socket, control: Control, view: MeshView, rank: int, coordinator: str,
                 early: list[Message]):
        self.view, self.rank, self.world_size = view, rank, len(view.members)
        self.coordinator = coordinator
        host_rank = control.hs.peer.rank
        self.coordinator_rank = host_rank if 0 <= host_rank < self.world_size else -1
        self.heartbeat_s, self.timeout_s = view.heartbeat_ms / 1000, view.timeout_ms / 1000
        self.detection_bound = detection_bound(view.heartbeat_ms, view.timeout_ms)
        self.peers: dict[int, Heartbeat] = {}     # the last relayed heartbeat of each member
        self.lost: dict[int, str] = {}            # lost rank -> the notice, in the order they came
        self.left: dict[int, str] = {}            # rank -> the reason it gave for leaving
        self.coordinator_gone: str | None = None  # why failure detection ended
        self.cancelled: Cancelled | None = None   # the job's cancel, once this rank heard of it
        self.resize_pending: str | None = None    # the coordinator's resize notice (E1009), until the next view
        self._rejoin: tuple[str, int] | None = None  # this rank's new data address while it rejoins
        self._rejoin_error: DTMError | None = None
        self._watchers: tuple[Callable[[int, str], None], ...] = ()
        self._cancel_watchers: tuple[Callable[[Cancelled], None], ...] = ()
        self._send_lock = threading.Lock()  # the heartbeat thread's frames and a cancel request
        self._sock, self._control = sock, control
        self._early = early
        self._cond = threading.Condition()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # --- the heartbeat thread -------------------------------------------------------------------

    def start(self, figures: FiguresFn = Figures) -> None:
        self._figures = figures
        self._thread = threading.Thread(target=self._run, name=f"dtm-heartbeat-{self.rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stats = ProcessStats()
        heard = next_beat = time.monotonic()
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            for msg in self._early:
                self._message(msg)
            while not self._stopping:
                now = time.monotonic()
                if now >= next_beat:
                    self._sock.settimeout(self.timeout_s)  # a coordinator that does not read is not waited for
                    beat = heartbeat(self.rank, stats, self._figures(), with_workers=self._control.peer_reads_worker_rows)
                    with self._send_lock:
                        self._sock.sendall(self._control.encode(beat))
                    next_beat = now + self.heartbeat_s
                if now - heard > self.timeout_s:
                    return self._silent(now - heard)
                wait = max(0.0, min(next_beat, heard + self.timeout_s) - time.monotonic())
                ready = {fd for fd, _ in poller.poll(int(wait * 1000) + 1)}
                if self._sock.fileno() in ready and not self._stopping:
                    data = self._sock.recv(1 << 16)
                    if not data:
                        return self._closed()
                    heard = time.monotonic()
                    _, messages = self._control.feed(data)
                    for msg in messages:
                        self._message(msg)
        except (OSError, DTMError) as e:
            if not self._stopping:
                self._gone(str(e))

    def _message(self, msg: Message) -> None:
        if isinstance(msg, Heartbeat):
            if msg.rank < self.world_size:
                self.peers[msg.rank] = msg
        elif isinstance(msg, Leave):
            with self._cond:
                self.left[msg.rank] = msg.reason
                self._cond.notify_all()
        elif isinstance(msg, Error) and msg.code == E.PEER_LOST.value and 0 <= msg.rank < self.world_size:
            self._record_lost(msg.rank, msg.message)
        elif is_cancel(msg):
            self.record_cancel(Cancelled(msg.rank, msg.message))
        elif isinstance(msg, Error) and msg.code == E.RESIZE.value:
            with self._cond:
                self.resize_pending = msg.message
                self._cond.notify_all()
        elif isinstance(msg, Error) and self._rejoin is not None and msg.code in (E.JOIN_REFUSED.value,
                                                                                  E.RESIZE_FAILED.value):
            with self._cond:
                self._rejoin_error = remote_error(msg, self.coordinator)
                self._cond.notify_all()
        elif isinstance(msg, Error):
            log.warning("rank %d: %s", self.rank, remote_error(msg, self.coordinator))
        elif isinstance(msg, MeshView) and self._rejoin is not None and msg.epoch > self.view.epoch:
            self._accept(msg)
        elif isinstance(msg, MeshView):
            log.warning("rank %d: %s published epoch %d, which this rank did not rejoin for; kept epoch %d",
                        self.rank, self.coordinator, msg.epoch, self.view.epoch)
        else:
            raise DTMError(E.UNEXPECTED_MESSAGE, f"{self.coordinator} sent {msg.TYPE.name} to a member")

    def _accept(self, view: MeshView) -> None:
        """On the heartbeat thread: the view this rank rejoined for (spec 9.6.7). From here
        on it stamps and checks frames with the new epoch, under its new rank; what it knew
        of the old members' losses and figures is of the old numbering, and goes."""
        addresses = [(m.host, m.port) for m in view.members]
        with self._cond:
            if self._rejoin not in addresses:
                self._rejoin_error = DTMError(E.BAD_PAYLOAD, f"the MeshView of epoch {view.epoch} from "
                                              f"{self.coordinator} does not list this rank's address "
                                              f"{self._rejoin[0]}:{self._rejoin[1]}")
            else:
                self._control.epoch = self._control.decoder.expected_epoch = view.epoch
                self.view, self.rank, self.world_size = view, addresses.index(self._rejoin), len(view.members)
                self.peers, self.lost, self.left = {}, {}, {}
                self.resize_pending = None
                self._rejoin = None
            self._cond.notify_all()

    def rejoin(self, host: str, port: int, timeout: float) -> MeshView:
        """Rejoin the resizing mesh (spec 9.6.7) with this rank's new data address: send
        JoinMesh on the control connection and wait, at most `timeout` s, for the view of
        the next epoch, which the heartbeat thread accepts (`rank`, `view` and
        `world_size` are then the new ones). E1004 when the new mesh has no place for this
        rank, E1010 when the resize cannot complete, E1001 when the coordinator is gone."""
        deadline = time.monotonic() + timeout
        epoch = self.view.epoch
        with self._cond:
            self._rejoin, self._rejoin_error = (host, port), None
        with self._send_lock:
            self._sock.settimeout(self.timeout_s)
            try:
                self._sock.sendall(self._control.encode(JoinMesh(self.rank, 0, host, port, node_id(), os.getpid())))
            except OSError as e:
                raise DTMError(E.PEER_LOST, f"rejoining the mesh: sending to {self.coordinator} failed: "
                               f"{e.strerror or e}") from None
        with self._cond:
            while self.view.epoch == epoch and self._rejoin_error is None and self.coordinator_gone is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self.view.epoch != epoch:
                return self.view
            self._rejoin = None
            if self._rejoin_error is not None:
                raise self._rejoin_error
            if self.coordinator_gone is not None:
                raise DTMError(E.RESIZE_FAILED, f"rejoining the mesh of epoch {epoch}: {self.coordinator} is gone "
                               f"({self.coordinator_gone})")
            raise DTMError(E.TIMEOUT, f"rejoining the mesh of epoch {epoch}: no view from {self.coordinator} in "
                           f"{timeout:g} s")

    def take_over(self, coordinator: tuple[str, int], token: bytes, host: str, port: int, timeout: float) -> MeshView:
        """Rejoin through the successor coordinator at `coordinator`, the job's own being
        lost (spec 9.6.7, "Succession"): stop hearing the old one, connect and prove the
        token, send JoinMesh (this rank, world size 0, the new data address `host`:`port`)
        stamped with the current epoch, and accept the next epoch's view that answers it;
        heartbeats go to the successor from then on. Within `timeout` s (else E0802); the
        successor's E1004 or E1010 is raised as `rejoin` raises them."""
        start = time.monotonic()
        deadline = start + timeout
        epoch = self.view.epoch
        self._stop_thread()
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()
        self._wake_r, self._wake_w = socket.socketpair()  # (no wake byte left for the thread started again)
        who = f"the successor coordinator at {coordinator[0]}:{coordinator[1]}"
        during = f"rejoining the mesh of epoch {epoch}"
        sock = _dial(coordinator, deadline, start, during)
        control = _control(token, self.rank, who)
        reader = _Reader(sock, control, who)
        try:
            _handshake(sock, control, reader, deadline, start, during)
            control.epoch = epoch  # a rejoin is stamped with the epoch it leaves
            view = _ask_view(sock, control, reader, JoinMesh(self.rank, 0, host, port, node_id(), os.getpid()),
                             deadline, start, during)
        except DTMError as err:
            sock.close()
            raise (err.at(who, during) if isinstance(err, ProtocolError) else err) from None
        self._sock, self._control, self.coordinator = sock, control, who
        self.coordinator_gone, self._early = None, reader.queue
        self._rejoin = (host, port)
        self._accept(view)
        host_rank = control.hs.peer.rank
        self.coordinator_rank = host_rank if 0 <= host_rank < self.world_size else -1
        self._stopping = False
        self.start(self._figures)
        return view

    def _stop_thread(self) -> None:
        """End the heartbeat thread (it says nothing more to the coordinator)."""
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(self.timeout_s + 1.0)

    def _record_lost(self, rank: int, message: str) -> None:
        if rank == self.rank:
            log.error("rank %d: the coordinator declared this rank lost: %s", self.rank, message)
            return
        with self._cond:
            if rank in self.lost:
                return
            self.lost[rank] = message
            self._cond.notify_all()
        log.warning("rank %d: %s", self.rank, message)
        for watcher in self._watchers:
            watcher(rank, message)

    def _silent(self, silent: float) -> None:
        why = f"nothing from {self.coordinator} for {silent:.1f} s (the limit is {self.timeout_s:g} s)"
        self._host_lost(f"it runs the coordinator, which is silent: {why}")
        self._gone(why)

    def _closed(self) -> None:
        # A rank that runs the coordinator and shuts down says Leave first (relayed to us).
        self._host_lost("it runs the coordinator, whose connection closed without Leave: the process ended or was "
                        "killed")
        self._gone("it closed the connection")

    def _host_lost(self, why: str) -> None:
        r = self.coordinator_rank
        # (a coordinator that refused this rank's rejoin closes the connection for it: no loss)
        if r >= 0 and r != self.rank and r not in self.left and self._rejoin_error is None:
            self._record_lost(r, f"rank {r} is lost: {why}; its last operation was {self.last_op(r)}")

    def _gone(self, why: str) -> None:
        with self._cond:
            self.coordinator_gone = why
            self._cond.notify_all()
        if not self._stopping and self._rejoin_error is None:
            log.warning("rank %d: lost %s: %s; failure detection by heartbeats has ended on this rank", self.rank,
                        self.coordinator, why)

    # --- what the owner asks ---------------------------------------------------------------------

    def watch_lost(self, fn: Callable[[int, str], None]) -> None:
        """Call `fn(rank, notice)` on the heartbeat thread for each peer declared lost from
        now on. It must not block: it wakes what waits for that peer (e.g. shuts a socket
        down). A loss recorded before the call is in `lost`, which a watcher reads too."""
        self._watchers = (*self._watchers, fn)  # one assignment: the heartbeat thread reads it unlocked

    def watch_cancel(self, fn: Callable[[Cancelled], None]) -> None:
        """Call `fn(cancel)` once when the job is cancelled (at once if it was already), on
        the thread that hears of it. Like a `watch_lost` function it must not block."""
        self._cancel_watchers = (*self._cancel_watchers, fn)
        if self.cancelled is not None:
            fn(self.cancelled)

    def record_cancel(self, cancel: Cancelled) -> None:
        """The job is cancelled (the coordinator's notice, or this rank's own request): the
        first cancel counts, and each watcher hears of it once."""
        with self._cond:
            if self.cancelled is not None:
                return
            self.cancelled = cancel
            self._cond.notify_all()
        log.warning("rank %d: %s", self.rank, cancel.message)
        for watcher in self._cancel_watchers:
            watcher(cancel)

    def request_cancel(self, reason: str) -> None:
        """Ask the coordinator to cancel the job for `reason`, as this rank (spec 9.4.10);
        E1006 when it did not announce CAP_CANCEL, E1001 when it is gone."""
        if not self._control.hs.peer.caps & Cap.CANCEL:
            raise DTMError(E.MISSING_CAPABILITY, f"{self.coordinator} did not announce CAP_CANCEL: it cannot cancel "
                           "the job")
        if self.coordinator_gone is not None:
            raise DTMError(E.PEER_LOST, f"cannot cancel the job: {self.coordinator} is gone "
                           f"({self.coordinator_gone})")
        with self._send_lock:
            self._sock.settimeout(self.timeout_s)
            try:
                self._sock.sendall(self._control.encode(notice(self.rank, reason)))
            except OSError as e:
                raise DTMError(E.PEER_LOST, f"cannot cancel the job: sending to {self.coordinator} failed: "
                               f"{e.strerror or e}") from None

    def wait_lost(self, timeout: float, prefer: int | None = None) -> tuple[int, str] | None:
        """A lost rank and the notice about it: `prefer` if it is lost, else the first lost,
        waiting up to `timeout` s for a notice while the coordinator is there to send one
        (and `prefer` has not left on purpose). A cancel of the job ends the wait too: the
        peers shut their connections down for it (spec 9.4.10), and none of them is lost."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.lost and self.coordinator_gone is None and prefer not in self.left and \
                    self.cancelled is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if not self.lost:
                return None
            rank = prefer if prefer in self.lost else next(iter(self.lost))
            return rank, self.lost[rank]

    def last_op(self, rank: int) -> str:
        """What `rank`'s last heartbeat said it was doing."""
        hb = self.peers.get(rank)
        return hb.last_op if hb is not None and hb.last_op else "none reported"

    def leave(self, reason: str = "shutdown") -> None:
        """Stop the heartbeat thread, say Leave, close."""
        self._stop_thread()
        if self.coordinator_gone is None:
            try:  # Leave, then read until the coordinator closes: unread bytes would make close() a reset
                self._sock.settimeout(1.0)
                self._sock.sendall(self._control.encode(Leave(self.rank, reason[:1000])))
                self._sock.shutdown(socket.SHUT_WR)
                while self._sock.recv(1 << 16):
                    pass
            except OSError:
                pass
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()
