"""dtm.all_reduce and friends outside dtm.shard_map: after dtm.init() they are the
collectives between processes (dtm.distributed), with dtm.barrier, dtm.send and dtm.recv;
before it, a clear error."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import dtm

SCRIPT = """
import numpy as np, dtm
dtm.init(timeout=60)
r = dtm.rank()
x = dtm.tensor(np.arange(4, dtype=np.float32) * (r + 1))
s = dtm.all_reduce(x, op="sum")
g = dtm.all_gather(dtm.tensor(np.full((1, 2), r, np.int64)), dim=0)
dtm.barrier()
if r == 0:
    dtm.send(dtm.tensor(np.array([7.5, -1.0], np.float32)), dst=1)
    got = "sent"
else:
    got = dtm.recv(0, dtype="f32", shape=(2,)).numpy().tolist()
print("RESULT", r, s.numpy().tolist(), g.numpy().tolist(), got, flush=True)
dtm.shutdown()
"""


def test_top_level_collectives_run_between_processes(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "dtm.cli", "launch", "-n", "2", str(script)],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, DTM_BACKEND="ref"))
    assert out.returncode == 0, out.stderr
    results = sorted(line.split("RESULT ", 1)[1] for line in out.stdout.splitlines() if "RESULT " in line)
    want_sum = (np.arange(4) * 1 + np.arange(4) * 2).tolist()
    got = ["sent", [7.5, -1.0]]
    assert results == [f"{r} {[float(v) for v in want_sum]} [[0, 0], [1, 1]] {got[r]}" for r in range(2)]


def test_top_level_collectives_need_shard_map_or_init():
    with pytest.raises(dtm.DTMError) as info:
        dtm.all_reduce(dtm.tensor([1.0, 2.0]))
    assert info.value.code is dtm.ErrorCode.NOT_INITIALIZED and "dtm.init()" in str(info.value)
