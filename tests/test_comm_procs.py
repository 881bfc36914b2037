"""dtm.comm between real processes on 127.0.0.1, over TCP and over shared memory: results
against numpy, desync, a corrupted Data frame, a rank killed with SIGKILL, a wrong token
and garbage at a listening port. Processes start with "spawn"; every wait is bounded.

Small thresholds (`COMM`, `SLOT`) make the test sizes take every algorithm: latency and
pipelined ring over TCP, replicated and sliced multi-round rounds in shared memory."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from dtm.comm import pump
from dtm.comm.transport import DATA_HEADER
from dtm.errors import ErrorCode
from dtm.protocol.frame import HEADER_SIZE, MsgType

BF16 = np.dtype(ml_dtypes.bfloat16)
COMM = dict(small_bytes=4 << 10, chunk_bytes=8 << 10)
SLOT = 16 << 10
CHANNEL = 12 << 10  # not a multiple of a frame: frames wrap around the channel's end mid-way
TOKEN = b"test-cluster-token"
SUM_SIZES = (0, 3, 250, 50_000, 1_048_579)  # the last over nontemporal.STREAM_BYTES: streamed out of shm
KILL_BOUND_S = 10.0  # survivors raise PeerLost within this after a rank is killed


# --- what each rank runs -----------------------------------------------------------------------

def data(rank: int, shape, dtype) -> np.ndarray:
    rng = np.random.default_rng(7 + rank)
    return (rng.integers(-8, 8, size=shape) / 4).astype(dtype)


def correctness(comm, rank, n):
    """A bit of everything; the parent checks each result against numpy."""
    out = {}
    for size in SUM_SIZES:
        out[f"sum{size}"] = comm.all_reduce(data(rank, (size,), np.float32))
    out["bf16"] = comm.all_reduce(data(rank, (30_000,), BF16))
    out["max_i32"] = comm.all_reduce((data(rank, (9_000,), np.float32) * 4).astype(np.int32), op="max")
    out["avg_f16"] = comm.all_reduce(data(rank, (7,), np.float16), op="avg")
    out["avg_f64"] = comm.all_reduce(data(rank, (20_001,), np.float64), op="avg")
    x = data(rank, (12, n * 700), np.float32)
    out["gather"] = comm.all_gather(x, dim=1)
    out["rs"] = comm.reduce_scatter(x, op="sum", dim=1)
    out["bcast"] = comm.broadcast(data(rank, (40_000,), np.float64), src=n - 1)
    def socket_bytes():  # bytes_sent counts shared memory too, in its own figure as well
        return comm.transport.bytes_sent - getattr(comm.transport, "shared_bytes_sent", 0)

    sent = socket_bytes()
    out["reduce"] = comm.reduce(data(rank, (20_000,), np.float32), dst=1)
    out["a2a"] = comm.all_to_all(data(rank, (n * 3, 500), np.float32), split_dim=0, concat_dim=1)
    out["socket_bytes"] = socket_bytes() - sent  # of reduce and all_to_all
    out["moved"] = comm.transport.bytes_sent
    comm.barrier()
    sent = socket_bytes()
    comm.send(data(rank, (5, 1000), BF16), dst=(rank + 1) % n)
    comm.send(data(rank, (3, 9000), np.float32), dst=(rank + 1) % n)  # many times the channel
    out["p2p"] = comm.recv((rank - 1) % n)
    out["p2p_big"] = comm.recv((rank - 1) % n)
    out["p2p_socket_bytes"] = socket_bytes() - sent
    sub = [n - 1, 0]
    if rank in sub:
        out["sub"] = comm.all_reduce(data(rank, (10_000,), np.float32), group=sub)
    if n == 4 and rank in (1, 2):
        out["sub"] = comm.all_gather(data(rank, (2, 3), np.float32), group=[2, 1])
    out["pump_runs"] = getattr(comm.transport, "pump_runs", 0)
    out["pump_handoffs"] = getattr(comm.transport, "pump_handoffs", 0)
    return out


def mismatch(comm, rank, n):
    x = np.zeros(1000, np.float32)
    comm.all_reduce(x)
    if rank == n - 1:
        comm.all_gather(x, dim=0)
    else:
        comm.all_reduce(x)


def mismatch_passed_on(comm, rank, n):
    """Rank 0 calls another collective than ranks 1 and 2 and finds out first: it has read
    their CollectiveStarts before its call, so it fails before it sends anything, and its
    Error goes to rank 1 alone (as when it is descheduled before the second send). Rank 2
    can learn why only from rank 1, which fails on the report and then leaves. Rank 0 says
    Leave only once rank 2 has ended: its Leave is all rank 2 would hear from it (the Error
    it would have sent first is the one left out), and would race rank 1's relay."""
    from dtm.protocol.frame import MsgType
    from dtm.protocol.messages import Error

    x = np.zeros(1000, np.float32)
    comm.all_reduce(x)
    if rank > 0:
        comm.all_reduce(x)
        return
    comm._report = lambda g, err: comm.transport.notify([1], g.stream, MsgType.ERROR,
                                                        Error.from_exception(err, 0).parts())
    group = comm._groups[tuple(range(n))]
    deadline = time.monotonic() + 10
    while len(group.pending.get(1, ())) < n - 1 and time.monotonic() < deadline:  # their starts of call #1
        comm.transport._progress(time.monotonic() + 0.05, (), "reading the others' starts")
    try:
        comm.all_gather(x, dim=0)
    finally:
        last = comm.transport._conns[2]
        while not (last.left or last.closed) and time.monotonic() < deadline:
            comm.transport._progress(time.monotonic() + 0.05, (), "waiting for rank 2 to end")


def mismatch_ring(comm, rank, n):
    """Ring-sized all_reduces: a sum (over TCP in ring_pump.c) on every rank but the last,
    which calls max (Python's ring)."""
    x = np.ones(50_000, np.float32)
    comm.all_reduce(x)
    comm.all_reduce(x, op="max" if rank == n - 1 else "sum")


def early(comm, rank, n):
    """Rank 0 reads what its left neighbour sent for an all_reduce before it joins it:
    those Data frames (and maybe half of one) are Python's when the ring starts."""
    x = data(rank, (300_000,), np.float32)
    comm.barrier()
    waiting = 0
    if rank == 0:
        time.sleep(0.5)
        comm.transport.poll("reading ahead")
        waiting = sum(len(q) for q in comm.transport._unexpected.values())
    return comm.all_reduce(x), waiting


def outsider_leaves(comm, rank, n):
    """Ranks 0-2 run ring all_reduces while rank 3, outside their group, leaves the mesh."""
    if rank == n - 1:
        time.sleep(0.2)
        return "left"
    group = list(range(n - 1))
    x = data(rank, (400_000,), np.float32)
    out = [comm.all_reduce(x, group=group) for _ in range(15)]
    return out[0], out[-1]


def corrupt(comm, rank, n):
    """An all_reduce whose first Data frame from rank 1 a proxy damages on the way
    (`_corrupting_proxy`)."""
    comm.all_reduce(np.ones(10_000, np.float32))


def killed(comm, rank, n):
    """The last rank SIGKILLs itself while everyone runs all_reduces; the others must raise."""
    x = np.ones(200_000, np.float32)
    if rank == n - 1:
        def die():
            _REPORT.put(("killed", rank, time.time(), []))
            time.sleep(0.1)  # let the queue's feeder thread send it
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(0.3, die).start()
    while True:
        comm.all_reduce(x, out=x)


def leaves(comm, rank, n):
    """The last rank closes its transport (what dtm.shutdown() does) between all_reduces
    while the others are inside one: they must fail naming it at once (spec 9.6.5)."""
    x = np.ones(200_000, np.float32)
    for _ in range(3):
        comm.all_reduce(x)
    if rank == n - 1:
        return time.time()  # rank_main closes the transport next
    while True:
        comm.all_reduce(x)


def leader_leaves(comm, rank, n):
    """Rank 0, which creates the group's segment at its first collective, leaves before
    that; the others, waiting for the segment, must fail naming it at once."""
    if rank == 0:
        return time.time()
    time.sleep(0.5)
    comm.all_reduce(np.ones(1000, np.float32))


def killed_sender(comm, rank, n):
    """Rank 1 SIGKILLs itself in the middle of a send far larger than a socket's or a
    channel's buffer, which rank 0 drains only later; rank 0, in recv, must raise."""
    if rank == 1:
        def die():
            _REPORT.put(("killed", rank, time.time(), []))
            time.sleep(0.1)  # let the queue's feeder thread send it
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(0.3, die).start()
        comm.send(np.ones(8_000_000, np.float32), dst=0)  # blocks until rank 0 drains it
        time.sleep(10)
    time.sleep(0.6)  # receive once rank 1 is dead
    comm.recv(1)


def cancelled_send(comm, rank, n):
    """Rank 1 is interrupted inside a send that waits for rank 0 to drain it; rank 0,
    which receives late, must fail with its Cancel (the unsent rest of the data is dropped,
    so the Cancel does not wait behind it), not wait for the rest."""
    comm.barrier()  # the two start together: under load one may return from connecting late
    if rank == 1:
        x = np.ones(8_000_000, np.float32)  # made first: under load its 32 MB took over 0.3 s to
        _interrupt_after(0.3)               # touch, and the interrupt came before the send began
        try:
            comm.send(x, dst=0)
        except KeyboardInterrupt:
            return "interrupted"
        return "sent"
    time.sleep(1.0)
    comm.recv(1)


def send_then_idle(comm, rank, n):
    """Rank 1 sends more than any buffer holds and then makes no DTM call for a while:
    rank 0's recv must still complete meanwhile (the send returns only once it is out)."""
    big = data(1, (4_000_000,), np.float32)
    if rank == 1:
        comm.send(big, dst=0)
        idle = time.time()
        time.sleep(2.0)
        return idle + 2.0
    time.sleep(0.3)
    got = comm.recv(1)
    return bool(np.array_equal(got, big)), time.time()


def served(comm, rank, n):
    """Keep the mesh busy for a while (the parent pokes at a listener meanwhile)."""
    end = time.monotonic() + 2.0
    while True:
        y = comm.all_reduce(np.full(3, rank + 1.0, np.float32))
        if comm.broadcast(np.array([time.monotonic() > end]), src=0)[0]:  # rank 0's clock decides
            return y


def severed(comm, rank, n):
    """Rank 0's failure detector (another thread) declares rank 1 lost while rank 0 waits
    for it; rank 1 is alive but slow."""
    if rank == 1:
        time.sleep(3.0)
        return None
    threading.Timer(0.3, comm.transport.sever, (1,)).start()
    t = time.monotonic()
    try:
        comm.recv(1)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return type(e).__name__, str(e), time.monotonic() - t


def _interrupt_after(seconds: float) -> None:
    """A KeyboardInterrupt in `seconds`, as Ctrl-C would raise it, wherever the rank waits."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt("Ctrl-C")
    signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def cancelled(comm, rank, n):
    """The last rank is interrupted while it waits in an all_reduce the others join late:
    it sends Cancel, and they fail the collective naming it."""
    x = np.ones(20_000, np.float32)
    comm.all_reduce(x)
    if rank == n - 1:
        _interrupt_after(0.3)
        try:
            comm.all_reduce(x)
        except KeyboardInterrupt:
            return "interrupted"
    time.sleep(1.0)
    comm.all_reduce(x)


def cancelled_recv(comm, rank, n):
    """Rank 0 is interrupted in a recv from rank 1; rank 1, which sends late, learns it."""
    comm.barrier()
    if rank == 0:
        _interrupt_after(0.3)
        try:
            comm.recv(1)
        except KeyboardInterrupt:
            return "interrupted"
    elif rank == 1:
        time.sleep(1.0)
        comm.send(np.ones(1000, np.float32), dst=0)  # the Cancel came long ago: delivered by send's poll
        return "not told"


SCENARIOS = {f.__name__: f for f in (correctness, mismatch, mismatch_passed_on, mismatch_ring, early, outsider_leaves, corrupt, killed, leaves,
                                     leader_leaves,
                                     killed_sender, send_then_idle, served, severed, cancelled, cancelled_recv,
                                     cancelled_send)}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


_REPORT = None  # the rank's queue to the parent


def rank_main(kind, scenario, rank, n, q_port, q_addrs, q_out, timeout):
    global _REPORT
    _REPORT = q_out
    records = _Records()
    logging.getLogger("dtm.comm").addHandler(records)
    comm = None
    try:
        from dtm.comm import Communicator
        from dtm.comm.shm import connect_local
        from dtm.comm.tcp import connect_mesh, listen
        listener = listen()
        q_port.put((rank, listener.getsockname()[1]))
        addresses = q_addrs.get(timeout=30)
        connect = connect_mesh if kind == "tcp" else connect_local
        extra = {} if kind == "tcp" else dict(slot_bytes=SLOT, channel_bytes=CHANNEL)
        if kind == "split":  # two hosts, as the transport sees it: ranks below n/2 and the others
            extra["local"] = [r for r in range(n) if (r < n // 2) == (rank < n // 2)]
        transport = connect(rank, n, addresses, TOKEN, listener=listener, timeout=timeout, **extra)
        comm = Communicator(transport, **COMM)
        result = SCENARIOS[scenario](comm, rank, n)
        q_out.put(("ok", rank, result, records.messages))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        q_out.put(("err", rank, (type(e).__name__, getattr(e, "code", None), str(e), time.time()), records.messages))
    finally:
        if comm is not None:
            comm.close()


def run_mesh(kind: str, n: int, scenario: str, *, timeout: float = 20.0, between=None):
    """Start n ranks, hand them each other's addresses, and collect one outcome per rank
    that reports one. `between(ports, release)`, when given, releases each rank itself
    (`release(r)` sends rank r the addresses) and may poke at the listeners meanwhile."""
    ctx = mp.get_context("spawn")
    q_port, q_out = ctx.Queue(), ctx.Queue()
    q_addrs = [ctx.Queue() for _ in range(n)]
    procs = [ctx.Process(target=rank_main, args=(kind, scenario, r, n, q_port, q_addrs[r], q_out, timeout),
                         daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    try:
        ports = dict(q_port.get(timeout=60) for _ in range(n))

        def release(r: int, addresses: list | None = None) -> None:
            q_addrs[r].put(addresses or [("127.0.0.1", ports[j]) for j in range(n)])

        if between is not None:
            between(ports, release)
        else:
            for r in range(n):
                release(r)
        outcomes = {}
        deadline = time.monotonic() + timeout + 30
        while len(outcomes) < n and time.monotonic() < deadline:
            try:
                status, rank, value, logs = q_out.get(timeout=0.2)
                outcomes[rank] = (status, value, logs)
            except queue.Empty:
                if all(p.exitcode is not None for r, p in enumerate(procs) if r not in outcomes):
                    break  # the rest ended without a word (killed)
        return outcomes, procs
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _dtm_segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("dtm")} if os.path.isdir("/dev/shm") else set()


# --- the tests --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,n", [("tcp", 2), ("tcp", 4), ("shm", 2), ("shm", 3), ("split", 4)])
def test_collectives_match_numpy(kind, n):
    """Every collective and send/recv against numpy. "split" is a mesh of two hosts of two
    ranks each: shared memory within a host, TCP between them."""
    before = _dtm_segments()
    outcomes, _ = run_mesh(kind, n, "correctness")
    assert sorted(outcomes) == list(range(n))
    errors = {r: o[1] for r, o in outcomes.items() if o[0] != "ok"}
    assert not errors, errors
    res = {r: o[1] for r, o in outcomes.items()}

    def each(fn, shape, dtype):
        return [fn(r, shape, dtype) for r in range(n)]

    for size in SUM_SIZES:
        want = np.sum(each(data, (size,), np.float32), axis=0, dtype=np.float64)
        for r in range(n):
            np.testing.assert_allclose(res[r][f"sum{size}"], want, rtol=1e-6)
            assert res[r][f"sum{size}"].tobytes() == res[0][f"sum{size}"].tobytes()
    bf = np.sum([x.astype(np.float64) for x in each(data, (30_000,), BF16)], axis=0).astype(BF16)
    ints = [(data(r, (9_000,), np.float32) * 4).astype(np.int32) for r in range(n)]
    f16 = (np.sum(each(data, (7,), np.float16), axis=0, dtype=np.float64) / n).astype(np.float16)
    xs = each(data, (12, n * 700), np.float32)
    total = np.sum(xs, axis=0, dtype=np.float64)
    for r in range(n):
        np.testing.assert_array_equal(res[r]["bf16"], bf)
        np.testing.assert_array_equal(res[r]["max_i32"], np.max(ints, axis=0))
        np.testing.assert_array_equal(res[r]["avg_f16"], f16)
        np.testing.assert_allclose(res[r]["avg_f64"], np.mean(each(data, (20_001,), np.float64), axis=0), rtol=1e-12)
        assert res[r]["avg_f64"].tobytes() == res[0]["avg_f64"].tobytes()
        if kind == "tcp" and pump.ring_pump() is not None:  # f32 sums and the f64 avg ran in C
            assert res[r]["pump_runs"] >= 2, res[r]["pump_runs"]
            # ... and took every Data frame itself: Python saw the CollectiveStarts at most
            assert res[r]["pump_handoffs"] <= res[r]["pump_runs"], (res[r]["pump_handoffs"], res[r]["pump_runs"])
        np.testing.assert_array_equal(res[r]["gather"], np.concatenate(xs, axis=1))
        np.testing.assert_allclose(res[r]["rs"], np.split(total, n, axis=1)[r], rtol=1e-6)
        np.testing.assert_array_equal(res[r]["bcast"], data(n - 1, (40_000,), np.float64))
        a2a = np.concatenate([np.split(data(j, (n * 3, 500), np.float32), n, axis=0)[r] for j in range(n)], axis=1)
        np.testing.assert_array_equal(res[r]["a2a"], a2a)
        np.testing.assert_array_equal(res[r]["p2p"], data((r - 1) % n, (5, 1000), BF16))
        np.testing.assert_array_equal(res[r]["p2p_big"], data((r - 1) % n, (3, 9000), np.float32))
    np.testing.assert_allclose(res[1]["reduce"], np.sum(each(data, (20_000,), np.float32), axis=0), rtol=1e-6)
    for r in range(n):  # shared memory carries them whole; sockets carry at least the data
        assert res[r]["socket_bytes"] == 0 if kind == "shm" else res[r]["socket_bytes"] > 20_000 * 4 // n
        same_host = kind == "shm" or (kind == "split" and (r < n // 2) == ((r + 1) % n < n // 2))
        assert res[r]["p2p_socket_bytes"] == 0 if same_host else res[r]["p2p_socket_bytes"] > 3 * 9000 * 4
        assert res[r]["moved"] > 200_000, "the bytes moved are counted whichever transport moved them"
    assert all(res[r]["reduce"] is None for r in range(n) if r != 1)
    sub = np.sum([data(r, (10_000,), np.float32) for r in (n - 1, 0)], axis=0)
    np.testing.assert_allclose(res[0]["sub"], sub, rtol=1e-6)
    if n == 4:
        np.testing.assert_array_equal(res[1]["sub"], np.concatenate([data(2, (2, 3), np.float32),
                                                                      data(1, (2, 3), np.float32)]))
    assert _dtm_segments() <= before, "shared memory segments were left behind"


@pytest.mark.parametrize("kind,n", [("tcp", 3), ("shm", 2)])
def test_mismatch_raises_on_every_rank(kind, n):
    outcomes, _ = run_mesh(kind, n, "mismatch")
    assert sorted(outcomes) == list(range(n))
    for status, (name, code, message, _), _logs in outcomes.values():
        assert status == "err" and code is ErrorCode.COLLECTIVE_MISMATCH, message
        assert "all_gather(dim=0)" in message and "all_reduce(sum)" in message
        assert "test_comm_procs.py:" in message


def test_a_mismatch_report_is_passed_on_before_its_hearer_leaves():
    """Spec 9.1.8: rank 2 hears of rank 0's mismatch through rank 1, before rank 1's Leave
    (without the relay it failed with E1001: a rank left during the all_reduce)."""
    outcomes, _ = run_mesh("tcp", 3, "mismatch_passed_on")
    assert sorted(outcomes) == [0, 1, 2]
    for status, (name, code, message, _), _logs in outcomes.values():
        assert status == "err" and code is ErrorCode.COLLECTIVE_MISMATCH, message
    assert "rank 0 reported: " in outcomes[2][1][2] and "all_gather(dim=0)" in outcomes[2][1][2]


def test_mismatch_in_the_ring_raises_on_every_rank():
    """Two ranks run the ring in C, the third in Python: all of them name both calls."""
    outcomes, _ = run_mesh("tcp", 3, "mismatch_ring")
    assert sorted(outcomes) == [0, 1, 2]
    for status, (name, code, message, _), _logs in outcomes.values():
        assert status == "err" and code is ErrorCode.COLLECTIVE_MISMATCH, message
        assert "all_reduce(max)" in message and "all_reduce(sum)" in message


def test_a_ring_takes_the_frames_that_came_before_it():
    outcomes, _ = run_mesh("tcp", 3, "early")
    want = np.sum([data(r, (300_000,), np.float32) for r in range(3)], axis=0, dtype=np.float64)
    for r in range(3):
        status, (result, waiting), _ = outcomes[r]
        assert status == "ok"
        np.testing.assert_allclose(result, want, rtol=1e-6)
        assert result.tobytes() == outcomes[0][1][0].tobytes()
    assert outcomes[0][1][1] > 0, "rank 0 read nothing ahead: the test did not test what it says"


def test_a_ring_goes_on_when_a_rank_outside_its_group_leaves():
    outcomes, _ = run_mesh("tcp", 4, "outsider_leaves")
    assert outcomes[3][:2] == ("ok", "left")
    want = np.sum([data(r, (400_000,), np.float32) for r in range(3)], axis=0, dtype=np.float64)
    for r in range(3):
        status, value, _ = outcomes[r]
        assert status == "ok", value
        for result in value:
            np.testing.assert_allclose(result, want, rtol=1e-6)


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_an_interrupted_collective_is_cancelled_on_every_rank(kind):
    outcomes, _ = run_mesh(kind, 3, "cancelled")
    assert outcomes[2][:2] == ("ok", "interrupted")
    for r in (0, 1):
        status, (name, code, message, _), _ = outcomes[r]
        assert (status, code) == ("err", ErrorCode.COLLECTIVE_ABORTED), message
        assert "rank 2 cancelled collective #1 on group [0, 1, 2]: interrupted by KeyboardInterrupt" in message


@pytest.mark.parametrize("kind", ["tcp", "shm"])
@pytest.mark.parametrize("scenario,interrupted,told", [("cancelled_recv", 0, 1), ("cancelled_send", 1, 0)])
def test_an_interrupted_transfer_is_cancelled(kind, scenario, interrupted, told):
    """A recv or a send interrupted from outside: the other side fails with its Cancel."""
    outcomes, _ = run_mesh(kind, 2, scenario)
    assert outcomes[interrupted][:2] == ("ok", "interrupted")
    status, (name, code, message, _), _ = outcomes[told]
    assert (status, code) == ("err", ErrorCode.COLLECTIVE_ABORTED), message
    assert (f"rank {interrupted} cancelled point-to-point transfer 0 with this rank: interrupted by "
            "KeyboardInterrupt") in message


def _corrupting_proxy(port: int) -> int:
    """A port that forwards one connection to `port` and flips the first tensor byte of
    the first Data frame the connecting side sends: bytes hurt in transit."""
    listener = socket.create_server(("127.0.0.1", 0))

    def copy(src: socket.socket, dst: socket.socket, damage: bool) -> None:
        try:
            forward(src, dst, damage)
        except OSError:  # a rank reset the connection (it closed with unread data) or it broke:
            try:         # the other rank is told, as a reset between the two would tell it
                dst.shutdown(socket.SHUT_RDWR)  # (without this one run in three waited its 20 s timeout)
            except OSError:
                pass

    def forward(src: socket.socket, dst: socket.socket, damage: bool) -> None:
        seen = bytearray()  # the stream so far, to find frame headers in
        frame, target = 0, None
        while data := src.recv(1 << 16):
            start = len(seen)
            seen += data
            while target is None and len(seen) >= frame + HEADER_SIZE:
                length = int.from_bytes(seen[frame + 16:frame + 24], "little")
                if damage and seen[frame + 6] == MsgType.DATA and length > DATA_HEADER.size:
                    target = frame + HEADER_SIZE + DATA_HEADER.size
                frame += HEADER_SIZE + length
            if target is not None and start <= target < len(seen):
                data = bytearray(data)
                data[target - start] ^= 0xFF
                target = -1
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)

    def serve() -> None:
        with listener:
            near, _ = listener.accept()
        far = socket.create_connection(("127.0.0.1", port))
        threading.Thread(target=copy, args=(far, near, False), daemon=True).start()
        copy(near, far, True)

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


@pytest.mark.parametrize("ring_pump", ["1", "0"])
def test_corrupted_data_frame_is_a_checksum_error(ring_pump, monkeypatch):
    """Over TCP, with the ring in C (ring_pump.c) and in Python."""
    monkeypatch.setenv("DTM_RING_PUMP", ring_pump)

    def through_proxy(ports, release):  # rank 1 connects to rank 0 through the proxy
        release(0)
        release(1, [("127.0.0.1", _corrupting_proxy(ports[0])), ("127.0.0.1", ports[1])])

    outcomes, _ = run_mesh("tcp", 2, "corrupt", between=through_proxy)
    status, (name, code, message, _), _ = outcomes[0]
    assert (status, name, code) == ("err", "ChecksumError", ErrorCode.CHECKSUM_MISMATCH), message
    assert "rank 1" in message and "CRC32C" in message
    assert outcomes[1][0] == "err"  # the sender is told, not left waiting


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_sigkill_mid_all_reduce_gives_peer_lost(kind):
    n = 3
    outcomes, procs = run_mesh(kind, n, "killed", timeout=30)
    assert procs[n - 1].exitcode == -signal.SIGKILL
    status, killed_at, _ = outcomes[n - 1]
    assert status == "killed"
    for r in range(n - 1):
        status, (name, code, message, when), _ = outcomes[r]
        assert status == "err" and code is ErrorCode.PEER_LOST, message
        assert "all_reduce" in message
        assert 0 < when - killed_at < KILL_BOUND_S


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_rank_that_leaves_mid_all_reduce_is_peer_lost_at_once(kind):
    """Spec 9.6.5 on every transport: shared memory too ends the survivors' wait with
    E1001 saying the rank left, not with E0802 at the timeout."""
    n = 3
    outcomes, _ = run_mesh(kind, n, "leaves", timeout=30)
    status, left_at, _ = outcomes[n - 1]
    assert status == "ok"
    for r in range(n - 1):
        status, (name, code, message, when), _ = outcomes[r]
        assert status == "err" and code is ErrorCode.PEER_LOST, message
        assert f"rank {n - 1}" in message and "left the mesh" in message and "all_reduce" in message
        assert 0 < when - left_at < KILL_BOUND_S


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_rank_that_left_before_a_collective_is_peer_lost_at_once(kind):
    """In shared memory the others wait for rank 0 to create the group's segment: its
    Leave ends that wait too (E1001), not the timeout."""
    n = 3
    outcomes, _ = run_mesh(kind, n, "leader_leaves", timeout=30)
    status, left_at, _ = outcomes[0]
    assert status == "ok"
    messages = []
    for r in range(1, n):
        status, (name, code, message, when), _ = outcomes[r]
        assert status == "err" and code is ErrorCode.PEER_LOST, message
        assert 0 < when - left_at < KILL_BOUND_S
        messages.append(message)
    # the first survivor to notice names rank 0; the other may instead see that one end
    # (it failed at once and exited) before rank 0's Leave: E1001 as well, as fast
    assert any("rank 0" in m and "left the mesh" in m for m in messages), messages


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_sigkill_mid_send_gives_peer_lost_to_the_receiver(kind):
    outcomes, procs = run_mesh(kind, 2, "killed_sender", timeout=30)
    assert procs[1].exitcode == -signal.SIGKILL
    status, killed_at, _ = outcomes[1]
    assert status == "killed"
    status, (name, code, message, when), _ = outcomes[0]
    assert status == "err" and code is ErrorCode.PEER_LOST, message
    assert "recv from rank 1" in message
    assert 0 < when - killed_at < KILL_BOUND_S


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_large_send_completes_while_the_sender_is_idle(kind):
    outcomes, _ = run_mesh(kind, 2, "send_then_idle")
    assert [o[0] for o in outcomes.values()] == ["ok", "ok"], outcomes
    same, received_at = outcomes[0][1]
    assert same
    assert received_at < outcomes[1][1], "the transfer waited for the sender's next DTM call"


def _hello_with_wrong_token(port: int) -> str:
    """Open a connection as a peer would, answer the challenge with a wrong token, and
    return the code of the Error the rank sends back."""
    from dtm.protocol.frame import FrameDecoder
    from dtm.protocol.handshake import Handshake
    from dtm.protocol.messages import Error, Hello, decode_message, encode_message
    from dtm.protocol.caps import level_caps
    hs = Handshake("connect", b"wrong token", level=1, caps=int(level_caps(1)), rank=1)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(hs.start()[0])
        dec = FrameDecoder()
        frames = []
        while not frames:
            frames = dec.feed(s.recv(4096))
        theirs = decode_message(*frames[0])
        assert isinstance(theirs, Hello)
        h = hs.hello
        bogus = Hello(h.versions, h.level, h.caps, h.max_payload, h.rank, h.name, h.challenge, b"\0" * 32)
        s.sendall(encode_message(bogus, epoch=0, stream=0, seq=1))
        frames = []
        while not frames:
            chunk = s.recv(4096)
            if not chunk:
                return "closed"
            frames = dec.feed(chunk)
        header, payload = frames[0]
        assert header.msg_type is MsgType.ERROR
        return Error.decode(payload).code


def _garbage(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        s.settimeout(10)
        try:
            while s.recv(4096):  # the rank closes the connection
                pass
        except ConnectionResetError:
            pass


def test_wrong_token_and_garbage_are_dropped_and_the_mesh_still_forms():
    from dtm.protocol.frame import encode_header
    seen = {}

    def poke(ports, release):
        release(0)  # rank 0 waits for rank 1's connection, accepting whatever comes
        seen["auth"] = _hello_with_wrong_token(ports[0])
        _garbage(ports[0], os.urandom(64))
        _garbage(ports[0], b"DTMW" + bytes(36))  # version 0.0: another major
        huge = bytearray(encode_header(MsgType.HELLO, b"", epoch=0, stream=0, seq=0))
        huge[16:24] = (1 << 40).to_bytes(8, "little")  # a length far past any limit
        _garbage(ports[0], bytes(huge))
        release(1)
        time.sleep(1.0)  # the mesh is formed and busy now: its listener is closed
        try:
            socket.create_connection(("127.0.0.1", ports[0]), timeout=10).close()
            seen["late"] = "accepted"
        except ConnectionRefusedError:
            seen["late"] = "refused"

    outcomes, _ = run_mesh("tcp", 2, "served", between=poke)
    assert seen["auth"] == ErrorCode.AUTH_FAILED.value and seen["late"] == "refused"
    for r in range(2):
        status, value, logs = outcomes[r]
        assert status == "ok", value
        np.testing.assert_array_equal(value, np.full(3, 3.0, np.float32))
    logs = "\n".join(outcomes[0][2])
    for reason in ("E0909", "E0901", "E0902", "E0904"):
        assert reason in logs, logs


def test_the_listener_closes_once_the_mesh_has_formed():
    """Spec 9.6.2: once a rank has its connection with every peer, its listener is closed,
    so a later connection is refused by the kernel at once instead of being accepted into a
    backlog that nobody reads."""
    from dtm.comm.tcp import connect_mesh, listen
    listeners = [listen(), listen()]
    addresses = [s.getsockname() for s in listeners]
    transports: dict = {}

    def form(r: int) -> None:
        transports[r] = connect_mesh(r, 2, addresses, TOKEN, listener=listeners[r], timeout=20)

    threads = [threading.Thread(target=form, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert sorted(transports) == [0, 1]
        for address in addresses:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(address, timeout=5).close()
    finally:
        for t in transports.values():
            t.close()


def test_sever_ends_a_wait_for_a_peer_at_once():
    """What dtm.cluster's failure detector calls: the wait ends with PeerLost, not at the timeout."""
    outcomes, _ = run_mesh("tcp", 2, "severed", timeout=20)
    status, (name, message, waited), _ = outcomes[0]
    assert (status, name) == ("ok", "PeerLost") and "failure detector" in message
    assert waited < 2.0
