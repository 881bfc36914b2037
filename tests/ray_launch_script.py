"""Run by tests/test_ray_launch.py inside a loopback-only network namespace:
`python ray_launch_script.py DIR`. Starts a local Ray cluster of two nodes (a head and a
worker node, `ray start`, 2 CPUs each), then three `dtm launch --ray` jobs against it:

- "spread": 2 ranks with --spread (one per node) all-reduce 3 times;
- "killed": 2 ranks all-reduce every 0.2 s; once rank 1 printed step 3, its actor is killed
  (`ray.kill`, found by its name in the namespace the launcher printed);
- "elastic": tests/elastic_train.py on DP=2 with --elastic 1:4; once rank 1 trained step 3,
  its actor is killed: the job shrinks to DP=1 and the launcher's replacement joins (DP=2).

Each job's exit status and output go to DIR/result.json for the test to judge; the Ray
cluster is stopped whatever happens."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from launched import Launched

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
PORT = 6391  # in this namespace of our own: nothing else listens there
ADDRESS = f"127.0.0.1:{PORT}"
JOB_TIMEOUT_S = 150


def ray_cli(*args: str) -> None:
    subprocess.run([str(BIN / "ray"), *args], check=True, capture_output=True, timeout=120)


def launch(args: list[str], cwd: str) -> Launched:
    """`dtm launch --ray` against this script's Ray cluster."""
    env = dict(os.environ, DTM_HEARTBEAT_MS="200", DTM_HEARTBEAT_TIMEOUT_MS="3000")
    return Launched([str(BIN / "dtm"), "launch", "--ray", ADDRESS, *args], env, cwd)


def finished(job: Launched) -> dict:
    """Its exit status (None: it ran past JOB_TIMEOUT_S and was killed) and its output."""
    try:
        code = job.finish(JOB_TIMEOUT_S)
    except AssertionError:
        code = None
    return {"code": code, "output": "".join(job.lines)}


def kill_actor(ray, job: Launched, label: str) -> str:
    """Kill the Ray actor of rank `label` ("rank 1") of `job`, by its name and namespace."""
    m = job.match(rf"dtm launch: {label} runs on Ray actor '([\w-]+)' \(namespace ([\w-]+)\)", 5)
    ray.kill(ray.get_actor(m.group(1), namespace=m.group(2)))
    return m.group(1)


def main(out: Path) -> None:
    # Ray's token authentication, one token for every node, driver and launcher here
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    import ray

    result: dict = {}
    ray_cli("start", "--head", f"--port={PORT}", "--num-cpus=2", "--include-dashboard=false",
            "--disable-usage-stats")
    try:
        ray_cli("start", f"--address={ADDRESS}", "--num-cpus=2")
        ray.init(address=ADDRESS, log_to_driver=False)
        deadline = time.monotonic() + 60
        while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        job = str(HERE / "ray_launch_job.py")

        result["spread"] = finished(launch(["--spread", "-n", "2", job], str(out)))

        killed = launch(["-n", "2", job, "--steps", "200", "--every", "0.2"], str(out))
        killed.match(r"\[rank 1\] step 3 ", 90)
        result["killed_actor"] = kill_actor(ray, killed, "rank 1")
        result["killed"] = finished(killed)

        train = str(HERE / "elastic_train.py")
        elastic = launch(["-n", "2", "--axes", "dp=2", "--elastic", "1:4", train, "--steps", "16", "--sleep", "0.3",
                          "--out", str(out / "got.json")], str(out))
        elastic.match(r"\[rank 1\] epoch 1 rank 1/2 .* step 3 ", 90)
        kill_actor(ray, elastic, "rank 1")
        result["elastic"] = finished(elastic)
    finally:
        (out / "result.json").write_text(json.dumps(result))
        ray.shutdown()
        subprocess.run([str(BIN / "ray"), "stop", "--force"], capture_output=True, timeout=60)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
