"""Compressed collectives (spec 9.5.1): the codec against the reference quantizer, the error
bound of a compressed all_reduce / reduce_scatter / all_gather against the exact sum on
random data between real processes on 127.0.0.1 over TCP (2, 3 and 4 ranks), CAP_QUANT
negotiation with a rank that does not announce it (DTM_NO_CAP_QUANT=1), a compressed Data
frame whose block count disagrees with its length (E0910), and bad `compress=` arguments.
Processes start with "spawn"; every wait is bounded."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time

import ml_dtypes
import numpy as np
import pytest

from dtm.comm.compress import codec_for
from dtm.errors import DTMError, ErrorCode
from dtm.protocol.compressed import chunk_bytes, pack_head

TOKEN = b"quant-test-token"
COMM = dict(small_bytes=4 << 10, chunk_bytes=8 << 10)  # several chunks per block even at these sizes
SIZE = 20_011  # not a multiple of 32, nor of the group size

C_Q8 = (0.5 + 127 * 2.0 ** -11) / 127 + 2.0 ** -24  # per rounding, relative to the block's largest |value|
D_Q8 = 127 * 2.0 ** -25                                # f16 subnormal scales
U_BF16 = 2.0 ** -8 + 2.0 ** -24                        # per rounding, relative to |value|


def block_max(xs: list[np.ndarray]) -> np.ndarray:
    """A_e = sum over ranks of the largest |x_r| in e's 32-block (blocks from element 0)."""
    out = np.zeros(xs[0].size)
    for x in xs:
        n = x.size
        padded = np.zeros(-(-n // 32) * 32)
        padded[:n] = np.abs(x.astype(np.float64))
        out += np.repeat(padded.reshape(-1, 32).max(axis=1), 32)[:n]
    return out


def q8_bound(xs: list[np.ndarray], roundings: int) -> np.ndarray:
    """Spec 9.5.1's bound of a q8_0 result rounded `roundings` times (n for all_reduce)."""
    n = len(xs)
    return roundings * (1 + C_Q8) ** n * (C_Q8 * block_max(xs) + D_Q8)


def bf16_bound(xs: list[np.ndarray], roundings: int) -> np.ndarray:
    n = len(xs)
    return roundings * (1 + U_BF16) ** n * U_BF16 * np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0)


def operand(rank: int, shape) -> np.ndarray:
    """Random data with a wide range of magnitudes (blocks of very different scale)."""
    rng = np.random.default_rng(100 + rank)
    scale = np.repeat(10.0 ** rng.uniform(-4, 3, -(-int(np.prod(shape)) // 32)), 32)[:int(np.prod(shape))]
    return (rng.standard_normal(int(np.prod(shape))) * scale).astype(np.float32).reshape(shape)


# --- what each rank runs ---------------------------------------------------------------------

def accuracy(comm, rank, n):
    out = {}
    x = operand(rank, (SIZE,))
    for c in ("q8_0", "bf16"):
        out[f"ar_{c}"] = comm.all_reduce(x, compress=c)
        out[f"avg_{c}"] = comm.all_reduce(x, op="avg", compress=c)
        out[f"rs_{c}"] = comm.reduce_scatter(operand(rank, (n * 64, 33)), compress=c)  # blocks of 64*33 elements
        out[f"ag_{c}"] = comm.all_gather(operand(rank, (7, 50)), dim=1, compress=c)
    out["auto"] = comm.all_reduce(x, compress="auto")
    out["bf16_operand"] = comm.all_reduce(x.astype(ml_dtypes.bfloat16), compress="q8_0")
    for bad in ("q4_0", "int8"):
        try:
            comm.all_reduce(x, compress=bad)
        except DTMError as e:
            out[f"bad_{bad}"] = e.code.value
    try:
        comm.all_reduce(np.arange(64, dtype=np.int32), compress="q8_0")
    except DTMError as e:
        out["bad_int"] = e.code.value
    try:
        comm.all_reduce(x, op="max", compress="q8_0")
    except DTMError as e:
        out["bad_max"] = e.code.value
    out["after"] = comm.all_reduce(np.full(5, rank, np.float32))  # still usable after refused calls
    out["sent"] = comm.transport.bytes_sent
    return out


def no_quant_peer(comm, rank, n):
    """The last rank does not announce CAP_QUANT."""
    out = {}
    x = operand(rank, (5000,))
    try:
        comm.all_reduce(x, compress="q8_0")
    except DTMError as e:
        out["strict"] = (e.code.value, str(e))
    out["auto"] = comm.all_reduce(x, compress="auto")
    out["plain"] = comm.all_reduce(x)
    return out


def bad_frame(comm, rank, n):
    """Rank 0 sends a compressed Data frame whose head says 64 q8_0 elements (2 blocks, 68
    bytes) but which holds one block (34 bytes); rank 1 must refuse it with E0910."""
    from dtm.protocol.frame import FLAG_COMPRESSED, MsgType
    from dtm.comm.transport import DATA_HEADER
    if rank == 0:
        data = pack_head("q8_0", 64) + bytes(34)
        comm.transport.send(1, 5, MsgType.DATA, [DATA_HEADER.pack(0, 0, 0, 0, len(data)), data], FLAG_COMPRESSED)
        comm.transport.wait([], "sending a bad frame")
        time.sleep(1.0)
        comm.transport.poll("after")
        return {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        comm.transport.poll("waiting for a bad frame")
        time.sleep(0.01)
    return {}


def python_ring(comm) -> None:
    """This rank runs compressed rings in Python (algorithms.compressed_ring), not in the pump."""
    comm.transport.compressed_ring_pass = lambda *args, **kw: False


def pump_vs_python(comm, rank, n):
    """The same compressed collectives with the C ring pump, with Python's ring, and with
    rank 0 on Python's ring and the others on the pump: every result the same bits."""
    out = {}
    shapes = {"ar": (SIZE,), "rs": (n * 64, 33), "ag": (7, 50)}
    for how in ("pump", "python", "mixed"):
        if how == "python" or (how == "mixed" and rank == 0):
            python_ring(comm)
        elif "compressed_ring_pass" in vars(comm.transport):
            del comm.transport.compressed_ring_pass
        for c in ("q8_0", "bf16"):
            out[f"{how}_ar_{c}"] = comm.all_reduce(operand(rank, shapes["ar"]), compress=c)
            out[f"{how}_avg_{c}"] = comm.all_reduce(operand(rank, shapes["ar"]), op="avg", compress=c)
            x = operand(rank, shapes["ar"])
            comm.all_reduce(x, out=x, compress=c)  # in place
            out[f"{how}_inplace_{c}"] = x
            out[f"{how}_rs_{c}"] = comm.reduce_scatter(operand(rank, shapes["rs"]), compress=c)
            out[f"{how}_ag_{c}"] = comm.all_gather(operand(rank, shapes["ag"]), dim=1, compress=c)
            out[f"{how}_tiny_{c}"] = comm.all_reduce(operand(rank, (n + 1,)), compress=c)  # empty blocks
        out[f"{how}_pump_runs"] = comm.transport.pump_runs
    return out


def unflagged(comm, rank, n, receiver_pump=True):
    """Rank 0 sends its compressed chunks without the COMPRESSED flag (Python's ring, flags
    dropped); the next rank, which expects compressed chunks, must refuse them (E0910)."""
    if rank == 0:
        python_ring(comm)
        send_data = comm.transport.send_data
        comm.transport.send_data = lambda peer, stream, buf, *, seq, chunk, flags=0: send_data(
            peer, stream, buf, seq=seq, chunk=chunk)
    elif not receiver_pump:
        python_ring(comm)
    comm.all_reduce(operand(rank, (SIZE,)), compress="q8_0")
    return {}


SCENARIOS = {"accuracy": accuracy, "no_quant_peer": no_quant_peer, "bad_frame": bad_frame,
             "pump_vs_python": pump_vs_python, "unflagged_pump": unflagged,
             "unflagged_python": lambda comm, rank, n: unflagged(comm, rank, n, receiver_pump=False)}


def rank_main(scenario, rank, n, q_port, q_addrs, q_out, env):
    os.environ.update(env.get(rank, {}))
    comm = None
    try:
        from dtm.comm import Communicator
        from dtm.comm.tcp import connect_mesh, listen
        listener = listen()
        q_port.put((rank, listener.getsockname()[1]))
        addresses = q_addrs.get(timeout=60)
        comm = Communicator(connect_mesh(rank, n, addresses, TOKEN, listener=listener, timeout=30), **COMM)
        q_out.put(("ok", rank, SCENARIOS[scenario](comm, rank, n)))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        q_out.put(("err", rank, (type(e).__name__, getattr(getattr(e, "code", None), "value", None), str(e))))
    finally:
        if comm is not None:
            comm.close()


def run_mesh(n: int, scenario: str, env: dict | None = None, timeout: float = 90.0) -> dict:
    ctx = mp.get_context("spawn")
    q_port, q_out = ctx.Queue(), ctx.Queue()
    q_addrs = [ctx.Queue() for _ in range(n)]
    procs = [ctx.Process(target=rank_main, args=(scenario, r, n, q_port, q_addrs[r], q_out, env or {}), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    try:
        ports = dict(q_port.get(timeout=60) for _ in range(n))
        for r in range(n):
            q_addrs[r].put([("127.0.0.1", ports[j]) for j in range(n)])
        outcomes = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < n and time.monotonic() < deadline:
            try:
                status, rank, value = q_out.get(timeout=0.2)
                outcomes[rank] = (status, value)
            except queue.Empty:
                if all(p.exitcode is not None for r, p in enumerate(procs) if r not in outcomes):
                    break
        return outcomes
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


# --- the tests ---------------------------------------------------------------------------------

def test_the_native_codec_and_compressed_pump_build_where_there_is_a_compiler():
    """A build error in quant_codec.c or ring_pump.c falls back to numpy and the Python ring
    (the same bits, tens of times slower) with a log line only: where a C compiler is, the
    native ones must be the ones in use."""
    from dtm.comm import pump
    from dtm.toolchain import compiler
    try:
        compiler()
    except DTMError:
        pytest.skip("no C compiler here")
    if os.environ.get("DTM_QUANT_CODEC") == "numpy":
        pytest.skip("DTM_QUANT_CODEC=numpy asks for numpy")
    assert codec_for("q8_0").lib is not None
    assert pump.compressed_ring_pump() is not None


def test_codec_is_the_reference_quantizer_bit_for_bit():
    rng = np.random.default_rng(0)
    for name in ("q8_0", "bf16"):
        fast, ref = codec_for(name), codec_for(name, native=False)
        for n in (0, 1, 31, 32, 33, 4099):
            x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-9, 6, n)).astype(np.float32)
            if n > 300:  # (scales: NaN, inf, zero, subnormal in f16, near f16's largest, past it)
                x[5], x[70], x[140:172], x[200:232] = np.nan, np.inf, 0, 1e-7
                x[240:256], x[300], x[333], x[608:640] = 1e-40, 8.3e6, 9e6, 4e-37  # (4e-37: a subnormal scale, finite 1/d)
            a, b = np.empty(fast.chunk_bytes(n), np.uint8), np.empty(ref.chunk_bytes(n), np.uint8)
            fast.encode(x, a)
            ref.encode(x, b)
            np.testing.assert_array_equal(a, b, err_msg=f"{name}[{n}]")
            acc, acc2 = rng.standard_normal(n).astype(np.float32), None
            acc2 = acc.copy()
            fast.decode_add(a, acc)
            ref.decode_add(a, acc2)
            np.testing.assert_array_equal(acc, acc2)
            # a reduce-scatter hop: add, encode again, and (keep: a finished chunk) decode back;
            # fused in C, 16 blocks at a time
            for keep in (False, True):
                again, again2 = np.empty_like(a), np.empty_like(b)
                fast.add_encode(a, acc, again, keep=keep)
                ref.add_encode(b, acc2, again2, keep=keep)
                np.testing.assert_array_equal(again, again2, err_msg=f"{name}[{n}] add_encode")
                np.testing.assert_array_equal(acc, acc2)
    q = codec_for("q8_0")
    good = np.empty(q.chunk_bytes(40), np.uint8)
    q.encode(np.ones(40, np.float32), good)
    q.check(good, 40, "rank 1")
    with pytest.raises(DTMError) as e:
        q.check(good, 41, "rank 1")
    assert e.value.code is ErrorCode.BAD_PAYLOAD and "rank 1" in str(e.value)
    assert chunk_bytes("q8_0", 40) == 8 + 2 * 34 and chunk_bytes("bf16", 40) == 8 + 80


@pytest.mark.parametrize("n", [2, 3, 4])
def test_compressed_collectives_within_the_spec_bound(n):
    outcomes = run_mesh(n, "accuracy")
    assert sorted(outcomes) == list(range(n)), outcomes
    errors = {r: o[1] for r, o in outcomes.items() if o[0] != "ok"}
    assert not errors, errors
    res = [outcomes[r][1] for r in range(n)]
    xs = [operand(r, (SIZE,)) for r in range(n)]
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    for c, bound in (("q8_0", q8_bound), ("bf16", bf16_bound)):
        for key in (f"ar_{c}", f"avg_{c}"):  # bitwise the same on every rank
            assert all(r[key].tobytes() == res[0][key].tobytes() for r in res), key
        err = np.abs(res[0][f"ar_{c}"] - exact)
        b = bound(xs, n)
        assert np.all(err <= b), (c, n, float(np.max(err / b)))
        assert np.max(err) > 0  # it did travel compressed
        np.testing.assert_array_less(np.abs(res[0][f"avg_{c}"] - exact / n), b / n + 1e-30)
        # reduce_scatter: n - 1 roundings; blocks of 64*33 elements, a multiple of 32
        rs = [operand(r, (n * 64, 33)) for r in range(n)]
        rs_exact = np.sum([x.astype(np.float64) for x in rs], axis=0)
        for r in range(n):
            part = slice(r * 64, (r + 1) * 64)
            got = res[r][f"rs_{c}"]
            b = bound([x[part].reshape(-1) for x in rs], n - 1).reshape(64, 33)
            assert np.all(np.abs(got - rs_exact[part]) <= b), (c, n, r)
        # all_gather: each block rounded once, every rank the same
        ag = [operand(r, (7, 50)) for r in range(n)]
        assert all(r[f"ag_{c}"].tobytes() == res[0][f"ag_{c}"].tobytes() for r in res)
        for r in range(n):
            got = res[0][f"ag_{c}"][:, r * 50:(r + 1) * 50]
            assert np.all(np.abs(got - ag[r]) <= bound([ag[r].reshape(-1)], 1).reshape(7, 50)), (c, n, r)
    np.testing.assert_array_equal(res[0]["auto"], res[0]["ar_q8_0"])  # every member announced CAP_QUANT
    assert res[0]["bad_q4_0"] == "E0306" and res[0]["bad_int8"] == "E0306"
    assert res[0]["bad_int"] == "E0402" and res[0]["bad_max"] == "E0306"
    np.testing.assert_array_equal(res[0]["after"], np.full(5, sum(range(n)), np.float32))


def test_a_peer_without_cap_quant_is_named_unless_auto():
    n = 3
    outcomes = run_mesh(n, "no_quant_peer", env={2: {"DTM_NO_CAP_QUANT": "1"}})
    assert sorted(outcomes) == list(range(n)), outcomes
    assert all(o[0] == "ok" for o in outcomes.values()), outcomes
    for r in range(n):
        res = outcomes[r][1]
        code, message = res["strict"]
        assert code == "E1006" and "CAP_QUANT" in message
        assert ("this rank (rank 2)" if r == 2 else "rank 2 at 127.0.0.1") in message
        np.testing.assert_array_equal(res["auto"], res["plain"])  # uncompressed: the same bits
        np.testing.assert_array_equal(res["auto"], outcomes[0][1]["auto"])


def test_a_compressed_frame_whose_block_count_disagrees_with_its_length_is_refused():
    outcomes = run_mesh(2, "bad_frame")
    status, value = outcomes[1]
    assert status == "err", value
    name, code, message = value
    assert code == "E0910" and "64 q8_0 elements need 68 bytes" in message and "rank 0" in message, value


@pytest.mark.parametrize("n", [2, 3])
def test_the_c_ring_pump_gives_the_python_rings_bits(n):
    outcomes = run_mesh(n, "pump_vs_python")
    assert sorted(outcomes) == list(range(n)), outcomes
    errors = {r: o[1] for r, o in outcomes.items() if o[0] != "ok"}
    assert not errors, errors
    for r in range(n):
        res = outcomes[r][1]
        runs = res["pump_pump_runs"]
        assert runs >= 12, runs  # the pump ran every compressed pass (2 codecs x 6 collectives)
        assert res["python_pump_runs"] == runs  # and none of Python's
        for key in (k for k in res if k.startswith("pump_") and not k.endswith("runs")):
            want = res[key].tobytes()
            for how in ("python", "mixed"):
                assert res[how + key[4:]].tobytes() == want, (r, how, key)
            assert outcomes[0][1][key].tobytes() == want or key.startswith("pump_rs"), (r, key)


@pytest.mark.parametrize("receiver", ["pump", "python"])
def test_a_data_frame_without_the_compressed_flag_where_a_compressed_one_is_due_is_refused(receiver):
    outcomes = run_mesh(2, f"unflagged_{receiver}")
    status, value = outcomes[1]
    assert status == "err", value
    name, code, message = value
    assert code == "E0910" and "without the COMPRESSED flag" in message and "rank 0" in message, value
