"""A memory quota per process (issue 31): DTM_MEMORY_QUOTA, or `dtm launch --memory-quota`
for every rank. A new tensor or a program's memory that would take the process past it is
refused before it is allocated (E0811, naming the quota, what was asked for and what is in
use); what fits runs."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

SCRIPT = r'''
import numpy as np
import dtm
from dtm.runtime.host import resident_bytes

ones = dtm.ones(30_000_000)                  # 120 MB: fits
assert ones.sum().item() == 30_000_000
try:
    (ones * 2.0).realize()                   # its 120 MB result would not
    raise SystemExit("the program ran past the quota")
except dtm.DTMError as e:
    assert e.code is dtm.ErrorCode.MEMORY_QUOTA_EXCEEDED, e
    assert "quota of 250.0 MiB" in e.message and "needs 114.4 MiB" in e.message, e.message
held = resident_bytes()
try:
    dtm.zeros(100_000_000)                   # 400 MB
    raise SystemExit("a tensor past the quota was made")
except dtm.DTMError as e:
    assert e.code is dtm.ErrorCode.MEMORY_QUOTA_EXCEEDED, e
assert resident_bytes() < held + (16 << 20)  # refused before it was allocated
print("ok")
'''


def test_a_process_under_a_quota_is_refused_what_passes_it():
    env = dict(os.environ, DTM_MEMORY_QUOTA="250M")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_launch_gives_every_rank_the_quota(tmp_path):
    job = tmp_path / "job.py"
    job.write_text("import dtm\ndtm.zeros(100_000_000)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), DTM_HOST="127.0.0.1")
    env.pop("DTM_MEMORY_QUOTA", None)
    out = subprocess.run([sys.executable, "-m", "dtm.cli", "launch", "-n", "2", "--memory-quota", "200M", str(job)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "E0811" in out.stdout + out.stderr and "quota of 200.0 MiB" in out.stdout + out.stderr


@pytest.mark.parametrize("text, want", [("2G", 2 << 30), ("512M", 512 << 20), ("1.5GiB", 3 << 29), ("1000", 1000)])
def test_sizes_parse_as_people_write_them(text, want):
    from dtm.runtime.host import parse_bytes

    assert parse_bytes(text, "x") == want


def test_a_bad_size_is_a_clear_error():
    import dtm
    from dtm.runtime.host import parse_bytes

    with pytest.raises(dtm.DTMError) as e:
        parse_bytes("lots", "--memory-quota")
    assert e.value.code is dtm.ErrorCode.ATTRIBUTE_VALUE and "--memory-quota" in e.value.message
