"""The `dtm` command: `ir check|fmt|hash`, `conformance ir`, `--version`, and the
compiler-style error report (FILE:LINE:COL: CODE: message, the line, a caret)."""

from __future__ import annotations

import pathlib

from click.testing import CliRunner

from dtm import ir
from dtm.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
MLP = ROOT / "examples" / "mlp.dtm"


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_check_fmt_hash_agree_with_the_library():
    module = ir.verify(ir.parse(MLP.read_text()))
    check = run("ir", "check", str(MLP))
    assert check.exit_code == 0 and module.hash() in check.output
    assert run("ir", "fmt", str(MLP)).output == ir.format(module)
    assert run("ir", "hash", str(MLP)).output.strip() == module.hash()


def test_fmt_in_place_is_canonical(tmp_path):
    target = tmp_path / "m.dtm"
    target.write_text(MLP.read_text())
    assert run("ir", "fmt", "-i", str(target)).exit_code == 0
    assert target.read_text() == ir.format(ir.parse(MLP.read_text()))


def test_error_report_names_file_line_col_code_and_points_at_the_column(tmp_path):
    bad = tmp_path / "bad.dtm"
    bad.write_text("dtm 1.0\nfunc @f(%x: f32[4]) -> (f32[4]) {\n  %y = add %x, %nope : f32[4]\n  return %y\n}\n")
    result = run("ir", "check", str(bad))
    assert result.exit_code == 1
    first, source, caret = result.output.splitlines()[:3]
    assert first.startswith(f"{bad}:3:16: E0201: ")
    assert source == "    %y = add %x, %nope : f32[4]"
    assert caret.index("^") == source.index("%nope")


def test_conformance_ir_runs_every_vector():
    result = run("conformance", "ir")
    assert result.exit_code == 0
    passed, failed = result.output.strip().splitlines()[-1].split(", ")
    assert failed == "0 failed" and int(passed.split()[0]) >= 88 + 40


def test_version_names_the_spec():
    assert "spec 1.1.3" in run("--version").output
