"""Where `dtm top` finds the local job: whoever serves a coordinator's metrics writes a small
JSON file into a per-user runtime directory, naming its metrics address; it removes the
file when it stops. A file whose process is gone (killed before it could remove it) is stale:
`find` ignores and deletes it. It also holds the cluster token in hex, for `dtm cancel` to
prove itself to the coordinator: the directory is the user's alone (0700), the file too (0600).

    $XDG_RUNTIME_DIR/dtm/job-PID.json   (else /tmp/dtm-UID/)
    {"pid": 123, "metrics": "127.0.0.1:9464", "coordinator": "127.0.0.1:29500",
     "world_size": 2, "started": 1700000000.0, "token": "6b65..."}
"""

from __future__ import annotations

import json
import os
import tempfile
import time

MAX_FILE_BYTES = 64 << 10  # a job file is a few hundred bytes; anything larger is not ours


def runtime_dir() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = os.path.join(base, "dtm") if base else os.path.join(tempfile.gettempdir(), f"dtm-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def write(metrics: str, coordinator: str, world_size: int, token: bytes = b"") -> str:
    """Write this process's job file atomically (temporary name, then rename); its path."""
    d = runtime_dir()
    path = os.path.join(d, f"job-{os.getpid()}.json")
    body = {"pid": os.getpid(), "metrics": metrics, "coordinator": coordinator, "world_size": world_size,
            "started": time.time(), "token": token.hex()}
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".job-")
    with os.fdopen(fd, "w") as f:
        json.dump(body, f)
    os.replace(tmp, path)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process took the pid: not our job
        return False
    return True


def find() -> list[dict]:
    """The live local jobs, newest first."""
    jobs = []
    d = runtime_dir()
    for name in os.listdir(d):
        if not (name.startswith("job-") and name.endswith(".json")):
            continue
        path = os.path.join(d, name)
        try:
            with open(path, "rb") as f:
                job = json.loads(f.read(MAX_FILE_BYTES))
            pid = int(job["pid"])
            str(job["metrics"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(pid):
            jobs.append(job)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass
    return sorted(jobs, key=lambda j: -float(j.get("started", 0)))
