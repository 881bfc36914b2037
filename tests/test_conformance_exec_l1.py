"""The execution vectors with a mesh over processes (L1; `dtm conformance exec --executor l1`):
a process per rank with `dtm launch` on 127.0.0.1 (one launch per rank count: 8 for
the collectives, 2 for send and recv) and every vector passes; a vector whose expected output
is wrong on one rank is a failure naming that rank, and the others still pass."""

from __future__ import annotations

import json
import pathlib
import shutil

from dtm.runtime.exec_l1 import run_l1_vectors

VECTORS = pathlib.Path(__file__).resolve().parents[1] / "conformance" / "exec"


def test_every_vector_with_a_mesh_passes_over_processes_and_a_wrong_one_is_named(tmp_path):
    root = tmp_path / "exec"
    shutil.copytree(VECTORS, root, ignore=shutil.ignore_patterns("tools"))
    meshes = sorted(n for n, v in json.loads((root / "manifest.json").read_text())["vectors"].items()
                    if v["ranks"] > 1)
    assert {"all_reduce", "send", "recv"} <= set(meshes)
    doc = json.loads((root / "valid" / "all_gather.json").read_text())
    doc["outputs"][5][0]["data"][3] += 1.0  # rank 5's expected value, wrong
    (root / "valid" / "all_gather.json").write_text(json.dumps(doc))
    results = run_l1_vectors(root)
    assert sorted(r.name for r in results) == meshes and {r.kind for r in results} == {"l1"}
    bad = {r.name: r.detail for r in results if not r.ok}
    assert list(bad) == ["all_gather"] and bad["all_gather"].startswith("rank 5 output"), bad

