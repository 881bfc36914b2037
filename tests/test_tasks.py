"""Task graphs on threads (dtm.tasks, spec 9.3): chains and fan-outs checked against numpy,
compiled functions on dtm Tensors, the report, cancel, a task that raises or hangs, and
every kind of bad graph with its code. Worker processes: test_tasks_process.py."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

import dtm
import task_functions as tf
from dtm.errors import ErrorCode
from dtm.tasks import Cancelled, Graph, GraphError, TaskFailed, TaskTimeout


@pytest.fixture
def st():
    with dtm.store.open(f"memory://tasks-{uuid.uuid4().hex}") as s:
        yield s


def add(a, b):
    return a + b


def nothing():
    return None


def gelu_mix(x, w):
    """Real compiled work on Tensors: a matmul, a gelu and a reduction in one program."""
    h = dtm.gelu(x @ w)
    return h, h.sum(dim=1)


def test_chain_of_compiled_tasks_matches_numpy(st):
    st.put("x/0", np.arange(6, dtype=np.float32))
    st.put("one", np.ones(6, np.float32))
    g, prev = Graph(st), None
    for i in range(50):
        prev = g.task(add, [f"x/{i}", "one"], [f"x/{i + 1}"], after=[prev] if prev else [])
    report = g.run(workers=2).wait(timeout=60)
    np.testing.assert_array_equal(st.get_array("x/50"), np.arange(6, dtype=np.float32) + 50)
    assert report.state == "finished" and len(report.finished) == 50
    rec = report.tasks[0]
    assert rec.bytes_read == 48 and rec.bytes_written == 24 and rec.worker.startswith("thread ") and rec.seconds > 0


def test_fan_out_and_in_with_two_outputs(st):
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((8, 16), np.float32), rng.standard_normal((16, 4), np.float32)
    st.put("x", x)
    g = Graph(st)
    branches = []
    for k in range(6):
        st.put(f"w/{k}", w * (k + 1))
        branches.append(g.task(gelu_mix, ["x", f"w/{k}"], [f"h/{k}", f"s/{k}"]))
    g.task(lambda *s: sum(s[1:], s[0]), [f"s/{k}" for k in range(6)], ["total"], after=branches, jit=False)
    g.run(workers=3).wait(timeout=60)

    def gelu(v):
        return 0.5 * v * (1 + np.vectorize(__import__("math").erf)(v / np.sqrt(2)))

    want = [gelu(x @ (w * (k + 1))) for k in range(6)]
    for k in range(6):
        np.testing.assert_allclose(st.get_array(f"h/{k}"), want[k], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(st.get_array("total"), sum(h.sum(1) for h in want), rtol=1e-4, atol=1e-4)


def test_a_task_that_raises_fails_the_graph_naming_task_inputs_and_worker(st):
    st.put("a", np.ones(3, np.float32))
    g = Graph(st)
    bad = g.task(lambda a: 1 / 0, ["a"], ["b"], name="divide", jit=False)
    g.task(add, ["b", "a"], ["c"], after=[bad], name="after_it")
    run = g.run(workers=2)
    with pytest.raises(TaskFailed) as e:
        run.wait(timeout=30)
    assert e.value.code is ErrorCode.TASK_FAILED and e.value.task == "divide" and e.value.inputs == ("a",)
    assert "ZeroDivisionError" in str(e.value) and "'a'" in str(e.value) and "thread " in str(e.value)
    report = run.report()
    assert report.state == "failed" and report.failed == ["divide"] and report.never_started == ["after_it"]
    assert "b" not in st and "c" not in st


def test_a_dtm_error_in_a_task_keeps_its_code(st):
    st.put("a", np.ones((2, 3), np.float32))
    g = Graph(st)
    g.task(lambda a: a @ a, ["a"], ["b"], name="mm")
    with pytest.raises(TaskFailed) as e:
        g.run().wait(timeout=30)
    assert e.value.code is ErrorCode.SHAPE_MISMATCH and e.value.task == "mm"


def test_wrong_number_of_results_is_e0307(st):
    st.put("a", np.ones(3, np.float32))
    g = Graph(st)
    g.task(lambda a: (a, a), ["a"], ["b"], name="two")
    with pytest.raises(TaskFailed) as e:
        g.run().wait(timeout=30)
    assert e.value.code is ErrorCode.RESULT_COUNT and "b" not in st


def test_timeout_of_a_hung_thread_task(st):
    st.put("a", np.ones(3, np.float32))
    g = Graph(st)
    g.task(lambda a: time.sleep(1) or a, ["a"], ["b"], name="hang", jit=False, timeout=0.2)
    t = time.monotonic()
    with pytest.raises(TaskTimeout) as e:
        g.run().wait(timeout=30)
    assert time.monotonic() - t < 2 and e.value.code is ErrorCode.TIMEOUT and e.value.task == "hang"
    time.sleep(1.2)  # the thread returns late; its result is dropped, never written
    assert "b" not in st


def test_cancel_stops_new_tasks_and_reports_each(st):
    st.put("x/0", np.zeros(2, np.float32))
    g, prev = Graph(st), None

    def slow(a):
        time.sleep(0.1)
        return np.asarray(a) + 1

    for i in range(20):
        prev = g.task(slow, [f"x/{i}"], [f"x/{i + 1}"], after=[prev] if prev else [], name=f"t{i}", jit=False)
    run = g.run(workers=2)
    time.sleep(0.35)
    run.cancel()
    with pytest.raises(Cancelled) as e:
        run.wait(timeout=10)
    assert e.value.code is ErrorCode.TASK_CANCELLED
    r = run.report()
    assert r.state == "cancelled" and 2 <= len(r.finished) <= 5
    assert len(r.finished) + len(r.cancelled) + len(r.never_started) == 20 and len(r.cancelled) <= 1
    for name in r.finished:  # exactly the finished tasks' outputs exist, whole
        k = int(name[1:]) + 1
        np.testing.assert_array_equal(st.get_array(f"x/{k}"), np.full(2, k, np.float32))
    assert sorted(st.keys("x/")) == sorted(f"x/{i}" for i in range(len(r.finished) + 1))
    assert run.status()["state"] == "cancelled"


def test_status_and_progress_bar(st, capsys):
    st.put("a", np.ones(2, np.float32))
    g = Graph(st)
    g.task(lambda a: time.sleep(0.2) or np.asarray(a), ["a"], ["b"], jit=False)
    run = g.run(progress=True)
    assert run.status()["state"] == "running"
    run.wait(timeout=30)
    assert run.status() == {"state": "finished", "done": 1, "running": 0, "failed": 0, "cancelled": 0, "queued": 0}
    assert "1/1" in capsys.readouterr().err


# --- bad graphs -------------------------------------------------------------------------------

def test_cycle_in_after_is_e0209(st):
    g = Graph(st)
    g.task(nothing, [], [], name="a", after=["c"], jit=False)
    g.task(nothing, [], [], name="b", after=["a"], jit=False)
    g.task(nothing, [], [], name="c", after=["b"], jit=False)
    g.task(nothing, [], [], name="d", after=["c"], jit=False)
    with pytest.raises(GraphError) as e:
        g.run()
    assert e.value.code is ErrorCode.TASK_CYCLE and "depends on itself" in str(e.value)
    assert e.value.message.split("'")[1] in "abc"


def test_bad_graphs_and_their_codes(st):
    st.put("a", np.ones(2, np.float32))
    g = Graph(st)
    with pytest.raises(GraphError) as e:
        g.task(add, ["a"], ["b"], name="one_for_two")
    assert e.value.code is ErrorCode.OPERAND_COUNT and "takes 2 input(s)" in str(e.value)
    g.task(add, ["a", "a"], ["b"], name="t")
    with pytest.raises(GraphError) as e:
        g.task(add, ["a", "a"], ["c"], name="t")
    assert e.value.code is ErrorCode.DUPLICATE_SYMBOL
    g.task(add, ["b", "nowhere"], ["c"], name="reader", after=["t"])
    with pytest.raises(GraphError) as e:
        g.run()
    assert e.value.code is ErrorCode.STORE_KEY_MISSING and "'nowhere'" in str(e.value) and e.value.task == "reader"
    g2 = Graph(st)
    g2.task(add, ["a", "a"], ["c"], after=["ghost"])
    with pytest.raises(GraphError) as e:
        g2.run()
    assert e.value.code is ErrorCode.UNDEFINED_TASK
    with pytest.raises(dtm.store.InvalidKey):
        Graph(st).task(add, ["a", "../x"], ["c"])


def test_process_task_must_be_importable(st):
    with pytest.raises(GraphError) as e:
        Graph(st).task(lambda a: a, ["a"], ["b"], process=True)
    assert e.value.code is ErrorCode.TASK_NOT_IMPORTABLE and "lambda" in str(e.value)

    def inner(a):
        return a
    with pytest.raises(GraphError) as e:
        Graph(st).task(inner, ["a"], ["b"], process=True)
    assert e.value.code is ErrorCode.TASK_NOT_IMPORTABLE


def test_100000_tasks_build_and_order_without_recursion(st):
    g = Graph(st)
    t = time.perf_counter()
    prev = None
    for i in range(100_000):  # one chain: as deep as a graph gets
        prev = g.task(np.negative, [f"k/{i}"], [f"k/{i + 1}"], after=[prev] if prev else [], jit=False)
    order = g.order()
    assert order == list(range(100_000))
    assert time.perf_counter() - t < 20
    wide = Graph(st)
    root = wide.task(nothing, [], [], name="root", jit=False)
    for i in range(100_000):
        wide.task(nothing, [], [], name=f"leaf{i}", after=[root], jit=False)
    order = wide.order()
    assert order[0] == 0 and sorted(order) == list(range(100_001))


def test_empty_graph_finishes(st):
    assert Graph(st).run().wait(timeout=5).state == "finished"


# --- an IR module's task declarations, and `dtm tasks run` -------------------------------------

MODULE = """\
dtm 1.0
func @affine(%x: f32[1, 4], %w: f32[4, 3]) -> (f32[3]) {
  %m = matmul %x, %w : f32[1, 3]
  %y = reshape %m {shape = [3]} : f32[3]
  return %y
}
func @split(%y: f32[3]) -> (f32[3], f32[3]) {
  %a = exp %y : f32[3]
  %b = neg %y : f32[3]
  return %a, %b
}
task @first = @affine {inputs = ["x", "w"], outputs = ["y"]}
task @second = @split {inputs = ["y"], outputs = ["e", "n"], after = [@first]}
"""


def _inputs(st, dtype=np.float32):
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((1, 4)).astype(dtype), rng.standard_normal((4, 3)).astype(dtype)
    st.put("x", x)
    st.put("w", w)
    return x, w


def test_dtm_tasks_run_cli_matches_numpy(tmp_path):
    from click.testing import CliRunner

    from dtm.cli import main

    (tmp_path / "m.dtm").write_text(MODULE)
    with dtm.store.open(tmp_path / "s") as st:
        x, w = _inputs(st)
    out = CliRunner().invoke(main, ["tasks", "run", str(tmp_path / "m.dtm"), "--store", str(tmp_path / "s"),
                                    "--kernels", "ref"])
    assert out.exit_code == 0, out.output
    assert "2 finished" in out.output and "second" in out.output
    with dtm.store.open(tmp_path / "s") as st:
        y = (x @ w).reshape(3)
        np.testing.assert_allclose(st.get_array("e"), np.exp(y), rtol=1e-5)
        np.testing.assert_allclose(st.get_array("n"), -y, rtol=1e-6)

    (tmp_path / "cycle.dtm").write_text(MODULE.replace('outputs = ["y"]}', 'outputs = ["y"], after = [@second]}'))
    out = CliRunner().invoke(main, ["tasks", "run", str(tmp_path / "cycle.dtm"), "--store", str(tmp_path / "s")])
    assert out.exit_code == 1 and "E0209" in out.output


def test_ir_task_input_of_the_wrong_type_fails_before_anything_runs(st):
    _inputs(st, np.float64)
    with pytest.raises(GraphError) as e:
        Graph.from_module(dtm.ir.parse(MODULE), st).run()
    assert e.value.code is ErrorCode.DTYPE_MISMATCH and e.value.task == "first" and "f64" in str(e.value)
    assert st.keys() == ["w", "x"]


# A graph's store is the one every task of it reads and writes (spec 9.3), whatever starts
# it: programs' own store_get / store_put and dtm.store.current() inside a task included.
# The process's default store holds a stale `hparams/w` that no task may see.

STORE_MODULE, FRESH = tf.STORE_MODULE, tf.FRESH


@pytest.fixture
def stale_default(tmp_path, monkeypatch):
    """The process's current store as a program that used it earlier left it: the default
    directory (DTM_STORE, under tmp_path: the user's own is never touched), holding a stale
    `hparams/w`. Worker processes inherit DTM_STORE, so theirs is the same one."""
    monkeypatch.setenv("DTM_STORE", str(tmp_path / "default"))
    monkeypatch.setattr(dtm.store, "_current", None)
    default = dtm.store.current()
    default.put("hparams/w", np.full(2, -1.0, np.float32))
    yield default
    default.close()


@pytest.fixture
def graph_store(tmp_path):
    with dtm.store.open(tmp_path / "graph") as s:
        s.put("hparams/w", FRESH)
        yield s


def _used_only(graph_store, default, written=("out", "seen/w")) -> None:
    """The tasks read the graph's `hparams/w` and wrote their keys there, none in `default`."""
    np.testing.assert_array_equal(graph_store.get_array("out"), 2 * FRESH)
    assert set(written) <= set(graph_store.keys())
    assert default.keys() == ["hparams/w"]


def test_cli_tasks_run_uses_its_store_not_the_default(tmp_path, stale_default, graph_store):
    from click.testing import CliRunner

    from dtm.cli import main

    (tmp_path / "m.dtm").write_text(STORE_MODULE)
    out = CliRunner().invoke(main, ["tasks", "run", str(tmp_path / "m.dtm"), "--store", str(tmp_path / "graph"),
                                    "--kernels", "ref"])
    assert out.exit_code == 0, out.output
    _used_only(graph_store, stale_default)
    np.testing.assert_array_equal(graph_store.get_array("seen/w"), FRESH)


@pytest.mark.parametrize("kernels", ["ref", "cpu"])
def test_from_module_uses_the_graph_store_without_use(stale_default, graph_store, kernels):
    Graph.from_module(dtm.ir.parse(STORE_MODULE), graph_store, kernels).run(workers=2).wait(timeout=120)
    _used_only(graph_store, stale_default)
    assert dtm.store.current() is stale_default  # the run did not change the process's store


def test_graph_built_in_python_uses_its_store(stale_default, graph_store):
    g = Graph(graph_store)
    g.task(dtm.tasks.IRFunction(dtm.ir.parse(STORE_MODULE), "load"), [], ["out"])
    g.task(lambda: np.asarray(dtm.store.current().get_array("hparams/w")) * 3.0, [], ["thrice"], jit=False)
    g.run(workers=2).wait(timeout=120)
    _used_only(graph_store, stale_default, ("out", "seen/w", "thrice"))
    np.testing.assert_array_equal(graph_store.get_array("thrice"), 3 * FRESH)


def test_process_task_uses_the_graph_store(stale_default, graph_store):
    g = Graph(graph_store)
    g.task(tf.doubled_from_current_store, [], ["out"], process=True)
    g.run(workers=1).wait(timeout=120)
    _used_only(graph_store, stale_default, ("out",))
