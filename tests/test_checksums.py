"""End-to-end tensor checksums (spec 9.4.9): a bit flipped in memory between the CRC the
producer computed and the frame encoder (after the frames' own CRCs would be computed, so
they pass) is caught where the tensor is consumed, with E1008 naming the transfer, the
peer, the operation and both CRCs; DTM_CHECKSUMS=0 turns the check off. The expected CRCs
come from the crc32c package over numpy's bytes, independently of dtm."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from crc32c import crc32c

from dtm.comm import collectives
from dtm.errors import ErrorCode
from dtm.protocol.checksums import ENV, TensorChecksumMismatch
from dtm.protocol.messages import P2PSend
from test_comm_inproc import spmd  # this folder is on sys.path

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parent.parent
LAUNCH_TIMEOUT_S = 120  # the whole launch, 2 processes on a loaded machine
PG_TIMEOUT_S = 40       # joining the mesh and every collective
THREAD_TIMEOUT_S = 20.0


def crc_of(a: np.ndarray) -> int:
    return crc32c(np.ascontiguousarray(a).tobytes())


def flipped(a: np.ndarray, byte: int = 0) -> np.ndarray:
    """`a` with bit 0 of byte `byte` of its storage flipped."""
    b = np.ascontiguousarray(a).copy()
    b.reshape(-1).view(np.uint8)[byte] ^= 1
    return b


def flip_p2p_data(transport) -> None:
    """From now on the first Data frame of each point-to-point transfer leaves `transport`
    with one bit flipped: a copy of the buffer, after the sender's CRC, before the frame's."""
    send_data = transport.send_data

    def damaged(peer, stream, buf, *, seq, chunk, flags=0):
        if stream == collectives.P2P_STREAM and chunk == 0 and len(memoryview(buf).cast("B")):
            buf = np.frombuffer(memoryview(buf).cast("B"), np.uint8).copy()
            buf[0] ^= 1
        return send_data(peer, stream, buf, seq=seq, chunk=chunk, flags=flags)

    transport.send_data = damaged


def run_ranks(n: int, fn, config: str = "bandwidth") -> list:
    """fn(comm, rank) on n threads (test_comm_inproc's `spmd`); per rank its result or exception."""
    def caught(comm, r):
        try:
            return fn(comm, r)
        except Exception as e:  # noqa: BLE001 - handed to the test
            comm.transport.close()
            return e
    return spmd(n, caught, config, timeout=THREAD_TIMEOUT_S)


def send_flipped_or_recv(comm, r):
    """Rank 0 sends X with a bit flipped on the way; rank 1 receives it."""
    if r == 0:
        flip_p2p_data(comm.transport)
        comm.send(X, 1)
        return None
    return comm.recv(0)


X = (np.arange(3000, dtype=np.float32) / 7).reshape(30, 100)


# --- the message ------------------------------------------------------------------------------------

def test_p2psend_crc_is_an_optional_section_and_1_0_bytes_stay():
    plain = P2PSend(4, 0, "f32", (2, 3), "t.py:1")
    with_crc = P2PSend(4, 0, "f32", (2, 3), "t.py:1", 0xDEADBEEF)
    assert with_crc.encode() == plain.encode() + (0xDEADBEEF).to_bytes(4, "little")
    assert P2PSend.decode(plain.encode()) == plain and P2PSend.decode(with_crc.encode()) == with_crc
    assert "crc" not in plain.to_json() and P2PSend.from_json(with_crc.to_json()) == with_crc
    with pytest.raises(Exception, match="E0910"):
        P2PSend.decode(with_crc.encode() + b"\0")  # trailing bytes past the section
    with pytest.raises(Exception, match="crc"):
        P2PSend(4, 0, "f32", (2, 3), "t.py:1", 1 << 32)


# --- P2P and broadcast between threads ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.dtype(ml_dtypes.bfloat16), np.int64])
def test_p2p_arrives_intact_with_checksums(dtype):
    x = X.astype(dtype)
    res = run_ranks(2, lambda c, r: c.send(x, 1) if r == 0 else c.recv(0))
    np.testing.assert_array_equal(res[1], x)


@pytest.mark.parametrize("config", ["latency", "bandwidth"])
def test_p2p_bit_flip_is_caught_and_named(config):
    res = run_ranks(2, send_flipped_or_recv, config)
    err = res[1]
    assert isinstance(err, TensorChecksumMismatch), err
    assert err.code is ErrorCode.TENSOR_CHECKSUM_MISMATCH
    assert (err.expected, err.found) == (crc_of(X), crc_of(flipped(X)))
    text = str(err)
    for part in ("E1008", "recv", "point-to-point transfer 0", "f32[30, 100]", "rank 0", "test_checksums.py",
                 f"{crc_of(X):08x}", f"{crc_of(flipped(X)):08x}"):
        assert part in text, (part, text)


def test_p2p_bit_flip_passes_when_checksums_are_off(monkeypatch):
    monkeypatch.setenv(ENV, "0")
    res = run_ranks(2, send_flipped_or_recv)
    np.testing.assert_array_equal(res[1], flipped(X))  # nothing computed, nothing checked


def flip_after_crc(monkeypatch) -> None:
    """A broadcast root's copy of the tensor gets one bit flipped after its CRC was computed."""
    with_crc = collectives._with_crc

    def damaged(wire, x):
        with_crc(wire, x)
        wire[5] ^= 1

    monkeypatch.setattr(collectives, "_with_crc", damaged)


@pytest.mark.parametrize("config", ["latency", "bandwidth"])  # tree, chain
def test_broadcast_bit_flip_is_caught_on_every_receiver(monkeypatch, config):
    flip_after_crc(monkeypatch)
    res = run_ranks(3, lambda c, r: c.broadcast(X if r == 1 else np.zeros_like(X), src=1), config)
    for r, root in ((0, "root rank 1"), (1, "this rank, the root"), (2, "root rank 1")):
        err = res[r]  # the root's result is its damaged copy too
        assert isinstance(err, TensorChecksumMismatch), err
        assert (err.expected, err.found) == (crc_of(X), crc_of(flipped(X, 5)))
        for part in ("E1008", "broadcast", "#0", "f32[30, 100]", "over ranks [0, 1, 2]", root):
            assert part in str(err), (part, str(err))


@pytest.mark.parametrize("config", ["latency", "bandwidth"])  # tree, chain
def test_broadcast_intact_and_off_switch(monkeypatch, config):
    for dtype in (np.float32, np.dtype(ml_dtypes.bfloat16), np.bool_):
        x = (X > 100).astype(dtype) if dtype == np.bool_ else X.astype(dtype)
        res = run_ranks(3, lambda c, r: c.broadcast(x if r == 0 else np.zeros_like(x)), config)
        for got in res:
            assert got.dtype == x.dtype and got.shape == x.shape
            np.testing.assert_array_equal(got, x)
    for scalar in (np.float32(2.5), np.zeros(0, np.float32)):
        res = run_ranks(2, lambda c, r: c.broadcast(np.asarray(scalar) if r == 0 else np.zeros_like(scalar)), config)
        for got in res:
            np.testing.assert_array_equal(got, scalar)
    monkeypatch.setenv(ENV, "0")
    flip_after_crc(monkeypatch)  # not called: with checksums off the root copies as before
    res = run_ranks(2, lambda c, r: c.broadcast(X if r == 0 else np.zeros_like(X)), config)
    np.testing.assert_array_equal(res[1], X)


# --- real processes: P2P and broadcast under `dtm launch` ------------------------------------------

def rank_main() -> None:
    import dtm
    from dtm.runtime import process_group

    pg = process_group.init(timeout=PG_TIMEOUT_S, op_timeout=PG_TIMEOUT_S)
    transport = pg._comm().transport
    big = (np.arange(1 << 18, dtype=np.float32) / 3).reshape(512, 512)  # 1 MiB: several Data frames
    odd = np.arange((1 << 17) + 3, dtype=np.float64)  # a shared-memory slot and 24 bytes (+ the CRC tail)
    for x in (X, big, odd):
        if pg.rank == 0:
            dtm.send(dtm.tensor(x), 1)
        else:
            np.testing.assert_array_equal(dtm.recv(0, dtype=dtm.float32 if x.dtype == np.float32 else dtm.float64,
                                                   shape=x.shape).numpy(), x)
        got = dtm.broadcast(dtm.tensor(x if pg.rank == 0 else np.zeros_like(x)), src=0).numpy()
        np.testing.assert_array_equal(got, x)
    # P2P with a flipped bit: the receiver names it, and the mesh goes on
    if pg.rank == 0:
        flip_p2p_data(transport)
        dtm.send(dtm.tensor(big), 1)
    else:
        try:
            dtm.recv(0, dtype=dtm.float32, shape=big.shape)
        except TensorChecksumMismatch as e:
            assert (e.expected, e.found) == (crc_of(big), crc_of(flipped(big))), str(e)
            print(f"CAUGHT p2p: {e}", flush=True)
    # broadcast with a bit flipped in the root's copy after its CRC
    with_crc = collectives._with_crc

    def damaged(wire, x):
        with_crc(wire, x)
        wire[5] ^= 1

    collectives._with_crc = damaged
    try:
        dtm.broadcast(dtm.tensor(big if pg.rank == 0 else np.zeros_like(big)), src=0)
    except TensorChecksumMismatch as e:
        assert (e.expected, e.found) == (crc_of(big), crc_of(flipped(big, 5))), str(e)
        print(f"CAUGHT broadcast on rank {pg.rank}: {e}", flush=True)
    collectives._with_crc = with_crc
    dtm.barrier()


def mixed_rank_main() -> None:
    """Rank 1 runs with DTM_CHECKSUMS=0: neither side sends a checksum (1.0 frames), so a
    flipped bit passes, as it did before checksums; nothing fails on either side."""
    import dtm
    from dtm.protocol.caps import Cap
    from dtm.runtime import process_group

    if os.environ["DTM_RANK"] == "1":
        os.environ[ENV] = "0"  # before the Hello
    pg = process_group.init(timeout=PG_TIMEOUT_S, op_timeout=PG_TIMEOUT_S)
    comm = pg._comm()
    peer_caps = comm.transport.peer_caps(1 - pg.rank)
    assert bool(peer_caps & Cap.CHECKSUMS) == (pg.rank == 1) and not comm._checksummed([0, 1])
    if pg.rank == 0:
        flip_p2p_data(comm.transport)
        dtm.send(dtm.tensor(X), 1)
    else:
        got = dtm.recv(0, dtype=dtm.float32, shape=X.shape).numpy()
        assert np.array_equal(got, flipped(X)), "expected the flipped bit to pass unchecked"
    got = dtm.broadcast(dtm.tensor(X if pg.rank == 0 else np.zeros_like(X)), src=0).numpy()
    np.testing.assert_array_equal(got, X)
    print(f"MIXED OK rank {pg.rank}", flush=True)


def test_a_rank_with_checksums_off_gets_and_sends_1_0_frames():
    env = dict(os.environ, PYTHONPATH=str(ROOT), DTM_HOST="127.0.0.1")
    env.pop(ENV, None)
    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", "2", "--join-timeout", str(PG_TIMEOUT_S), str(HERE),
           "mixed"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert out.count("MIXED OK rank") == 2, out[-6000:]


def test_two_processes_catch_flips_in_p2p_and_broadcast():
    env = dict(os.environ, PYTHONPATH=str(ROOT), DTM_HOST="127.0.0.1")
    env.pop(ENV, None)
    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", "2", "--join-timeout", str(PG_TIMEOUT_S), str(HERE)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    p2p = [line for line in out.splitlines() if "CAUGHT p2p:" in line]
    bc = sorted(line for line in out.splitlines() if "CAUGHT broadcast on rank" in line)
    assert len(p2p) == 1 and len(bc) == 2, out[-6000:]
    for part in ("E1008", "recv of point-to-point transfer 3 f32[512, 512]", "from rank 0"):
        assert part in p2p[0], (part, p2p[0])
    for line, root in zip(bc, ("from this rank, the root", "from root rank 0")):
        for part in ("E1008", "broadcast of #", "f32[512, 512] over ranks [0, 1]", root):
            assert part in line, (part, line)


if __name__ == "__main__":
    if sys.argv[1:] == ["mixed"]:
        mixed_rank_main()
    else:
        rank_main()
