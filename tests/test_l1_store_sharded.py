"""Runtime L1 and distributed tensors in the store (spec 9.2.10): two processes started by
`dtm launch` (real processes on 127.0.0.1) form a mesh of 2, open the same directory store,
and each puts only its own piece of a tensor (no gather); then each gets it back with other
placements and checks its piece against numpy, and counts the chunks it read: only those
its piece overlaps. A put that fails on one rank fails on both and keeps the old tensor. The
test process then reads the keys whole, as one process would. Run
as a script, this file is one rank's side."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
from crc32c import crc32c

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parent.parent
TIMEOUT_S = 90     # the whole launch, 2 processes sharing 2 cores
PG_TIMEOUT_S = 30  # joining the mesh and every collective


def x_f32() -> np.ndarray:
    return np.arange(5 * 6, dtype=np.float32).reshape(5, 6) / 8  # 5 rows over 2 ranks: 3 and 2


def x_bf16() -> np.ndarray:
    return (np.arange(4 * 3, dtype=np.float32).reshape(4, 3) - 5).astype(ml_dtypes.bfloat16)


def rank_main(store_dir: str) -> None:
    import dtm
    from dtm.store.store import Store

    pg = dtm.runtime.process_group.init(timeout=PG_TIMEOUT_S, op_timeout=PG_TIMEOUT_S)
    st = dtm.store.open(store_dir)
    mesh = dtm.Mesh({"x": 2})
    assert mesh.process is not None and mesh.rank == pg.rank  # a mesh of processes: L1
    reads: list[tuple[int, ...]] = []
    chunk = Store._chunk
    Store._chunk = lambda self, entry, layout, i: reads.append(i) or chunk(self, entry, layout, i)

    x = x_f32()
    dt = dtm.distribute(x, mesh, [dtm.Shard(0)])
    assert [p is not None for p in dt.local_shards()] == [pg.rank == 0, pg.rank == 1]  # only its own piece
    info = st.put("a", dt)  # collective: each rank writes its chunk, rank 0 commits
    assert (info.shape, info.version, info.checksum) == ((5, 6), 1, f"{crc32c(x.tobytes()):08x}")

    got = st.get("a", mesh=mesh, placements=[dtm.Shard(0)])  # the same layout: its own chunk alone
    assert reads == [(pg.rank, 0)], reads
    np.testing.assert_array_equal(got.local_shards()[pg.rank].numpy(), x[3 * pg.rank:3 * pg.rank + 3])
    reads.clear()
    got = st.get("a", mesh=mesh, placements=[dtm.Shard(1)])  # columns: every row chunk
    assert sorted(reads) == [(0, 0), (1, 0)], reads
    np.testing.assert_array_equal(got.local_shards()[pg.rank].numpy(), x[:, 3 * pg.rank:3 * pg.rank + 3])
    np.testing.assert_array_equal(got.full_tensor().numpy(), x)  # every rank calls it: a gather

    b = x_bf16()
    info = st.put("b", dtm.distribute(dtm.from_numpy(b), mesh, [dtm.Replicate()]))  # rank 0 writes the one chunk
    assert info.checksum == f"{crc32c(b.tobytes()):08x}"
    got = st.get("b", mesh=mesh, placements=[dtm.Shard(1)])
    assert got.local_shards()[pg.rank].numpy().tobytes() == b[:, 2 * pg.rank:2 * pg.rank + 2].tobytes()

    # get_many: both keys as their gets give them, the ranks agreeing in two all_gathers in all
    gathers = []
    all_gather = pg.all_gather
    pg.all_gather = lambda *a, **k: gathers.append(1) or all_gather(*a, **k)
    many = st.get_many([("a", mesh, [dtm.Shard(1)]), ("b", mesh, [dtm.Shard(0)])])
    assert len(gathers) == 2, gathers
    np.testing.assert_array_equal(many[0].local_shards()[pg.rank].numpy(), x[:, 3 * pg.rank:3 * pg.rank + 3])
    assert many[1].local_shards()[pg.rank].numpy().tobytes() == b[2 * pg.rank:2 * pg.rank + 2].tobytes()
    # a chunk of "b" damaged for rank 1 alone: both ranks fail naming "b", rank 0 naming rank 1 too
    read_box = Store._read_box
    if pg.rank == 1:
        def damaged(store, entry, layout, box):
            if entry.key == "b":
                raise dtm.store.ChecksumError("b", "c/0/0", "damaged on purpose")
            return read_box(store, entry, layout, box)
        Store._read_box = damaged
    try:
        st.get_many([("a", mesh, [dtm.Shard(0)]), ("b", mesh, [dtm.Replicate()])])
        raise AssertionError("the get should have failed")
    except dtm.DTMError as e:
        assert e.code is dtm.ErrorCode.STORE_CHUNK_CORRUPT and "'b'" in e.message, e
        assert pg.rank == 1 or "process rank 1" in e.message, e
    Store._read_box = read_box
    pg.all_gather = all_gather

    # rank 1's disk fails: both ranks fail the put (rank 0 naming rank 1), and "a" keeps its tensor;
    # rank 0 writes after rank 1 failed: rank 1 must not remove the version rank 0 is writing into
    if pg.rank == 1:
        Store._write_chunk = lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    else:
        write = Store._write_chunk

        def late_write(store, rel, *args):
            time.sleep(0.5)  # rank 1 has failed by now
            assert os.path.isdir(store._files.path(rel)), "rank 1 removed the version rank 0 writes into"
            return write(store, rel, *args)
        Store._write_chunk = late_write
    try:
        st.put("a", dtm.distribute(np.zeros((5, 6), np.float32), mesh, [dtm.Shard(0)]))
        raise AssertionError("the put should have failed")
    except dtm.DTMError as e:
        assert e.code is dtm.ErrorCode.STORE_IO_ERROR, e
        assert pg.rank == 1 or "process rank 1" in e.message, e
    assert st.info("a").version == 1
    np.testing.assert_array_equal(st.get_array("a"), x)


def test_two_processes_put_their_pieces_and_get_other_placements(tmp_path):
    import dtm

    env = dict(os.environ, PYTHONPATH=str(ROOT), DTM_HOST="127.0.0.1")
    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", "2", "--join-timeout", str(PG_TIMEOUT_S),
           str(HERE), str(tmp_path / "store")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with dtm.store.open(str(tmp_path / "store")) as st:
        assert st.keys() == ["a", "b"]
        np.testing.assert_array_equal(st.get("a").numpy(), x_f32())
        assert st.get_array("b").tobytes() == x_bf16().tobytes()
        assert st.verify().ok
        assert st.collect(older_than_s=0) == []  # the failed put left no version directory behind
        chunks = sorted(p.relative_to(tmp_path / "store" / st.info("a").dir).as_posix()
                        for p in (tmp_path / "store" / st.info("a").dir / "c").rglob("*") if p.is_file())
        assert chunks == ["c/0/0", "c/1/0"]  # one chunk per rank's piece


if __name__ == "__main__":
    rank_main(sys.argv[1])
