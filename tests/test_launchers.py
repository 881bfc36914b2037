"""Ranks started by other launchers (dtm/cluster/launchers.py, spec 9.6.1): the variables
of torchrun, Open MPI and Slurm become DTM's; a real job under torchrun itself (in a
loopback-only network namespace: its agent probes the machine's interfaces otherwise) and
one with Slurm's variables set by hand, each checked against numpy."""

from __future__ import annotations

import json
import os
import pathlib
import random
import socket
import subprocess
import sys

import numpy as np
import pytest

from dtm.cluster.env import rank_env
from dtm.cluster.launchers import SLURM_PORT_BASE, first_host, launcher_env, with_launcher
from dtm.errors import DTMError, ErrorCode as E
from hosts import LOOPBACK_ONLY, loopback_only_missing

HERE = pathlib.Path(__file__).resolve().parent
JOB = str(HERE / "launcher_job.py")
TIMEOUT_S = 120


def test_torchrun_variables():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500",
           "TORCHELASTIC_RUN_ID": "run-7"}
    got = rank_env(with_launcher(env))
    assert (got.rank, got.world_size, got.coordinator) == (1, 2, ("localhost", 29501))
    assert got.token == b"torchrun:run-7:29501" and not got.external
    assert launcher_env({**env, "DTM_COORDINATOR": "h:1"}) == {}  # DTM's own variables win


def test_open_mpi_and_slurm_variables():
    mpi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
           "DTM_COORDINATOR_PORT": "4000"}
    assert launcher_env(mpi)["DTM_COORDINATOR"] == "127.0.0.1:4000" and launcher_env(mpi)["DTM_RANK"] == "3"
    slurm = {"SLURM_PROCID": "2", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "gpu[07-09,12],cpu1",
             "SLURM_JOB_ID": "123456", "DTM_TOKEN": "secret"}
    assert launcher_env(slurm) == {"DTM_RANK": "2", "DTM_WORLD_SIZE": "8",
                                   "DTM_COORDINATOR": f"gpu07:{SLURM_PORT_BASE + 3456}"}
    # torchrun inside a Slurm allocation: torchrun's ranks
    both = {**slurm, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert launcher_env(both)["DTM_COORDINATOR"] == "10.0.0.1:29501"
    assert launcher_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == {}  # one process: no mesh
    assert [first_host(t) for t in ("n[001-004]", "a,b", "x[1-2]y[5-6]", "")] == ["n001", "a", "x1y5", ""]


def test_launcher_variables_that_disagree_are_refused_before_anything_runs():
    with pytest.raises(DTMError) as e:
        launcher_env({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"})
    assert e.value.code is E.NOT_INITIALIZED and "RANK='2'" in e.value.message and "WORLD_SIZE=2" in e.value.message
    with pytest.raises(DTMError, match="needs DTM_TOKEN"):  # a job id is no secret across hosts
        launcher_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"})
    with pytest.raises(DTMError, match="coordinator's port"):
        launcher_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "localhost"})


def _clean_env(**extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("DTM_", "SLURM_", "OMPI_")) and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                                           "MASTER_PORT")}
    return dict(keep, **extra)


def _check(lines: list[str], world: int) -> None:
    got = sorted((json.loads(line) for line in lines if line.startswith("{")), key=lambda d: d["rank"])
    want = (np.arange(4, dtype=np.float32) * sum(range(1, world + 1))).tolist()
    assert [(g["rank"], g["world"], g["sum"]) for g in got] == [(r, world, want) for r in range(world)], lines


def _free_slurm_job_id() -> int:
    """A job id whose port (SLURM_PORT_BASE + id mod 10000) is free now."""
    for _ in range(50):
        job = random.randrange(1, 10**6)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", SLURM_PORT_BASE + job % 10000))
                return job
            except OSError:
                continue
    pytest.skip("no free port for the Slurm job found")


def _run_all(envs: list[dict[str, str]]) -> tuple[list[int], list[str]]:
    """The job, one process per environment, all at once: their exit codes and outputs."""
    procs = [subprocess.Popen([sys.executable, JOB], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) for env in envs]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=TIMEOUT_S)[0])
        finally:
            p.kill()
    return [p.returncode for p in procs], outs


def test_a_job_with_slurms_variables():
    job = str(_free_slurm_job_id())
    codes, outs = _run_all([_clean_env(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_JOB_ID=job,
                                       SLURM_JOB_NODELIST="localhost") for r in range(2)])
    assert codes == [0, 0], outs
    _check("".join(outs).splitlines(), 2)


def test_a_job_under_torchrun():
    torchrun = pathlib.Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun is not installed (pip install -e '.[test]')")
    why = loopback_only_missing()
    if why:
        pytest.skip(f"torchrun runs only in a loopback-only namespace here: {why}")
    r = subprocess.run([*LOOPBACK_ONLY, str(torchrun), "--standalone", "--nnodes", "1", "--nproc-per-node", "3", JOB], capture_output=True,
                       text=True, timeout=TIMEOUT_S, env=_clean_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _check(r.stdout.splitlines(), 3)


def test_two_ranks_with_the_same_rank():
    """torchrun's variables set by hand, with RANK 1 given to two processes: the coordinator
    admits one and refuses the other with E1004 before it joins (no data moves to or from
    it); the mesh of ranks 0 and 1 runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # DTM's coordinator takes MASTER_PORT + 1
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port - 1), "TORCHELASTIC_RUN_ID": "t",
           "LINGER": "5"}  # (the mesh stays while the second RANK 1 comes: its refusal, not a coordinator gone)
    codes, outs = _run_all([_clean_env(RANK=r, **env) for r in ("0", "1", "1")])
    refused = [o for code, o in zip(codes, outs) if code != 0]
    assert len(refused) == 1 and "E1004" in refused[0] and "rank 1" in refused[0], outs
    _check("".join(o for code, o in zip(codes, outs) if code == 0).splitlines(), 2)
