"""dtm.comm's collectives and point-to-point transfers against numpy, on the in-process
transport (ranks are threads), with thresholds set so that every algorithm runs: the
latency ones (recursive doubling, trees, direct) and the pipelined ring and chain with
many chunks. The same algorithms run over TCP and shared memory in test_comm_procs.py."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

from dtm.comm import CollectiveMismatch, Communicator, InprocHub
from dtm.errors import DTMError, ErrorCode

BF16 = np.dtype(ml_dtypes.bfloat16)
# small_bytes / chunk_bytes: "latency" never takes a bandwidth algorithm, "bandwidth"
# always does, in chunks of 16 bytes (so a few dozen elements make many chunks).
CONFIGS = {"latency": dict(small_bytes=1 << 30, chunk_bytes=1 << 20), "bandwidth": dict(small_bytes=0, chunk_bytes=16)}


def spmd(n: int, fn, config: str = "bandwidth", timeout: float = 10.0, fails: bool = False, nodes=None):
    """Run fn(comm, rank) on n threads; returns the per-rank results, or with `fails` the
    per-rank exceptions (None for ranks that raised none). `nodes`: each rank's host, as a
    mesh's transports know them (hierarchical collectives group by it)."""
    transports = InprocHub(n).transports(timeout=timeout)
    for t in transports:
        t.nodes = None if nodes is None else tuple(nodes)
    results, errors = [None] * n, [None] * n

    def main(r: int) -> None:
        comm = Communicator(transports[r], **CONFIGS[config])
        try:
            results[r] = fn(comm, r)
        except Exception as e:  # noqa: BLE001 - handed to the test
            errors[r] = e
            transports[r].close()

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    assert not any(t.is_alive() for t in threads), "a rank hung past its timeout"
    if fails:
        return errors
    for e in errors:
        if e is not None:
            raise e
    return results


def data(rank: int, shape, dtype, op: str = "sum") -> np.ndarray:
    """Rank-specific operands; small integers so that sums and products are exact in floats."""
    rng = np.random.default_rng(1000 + rank)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-100 if np.dtype(dtype).kind == "i" else 0, 100, size=shape).astype(dtype)
    lo, hi = (1, 3) if op == "prod" else (-8, 8)
    return (rng.integers(lo, hi, size=shape) / 4).astype(dtype)


def reference(xs: list[np.ndarray], op: str) -> np.ndarray:
    """The reduction computed independently: in float64 (or Python ints, wrapped)."""
    dtype = xs[0].dtype
    if dtype.kind in "iu":
        wide = [x.astype(object) for x in xs]
        total = {"sum": sum, "avg": sum, "prod": np.prod, "max": np.max, "min": np.min}[op](
            wide, axis=0) if op in ("prod", "max", "min") else sum(wide[1:], wide[0])
        bits = dtype.itemsize * 8
        wrap = np.vectorize(lambda v: ((int(v) + (1 << (bits - 1))) % (1 << bits)) - (1 << (bits - 1))
                            if dtype.kind == "i" else int(v) % (1 << bits), otypes=[object])
        total = wrap(total) if np.size(total) else total
        if op == "avg":  # the wrapped sum divided, truncating toward zero
            total = np.vectorize(lambda v: abs(int(v)) // len(xs) * (1 if v >= 0 else -1), otypes=[object])(total) \
                if np.size(total) else total
        return np.asarray(total, dtype=object).astype(dtype)
    wide = np.stack([x.astype(np.float64) for x in xs])
    fn = {"sum": np.sum, "avg": np.mean, "prod": np.prod, "max": np.max, "min": np.min}[op]
    return fn(wide, axis=0).astype(dtype)


def same_everywhere(results: list[np.ndarray]) -> None:
    for r in results[1:]:
        assert r.dtype == results[0].dtype and r.shape == results[0].shape
        assert r.tobytes() == results[0].tobytes(), "ranks received different bits"


@pytest.mark.parametrize("config", ["latency", "bandwidth"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min", "avg"])
def test_all_reduce_float32(config, n, op):
    for shape in [(0,), (1,), (7, 3), (101,)]:
        xs = [data(r, shape, np.float32, op) for r in range(n)]
        out = spmd(n, lambda c, r: c.all_reduce(xs[r], op=op), config)
        same_everywhere(out)
        np.testing.assert_allclose(out[0], reference(xs, op), rtol=1e-6)
        assert out[0].shape == shape


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint8, np.int64, np.float64, np.float16, BF16,
                                   ml_dtypes.float8_e4m3fn])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "prod"])
def test_all_reduce_dtypes(dtype, op):
    n = 4
    xs = [data(r, (33,), dtype, op) for r in range(n)]
    for config in CONFIGS:
        out = spmd(n, lambda c, r: c.all_reduce(xs[r], op=op), config)
        same_everywhere(out)
        assert out[0].dtype == np.dtype(dtype)
        want = reference(xs, op)
        if np.dtype(dtype).kind in "iu":
            np.testing.assert_array_equal(out[0], want)  # integers wrap exactly like the reference
        else:  # operands are multiples of 1/4: exact in f32, so the one rounding gives the reference's value
            np.testing.assert_array_equal(out[0].astype(np.float64), want.astype(np.float64))


def test_narrow_floats_round_once():
    """bf16 partial sums stay in f32: 1 + 3 * 2^-9 rounds to 1 + 2^-7 once; rounding after
    each addition (rank 0 first) would leave 1.0."""
    xs = [np.array([1.0], BF16)] + [np.array([2.0 ** -9], BF16)] * 3
    for config in CONFIGS:
        out = spmd(4, lambda c, r: c.all_reduce(xs[r]), config)
        assert float(out[0][0]) == 1.0 + 2.0 ** -7


def test_max_min_propagate_nan():
    xs = [np.array([1.0, 2.0, 3.0], np.float32) for _ in range(3)]
    xs[1] = np.array([np.nan, 5.0, -1.0], np.float32)
    out = spmd(3, lambda c, r: (c.all_reduce(xs[r], op="max"), c.all_reduce(xs[r], op="min")))
    assert np.isnan(out[0][0][0]) and np.isnan(out[0][1][0])
    assert list(out[2][0][1:]) == [5.0, 3.0] and list(out[2][1][1:]) == [2.0, -1.0]


def test_sub_groups_in_group_order():
    """Two groups at once on a world of 4; [3, 1] lists rank 3 first, so it is group rank 0."""
    groups = {0: [0, 2], 2: [0, 2], 3: [3, 1], 1: [3, 1]}
    xs = [np.full((2, 3), r + 1, np.float32) for r in range(4)]

    def fn(c, r):
        g = groups[r]
        return (c.all_reduce(xs[r], group=g), c.all_gather(xs[r], dim=1, group=g), c.broadcast(xs[r], src=0, group=g),
                c.reduce_scatter(np.arange(8, dtype=np.float32) * (r + 1), group=g))

    out = spmd(4, fn)
    np.testing.assert_array_equal(out[0][0], xs[0] + xs[2])
    np.testing.assert_array_equal(out[1][0], xs[1] + xs[3])
    np.testing.assert_array_equal(out[1][1], np.concatenate([xs[3], xs[1]], axis=1))
    np.testing.assert_array_equal(out[1][2], xs[3])  # src 0 of [3, 1] is rank 3
    full = np.arange(8, dtype=np.float32) * (4 + 2)
    np.testing.assert_array_equal(out[3][3], full[:4])  # rank 3 is group rank 0: first block
    np.testing.assert_array_equal(out[1][3], full[4:])


@pytest.mark.parametrize("config", ["latency", "bandwidth"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_all_gather(config, n):
    for shape, dim in [((0, 2), 0), ((3, 5), 0), ((3, 5), 1), ((2, 3, 4), 2), ((2, 0), 1)]:
        xs = [data(r, shape, BF16) for r in range(n)]
        out = spmd(n, lambda c, r: c.all_gather(xs[r], dim=dim), config)
        same_everywhere(out)
        np.testing.assert_array_equal(out[0], np.concatenate(xs, axis=dim))


@pytest.mark.parametrize("config", ["latency", "bandwidth"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_reduce_scatter(config, n):
    for shape, dim, dtype, op in [((n * 5,), 0, np.float32, "sum"), ((3, n * 2), 1, np.int16, "max"),
                                  ((n, 4), 0, np.float16, "avg"), ((0, n), 1, np.float32, "sum")]:
        xs = [data(r, shape, dtype, op) for r in range(n)]
        out = spmd(n, lambda c, r: c.reduce_scatter(xs[r], op=op, dim=dim), config)
        blocks = np.split(reference(xs, op), n, axis=dim)
        for r in range(n):
            np.testing.assert_array_equal(out[r], blocks[r])


@pytest.mark.parametrize("config", ["latency", "bandwidth"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_broadcast_and_reduce(config, n):
    for src in range(n):
        xs = [data(r, (4, 7), np.int32) for r in range(n)]
        out = spmd(n, lambda c, r: (c.broadcast(xs[r], src=src), c.reduce(xs[r], dst=src)), config)
        for r in range(n):
            np.testing.assert_array_equal(out[r][0], xs[src])
            if r == src:
                np.testing.assert_array_equal(out[r][1], reference(xs, "sum"))
            else:
                assert out[r][1] is None


@pytest.mark.parametrize("n", [2, 3, 4])
def test_all_to_all(n):
    for shape, s, cdim in [((n * 2, 3), 0, 0), ((n * 2, 3), 0, 1), ((2, n * 3), 1, 0), ((0, n), 1, 1)]:
        xs = [data(r, shape, np.float64) for r in range(n)]
        out = spmd(n, lambda c, r: c.all_to_all(xs[r], split_dim=s, concat_dim=cdim))
        for r in range(n):
            want = np.concatenate([np.split(xs[j], n, axis=s)[r] for j in range(n)], axis=cdim)
            np.testing.assert_array_equal(out[r], want)


def test_in_place_and_out():
    xs = [np.arange(50, dtype=np.float32) * (r + 1) for r in range(3)]
    mine = [x.copy() for x in xs]
    out = spmd(3, lambda c, r: c.all_reduce(mine[r], out=mine[r]))
    for r in range(3):
        assert out[r] is mine[r]
        np.testing.assert_array_equal(mine[r], sum(xs))


def test_barrier_orders_effects():
    seen = []
    lock = threading.Lock()

    def fn(c, r):
        with lock:
            seen.append(("before", r))
        c.barrier()
        with lock:
            seen.append(("after", r))

    spmd(4, fn)
    assert all(tag == "before" for tag, _ in seen[:4])


def test_send_recv_fifo_and_types():
    def fn(c, r):
        if r == 0:
            for i in range(5):
                c.send(np.full((i,), i, np.int16), dst=2)
            c.send(np.ones((2, 2), BF16), dst=1)
            c.send(np.zeros(3, np.float32), dst=0)  # to itself
            return c.recv(0)
        if r == 2:
            return [c.recv(0) for _ in range(5)]
        return c.recv(0, dtype=BF16, shape=(2, 2))

    out = spmd(3, fn)
    assert [list(a) for a in out[2]] == [[i] * i for i in range(5)]
    np.testing.assert_array_equal(out[1], np.ones((2, 2), BF16))
    np.testing.assert_array_equal(out[0], np.zeros(3, np.float32))


def test_recv_of_another_type_is_refused():
    def fn(c, r):
        if r == 0:
            c.send(np.zeros(3, np.float32), dst=1)
            c.send(np.zeros(3, np.float32), dst=1)
            return None
        with pytest.raises(DTMError) as dtype_err:
            c.recv(0, dtype=np.int32)
        return dtype_err.value.code

    assert spmd(2, fn)[1] is ErrorCode.DTYPE_MISMATCH


@pytest.mark.parametrize("config", ["latency", "bandwidth"])
def test_mismatch_names_both_calls_on_every_rank(config):
    def fn(c, r):
        x = np.zeros(16, np.float32)
        c.all_reduce(x)  # one matching collective first
        if r == 2:
            c.all_gather(x)
        else:
            c.all_reduce(x, op="max")

    errors = spmd(4, fn, config, fails=True)
    for e in errors:
        assert isinstance(e, CollectiveMismatch), e
        assert e.code is ErrorCode.COLLECTIVE_MISMATCH
        assert "all_gather" in str(e) and "all_reduce(max)" in str(e) and "test_comm_inproc.py:" in str(e)


def test_mismatched_shapes_and_dims():
    errors = spmd(2, lambda c, r: c.all_reduce(np.zeros(3 + r, np.float32)), fails=True)
    assert all(isinstance(e, CollectiveMismatch) and "f32[3]" in str(e) and "f32[4]" in str(e) for e in errors)
    errors = spmd(2, lambda c, r: c.all_gather(np.zeros((2, 2), np.float32), dim=r), fails=True)
    assert all(isinstance(e, CollectiveMismatch) and "dim=0" in str(e) and "dim=1" in str(e) for e in errors)


def test_a_missing_rank_times_out_naming_it():
    def fn(c, r):
        if r == 0:
            c.all_reduce(np.zeros(4, np.float32))

    errors = spmd(2, fn, timeout=0.5, fails=True)
    assert errors[0].code is ErrorCode.TIMEOUT and "rank 1" in str(errors[0]) and "all_reduce" in str(errors[0])


def test_bad_arguments():
    def fn(c, r):
        codes = []
        for call in (lambda: c.all_reduce(np.zeros(2, np.bool_)), lambda: c.all_reduce(np.zeros(2), op="mean"),
                     lambda: c.broadcast(np.zeros(2), src=2), lambda: c.all_reduce(np.zeros(2), group=[0, 0]),
                     lambda: c.reduce_scatter(np.zeros(3), dim=0), lambda: c.all_gather(np.zeros(2), dim=1)):
            with pytest.raises(DTMError) as e:
                call()
            codes.append(e.value.code)
        return codes

    assert spmd(2, fn)[0] == [ErrorCode.DTYPE_MISMATCH, ErrorCode.ATTRIBUTE_VALUE, ErrorCode.INVALID_GROUP,
                              ErrorCode.INVALID_GROUP, ErrorCode.SHAPE_MISMATCH, ErrorCode.ATTRIBUTE_VALUE]


def test_zero_dim_operands_keep_their_shape():
    """A loss is a 0-d tensor: its all_reduce and broadcast are 0-d too."""
    xs = [np.array(float(r + 1), np.float32) for r in range(3)]
    out = spmd(3, lambda c, r: (c.all_reduce(xs[r]), c.broadcast(xs[r], src=1), c.reduce(xs[r], dst=0)))
    for r in range(3):
        assert out[r][0].shape == () and float(out[r][0]) == 6.0
        assert out[r][1].shape == () and float(out[r][1]) == 2.0
    assert out[0][2].shape == () and float(out[0][2]) == 6.0


def test_a_collective_that_starts_before_a_peer_is_ready():
    """A rank whose transport has no handler yet (it is still setting up, as a rank of
    another host attaching shared memory is) keeps the control frames of a collective a
    faster peer started, and its Communicator handles them once it exists: the collective
    completes. Past MAX_HELD_CONTROLS such frames, E0911."""
    from dtm.comm.transport import MAX_HELD_CONTROLS
    from dtm.protocol.frame import MsgType

    t0, t1 = InprocHub(2).transports(timeout=10)
    out: dict[int, np.ndarray] = {}
    fast = threading.Thread(target=lambda: out.__setitem__(0, Communicator(t0).all_reduce(np.ones(4, np.float32))))
    fast.start()
    deadline = 100
    while not t1.hub.inbox[1] and deadline:  # rank 0's descriptor (and data) reach rank 1 first
        threading.Event().wait(0.01)
        deadline -= 1
    t1.poll("setting up")  # rank 1 reads them before it has a Communicator: held, not refused
    out[1] = Communicator(t1).all_reduce(np.full(4, 2, np.float32))
    fast.join(10)
    np.testing.assert_array_equal(out[0], np.full(4, 3, np.float32))
    np.testing.assert_array_equal(out[1], np.full(4, 3, np.float32))
    t2, t3 = InprocHub(2).transports(timeout=10)
    for _ in range(MAX_HELD_CONTROLS + 1):
        t2.send(1, 5, MsgType.COLLECTIVE_START, [b"x"])
    with pytest.raises(DTMError) as e:
        t3.poll("setting up")
    assert e.value.code is ErrorCode.UNEXPECTED_MESSAGE and "before anything on this rank" in e.value.message


# --- groups that span hosts (spec 9.5.2) ----------------------------------------------------------

HOSTS = {"2x2": "aabb", "interleaved 2+3": "ababb", "3+1": "aaab"}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("layout", list(HOSTS))
@pytest.mark.parametrize("op,dtype", [("sum", np.float32), ("avg", np.float32), ("max", np.float32),
                                      ("prod", np.float64), ("avg", np.int32), ("sum", BF16), ("min", np.int8)])
def test_all_reduce_across_hosts(layout, op, dtype, config):
    """Inside each host, between hosts, inside again: the reference's result on every rank,
    bitwise the same on all."""
    nodes = HOSTS[layout]
    xs = [data(r, (5, 7), dtype, op) for r in range(len(nodes))]
    got = spmd(len(nodes), lambda c, r: c.all_reduce(xs[r], op=op), config, nodes=nodes)
    want = reference(xs, op)
    for g in got:
        assert g.dtype == xs[0].dtype and g.tobytes() == got[0].tobytes()
        np.testing.assert_allclose(g.astype(np.float64), want.astype(np.float64), rtol=1e-2 if dtype == BF16 else 1e-6)


def _peers_sent_to(nodes: str, fn, **kw) -> tuple[list, list[set[int]]]:
    """Run fn on ranks placed on `nodes`; the results and the ranks each rank sent data to."""
    peers: list[set[int]] = [set() for _ in nodes]

    def traced(c: Communicator, r: int):
        send = c.transport.send

        def recording(peer, stream, msg_type, parts, flags=0):
            if msg_type.name == "DATA":
                peers[r].add(peer)
            return send(peer, stream, msg_type, parts, flags)
        c.transport.send = recording
        return fn(c, r)
    return spmd(len(nodes), traced, nodes=nodes, **kw), peers


def test_who_crosses_the_network():
    """Hosts a (ranks 0, 1) and b (2, 3), two each: each rank exchanges with its host's other
    rank and with the rank of its index on the other host, never with the other (0 with 3,
    1 with 2). Hosts a (0, 1, 2) and b (3): only host a's first rank and rank 3 cross. Both
    in place (out=x)."""
    for nodes, want in (("aabb", 10), ("aaab", 10)):
        xs = [np.full(64, r + 1, np.float32) for r in range(4)]
        _, peers = _peers_sent_to(nodes, lambda c, r: c.all_reduce(xs[r], out=xs[r]))
        assert all((x == want).all() for x in xs)
        if nodes == "aabb":
            assert peers == [{1, 2}, {0, 3}, {0, 3}, {1, 2}], peers
        else:
            assert peers[3] == {0} and 3 in peers[0] and (peers[1] | peers[2]) <= {0, 1, 2}, peers


def test_a_subgroup_across_hosts_and_flat_when_told():
    """Group [1, 2, 3] of hosts (0, 1) and (2, 3): host a holds one member, host b two; with
    `hierarchical` off the same group runs one flat ring (rank 3 then sends to rank 1)."""
    xs = [np.full(64, r + 1, np.float32) for r in range(4)]

    def call(c: Communicator, r: int, flat: bool):
        c.hierarchical = not flat
        return c.all_reduce(xs[r], group=[1, 2, 3]) if r else None
    for flat, to_rank_1 in ((False, False), (True, True)):
        got, peers = _peers_sent_to("aabb", lambda c, r: call(c, r, flat), config="bandwidth")
        assert all((g == 9).all() for g in got[1:])
        assert (1 in peers[3]) == to_rank_1, peers


def test_a_failure_in_one_subgroup_fails_every_member_at_once():
    """Hosts a (0, 1) and b (2, 3); rank 3 calls all_reduce with another shape, which ranks
    2 and 3 find in their host's reduce_scatter (E0803). They stay alive afterwards without
    closing (as an elastic job's ranks do), so no closed connection tells ranks 0 and 1,
    which wait on them in the exchange between hosts: they fail too, at once (told by the
    failing ranks), not at the 10 s timeout."""
    import time

    def fn(c: Communicator, r: int):
        t0 = time.monotonic()
        try:
            c.all_reduce(np.ones(32 if r == 3 else 64, np.float32))
        except DTMError as e:
            took = time.monotonic() - t0
            time.sleep(1.0)  # alive, connections open
            return e, took
        return None, time.monotonic() - t0
    got = spmd(4, fn, nodes="aabb", timeout=10.0)
    for r in range(4):
        err, took = got[r]
        assert isinstance(err, CollectiveMismatch) and took < 5.0, (r, took, err)


def test_all_gather_into_out():
    """all_gather(out=) writes the members' blocks one after another into `out` (dim 0),
    as the result without it; another dim is refused."""
    xs = [data(r, (3, 2), np.float32) for r in range(3)]

    def fn(c: Communicator, r: int):
        out = np.full((9, 2), np.nan, np.float32)
        got = c.all_gather(xs[r], 0, out=out)
        with pytest.raises(DTMError, match="dim 0"):
            c.all_gather(xs[r], 1, out=out)
        return got, out
    for got, out in spmd(3, fn):
        assert got is out and np.array_equal(out, np.concatenate(xs))
