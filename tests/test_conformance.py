"""The IR conformance vectors (conformance/ir) pass, cover every op and every error code, and
their runner really notices a broken vector."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import dtm.ir as ir
from dtm.errors import ErrorCode
from dtm.ir import REGISTRY, versioning
from dtm.ir.conformance import DEFAULT_ROOT, VectorResult, load_manifest, run_ir_vectors, summary

ROOT = DEFAULT_ROOT
MANIFEST = load_manifest(ROOT)
RESULTS = run_ir_vectors()

# Ops whose vector a core bug blocks; the vector goes in when the bug is fixed (strict xfail:
# the test fails once the op is covered, as a reminder to delete the entry).
BLOCKED_OPS: dict[str, str] = {}  # op name -> why it has no valid vector yet


def test_default_root_is_the_repository_folder():
    assert ROOT == pathlib.Path(__file__).resolve().parents[1] / "conformance" / "ir"
    assert (ROOT / "manifest.json").is_file()


@pytest.mark.parametrize("result", RESULTS, ids=[f"{r.kind}/{r.name}" for r in RESULTS])
def test_vector(result: VectorResult):
    assert result.ok, result.detail


def test_summary_of_the_real_run():
    assert summary(RESULTS).splitlines()[-1] == f"{len(RESULTS)} passed, 0 failed"


# --- coverage ---------------------------------------------------------------------------

def _ops_in(path: pathlib.Path) -> set[str]:
    m = ir.parse(path.read_bytes())
    return {op.name for f in m.funcs.values() for op in f.ops}


VALID_OPS = {p.stem: _ops_in(p) for p in sorted((ROOT / "valid").glob("*.dtm"))}


@pytest.mark.parametrize("opname", [
    pytest.param(name, marks=pytest.mark.xfail(reason=BLOCKED_OPS[name], strict=True)) if name in BLOCKED_OPS
    else name for name in REGISTRY])
def test_every_op_has_a_valid_vector(opname: str):
    own = f"op_{opname}"
    assert own in VALID_OPS, f"no valid/{own}.dtm"
    assert opname in VALID_OPS[own], f"valid/{own}.dtm does not use {opname}"
    assert own in MANIFEST["valid"]


def test_whole_program_vectors_exist():
    progs = [n for n in VALID_OPS if n.startswith("prog_")]
    assert len(progs) >= 5, progs


def test_enough_invalid_vectors():
    assert len(MANIFEST["invalid"]) >= 40
    assert len(list((ROOT / "invalid").glob("*.dtm"))) == len(MANIFEST["invalid"])


def test_every_error_code_is_covered_or_unreachable():
    covered = {e["code"] for e in MANIFEST["invalid"].values()}
    unreachable = MANIFEST["unreachable"]
    known = {c.value: c for c in ErrorCode}
    for code, entry in unreachable.items():
        assert code in known, f"unreachable lists {code}, which is not an ErrorCode"
        assert entry["name"] == known[code].name
        assert entry["reason"].strip()
        assert code not in covered, f"{code} is listed unreachable but a vector reaches it"
    for code in ErrorCode:
        if code.value[:3] in ("E01", "E02", "E03", "E04", "E05", "E06"):
            assert code.value in covered or code.value in unreachable, f"{code.value} {code.name} is not covered"
    for code in covered:
        assert code in known


def test_manifest_shape():
    assert set(MANIFEST) == {"spec_version", "valid", "invalid", "unreachable"}
    assert MANIFEST["spec_version"] == ".".join(map(str, ir.SPEC_VERSION))
    for e in MANIFEST["invalid"].values():
        assert set(e) == {"code", "line", "col"}
        assert e["line"] >= 1 and e["col"] >= 1


def test_bytes_that_git_could_mangle_are_intact():
    """.gitattributes keeps these as they are; a checkout that rewrote them would make the
    vectors test something else."""
    crlf = (ROOT / "valid" / "prog_crlf_and_spacing.dtm").read_bytes()
    assert crlf.count(b"\r\n") == crlf.count(b"\n") > 5
    with pytest.raises(UnicodeDecodeError):
        (ROOT / "invalid" / "lex_invalid_utf8.dtm").read_bytes().decode("utf-8")
    deep = (ROOT / "invalid" / "syntax_nesting_too_deep.dtm").read_text()
    assert "[" * 65 in deep


def test_expected_files_are_canonical_and_complete():
    for p in (ROOT / "valid").glob("*.expected"):
        assert p.with_suffix(".dtm").exists(), f"stale {p.name}"
        text = p.read_bytes()
        assert text.endswith(b"\n") and b"\r" not in text and b"//" not in text


_VALUE = re.compile(r"value = (\[.*\]|[^,}\s]+)\}.*: ([a-z0-9]+)\[")
_NUMBER = re.compile(r"-?(?:inf|nan|[0-9][0-9.eE+-]*)")


def _literals(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """(dtype, element spellings) of every `value = ...` of a vector, line by line."""
    return [(m.group(2), _NUMBER.findall(m.group(1))) for m in map(_VALUE.search, path.read_text().splitlines()) if m]


@pytest.mark.parametrize("name", ["literal_f16", "literal_f8", "literal_u64"])
def test_narrow_literal_vectors_round_as_numpy_and_ml_dtypes(name):
    """The values a narrow-dtype vector holds, checked against numpy's and ml_dtypes' own
    round-to-nearest-even conversions, not DTM's: each element as written and as the
    expected text prints it is one value of the dtype, the one DTM holds."""
    import ml_dtypes
    import numpy as np

    np_dtype = {"f16": np.float16, "f8e4m3": ml_dtypes.float8_e4m3fn, "f8e5m2": ml_dtypes.float8_e5m2,
                "u64": np.uint64, "i64": np.int64}

    def held(dtype: str, spellings: list[str]) -> np.ndarray:
        if dtype in ("u64", "i64"):
            return np.array([int(x) for x in spellings], dtype=np_dtype[dtype])
        return np.array([float(x) for x in spellings], dtype=np.float64).astype(np_dtype[dtype])

    written, printed = _literals(ROOT / "valid" / f"{name}.dtm"), _literals(ROOT / "valid" / f"{name}.expected")
    module = ir.verify(ir.parse((ROOT / "valid" / f"{name}.dtm").read_bytes()))
    values = [op.attrs["value"] for op in module.funcs["f"].ops]
    assert len(written) == len(printed) == len(values) > 0
    for (dtype, src), (dtype2, out), value in zip(written, printed, values):
        want = held(dtype, src)
        assert dtype == dtype2 and held(dtype, out).tobytes() == want.tobytes(), (dtype, src, out)
        data = value.data if isinstance(value, ir.Literal) else held(dtype, [repr(value)]).tobytes()  # `full`: a scalar
        assert data == want.tobytes(), (dtype, src)


def test_make_expected_finds_no_drift():
    script = ROOT / "tools" / "make_expected.py"
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- the runner notices broken vectors ----------------------------------------------------

def _copy_suite(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "ir"
    shutil.copytree(ROOT, root, ignore=shutil.ignore_patterns("tools"))
    return root


def _by_name(results):
    return {(r.kind, r.name): r for r in results}


def test_runner_reports_broken_vectors(tmp_path):
    root = _copy_suite(tmp_path)
    # a canonical text that is off by one character
    exp = root / "valid" / "op_add.expected"
    exp.write_bytes(exp.read_bytes().replace(b"%w = add", b"%w =  add"))
    # a wrong hash
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["valid"]["op_neg"]["hash"] = "0" * 64
    # an invalid vector expected at the wrong column, and one with the wrong code
    manifest["invalid"]["lex_bad_character"]["col"] += 1
    manifest["invalid"]["op_unknown"]["code"] = "E0302"
    # a vector without a manifest entry, and an entry without a vector
    (root / "invalid" / "stray.dtm").write_text("dtm 1.0\n")
    manifest["invalid"]["ghost"] = {"code": "E0101", "line": 1, "col": 1}
    (root / "manifest.json").write_text(json.dumps(manifest))
    # an "invalid" vector that is in fact valid
    shutil.copy(root / "valid" / "op_abs.dtm", root / "invalid" / "name_undefined_value.dtm")

    results = _by_name(run_ir_vectors(root))
    bad = {k for k, r in results.items() if not r.ok}
    assert bad == {("valid", "op_add"), ("valid", "op_neg"), ("invalid", "lex_bad_character"),
                   ("invalid", "op_unknown"), ("invalid", "stray"), ("invalid", "ghost"),
                   ("invalid", "name_undefined_value")}
    assert "line 5" in results["valid", "op_add"].detail
    assert "0" * 64 in results["valid", "op_neg"].detail
    assert "E0101" in results["invalid", "lex_bad_character"].detail
    assert "parsed and verified" in results["invalid", "name_undefined_value"].detail
    text = summary(list(results.values()))
    assert text.splitlines()[-1] == f"{len(results) - 7} passed, 7 failed"
    assert "FAIL invalid/stray: " in text


def test_runner_without_manifest(tmp_path):
    results = run_ir_vectors(tmp_path)
    assert len(results) == 1 and not results[0].ok


def test_make_expected_regenerates_valid_only(tmp_path):
    root = _copy_suite(tmp_path)
    (root / "valid" / "op_add.expected").unlink()
    manifest = json.loads((root / "manifest.json").read_text())
    del manifest["valid"]["op_neg"]
    manifest["invalid"]["op_unknown"]["col"] = 99
    (root / "manifest.json").write_text(json.dumps(manifest))
    script = ROOT / "tools" / "make_expected.py"
    proc = subprocess.run([sys.executable, str(script), "--root", str(root)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1  # the hand-written invalid entry disagrees: reported, not rewritten
    assert "PROBLEM invalid/op_unknown" in proc.stdout
    after = json.loads((root / "manifest.json").read_text())
    assert after["invalid"]["op_unknown"]["col"] == 99
    assert after["valid"]["op_neg"] == MANIFEST["valid"]["op_neg"]
    assert (root / "valid" / "op_add.expected").read_bytes() == (ROOT / "valid" / "op_add.expected").read_bytes()


# --- versions: what a vector cannot say ---------------------------------------------------

def test_version_boundaries_of_this_reader():
    major, minor, _ = ir.SPEC_VERSION
    ir.parse(f"dtm {major}.{minor}\n")
    ir.parse(f"dtm {major}.0\n")
    for text in (f"dtm {major}.{minor + 1}\n", f"dtm {major + 1}.0\n"):
        with pytest.raises(ir.IRError) as e:
            ir.parse(text)
        assert (e.value.code, e.value.line, e.value.col) == (ErrorCode.UNSUPPORTED_VERSION, 1, 5)


NEWER_OP_MODULE = """dtm 1.1
func @f(%x: f32[4]) -> (f32[4]) {
  %y = silu %x : f32[4]
  return %y
}
"""


def test_e0602_op_newer_than_target(monkeypatch):
    """A 1.1 reader pretends `silu` was added in 1.1: a 1.1 module that uses it can be written
    as 1.1, but writing it for a 1.0 target is refused (E0602), in text and in binary."""
    monkeypatch.setitem(REGISTRY, "silu", dataclasses.replace(REGISTRY["silu"], since=(1, 1)))
    monkeypatch.setattr(versioning, "SPEC_VERSION", (1, 1, 0))

    m = ir.verify(ir.parse(NEWER_OP_MODULE))
    assert ir.format(m).startswith("dtm 1.1\n")
    assert ir.decode(ir.encode(m)) == m
    for write in (ir.format, ir.encode):
        with pytest.raises(ir.IRError) as e:
            write(m, target=(1, 0))
        assert e.value.code is ErrorCode.OP_NEWER_THAN_TARGET
        assert (e.value.line, e.value.col) == (3, 8)  # the op's name

    # The same module without the new op is written for 1.0 without complaint.
    plain = ir.verify(ir.parse(NEWER_OP_MODULE.replace("silu", "sigmoid")))
    assert ir.format(plain, target=(1, 0)).startswith("dtm 1.0\n")
    assert ir.parse(ir.format(plain, target=(1, 0))).version == (1, 0)
