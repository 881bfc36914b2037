"""dtm.checkpoint.save on a mesh of two processes writes in the background (spec 9.4.7):
collectives of the training run between save and wait while a rank's writes are held back,
with the values numpy gives; a rank whose write fails (ENOSPC) fails the save on both ranks
and the earlier checkpoint stays the newest; the next save succeeds. A program that saves
and exits without waiting keeps its checkpoint."""

from __future__ import annotations

import errno
import os
import pathlib
import subprocess
import sys
import threading

import numpy as np

from test_checkpoint_l1 import launch  # this folder is on sys.path

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parent.parent
TIMEOUT_S = 180    # the whole launch, 2 processes sharing 2 busy cores
PG_TIMEOUT_S = 60  # joining the mesh and every collective
WAIT_S = 120       # a save's wait

W = np.arange(64 * 48, dtype=np.float32).reshape(64, 48) / 16
B = np.linspace(-1, 1, 7).astype(np.float32)


def _state(dtm, mesh, scale: float) -> dict:
    return {"w": dtm.distribute(W * scale, mesh, [dtm.Shard(0)]),
            "b": dtm.distribute(B * scale, mesh, [dtm.Replicate()]), "step": int(scale)}


def _loaded(dtm, mesh, root: str, rank: int) -> dict:
    out = {"w": dtm.distribute(np.zeros_like(W), mesh, [dtm.Shard(1)]),
           "b": dtm.distribute(np.zeros_like(B), mesh, [dtm.Replicate()]), "step": None}
    dtm.checkpoint.load(out, root)
    return {"w": out["w"].local_shards()[rank].numpy(), "b": out["b"].local_shards()[rank].numpy(),
            "step": out["step"]}


def rank_main(root: str) -> None:
    import dtm
    from dtm.store.files import LocalFiles

    pg = dtm.runtime.process_group.init(timeout=PG_TIMEOUT_S, op_timeout=PG_TIMEOUT_S)
    mesh = dtm.Mesh({"dp": 2})
    me = pg.rank
    cols = slice(24 * me, 24 * me + 24)
    real_write = LocalFiles.write

    # 1. a save in progress while the training's collectives run: rank 1's files are held
    # back until after them, so neither rank's save can be done before they end
    gate = threading.Event()

    def held_write(self, rel, parts):
        if not gate.wait(WAIT_S):
            raise OSError(errno.ETIMEDOUT, "the test's gate never opened", rel)
        return real_write(self, rel, parts)
    if me == 1:
        LocalFiles.write = held_write
    h = dtm.checkpoint.save(_state(dtm, mesh, 1.0), root, step=1)
    rng = np.random.default_rng(me)
    for i in range(20):
        x = rng.standard_normal((3, 5 + i)).astype(np.float32)
        got = pg.all_reduce(x, "sum")
        peers = pg.all_gather(x[None], dim=0)
        np.testing.assert_allclose(got, peers.sum(axis=0), rtol=1e-6)
        np.testing.assert_array_equal(peers[me], x)
        np.testing.assert_array_equal(pg.broadcast(np.full(4, i + me, np.int64), src=1), np.full(4, i + 1))
    assert not h.done(), "the save completed while rank 1's writes were held back"
    pg.barrier()
    gate.set()
    h.wait(WAIT_S)
    LocalFiles.write = real_write
    got = _loaded(dtm, mesh, root, me)
    np.testing.assert_array_equal(got["w"], W[:, cols])
    np.testing.assert_array_equal(got["b"], B)
    assert got["step"] == 1

    # 2. rank 1's disk is full: the save fails on both ranks, step 1 stays the newest
    def full_write(self, rel, parts):
        raise OSError(errno.ENOSPC, "No space left on device", self.path(rel))
    if me == 1:
        LocalFiles.write = full_write
    h = dtm.checkpoint.save(_state(dtm, mesh, 2.0), root, step=2)
    try:
        h.wait(WAIT_S)
    except dtm.DTMError as e:
        assert e.code.value == "E1104", e
        assert "the earlier checkpoints are kept" in e.message, e.message
        if me == 0:
            assert "process rank 1" in e.message and "No space left" in e.message, e.message
    else:
        raise AssertionError("the save with a failed rank succeeded")
    LocalFiles.write = real_write
    pg.barrier()  # (rank 0 removes the failed step directory before its wait returns)
    assert [c.step for c in dtm.checkpoint.list(root)] == [1]
    assert not os.path.exists(os.path.join(root, "step-000000000002"))
    assert _loaded(dtm, mesh, root, me)["step"] == 1

    # 3. the next save goes through
    dtm.checkpoint.save(_state(dtm, mesh, 3.0), root, step=3).wait(WAIT_S)
    got = _loaded(dtm, mesh, root, me)
    np.testing.assert_array_equal(got["w"], 3 * W[:, cols])
    assert got["step"] == 3


def test_save_on_two_processes_runs_beside_collectives_and_fails_on_every_rank(tmp_path):
    import dtm

    root = tmp_path / "run"
    launch(HERE, 2, str(root), timeout=TIMEOUT_S, join_timeout=PG_TIMEOUT_S)
    assert [c.step for c in dtm.checkpoint.list(root)] == [1, 3]
    assert dtm.checkpoint.verify(root).ok
    names = sorted(os.listdir(root / "step-000000000003"))
    assert not [n for n in names if n.startswith((".status", ".outcome", ".seen"))], names
    state = {"w": dtm.zeros(64, 48), "b": dtm.zeros(7), "step": None}
    dtm.checkpoint.load(state, root)
    np.testing.assert_array_equal(state["w"].numpy(), 3 * W)
    np.testing.assert_array_equal(state["b"].numpy(), 3 * B)


def test_a_program_that_saves_and_exits_keeps_its_checkpoint(tmp_path):
    import dtm

    code = ("import sys, numpy as np, dtm\n"
            "dtm.checkpoint.save({'w': np.arange(1 << 22, dtype=np.float32)}, sys.argv[1], step=5)\n")  # no wait
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    state = {"w": np.zeros(1 << 22, np.float32)}
    dtm.checkpoint.load(state, tmp_path)
    np.testing.assert_array_equal(state["w"], np.arange(1 << 22, dtype=np.float32))


if __name__ == "__main__":
    rank_main(sys.argv[1])
