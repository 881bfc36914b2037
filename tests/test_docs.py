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
# A ```python fence, its info string after the language (`no-run`, `title="mymodule.py"`) and its code.
PYTHON_BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```[ \t]*$", re.S | re.M)
# The blocks a guide marks ```python no-run, by page: each starts or joins a job of several
# processes (see the test's docstring). A new one is a decision, made here.
NO_RUN = {"checkpoints": 1, "meshes": 1, "store": 1}


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
    module that worker processes import by name). Blocks marked ```python no-run``` are
    read, not run: each is a rank's program of a job of several processes (`dtm launch
    -n 4`: the collectives between processes, the mesh's store, an elastic training loop),
    which one process cannot be; the tests of dtm launch, the mesh's store and
    dtm.elastic run those with real processes."""
    blocks = python_blocks(ROOT / "docs" / "guide" / f"{page}.md")
    assert sum("no-run" in info.split() for info, _ in blocks) == NO_RUN.get(page, 0)
    script = []
    for info, code in blocks:
        if "no-run" in info.split():
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
