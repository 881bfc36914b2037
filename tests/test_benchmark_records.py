"""The benchmarks' records (benchmarks/record.py; issue 36: benchmark pages with plots made
by the benchmarks themselves): each committed record in docs/benchmarks/ is a plot its
benchmark draws from the record's own figures, and a benchmark run with --record writes
both. Nothing here times anything: matmul's figures are checked for shape, not speed."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "benchmarks"
sys.path.insert(0, str(ROOT / "benchmarks"))

import record  # noqa: E402  (benchmarks/record.py)

SVG = "{http://www.w3.org/2000/svg}"
KEYS = {"benchmark", "name", "command", "date", "commit", "machine", "about", "figures"}


def texts(svg: Path) -> list[str]:
    """Every text of an SVG plot (titles, labels, ticks, the values written on bars), in order."""
    return [t.text or "" for t in ET.parse(svg).getroot().iter(f"{SVG}text")]


def committed() -> list[Path]:
    return sorted(RECORDS.glob("*.json"))


def test_the_benchmarks_keep_records():
    names = {p.stem for p in committed()}
    assert {"matmul", "gpt2", "train_char", "collectives", "control_plane"} <= names, names


@pytest.mark.parametrize("path", committed(), ids=lambda p: p.stem)
def test_a_committed_plot_is_drawn_from_its_figures(path, tmp_path):
    """The committed SVG holds the same texts (every title, tick and written value) as the
    plot its benchmark's draw() makes now from the committed JSON."""
    data = json.loads(path.read_text(encoding="utf-8"))
    assert KEYS <= set(data), f"{path.name} lacks {KEYS - set(data)}"
    assert data["name"] == path.stem and data["command"].startswith(f"python benchmarks/{data['benchmark']}.py")
    assert data["machine"]["cores"] >= 1 and data["about"]
    drawn = tmp_path / f"{path.stem}.svg"
    record.plot(data, drawn, __import__(data["benchmark"]).draw)
    got, kept = texts(drawn), texts(path.with_suffix(".svg"))
    assert got == kept, f"{path.with_suffix('.svg').name} was not drawn from {path.name}: run python benchmarks/record.py"
    assert data["name"] in " ".join(got)


def test_a_benchmark_run_records_its_figures_and_plot(tmp_path, monkeypatch, capsys):
    """matmul run with --record (in this process: it compiles its kernels, starts nothing):
    its JSON holds a rate per library and size, its plot a line per library."""
    import matmul

    monkeypatch.setattr(sys, "argv", ["matmul.py", "--sizes", "32", "64", "--budget", "0.01", "--record", str(tmp_path)])
    matmul.main()
    data = json.loads((tmp_path / "matmul.json").read_text(encoding="utf-8"))
    assert data["command"] == f"python benchmarks/matmul.py --sizes 32 64 --budget 0.01 --record {tmp_path}"
    assert data["about"].startswith("Matrix product throughput")
    series = data["figures"]["gflops"]
    assert set(series) == {"dtm", "numpy", "torch"}
    for points in series.values():
        assert [n for n, _ in points] == [32, 64] and all(rate > 0 for _, rate in points)
    words = texts(tmp_path / "matmul.svg")
    assert {"DTM cpu", "numpy", "torch", "square f32 matmul, 2 threads"} <= set(words), words
    assert "recorded:" in capsys.readouterr().out


def test_redraw_rewrites_every_plot(tmp_path):
    """`python benchmarks/record.py DIR` draws each record's plot again from its JSON."""
    for path in committed()[:1]:
        (tmp_path / path.name).write_bytes(path.read_bytes())
    assert [p.name for p in record.redraw(tmp_path)] == [p.with_suffix(".svg").name for p in committed()[:1]]
    assert all((tmp_path / p.with_suffix(".svg").name).stat().st_size > 0 for p in committed()[:1])
