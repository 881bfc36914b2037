"""A rank's store service (spec 9.2.11): serves the part of the mesh's store this rank holds
to its peers, one thread per connection, each answering StoreRequests in order.

    server = StoreServer(local_store, listener, token, rank=1, epoch=1)   # accepting at once
    ...
    server.close()          # stops accepting, ends every connection

A request that fails for a reason of the store (a missing key, another type, a quota, a bad
chunk) is answered with a StoreReply carrying the error's code, and the connection goes on;
a put's bytes are read (and dropped) even when the put is refused, so the stream keeps its
place. A fault of the protocol itself (bad CRC, a frame out of sequence, a size that does
not match the announced type) is answered with an Error frame and the connection closes.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import numpy as np

from ..errors import DTMError, ErrorCode as E
from ..protocol.errors import ProtocolError
from ..protocol.messages import FLAG_EXPECT_SHAPE, StoreReply, StoreRequest
from ..protocol.payload import MAX_STR_BYTES
from ..runtime.host import available_bytes
from . import format as fmt
from .store import Store, as_store_dtype
from .wire import StoreConnection

log = logging.getLogger("dtm.store")

HANDSHAKE_TIMEOUT_S = 10.0   # an accepted connection must finish its Hellos within this
IDLE_S = 1e9                 # a served connection waits this long for its next request (until closed)
DATA_TIMEOUT_S = 120.0       # a put's bytes must all arrive within this after its request


class StoreServer:
    """Serves `store` to the mesh's peers on `listener` (an already listening socket)."""

    def __init__(self, store: Store, listener: socket.socket, token: bytes, *, rank: int, epoch: int):
        self.store, self.listener, self.token, self.rank, self.epoch = store, listener, token, rank, epoch
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"dtm-store-{rank}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._conns.add(sock)
            threading.Thread(target=self._serve, args=(sock,), name=f"dtm-store-{self.rank}-conn",
                             daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:


        conn = None
        try:
            conn = StoreConnection.accept(sock, self.token, rank=self.rank, epoch=self.epoch,
                                          timeout=HANDSHAKE_TIMEOUT_S)
            while not self._closed:
                msg = conn.receive(time.monotonic() + IDLE_S, "waiting for a store request")
                if not isinstance(msg, StoreRequest):
                    raise ProtocolError(E.UNEXPECTED_MESSAGE, f"a {type(msg).__name__} where a StoreRequest was due")
                self._answer(conn, msg)
        except ProtocolError as err:
            log.warning("rank %d: store connection from %s closed: %s", self.rank,
                        conn.peer if conn else "a peer", err)
            if conn is not None:
                conn.send_error(err, self.rank)
        except DTMError as err:  # the peer went away, or a deadline passed: nothing to answer
            if not self._closed and err.code is not E.PEER_LOST:
                log.info("rank %d: store connection ended: %s", self.rank, err)
        finally:
            with self._lock:
                self._conns.discard(sock)
            (conn.close() if conn is not None else sock.close())

    def _answer(self, conn, req: StoreRequest) -> None:
        data = None
        try:
            if req.op == "put":
                reply = self._put(conn, req)
            elif req.op == "get":
                reply, data = self._get(req)
            elif req.op == "info":
                reply = _entry_reply(req.id, self.store.info(req.key))
            elif req.op == "keys":
                reply = _reply(req.id, keys=tuple((k, self.store.info(k).nbytes) for k in self.store.keys(req.key)))
            else:
                self.store.delete(req.key)
                reply = _reply(req.id)
        except ProtocolError:
            raise
        except DTMError as err:
            reply, data = _reply(req.id, code=err.code.value, message=_fits(str(err.message))), None
        conn.send(reply, data)

    def _put(self, conn, req: StoreRequest) -> StoreReply:
        dt = as_store_dtype(req.dtype)
        layout = fmt.plan(dt, req.shape)
        if req.nbytes != layout.nbytes:
            raise ProtocolError(E.BAD_PAYLOAD, f"a put of {req.key!r} as {req.dtype}{list(req.shape)} announces "
                                               f"{req.nbytes} bytes; that type holds {layout.nbytes}")
        deadline = time.monotonic() + DATA_TIMEOUT_S
        free = available_bytes()
        if free is not None and req.nbytes > free:
            conn.skip_data(req.id, req.nbytes, deadline, f"the refused put of {req.key!r}")
            raise DTMError(E.STORE_IO_ERROR, f"rank {self.rank} cannot take the {req.nbytes} bytes of {req.key!r}: "
                                             f"{free} bytes of memory are free")
        buf = np.empty(layout.storage_shape, layout.storage_dtype)
        conn.read_data(req.id, memoryview(buf.reshape(-1).view(np.uint8)), deadline, f"the put of {req.key!r}")
        return _entry_reply(req.id, self.store.put_array(req.key, fmt.from_storage(buf, dt), dt))

    def _get(self, req: StoreRequest) -> tuple[StoreReply, memoryview]:
        entry = self.store.info(req.key)
        shape = req.shape if req.flags & FLAG_EXPECT_SHAPE else None
        a = self.store.get_array(req.key, req.dtype or None, shape)
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        return _entry_reply(req.id, entry, nbytes=raw.size), memoryview(raw)

    def close(self) -> None:
        """Stop accepting and end every connection (their threads see the socket close)."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        try:
            self.listener.close()
        except OSError:
            pass
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _fits(text: str) -> str:
    """`text` cut to what a `str` field holds (65535 UTF-8 bytes), never inside a character."""
    return text.encode("utf-8", "replace")[:MAX_STR_BYTES].decode("utf-8", "ignore")


def _reply(id_: int, *, code: str = "", message: str = "", keys: tuple = ()) -> StoreReply:
    return StoreReply(id_, code, message, "", (), 0, 0, "", 0.0, keys)


def _entry_reply(id_: int, entry, nbytes: int | None = None) -> StoreReply:
    return StoreReply(id_, "", "", entry.dtype.name, tuple(entry.shape), entry.nbytes if nbytes is None else nbytes,
                      entry.version, entry.checksum, float(entry.written), ())
