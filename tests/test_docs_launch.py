"""The guides' jobs of several processes (a ```python launch="ARGS"``` block, tests/test_docs.py):
each runs as a newcomer would run it, `dtm launch ARGS job.py` on this host, and every rank
ends without an error (what a block's comments show as a result, it asserts itself)."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from test_docs import GUIDES, LAUNCH, python_blocks

JOBS = [(g.stem, m.group(1), code) for g in GUIDES for info, code in python_blocks(g) if (m := LAUNCH.search(info))]


def test_the_guides_have_jobs():
    assert {page for page, _, _ in JOBS} >= {"meshes", "store"}


@pytest.mark.parametrize("page, args, code", JOBS, ids=[f"{p}:{a}" for p, a, _ in JOBS])
def test_a_guide_job_runs_under_dtm_launch(page, args, code, tmp_path):
    (tmp_path / "job.py").write_text(code, encoding="utf-8")
    cmd = [sys.executable, "-m", "dtm.cli", "launch", *shlex.split(args), "--join-timeout", "60", "job.py"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, f"docs/guide/{page}.md, dtm launch {args}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
