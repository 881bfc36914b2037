"""What a rank's store service (spec 9.2.11) allocates and holds for what a peer announces:
handshake frames are bounded before the peer is authenticated, connections and threads per
service are bounded, a request's frames hold only what the request may carry, a refused put
is answered before its bytes, and a get's reply that announces more than this machine holds
is a DTMError. Every service runs on 127.0.0.1; every wait is bounded."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from dtm.errors import DTMError, ErrorCode as E
from dtm.protocol.frame import FrameDecoder, MsgType, encode_header
from dtm.protocol.messages import Data, StoreReply, StoreRequest, decode_message, frame_parts
from dtm.store import service as service_mod
from dtm.store.mesh_store import MeshStore, open_local, placement
from dtm.store.service import StoreServer
from dtm.store.wire import StoreConnection

TOKEN = b"service bounds token"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _serve(tmp_path, **kw) -> tuple[StoreServer, tuple[str, int], object]:
    listener = socket.create_server(("127.0.0.1", 0))
    local = open_local(str(tmp_path / "rank-1"))
    return StoreServer(local, listener, TOKEN, rank=1, epoch=1, **kw), listener.getsockname(), local


@pytest.fixture
def service(tmp_path):
    """Rank 1's service over its own directory store: (server, address, its store)."""
    server, address, local = _serve(tmp_path)
    yield server, address, local
    server.close()
    local.close()


def _connect(address, timeout: float = 10) -> StoreConnection:
    return StoreConnection.connect(address, TOKEN, rank=0, epoch=1, timeout=timeout, peer="rank 1")


def _huge_header(msg_type: MsgType, length: int, *, epoch: int = 0, seq: int = 0) -> bytes:
    """A well-formed 40-byte header that announces `length` payload bytes (none follow)."""
    header = bytearray(encode_header(msg_type, b"", epoch=epoch, stream=0, seq=seq))
    header[16:24] = length.to_bytes(8, "little")
    return bytes(header)


def _error_code(sock: socket.socket, wait: float) -> str | None:
    """The code of the Error frame the other side sends before it closes, or None when it
    closes (or `wait` seconds pass) without one."""
    decoder = FrameDecoder()
    end = time.monotonic() + wait
    while time.monotonic() < end:
        if not select.select([sock], [], [], max(0.0, end - time.monotonic()))[0]:
            break
        try:
            data = sock.recv(1 << 16)
        except ConnectionResetError:
            return None
        if not data:
            return None
        for header, payload in decoder.feed(data):
            if header.msg_type is MsgType.ERROR:
                return decode_message(header, payload).code
    return None


# --- before the peer is authenticated -----------------------------------------------------------

SERVICE_PROCESS = r"""
import socket, sys
from dtm.store.mesh_store import open_local
from dtm.store.service import StoreServer
listener = socket.create_server(("127.0.0.1", 0))
server = StoreServer(open_local(sys.argv[1]), listener, b"t", rank=1, epoch=1)
print(listener.getsockname()[1], flush=True)
sys.stdin.read()  # serve until the test closes stdin
"""


def _memory(pid: int, field: str) -> int:
    """A /proc/PID/status figure (VmRSS, VmHWM) in bytes."""
    with open(f"/proc/{pid}/status") as f:
        line = next(ln for ln in f if ln.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def test_hellos_announcing_1_gib_make_the_service_allocate_nothing(tmp_path):
    """Issue 37: a 40-byte header announcing 1 GiB made a rank allocate 1 GiB before any
    HMAC check and hold it for 10 s. The service's peak RSS may not grow by more than a few
    MiB for two such connections, and each is refused at once with E0904."""
    proc = subprocess.Popen([sys.executable, "-c", SERVICE_PROCESS, str(tmp_path / "part")], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    socks = []
    try:
        assert select.select([proc.stdout], [], [], 60)[0], "the service did not start within 60 s"
        port = int(proc.stdout.readline())
        time.sleep(0.2)
        before = _memory(proc.pid, "VmHWM")
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(_huge_header(MsgType.HELLO, 1 << 30))
            socks.append(s)
        time.sleep(1.0)  # long enough for a service that allocates to have done so
        grown = _memory(proc.pid, "VmHWM") - before
        print(f"service peak RSS grew by {grown / 2**20:.1f} MiB for two Hellos announcing 1 GiB each")
        assert grown < 32 << 20
        assert [_error_code(s, 5) for s in socks] == ["E0904", "E0904"]
    finally:
        for s in socks:
            s.close()
        proc.stdin.close()
        proc.wait(timeout=30)


def test_a_client_refuses_a_service_hello_announcing_1_gib_at_once():
    """The connecting side caps its handshake reads the same way."""
    listener = socket.create_server(("127.0.0.1", 0))

    def fake_service() -> None:
        sock, _ = listener.accept()
        with sock:
            sock.recv(1 << 16)
            sock.sendall(_huge_header(MsgType.HELLO, 1 << 30))
            sock.settimeout(10)
            try:
                sock.recv(1 << 16)
            except OSError:
                pass

    t = threading.Thread(target=fake_service, daemon=True)
    t.start()
    start = time.monotonic()
    try:
        with pytest.raises(DTMError) as e:
            _connect(listener.getsockname(), timeout=5)
        assert e.value.code is E.FRAME_TOO_LARGE and time.monotonic() - start < 4
    finally:
        t.join(15)
        listener.close()


# --- connections and threads ---------------------------------------------------------------------

def test_connections_past_the_bound_are_refused_at_once_with_the_reason(tmp_path):
    server, address, local = _serve(tmp_path, max_connections=2)
    held = [_connect(address) for _ in range(2)]
    try:
        start = time.monotonic()
        with pytest.raises(DTMError) as e:
            _connect(address)
        assert time.monotonic() - start < 5
        assert e.value.code is E.RECEIVE_BUFFER_FULL and "2 connections" in str(e.value), str(e.value)
        held.pop(0).close()  # a place comes free once the service sees the close
        end = time.monotonic() + 10
        while True:
            try:
                held.append(_connect(address))
                break
            except DTMError:
                assert time.monotonic() < end, "the closed connection's place never came free"
                time.sleep(0.05)
    finally:
        for c in held:
            c.close()
        server.close()
        local.close()


def test_connections_that_never_say_hello_make_room_for_one_that_does(tmp_path):
    """At the bound, the oldest connection still in its handshake goes (with the reason),
    so silent strangers cannot keep a peer out."""
    server, address, local = _serve(tmp_path, max_connections=3)
    silent = [socket.create_connection(address, timeout=10) for _ in range(3)]
    try:
        time.sleep(0.2)
        _connect(address).close()  # within its own timeout, though 3 strangers held every place
        assert _error_code(silent[0], 5) == E.RECEIVE_BUFFER_FULL.value
    finally:
        for s in silent:
            s.close()
        server.close()
        local.close()


def test_many_connections_share_a_fixed_pool_of_threads(service):
    _, address, _ = service
    before = threading.active_count()
    conns = [_connect(address) for _ in range(24)]
    try:
        for i, c in enumerate(conns):
            c.send(StoreRequest(0, "info", f"missing/{i}", "", (), 0, 0))
        for c in conns:
            assert c.receive(time.monotonic() + 10, "test").code == E.STORE_KEY_MISSING.value
        assert threading.active_count() - before <= service_mod.WORKERS
    finally:
        for c in conns:
            c.close()


# --- what an authenticated peer's frames may take -------------------------------------------------

@pytest.mark.parametrize("during", ["a request", "a put's bytes"])
def test_a_frame_longer_than_its_request_may_carry_is_refused_before_it_is_read(service, during):
    """A StoreRequest (or the Error that may come where Data is due) fits in 64 KiB: a
    header announcing 1 MiB is E0904 at once, not a 1 MiB buffer and a wait for it."""
    _, address, _ = service
    conn = _connect(address)
    try:
        if during == "a put's bytes":
            conn.send(StoreRequest(0, "put", "k/x", "f32", (16,), 0, 64))
        conn.sock.sendall(_huge_header(MsgType.STORE_REQUEST, 1 << 20, epoch=1, seq=conn.hs.next_seq))
        start = time.monotonic()
        with pytest.raises(DTMError) as e:
            conn.receive(start + 10, "test")
        assert e.value.code is E.FRAME_TOO_LARGE and time.monotonic() - start < 5
    finally:
        conn.close()


@pytest.mark.parametrize("why", ["memory", "quota"])
def test_a_refused_put_is_answered_before_its_bytes_and_the_connection_goes_on(service, monkeypatch, why):
    _, address, local = service
    if why == "memory":
        monkeypatch.setattr("dtm.store.service.available_bytes", lambda: 1000)
    else:
        local.set_quota(1000)
    conn = _connect(address)
    try:
        conn.send(StoreRequest(0, "put", "big/x", "f32", (1 << 20,), 0, 4 << 20))  # 4 MiB announced, none sent
        start = time.monotonic()
        reply = conn.receive(start + 10, "test")
        assert time.monotonic() - start < 5
        want = E.STORE_IO_ERROR if why == "memory" else E.STORE_QUOTA_EXCEEDED
        assert reply.code == want.value, reply
        # The client stopped sending the put's bytes: its next request is read where it starts.
        conn.send(StoreRequest(1, "info", "big/x", "", (), 0, 0))
        assert conn.receive(time.monotonic() + 10, "test").code == E.STORE_KEY_MISSING.value
    finally:
        conn.close()


def _mesh_store(address, tmp_path) -> MeshStore:
    pg = SimpleNamespace(rank=0, world_size=2, membership=None, nodes=("a", "b"),
                         service_addresses=(("127.0.0.1", 1), address), token=TOKEN, epoch=1, session="test")
    return MeshStore(pg, open_local(str(tmp_path / "rank-0")), str(tmp_path), share_memory=False, replicas=1,
                     timeout=10)


def _homed_on_1() -> str:
    return next(f"k{i}" for i in range(1000) if placement(f"k{i}", 2)[0] == 1)


def test_a_client_stops_sending_a_put_the_service_refused(service, tmp_path, monkeypatch):
    """128 MiB put to a service that refuses it at once: the client sends far fewer than the
    put's 256 Data frames before it reads the refusal, and the connection goes on."""
    _, address, _ = service
    monkeypatch.setattr("dtm.store.service.available_bytes", lambda: 1000)
    st = _mesh_store(address, tmp_path)
    key = _homed_on_1()
    try:
        with pytest.raises(DTMError) as e:
            st.put(key, np.zeros(32 << 20, np.float32))
        assert e.value.code is E.STORE_IO_ERROR
        sent = st._conns[1].hs.next_seq - 2 - 1  # frames after the two Hellos and the request
        assert sent < 128, f"the client sent {sent} of 256 Data frames after the refusal"
        monkeypatch.setattr("dtm.store.service.available_bytes", lambda: 1 << 40)
        st.put(key, np.arange(5, dtype=np.int32))
        np.testing.assert_array_equal(st.get_array(key), np.arange(5, dtype=np.int32))
    finally:
        st.close()
        st.local.close()


@pytest.mark.parametrize("lie", ["4 TiB", "another shape"])
def test_a_get_reply_announcing_what_was_not_asked_for_is_a_dtm_error(service, tmp_path, monkeypatch, lie):
    """A peer's reply announcing a 4 TiB tensor is E1003 (more than this machine holds),
    one whose shape is not the shape asked for E0910: each names the peer and the get,
    never a MemoryError, and the connection is dropped unread."""
    _, address, local = service
    key = _homed_on_1()
    local.put(key, np.ones(4, np.float32))
    shape = (1 << 40,) if lie == "4 TiB" else (5,)

    def lying_get(self, req):
        return StoreReply(req.id, "", "", "f32", shape, 4 * shape[0], 1, "00000000", 0.0, ()), None

    monkeypatch.setattr(StoreServer, "_get", lying_get)
    st = _mesh_store(address, tmp_path)
    try:
        with pytest.raises(DTMError) as e:
            st.get_array(key, shape=None if lie == "4 TiB" else (4,))
        want = E.RECEIVE_BUFFER_FULL if lie == "4 TiB" else E.BAD_PAYLOAD
        assert e.value.code is want and "rank 1" in str(e.value) and "get" in str(e.value), str(e.value)
        assert 1 not in st._conns  # dropped: its Data frames are never read
    finally:
        st.close()
        st.local.close()


def test_a_refused_put_s_bytes_hold_no_thread_while_its_client_idles(tmp_path, monkeypatch):
    """The one serving thread drops what came of a refused put, then serves another peer
    while the first one's client sends nothing more."""
    monkeypatch.setattr("dtm.store.service.available_bytes", lambda: 1000)
    server, address, local = _serve(tmp_path, workers=1)
    first, second = _connect(address), _connect(address)
    try:
        data = memoryview(np.zeros(1 << 20, np.uint8))
        first.send(StoreRequest(0, "put", "big/x", "u8", (4 << 20,), 0, 4 << 20))
        first.sock.sendall(b"".join(bytes(p) for p in frame_parts(Data(0, 0, 0, 0, data), epoch=1, stream=0,
                                                                   seq=first.hs.next_seq)))
        first.hs.next_seq += 1  # one Data frame of four, then nothing: the client stopped
        assert first.receive(time.monotonic() + 10, "test").code == E.STORE_IO_ERROR.value
        second.send(StoreRequest(0, "info", "big/x", "", (), 0, 0))
        assert second.receive(time.monotonic() + 5, "test").code == E.STORE_KEY_MISSING.value
        first.send(StoreRequest(1, "info", "big/x", "", (), 0, 0))  # its stream kept its place
        assert first.receive(time.monotonic() + 5, "test").code == E.STORE_KEY_MISSING.value
    finally:
        first.close()
        second.close()
        server.close()
        local.close()


def test_close_ends_every_thread_and_connection(tmp_path):
    before = threading.active_count()
    server, address, local = _serve(tmp_path)
    conns = [_connect(address) for _ in range(3)]
    try:
        server.close()
        assert threading.active_count() == before
        for c in conns:
            assert _error_code(c.sock, 5) is None  # closed, with nothing more to say
        with pytest.raises(DTMError) as e:
            _connect(address, timeout=5)
        assert e.value.code is E.PEER_LOST
    finally:
        for c in conns:
            c.close()
        local.close()
