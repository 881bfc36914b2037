"""The mesh store's wire (spec 9.2.11) in one process: two ranks' services on 127.0.0.1, each
over its own directory store, and each rank's MeshStore talking to the other through real
sockets (share_memory=False, so nothing is read from the other's directory). Every value is
compared with the numpy array that was put; faults are injected as raw frames."""

from __future__ import annotations

import contextlib
import hashlib
import pathlib
import socket
import threading
import time
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

import dtm
from dtm.errors import DTMError, ErrorCode as E
from dtm.protocol.frame import MsgType, encode_header
from dtm.comm.transport import PeerLost
from dtm.protocol.messages import Data, StoreReply, StoreRequest, frame_parts
from dtm.store import mesh_store as mesh_mod
from dtm.store.errors import KeyLost, KeyMissing, StoreError, StoreTypeError
from dtm.store.mesh_store import MeshStore, open_local, placement
from dtm.store.service import StoreServer
from dtm.store.wire import StoreConnection

TOKEN = b"mesh store test token"


@pytest.fixture
def two_ranks(tmp_path):
    """Two ranks' MeshStores (share_memory=False) and their services; closed at the end."""
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    addresses = tuple(("127.0.0.1", s.getsockname()[1]) for s in listeners)
    locals_ = [open_local(str(tmp_path / f"rank-{r}")) for r in range(2)]
    servers = [StoreServer(locals_[r], listeners[r], TOKEN, rank=r, epoch=1) for r in range(2)]
    stores = []
    for r in range(2):
        pg = SimpleNamespace(rank=r, world_size=2, membership=None, nodes=("a", "b"), service_addresses=addresses,
                             token=TOKEN, epoch=1, session="test")
        stores.append(MeshStore(pg, locals_[r], str(tmp_path), share_memory=False, timeout=10))
    yield stores
    for st in stores:
        st.close()
    for s in servers:
        s.close()
    for st in locals_:
        st.close()


def key_homed_on(rank: int, world: int = 2, prefix: str = "k") -> str:
    return next(f"{prefix}{i}" for i in range(1000) if placement(f"{prefix}{i}", world)[0] == rank)


def test_placement_is_rendezvous_hashing_as_the_spec_writes_it():
    def by_spec(key: str, n: int) -> list[int]:  # spec 9.2.11, written out independently
        score = {r: int.from_bytes(hashlib.blake2b(key.encode() + r.to_bytes(4, "little"), digest_size=8).digest(),
                                   "little") for r in range(n)}
        return sorted(range(n), key=lambda r: (-score[r], r))

    keys = [f"layer{i}/w" for i in range(400)]
    for n in (1, 2, 3, 8):
        assert all(placement(k, n) == by_spec(k, n) for k in keys)
    firsts = np.bincount([placement(k, 8)[0] for k in keys], minlength=8)
    assert firsts.min() > 20, firsts  # spread over every rank (400 keys, 50 expected each)
    # losing rank 3 moves only the keys whose first home was rank 3
    moved = [k for k in keys if [r for r in placement(k, 8) if r != 3][0] != placement(k, 8)[0]]
    assert all(placement(k, 8)[0] == 3 for k in moved)


@pytest.mark.parametrize("dtype", ["f32", "f64", "i64", "bool", "bf16", "f8e4m3", "u8"])
def test_every_dtype_crosses_the_wire_bit_for_bit(two_ranks, dtype):
    a, b = two_ranks
    rng = np.random.default_rng(0)
    np_dtype = {"f32": np.float32, "f64": np.float64, "i64": np.int64, "u8": np.uint8, "bool": np.bool_,
                "bf16": ml_dtypes.bfloat16, "f8e4m3": ml_dtypes.float8_e4m3fn}[dtype]
    if dtype in ("i64", "u8", "bool"):
        x = rng.integers(0, 100, (5, 7)).astype(np_dtype)
    else:
        x = (rng.standard_normal((5, 7)) * 10).astype(np_dtype)
    key = key_homed_on(1, prefix=f"{dtype}/")
    a.put(key, x)  # rank 0 puts: one copy on rank 0, one sent to rank 1
    for st in (a, b):
        got = st.get_array(key)
        assert got.dtype == x.dtype and got.shape == x.shape
        assert got.tobytes() == x.tobytes()
    assert b.local.get_array(key).tobytes() == x.tobytes()  # rank 1 holds a copy of its own


def test_quantized_blocks_scalars_and_empty_tensors(two_ranks):
    a, b = two_ranks
    blocks = np.random.default_rng(1).integers(0, 255, (3, 2 * 34)).astype(np.uint8)  # q8_0: 34-byte blocks
    a.put_array("q/w", blocks, "q8_0")
    assert b.info("q/w").shape == (3, 64) and str(b.info("q/w").dtype) == "q8_0"
    assert b.get_array("q/w").tobytes() == blocks.tobytes()
    with pytest.raises(StoreTypeError):
        b.get("q/w")  # no dtm.Tensor holds q8_0: E0408, as from the embedded store
    b.put("s", np.float32(2.5))
    b.put("e", np.zeros((0, 4), np.float32))
    assert a.get_array("s").shape == () and float(a.get_array("s")) == 2.5
    assert a.get_array("e").shape == (0, 4)


def test_a_remote_get_goes_over_the_socket_and_errors_keep_their_class(two_ranks):
    a, b = two_ranks
    key = key_homed_on(1)
    b.put(key, np.arange(6, dtype=np.float32))
    a.local.delete(key)  # only rank 1 holds it now
    got = a.get(key)
    assert isinstance(got, dtm.Tensor) and got.numpy().tolist() == list(range(6))
    assert a._conns[1].bytes_received == 24
    with pytest.raises(StoreTypeError) as e:
        a.get_array(key, dtype="f64")
    assert e.value.code is E.DTYPE_MISMATCH and "rank 1" in str(e.value) and e.value.key == key
    with pytest.raises(StoreTypeError) as e:
        a.get_array(key, shape=(2, 3))
    assert e.value.code is E.SHAPE_MISMATCH
    with pytest.raises(KeyMissing) as e:
        a.get("never/put")
    assert e.value.code is E.STORE_KEY_MISSING
    with pytest.raises(StoreError) as e:
        a.put("bad//key", np.zeros(2))
    assert e.value.code is E.INVALID_STORE_KEY
    # the connection still serves after those refusals
    assert a.get_array(key).tolist() == list(range(6))


def test_keys_du_delete_and_info_over_the_mesh(two_ranks):
    a, b = two_ranks
    for i in range(6):
        (a if i % 2 else b).put(f"p/{i}", np.full(i + 1, i, np.float32))
    assert a.keys("p/") == b.keys("p/") == [f"p/{i}" for i in range(6)]
    assert a.du("p/") == sum(4 * (i + 1) for i in range(6))  # each key once, not once per replica
    assert b.info("p/3").shape == (4,) and b.info("p/3").nbytes == 16
    a.delete("p/3")
    assert "p/3" not in b and b.keys("p/") == [f"p/{i}" for i in (0, 1, 2, 4, 5)]
    with pytest.raises(KeyMissing):
        b.delete("p/3")


def test_a_replica_rank_that_is_gone_is_skipped_and_a_key_with_no_live_copy_is_lost(two_ranks, tmp_path):
    a, b = two_ranks
    key = key_homed_on(1)
    a.put(key, np.ones(3, np.float32))
    b.local.delete(key)
    a._unreachable[0] = "test"  # as if rank 0 were lost: rank 1 holds no copy
    with pytest.raises(KeyLost) as e:
        a.get(key)
    assert e.value.code is E.STORE_KEY_LOST and e.value.lost == [0] and key in str(e.value)
    del a._unreachable[0]
    np.testing.assert_array_equal(a.get_array(key), np.ones(3, np.float32))


def test_a_put_the_server_cannot_hold_is_refused_and_the_connection_goes_on(two_ranks, monkeypatch):
    a, _ = two_ranks
    key = key_homed_on(1)
    monkeypatch.setattr("dtm.store.service.available_bytes", lambda: 1000)
    with pytest.raises(StoreError) as e:
        a.put(key, np.zeros(4096, np.float32))  # 16 KiB over 1000 bytes free
    assert e.value.code is E.STORE_IO_ERROR and "1000 bytes of memory are free" in str(e.value)
    monkeypatch.setattr("dtm.store.service.available_bytes", lambda: 1 << 40)
    a.put(key, np.arange(5, dtype=np.int32))
    assert a._conns[1].sock.fileno() >= 0  # the same connection took the next request
    np.testing.assert_array_equal(a.get_array(key), np.arange(5, dtype=np.int32))


def _raw_conn(stores) -> StoreConnection:
    st = stores[0]
    return StoreConnection.connect(st.pg.service_addresses[1], TOKEN, rank=0, epoch=1, timeout=10, peer="rank 1")


def test_a_data_frame_with_a_bad_crc_is_refused_with_an_error_frame(two_ranks):
    conn = _raw_conn(two_ranks)
    x = np.arange(8, dtype=np.float32)
    req = StoreRequest(0, "put", "crc/x", "f32", (8,), 0, 32)
    conn.send(req)
    parts = frame_parts(Data(0, 0, 0, 0, memoryview(x.view(np.uint8))), epoch=1, stream=0, seq=conn.hs.next_seq)
    frame = bytearray(b"".join(bytes(p) for p in parts))
    frame[-1] ^= 0xFF  # one flipped bit of tensor data
    conn.sock.sendall(frame)
    with pytest.raises(DTMError) as e:
        conn.receive(time.monotonic() + 10, "test")
    assert e.value.code is E.CHECKSUM_MISMATCH
    conn.close()
    assert "crc/x" not in two_ranks[1].local  # nothing was stored


def test_a_quantized_put_of_partial_blocks_is_refused_not_cut(two_ranks):
    """q8_0 [2, 33] is not whole blocks (spec 2.2): it has no storage size, where the floor
    of 33 / 32 used to make one of 68 bytes and store the tensor as if it were [2, 32]."""
    conn = _raw_conn(two_ranks)
    conn.send(StoreRequest(0, "put", "q/x", "q8_0", (2, 33), 0, 68), memoryview(bytes(68)))
    reply = conn.receive(time.monotonic() + 10, "test")
    assert reply.code == "E0408" and "multiple of 32" in reply.message, reply
    conn.close()
    assert "q/x" not in two_ranks[1].local  # nothing was stored


def test_a_put_whose_size_disagrees_with_its_type_is_refused(two_ranks):
    conn = _raw_conn(two_ranks)
    conn.send(StoreRequest(0, "put", "size/x", "f32", (8,), 0, 1 << 40))  # 2^40 bytes for 8 floats
    with pytest.raises(DTMError) as e:
        conn.receive(time.monotonic() + 10, "test")
    assert e.value.code is E.BAD_PAYLOAD and "announces 1099511627776 bytes" in str(e.value)
    conn.close()


def test_a_frame_past_the_payload_bound_is_refused_before_allocating(two_ranks):
    conn = _raw_conn(two_ranks)
    header = bytearray(encode_header(MsgType.STORE_REQUEST, b"", epoch=1, stream=0, seq=conn.hs.next_seq))
    header[16:24] = (1 << 40).to_bytes(8, "little")  # length: 1 TiB
    conn.sock.sendall(bytes(header))
    with pytest.raises(DTMError) as e:
        conn.receive(time.monotonic() + 10, "test")
    assert e.value.code is E.FRAME_TOO_LARGE
    conn.close()


def test_a_wrong_token_is_refused_at_the_handshake(two_ranks):
    with pytest.raises(DTMError) as e:
        StoreConnection.connect(two_ranks[0].pg.service_addresses[1], b"not the token", rank=0, epoch=1, timeout=10,
                                peer="rank 1")
    assert e.value.code is E.AUTH_FAILED


def test_without_a_mesh_the_mesh_store_is_not_initialized():
    with pytest.raises(StoreError) as e:
        dtm.store.mesh()
    assert e.value.code is E.NOT_INITIALIZED and "dtm.init()" in str(e.value)


def test_a_data_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DTM_MESH_STORE", str(tmp_path))
    assert mesh_mod.root_for("abc") == str(tmp_path / "dtmabc_store")


def test_a_copy_with_a_corrupt_chunk_is_passed_over_for_a_good_one(two_ranks):
    a, b = two_ranks
    key = key_homed_on(1)
    x = np.arange(64, dtype=np.float32)
    a.put(key, x)  # on both ranks
    entry = b.local.info(key)
    chunk = next(p for p in (pathlib.Path(b.local.url.removeprefix("file://")) / entry.dir).rglob("*")
                 if p.is_file() and p.name != "zarr.json")
    raw = bytearray(chunk.read_bytes())
    raw[0] ^= 1
    chunk.write_bytes(bytes(raw))  # rank 1's copy is damaged
    order = placement(key, 2)
    assert order[0] == 1  # rank 1 is asked first ...
    np.testing.assert_array_equal(a.get_array(key), x)  # ... and rank 0's good copy is returned
    a.local.delete(key)
    with pytest.raises(StoreError) as e:  # no good copy left: the checksum error, naming the key
        a.get_array(key)
    assert e.value.code is E.STORE_CHUNK_CORRUPT and key in str(e.value)


def test_a_distributed_tensor_is_refused_not_gathered(two_ranks):
    a, _ = two_ranks
    x = dtm.distribute(dtm.tensor(np.arange(8, dtype=np.float32)), dtm.parallel.Mesh({"x": 2}), [dtm.Shard(0)])
    with pytest.raises(StoreError) as e:
        a.put("d/x", x)
    assert e.value.code is E.INVALID_PLACEMENT and "dtm.store.open" in str(e.value)
    assert "d/x" not in a


class _Membership:
    """What a MeshStore reads of its rank's membership: the lost and left ranks, and the
    watchers that the coordinator's notice of a loss wakes."""

    def __init__(self):
        self.lost: dict[int, str] = {}
        self.left: dict[int, str] = {}
        self._watchers = []

    def watch_lost(self, fn) -> None:
        self._watchers.append(fn)

    def watch_cancel(self, fn) -> None:
        pass  # (no job is cancelled here: tests/test_cancel.py cancels real ones)

    def declare_lost(self, rank: int, notice: str) -> None:
        self.lost[rank] = notice
        for fn in self._watchers:
            fn(rank, notice)


@contextlib.contextmanager
def _silent_peer(tmp_path, answer):
    """Rank 0's MeshStore (replicas=1, a 30 s timeout) against a rank 1 whose service runs
    `answer(conn)` on its first connection, then says nothing more; rank 1 is declared lost
    1 s after the start. Yields (store, start time)."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        sock, _ = listener.accept()
        conn = StoreConnection.accept(sock, TOKEN, rank=1, epoch=1, timeout=10)
        answer(conn)
        done.wait(60)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    m = _Membership()
    pg = SimpleNamespace(rank=0, world_size=2, membership=m, nodes=("a", "b"),
                         service_addresses=(("127.0.0.1", 1), listener.getsockname()[:2]), token=TOKEN, epoch=1,
                         session="test")
    st = MeshStore(pg, open_local(str(tmp_path / "rank-0")), str(tmp_path), replicas=1, share_memory=False,
                   timeout=30)
    timer = threading.Timer(1.0, m.declare_lost, (1, "the coordinator lost rank 1: no Heartbeat for 1.0 s"))
    timer.start()
    try:
        yield st, time.monotonic()
    finally:
        timer.cancel()
        done.set()
        st.close()
        st.local.close()
        listener.close()


def test_a_peer_that_stalls_mid_reply_is_left_once_it_is_declared_lost(tmp_path):
    """Rank 1 sends a get's reply and half its bytes, then nothing: the get ends when rank 1
    is declared lost (after 1 s), not at the store's 30 s timeout (E0802)."""
    def half_a_reply(conn: StoreConnection) -> None:
        req = conn.receive(time.monotonic() + 10, "test")
        x = np.zeros(1 << 16, np.float32)
        conn.send(StoreReply(req.id, "", "", "f32", x.shape, x.nbytes, 1, "", 0.0, ()),
                  memoryview(x.view(np.uint8))[:x.nbytes // 2])

    key = key_homed_on(1)
    with _silent_peer(tmp_path, half_a_reply) as (st, start):
        with pytest.raises(KeyLost) as e:
            st.get_array(key)
        waited = time.monotonic() - start
    assert waited < 10, waited
    assert e.value.code is E.STORE_KEY_LOST and e.value.lost == [1], e.value
    cause = e.value.__cause__
    assert isinstance(cause, PeerLost) and cause.peer == 1 and cause.op == f"store get {key!r}", cause
    assert "this rank waited" in str(e.value) and "no Heartbeat for 1.0 s" in str(e.value), e.value


def test_a_put_to_a_peer_that_stopped_reading_goes_to_the_next_rank_once_it_is_declared_lost(tmp_path):
    """Rank 1 reads nothing: the put's send blocks once the socket's buffers are full, until
    rank 1 is declared lost; the key then goes to its next rank, this one."""
    key = key_homed_on(1)
    x = np.ones(16 << 20, np.float32)  # 64 MiB: far past what the sockets buffer
    result = {}

    def put() -> None:
        try:
            result["info"] = st.put(key, x)
        except DTMError as err:
            result["error"] = err

    with _silent_peer(tmp_path, lambda conn: None) as (st, start):
        putter = threading.Thread(target=put, daemon=True)
        putter.start()
        putter.join(20)
        waited = time.monotonic() - start
        assert not putter.is_alive(), "the put still waits for rank 1"
        assert "info" in result and waited < 10, (result, waited)
        assert st.local.info(key).shape == x.shape and "rank 1 was lost during store put" in st._unreachable[1]
