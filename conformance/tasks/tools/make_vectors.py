#!/usr/bin/env python3
"""Write the task-graph vectors (spec 9.3.8): IR modules whose `task` declarations form a
graph over a tensor store, the store before the run, and what the spec says comes of it.

A valid graph's outcome is computed here without any task executor: its tasks are taken in
an order that `after` allows (they are declared in one), each function run by the reference
interpreter on the values its input keys hold, its results stored under its output keys only
once it has returned all of them (9.3.3). A task that raises fails the graph with its code;
the tasks ordered after it never start (9.3.4). An invalid graph is refused before any task
starts (9.3.1): its code is the rule's, written below by hand, and the store stays as it was.

    .venv/bin/python conformance/tasks/tools/make_vectors.py          # write
    .venv/bin/python conformance/tasks/tools/make_vectors.py --check  # compare with what is written; exit 1 on drift

Review `git diff conformance/tasks` before committing: a changed outcome is a change of the
spec's rules, which other implementations must follow.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]  # conformance/tasks
sys.path.insert(0, str(ROOT.parents[1]))  # the repository, so `dtm` imports without installing

from dtm.errors import DTMError  # noqa: E402
from dtm.ir.conformance import generator_main  # noqa: E402
from dtm.ir import parse  # noqa: E402
from dtm.ir.version import SPEC_VERSION  # noqa: E402
from dtm.ref.interpreter import run  # noqa: E402
from dtm.runtime.exec_vectors import encode_array  # noqa: E402

FUNCS = '''dtm 1.1

func @double(%x: f32[4]) -> (f32[4]) {
  %two = full {value = 2} : f32[]
  %y = mul %x, %two : f32[4]
  return %y
}

func @add(%x: f32[4], %y: f32[4]) -> (f32[4]) {
  %z = add %x, %y : f32[4]
  return %z
}

func @split(%x: f32[4]) -> (f32[2], i64[]) {
  %head = slice %x {start = [0], stop = [2], step = [1]} : f32[2]
  %big = argmax %x {axis = 0} : i64[]
  return %head, %big
}

func @ones() -> (f32[4]) {
  %o = full {value = 1} : f32[4]
  return %o
}

func @bounded(%x: f32[4]) -> (f32[4], f32[]) {
  %ten = full {value = 10} : f32[]
  %over = gt %x, %ten : bool[4]
  %y = check %x, %over {code = "E0808", message = "value {value} is over 10"} : f32[4]
  %s = reduce_sum %y {axes = [0]} : f32[]
  return %y, %s
}
'''

X = np.array([1.5, -2.0, 3.25, 0.5], np.float32)
W = np.array([4.0, 0.25, -1.0, 2.0], np.float32)

# name: (the graph's task declarations, the store before the run, the code a refused graph
# is refused with (None for a graph that runs), what the vector pins)
VALID = {
    "chain": ('task @a = @double {inputs = ["x"], outputs = ["a"]}\n'
              'task @b = @add {inputs = ["a", "x"], outputs = ["b"], after = [@a]}\n'
              'task @c = @double {inputs = ["b"], outputs = ["c"], after = [@b]}\n',
              {"x": X}, "a key a task writes is read by the task after it"),
    "diamond": ('task @top = @double {inputs = ["x"], outputs = ["t"]}\n'
                'task @left = @add {inputs = ["t", "w"], outputs = ["l"], after = [@top]}\n'
                'task @right = @double {inputs = ["t"], outputs = ["r"], after = [@top]}\n'
                'task @bottom = @add {inputs = ["l", "r"], outputs = ["out"], after = [@left, @right]}\n',
                {"x": X, "w": W}, "two tasks after one, one after both (they MAY run at once)"),
    "independent": ('task @one = @double {inputs = ["x"], outputs = ["p/x2"]}\n'
                    'task @two = @double {inputs = ["w"], outputs = ["p/w2"]}\n'
                    'task @three = @ones {inputs = [], outputs = ["p/ones"]}\n',
                    {"x": X, "w": W}, "tasks not ordered by after, one with no inputs"),
    "two_outputs": ('task @s = @split {inputs = ["x"], outputs = ["head", "argmax"]}\n',
                    {"x": X}, "a function's results go to the task's output keys in order, of their dtypes"),
    "ordered_rewrite": ('task @first = @double {inputs = ["x"], outputs = ["k"]}\n'
                        'task @again = @double {inputs = ["k"], outputs = ["k"], after = [@first]}\n',
                        {"x": X}, "two ordered tasks write one key: the later value stays; a task reads the key it writes"),
    "replaces_a_stored_key": ('task @t = @ones {inputs = [], outputs = ["x"]}\n',
                              {"x": X}, "an output key the store already holds is replaced"),
    "fails_at_run_time": ('task @a = @double {inputs = ["x"], outputs = ["a"]}\n'
                          'task @b = @double {inputs = ["a"], outputs = ["b"], after = [@a]}\n'
                          'task @c = @bounded {inputs = ["b"], outputs = ["c", "sum"], after = [@b]}\n'
                          'task @d = @double {inputs = ["c"], outputs = ["d"], after = [@c]}\n',
                          {"x": X}, "a task whose check fails (E0808): the finished tasks' outputs stay, the failed "
                          "one writes none of its two, the one after it never starts"),
}
INVALID = {
    "missing_input": ('task @a = @double {inputs = ["x"], outputs = ["a"]}\n'
                      'task @b = @add {inputs = ["a", "absent"], outputs = ["b"], after = [@a]}\n',
                      {"x": X}, "E0804", "an input key the store lacks and no task writes: nothing runs, not even @a"),
    "input_dtype": ('task @a = @double {inputs = ["x"], outputs = ["a"]}\n',
                    {"x": X.astype(np.int32)}, "E0402", "the store holds i32 where the parameter is f32"),
    "input_shape": ('task @a = @double {inputs = ["x"], outputs = ["a"]}\n',
                    {"x": np.append(X, 1.0).astype(np.float32)}, "E0403", "the store holds f32[5] where the parameter is f32[4]"),
    "input_count": ('task @a = @double {inputs = ["x", "x"], outputs = ["a"]}\n',
                    {"x": X}, "E0302", "two input keys for a function of one parameter"),
    "output_count": ('task @a = @double {inputs = ["x"], outputs = ["a", "b"]}\n',
                     {"x": X}, "E0307", "two output keys for a function of one result"),
    "after_unknown": ('task @a = @double {inputs = ["x"], outputs = ["a"], after = [@nowhere]}\n',
                      {"x": X}, "E0208", "after names no task"),
    "cycle": ('task @a = @double {inputs = ["x"], outputs = ["a"], after = [@c]}\n'
              'task @b = @double {inputs = ["x"], outputs = ["b"], after = [@a]}\n'
              'task @c = @double {inputs = ["x"], outputs = ["c"], after = [@b]}\n',
              {"x": X}, "E0209", "after has a cycle (a, b, c)"),
    "duplicate_name": ('task @a = @double {inputs = ["x"], outputs = ["a"]}\n'
                       'task @a = @double {inputs = ["x"], outputs = ["b"]}\n',
                       {"x": X}, "E0204", "two tasks named @a"),
}


def outcome(text: str, store: dict[str, np.ndarray]) -> tuple[dict, dict, str | None]:
    """(the store after the run, each task's state, the graph's error code or None), by
    running the tasks one by one in declaration order (each vector declares its tasks in an
    order `after` allows) on the reference interpreter."""
    module = parse(text)
    held = dict(store)
    states = {t.name: "never started" for t in module.tasks.values()}
    for t in module.tasks.values():
        try:
            results = run(module, t.func, [held[k] for k in t.inputs])
        except DTMError as e:
            states[t.name] = "failed"
            return held, states, e.code.value
        held.update(zip(t.outputs, (np.asarray(r) for r in results)))  # all of them, after the return
        states[t.name] = "finished"
    return held, states, None


def _arrays(d: dict[str, np.ndarray]) -> dict:
    return {k: encode_array(v) for k, v in sorted(d.items())}


def files() -> tuple[dict[pathlib.Path, str], dict]:
    """{path: content} of every vector, and the manifest's `vectors`."""
    out, vectors = {}, {}
    for name, (tasks, store, note) in VALID.items():
        text = FUNCS + "\n" + tasks
        held, states, error = outcome(text, store)
        doc = {"store": _arrays(store), "stored": _arrays(held), "states": states, "error": error}
        out[ROOT / "valid" / f"{name}.dtm"] = text
        out[ROOT / "valid" / f"{name}.json"] = json.dumps(doc, indent=1) + "\n"
        vectors[name] = {"kind": "valid", "error": error, "pins": note}
    for name, (tasks, store, code, note) in INVALID.items():
        out[ROOT / "invalid" / f"{name}.dtm"] = FUNCS + "\n" + tasks
        out[ROOT / "invalid" / f"{name}.json"] = json.dumps({"store": _arrays(store), "error": code}, indent=1) + "\n"
        vectors[name] = {"kind": "invalid", "error": code, "pins": note}
    return out, vectors


def main(argv: list[str] | None = None) -> int:
    out, vectors = files()
    out[ROOT / "manifest.json"] = json.dumps({"spec_version": ".".join(map(str, SPEC_VERSION)),
                                              "vectors": vectors}, indent=1) + "\n"
    return generator_main(argv, __doc__.split("\n")[0], out, "the spec's rules and the reference",
                          f"{len(vectors)} vectors written to {ROOT}")

if __name__ == "__main__":
    sys.exit(main())
