"""A job for tests/ray_launch_script.py (`dtm launch --ray`): all-reduces a rank-dependent
array every `--every` seconds for `--steps` steps, printing one line per step with the sum,
and one line to stderr at the start; the script checks the sums against numpy's."""

import argparse
import sys
import time

import numpy as np

import dtm

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--every", type=float, default=0.0)
args = ap.parse_args()

pg = dtm.init(timeout=60)
sys.stderr.write(f"rank {pg.rank} of {pg.world_size} started\n")
for step in range(args.steps):
    total = pg.all_reduce(np.arange(4, dtype=np.float32) * (pg.rank + 1) + step)
    print(f"step {step} sum {total.tolist()}", flush=True)
    time.sleep(args.every)
