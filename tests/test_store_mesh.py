"""The mesh's store across real processes on 127.0.0.1 (spec 9.2.11): `dtm.store.mesh()`
after `dtm.init()`, keys on two ranks by their hash, any rank getting any key, gets from
ranks on this machine mapped from their directories (no bytes through a socket), gets over
the wire when that is turned off, programs' store_get / store_put on the mesh's store, and
a rank killed with SIGKILL losing no key that had a live replica, a get from a stopped rank
ending once the coordinator declares it lost, and the parts of killed ranks removed by `dtm
launch` and by the next `dtm.init()` on the host. Every value is compared with the numpy
array the test regenerates from its seed. Run as a script, this file is one rank's side."""

from __future__ import annotations

import json
import mmap
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parent.parent
TIMEOUT_S = 90     # a whole run of ranks sharing 2 cores
PG_TIMEOUT_S = 30  # joining the mesh, and each collective


def value(i: int, rows: int = 512) -> np.ndarray:
    """Key i's tensor: 66 KiB by default, past MAP_BYTES, so a get on the host maps its chunk."""
    return np.random.default_rng(i).standard_normal((rows, 33)).astype(np.float32)


def mapped(a: np.ndarray) -> bool:
    """Whether `a`'s memory is a mapping of a file (not a copy)."""
    while a is not None and not isinstance(a, mmap.mmap):
        a = getattr(a, "base", None) if isinstance(a, np.ndarray) else getattr(a, "obj", None)
    return isinstance(a, mmap.mmap)


def report(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def wait_for_survivors(folder: pathlib.Path, rank: int, survivors: tuple[int, ...]) -> None:
    """Say this rank is done (a file in `folder`) and wait, bounded, until every survivor
    is: a barrier no collective can give once a rank of the mesh is gone."""
    (folder / f"done-{rank}").touch()
    deadline = time.monotonic() + PG_TIMEOUT_S
    while not all((folder / f"done-{r}").exists() for r in survivors) and time.monotonic() < deadline:
        time.sleep(0.05)


# --- the ranks' side -------------------------------------------------------------------------

def killed_rank_main() -> None:
    """Three ranks; rank 0 puts; after the test SIGKILLs rank 2 the others get every key."""
    import dtm
    from dtm.store.mesh_store import placement

    pg = dtm.runtime.process_group.init(timeout=PG_TIMEOUT_S, op_timeout=PG_TIMEOUT_S)
    st, one = dtm.store.mesh(), dtm.store.mesh(replicas=1)
    if pg.rank == 0:
        for i in range(24):
            st.put(f"w/{i}", value(i))
            one.put(f"one/{i}", value(100 + i))
    pg.barrier()
    # rank 1 reads a key it does not hold: from a local rank's directory, mapped, no socket
    away = next(f"w/{i}" for i in range(24) if 1 not in placement(f"w/{i}", 3)[:2])
    got = st.get_array(away)
    local_read = dict(mapped=mapped(got), sockets=len(st._conns), equal=bool(np.array_equal(got, value(int(away[2:])))))
    print(json.dumps({"ready": pg.rank, "pid": os.getpid()}), flush=True)
    if pg.rank == 2:
        time.sleep(TIMEOUT_S)  # the test kills this rank
    deadline = time.monotonic() + PG_TIMEOUT_S
    while 2 not in pg.membership.lost and time.monotonic() < deadline:
        time.sleep(0.05)
    equal = [bool(np.array_equal(st.get_array(f"w/{i}"), value(i))) for i in range(24)]
    single = {}
    for i in range(24):
        try:
            single[i] = bool(np.array_equal(one.get_array(f"one/{i}"), value(100 + i)))
        except dtm.store.KeyLost as e:
            single[i] = {"code": e.code.value, "lost": e.lost, "msg": str(e)}
    report(rank=pg.rank, knows_lost=2 in pg.membership.lost, equal=equal, single=single,
           homes={i: placement(f"one/{i}", 3)[0] for i in range(24)}, local_read=local_read)
    # A survivor serves its part until the other is done too (no collective: one rank is gone).
    wait_for_survivors(pathlib.Path(os.environ["DTM_MESH_STORE"]).parent, pg.rank, (0, 1))
    os._exit(0)  # the mesh lost a rank: no orderly shutdown to wait for


def program_rank_main() -> None:
    """Two ranks: a program's store ops use the mesh's store (no dtm.store.use), then a get
    of 8 MiB over the wire (share_memory=False)."""
    import dtm
    from dtm.runtime import l1
    from dtm.store.mesh_store import placement
    from test_store_programs import rank_program  # this folder is on sys.path

    pg = dtm.runtime.process_group.init(timeout=PG_TIMEOUT_S, op_timeout=PG_TIMEOUT_S)
    xs = [np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1) for r in range(2)]
    (got,) = l1.executor().run(rank_program(pg.rank), "f", [xs[pg.rank]])
    current = type(dtm.store.current()).__name__
    wire = dtm.store.mesh(replicas=1, share_memory=False)
    key = next(f"big/{i}" for i in range(100) if placement(f"big/{i}", 2)[0] == 0)
    if pg.rank == 0:
        wire.put(key, value(7, rows=64 << 10))  # 8.25 MiB
    pg.barrier()
    big = wire.get_array(key)
    report(rank=pg.rank, program=bool(np.array_equal(got, xs[1 - pg.rank] - xs[pg.rank])), current=current,
           big=bool(np.array_equal(big, value(7, rows=64 << 10))),
           over_wire=wire._conns[0].bytes_received if pg.rank == 1 else 0,
           keys=dtm.store.current().keys("ranks/"))
    pg.barrier()


def stopped_rank_main() -> None:
    """Three ranks; rank 2 holds two keys alone (replicas=1, asked over the wire) and the test
    stops it (SIGSTOP) before the others get the second: rank 1 on the connection its first
    get opened, rank 0 on a new one (its handshake waits)."""
    import dtm
    from dtm.store.mesh_store import placement

    pg = dtm.runtime.process_group.init(timeout=PG_TIMEOUT_S, op_timeout=PG_TIMEOUT_S)
    one = dtm.store.mesh(replicas=1, share_memory=False)
    keys = [k for k in (f"s/{i}" for i in range(100)) if placement(k, 3)[0] == 2][:2]
    if pg.rank == 2:
        for i, k in enumerate(keys):
            one.put(k, value(i))
    pg.barrier()
    if pg.rank == 1:
        one.get_array(keys[0])
    print(json.dumps({"ready": pg.rank, "pid": os.getpid()}), flush=True)
    go = pathlib.Path(os.environ["DTM_MESH_STORE"]).parent / "go"
    deadline = time.monotonic() + TIMEOUT_S
    while not go.exists() and time.monotonic() < deadline:  # rank 2 is stopped meanwhile
        time.sleep(0.02)
    start = time.monotonic()
    try:
        one.get_array(keys[1])
        outcome = {"code": None}
    except dtm.DTMError as e:
        outcome = {"code": e.code.value, "msg": str(e), "cause": type(e.__cause__).__name__}
    report(rank=pg.rank, waited=time.monotonic() - start, **outcome)
    os._exit(0)  # the mesh lost a rank: no orderly shutdown to wait for


def killed_parts_main() -> None:
    """Two ranks under `dtm launch`: rank 1 is killed (SIGKILL), and rank 0 ended by the
    launcher's SIGTERM, so that neither removes a part."""
    import dtm

    pg = dtm.runtime.process_group.init(timeout=PG_TIMEOUT_S, op_timeout=PG_TIMEOUT_S)
    dtm.store.mesh().put(f"k/{pg.rank}", value(pg.rank))
    pg.barrier()
    base = pathlib.Path(os.environ["DTM_MESH_STORE"])
    print(json.dumps({"ready": pg.rank, "parts": sorted(p.name for p in base.glob("dtm*_store/rank-*"))}),
          flush=True)
    if pg.rank == 1:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    time.sleep(TIMEOUT_S)


def failover_main() -> None:
    """Three ranks under `dtm launch`, their parts in the root argv[2] (set here, so the
    launcher's environment does not name it); argv[3] "elastic" calls dtm.init(elastic=True).
    Each rank puts 8 keys, then rank 1 is SIGKILLed; a survivor that goes on gets every key
    (rank 1's from their replicas) and leaves as a program does (Leave to the live ranks)."""
    os.environ["DTM_MESH_STORE"] = sys.argv[2]
    import dtm

    pg = dtm.init(timeout=PG_TIMEOUT_S, op_timeout=PG_TIMEOUT_S, elastic=sys.argv[3] == "elastic")
    st = dtm.store.mesh()  # replicas=2
    for i in range(8):
        st.put(f"r{pg.rank}/{i}", value(10 * pg.rank + i))
    pg.barrier()
    base = pathlib.Path(sys.argv[2])
    print(json.dumps({"ready": pg.rank, "parts": sorted(p.name for p in base.glob("dtm*_store/rank-*"))}),
          flush=True)
    if pg.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + PG_TIMEOUT_S
    while 1 not in pg.membership.lost and time.monotonic() < deadline:
        time.sleep(0.05)
    equal = [bool(np.array_equal(st.get_array(f"r{r}/{i}"), value(10 * r + i))) for r in range(3) for i in range(8)]
    knows_lost = 1 in pg.membership.lost
    # A survivor serves its part, which holds replicas of rank 1's keys, until the other has
    # read them too (leaving removes it).
    wait_for_survivors(base.parent, pg.rank, (0, 2))
    start = time.monotonic()
    dtm.shutdown()
    report(rank=pg.rank, knows_lost=knows_lost, equal=equal, shutdown_s=time.monotonic() - start)


def vanished_main() -> None:
    """Two ranks on one host; rank 1 holds two keys alone. Rank 0 reads the first from rank
    1's directory, then that part is removed, as a rank that leaves removes it, before any
    Leave notice: the second get must say the key was lost with its rank, not that it is
    missing or corrupt."""
    import dtm
    from dtm.store.mesh_store import placement

    pg = dtm.runtime.process_group.init(timeout=PG_TIMEOUT_S, op_timeout=PG_TIMEOUT_S)
    one = dtm.store.mesh(replicas=1)
    first, second = [k for k in (f"v/{i}" for i in range(100)) if placement(k, 2)[0] == 1][:2]
    if pg.rank == 1:
        one.put(first, value(1))
        one.put(second, value(2))
    pg.barrier()
    if pg.rank == 0:
        read = bool(np.array_equal(one.get_array(first), value(1)))
        shutil.rmtree(pathlib.Path(one.root) / "rank-1")
        try:
            one.get_array(second)
            outcome = {"code": None}
        except dtm.DTMError as e:
            outcome = {"code": e.code.value, "cls": type(e).__name__, "lost": getattr(e, "lost", None), "msg": str(e)}
        report(rank=0, read=read, **outcome)
    pg.barrier()
    dtm.runtime.process_group.shutdown()


def sweep_main() -> None:
    """Two ranks: what is left in $DTM_MESH_STORE once this rank has joined."""
    import dtm

    pg = dtm.runtime.process_group.init(timeout=PG_TIMEOUT_S, op_timeout=PG_TIMEOUT_S)
    base = pathlib.Path(os.environ["DTM_MESH_STORE"])
    report(rank=pg.rank, parts=sorted(str(p.relative_to(base)) for p in base.glob("dtm*_store/rank-*")),
           own=f"dtm{pg.session}_store/rank-{pg.rank}")
    pg.barrier()  # both have looked before either leaves (and removes its part)
    dtm.runtime.process_group.shutdown()


# --- the test's side ---------------------------------------------------------------------------

def _env(tmp_path, **kw) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTM_")}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{HERE.parent}", PYTHONUNBUFFERED="1", DTM_HOST="127.0.0.1",
               DTM_MESH_STORE=str(tmp_path / "parts"), **{k: str(v) for k, v in kw.items()})
    return env


def _results(text: str) -> dict[int, dict]:
    out = {}
    for line in text.splitlines():
        if "RESULT " in line:
            d = json.loads(line.split("RESULT ", 1)[1])
            out[d["rank"]] = d
    return out


def test_programs_use_the_mesh_store_and_a_get_crosses_the_wire(tmp_path):
    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", "2", "--join-timeout", str(PG_TIMEOUT_S), str(HERE),
           "program"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = _results(proc.stdout)
    assert sorted(res) == [0, 1], proc.stdout
    for r, d in res.items():
        assert d["program"] and d["current"] == "MeshStore" and d["big"], d
        assert d["keys"] == ["ranks/0", "ranks/1"], d
    assert res[1]["over_wire"] == 64 * 1024 * 33 * 4  # every byte came through the socket
    assert not any((tmp_path / "parts").iterdir())  # each rank removed its part at shutdown


def test_a_rank_killed_with_sigkill_loses_no_key_that_had_a_live_replica(tmp_path):
    from dtm.cluster import Coordinator

    coord = Coordinator(3, "mesh store").start()
    host, port = coord.address
    procs = []
    try:
        for r in range(3):
            env = _env(tmp_path, DTM_COORDINATOR=f"{host}:{port}", DTM_RANK=r, DTM_WORLD_SIZE=3,
                       DTM_TOKEN="mesh store", DTM_COORDINATOR_EXTERNAL=1)
            procs.append(subprocess.Popen([sys.executable, str(HERE), "killed"], env=env, cwd=ROOT,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        pids = {}
        for r, p in enumerate(procs):
            line = p.stdout.readline()  # bounded: init and the barrier time out after PG_TIMEOUT_S
            assert line, p.stderr.read()[-4000:]
            pids[r] = json.loads(line)["pid"]
        os.kill(pids[2], signal.SIGKILL)
        res = {}
        for r in (0, 1):
            out, err = procs[r].communicate(timeout=TIMEOUT_S)
            res.update(_results(out))
            assert r in res, out[-2000:] + err[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
        coord.stop()
    for r, d in res.items():
        assert d["knows_lost"], d
        assert d["equal"] == [True] * 24, d  # replicas=2: every key had a live copy
        for i, got in d["single"].items():
            if d["homes"][i] == 2:  # replicas=1 and its only rank was killed
                assert got["code"] == "E1106" and got["lost"] == [2] and f"one/{i}" in got["msg"], got
            else:
                assert got is True, (i, got)
    assert any(h == 2 for h in res[0]["homes"].values())  # the lost case was exercised
    assert res[1]["local_read"] == {"mapped": True, "sockets": 0, "equal": True}


def _start(tmp_path, coord, n: int, role: str, token: str) -> list[subprocess.Popen]:
    """n ranks of this file's `role` against `coord`, each with its own DTM_RANK."""
    host, port = coord.address
    return [subprocess.Popen([sys.executable, str(HERE), role], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=_env(tmp_path, DTM_COORDINATOR=f"{host}:{port}", DTM_RANK=r, DTM_WORLD_SIZE=n,
                                      DTM_TOKEN=token, DTM_COORDINATOR_EXTERNAL=1))
            for r in range(n)]


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()  # SIGKILL ends a stopped process too
        p.wait(10)


def test_a_get_from_a_stopped_rank_ends_once_the_coordinator_declares_it_lost(tmp_path):
    """Issue 37: the get waited the store's full 120 s and failed with E0802. Now rank 2's
    loss (no heartbeat for 2 s) shuts the get's socket down: KeyLost (E1106, its only home is
    lost), caused by PeerLost naming rank 2, the request and the wait."""
    from dtm.cluster import Coordinator

    coord = Coordinator(3, "stopped", heartbeat_ms=200, timeout_ms=2000).start()
    procs = _start(tmp_path, coord, 3, "stopped", "stopped")
    res = {}
    try:
        pids = {}
        for r, p in enumerate(procs):
            line = p.stdout.readline()  # bounded: init and the barrier time out after PG_TIMEOUT_S
            assert line, p.stderr.read()[-4000:]
            pids[r] = json.loads(line)["pid"]
        os.kill(pids[2], signal.SIGSTOP)  # alive, its sockets open, silent
        (tmp_path / "go").touch()
        for r in (0, 1):
            out, err = procs[r].communicate(timeout=TIMEOUT_S)
            res.update(_results(out))
            assert r in res, out[-2000:] + err[-4000:]
    finally:
        _kill_all(procs)
        coord.stop()
    for r, d in res.items():
        assert d["code"] == "E1106" and d["cause"] == "PeerLost", d
        assert "rank 2 was lost during store get 's/" in d["msg"] and "this rank waited" in d["msg"], d
        assert "no Heartbeat for" in d["msg"], d  # the coordinator's notice
        assert d["waited"] < 30, d  # detection takes about 3 s; the store's own timeout is 120 s


def test_a_part_removed_under_a_read_is_its_rank_lost_not_a_missing_key(tmp_path):
    """A CI run caught rank 2 leaving (and removing its part) while rank 0 read a replica from
    that directory: the read failed with E1105, "metadata cannot be read"; had the index
    gone first it would have said E0804, no such key. Both are wrong: the key was lost."""
    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", "2", "--join-timeout", str(PG_TIMEOUT_S), str(HERE),
           "vanished"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = _results(proc.stdout)[0]
    assert got["read"], got
    assert (got["cls"], got["code"], got["lost"]) == ("KeyLost", "E1106", [1]), got
    assert "was removed under the read" in got["msg"], got


def test_dtm_launch_removes_the_parts_of_ranks_that_were_killed(tmp_path):
    """Neither rank removes its part (one SIGKILLed, one ended by SIGTERM), and the parts are
    in $DTM_MESH_STORE, not /dev/shm: the launcher removes them, as their owners are dead."""
    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", "2", "--grace", "2", "--join-timeout",
           str(PG_TIMEOUT_S), str(HERE), "killed-parts"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "rank 1 failed first (killed by SIGKILL" in proc.stderr, proc.stderr
    assert '"parts": ["rank-0", "rank-1"]' in proc.stdout, proc.stdout  # they were there
    assert not list((tmp_path / "parts").iterdir()), list((tmp_path / "parts").rglob("*"))


@pytest.mark.parametrize("policy,declared", [(["--on-failure", "continue"], "not-elastic"), ([], "elastic"),
                                             (["--on-failure", "stop"], "elastic"), ([], "not-elastic")])
def test_dtm_launch_lets_the_survivors_finish_or_ends_them_and_removes_the_store(tmp_path, policy, declared):
    """Issue 29: when rank 1 died, `dtm launch` ended ranks 0 and 2 before they could read its
    keys from their replicas. With --on-failure continue, or by default when the job called
    dtm.init(elastic=True), they go on, get every key and finish; with stop (the default of
    a job that did not) they are ended. Either way nothing of the run is left in the root
    its ranks chose for the mesh's store, which the launcher's own environment does not name
    (the launcher removed only the parts in its own DTM_MESH_STORE before)."""
    root = tmp_path / "job-store"
    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", "3", "--grace", "2", "--join-timeout",
           str(PG_TIMEOUT_S), *policy, str(HERE), "failover", str(root), declared]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S)
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 128 + signal.SIGKILL, out  # rank 1's status
    assert '"parts": ["rank-0", "rank-1", "rank-2"]' in proc.stdout, out  # they were there
    report = next(line for line in proc.stderr.splitlines() if line.startswith("dtm launch: rank 1 failed"))
    res = _results(proc.stdout)
    if declared == "not-elastic" and not policy or "stop" in policy:
        assert report.startswith("dtm launch: rank 1 failed first (killed by SIGKILL"), report
        assert report.endswith("ended the other ranks [0, 2]"), report
    else:
        assert report.startswith("dtm launch: rank 1 failed (killed by SIGKILL; the coordinator lost rank 1"), report
        assert report.endswith("the other ranks [0, 2] went on and finished (on failure: continue)"), report
        assert sorted(res) == [0, 2], out
        for d in res.values():
            assert d["knows_lost"] and d["equal"] == [True] * 24, d  # rank 1's keys from their replicas
            assert d["shutdown_s"] < PG_TIMEOUT_S / 2, d  # it waited op_timeout for rank 1's Leave before
    assert not list(root.iterdir()), list(root.rglob("*"))
    assert not (tmp_path / "parts").exists()  # the launcher's DTM_MESH_STORE: never used


KILLED_OWNER = """
import os, signal, sys
from dtm.cluster.leftovers import claim
from dtm.store.mesh_store import open_local
open_local(sys.argv[1]).close()
claim(sys.argv[1])
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_next_init_on_a_host_removes_the_parts_that_killed_ranks_left(tmp_path):
    """A part whose rank was killed with no survivor on its host to remove it goes at the
    next dtm.init() there; a part whose owner runs (this test) stays."""
    from dtm.cluster import Coordinator
    from dtm.cluster.leftovers import claim
    from dtm.store.mesh_store import open_local

    parts = tmp_path / "parts"
    dead, live = parts / "dtm0000000000000000_store" / "rank-1", parts / "dtm1111111111111111_store" / "rank-0"
    killed = subprocess.run([sys.executable, "-c", KILLED_OWNER, str(dead)], cwd=ROOT, env=_env(tmp_path),
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert killed.returncode == -signal.SIGKILL and (dead / "owner").exists(), killed.stderr
    open_local(str(live)).close()
    claim(str(live))
    coord = Coordinator(2, "sweep").start()
    procs = _start(tmp_path, coord, 2, "sweep", "sweep")
    res = {}
    try:
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=TIMEOUT_S)
            res.update(_results(out))
            assert p.returncode == 0 and r in res, out[-2000:] + err[-4000:]
    finally:
        _kill_all(procs)
        coord.stop()
    for r, d in res.items():
        assert "dtm0000000000000000_store/rank-1" not in d["parts"], d
        assert "dtm1111111111111111_store/rank-0" in d["parts"] and d["own"] in d["parts"], d
    assert not dead.parent.exists() and live.exists()


if __name__ == "__main__":
    {"killed": killed_rank_main, "program": program_rank_main, "stopped": stopped_rank_main,
     "killed-parts": killed_parts_main, "sweep": sweep_main, "failover": failover_main,
     "vanished": vanished_main}[sys.argv[1]]()
