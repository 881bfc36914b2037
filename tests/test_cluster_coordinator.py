"""The coordinator (dtm/cluster, spec 9.6) against well- and ill-behaved peers on 127.0.0.1.

Ranks here are threads of the test process calling `dtm.cluster.join`, with real sockets;
tests/test_cluster_processes.py runs ranks as processes. Every wait is bounded.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time

import pytest

from dtm.cluster import Coordinator, join
from dtm.cluster.coordinator import RELAY_MAX
from dtm.cluster.membership import Membership
from dtm.errors import DTMError, ErrorCode as E
from dtm.protocol import Hello, JoinMesh, encode_header, encode_message
from dtm.protocol.frame import MsgType
from dtm.protocol.messages import CHALLENGE_SIZE

TOKEN = b"cluster token for tests"


@pytest.fixture
def coordinator():
    """make(world_size, **kw): a started Coordinator, stopped after the test."""
    made: list[Coordinator] = []

    def make(world_size: int, **kw) -> Coordinator:
        c = Coordinator(world_size, kw.pop("token", TOKEN), **kw).start()
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def _join_all(address, n: int, *, timeout: float = 10.0, ranks=None):
    """n ranks joining from threads: a list of Membership or the exception each got."""
    results: list = [None] * n
    listeners = []

    def one(i: int) -> None:
        try:
            m, listener = join(address, TOKEN, rank=-1 if ranks is None else ranks[i], world_size=n if ranks is None
                               else 0, timeout=timeout)
            listeners.append(listener)
            results[i] = m
        except Exception as e:  # noqa: BLE001 - reported to the test
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    for listener in listeners:
        listener.close()
    return results


def _leave_all(members) -> None:
    for m in members:
        if isinstance(m, Membership):
            m.leave("test over")


def _logged(caplog, *texts: str, timeout: float = 5.0) -> bool:
    """Whether every one of `texts` is in the captured log within `timeout` s (the
    coordinator logs from its own thread)."""
    deadline = time.monotonic() + timeout
    while not all(t in caplog.text for t in texts) and time.monotonic() < deadline:
        time.sleep(0.01)
    return all(t in caplog.text for t in texts)


def _hello() -> Hello:
    return Hello(((1, 0),), 1, 0x3F, 1 << 20, -1, "junk", os.urandom(CHALLENGE_SIZE))


def _send_and_wait_close(address, data: bytes, *, close_after_send: bool = False, timeout: float = 10.0) -> bool:
    """Send `data`; True when the coordinator then closes the connection within `timeout`."""
    s = socket.create_connection(address, timeout=timeout)
    try:
        s.sendall(data)
        if close_after_send:
            s.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if not s.recv(1 << 16):
                    return True
            except ConnectionResetError:
                return True
        return False
    finally:
        s.close()


def test_ranks_join_and_get_one_view(coordinator):
    coord = coordinator(3, axes=(("a", 3),))
    members = _join_all(coord.address, 3)
    try:
        assert all(isinstance(m, Membership) for m in members), members
        assert sorted(m.rank for m in members) == [0, 1, 2]
        views = {m.view for m in members}
        assert len(views) == 1
        view = views.pop()
        assert view.epoch == 1 and view.axes == (("a", 3),) and len(view.members) == 3
        for m in members:  # each rank is the index of its own data address in the view
            assert m.view.members[m.rank] == coord.view.members[m.rank]
        assert coord.formed.is_set()
    finally:
        _leave_all(members)
    assert coord.finished.wait(5) and coord.left == {0, 1, 2} and not coord.lost


def test_rank_conflicts_and_world_size_mismatch_are_refused(coordinator, caplog):
    caplog.set_level(logging.INFO, "dtm.cluster")
    coord = coordinator(2, join_timeout=30)
    out: dict = {}

    def joiner(key, rank, world):
        try:
            out[key] = join(coord.address, TOKEN, rank=rank, world_size=world, timeout=10)
        except DTMError as e:
            out[key] = e

    t = threading.Thread(target=joiner, args=("first", 1, 2))
    t.start()
    assert _logged(caplog, "joined as rank 1")
    joiner("dup", 1, 2)      # rank 1 is taken
    joiner("world", -1, 3)   # another world size
    joiner("big", 5, 0)      # not below the world size
    for key in ("dup", "world", "big"):
        assert isinstance(out[key], DTMError) and out[key].code is E.JOIN_REFUSED, out[key]
    assert "rank 1 is taken" in str(out["dup"]) and "world of 3" in str(out["world"]) and "rank 5" in str(out["big"])
    joiner("free", -1, 0)    # the coordinator chooses rank 0, the mesh forms
    t.join(15)
    m1, _ = out["first"]
    m0, _ = out["free"]
    try:
        assert (m0.rank, m1.rank) == (0, 1)
    finally:
        _leave_all([m0, m1])


def test_a_rank_that_never_comes_is_named_to_every_waiting_rank(coordinator):
    coord = coordinator(3, join_timeout=1.5)
    start = time.monotonic()
    results = _join_all(coord.address, 2, ranks=[0, 1], timeout=10)
    assert time.monotonic() - start < 8
    for r in results:
        assert isinstance(r, DTMError) and r.code is E.TIMEOUT, r
        assert "2 of 3 ranks joined" in r.message and "missing: rank(s) 2" in r.message, r.message
    assert coord.finished.is_set() and coord.error is not None


def test_wrong_token_is_refused_and_the_coordinator_serves_on(coordinator, caplog):
    caplog.set_level(logging.WARNING, "dtm.cluster")
    coord = coordinator(2)
    with pytest.raises(DTMError) as info:
        join(coord.address, b"not the token", world_size=2, timeout=5)
    assert info.value.code is E.AUTH_FAILED
    assert _logged(caplog, "E0909", "dropped the connection")
    members = _join_all(coord.address, 2)
    try:
        assert sorted(m.rank for m in members) == [0, 1]
    finally:
        _leave_all(members)


def _junk_frames() -> dict[str, tuple[bytes, E, bool]]:
    """name -> (bytes, the code the coordinator must log, close our side after sending)."""
    hello = encode_message(_hello(), epoch=0, stream=0, seq=0)
    payload = hello[40:]
    bad_crc = bytearray(hello)
    bad_crc[-1] ^= 0x01
    rng = bytes(range(7, 7 + 200))  # deterministic "random" bytes that do not start with DTMW
    return {
        "random bytes": (os.urandom(3) + b"\x00" + rng, E.BAD_MAGIC, False),
        "wrong magic": (b"DTMX" + hello[4:], E.BAD_MAGIC, False),
        "truncated": (hello[:len(hello) - 5], E.TRUNCATED_FRAME, True),
        "truncated header": (hello[:20], E.TRUNCATED_FRAME, True),
        "oversized length": (encode_header(Hello.TYPE, b"", epoch=0, stream=0, seq=0)[:16]
                             + (1 << 40).to_bytes(8, "little") + hello[24:40], E.FRAME_TOO_LARGE, False),
        "newer major": (encode_header(Hello.TYPE, payload, epoch=0, stream=0, seq=0, version=(9, 0)) + payload,
                        E.UNSUPPORTED_PROTOCOL_VERSION, False),
        "bad crc": (bytes(bad_crc), E.CHECKSUM_MISMATCH, False),
        "unknown type": (hello[:6] + b"\x63" + hello[7:], E.UNKNOWN_MESSAGE, False),
        "JoinMesh before Hello": (encode_message(JoinMesh(0, 2, "127.0.0.1", 1, "n", 1), epoch=0, stream=0, seq=0),
                                  E.UNEXPECTED_MESSAGE, False),
    }


def test_junk_is_dropped_with_a_logged_reason_and_real_ranks_still_join(coordinator, caplog):
    caplog.set_level(logging.WARNING, "dtm.cluster")
    coord = coordinator(2)
    for name, (data, code, close) in _junk_frames().items():
        caplog.clear()
        assert _send_and_wait_close(coord.address, data, close_after_send=close), f"{name}: connection not dropped"
        assert _logged(caplog, code.value, "dropped the connection"), f"{name}: {caplog.text}"
    members = _join_all(coord.address, 2)
    try:
        assert sorted(m.rank for m in members) == [0, 1]
    finally:
        _leave_all(members)


def test_a_flood_of_silent_connections_stays_capped(coordinator):
    cap = 8
    coord = coordinator(2, max_pending=cap, hello_timeout=30)
    socks = []
    try:
        for i in range(120):
            s = socket.create_connection(coord.address, timeout=5)
            s.sendall(b"DTMW\x01\x00")  # a header begun, never finished
            socks.append(s)
            if i % 10 == 0:
                assert coord.pending_count <= cap
        deadline = time.monotonic() + 10
        while coord.pending_count > cap and time.monotonic() < deadline:  # let it accept the backlog
            time.sleep(0.01)
        time.sleep(0.2)
        assert coord.max_pending_seen <= cap
        # The oldest went as new ones came: all but the newest `cap` were closed by the coordinator.
        closed = 0
        for s in socks:
            s.settimeout(0.2)
            try:
                closed += s.recv(16) == b""
            except ConnectionResetError:
                closed += 1
            except socket.timeout:
                pass
        assert closed >= len(socks) - cap
        members = _join_all(coord.address, 2)  # real ranks push the silent ones out and join
        try:
            assert sorted(m.rank for m in members) == [0, 1]
        finally:
            _leave_all(members)
    finally:
        for s in socks:
            s.close()


def test_a_silent_connection_is_dropped_after_the_hello_deadline(coordinator, caplog):
    caplog.set_level(logging.WARNING, "dtm.cluster")
    coord = coordinator(2, hello_timeout=0.5)
    start = time.monotonic()
    assert _send_and_wait_close(coord.address, b"", timeout=5)
    assert time.monotonic() - start < 4
    assert _logged(caplog, "within 0.5 s")
    assert coord.pending_count == 0


def test_a_rank_refuses_a_huge_frame_before_the_coordinator_is_authenticated():
    """Issue 37: a listener posing as the coordinator announces a 1 MiB Hello (more than any
    control message): the joining rank refuses it from its 40-byte header (E0904) at once,
    instead of buffering what follows while the handshake waits."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)

    def pose() -> None:
        conn, _ = server.accept()
        header = bytearray(encode_header(MsgType.HELLO, b"", epoch=0, stream=0, seq=0))
        header[16:24] = (1 << 20).to_bytes(8, "little")  # the payload length; none follows
        conn.sendall(bytes(header))
        time.sleep(5)
        conn.close()

    t = threading.Thread(target=pose, daemon=True)
    t.start()
    with pytest.raises(DTMError) as e:  # (before: PEER_LOST once the poser closed, 5 s later)
        join(server.getsockname(), b"t" * 32, timeout=20)
    assert e.value.code is E.FRAME_TOO_LARGE, e.value
    server.close()


def test_init_without_a_coordinator_is_a_group_of_one(monkeypatch):
    import numpy as np

    import dtm

    for k in [k for k in os.environ if k.startswith("DTM_")]:
        monkeypatch.delenv(k)
    with pytest.raises(DTMError) as info:
        dtm.rank()
    assert info.value.code is E.NOT_INITIALIZED
    dtm.init(timeout=5)
    try:
        assert (dtm.rank(), dtm.world_size()) == (0, 1)
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        np.testing.assert_array_equal(dtm.distributed.all_reduce(x, op="max"), x)
        np.testing.assert_array_equal(dtm.distributed.all_gather(dtm.tensor(x), dim=1).numpy(), x)
        with pytest.raises(DTMError) as info:
            dtm.distributed.all_reduce(x, axis="dp")
        assert info.value.code is E.UNKNOWN_MESH_AXIS
    finally:
        dtm.shutdown()
    with pytest.raises(DTMError) as info:
        dtm.distributed.barrier()
    assert info.value.code is E.NOT_INITIALIZED


@pytest.mark.parametrize("env, names", [
    ({"DTM_WORLD_SIZE": "2"}, "DTM_COORDINATOR"),
    ({"DTM_COORDINATOR": "127.0.0.1", "DTM_WORLD_SIZE": "2"}, "DTM_COORDINATOR"),
    ({"DTM_COORDINATOR": "127.0.0.1:1", "DTM_WORLD_SIZE": "2", "DTM_RANK": "2"}, "DTM_RANK"),
    ({"DTM_COORDINATOR": "127.0.0.1:1", "DTM_RANK": "0"}, "DTM_WORLD_SIZE"),
    ({"DTM_MESH_AXES": "dp=two"}, "DTM_MESH_AXES"),
])
def test_a_bad_environment_is_named(env, names):
    from dtm.cluster import rank_env

    with pytest.raises(DTMError) as info:
        rank_env(env)
    assert info.value.code is E.NOT_INITIALIZED and names in info.value.message


def test_a_whole_mesh_reset_at_once_is_lost_one_by_one(coordinator):
    """150 members' connections reset at once (a job torn down, a switch gone): each loss is
    told to the others, whose sends fail in turn. The coordinator loses them one after
    another; nested, one loss inside the other's notice, it would pass Python's recursion
    limit and its thread would die with the mesh half lost."""
    n = 150
    coord = coordinator(n, join_timeout=60)
    members = _join_all(coord.address, n, timeout=60)
    assert all(isinstance(m, Membership) for m in members), [m for m in members if not isinstance(m, Membership)][:1]
    parked, go_on = threading.Event(), threading.Event()
    check = coord._check_deadlines

    def parking(now: float) -> None:  # holds the coordinator's loop while every member goes
        parked.set()
        go_on.wait(10)
        check(now)
    coord._check_deadlines = parking
    assert parked.wait(10)
    for m in members:  # RST, not FIN: the coordinator's next send to each fails at once
        m._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        m._sock.close()
    go_on.set()
    assert coord.finished.wait(20), f"{len(coord.lost)} of {n} lost; the coordinator thread: {coord._thread}"
    assert len(coord.lost) == n


@pytest.mark.parametrize("n", [3, RELAY_MAX + 1])
def test_heartbeats_relayed_in_a_small_mesh_and_not_in_a_large_one(coordinator, n):
    """Up to RELAY_MAX members each hears every member's heartbeat (their last operations);
    past it each hears only the coordinator's own (spec 9.6.4): members^2 frames per
    interval would swamp the coordinator. Either way no member takes the coordinator for
    lost, nor the coordinator a member, over several timeouts."""
    coord = coordinator(n, heartbeat_ms=50, timeout_ms=400, join_timeout=60)
    members = _join_all(coord.address, n, timeout=60)
    try:
        for m in members:
            m.start()
        time.sleep(1.5)
        assert not coord.lost and all(m.coordinator_gone is None and not m.lost for m in members)
        heard = [set(m.peers) for m in members]
        assert heard == ([set(range(n))] * n if n <= RELAY_MAX else [set()] * n)
    finally:
        _leave_all(members)
