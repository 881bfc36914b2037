"""A job for the link-cut tests of tests/test_hosts.py: one rank on a "host" of
tests/hosts.py that runs small all_reduces in a loop, one about every STEP_S, each checked
against the value numpy gives, while the test cuts a host's link and restores it.

The loop ends when every rank has seen the stop vote: each step all_reduces a flag along
with the data, 1 from a rank that finds the file named by argv[1] (the test writes it once
the link is back), so all ranks stop after the same step. Touches argv[2] once the first
step is done (the test cuts the link only after that: the mesh has formed). Prints one JSON
line: the steps done, the longest step, the DTMError that ended the job, if one did (its
code and message; exit status 3), and when the loop ended (wall clock: the test compares it
with when it cut the link). A wrong value is an AssertionError (a traceback, status 1).
"""

import json
import pathlib
import sys
import time

import numpy as np

import dtm
from dtm.errors import DTMError

STEP_S = 0.05
N = 8

stop, ready = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
pg = dtm.init(timeout=60)
r, n = pg.rank, pg.world_size
out = {"rank": r, "steps": 0, "longest_step_s": 0.0, "code": None, "error": None}
try:
    while True:
        x = np.arange(N + 1, dtype=np.float64) * (r + 1) + out["steps"]
        x[N] = float(stop.exists())
        t0 = time.perf_counter()
        got = pg.all_reduce(x)
        out["longest_step_s"] = max(out["longest_step_s"], time.perf_counter() - t0)
        want = np.arange(N, dtype=np.float64) * sum(range(1, n + 1)) + n * out["steps"]
        assert np.array_equal(got[:N], want), (out["steps"], got.tolist(), want.tolist())
        out["steps"] += 1
        if out["steps"] == 1:
            ready.touch()
        if got[N] > 0:
            break
        time.sleep(STEP_S)
except DTMError as e:
    out["code"], out["error"] = e.code.name, str(e)
out["ended_at"] = time.time()
sys.stdout.write(json.dumps(out) + "\n")
sys.stdout.flush()
sys.exit(3 if out["error"] else 0)
