"""The checkpoint vectors (conformance/checkpoint, spec 9.4.8) pass, are what their generator
writes, lay out the pieces spec 2.7 says, reach the error codes they claim, and their runner
notices a broken copy; `dtm conformance checkpoint` runs them."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

from click.testing import CliRunner

from dtm.ckpt.conformance import DEFAULT_ROOT, load_manifest, run_checkpoint_vectors, summary
from dtm.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
GENERATOR = DEFAULT_ROOT / "tools" / "make_vectors.py"


def test_every_vector_passes_onto_one_and_three_ranks():
    results = run_checkpoint_vectors()
    assert all(r.ok for r in results), summary(results)
    assert sorted(r.name for r in results if r.kind == "valid") == ["two_layer/one_rank", "two_layer/three_ranks"]
    invalid = load_manifest()["invalid"]
    assert {e["code"] for e in invalid.values()} == {"E1102", "E0601", "E1401"}
    assert sum(r.kind == "invalid" for r in results) == 2 * len(invalid)  # each damage on both loads


def test_dtm_conformance_checkpoint_runs_them():
    r = CliRunner().invoke(main, ["conformance", "checkpoint"])
    assert r.exit_code == 0, r.output
    assert r.output.strip().splitlines()[-1] == f"{len(run_checkpoint_vectors())} passed, 0 failed"


def test_three_rank_pieces_are_the_spec_split_of_the_saved_tensors():
    three = load_manifest()["valid"]["two_layer"]["loads"][1]["tensors"]
    shapes = {n: [p["shape"] for p in t["pieces"]] for n, t in three.items()}
    assert shapes["model/0.weight"] == [[2, 4], [2, 4], [1, 4]]  # 5 rows: ceil(5 / 3) = 2, 2, 1
    assert shapes["optim/state/2/exp_avg"] == [[3, 2], [3, 2], [3, 1]]  # shard(1) of f32[3, 5]
    assert shapes["model/2.bias"] == [[3], [3], [3]]  # replicated
    saved = json.loads(next((DEFAULT_ROOT / "valid" / "two_layer").glob("step-*/manifest.json")).read_text())
    for t in saved["tensors"]:  # saved on dp=2 x tp=2: layer 0 colwise, layer 2 rowwise
        assert t["mesh"] == {"axes": [["dp", 2], ["tp", 2]]}, t["name"]
    one = load_manifest()["valid"]["two_layer"]["loads"][0]["tensors"]
    assert {n: t["pieces"][0]["crc32c"] for n, t in one.items()} == {t["name"]: t["checksum"] for t in saved["tensors"]}


def test_vectors_are_what_the_generator_writes(tmp_path):
    proc = subprocess.run([sys.executable, str(GENERATOR), str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    committed = sorted(p.relative_to(DEFAULT_ROOT) for p in DEFAULT_ROOT.rglob("*") if p.is_file()
                       and p.relative_to(DEFAULT_ROOT).parts[0] not in ("tools", "README.md"))
    assert written == committed
    for rel in written:
        new, old = (tmp_path / rel).read_bytes(), (DEFAULT_ROOT / rel).read_bytes()
        if rel.name == "manifest.json":  # the committed vectors stay as a release wrote them (a 1.x checkpoint
            new, old = _unversioned(new), _unversioned(old)  # loads in every later 1.y), so versions may differ
        assert new == old, rel
    assert sum((tmp_path / rel).stat().st_size for rel in written) < 32 << 10  # small vectors


def _unversioned(manifest: bytes) -> dict:
    doc = json.loads(manifest)
    for field in ("dtm_version", "spec_version"):
        doc.pop(field, None)
    return doc


def test_the_runner_notices_a_broken_copy(tmp_path):
    root = tmp_path / "checkpoint"
    shutil.copytree(DEFAULT_ROOT, root)
    manifest = json.loads((root / "manifest.json").read_text())
    pieces = manifest["valid"]["two_layer"]["loads"][1]["tensors"]["model/0.weight"]["pieces"]
    pieces[2]["crc32c"] = "00000000"
    manifest["valid"]["two_layer"]["values"]["step"] = 3
    manifest["invalid"]["flipped_byte"]["code"] = "E1403"
    (root / "manifest.json").write_text(json.dumps(manifest))
    failed = {r.name: r.detail for r in run_checkpoint_vectors(root) if not r.ok}
    assert set(failed) == {"two_layer/one_rank", "two_layer/three_ranks", "flipped_byte/one_rank",
                           "flipped_byte/three_ranks"}, failed
    assert "model/0.weight, rank 2" in failed["two_layer/three_ranks"]
    assert "step: 2, expected 3" in failed["two_layer/one_rank"]
    assert "E1102" in failed["flipped_byte/one_rank"] and "expected E1403" in failed["flipped_byte/one_rank"]
    r = CliRunner().invoke(main, ["conformance", "checkpoint", "--root", str(root)])
    assert r.exit_code == 1 and "FAIL valid two_layer/three_ranks" in r.output
