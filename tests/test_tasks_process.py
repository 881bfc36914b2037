"""Task graphs on worker processes (dtm.tasks, process=True): functions imported by name,
results through a directory store; a task that raises is not retried, a SIGKILLed worker's
task is (on a fresh worker) until `retries` runs out, a hung worker is killed at the task's
timeout, and a cancel interrupts the running task without half-written keys."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import dtm
import task_functions as tf
from dtm.errors import ErrorCode
from dtm.tasks import Cancelled, Graph, TaskFailed, TaskTimeout, WorkerLost


@pytest.fixture
def st(tmp_path):
    with dtm.store.open(tmp_path / "store") as s:
        yield s


def test_process_and_thread_tasks_in_one_graph(st):
    x = np.arange(10, dtype=np.float32)
    st.put("raw", x)
    g = Graph(st)
    first = g.task(tf.scale, ["raw"], ["scaled"], process=True)
    halves = g.task(tf.split, ["scaled"], ["lo", "hi"], process=True, after=[first])
    g.task(lambda a, b: a * b, ["lo", "hi"], ["prod"], after=[halves])
    report = g.run(workers=2).wait(timeout=120)
    np.testing.assert_array_equal(st.get_array("prod"), (2 * x[:5]) * (2 * x[5:]))
    assert report.tasks[0].worker.startswith("process ") and "pid" in report.tasks[0].worker
    assert report.tasks[1].bytes_read == 40 and report.tasks[1].bytes_written == 40


def test_raising_task_is_not_retried_and_names_task_inputs_worker(st):
    st.put("raw", np.ones(3, np.float32))
    g = Graph(st)
    g.task(tf.boom, ["raw"], ["out"], process=True, name="tokenize")
    run = g.run(workers=1)
    with pytest.raises(TaskFailed) as e:
        run.wait(timeout=120)
    msg = str(e.value)
    assert e.value.code is ErrorCode.TASK_FAILED and "tokenize" in msg and "'raw'" in msg and "pid" in msg
    assert "ValueError: bad token in the input" in msg and run.report().tasks[0].attempts == 1


def test_sigkilled_worker_is_retried_on_a_fresh_one(st, tmp_path, monkeypatch):
    monkeypatch.setenv("DTM_TEST_MARKER", str(tmp_path / "died"))
    st.put("raw", np.ones(3, np.float32))
    g = Graph(st)
    g.task(tf.die_once, ["raw"], ["out"], process=True)
    report = g.run(workers=1).wait(timeout=120)
    np.testing.assert_array_equal(st.get_array("out"), np.full(3, 2, np.float32))
    assert report.tasks[0].attempts == 2 and report.tasks[0].worker.startswith("process 0.2 ")


def test_worker_that_always_dies_fails_after_its_retries(st):
    st.put("raw", np.ones(3, np.float32))
    g = Graph(st)
    g.task(tf.die, ["raw"], ["out"], process=True, retries=1, name="doomed")
    with pytest.raises(WorkerLost) as e:
        g.run(workers=1).wait(timeout=120)
    assert e.value.code is ErrorCode.WORKER_LOST and "SIGKILL" in str(e.value) and "2 attempt" in str(e.value)
    assert "out" not in st


def test_hung_worker_is_killed_at_the_timeout(st):
    st.put("raw", np.ones(3, np.float32))
    g = Graph(st)
    g.task(tf.hang, ["raw"], ["out"], process=True, timeout=2.0, name="stuck")
    t = time.monotonic()
    with pytest.raises(TaskTimeout) as e:
        g.run(workers=1).wait(timeout=120)
    assert e.value.code is ErrorCode.TIMEOUT and e.value.task == "stuck" and time.monotonic() - t < 30


def test_cancel_interrupts_the_running_process_task(st):
    st.put("x/0", np.zeros(4, np.float32))
    g, prev = Graph(st), None
    for i in range(10):
        prev = g.task(tf.slow, [f"x/{i}"], [f"x/{i + 1}"], process=True, after=[prev] if prev else [], name=f"t{i}")
    run = g.run(workers=1)
    deadline = time.monotonic() + 60
    while run.status()["done"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)  # inside the third task's sleep
    run.cancel()
    with pytest.raises(Cancelled):
        run.wait(timeout=30)
    r = run.report()
    assert r.cancelled == ["t2"] and r.finished == ["t0", "t1"] and r.never_started == [f"t{i}" for i in range(3, 10)]
    assert sorted(st.keys("x/")) == ["x/0", "x/1", "x/2"]
    assert st.verify().ok


CTRL_C_SCRIPT = r'''
import json, signal, sys
# Ctrl-C raises KeyboardInterrupt, as in a terminal, even where this test runs under a shell
# that started it in the background (which ignores SIGINT, and Python then keeps ignoring it)
signal.signal(signal.SIGINT, signal.default_int_handler)
import numpy as np
import dtm
import task_functions as tf
from dtm.tasks import Graph

st = dtm.store.open(sys.argv[1])
st.put("k0", np.zeros(4, np.float32))
g = Graph(st)
prev = None
for i in range(6):  # a chain of slow process tasks: Ctrl-C lands while one of them runs
    prev = g.task(tf.slow, [f"k{i}"], [f"k{i + 1}"], process=True, after=[prev] if prev else [])
run = g.run(workers=1)
print("running", flush=True)
try:
    run.wait(timeout=60)
    print(json.dumps({"interrupted": False}))
except KeyboardInterrupt:
    r = run.report()
    print(json.dumps({"interrupted": True, "state": r.state,
                      "states": [t.state for t in r.tasks], "keys": st.keys()}))
'''


def test_ctrl_c_while_waiting_cancels_the_run_and_leaves_no_half_written_key(tmp_path):
    import json
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path / "store")], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "running", p.stderr.read()
        deadline = time.monotonic() + 30
        with dtm.store.open(tmp_path / "store") as st:  # the first task finished: the chain is under way
            while "k1" not in st and time.monotonic() < deadline:
                time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    d = json.loads(out.strip().splitlines()[-1])
    assert d["interrupted"] and d["state"] == "cancelled", (d, err[-2000:])
    done = [s == "finished" for s in d["states"]]
    assert done == sorted(done, reverse=True) and done[0] and not all(done), d  # a prefix of the chain finished
    assert "never started" in d["states"] or "cancelled" in d["states"], d
    # exactly the finished tasks' outputs are in the store: none half-written, none from a cancelled task
    assert d["keys"] == sorted(["k0"] + [f"k{i + 1}" for i, ok in enumerate(done) if ok]), d


def test_a_later_run_over_the_same_store_reuses_its_workers(st, tmp_path):
    """Workers outlive a run (a fresh one imports dtm), but only for the same Store object."""
    st.put("raw", np.ones(3, np.float32))

    def worker_of(store) -> str:
        g = Graph(store)
        g.task(tf.scale, ["raw"], ["scaled"], process=True)
        return g.run(workers=1).wait(timeout=120).tasks[0].worker

    first = worker_of(st)
    assert worker_of(st) == first
    with dtm.store.open(tmp_path / "other") as other:
        other.put("raw", np.ones(3, np.float32))
        assert worker_of(other) != first


def test_workers_are_forks_of_the_fork_server_with_the_parents_environment(st, monkeypatch):
    """Workers start in milliseconds: forked from the fork server (dtm/store/forkserver.py),
    which has dtm imported, not fresh interpreters of this process; yet they see this
    process's environment as it is now (set after the server started)."""
    from dtm.store import forkserver

    monkeypatch.setenv("DTM_TEST_MARKER", "set after the server was forked")
    st.put("raw", np.ones(1, np.float32))
    g = Graph(st)
    g.task(tf.parent_pid, ["raw"], ["ppid"], process=True)
    g.task(tf.environment_marker, ["raw"], ["marker"], process=True)
    g.run(workers=1).wait(timeout=120)
    assert int(st.get_array("ppid")[0]) == forkserver.server().pid != os.getpid()
    assert bytes(st.get_array("marker")).decode() == "set after the server was forked"
