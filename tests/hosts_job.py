"""A job for tests/test_hosts.py: one rank on a "host" of tests/hosts.py (its own network
namespace and hostname). All-reduces a small and a 4 MiB rank-dependent array, sends rank
0's array to the last rank (across hosts), times a 4 MiB and a 2-float all_reduce (and counts
the bytes the 4 MiB one sent by socket), and prints one JSON line; the test checks the values against numpy."""

import json
import sys
import time

import numpy as np

import dtm

pg = dtm.init(timeout=60)
r, n = pg.rank, pg.world_size
out = {"rank": r, "nodes": list(pg.nodes),
       "small": pg.all_reduce(np.arange(8, dtype=np.float32) * (r + 1)).tolist(),
       "big": pg.all_reduce(np.full(1 << 20, r + 1, np.float32)).tolist()[::65536]}
if r == 0:
    pg.send(np.arange(5, dtype=np.int64), n - 1)
if r == n - 1:
    out["recv"] = pg.recv(0, dtype=np.int64, shape=(5,)).tolist()
big = np.ones(1 << 20, np.float32)
tp = pg.comm.transport
tcp_before = tp.bytes_sent - tp.shared_bytes_sent
t0 = time.perf_counter()
pg.all_reduce(big)
out["big_all_reduce_s"] = time.perf_counter() - t0
out["big_tcp_bytes"] = tp.bytes_sent - tp.shared_bytes_sent - tcp_before  # what this rank sent by socket
one = np.ones(2, np.float32)
pg.all_reduce(one)
t0 = time.perf_counter()
for _ in range(20):
    pg.all_reduce(one)
out["tiny_all_reduce_s"] = (time.perf_counter() - t0) / 20
sys.stdout.write(json.dumps(out) + "\n")
sys.stdout.flush()
