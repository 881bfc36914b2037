"""The cluster examples (examples/cluster/: a Kubernetes indexed Job with its headless
Service, and a Slurm batch script) parsed and checked without a cluster: their names,
sizes and variables agree with each other, with the mesh they ask for and with the flags of
the scripts they run; and the environment each rank would get makes a valid DTM rank
(dtm.cluster.env.rank_env), with one coordinator that rank 0 runs."""

from __future__ import annotations

import math
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from dtm.cluster.env import parse_axes, rank_env
from dtm.cluster.launchers import with_launcher

yaml = pytest.importorskip("yaml", reason="the manifest check reads YAML: pip install -e '.[test]'")

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "cluster"
INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def _flags(script: str) -> str:
    """The --help text of an example script (its flags)."""
    return subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True,
                          check=True, timeout=60).stdout


def _runs(command: str) -> list[tuple[str, list[str]]]:
    """The example scripts a shell command runs, with their flags."""
    out = []
    for line in command.splitlines():
        words = shlex.split(line.replace(";", " ; "))
        for i, w in enumerate(words):
            if w.startswith("examples/") and w.endswith(".py"):
                out.append((w, [x.split("=")[0] for x in words[i + 1:] if x.startswith("--")]))
    return out


def _check_runs(command: str) -> None:
    runs = _runs(command)
    assert [s for s, _ in runs] == ["examples/demo_corpus.py", "examples/demo_train.py"], runs
    for script, flags in runs:
        help_text = _flags(script)
        assert all(f in help_text for f in flags), (script, flags)


def test_kubernetes_indexed_job():
    service, job = list(yaml.safe_load_all((CLUSTER / "demo-job.yaml").read_text()))
    assert service["kind"] == "Service" and job["kind"] == "Job"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert pod["subdomain"] == service["metadata"]["name"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["DTM_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == INDEX
    assert "secretKeyRef" in env["DTM_TOKEN"]["valueFrom"]
    world = int(env["DTM_WORLD_SIZE"]["value"])
    assert world == spec["completions"] == math.prod(n for _, n in parse_axes(env["DTM_MESH_AXES"]["value"]))
    host, _, port = env["DTM_COORDINATOR"]["value"].rpartition(":")
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"  # pod 0's DNS name
    _check_runs(container["args"][0])
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert {v["name"] for v in pod["volumes"]} == set(mounts) and "/work" in container["args"][0]
    ranks = [rank_env({"DTM_RANK": str(i), "DTM_WORLD_SIZE": str(world), "DTM_COORDINATOR": f"{host}:{port}",
                       "DTM_TOKEN": "t", "DTM_MESH_AXES": env["DTM_MESH_AXES"]["value"]}) for i in range(world)]
    assert [r.rank for r in ranks] == list(range(world)) and [r.hosts_coordinator for r in ranks].count(True) == 1


def test_slurm_batch_script():
    text = (CLUSTER / "demo.sbatch").read_text()
    if shutil.which("bash"):
        subprocess.run(["bash", "-n", str(CLUSTER / "demo.sbatch")], check=True, timeout=30)
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))
    world = int(directives["nodes"]) * int(directives["ntasks-per-node"])
    axes = re.search(r"^export DTM_MESH_AXES=(\S+)", text, re.M)[1]
    assert world == math.prod(n for _, n in parse_axes(axes))
    assert re.search(r"^export DTM_TOKEN\b", text, re.M), "across hosts the ranks need one token"
    srun = [line for line in text.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1
    _check_runs("\n".join(line for line in text.splitlines() if line.startswith(("python ", "srun "))))
    # what dtm.init() makes of each task's variables
    ranks = [rank_env(with_launcher({"SLURM_PROCID": str(i), "SLURM_NTASKS": str(world), "SLURM_JOB_ID": "4242",
                                     "SLURM_JOB_NODELIST": "node[07-08]", "DTM_TOKEN": "t",
                                     "DTM_MESH_AXES": axes})) for i in range(world)]
    assert {r.coordinator for r in ranks} == {("node07", 20000 + 4242)}
    assert [r.rank for r in ranks] == list(range(world)) and [r.hosts_coordinator for r in ranks].count(True) == 1
