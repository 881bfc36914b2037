"""The README and the guides under docs/: the Python examples of the README and of each guide
(docs/guide/*.md) run, in order, as a newcomer would paste them (so the pages cannot drift
from the code), and every relative link in them points at a file of the repository."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
GUIDES = sorted((ROOT / "docs" / "guide").glob("*.md"))
# A ```python fence, its info string after the language (`title="mymodule.py"`, `launch="-n 4"`,
# `excerpt="tests/elastic_train.py"`) and its code.
PYTHON_BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```[ \t]*$", re.S | re.M)
# A block that is a job of several processes, run by tests/test_docs_launch.py under `dtm launch ARGS`.
LAUNCH = re.compile(r'launch="([^"]*)"')
# A block whose lines are a file's of the repository that the tests run (checked below).
EXCERPT = re.compile(r'excerpt="([^"]*)"')
COMMENT = re.compile(r"\s*#.*$")  # (the excerpts' code has no '#' inside a string)


def python_blocks(page: pathlib.Path) -> list[tuple[str, str]]:
    """Each ```python block of `page` as (its info string's words after the language, its code)."""
    return [(info.strip(), code) for info, code in PYTHON_BLOCK.findall(page.read_text(encoding="utf-8"))]


def test_the_readme_examples_run(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)
    assert len(blocks) >= 4  # one device, L0, L2, L3
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks), encoding="utf-8")
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "runs" / "a").is_dir() and (tmp_path / "runs" / "data").is_dir()


@pytest.mark.parametrize("page", [g.stem for g in GUIDES if python_blocks(g)])
def test_the_guide_examples_run(page, tmp_path):
    """A guide's ```python blocks run in order as one script, in a fresh directory (where
    `examples/` is the repository's, as in a checkout, and the store is a memory:// one of
    the script's own: tests/conftest.py's DTM_STORE), and end without an error; what a
    block's comments show as a result it asserts itself. A block whose info string names a
    file (```python title="mymodule.py"```) is that file, written beside the script (a
    module that worker processes import by name). A ```python launch="ARGS"``` block is a
    rank's program of a job of several processes, which one process cannot be:
    tests/test_docs_launch.py runs it under `dtm launch ARGS`; an ```python excerpt="FILE"```
    block is lines of a file the tests run (test_an_excerpt_is_its_files_lines)."""
    blocks = python_blocks(ROOT / "docs" / "guide" / f"{page}.md")
    assert not [info for info, _ in blocks if "no-run" in info.split()], "every example runs: launch= or excerpt="
    script = []
    for info, code in blocks:
        if LAUNCH.search(info) or EXCERPT.search(info):
            continue
        if (named := re.search(r'title="([^"]+)"', info)) is not None:
            (tmp_path / named.group(1)).write_text(code, encoding="utf-8")
        else:
            script.append(code)
    assert script, f"{page}.md has no block that runs"
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / f"guide_{page}.py").write_text("\n".join(script), encoding="utf-8")
    out = subprocess.run([sys.executable, f"guide_{page}.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, f"docs/guide/{page}.md:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


EXCERPTS = [(g.stem, m.group(1), code) for g in GUIDES for info, code in python_blocks(g)
            if (m := EXCERPT.search(info))]


@pytest.mark.parametrize("page, path, code", EXCERPTS, ids=[f"{p}:{f}" for p, f, _ in EXCERPTS])
def test_an_excerpt_is_its_files_lines(page, path, code):
    """Each line of an excerpt block, its comment aside, is a line of the file it names (so
    the guide cannot drift from a program the tests run), and the file's tests exist."""
    lines = {COMMENT.sub("", line).strip() for line in (ROOT / path).read_text(encoding="utf-8").splitlines()}
    drifted = [line for line in code.splitlines() if COMMENT.sub("", line).strip() not in lines]
    assert drifted == [], f"docs/guide/{page}.md: lines not in {path}"
    assert any(pathlib.Path(path).name in t.read_text(encoding="utf-8") for t in (ROOT / "tests").glob("test_*.py"))


def test_every_relative_link_points_at_a_file():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # (not links inside code)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []
