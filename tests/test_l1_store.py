"""Runtime L1 and the tensor store: two processes started by `dtm launch` (real processes on
127.0.0.1) each open the same directory store and `dtm.store.use` it; a local-view program
on each rank puts its x, meets the other at a barrier and gets the other's x (spec 9.2:
a put is visible to a later get, also from another process on a shared store). Each rank
checks its result against numpy; the test process then reads both keys with `st.get`. Run
as a script, this file is one rank's side."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np

from test_store_programs import rank_program  # this folder is on sys.path

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parent.parent
TIMEOUT_S = 90     # the whole launch, 2 processes sharing 2 cores
PG_TIMEOUT_S = 30  # joining the mesh and every wait at the barrier


def x_of(rank: int) -> np.ndarray:
    return np.arange(6, dtype=np.float32).reshape(2, 3) * (rank + 1)


def rank_main(store_dir: str) -> None:
    import dtm
    from dtm.runtime import l1

    dtm.store.use(dtm.store.open(store_dir))
    pg = dtm.runtime.process_group.init(timeout=PG_TIMEOUT_S, op_timeout=PG_TIMEOUT_S)
    (got,) = l1.executor().run(rank_program(pg.rank), "f", [x_of(pg.rank)])
    np.testing.assert_array_equal(got, x_of(1 - pg.rank) - x_of(pg.rank))


def test_two_processes_share_a_directory_store(tmp_path):
    import dtm

    env = dict(os.environ, PYTHONPATH=str(ROOT), DTM_HOST="127.0.0.1")
    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", "2", "--join-timeout", str(PG_TIMEOUT_S),
           str(HERE), str(tmp_path / "store")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    st = dtm.store.open(str(tmp_path / "store"))
    assert st.keys("ranks/") == ["ranks/0", "ranks/1"]
    for r in range(2):
        np.testing.assert_array_equal(st.get(f"ranks/{r}").numpy(), x_of(r))


if __name__ == "__main__":
    rank_main(sys.argv[1])
