"""Cancelling a whole job (spec 9.4.10), with real processes under `dtm launch`:
`dtm.cancel(reason)` on one rank and `dtm cancel` from the shell end every rank's blocked
collective, P2P receive, mesh-store get and checkpoint save with Cancelled (E1007) naming
who cancelled and why; later calls raise it at once; a cancelled save leaves no step
directory and the previous checkpoint loads with its values (numpy, the reference).

No wait here is ended by a timeout: each rank's operation timeout is far longer than the
test's, so an operation that the cancel did not end fails the test by its time limit."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import task_functions as tf
from dtm.cluster.membership import Membership
from test_cluster_coordinator import TOKEN, _join_all, _leave_all, coordinator  # noqa: F401 - the fixture

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parent.parent
TIMEOUT_S = 120    # a whole launch, processes sharing 2 busy cores
PG_TIMEOUT_S = 60  # joining the mesh
OP_TIMEOUT_S = 600  # a collective's own limit: longer than the test's, so only the cancel ends one
MARK_S = 60        # waiting for a rank's marker file


# --- the ranks ------------------------------------------------------------------------------------

def _init():
    import dtm

    return dtm.runtime.process_group.init(timeout=PG_TIMEOUT_S, op_timeout=OP_TIMEOUT_S)


def _mark(out: pathlib.Path, name: str) -> None:
    (out / name).write_text("")


def _wait_for(paths, what: str) -> None:
    deadline = time.monotonic() + MARK_S
    while not all(pathlib.Path(p).exists() for p in paths):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: {[str(p) for p in paths if not pathlib.Path(p).exists()]} never came")
        time.sleep(0.05)


def _caught(out: pathlib.Path, rank: int, fn, **extra) -> Exception:
    """Run `fn`, which must raise Cancelled; record what it said in rank-R.json."""
    import dtm

    start = time.monotonic()
    try:
        fn()
    except dtm.Cancelled as e:
        took, at = time.monotonic() - start, time.time()
        later = time.monotonic()
        try:
            dtm.runtime.process_group.current().barrier()
            again = None
        except dtm.Cancelled as e2:
            again = {"code": e2.code.value, "by": e2.by, "took_s": time.monotonic() - later}
        doc = {"code": e.code.value, "by": e.by, "reason": e.reason, "message": str(e), "took_s": took,
               "at": at, "again": again, **extra}
        (out / f"rank-{rank}.json").write_text(json.dumps(doc))
        return e
    raise AssertionError(f"rank {rank}: {fn} returned instead of raising Cancelled")


def rank_collective(out: pathlib.Path) -> None:
    """Three ranks in a loop of all_reduce; rank 1 stops joining and cancels once the others
    are about to block in the next one. Rank 0 lets the Cancelled go uncaught (exit 1)."""
    import dtm

    pg = _init()
    x = np.arange(6, dtype=np.float32) * (pg.rank + 1)
    want = np.arange(6, dtype=np.float32) * 6  # 1 + 2 + 3
    for _ in range(3):
        np.testing.assert_array_equal(pg.all_reduce(x), want)
    if pg.rank == 1:
        _wait_for([out / "blocked-0", out / "blocked-2"], "rank 1 waiting for the others to block")
        (out / "cancel-at").write_text(repr(time.time()))
        dtm.cancel("why")
        _caught(out, 1, lambda: pg.all_reduce(x))
        return

    def loop():
        _mark(out, f"blocked-{pg.rank}")
        while True:
            np.testing.assert_array_equal(pg.all_reduce(x), want)

    e = _caught(out, pg.rank, loop)
    if pg.rank == 0:
        raise e


def rank_shell(out: pathlib.Path) -> None:
    """Rank 0 blocks in a receive from rank 1, rank 1 in an all_reduce that needs rank 0,
    until `dtm cancel` from the shell ends both."""
    pg = _init()
    if pg.rank == 0:
        _mark(out, "blocked-0")
        _caught(out, 0, lambda: pg.recv(1))
    else:
        _mark(out, "blocked-1")
        _caught(out, 1, lambda: pg.all_reduce(np.ones(3, np.float32)))


W1 = np.arange(8 * 4, dtype=np.float32).reshape(8, 4) / 4
B1 = np.linspace(-1, 1, 5).astype(np.float32)
SLOW_TENSORS, SLOW_CHUNK_S = 24, 0.5  # the second save: ~12 s of chunk writes per rank unless cancelled


def rank_save(out: pathlib.Path) -> None:
    """Save step 1, then a slow step 2 (each chunk write sleeps first) that `dtm cancel`
    ends while it is being written."""
    import dtm
    from dtm.store.store import Store

    pg = _init()
    mesh = dtm.Mesh({"dp": 2})
    root = out / "ckpt"
    state = {"w": dtm.distribute(W1, mesh, [dtm.Shard(0)]), "b": dtm.distribute(B1, mesh, [dtm.Replicate()]),
             "step": 1}
    dtm.checkpoint.save(state, root, step=1).wait()
    original = Store._write_chunk

    def slow(self, *args, **kw):
        _mark(out, f"saving-{pg.rank}")
        time.sleep(SLOW_CHUNK_S)
        return original(self, *args, **kw)

    Store._write_chunk = slow
    big = {f"t{i}": dtm.distribute(np.full((4, 3), i, np.float32), mesh, [dtm.Shard(0)]) for i in range(SLOW_TENSORS)}
    h = dtm.checkpoint.save({**big, "step": 2}, root, step=2)
    _caught(out, pg.rank, lambda: h.wait(OP_TIMEOUT_S))
    try:  # a later save: refused at once, leaving nothing
        dtm.checkpoint.save(state, root, step=3)
        again = "returned"
    except dtm.Cancelled as e:
        again = e.code.value
    (out / f"save-again-{pg.rank}").write_text(again)


def rank_store(out: pathlib.Path) -> None:
    """Rank 0's mesh-store get of a key that only rank 1 holds blocks, because rank 1's
    service does not answer; rank 1 cancels the job once rank 0 is waiting."""
    import dtm
    from dtm.store.mesh_store import placement
    from dtm.store.service import StoreServer

    pg = _init()
    st = dtm.store.mesh(replicas=1, share_memory=False)
    key = next(f"k{i}" for i in range(100) if placement(f"k{i}", 2)[0] == 1)
    release = threading.Event()
    if pg.rank == 1:
        st.put(key, np.arange(5, dtype=np.float32))
        original = StoreServer._get

        def stalled(self, req):
            _mark(out, "stalled")
            release.wait(TIMEOUT_S)
            return original(self, req)

        StoreServer._get = stalled
    pg.barrier()
    if pg.rank == 0:
        _caught(out, 0, lambda: st.get_array(key))
    else:
        _wait_for([out / "stalled"], "rank 1 waiting for rank 0's get to reach its service")
        dtm.cancel("stop the get")
        _caught(out, 1, lambda: st.get_array(key), store_again=_store_again(st, key))
        try:  # the stalled get is answered only once rank 0 has seen it end with Cancelled
            _wait_for([out / "rank-0.json"], "rank 1 waiting for rank 0's get to end")
        finally:
            release.set()


def _store_again(st, key) -> str:
    """What a later store call raises on the rank that cancelled: at once, Cancelled."""
    import dtm

    try:
        st.put(key + "-late", np.zeros(2, np.float32))
    except dtm.Cancelled as e:
        return e.code.value
    return "returned"


# --- the tests ------------------------------------------------------------------------------------

def _env(tmp_path: pathlib.Path) -> dict:
    run = tmp_path / "xdg"
    run.mkdir(mode=0o700, exist_ok=True)
    # XDG_RUNTIME_DIR: this test's job file alone, for `dtm cancel` to find
    return dict(os.environ, PYTHONPATH=str(ROOT), DTM_HOST="127.0.0.1", XDG_RUNTIME_DIR=str(run))


def _launch(tmp_path: pathlib.Path, n: int, mode: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", str(n), "--join-timeout", str(PG_TIMEOUT_S),
           str(HERE), mode, str(tmp_path)]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError("the job did not end: the cancel did not end its operations\n" + out[-3000:] +
                             err[-3000:]) from None
    return proc.returncode, out + err


def _shell_cancel(tmp_path: pathlib.Path, reason: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "dtm.cli", "cancel", "--reason", reason], cwd=ROOT,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _ranks(tmp_path: pathlib.Path, n: int, log: str) -> list[dict]:
    docs = []
    for r in range(n):
        p = tmp_path / f"rank-{r}.json"
        assert p.exists(), f"rank {r} recorded no Cancelled\n{log[-4000:]}"
        docs.append(json.loads(p.read_text()))
    return docs


def test_a_rank_cancels_every_ranks_blocked_all_reduce(tmp_path):
    code, log = _finish(_launch(tmp_path, 3, "collective"))
    docs = _ranks(tmp_path, 3, log)
    for r, d in enumerate(docs):
        assert d["code"] == "E1007" and d["by"] == 1 and d["reason"] == "why", (r, d)
        assert "cancelled by rank 1: why" in d["message"] and "all_reduce" in d["message"], (r, d)
        assert d["again"] is not None and d["again"]["code"] == "E1007", (r, d)  # a later call: Cancelled too
    cancel_at = float((tmp_path / "cancel-at").read_text())
    print("from dtm.cancel on rank 1 to Cancelled on ranks 0, 1, 2 (ms):",
          [round((d["at"] - cancel_at) * 1000, 1) for d in docs])
    # rank 0 did not catch it: its process failed, and the launcher says the job was cancelled
    assert code != 0, log[-3000:]
    assert "dtm launch: the job was cancelled by rank 1: why" in log, log[-3000:]
    assert "E1007" in log


def test_dtm_cancel_from_the_shell_ends_a_receive_and_a_collective(tmp_path):
    proc = _launch(tmp_path, 2, "shell")
    try:
        _wait_for([tmp_path / "blocked-0", tmp_path / "blocked-1"], "the ranks blocking")
        said = _shell_cancel(tmp_path, "from the shell")
    finally:
        code, log = _finish(proc)
    assert "cancelled by the command line: from the shell" in said and "2 of 2 ranks heard it" in said, said
    docs = _ranks(tmp_path, 2, log)
    for r, d in enumerate(docs):
        assert d["code"] == "E1007" and d["by"] == -1 and d["reason"] == "from the shell", (r, d)
        assert "the command line" in d["message"], d
    assert "recv" in docs[0]["message"] and "all_reduce" in docs[1]["message"], docs
    assert code == 0, log[-3000:]  # both ranks caught it
    assert "dtm launch: the job was cancelled by the command line: from the shell" in log, log[-3000:]


def test_dtm_cancel_during_a_checkpoint_save_keeps_the_previous_one(tmp_path):
    import dtm

    proc = _launch(tmp_path, 2, "save")
    try:
        _wait_for([tmp_path / "saving-0", tmp_path / "saving-1"], "the slow save starting")
        _shell_cancel(tmp_path, "no more saves")
    finally:
        code, log = _finish(proc)
    docs = _ranks(tmp_path, 2, log)
    for r, d in enumerate(docs):
        assert d["code"] == "E1007" and d["by"] == -1 and d["reason"] == "no more saves", (r, d)
        assert "checkpoint step 2" in d["message"], d
    assert code == 0, log[-3000:]
    assert [(tmp_path / f"save-again-{r}").read_text() for r in range(2)] == ["E1007", "E1007"]
    root = tmp_path / "ckpt"
    assert [c.step for c in dtm.checkpoint.list(root)] == [1]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-000000000001"]
    state = {"w": dtm.zeros(8, 4), "b": dtm.zeros(5), "step": None}
    dtm.checkpoint.load(state, root)
    np.testing.assert_array_equal(state["w"].numpy(), W1)
    np.testing.assert_array_equal(state["b"].numpy(), B1)
    assert state["step"] == 1
    assert dtm.checkpoint.verify(root).ok


def test_cancel_ends_a_blocked_mesh_store_get(tmp_path):
    code, log = _finish(_launch(tmp_path, 2, "store"))
    docs = _ranks(tmp_path, 2, log)
    for r, d in enumerate(docs):
        assert d["code"] == "E1007" and d["by"] == 1 and d["reason"] == "stop the get", (r, d)
        assert "store get" in d["message"], d
    assert docs[1]["store_again"] == "E1007"
    assert code == 0, log[-3000:]


def test_the_coordinator_relays_a_command_line_cancel_once_and_to_late_members(coordinator):
    """In one process: `dtm cancel`'s request before the mesh forms is remembered and heard
    by each member right after its view; a second is acknowledged and not relayed; a wrong
    token is refused (E0909) and cancels nothing."""
    from dtm.cluster.membership import cancel_job
    from dtm.errors import DTMError

    coord = coordinator(2)
    with pytest.raises(DTMError) as e:
        cancel_job(coord.address, b"not the token", "no", timeout=10)
    assert e.value.code.value == "E0909" and coord.cancelled is None
    said = cancel_job(coord.address, TOKEN, "before the mesh", timeout=10)
    assert "cancelled by the command line: before the mesh" in said and "has not formed" in said, said
    assert coord.cancelled == (-1, "before the mesh")
    members = _join_all(coord.address, 2)
    try:
        assert all(isinstance(m, Membership) for m in members), members
        for m in members:
            m.start()
        deadline = time.monotonic() + MARK_S
        while any(m.cancelled is None for m in members) and time.monotonic() < deadline:
            time.sleep(0.01)
        for m in members:
            assert m.cancelled is not None and m.cancelled.by == -1 and m.cancelled.reason == "before the mesh"
        said = cancel_job(coord.address, TOKEN, "again", timeout=10)  # the first cancel counts
        assert "before the mesh" in said and "2 of 2 ranks heard it" in said, said
        assert coord.cancelled == (-1, "before the mesh")
    finally:
        _leave_all(members)


def test_cancel_in_one_process_ends_a_task_graph_and_a_save(tmp_path, monkeypatch):
    """A group of one process: dtm.cancel ends a running task graph (E1203, naming the
    job's cancel) and a checkpoint save, and every later collective raises Cancelled."""
    import dtm
    from dtm.tasks import Graph

    for name in ("DTM_COORDINATOR", "DTM_WORLD_SIZE", "DTM_RANK"):
        monkeypatch.delenv(name, raising=False)
    pg = dtm.init()
    try:
        root = tmp_path / "ckpt"
        dtm.checkpoint.save({"w": dtm.tensor(W1), "step": 1}, root, step=1).wait()
        st = dtm.store.open(tmp_path / "store")
        st.put("x/0", np.zeros(2, np.float32))
        g = Graph(st)
        for i in range(50):  # a chain: t{i} writes x/{i+1} = x/{i} + 1
            g.task(tf.slow, [f"x/{i}"], [f"x/{i + 1}"], after=[f"t{i - 1}"] if i else [], name=f"t{i}", jit=False)
        run = g.run(workers=1)
        dtm.cancel("enough")
        with pytest.raises(dtm.tasks.Cancelled) as e:
            run.wait(timeout=OP_TIMEOUT_S)
        assert e.value.code.value == "E1203" and "cancelled by rank 0: enough" in str(e.value)
        assert isinstance(e.value.__cause__, dtm.Cancelled)
        r = run.report()
        assert r.state == "cancelled" and len(r.finished) < 50
        for name in r.finished:  # each finished task's output is whole; no other task's exists
            k = int(name[1:]) + 1
            np.testing.assert_array_equal(st.get_array(f"x/{k}"), np.full(2, k, np.float32))
        assert sorted(st.keys("x/")) == sorted(f"x/{i}" for i in range(len(r.finished) + 1))
        with pytest.raises(dtm.Cancelled) as e:
            pg.all_reduce(np.ones(2, np.float32))
        assert e.value.code.value == "E1007" and e.value.by == 0 and "all_reduce" in str(e.value)
        h = dtm.checkpoint.save({"w": dtm.tensor(W1 + 1), "step": 2}, root, step=2)
        with pytest.raises(dtm.Cancelled) as e:
            h.wait(OP_TIMEOUT_S)
        assert "checkpoint step 2" in str(e.value)
        assert [c.step for c in dtm.checkpoint.list(root)] == [1]
        assert not (root / "step-000000000002").exists()
        state = {"w": dtm.zeros(8, 4), "step": None}
        dtm.checkpoint.load(state, root)
        np.testing.assert_array_equal(state["w"].numpy(), W1)
    finally:
        dtm.shutdown()


if __name__ == "__main__":
    globals()[f"rank_{sys.argv[1]}"](pathlib.Path(sys.argv[2]))
