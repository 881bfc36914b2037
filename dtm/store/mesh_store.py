"""The mesh's tensor store (spec 9.2.11): one store spread over the ranks of a multi-process
mesh, with the methods of the embedded `Store`.

    dtm.init()
    st = dtm.store.mesh()          # every rank: the same store
    st.put("w/0", x)               # kept on `replicas` ranks chosen by the key's hash
    y = st.get("w/0")              # from any rank

Placement is rendezvous hashing: each rank scores a key with BLAKE2b(key, rank), and the key
lives on the `replicas` live ranks of highest score. Every rank computes the same order, a
lost rank moves only its own keys (to the next rank in each key's order), and no table of
placements exists to keep in step.

Each rank serves its part from an embedded directory store (`service.StoreServer`), kept in
/dev/shm where the machine has it, under a directory named by the mesh's session, which
`dtm launch` removes after the run. A part records its owner's process id
(`cluster.leftovers`): a killed rank's part that no survivor on its host removed goes when
`dtm launch` sees its ranks end, or at the next `dtm.init()` on that host. A get from a rank
on the same machine opens that rank's directory and maps the chunk files (no copy through a
socket; CRC32C checked as always); a get from another machine travels as StoreRequest /
StoreReply frames with the bytes in Data frames (spec 9.1.5), each CRC-checked.

A put goes to the key's first `replicas` live ranks; a rank that turns out to be gone during
the put is replaced by the next in the key's order. A get asks the key's live ranks in order
and takes the first copy; when none holds it and some of the ranks it may have been placed on
are lost, it raises KeyLost (E1106) naming them, else KeyMissing (E0804).

A request waits for its peer at most `timeout` s (E0802), and less when the coordinator
declares that peer lost: the membership's notice shuts the request's socket down, so the
wait ends at once with PeerLost (E1001) naming the rank, the request and how long it
waited; a get or put then goes on to the key's next rank as above.

A cancel of the job (spec 9.4.10) shuts every request's socket down the same way: the request
in flight, and every call from then on, raises Cancelled naming who cancelled and why.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..cluster.cancel import Cancelled
from ..cluster.leftovers import claim, remove_orphans, scratch_base
from ..comm.transport import PeerLost
from ..errors import DTMError, ErrorCode as E
from ..ir.dtypes import DType, numpy_dtype
from ..protocol import checksums
from ..protocol.checksums import TensorChecksumMismatch
from ..protocol.messages import FLAG_EXPECT_SHAPE, StoreReply, StoreRequest
from ..runtime.host import store_quota
from . import format as fmt
from .errors import KeyLost, KeyMissing, StoreError, remote_error
from .files import LocalFiles
from .index import Entry, SqliteIndex
from .keys import check_key
from .service import StoreServer, connections_for
from .store import Info, Store, as_store_dtype, as_tensor, quant_shape
from .wire import StoreConnection

DEFAULT_REPLICAS = 2
REQUEST_TIMEOUT_S = 120.0  # one request and its bytes, either way


def root_for(session: str) -> str:
    """Where the ranks of mesh `session` on this machine keep their parts: in
    $DTM_MESH_STORE, else /dev/shm (memory, as Ray's object store), else the temp directory
    (`leftovers.scratch_base`). The name starts with the mesh's shared-memory prefix, so
    `dtm launch` removes it."""
    return os.path.join(scratch_base(), f"dtm{session}_store")


def open_local(path: str) -> Store:
    """A directory store at `path` (made if missing)."""
    os.makedirs(os.path.join(path, "data"), exist_ok=True)
    return Store("file://" + path, LocalFiles(path), SqliteIndex(os.path.join(path, "index.sqlite")))


def placement(key: str, world_size: int) -> list[int]:
    """Every rank, best home of `key` first (rendezvous hashing, spec 9.2.11)."""
    raw = key.encode("utf-8")
    score = [int.from_bytes(hashlib.blake2b(raw + r.to_bytes(4, "little"), digest_size=8).digest(), "little")
             for r in range(world_size)]
    return sorted(range(world_size), key=lambda r: (-score[r], r))


class MeshStore:
    """The mesh's store as seen from one rank. Made by `dtm.store.mesh()`."""

    def __init__(self, pg: Any, local: Store, root: str, *, replicas: int | None = None, share_memory: bool = True,
                 timeout: float = REQUEST_TIMEOUT_S):
        self.pg, self.local, self.root = pg, local, root
        self.rank, self.world_size = pg.rank, pg.world_size
        n = DEFAULT_REPLICAS if replicas is None else replicas
        if not isinstance(n, int) or n < 1:
            raise StoreError(E.ATTRIBUTE_VALUE, f"replicas is a count of ranks >= 1, not {replicas!r}")
        self.replicas = min(n, self.world_size)
        self.share_memory, self.timeout = share_memory, timeout
        self.url = f"mesh://{pg.session}"
        self._conns: dict[int, StoreConnection] = {}
        self._peer_stores: dict[int, Store] = {}
        self._locks = [threading.Lock() for _ in range(self.world_size)]
        self._next_id = [0] * self.world_size
        self._unreachable: dict[int, str] = {}
        self._socks: dict[int, socket.socket] = {}  # each peer's store socket, from its connect on
        self._cancel: Cancelled | None = None  # the job's cancel, once the membership said so
        if pg.membership is not None:
            pg.membership.watch_lost(self._sever)
            pg.membership.watch_cancel(self._cancelled)

    def __repr__(self) -> str:
        return f"MeshStore(rank {self.rank} of {self.world_size}, replicas={self.replicas})"

    # --- who holds what ----------------------------------------------------------------------

    def _gone(self) -> dict[int, str]:
        """Ranks that hold nothing any more: lost, left, or unreachable from here."""
        gone = dict(self._unreachable)
        m = self.pg.membership
        if m is not None:
            gone.update({r: f"left: {why}" for r, why in m.left.items()})
            gone.update(m.lost)
        return gone

    def _notice(self, r: int) -> str | None:
        """The coordinator's notice that rank r is lost; None while it is not."""
        m = self.pg.membership
        return m.lost.get(r) if m is not None else None

    def _candidates(self, key: str, ranks: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
        """The live ranks that may hold `key`, in its order, and the lost ones among the
        ranks it may have been placed on (its first `replicas` plus one per lost rank, or the
        `ranks` the caller put it on)."""
        gone = self._gone()
        order = placement(key, self.world_size)[:self.replicas + len(gone)] if ranks is None else list(ranks)
        return [r for r in order if r not in gone], [r for r in order if r in gone]

    def _lost(self, r: int, err: DTMError) -> None:
        """Rank r failed a request with `err`: gone for this store from now when it was lost
        (E1001); any other error is the caller's."""
        if err.code is not E.PEER_LOST:
            raise err
        self._unreachable[r] = str(err)

    # --- writing -------------------------------------------------------------------------------

    def put(self, key: str, x: Any, dtype: Any = None) -> Info:
        """Store a copy of `x` under `key` on its `replicas` ranks, replacing what was there."""
        if getattr(x, "device_mesh", None) is not None:  # np.asarray would gather it on this rank
            raise StoreError(E.INVALID_PLACEMENT, f"put {key!r}: the mesh's store keeps whole tensors, and this one "
                                                  "is distributed; put it into a store every rank opens "
                                                  "(dtm.store.open(PATH)), which writes it piece by piece", key)
        return self.put_array(key, np.asarray(x), dtype)

    def put_array(self, key: str, a: np.ndarray, dtype: Any = None, *, ranks: Sequence[int] | None = None) -> Info:
        """Store a copy of `a` under `key` on its `replicas` ranks; with `ranks`, on each of
        those that is live instead, ranks the caller chose (a snapshot keeps a rank's pieces on
        other ranks than its own, spec 9.4.12), to be read and deleted with the same `ranks`."""
        key = check_key(key)
        self._check(f"store put {key!r}")
        dt = as_store_dtype(a.dtype if dtype is None else dtype)
        data, shape = _storage(key, a, dt)
        # the CRC of the caller's bytes, against which each remote replica's is checked (spec
        # 9.4.9): computed before the first remote put (a put on this rank alone checks
        # nothing against it; a survivor's snapshot blobs are hundreds of MB)
        crc: int | None = None
        first: Info | None = None
        done: list[int] = []
        for r in placement(key, self.world_size) if ranks is None else ranks:
            if ranks is None and len(done) == self.replicas:
                break
            if r in self._gone():
                continue
            if r != self.rank and crc is None and checksums.enabled():
                crc = checksums.array_crc(data)
            try:
                info = self._put_on(r, key, data, dt, shape, crc)
            except DTMError as err:
                self._lost(r, err)
                continue
            first = first or info
            done.append(r)
        if first is None:
            raise DTMError(E.PEER_LOST, f"put {key!r}: no rank of the mesh could take it; lost: {self._gone()}")
        return first

    def _put_on(self, r: int, key: str, data: np.ndarray, dt: DType, shape: tuple[int, ...],
                crc: int | None) -> Info:
        """Put `data` on rank r; a remote rank's reply names the checksum it stored, which
        must be `crc`, the caller's: else its copy is damaged, and is deleted (a get would
        find it consistent with itself) before the put fails with E1008."""
        if r == self.rank:
            return self.local.put_array(key, fmt.from_storage(data, dt), dt)
        raw = memoryview(data.reshape(-1).view(np.uint8)) if data.size else memoryview(b"")
        reply = self._request(r, "put", key, dtype=dt.name, shape=shape, data=raw)
        if crc is not None and reply.checksum != f"{crc:08x}":
            self._request(r, "delete", key)
            raise TensorChecksumMismatch(f"key {key!r}", "put", f"rank {r}'s store", crc, int(reply.checksum, 16),
                                         f"rank {r} deleted the damaged copy; put it again")
        return _entry(key, reply)

    def delete(self, key: str, *, ranks: Sequence[int] | None = None) -> None:
        """Remove `key` from every live rank, or every live one of `ranks` (E0804 when none
        held it)."""
        key = check_key(key)
        self._check(f"store delete {key!r}")
        held = False
        for r in range(self.world_size) if ranks is None else ranks:
            if r in self._gone():
                continue
            try:
                if r == self.rank:
                    self.local.delete(key)
                else:
                    self._request(r, "delete", key)
                held = True
            except KeyMissing:
                pass
        if not held:
            raise KeyMissing(key)

    # --- reading -------------------------------------------------------------------------------

    def get(self, key: str, dtype: Any = None, shape: tuple[int, ...] | None = None) -> Any:
        """The tensor under `key` as a dtm.Tensor, from whichever live rank holds it."""
        return as_tensor(key, self.info(key).dtype, self.get_array(key, dtype, shape))

    def get_array(self, key: str, dtype: Any = None, shape: tuple[int, ...] | None = None, *,
                  ranks: Sequence[int] | None = None) -> np.ndarray:
        """The array under `key`, from the first live rank that holds it: of its placement,
        or of the `ranks` a put with `ranks` chose."""
        key = check_key(key)
        want = None if dtype is None else as_store_dtype(dtype)
        return self._first(key, lambda r: self._get_from(r, key, want, shape), ranks)

    def info(self, key: str, *, ranks: Sequence[int] | None = None) -> Info:
        key = check_key(key)
        return self._first(key, lambda r: self._info_from(r, key), ranks)

    def __contains__(self, key: str) -> bool:
        try:
            self.info(key)
            return True
        except (KeyMissing, KeyLost):
            return False

    def keys(self, prefix: str = "") -> list[str]:
        """Every key under `prefix` held by a live rank, sorted."""
        return sorted(self._listing(prefix))

    def du(self, prefix: str = "") -> int:
        """Bytes of tensor data under `prefix`, each key counted once (not once per replica)."""
        return sum(self._listing(prefix).values())

    def _listing(self, prefix: str) -> dict[str, int]:
        self._check(f"store keys {prefix!r}")
        found: dict[str, int] = {}
        for r in range(self.world_size):
            if r in self._gone():
                continue
            if r == self.rank:
                items = [(k, self.local.info(k).nbytes) for k in self.local.keys(prefix)]
            else:
                try:
                    items = list(self._request(r, "keys", prefix).keys)
                except DTMError as err:
                    self._lost(r, err)
                    continue
            found.update(items)
        return found

    def _first(self, key: str, read, ranks: Sequence[int] | None = None):
        """`read(r)` on the first live rank that holds `key` whole (of `ranks`, where the
        caller chose them): a copy with a bad chunk (E1102) is passed over for the next, and
        raised only when no copy is good."""
        self._check(f"store get {key!r}")
        live, lost = self._candidates(key, ranks)
        corrupt: StoreError | None = None
        why: DTMError | None = None  # what a rank lost during this read failed with
        for r in live:
            try:
                return read(r)
            except KeyMissing:
                continue
            except DTMError as err:
                if err.code is E.STORE_CHUNK_CORRUPT:
                    corrupt = corrupt or err
                    continue
                self._lost(r, err)
                lost.append(r)
                why = err
        if corrupt is not None:
            raise corrupt
        if lost:
            raise KeyLost(key, sorted(set(lost)), str(why) if why is not None else "") from why
        raise KeyMissing(key)

    def _get_from(self, r: int, key: str, want: DType | None, shape: tuple[int, ...] | None) -> np.ndarray:
        part = self._part(r)
        if part is not None:
            return self._direct(r, f"store get {key!r}", lambda: part.get_array(key, want, shape))
        flags = FLAG_EXPECT_SHAPE if shape is not None else 0
        with self._exchange(r, f"store get {key!r}") as conn:
            reply = self._ask(r, conn, "get", key, dtype=want.name if want else "",
                              shape=tuple(shape) if shape is not None else (), flags=flags)
            layout = conn.get_layout(reply, want, shape, f"get {key!r}")  # bounded before it is allocated
            out = conn.read_array(reply.id, layout, time.monotonic() + self.timeout, f"get {key!r}")
        if checksums.enabled():  # the tensor checksum rank r stored at its put
            checksums.verify(out, int(reply.checksum, 16), what=f"key {key!r}", op="get", peer=f"rank {r}'s store")
        out.flags.writeable = False
        return out

    def _info_from(self, r: int, key: str) -> Info:
        part = self._part(r)
        if part is not None:
            return self._direct(r, f"store info {key!r}", lambda: part.info(key))
        return _entry(key, self._request(r, "info", key))

    def _direct(self, r: int, what: str, read: Callable[[], Any]) -> Any:
        """`read()` of rank r's part, opened from its directory. A rank that leaves removes its
        part, and may do so while this rank reads it before the Leave notice has arrived:
        the files vanish under the read, which then fails as a corrupt chunk or a missing
        key. Once the part's directory is gone that is rank r gone (E1001), so the read goes
        on to the key's other copies, and raises KeyLost when there is none (never "no such
        key")."""
        try:
            return read()
        except DTMError:
            path = self._part_dir(r)
            if r == self.rank or os.path.isdir(os.path.join(path, "data")):
                raise
            gone = self._peer_stores.pop(r, None)  # (another thread's read may have dropped it)
            if gone is not None:
                gone.close()
            raise PeerLost(r, what, f"its part {path} was removed under the read (its rank left the mesh)") from None

    def _part_dir(self, r: int) -> str:
        """Where rank r's part lives on this machine (its `data` directory is the store)."""
        return os.path.join(self.root, f"rank-{r}")

    def _part(self, r: int) -> Store | None:
        """Rank r's part to read directly: this rank's own, or one on this machine opened
        from its directory (no socket); None when r must be asked over the wire."""
        if r == self.rank:
            return self.local
        if not self.share_memory or self.pg.nodes[r] != self.pg.nodes[self.rank]:
            return None
        if r not in self._peer_stores:
            path = self._part_dir(r)
            if not os.path.isdir(os.path.join(path, "data")):
                return None  # its service uses another root ($DTM_MESH_STORE differs): ask it
            self._peer_stores[r] = open_local(path)
        return self._peer_stores[r]

    # --- talking to a peer's service ---------------------------------------------------------

    def _request(self, r: int, op: str, key: str, *, dtype: str = "", shape: tuple[int, ...] = (),
                 data: memoryview | None = None) -> StoreReply:
        with self._exchange(r, f"store {op} {key!r}") as conn:
            return self._ask(r, conn, op, key, dtype=dtype, shape=shape, data=data)

    @contextlib.contextmanager
    def _exchange(self, r: int, what: str) -> Iterator[StoreConnection]:
        """Rank r's connection, held for one request and its reply (one in flight per
        connection). Any failure of the connection drops it (the next request opens a new
        one), and is raised as `_failed` words it; an error the peer's store answered with
        (a StoreError) keeps it."""
        start = time.monotonic()
        with self._locks[r]:
            try:
                yield self._conn(r)
            except StoreError:
                raise
            except DTMError as err:
                self._drop(r)
                failed = self._failed(r, what, time.monotonic() - start, err)
                if failed is err:
                    raise
                raise failed from err

    def _failed(self, r: int, what: str, waited: float, err: DTMError) -> DTMError:
        """What a request to rank r that failed with `err` after `waited` s raises: PeerLost
        with the coordinator's notice once r is declared lost (`_sever` shut its socket, or
        its process ended), Cancelled once the job is (`_cancelled` shut the socket), the
        wait in seconds on a timeout, else `err`."""
        if self._cancel is not None:
            return self._cancel.during(f"{what} (waiting {waited:.1f} s for rank {r}'s store)")
        notice = self._notice(r)
        if notice is not None:
            return PeerLost(r, what, f"this rank waited {waited:.1f} s for its store; {notice}")
        if err.code is E.TIMEOUT:
            return DTMError(E.TIMEOUT, f"{what}: rank {r}'s store did not answer within {waited:.1f} s "
                                       f"({err.message})")
        return err

    def _ask(self, r: int, conn: StoreConnection, op: str, key: str, *, dtype: str = "",
             shape: tuple[int, ...] = (), flags: int = 0, data: memoryview | None = None) -> StoreReply:
        """Send one request (and a put's bytes) to rank r and read its reply; the error that
        the reply carries is raised as the class this side raises for its code."""
        rid = self._next_id[r]
        self._next_id[r] += 1
        conn.send(StoreRequest(rid, op, key, dtype, shape, flags, len(data) if data is not None else 0), data)
        reply = conn.receive(time.monotonic() + self.timeout, f"waiting for rank {r}'s store")
        if not isinstance(reply, StoreReply) or reply.id != rid:
            raise DTMError(E.UNEXPECTED_MESSAGE, f"rank {r}'s store answered {reply} to request {rid}")
        if reply.code:
            code = next((c for c in E if c.value == reply.code), E.UNEXPECTED_MESSAGE)
            raise remote_error(code, reply.message, key, f"rank {r}")
        return reply

    # A request blocks in a read of its socket (or in a send, when the peer stopped reading).
    # When the coordinator declares the peer lost, the heartbeat thread shuts that socket
    # down: every read or send on it returns at once, in whatever phase it is (handshake,
    # request, a reply half read), with no polling slices and no second clock. The
    # collectives' transport ends its waits the same way (TcpTransport.sever).

    def _track(self, r: int, sock: socket.socket) -> None:
        """`sock` now carries the requests to rank r: shut at once when r is lost already
        or the job cancelled (the notice may have come before the socket existed)."""
        self._socks[r] = sock
        if self._notice(r) is not None or self._cancel is not None:
            _shut(sock)

    def _sever(self, r: int, notice: str) -> None:
        """The membership's word (on its heartbeat thread) that rank r is lost."""
        sock = self._socks.get(r)
        if sock is not None:
            _shut(sock)  # a socket closed meanwhile has no descriptor left to shut: OSError, ignored

    def _cancelled(self, cancel: Cancelled) -> None:
        """The membership's word (on the thread that heard it) that the job is cancelled:
        every request in flight ends now, and every later call raises it."""
        self._cancel = cancel
        for sock in list(self._socks.values()):
            _shut(sock)

    def _check(self, what: str) -> None:
        if self._cancel is not None:
            raise self._cancel.during(what)

    def _conn(self, r: int) -> StoreConnection:
        if r not in self._conns:
            self._conns[r] = StoreConnection.connect(self.pg.service_addresses[r], self.pg.token, rank=self.rank,
                                                     epoch=self.pg.epoch, timeout=self.timeout, peer=f"rank {r}",
                                                     opened=lambda sock: self._track(r, sock))
            self._next_id[r] = 0
        return self._conns[r]

    def _drop(self, r: int) -> None:
        self._socks.pop(r, None)  # a handshake that failed closed its socket itself
        conn = self._conns.pop(r, None)
        if conn is not None:
            conn.close()

    # --- the rest of the Store methods -------------------------------------------------------

    def verify(self, prefix: str = ""):
        """Scrub this rank's own part (each rank verifies what it holds)."""
        return self.local.verify(prefix)

    def close(self) -> None:
        for r in list(self._conns):
            self._drop(r)
        for st in self._peer_stores.values():
            st.close()
        self._peer_stores.clear()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _storage(key: str, a: np.ndarray, dt: DType) -> tuple[np.ndarray, tuple[int, ...]]:
    """The storage array of `a` as `dt` and the tensor's logical shape (a quantized array
    is its uint8 blocks, as `Store.put_array` takes them)."""
    if dt.is_quant:
        return fmt.to_storage(a, dt), quant_shape(key, a, dt)
    # to_storage gives a 0-d array 1 dim (np.ascontiguousarray does): its shape is put back
    return fmt.to_storage(a.astype(numpy_dtype(dt), copy=False), dt).reshape(a.shape), tuple(a.shape)


def _entry(key: str, reply: StoreReply) -> Entry:
    return Entry(key, "", as_store_dtype(reply.dtype), tuple(reply.shape), reply.nbytes, reply.checksum,
                 reply.version, reply.written)


# The part each process group serves (set by its join hook), so `dtm.store.mesh()` finds it.
_parts: "weakref.WeakKeyDictionary[Any, tuple[Store, str]]" = weakref.WeakKeyDictionary()


def part_of(pg: Any) -> tuple[Store, str] | None:
    """(this rank's part, the mesh's root directory) of a group that serves one, else None."""
    return _parts.get(pg)


def start_service(pg: Any) -> Any:
    """The join hook (process_group.on_join): open this rank's part and serve it."""
    root = root_for(pg.session)
    path = os.path.join(root, f"rank-{pg.rank}")
    # The parts of killed ranks of earlier meshes that no survivor on this host removed
    remove_orphans(os.path.dirname(root))
    shutil.rmtree(path, ignore_errors=True)  # a part left by an earlier mesh of the same session
    local = open_local(path)
    local.set_quota(store_quota())  # DTM_STORE_QUOTA: what this rank's part may hold (None: no limit)
    claim(path)
    server = StoreServer(local, pg.service_listener, pg.token, rank=pg.rank, epoch=pg.epoch,
                         max_connections=connections_for(pg.world_size))
    _parts[pg] = (local, root)

    def stop() -> None:
        _parts.pop(pg, None)
        server.close()
        local.close()
        shutil.rmtree(path, ignore_errors=True)
        # The parts of this machine's ranks that were killed: nobody else will remove them
        # when the mesh was started without `dtm launch`.
        lost = pg.membership.lost if pg.membership is not None else {}
        for r in lost:
            if pg.nodes[r] == pg.nodes[pg.rank]:
                shutil.rmtree(os.path.join(root, f"rank-{r}"), ignore_errors=True)
        try:
            os.rmdir(root)  # the last rank of this machine to leave removes the mesh's directory
        except OSError:
            pass

    return stop
