"""The runner for the task-graph vectors in `conformance/tasks/` (spec 9.3.8).

    results = run_task_vectors()   # default root: the repository's conformance/tasks

Each vector is a module (`NAME.dtm`) whose `task` declarations form a graph, and a JSON
file: `store`, what the tensor store holds before the run; `error`, the code the graph
ends with (None: it finishes); for a valid graph `stored`, every key the store MUST hold
after the run and its value (no other key), and `states`, each task's state in the run's
report. A graph under `invalid/` MUST be refused before any task starts: the store holds
exactly `store` afterwards.

Each vector runs on a fresh directory store in a temporary directory, with two worker
threads, as `Graph.from_module(module, store).run(workers=2)`; nothing under `conformance/`
is written.
`tests/test_tasks_conformance.py` and `dtm conformance tasks` both call `run_task_vectors`.
"""

from __future__ import annotations

import json
import pathlib
import tempfile

import numpy as np

from .. import store as _store
from ..errors import DTMError
from ..ir.conformance import VectorResult, manifest_or_failure
from ..ir.parser import parse
from ..runtime.exec_vectors import decode_array, differences
from .graph import Graph

DEFAULT_ROOT = pathlib.Path(__file__).resolve().parents[2] / "conformance" / "tasks"
WAIT_S = 60.0  # a vector's graph is a few tasks of four elements: this bound only catches a hang


def _arrays(doc: dict, field: str, where: str) -> dict[str, np.ndarray]:
    return {k: decode_array(v, f"{where} {field} {k!r}") for k, v in doc.get(field, {}).items()}


def _store_differs(store, want: dict[str, np.ndarray]) -> str | None:
    """How the store's keys and values differ from `want`, or None."""
    keys = set(store.keys())
    if keys != set(want):
        return f"the store holds {sorted(keys)}, expected {sorted(want)}"
    for k, w in sorted(want.items()):
        problem = differences([store.get_array(k)], [w], f"stored {k!r}")
        if problem:
            return problem
    return None


def check(path: pathlib.Path, valid: bool) -> str | None:
    """Run vector `path` (its .dtm; its .json beside it); None when the outcome is the one
    listed, else the first difference."""
    doc = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    text = path.with_suffix(".dtm").read_text(encoding="utf-8")
    before, after = _arrays(doc, "store", path.name), _arrays(doc, "stored", path.name)
    with tempfile.TemporaryDirectory(prefix="dtm-task-vector-") as tmp, _store.open(tmp) as store:
        for k, a in before.items():
            store.put_array(k, a)
        return _outcome_differs(doc, text, store, before, after, valid)


def _outcome_differs(doc: dict, text: str, store, before: dict[str, np.ndarray], after: dict[str, np.ndarray],
                     valid: bool) -> str | None:
    """Run the graph of module `text` on `store` (holding `before`); its outcome's first
    difference from `doc`'s (`after`: the store a valid graph leaves), or None."""
    run, code = None, None
    try:
        run = Graph.from_module(parse(text), store).run(workers=2)
        run.wait(timeout=WAIT_S)
    except DTMError as e:
        code = e.code.value
    if code != doc["error"]:
        got = f"it ended with {code}" if code else "it finished"
        return f"{got}, expected {doc['error'] or 'it to finish'}"
    if not valid:
        if run is not None:
            return "the graph started, expected it refused before any task"
        problem = _store_differs(store, before)
        return f"refused, but the store changed: {problem}" if problem else None
    if run is None:
        return f"refused before it ran ({code}); the graph is valid"
    states = {r.name: r.state for r in run.report().tasks}
    if states != doc["states"]:
        return f"task states {states}, expected {doc['states']}"
    return _store_differs(store, after)


def run_task_vectors(root: pathlib.Path | None = None) -> list[VectorResult]:
    """Every vector the manifest lists under `root` (default: the repository's
    conformance/tasks), by name; a vector that cannot be read, or a manifest of another
    spec version, is a failure naming it, and the others still run."""
    root = pathlib.Path(root) if root is not None else DEFAULT_ROOT
    manifest = manifest_or_failure(root, this_version=True)
    if isinstance(manifest, VectorResult):
        return [manifest]
    results = []
    for name, entry in sorted(manifest.get("vectors", {}).items()):
        kind = entry.get("kind", "valid")
        try:
            problem = check(root / kind / f"{name}.dtm", kind == "valid")
        except (OSError, ValueError, KeyError, TypeError) as e:
            problem = f"cannot read the vector: {type(e).__name__}: {e}"
        results.append(VectorResult(name, kind, problem is None, problem or ""))
    return results


__all__ = ["run_task_vectors", "check", "DEFAULT_ROOT"]
