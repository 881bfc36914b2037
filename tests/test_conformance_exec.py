"""The execution vectors (spec 8.4) and the claim matrix (8.5): every op of the registry has
a vector made from its spec entry's example (or a stated reason why not), the vectors are
what the spec and the reference interpreter give (regenerating them changes nothing), the
reference, the cpu backend and L0's devices pass them, a damaged vector is named while the
others still run, and `dtm conformance all` prints the matrix, writes its JSON and fails
when a claimed capability does."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

from click.testing import CliRunner

from dtm import cli
from dtm.ir.registry import REGISTRY
from dtm.runtime import exec_vectors as ev

ROOT = pathlib.Path(__file__).resolve().parents[1]
VECTORS = ROOT / "conformance" / "exec"


def test_every_op_has_a_vector_or_a_reason():
    manifest = json.loads((VECTORS / "manifest.json").read_text())
    covered = {op for v in manifest["vectors"].values() for op in v["ops"]}
    assert set(REGISTRY) - covered - set(manifest["skipped"]) == set()
    assert set(manifest["vectors"]) | set(manifest["skipped"]) == set(REGISTRY)  # one per op's example


def test_the_vectors_are_what_the_spec_and_the_reference_give():
    out = subprocess.run([sys.executable, str(VECTORS / "tools" / "make_vectors.py"), "--check"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ref_cpu_and_l0_pass_every_vector():
    results = ev.run_exec_vectors()
    failed = [(r.kind, r.name, r.detail) for r in results if not r.ok]
    assert failed == []
    by = {k: sum(1 for r in results if r.kind == k) for k in ev.EXECUTORS}
    manifest = json.loads((VECTORS / "manifest.json").read_text())
    meshes = sum(1 for v in manifest["vectors"].values() if v["ranks"] > 1)
    assert by["ref"] == len(manifest["vectors"]) and by["l0"] == meshes and by["cpu"] >= len(manifest["vectors"]) - meshes - 2


def test_a_vector_that_differs_is_a_failure_that_names_it(tmp_path):
    root = tmp_path / "exec"
    shutil.copytree(VECTORS, root, ignore=shutil.ignore_patterns("tools"))
    doc = json.loads((root / "valid" / "exp.json").read_text())
    doc["outputs"][0][0]["data"][0] += 1.0  # a wrong expected value
    (root / "valid" / "exp.json").write_text(json.dumps(doc))
    doc = json.loads((root / "valid" / "neg.json").read_text())
    doc["outputs"][0][0]["shape"] = [2, 2]  # the wrong shape for its data
    (root / "valid" / "neg.json").write_text(json.dumps(doc))
    doc = json.loads((root / "valid" / "sign.json").read_text())
    doc["inputs"][0][0]["shape"] = [3]  # data that does not fill its shape
    (root / "valid" / "sign.json").write_text(json.dumps(doc))
    (root / "valid" / "abs.json").unlink()  # a missing file
    results = ev.run_exec_vectors(root, ("ref",))
    bad = {r.name: r.detail for r in results if not r.ok}
    assert set(bad) == {"exp", "neg", "sign", "abs"}, bad
    assert "output 0: at [0, 0] " in bad["exp"] and "expected int32[2, 2]" in bad["neg"]
    assert "not an array" in bad["sign"] and "abs.json" in bad["abs"]
    assert sum(r.ok for r in results) == len(results) - 4  # the others ran
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["spec_version"] = "9.9.0"
    (root / "manifest.json").write_text(json.dumps(manifest))
    (only,) = ev.run_exec_vectors(root)
    assert not only.ok and "9.9.0" in only.detail


def test_the_claim_matrix_passes_and_writes_its_json(tmp_path):
    out = tmp_path / "matrix.json"
    result = CliRunner().invoke(cli.main, ["conformance", "all", "--json", str(out)])
    assert result.exit_code == 0, result.output
    matrix = json.loads(out.read_text())
    claims = {c["capability"]: c for c in matrix["claims"]}
    assert list(claims)[:3] == ["CAP_IR", "CAP_EXEC", "CAP_LOCAL_COLLECTIVES"] and len(claims) == 14
    assert {c["status"] for c in claims.values()} == {"pass"}  # (CAP_TASKS, CAP_QUOTAS: untested before 1.1.2)
    assert all(c["vectors"] > 0 for c in claims.values() if c["status"] == "pass")
    assert "CAP_RESIZE" in result.output and "L3" in result.output


def test_a_failing_capability_fails_the_command(tmp_path, monkeypatch):
    root = tmp_path / "exec"
    shutil.copytree(VECTORS, root, ignore=shutil.ignore_patterns("tools"))
    doc = json.loads((root / "valid" / "all_reduce.json").read_text())
    doc["outputs"][1][0]["data"][3] = 1e6
    (root / "valid" / "all_reduce.json").write_text(json.dumps(doc))
    real = ev.run_exec_vectors
    monkeypatch.setattr(ev, "run_exec_vectors", lambda *a, **k: real(root))
    result = CliRunner().invoke(cli.main, ["conformance", "all", "--json", str(tmp_path / "m.json")])
    assert result.exit_code == 1
    claims = {c["capability"]: c for c in json.loads((tmp_path / "m.json").read_text())["claims"]}
    assert claims["CAP_LOCAL_COLLECTIVES"]["status"] == "fail" and claims["CAP_EXEC"]["status"] == "pass"
    assert "all_reduce" in claims["CAP_LOCAL_COLLECTIVES"]["first_failure"]
