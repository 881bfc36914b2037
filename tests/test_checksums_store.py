"""End-to-end tensor checksums in the store (spec 9.4.9): the checksum a put computed from
the caller's array is checked after a get assembled the tensor, so a bit flipped in memory
after a chunk's own CRC check (or before a remote put's frames were encoded) is caught with
E1008 naming the key; across real processes for the mesh's store over the wire. Expected
CRCs come from the crc32c package over numpy's bytes."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from crc32c import crc32c

import dtm
from dtm.errors import ErrorCode
from dtm.ir.types import Shard
from dtm.protocol.checksums import ENV, TensorChecksumMismatch
from dtm.store import format as fmt

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parent.parent
LAUNCH_TIMEOUT_S = 120  # the whole launch, 2 processes on a loaded machine
PG_TIMEOUT_S = 40       # joining the mesh and each collective
X = (np.arange(64 * 50, dtype=np.float32) / 7).reshape(64, 50)  # 12.5 KiB: several chunks of 4 KiB


def crc_of(a: np.ndarray) -> int:
    return crc32c(np.ascontiguousarray(a).tobytes())


def flip_decoded_chunks(monkeypatch) -> None:
    """Every chunk a get reads comes back, after its CRC check, as a copy with one bit flipped."""
    decode = fmt.decode_chunk

    def damaged(layout, body):
        out = decode(layout, body).copy()
        out.reshape(-1).view(np.uint8)[0] ^= 1
        return out

    monkeypatch.setattr(fmt, "decode_chunk", damaged)


@pytest.fixture
def store(tmp_path):
    with dtm.store.open(tmp_path / "s", inline_bytes=0, chunk_bytes=4096) as st:
        yield st


def test_a_get_of_several_chunks_checks_the_tensor_after_assembling_it(store, monkeypatch):
    info = store.put("w", X)
    assert info.checksum == f"{crc_of(X):08x}"  # computed from the caller's array
    np.testing.assert_array_equal(store.get_array("w"), X)
    flip_decoded_chunks(monkeypatch)
    with pytest.raises(TensorChecksumMismatch) as e:
        store.get_array("w")
    assert e.value.code is ErrorCode.TENSOR_CHECKSUM_MISMATCH and e.value.expected == crc_of(X)
    assert e.value.found != crc_of(X)
    for part in ("E1008", "get of key 'w'", "the store at", f"{crc_of(X):08x}"):
        assert part in str(e.value), (part, str(e.value))
    monkeypatch.setenv(ENV, "0")  # off: the damaged copy is what the check alone stopped
    assert not np.array_equal(store.get_array("w"), X)


def test_an_inline_put_checksums_the_callers_array_before_its_copy(tmp_path, monkeypatch):
    small = X[:4, :8]  # 128 bytes: kept in its index row
    with dtm.store.open(tmp_path / "inline") as st:
        assert st.put("s", small).checksum == f"{crc_of(small):08x}"
        tobytes = np.ndarray.tobytes

        class Damaged(np.ndarray):  # a put whose copy into the row gets one bit flipped
            def tobytes(self, *a, **kw):
                body = bytearray(tobytes(self, *a, **kw))
                body[3] ^= 1
                return bytes(body)

        to_storage = fmt.to_storage
        monkeypatch.setattr(fmt, "to_storage", lambda a, dt: to_storage(a, dt).view(Damaged))
        assert st.put("s", small).checksum == f"{crc_of(small):08x}"
        monkeypatch.undo()
        with pytest.raises(dtm.store.ChecksumError, match="inline"):
            st.get_array("s")


@pytest.mark.parametrize("put_pl,get_pl", [([Shard(0)], [Shard(1)]), ([Shard(1)], None)])
def test_a_distributed_get_checks_its_pieces_against_the_tensor_checksum(store, monkeypatch, put_pl, get_pl):
    mesh = dtm.Mesh({"x": 2})
    info = store.put("d", dtm.distribute(X, mesh, put_pl))
    assert info.checksum == f"{crc_of(X):08x}"
    got = store.get("d", mesh=dtm.Mesh({"y": 2}), placements=get_pl)
    np.testing.assert_array_equal(got.numpy(), X)
    flip_decoded_chunks(monkeypatch)
    with pytest.raises(TensorChecksumMismatch) as e:
        store.get("d", mesh=dtm.Mesh({"y": 2}), placements=get_pl)
    assert e.value.expected == crc_of(X) and "get of key 'd' laid out as" in str(e.value)


# --- the mesh's store over the wire, real processes ---------------------------------------------

def rank_main() -> None:
    from dtm.store import wire as store_wire
    from dtm.store.mesh_store import placement

    pg = dtm.runtime.process_group.init(timeout=PG_TIMEOUT_S, op_timeout=PG_TIMEOUT_S)
    st = dtm.store.mesh(replicas=1, share_memory=False)  # every byte through the socket
    keys = [f"k/{i}" for i in range(100) if placement(f"k/{i}", 2)[0] == 1][:3]  # held by rank 1
    result = {"rank": pg.rank}
    if pg.rank == 0:
        st.put(keys[0], X)
        result["clean"] = bool(np.array_equal(st.get_array(keys[0]), X))
        send = store_wire.StoreConnection.send

        def damaged_send(self, msg, data=None):  # the put's bytes, after the caller's CRC
            if data is not None and len(data):
                data = bytearray(data)
                data[1] ^= 1
                data = memoryview(data)
            return send(self, msg, data)

        store_wire.StoreConnection.send = damaged_send
        try:
            st.put(keys[1], X)
        except TensorChecksumMismatch as e:
            result["put"] = str(e)
            result["deleted"] = keys[1] not in st
        store_wire.StoreConnection.send = send
        read_array = store_wire.StoreConnection.read_array

        def damaged_read(self, *a, **kw):  # after every frame's CRC check
            out = read_array(self, *a, **kw).copy()
            out.reshape(-1).view(np.uint8)[2] ^= 1
            return out

        store_wire.StoreConnection.read_array = damaged_read
        try:
            st.get_array(keys[0])
        except TensorChecksumMismatch as e:
            result["get"] = str(e)
        store_wire.StoreConnection.read_array = read_array
    pg.barrier()
    print("RESULT " + json.dumps(result), flush=True)
    pg.barrier()


def test_the_mesh_store_checks_puts_and_gets_over_the_wire(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTM_")}
    env.update(PYTHONPATH=str(ROOT), DTM_HOST="127.0.0.1", DTM_MESH_STORE=str(tmp_path / "parts"))
    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", "2", "--join-timeout", str(PG_TIMEOUT_S), str(HERE)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = next(json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines()
               if "RESULT " in line and '"rank": 0' in line)
    assert res["clean"] and res["deleted"], res
    flipped = bytearray(X.tobytes())
    flipped[1] ^= 1
    for part in ("E1008", "put of key 'k/", "to rank 1's store", f"{crc32c(bytes(flipped)):08x} where it arrived",
                 f"{crc_of(X):08x} where it was produced", "rank 1 deleted the damaged copy"):
        assert part in res.get("put", ""), (part, res)
    flipped = bytearray(X.tobytes())
    flipped[2] ^= 1
    for part in ("E1008", "get of key 'k/", "from rank 1's store", f"{crc32c(bytes(flipped)):08x} where it arrived"):
        assert part in res.get("get", ""), (part, res)


if __name__ == "__main__":
    rank_main()
