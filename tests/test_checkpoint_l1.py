"""dtm.checkpoint between processes (spec 9.4): two ranks under `dtm launch` save a tensor
sharded over them (each rank writes its own piece), a replicated one (written once) and a
plain value, load it back with other placements, and one process with no mesh loads it
whole; values against numpy."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parent.parent
TIMEOUT_S = 90     # the whole launch, 2 processes sharing 2 cores
PG_TIMEOUT_S = 30  # joining the mesh and every collective

W = np.arange(5 * 6, dtype=np.float32).reshape(5, 6) / 8  # 5 rows over 2 ranks: 3 and 2
B = np.linspace(-1, 1, 7).astype(np.float32)


def rank_main(root: str) -> None:
    import dtm

    pg = dtm.runtime.process_group.init(timeout=PG_TIMEOUT_S, op_timeout=PG_TIMEOUT_S)
    mesh = dtm.Mesh({"dp": 2})
    assert mesh.process is not None
    state = {"w": dtm.distribute(W, mesh, [dtm.Shard(0)]), "b": dtm.distribute(B, mesh, [dtm.Replicate()]),
             "step": 7}
    dtm.checkpoint.save(state, root, step=7).wait()
    other = {"w": dtm.distribute(np.zeros_like(W), mesh, [dtm.Shard(1)]),
             "b": dtm.distribute(np.zeros_like(B), mesh, [dtm.Shard(0)]), "step": 0}
    dtm.checkpoint.load(other, root)
    assert other["step"] == 7
    np.testing.assert_array_equal(other["w"].local_shards()[pg.rank].numpy(), W[:, 3 * pg.rank:3 * pg.rank + 3])
    np.testing.assert_array_equal(other["b"].local_shards()[pg.rank].numpy(), B[4 * pg.rank:4 * pg.rank + 4])


def launch(script: pathlib.Path, n: int, *args: str, timeout: float = TIMEOUT_S,
           join_timeout: float = PG_TIMEOUT_S) -> None:
    """Run `script ARGS...` as `n` ranks under `dtm launch` on 127.0.0.1, every wait bounded;
    fails the test with the job's output when it does not end well."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), DTM_HOST="127.0.0.1")
    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", str(n), "--join-timeout", str(join_timeout),
           str(script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def test_two_processes_save_their_pieces_and_one_process_loads_them(tmp_path):
    import dtm

    root = tmp_path / "run"
    launch(HERE, 2, str(root))
    (ckpt,) = dtm.checkpoint.list(root)
    assert ckpt.step == 7 and ckpt.mesh == "dp=2"
    state = {"w": dtm.zeros(5, 6), "b": dtm.zeros(7), "step": None}
    dtm.checkpoint.load(state, root)
    np.testing.assert_array_equal(state["w"].numpy(), W)
    np.testing.assert_array_equal(state["b"].numpy(), B)
    assert state["step"] == 7
    assert dtm.checkpoint.verify(root).ok
    manifest = dtm.checkpoint.read_manifest(root)
    chunks = {t["name"]: len(t["chunks"]) for t in manifest["tensors"]}
    assert chunks == {"w": 2, "b": 1}, chunks  # each rank its piece of w; the replica once


if __name__ == "__main__":
    rank_main(sys.argv[1])
