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
import queue
import re
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
PORT = 6391  # in this namespace of our own: nothing else listens there
ADDRESS = f"127.0.0.1:{PORT}"
JOB_TIMEOUT_S = 150


def ray_cli(*args: str) -> None:
    subprocess.run([str(BIN / "ray"), *args], check=True, capture_output=True, timeout=120)


class Launch:
    """A `dtm launch --ray` whose output lines are read on a thread."""

    def __init__(self, args: list[str], cwd: str):
        env = dict(os.environ, DTM_HEARTBEAT_MS="200", DTM_HEARTBEAT_TIMEOUT_MS="3000")
        self.p = subprocess.Popen([str(BIN / "dtm"), "launch", "--ray", ADDRESS, *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
        self.lines: list[str] = []
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.lines.append(line)
            self.q.put(line)

    def wait_for(self, pattern: str, timeout: float = 90) -> re.Match:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            while seen < len(self.lines):
                m = re.search(pattern, self.lines[seen])
                seen += 1
                if m:
                    return m
            try:
                self.q.get(timeout=0.2)
            except queue.Empty:
                if self.p.poll() is not None:
                    break
        raise RuntimeError(f"no line matching {pattern!r}:\n" + "".join(self.lines[-40:]))

    def finish(self) -> dict:
        try:
            code = self.p.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.p.kill()
            code = None
        time.sleep(0.2)  # the reader's last lines
        return {"code": code, "output": "".join(self.lines)}


def kill_actor(ray, launch: Launch, label: str) -> str:
    """Kill the Ray actor of rank `label` ("rank 1") of `launch`, by its name and namespace."""
    m = launch.wait_for(rf"dtm launch: {label} runs on Ray actor '([\w-]+)' \(namespace ([\w-]+)\)", 5)
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

        result["spread"] = Launch(["--spread", "-n", "2", job], str(out)).finish()

        killed = Launch(["-n", "2", job, "--steps", "200", "--every", "0.2"], str(out))
        killed.wait_for(r"\[rank 1\] step 3 ")
        result["killed_actor"] = kill_actor(ray, killed, "rank 1")
        result["killed"] = killed.finish()

        train = str(HERE / "elastic_train.py")
        elastic = Launch(["-n", "2", "--axes", "dp=2", "--elastic", "1:4", train, "--steps", "16", "--sleep", "0.3",
                          "--out", str(out / "got.json")], str(out))
        elastic.wait_for(r"\[rank 1\] epoch 1 rank 1/2 .* step 3 ")
        kill_actor(ray, elastic, "rank 1")
        result["elastic"] = elastic.finish()
    finally:
        (out / "result.json").write_text(json.dumps(result))
        ray.shutdown()
        subprocess.run([str(BIN / "ray"), "stop", "--force"], capture_output=True, timeout=60)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
