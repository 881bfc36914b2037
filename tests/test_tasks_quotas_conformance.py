"""The task-graph vectors (conformance/tasks, spec 9.3.8) and the quota vectors
(conformance/quotas, spec 9.4.14): DTM passes them, they are what their generators write
(outcomes computed there from the reference interpreter and a model of 9.2.7's rule, not by
the code under test), a vector that differs from what DTM does is a failure that names it
while the others still run, and `dtm conformance tasks` / `quotas` run them."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil

import pytest
from click.testing import CliRunner

from dtm.cli import main
from dtm.store import conformance as quota_vectors
from dtm.tasks import conformance as task_vectors

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _generator(suite: str):
    path = ROOT / "conformance" / suite / "tools" / "make_vectors.py"
    spec = importlib.util.spec_from_file_location(f"make_{suite}_vectors", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("suite", ["tasks", "quotas"])
def test_the_vectors_are_what_their_generator_writes(suite):
    assert _generator(suite).main(["--check"]) == 0


def test_every_task_vector_passes():
    results = task_vectors.run_task_vectors()
    assert [(r.name, r.detail) for r in results if not r.ok] == []
    manifest = json.loads((task_vectors.DEFAULT_ROOT / "manifest.json").read_text())
    assert sorted(r.name for r in results) == sorted(manifest["vectors"])
    codes = {e["error"] for e in manifest["vectors"].values() if e["kind"] == "invalid"}
    assert codes == {"E0804", "E0402", "E0403", "E0302", "E0307", "E0208", "E0209", "E0204"}  # each check of 9.3.1


def test_the_failing_graph_keeps_finished_outputs_and_writes_none_of_the_failed_task():
    doc = json.loads((task_vectors.DEFAULT_ROOT / "valid" / "fails_at_run_time.json").read_text())
    assert doc["error"] == "E0808"
    assert doc["states"] == {"a": "finished", "b": "finished", "c": "failed", "d": "never started"}
    assert sorted(doc["stored"]) == ["a", "b", "x"]  # neither "c" nor "sum" of the failed task


def _copy(src: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / src.name
    shutil.copytree(src, root, ignore=shutil.ignore_patterns("tools"))
    return root


def _edit(path: pathlib.Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def test_a_task_vector_that_differs_is_a_failure_that_names_it(tmp_path):
    root = _copy(task_vectors.DEFAULT_ROOT, tmp_path)
    _edit(root / "valid" / "chain.json", lambda d: d["stored"]["c"]["data"].__setitem__(0, 99.0))
    _edit(root / "valid" / "diamond.json", lambda d: d["states"].__setitem__("bottom", "failed"))
    _edit(root / "invalid" / "cycle.json", lambda d: d.__setitem__("error", "E0208"))
    _edit(root / "invalid" / "missing_input.json", lambda d: d.__setitem__("error", None))
    (root / "valid" / "two_outputs.dtm").unlink()
    results = {r.name: r for r in task_vectors.run_task_vectors(root)}
    failed = {n: r.detail for n, r in results.items() if not r.ok}
    assert sorted(failed) == ["chain", "cycle", "diamond", "missing_input", "two_outputs"]
    assert "stored 'c'" in failed["chain"] and "bottom" in failed["diamond"]
    assert "E0209, expected E0208" in failed["cycle"] and "cannot read" in failed["two_outputs"]
    assert results["independent"].ok  # the others still run


def test_a_manifest_of_another_version_is_named(tmp_path):
    for module, src in ((task_vectors, task_vectors.DEFAULT_ROOT), (quota_vectors, quota_vectors.DEFAULT_ROOT)):
        root = _copy(src, tmp_path)
        _edit(root / "manifest.json", lambda d: d.__setitem__("spec_version", "2.0.0"))
        run = task_vectors.run_task_vectors if module is task_vectors else quota_vectors.run_quota_vectors
        (result,) = run(root)
        assert not result.ok and "'2.0.0'" in result.detail


def test_every_quota_vector_passes_on_both_stores():
    results = quota_vectors.run_quota_vectors()
    assert [(r.kind, r.name, r.detail) for r in results if not r.ok] == []
    manifest = json.loads((quota_vectors.DEFAULT_ROOT / "manifest.json").read_text())
    assert sum(r.kind == "size" for r in results) == len(manifest["sizes"])
    for kind in quota_vectors.KINDS:
        assert sorted(r.name for r in results if r.kind == kind) == sorted(manifest["vectors"])
    steps = [s for n in manifest["vectors"] for s in
             json.loads((quota_vectors.DEFAULT_ROOT / "valid" / f"{n}.json").read_text())["steps"]]
    assert {s["expect"] for s in steps if "put" in s} == {"ok", "E1103"}  # both outcomes are pinned


def test_a_quota_vector_that_differs_is_a_failure_that_names_it(tmp_path):
    root = _copy(quota_vectors.DEFAULT_ROOT, tmp_path)
    _edit(root / "manifest.json", lambda d: d["sizes"].__setitem__(0, ["1000000", 1000001]))
    doc = json.loads((root / "valid" / "replacing.json").read_text())
    i = next(i for i, s in enumerate(doc["steps"]) if s.get("expect") == "E1103")
    doc["steps"][i]["expect"] = "ok"
    (root / "valid" / "replacing.json").write_text(json.dumps(doc))
    failed = [(r.kind, r.name, r.detail) for r in quota_vectors.run_quota_vectors(root) if not r.ok]
    assert [(k, n) for k, n, _ in failed] == [("size", "'1000000'"), ("directory", "replacing"), ("memory", "replacing")]
    assert f"step {i}" in failed[1][2] and "E1103, expected ok" in failed[1][2]


@pytest.mark.parametrize("suite, run", [("tasks", task_vectors.run_task_vectors),
                                        ("quotas", quota_vectors.run_quota_vectors)])
def test_dtm_conformance_runs_them(suite, run):
    r = CliRunner().invoke(main, ["conformance", suite])
    assert r.exit_code == 0, r.output
    assert r.output.strip().splitlines()[-1] == f"{len(run())} passed, 0 failed"
