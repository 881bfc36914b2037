"""The Ray backend of task graphs (dtm.tasks, backend="ray", spec 9.3): Ray runs in a
loopback-only network namespace (`unshare -n`), in a subprocess running
tests/ray_tasks_script.py, which runs a chain and fan-out of compiled and plain tasks (and
an IR module's tasks) with backend="ray" and backend="local" into two directory stores;
this test compares every key bit for bit and with numpy, and judges a raising task (not
retried, naming task, inputs and worker), a worker that dies once (Ray retries it), a
timeout and a cancel. The checks made before Ray starts run in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

import dtm
import task_functions as tf
from dtm.errors import ErrorCode
from dtm.tasks import Graph, GraphError
from hosts import LOOPBACK_ONLY, loopback_only_missing

HERE = Path(__file__).resolve().parent
pytest.importorskip("ray", reason="the Ray backend needs ray: pip install 'dtm[ray]'")


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory):
    """Run the script once (about 15 s); every test below reads what it left."""
    why = loopback_only_missing()
    if why:
        pytest.skip(f"Ray runs only in a loopback-only namespace: {why}")
    out = tmp_path_factory.mktemp("ray")
    root = str(HERE.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, str(HERE), os.environ.get("PYTHONPATH", "")]),
               DTM_TEST_MARKER=str(out / "died"), RAY_USAGE_STATS_ENABLED="0")
    cmd = [*LOOPBACK_ONLY, sys.executable,
           str(HERE / "ray_tasks_script.py"), str(out)]
    try:
        r = subprocess.run(cmd, env=env, cwd=str(out), capture_output=True, timeout=150)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the Ray script ran past 150 s; stderr:\n{(e.stderr or b'').decode()[-4000:]}")
    assert r.returncode == 0, r.stderr.decode()[-4000:]
    return out, json.loads((out / "result.json").read_text())


def _expected(st) -> dict[str, np.ndarray]:
    x, w, raw = st.get_array("x"), st.get_array("w"), st.get_array("raw")
    h = x @ w
    s3 = h.sum(axis=1) * 2 + 1
    lo, hi = raw[:5], raw[5:]
    y = x @ w
    out = {"h": h * h + 1, "s": h.sum(axis=1), "s2": h.sum(axis=1) * 2, "s3": s3, "lo": lo, "hi": hi,
           "a": lo * 2, "b": hi + 1, "prod": (lo * 2) * (hi + 1), "ir/y": y, "ir/e": np.exp(y), "ir/n": -y}
    out.update({f"f/{k}": h * h + 2 for k in range(3)})
    return out


def test_ray_backend_matches_local_backend_bit_for_bit_and_numpy(ray_run):
    out, result = ray_run
    assert result["ray"]["state"] == result["local"]["state"] == "finished"
    with dtm.store.open(out / "ray") as ray_st, dtm.store.open(out / "local") as local_st:
        keys = ray_st.keys()
        assert keys == local_st.keys() and len(keys) == 18
        for k in keys:
            a, b = ray_st.get_array(k), local_st.get_array(k)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), k
        for k, want in _expected(ray_st).items():
            np.testing.assert_allclose(ray_st.get_array(k), want, rtol=1e-5, atol=1e-5, err_msg=k)
        assert ray_st.verify().ok


def test_ray_tasks_use_the_graph_store_not_the_default(ray_run):
    out, _ = ray_run
    with dtm.store.open(out / "scoped") as st, dtm.store.open(out / "default") as default:
        np.testing.assert_array_equal(st.get_array("out"), 2 * tf.FRESH)
        np.testing.assert_array_equal(st.get_array("seen/w"), tf.FRESH)
        assert default.keys() == ["hparams/w"]


def test_ray_report_has_the_local_shape(ray_run):
    _, result = ray_run
    ray_tasks, local_tasks = result["ray"]["tasks"], result["local"]["tasks"]
    assert [t["name"] for t in ray_tasks] == [t["name"] for t in local_tasks]
    assert set(ray_tasks[0]) == set(local_tasks[0])
    for r, loc in zip(ray_tasks, local_tasks):
        assert r["worker"].startswith("ray node ") and " worker " in r["worker"] and "pid" in r["worker"]
        assert (r["bytes_read"], r["bytes_written"], r["attempts"]) == (loc["bytes_read"], loc["bytes_written"], 1)
        assert r["seconds"] > 0
    assert ray_tasks[0]["bytes_read"] == 8 * 16 * 4 + 16 * 4 * 4 and ray_tasks[0]["bytes_written"] == 8 * 4 * 4 + 8 * 4


def test_ray_raising_task_is_not_retried_and_names_task_inputs_worker(ray_run):
    _, result = ray_run
    e = result["raise"]
    assert e is not None and e["type"] == "TaskFailed" and e["code"] == "E1201" and e["task"] == "tokenize"
    assert "'raw'" in e["message"] and "ray node" in e["message"] and "ValueError: bad token in the input" in e["message"]
    tasks = {t["name"]: t for t in e["report"]["tasks"]}
    assert tasks["tokenize"]["attempts"] == 1 and tasks["tokenize"]["state"] == "failed"
    assert tasks["dependent"]["state"] == "never started"


def test_ray_retries_a_task_whose_worker_died(ray_run):
    out, result = ray_run
    t = result["retry"]["tasks"][0]
    assert result["retry"]["state"] == "finished" and t["attempts"] == 2
    with dtm.store.open(out / "faults") as st:
        np.testing.assert_array_equal(st.get_array("revived"), np.full(3, 2, np.float32))


def test_ray_timeout_and_cancel(ray_run):
    out, result = ray_run
    e = result["timeout"]
    assert e["type"] == "TaskTimeout" and e["code"] == "E0802" and "stuck" in e["message"] and e["seconds"] < 30
    c = result["cancel"]
    assert c["code"] == "E1203" and c["verify"]
    # t2 sleeps in a system call, which Ray's cancel (an interrupt at the next bytecode) does
    # not wake: the grace of 5 s ends in ray.cancel(force=True), which kills its worker
    assert c["seconds"] < 12
    states = {t["name"]: t["state"] for t in c["report"]["tasks"]}
    assert states == {"t0": "finished", "t1": "finished", "t2": "cancelled", "t3": "never started",
                      "t4": "never started", "t5": "never started"}
    assert c["keys"] == ["c/0", "c/1", "c/2"]
    with dtm.store.open(out / "faults") as st:
        assert "hung" not in st


# --- checks made before Ray starts (this process; Ray is not initialized) -------------------

def test_ray_backend_refuses_a_memory_store():
    with dtm.store.open(f"memory://ray-{uuid.uuid4().hex}") as st:
        st.put("raw", np.ones(3, np.float32))
        g = Graph(st)
        g.task(tf.scale, ["raw"], ["out"])
        with pytest.raises(GraphError) as e:
            g.run(backend="ray")
        assert e.value.code is ErrorCode.ATTRIBUTE_VALUE and "memory://" in str(e.value)


def test_ray_backend_needs_functions_reachable_by_name(tmp_path):
    with dtm.store.open(tmp_path / "s") as st:
        st.put("raw", np.ones(3, np.float32))
        g = Graph(st)
        g.task(lambda a: a + 1, ["raw"], ["out"])
        with pytest.raises(GraphError) as e:
            g.run(backend="ray")
        assert e.value.code is ErrorCode.TASK_NOT_IMPORTABLE and "lambda" in str(e.value)


def test_ray_backend_without_ray_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with dtm.store.open(tmp_path / "s") as st:
        st.put("raw", np.ones(3, np.float32))
        g = Graph(st)
        g.task(tf.scale, ["raw"], ["out"])
        with pytest.raises(GraphError) as e:
            g.run(backend="ray")
        assert e.value.code is ErrorCode.UNKNOWN_BACKEND and "dtm[ray]" in str(e.value)
    with pytest.raises(GraphError) as e:
        Graph(dtm.store.open(tmp_path / "s")).run(backend="dask")
    assert e.value.code is ErrorCode.UNKNOWN_BACKEND and "local, ray" in str(e.value)
