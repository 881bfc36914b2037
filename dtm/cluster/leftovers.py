"""Directories a rank keeps on its host for the mesh's lifetime (the parts of the mesh's
store, dtm/store/mesh_store.py), and their removal when the rank was killed before it
removed its own.

    claim(path)                          # the rank that made `path`: it is this process's
    remove_orphans(scratch_base())       # dtm launch as its ranks end, and dtm.init()

A rank removes its directory when it leaves, and a survivor on its host removes a lost
rank's when it leaves. When no survivor on the host knew of the loss (the whole host's ranks
were killed, or the survivors ended first), the directory would stay until the machine
restarts, holding memory in /dev/shm; so each claimed directory records its owner's process
id, and `remove_orphans` removes those whose owner no longer runs.
"""

from __future__ import annotations

import os
import shutil
import tempfile

OWNER = "owner"     # in a claimed directory: "PID PID-NAMESPACE" of the process that claimed it
PREFIX = "dtm"      # claimed directories lie one level inside base/dtm*/


def scratch_base() -> str:
    """Where the ranks of this host keep such directories: $DTM_MESH_STORE, else /dev/shm
    when it is writable (memory, as Ray's object store), else the temporary directory."""
    return os.environ.get("DTM_MESH_STORE") or ("/dev/shm" if os.access("/dev/shm", os.W_OK)
                                                else tempfile.gettempdir())


def _pid_namespace() -> str:
    """This process's PID namespace: a process id means the same process only within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def claim(path: str) -> None:
    """Record this process as the owner of directory `path`. Written to a temporary name and
    renamed, so that a reader never sees half of it; not fsynced: the record needs to
    outlive this process, not the machine (the directory is in memory, or scratch)."""
    tmp = os.path.join(path, f".{OWNER}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()} {_pid_namespace()}\n")
    os.replace(tmp, os.path.join(path, OWNER))


def _orphaned(path: str, namespace: str) -> bool:
    """Whether `path` was claimed by a process of this PID namespace that no longer runs. A
    directory without a readable owner, or claimed in another namespace, is not judged; a
    process id reused since reads as running, so its directory stays (never a live one goes)."""
    try:
        with open(os.path.join(path, OWNER)) as f:
            pid, ns = f.read().split()
    except (OSError, ValueError):
        return False
    if ns != namespace or not pid.isdigit() or int(pid) <= 0:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: it runs
        pass
    return False


def remove_orphans(base: str) -> list[str]:
    """Remove each claimed directory one level inside `base`/dtm*/ whose owner no longer
    runs, and a dtm* directory that this leaves empty. The paths removed."""
    namespace = _pid_namespace()
    try:
        groups = [os.path.join(base, n) for n in os.listdir(base) if n.startswith(PREFIX)]
    except OSError:  # no such base: nothing was left there
        return []
    removed = []
    for group in groups:
        try:
            paths = [os.path.join(group, n) for n in os.listdir(group)]
        except OSError:  # a segment, not a directory, or removed meanwhile
            continue
        gone = [p for p in paths if _orphaned(p, namespace)]
        for path in gone:
            shutil.rmtree(path, ignore_errors=True)
        removed += gone
        if gone:
            try:
                os.rmdir(group)  # the last part of that mesh on this host
            except OSError:  # a live rank's part is still in it
                pass
    return removed
