"""A rank's store service (spec 9.2.11): serves the part of the mesh's store this rank holds
to its peers.

    server = StoreServer(local_store, listener, token, rank=1, epoch=1)   # accepting at once
    ...
    server.close()          # stops accepting, ends every connection

Two kinds of thread, a fixed number of each. The admitting thread accepts connections and
moves each handshake as far as the bytes that came allow, never waiting on one peer, each
frame bounded by 64 KiB (the peer is not proven yet). A proven connection goes to the
`WORKERS` serving threads, which wait together on one epoll set in which each connection is
armed for one event: the thread that wakes for it reads the request, answers it and arms the
connection again, so a request costs no hand-over between threads. Threads do not grow with
connections, and a peer that connects and says nothing holds no thread. At most
`max_connections` are held at once: past that the oldest still in its handshake goes, or,
when every one has proven the token, the new one is refused; either is told why in an Error
frame (E1003).

A request that fails for a reason of the store (a missing key, another type, a quota, a bad
chunk) is answered with a StoreReply carrying the error's code, and the connection goes on.
A put the service cannot take (its key, its dtype, a quota of the part, this machine's free
memory) is answered before any of its bytes is read; the bytes that still come are dropped,
so the stream keeps its place. A fault of the protocol itself (bad CRC, a frame out of
sequence or longer than its message may be, a size that does not match the announced type)
is answered with an Error frame and the connection closes.
"""

from __future__ import annotations

import logging
import select
import selectors
import socket
import threading
import time

import numpy as np

from ..comm.tcp import PendingHandshake, read_handshake
from ..errors import DTMError, ErrorCode as E
from ..protocol.errors import ProtocolError
from ..protocol.handshake import CONTROL_STREAM
from ..protocol.messages import FLAG_EXPECT_SHAPE, MIN_MAX_PAYLOAD, Error, StoreReply, StoreRequest, encode_message
from ..runtime.host import available_bytes
from . import format as fmt
from .errors import KeyMissing
from .index import check_quotas
from .keys import check_key
from .store import Store, as_store_dtype
from .wire import StoreConnection, fit_message, store_handshake

log = logging.getLogger("dtm.store")

HANDSHAKE_TIMEOUT_S = 10.0   # an accepted connection must finish its Hellos within this
REQUEST_TIMEOUT_S = 120.0    # a request whose first bytes came, and a put's bytes, must all arrive within this
MAX_CONNECTIONS = 64         # connections held at once, at least: a mesh's peers keep one each (spec 9.2.11)
                             # and the rest is room for handshakes; `connections_for` adds to it for big meshes
WORKERS = 4                  # threads serving requests: a put or get moves bytes at the link's speed, so a few
                             # fill it, and requests past them wait their turn rather than take a thread each
CLOSE_WAIT_S = 5.0           # `close` waits this long for each thread (their sockets are shut: they end at once)
_ARMED = select.EPOLLIN | select.EPOLLONESHOT  # one event, to one serving thread, until armed again


def connections_for(world_size: int) -> int:
    """The connections a rank's service may hold in a mesh of `world_size` ranks: two per
    peer (each keeps one open and may open the next before the service has seen the last
    close), and never fewer than MAX_CONNECTIONS."""
    return max(MAX_CONNECTIONS, 2 * world_size)


class StoreServer:
    """Serves `store` to the mesh's peers on `listener` (an already listening socket), with
    `workers` serving threads and at most `max_connections` connections at once."""

    def __init__(self, store: Store, listener: socket.socket, token: bytes, *, rank: int, epoch: int,
                 max_connections: int = MAX_CONNECTIONS, workers: int = WORKERS):
        self.store, self.listener, self.token, self.rank, self.epoch = store, listener, token, rank, epoch
        self.max_connections = max_connections
        self._handshakes: dict[PendingHandshake, None] = {}  # oldest first; the admitting thread's alone
        self._conns: dict[int, StoreConnection] = {}         # proven, by descriptor
        self._lock = threading.Lock()                        # _conns, _reserved
        self._closed = False
        self._reserved = 0  # bytes of memory held by the puts being read
        self._wake_r, self._wake_w = socket.socketpair()     # readable once closing: wakes every thread
        self._admitting = selectors.DefaultSelector()
        self._admitting.register(listener, selectors.EVENT_READ, "accept")
        self._admitting.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._armed = select.epoll()
        self._armed.register(self._wake_r.fileno(), select.EPOLLIN)  # level-triggered: every thread sees it
        listener.setblocking(False)
        self._threads = [threading.Thread(target=self._admit_loop, name=f"dtm-store-{rank}", daemon=True)]
        self._threads += [threading.Thread(target=self._work, name=f"dtm-store-{rank}-worker", daemon=True)
                          for _ in range(workers)]
        for t in self._threads:
            t.start()

    # --- admitting ---------------------------------------------------------------------------

    def _admit_loop(self) -> None:
        """The admitting thread: accept, move handshakes, drop those past their deadline."""
        try:
            while not self._closed:
                for key, events in self._admitting.select(self._wait()):
                    if key.data == "accept":
                        self._accept()
                    elif isinstance(key.data, PendingHandshake):
                        self._advance(key.data, events)
                self._expire()
        finally:
            for p in self._handshakes:
                p.sock.close()
            self._admitting.close()
            self.listener.close()

    def _wait(self) -> float | None:
        """Seconds until the oldest handshake's deadline; None (until an event) when there is none."""
        oldest = next(iter(self._handshakes), None)
        return None if oldest is None else max(0.0, oldest.deadline - time.monotonic())

    def _accept(self) -> None:
        try:
            sock, addr = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # out of file descriptors, say: the bound frees some
            log.warning("rank %d: the store service could not accept: %s", self.rank, e)
            return
        with self._lock:
            held = len(self._handshakes) + len(self._conns)
        if held >= self.max_connections:
            full = DTMError(E.RECEIVE_BUFFER_FULL, f"the store of rank {self.rank} holds {self.max_connections} "
                                                   "connections, its bound")
            if not self._handshakes:  # every place is a proven peer's: this one goes
                _turn_away(sock, encode_message(Error.from_exception(full, self.rank), epoch=0,
                                                stream=CONTROL_STREAM, seq=0))
                return
            self._drop(next(iter(self._handshakes)),
                       DTMError(full.code, f"{full.message}; the oldest still in its handshake goes"))
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a small reply leaves at once
        p = PendingHandshake(sock, store_handshake("accept", self.token, self.rank),
                             time.monotonic() + HANDSHAKE_TIMEOUT_S, f"{addr[0]}:{addr[1]}", None)
        self._handshakes[p] = None
        self._admitting.register(sock, selectors.EVENT_READ, p)

    def _advance(self, p: PendingHandshake, events: int) -> None:
        """Move p's handshake as far as what came allows; once done, the connection goes to
        the serving threads."""
        try:
            if events & selectors.EVENT_WRITE and p.out:
                del p.out[:p.sock.send(p.out)]
            if events & selectors.EVENT_READ:
                read_handshake(p)
        except BlockingIOError:
            pass
        except (ProtocolError, OSError) as err:
            return self._drop(p, err)
        if not (p.hs.done and not p.out):  # wait for more, or for room to send our Hello
            self._admitting.modify(p.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if p.out else 0), p)
            return
        del self._handshakes[p]
        self._admitting.unregister(p.sock)
        try:
            conn = StoreConnection.proven(p.sock, p.hs, p.addr, self.epoch, send_timeout=REQUEST_TIMEOUT_S)
        except ProtocolError as err:
            return _turn_away(p.sock, p.hs.error_frame(err))
        with self._lock:
            self._conns[conn.sock.fileno()] = conn
        self._armed.register(conn.sock.fileno(), _ARMED)

    def _drop(self, p: PendingHandshake, err: Exception) -> None:
        """End a connection in its handshake; a DTM error is told to the peer first (an
        OSError means the peer went away)."""
        (log.warning if isinstance(err, DTMError) else log.debug)(
            "rank %d: store connection from %s dropped in its handshake: %s", self.rank, p.addr, err)
        del self._handshakes[p]
        self._admitting.unregister(p.sock)
        _turn_away(p.sock, p.hs.error_frame(err) if isinstance(err, DTMError) else b"")

    def _expire(self) -> None:
        now = time.monotonic()
        for p in [p for p in self._handshakes if p.deadline <= now]:
            self._drop(p, DTMError(E.TIMEOUT, f"no handshake within {HANDSHAKE_TIMEOUT_S:g} s"))

    # --- serving -----------------------------------------------------------------------------

    def _work(self) -> None:
        """A serving thread: wait with the others for a request on any proven connection."""
        while not self._closed:
            for fd, _ in self._armed.poll(-1, 1):
                conn = self._conns.get(fd)
                if conn is not None and not self._closed:
                    self._serve(conn)

    def _serve(self, conn: StoreConnection) -> None:
        """Answer the request that has begun to arrive on `conn` (or drop the bytes of a
        refused put that came) and arm it for the next; a fault of the protocol is told to the
        peer in an Error frame, and any fault ends it."""
        try:
            msg = conn.next_request(time.monotonic() + REQUEST_TIMEOUT_S, "reading a store request")
            if msg is not None and not isinstance(msg, StoreRequest):
                raise ProtocolError(E.UNEXPECTED_MESSAGE, f"a {type(msg).__name__} where a StoreRequest was due")
            if msg is not None:
                self._answer(conn, msg)
            self._armed.modify(conn.sock.fileno(), _ARMED)
            return
        except ProtocolError as err:
            log.warning("rank %d: store connection from %s closed: %s", self.rank, conn.peer, err)
            conn.send_error(err, self.rank)
        except DTMError as err:  # the peer went away, or a deadline passed: nothing to answer
            if not self._closed and err.code is not E.PEER_LOST:
                log.info("rank %d: store connection ended: %s", self.rank, err)
        except Exception:  # a fault of this code: that connection ends, the pool keeps its thread
            log.exception("rank %d: store connection from %s ended by an internal error", self.rank, conn.peer)
        self._end(conn)

    def _end(self, conn: StoreConnection) -> None:
        """Forget and close `conn` (out of the epoll set first: its descriptor may be reused)."""
        fd = conn.sock.fileno()
        with self._lock:
            self._conns.pop(fd, None)
        self._armed.unregister(fd)
        conn.close()

    # --- requests ----------------------------------------------------------------------------

    def _answer(self, conn: StoreConnection, req: StoreRequest) -> None:
        """Send the reply to `req` (and a get's bytes): an error of the store is the reply's,
        and the connection goes on; a fault of the connection is raised."""
        if req.op == "put":
            conn.send(self._put(conn, req))
            return
        try:
            reply, data = self._get(req) if req.op == "get" else (self._lookup(req), None)
        except DTMError as err:
            reply, data = _error_reply(req.id, err), None
        conn.send(reply, data)

    def _lookup(self, req: StoreRequest) -> StoreReply:
        """The reply to an info, keys or delete request."""
        if req.op == "info":
            return _entry_reply(req.id, self.store.info(req.key))
        if req.op == "keys":
            return _reply(req.id, keys=tuple((k, self.store.info(k).nbytes) for k in self.store.keys(req.key)))
        self.store.delete(req.key)
        return _reply(req.id)

    def _put(self, conn: StoreConnection, req: StoreRequest) -> StoreReply:
        """Take a put's bytes and store them; refused before a byte is read when the service
        cannot take it, its reply then sent at once and the bytes still to come dropped."""
        try:
            layout = self._admit(req)
        except ProtocolError:
            raise
        except DTMError as err:
            conn.drop_data(req.nbytes)
            return _error_reply(req.id, err)
        try:
            a = conn.read_array(req.id, layout, time.monotonic() + REQUEST_TIMEOUT_S, f"the put of {req.key!r}")
            try:
                return _entry_reply(req.id, self.store.put_array(req.key, a, layout.dtype))
            except DTMError as err:
                return _error_reply(req.id, err)
        finally:
            with self._lock:
                self._reserved -= layout.nbytes

    def _admit(self, req: StoreRequest) -> fmt.Layout:
        """The layout of a put's tensor once this service can take it, its bytes of memory
        held until the put ends: E1101 for its key, E0401 for its dtype, E1103 past a quota
        of the part, E1104 past this machine's free memory (less what the puts being read
        hold). A `nbytes` that is not the type's size is a fault of the protocol (E0910)."""
        dt = as_store_dtype(req.dtype)
        layout = fmt.plan(dt, req.shape)
        if req.nbytes != layout.nbytes:
            raise ProtocolError(E.BAD_PAYLOAD, f"a put of {req.key!r} as {req.dtype}{list(req.shape)} announces "
                                               f"{req.nbytes} bytes; that type holds {layout.nbytes}")
        key = check_key(req.key)
        check_quotas(key, layout.nbytes, lambda: self._held_by(key), self.store.quotas(), self.store.du)
        with self._lock:
            free = available_bytes()
            if free is not None and self._reserved + layout.nbytes > free:
                held = f", {self._reserved} of them held by puts in progress" if self._reserved else ""
                raise DTMError(E.STORE_IO_ERROR, f"rank {self.rank} cannot take the {req.nbytes} bytes of "
                                                 f"{req.key!r}: {free} bytes of memory are free{held}")
            self._reserved += layout.nbytes
        return layout

    def _held_by(self, key: str) -> int:
        """The bytes `key` holds in this part now (0 when none): what a put of it replaces."""
        try:
            return self.store.info(key).nbytes
        except KeyMissing:
            return 0

    def _get(self, req: StoreRequest) -> tuple[StoreReply, memoryview]:
        entry = self.store.info(req.key)
        shape = req.shape if req.flags & FLAG_EXPECT_SHAPE else None
        a = self.store.get_array(req.key, req.dtype or None, shape)
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        return _entry_reply(req.id, entry, nbytes=raw.size), memoryview(raw)

    def close(self) -> None:
        """Stop accepting and end every connection: a request in progress fails at once (its
        socket is shut down). Returns once the listener is closed and the threads have ended."""
        if self._closed:
            return
        self._closed = True
        self._wake_w.send(b"x")
        with self._lock:
            for conn in self._conns.values():
                _shut(conn.sock)
        for t in self._threads:
            t.join(CLOSE_WAIT_S)
        for conn in self._conns.values():
            conn.close()
        self._armed.close()
        self._wake_r.close()
        self._wake_w.close()


def _turn_away(sock: socket.socket, frame: bytes) -> None:
    """Close a connection, sending `frame` (an Error saying why) first, without waiting. What
    the peer sent already (its Hello) is read and dropped first: a socket closed with unread
    bytes sends a reset, which may discard the frame before the peer reads it."""
    sock.setblocking(False)
    for step in (lambda: sock.recv(MIN_MAX_PAYLOAD), lambda: sock.send(frame)):
        try:
            step()
        except OSError:  # nothing came yet; or the peer is gone, and nothing is owed to it
            pass
    sock.close()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _error_reply(id_: int, err: DTMError) -> StoreReply:
    return _reply(id_, code=err.code.value, message=fit_message(str(err.message)))


def _reply(id_: int, *, code: str = "", message: str = "", keys: tuple = ()) -> StoreReply:
    return StoreReply(id_, code, message, "", (), 0, 0, "", 0.0, keys)


def _entry_reply(id_: int, entry, nbytes: int | None = None) -> StoreReply:
    return StoreReply(id_, "", "", entry.dtype.name, tuple(entry.shape), entry.nbytes if nbytes is None else nbytes,
                      entry.version, entry.checksum, float(entry.written), ())
