"""A job for tests/test_launchers.py, started by another launcher (torchrun, or Slurm's
variables set by hand): `dtm.init()` takes its rank, world size and coordinator from them;
each rank all_reduces a rank-dependent array and prints one JSON line, then stays
LINGER seconds (default 0) before it leaves the mesh."""

import json
import os
import sys
import time

import numpy as np

import dtm

pg = dtm.init(timeout=60)
x = np.arange(4, dtype=np.float32) * (pg.rank + 1)
line = json.dumps({"rank": pg.rank, "world": pg.world_size, "sum": pg.all_reduce(x).tolist()}) + "\n"
sys.stdout.write(line)  # one write: the ranks of a launcher may share one pipe
sys.stdout.flush()
time.sleep(float(os.environ.get("LINGER", "0")))
