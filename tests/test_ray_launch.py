"""Ranks on Ray actors (`dtm launch --ray`, issue 33): a Ray cluster of a head and a worker
node runs in a loopback-only network namespace (`unshare -n`), in a subprocess running
tests/ray_launch_script.py, which launches three jobs against it (one rank per node with
--spread; a job whose rank's actor is killed with `ray.kill`; an elastic training job whose
rank's actor is killed and replaced). This test judges what they printed: every all_reduce
against numpy, the lost rank named as a dead actor, and every training step's loss against
the same steps on one process. The option checks made before Ray starts run in this process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dtm.cli import main
from hosts import LOOPBACK_ONLY, loopback_only_missing

HERE = Path(__file__).resolve().parent
RTOL = 2e-4  # as tests/test_elastic.py: the mesh changes how sums are split
STEPS = 16   # the elastic job's (as in ray_launch_script.py)


def test_the_ray_options_are_checked_before_ray_starts():
    runner = CliRunner()
    r = runner.invoke(main, ["launch", "-n", "2", "--ray", "job.py"])
    assert r.exit_code == 2 and "is not a Ray address" in r.output, r.output
    r = runner.invoke(main, ["launch", "-n", "2", "--spread", "job.py"])
    assert r.exit_code == 2 and "only with --ray" in r.output, r.output


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory):
    """Run the script once (about 40 s); the tests below read what it left."""
    pytest.importorskip("ray", reason="dtm launch --ray needs ray: pip install 'dtm[ray]'")
    why = loopback_only_missing()
    if why:
        pytest.skip(f"Ray runs only in a loopback-only namespace: {why}")
    out = tmp_path_factory.mktemp("ray_launch")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTM_", "RAY_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]), RAY_USAGE_STATS_ENABLED="0")
    try:
        r = subprocess.run([*LOOPBACK_ONLY, sys.executable, str(HERE / "ray_launch_script.py"), str(out)], env=env,
                           cwd=str(out), capture_output=True, timeout=420)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the Ray script ran past 420 s; stderr:\n{(e.stderr or b'').decode()[-4000:]}")
    assert r.returncode == 0, r.stderr.decode()[-4000:]
    return out, json.loads((out / "result.json").read_text())


def _sums(output: str) -> dict[tuple[int, int], list[float]]:
    """(rank, step) -> the sum that rank printed for that step."""
    return {(int(m[1]), int(m[2])): json.loads(m[3])
            for m in re.finditer(r"^\[rank (\d+)\] step (\d+) sum (\[.*\])$", output, re.M)}


def _want(step: int, world: int = 2) -> list[float]:
    return (np.arange(4, dtype=np.float32) * sum(range(1, world + 1)) + world * step).tolist()


def test_one_rank_per_node_with_spread(ray_run):
    _, result = ray_run
    job = result["spread"]
    assert job["code"] == 0, job["output"][-3000:]
    sums = _sums(job["output"])
    assert sums == {(k, s): _want(s) for k in range(2) for s in range(3)}, job["output"][-3000:]
    nodes = re.findall(r"dtm launch: rank \d runs on Ray actor .* on node (\w+)", job["output"])
    assert len(nodes) == 2 and nodes[0] != nodes[1], job["output"]  # STRICT_SPREAD: two Ray nodes
    for k in range(2):  # stderr comes back too, with the rank's prefix
        assert f"[rank {k}] rank {k} of 2 started" in job["output"]


def test_a_killed_actor_is_a_lost_rank(ray_run):
    _, result = ray_run
    job = result["killed"]
    assert job["code"] == 128 + 9, job["output"][-3000:]  # the lost rank's status: killed (SIGKILL)
    assert re.search(r"rank 1 failed first \(its Ray actor died: .*the coordinator lost rank 1", job["output"]), \
        job["output"][-3000:]
    assert "ended the other ranks [0]" in job["output"]
    sums = _sums(job["output"])
    assert len(sums) >= 8 and all(got == _want(s) for (_, s), got in sums.items()), job["output"][-3000:]


def test_an_elastic_job_replaces_a_killed_actor(ray_run, tmp_path):
    out, result = ray_run
    job = result["elastic"]
    assert job["code"] == 0, job["output"][-4000:]
    text = job["output"]
    assert "epoch 2: {'dp': 1} (0->0); epoch 3: {'dp': 2} (0->0, new->1)" in text, text[-3000:]
    assert re.search(r"\[replacement 1\] epoch 3 rank 1/2 .* step \d+ loss", text), text[-3000:]  # it trained
    want_file = tmp_path / "want.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTM_")}
    subprocess.run([sys.executable, str(HERE / "elastic_train.py"), "--steps", str(STEPS), "--out", str(want_file)],
                   check=True, timeout=300, capture_output=True, env=env)
    want = json.loads(want_file.read_text())["losses"]
    got = json.loads((out / "got.json").read_text())["losses"]
    assert sorted(got, key=int) == [str(i) for i in range(STEPS)]
    bad = {k: (got[k], want[k]) for k in want if not abs(got[k] - want[k]) <= RTOL * abs(want[k])}
    assert not bad, f"losses differ from the single-process run: {bad}"
