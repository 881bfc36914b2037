"""Ranks as real processes on 127.0.0.1 (spec 9.6): `dtm launch`, the DTM_* environment,
the collectives of dtm.distributed against numpy, and PeerLost when a rank dies or hangs.
Every wait is bounded; processes left over are killed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from dtm.cluster import Coordinator, detection_bound

RANK_SCRIPT = r'''
import json, os, sys, time
import numpy as np
import dtm
from dtm import distributed as dist

def x_of(r):
    return np.arange(12, dtype=np.float32).reshape(3, 4) * (r + 1) + r

dtm.init(timeout=30)
r, n = dtm.rank(), dtm.world_size()
x = x_of(r)
out = {"rank": r, "world": n, "pid": os.getpid()}
out["sum"] = dist.all_reduce(x).tolist()
t = dist.all_reduce(dtm.tensor(x), op="max")
out["max"], out["max_type"] = t.numpy().tolist(), type(t).__name__
out["gather"] = dist.all_gather(x, dim=1).tolist()
out["bcast"] = dist.broadcast(x if r == n - 1 else np.zeros_like(x), src=n - 1).tolist()
out["rs"] = dist.reduce_scatter(np.concatenate([x] * n), dim=0).tolist()
out["a2a"] = dist.all_to_all(np.concatenate([x + 100 * j for j in range(n)]), split_dim=0, concat_dim=1).tolist()
dist.send(x, (r + 1) % n)
out["recv"] = dist.recv((r - 1) % n).numpy().tolist()
if os.environ.get("AXES"):
    out["tp_sum"] = dist.all_reduce(x, axis="tp").tolist()
    out["dp_gather"] = dist.all_gather(x, axis="dp").tolist()
dist.barrier()
print("RESULT " + json.dumps(out), flush=True)
time.sleep(float(os.environ.get("LINGER", "0")))
dtm.shutdown()
'''

LOOP_SCRIPT = r'''
import json, os, sys, time
import numpy as np
import dtm
dtm.init(timeout=30)
r = dtm.rank()
x = np.ones(1 << 18, np.float32)
dtm.distributed.barrier()
print(json.dumps({"ready": r, "pid": os.getpid()}), flush=True)
try:
    while True:
        dtm.distributed.all_reduce(x)
except dtm.DTMError as e:
    print(json.dumps({"rank": r, "t": time.time(), "code": e.code.value, "type": type(e).__name__, "msg": str(e)}),
          flush=True)
'''


def x_of(r: int) -> np.ndarray:
    return np.arange(12, dtype=np.float32).reshape(3, 4) * (r + 1) + r


@pytest.fixture
def procs():
    """Popen objects started by the test; killed at the end whatever happened."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def _script(tmp_path, text: str, name: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _env(**kw) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTM_")}
    env.update({k: str(v) for k, v in kw.items()})
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtm.cli", "launch", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _results(lines) -> dict[int, dict]:
    out = {}
    for line in lines:
        if "RESULT " in line:
            d = json.loads(line.split("RESULT ", 1)[1])
            out[d["rank"]] = d
    return out


def _check_collectives(results: dict[int, dict], n: int, axes: dict[str, int] | None = None) -> None:
    """Each rank's results against numpy on the same inputs."""
    xs = [x_of(r) for r in range(n)]
    assert sorted(results) == list(range(n))
    for r, d in results.items():
        assert d["world"] == n
        np.testing.assert_array_equal(d["sum"], np.sum(xs, axis=0))
        np.testing.assert_array_equal(d["max"], np.max(xs, axis=0))
        assert d["max_type"] == "Tensor"
        np.testing.assert_array_equal(d["gather"], np.concatenate(xs, axis=1))
        np.testing.assert_array_equal(d["bcast"], xs[n - 1])
        np.testing.assert_array_equal(d["rs"], np.sum(xs, axis=0))  # block r of the sum of [x_j]*n is sum(x_j)
        np.testing.assert_array_equal(d["a2a"], np.concatenate([xs[j] + 100 * r for j in range(n)], axis=1))
        np.testing.assert_array_equal(d["recv"], xs[(r - 1) % n])
        if axes:
            dp, tp = divmod(r, axes["tp"])  # row-major over (dp, tp)
            tp_group = [dp * axes["tp"] + j for j in range(axes["tp"])]
            dp_group = [i * axes["tp"] + tp for i in range(axes["dp"])]
            np.testing.assert_array_equal(d["tp_sum"], np.sum([xs[j] for j in tp_group], axis=0))
            np.testing.assert_array_equal(d["dp_gather"], np.concatenate([xs[j] for j in dp_group]))


def test_launch_two_ranks(tmp_path):
    script = _script(tmp_path, RANK_SCRIPT, "ranks.py")
    res = _launch(["-n", "2", script], _env())
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines and all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in lines), res.stdout
    _check_collectives(_results(lines), 2)


def test_launch_four_ranks_on_mesh_axes(tmp_path):
    script = _script(tmp_path, RANK_SCRIPT, "ranks.py")
    res = _launch(["-n", "4", "--axes", "dp=2,tp=2", script], _env(AXES=1))
    assert res.returncode == 0, res.stdout + res.stderr
    _check_collectives(_results(res.stdout.splitlines()), 4, {"dp": 2, "tp": 2})


def test_ranks_from_environment_variables_rank_0_runs_the_coordinator(tmp_path, procs):
    """No launcher: rank 0 runs the coordinator; the other rank leaves its rank to it."""
    script = _script(tmp_path, RANK_SCRIPT, "ranks.py")
    common = dict(DTM_COORDINATOR=f"127.0.0.1:{_free_port()}", DTM_WORLD_SIZE=2, DTM_TOKEN="env token")
    procs.append(subprocess.Popen([sys.executable, script], env=_env(DTM_RANK=0, **common), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True))
    procs.append(subprocess.Popen([sys.executable, script], env=_env(**common), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    results = _results(o for out, _ in outs for o in out.splitlines())
    _check_collectives(results, 2)
    assert results[0]["pid"] == procs[0].pid and results[1]["pid"] == procs[1].pid


def test_launch_prefixes_output_and_ends_every_rank_when_one_fails(tmp_path):
    script = _script(tmp_path, r'''
import os, sys, time
r = int(os.environ["DTM_RANK"])
open(os.path.join(sys.argv[1], f"pid{r}"), "w").write(str(os.getpid()))
print(f"out of {r} of {os.environ['DTM_WORLD_SIZE']}", flush=True)
print(f"err of {r}", file=sys.stderr, flush=True)
if r == 1:
    time.sleep(0.5)
    sys.exit(3)
time.sleep(120)
''', "fails.py")
    start = time.monotonic()
    res = _launch(["-n", "3", "--grace", "2", script, str(tmp_path)], _env(), timeout=60)
    assert time.monotonic() - start < 30
    assert res.returncode == 3, res.stdout + res.stderr
    for r in range(3):
        assert f"[rank {r}] out of {r} of 3" in res.stdout.splitlines()
        assert f"[rank {r}] err of {r}" in res.stderr.splitlines()
    assert "rank 1 failed first (exit code 3)" in res.stderr
    for r in range(3):  # every rank has ended
        pid = int((tmp_path / f"pid{r}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


KILLED_SCRIPT = r'''
import json, os, signal, sys, time
import numpy as np
import dtm
from dtm.runtime import process_group
dtm.init(timeout=30)
r = dtm.rank()
print(json.dumps({"rank": r, "session": process_group.current().comm.transport.session}), flush=True)
victims, when = sys.argv[1].split(","), sys.argv[2]

def die():
    # The rank with its helpers, multiprocessing's resource tracker among them (which would
    # otherwise remove the segments the rank created)
    os.killpg(os.getpgid(0), signal.SIGKILL)

x = np.ones(1 << 16, np.float32)
if when == "mid-run":
    for _ in range(10):
        dtm.distributed.all_reduce(x)
if str(r) in victims:
    time.sleep(0.3 * victims.index(str(r)))
    die()
while True:
    dtm.distributed.all_reduce(x)
'''


@pytest.mark.parametrize("victims,when", [("0", "at-start"), ("0", "mid-run"), ("1", "mid-run"), ("0,1", "at-start")])
def test_no_shared_memory_is_left_when_a_rank_is_killed(tmp_path, victims, when):
    """A rank SIGKILLed with its resource tracker left its 4 MB segment in /dev/shm: the
    creator now drops the channels' name once all mapped it, a survivor removes its mesh's
    names when it closes after losing a local rank, and the launcher removes them once
    every rank ended (the only one left when no survivor closes: "0,1")."""
    script = _script(tmp_path, KILLED_SCRIPT, "killed.py")
    res = _launch(["-n", "2", "--grace", "2", script, victims, when], _env(), timeout=90)
    sessions = {json.loads(line.split("] ", 1)[1])["session"] for line in res.stdout.splitlines()
                if line.split("] ", 1)[-1].startswith('{"rank"')}
    assert len(sessions) == 1 and res.returncode == 128 + signal.SIGKILL, res.stdout + res.stderr
    prefix = f"dtm{sessions.pop()}_"
    left = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    assert not left, res.stderr


STOPPED_SCRIPT = r'''
import os, signal, sys
import numpy as np
import dtm
dtm.init(timeout=30)
dtm.distributed.barrier()
if dtm.rank() == 2:
    os.kill(os.getpid(), signal.SIGSTOP)  # alive, its sockets open, silent
if sys.argv[1] == "fail":
    dtm.distributed.all_reduce(np.ones(4, np.float32))  # PeerLost once rank 2 is declared lost
elif sys.argv[1] == "recv":
    dtm.distributed.recv(2)  # the same, point to point
'''


@pytest.mark.parametrize("others", ["fail", "recv", "finish"])
def test_launch_names_the_rank_that_hung(tmp_path, others):
    """Issue 37: rank 2 stops; ranks 0 and 1 fail because of it in a collective or a recv
    (the launcher said "rank 0 failed first") or finish ("finish": the launcher waited for
    rank 2 forever). The report names rank 2, which the coordinator declared lost."""
    script = _script(tmp_path, STOPPED_SCRIPT, "stopped.py")
    start = time.monotonic()
    res = _launch(["-n", "3", "--grace", "2", script, others],
                  _env(DTM_HEARTBEAT_MS=200, DTM_HEARTBEAT_TIMEOUT_MS=2000), timeout=90)
    assert time.monotonic() - start < 60, res.stderr
    assert res.returncode == 128 + signal.SIGTERM, res.stdout + res.stderr  # ended by the launcher
    report = next(line for line in res.stderr.splitlines() if "failed first" in line)
    assert report.startswith("dtm launch: rank 2 failed first (killed by SIGTERM; the coordinator lost rank 2 "), report
    assert "no Heartbeat for" in report and report.endswith("ended the other ranks [0, 1]"), report
    if others != "finish":
        assert all(f"[rank {r}] dtm.comm.transport.PeerLost: E1001: rank 2 was lost during" in res.stderr
                   for r in (0, 1)), res.stderr


def _start_loop(tmp_path, procs, n: int, coord: Coordinator) -> dict[int, int]:
    """n ranks looping all_reduce against `coord`: rank -> pid, once all are in the loop."""
    script = _script(tmp_path, LOOP_SCRIPT, "loop.py")
    host, port = coord.address
    for r in range(n):
        env = _env(DTM_COORDINATOR=f"{host}:{port}", DTM_RANK=r, DTM_WORLD_SIZE=n, DTM_TOKEN="loop",
                   DTM_COORDINATOR_EXTERNAL=1)
        procs.append(subprocess.Popen([sys.executable, script], env=env, stdout=subprocess.PIPE, text=True))
    pids = {}
    for r, p in enumerate(procs):
        line = p.stdout.readline()  # bounded: init times out after 30 s and the script exits
        pids[r] = json.loads(line)["pid"]
    time.sleep(0.7)  # a few heartbeats from inside the loop
    return pids


def _survivors_report(procs, victim: int, t_kill: float) -> dict[int, dict]:
    reports = {}
    for r, p in enumerate(procs):
        if r != victim:
            out, _ = p.communicate(timeout=60)
            reports[r] = json.loads(out.strip().splitlines()[-1])
            reports[r]["after"] = reports[r]["t"] - t_kill
    return reports


def test_a_rank_killed_during_all_reduce_is_peer_lost_on_every_survivor(tmp_path, procs):
    coord = Coordinator(4, "loop").start()
    try:
        pids = _start_loop(tmp_path, procs, 4, coord)
        t_kill = time.time()
        os.kill(pids[2], signal.SIGKILL)
        reports = _survivors_report(procs, 2, t_kill)
    finally:
        coord.stop()
    bound = detection_bound(coord.heartbeat_ms, coord.timeout_ms)
    for r, d in reports.items():
        assert d["type"] == "PeerLost" and d["code"] == "E1001", d
        assert "rank 2 was lost" in d["msg"] and "its last operation was all_reduce(sum) f32[262144]" in d["msg"], d
        assert d["after"] < bound, (r, d["after"], bound)
    assert 2 in coord.lost and "closed without Leave" in coord.lost[2]


def test_a_stuck_rank_is_peer_lost_within_the_heartbeat_timeout(tmp_path, procs):
    coord = Coordinator(3, "loop", heartbeat_ms=200, timeout_ms=3000).start()
    try:
        pids = _start_loop(tmp_path, procs, 3, coord)
        t_stop = time.time()
        os.kill(pids[1], signal.SIGSTOP)  # alive, sockets open, silent
        try:
            reports = _survivors_report(procs, 1, t_stop)
        finally:
            os.kill(pids[1], signal.SIGKILL)
    finally:
        coord.stop()
    bound = detection_bound(200, 3000)
    for r, d in reports.items():
        assert d["type"] == "PeerLost" and "rank 1 was lost" in d["msg"] and "no Heartbeat for" in d["msg"], d
        assert d["after"] < bound, (r, d["after"], bound)
    beats = coord.last_heartbeats()  # what the survivors reported (bytes moved through shared memory aside)
    for r in (0, 2):
        assert beats[r].rss_bytes > 10 << 20 and beats[r].ops_done > 0 and beats[r].cpu_percent > 0
        assert beats[r].last_op.startswith("all_reduce(sum) f32[262144] over all ranks at loop.py:")


ONE_MORE_SCRIPT = r'''
import json, os, sys, time
import numpy as np
import dtm
dtm.init(timeout=30)
r = dtm.rank()
x = np.ones(1 << 16, np.float32)
dtm.distributed.all_reduce(x)
print(json.dumps({"ready": r}), flush=True)
go = sys.argv[1]
deadline = time.monotonic() + 30
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.02)
if r == 0:  # its loop ended one step earlier than rank 1's
    dtm.shutdown()
    print(json.dumps({"rank": r, "t": time.time()}), flush=True)
    sys.exit(0)
time.sleep(0.3)
try:
    dtm.distributed.all_reduce(x)
    print(json.dumps({"rank": r, "t": time.time(), "code": None}), flush=True)
except dtm.DTMError as e:
    print(json.dumps({"rank": r, "t": time.time(), "code": e.code.value, "msg": str(e)}), flush=True)
'''


def test_one_more_all_reduce_after_the_peer_shut_down_fails_at_once_without_a_coordinator(tmp_path, procs):
    """The stall of issue 16: ranks that end a loop on a shared clock sometimes disagree by
    one step; the late one's all_reduce waited 60 s in shared memory for the rank that had
    shut down (E0802), the coordinator being gone so no notice came either. Now the
    survivor sees the Leave on the connection: E1001 at once."""
    coord = Coordinator(2, "one more").start()
    script = _script(tmp_path, ONE_MORE_SCRIPT, "one_more.py")
    go = tmp_path / "go"
    host, port = coord.address
    try:
        for r in range(2):
            env = _env(DTM_COORDINATOR=f"{host}:{port}", DTM_RANK=r, DTM_WORLD_SIZE=2, DTM_TOKEN="one more",
                       DTM_COORDINATOR_EXTERNAL=1)
            procs.append(subprocess.Popen([sys.executable, script, str(go)], env=env, stdout=subprocess.PIPE,
                                          text=True))
        for p in procs:
            assert "ready" in p.stdout.readline()  # bounded: init times out after 30 s
    finally:
        coord.stop()  # the coordinator is gone before the ranks part
    go.touch()
    outs = [json.loads(p.communicate(timeout=90)[0].strip().splitlines()[-1]) for p in procs]
    left, late = outs
    assert late["code"] == "E1001" and "rank 0" in late["msg"] and "left the mesh" in late["msg"], late
    assert late["t"] - left["t"] < 10.0, (left, late)
