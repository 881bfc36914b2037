"""Run by tests/test_tasks_ray.py inside a loopback-only network namespace:
`python ray_tasks_script.py DIR`. Starts a local Ray (2 CPUs), runs the same graphs with
backend="ray" into DIR/ray and with backend="local" into DIR/local, then a raising task, a
worker that dies once, a timeout and a cancel on Ray, and writes what it saw to
DIR/result.json for the test to judge (it also reads both stores itself)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import task_functions as tf  # noqa: E402

import dtm  # noqa: E402
from dtm.tasks import Cancelled, Graph, TaskError  # noqa: E402

MODULE = """\
dtm 1.0
func @affine(%x: f32[8, 16], %w: f32[16, 4]) -> (f32[8, 4]) {
  %m = matmul %x, %w : f32[8, 4]
  return %m
}
func @split(%y: f32[8, 4]) -> (f32[8, 4], f32[8, 4]) {
  %a = exp %y : f32[8, 4]
  %b = neg %y : f32[8, 4]
  return %a, %b
}
task @first = @affine {inputs = ["x", "w"], outputs = ["ir/y"]}
task @second = @split {inputs = ["ir/y"], outputs = ["ir/e", "ir/n"], after = [@first]}
"""


def inputs(st) -> None:
    rng = np.random.default_rng(7)
    st.put("x", rng.standard_normal((8, 16)).astype(np.float32))
    st.put("w", rng.standard_normal((16, 4)).astype(np.float32))
    st.put("raw", np.arange(10, dtype=np.float32))


def build(st) -> Graph:
    """A chain and a fan-out of compiled (jitted) and plain (numpy) tasks."""
    g = Graph(st)
    root = g.task(tf.mix, ["x", "w"], ["h", "s"], name="mix")  # compiled
    s2 = g.task(tf.scale, ["s"], ["s2"], after=[root], jit=False, name="scale")  # plain
    g.task(tf.plus_one, ["s2"], ["s3"], after=[s2], name="plus")  # compiled
    halves = g.task(tf.split, ["raw"], ["lo", "hi"], jit=False, name="split")  # plain, two outputs
    fan = [g.task(tf.plus_one, ["h"], [f"f/{k}"], after=[root], name=f"fan{k}") for k in range(3)]
    a = g.task(tf.scale, ["lo"], ["a"], after=[halves], jit=False, name="a")
    b = g.task(tf.plus_one, ["hi"], ["b"], after=[halves], name="b")
    g.task(tf.mul, ["a", "b"], ["prod"], after=[a, b, *fan], name="prod")  # fan-in
    return g


def record(report) -> dict:
    return {"state": report.state, "tasks": [t.__dict__ for t in report.tasks]}


def main() -> None:
    out = Path(sys.argv[1])
    import ray

    # a default store with a stale `hparams/w`, inherited by Ray's workers: tasks must not see it
    os.environ["DTM_STORE"] = str(out / "default")
    with dtm.store.open() as default:
        default.put("hparams/w", -tf.FRESH)
    t0 = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    result: dict = {"init_s": time.monotonic() - t0}
    for backend in ("ray", "local"):
        with dtm.store.open(out / backend) as st:
            inputs(st)
            result[backend] = record(build(st).run(workers=2, backend=backend).wait(timeout=120))
            Graph.from_module(dtm.ir.parse(MODULE), st, backend="ref").run(backend=backend).wait(timeout=120)
    with dtm.store.open(out / "scoped") as st:  # a program's own store_get / store_put reach the graph's store
        st.put("hparams/w", tf.FRESH)
        Graph.from_module(dtm.ir.parse(tf.STORE_MODULE), st, backend="ref").run(backend="ray").wait(timeout=120)
    result["graphs_s"] = time.monotonic() - t0

    with dtm.store.open(out / "faults") as st:
        st.put("raw", np.ones(3, np.float32))
        g = Graph(st)  # a task that raises: not retried, its dependent never starts
        bad = g.task(tf.boom, ["raw"], ["out"], jit=False, name="tokenize")
        g.task(tf.plus_one, ["out"], ["after"], after=[bad], name="dependent")
        run = g.run(backend="ray")
        try:
            run.wait(timeout=60)
            result["raise"] = None
        except TaskError as e:
            result["raise"] = {"type": type(e).__name__, "code": e.code.value, "message": str(e), "task": e.task,
                               "worker": e.worker, "report": record(run.report())}

        g = Graph(st)  # a worker SIGKILLed on the first attempt: Ray runs it again
        g.task(tf.die_once, ["raw"], ["revived"], jit=False, name="die_once")
        result["retry"] = record(g.run(backend="ray").wait(timeout=60))

        g = Graph(st)  # a hung task past its timeout
        g.task(tf.hang, ["raw"], ["hung"], timeout=2.0, jit=False, name="stuck")
        t = time.monotonic()
        try:
            g.run(backend="ray").wait(timeout=60)
            result["timeout"] = None
        except TaskError as e:
            result["timeout"] = {"type": type(e).__name__, "code": e.code.value, "message": str(e),
                                 "seconds": time.monotonic() - t}

        st.put("c/0", np.zeros(4, np.float32))
        g, prev = Graph(st), None  # cancel in the middle of a chain: the third task hangs (killed after the grace)
        for i in range(6):
            fn = tf.hang if i == 2 else tf.slow
            prev = g.task(fn, [f"c/{i}"], [f"c/{i + 1}"], after=[prev] if prev else [], jit=False, name=f"t{i}")
        run = g.run(backend="ray")
        deadline = time.monotonic() + 60
        while run.status()["done"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # inside the third task's sleep
        t = time.monotonic()
        run.cancel()
        try:
            run.wait(timeout=30)
            result["cancel"] = None
        except Cancelled as e:
            result["cancel"] = {"code": e.code.value, "seconds": time.monotonic() - t, "report": record(run.report()),
                                "keys": st.keys("c/"), "verify": st.verify().ok}
    result["total_s"] = time.monotonic() - t0
    (out / "result.json").write_text(json.dumps(result, indent=1))
    ray.shutdown()


if __name__ == "__main__":
    main()
