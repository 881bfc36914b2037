"""Directories a rank keeps on its host for the mesh's lifetime (the parts of the mesh's
store, dtm/store/mesh_store.py), and their removal when the rank was killed before it
removed its own.

    claim(path)                          # the rank that made `path`: it is this process's
    remove_orphans(scratch_base())       # dtm launch as its ranks end, and dtm.init()
    remove_noted(run)                    # dtm launch: its own ranks' parts, wherever they lie

A rank removes its directory when it leaves, and a survivor on its host removes a lost
rank's when it leaves. When no survivor on the host knew of the loss (the whole host's ranks
were killed, or the survivors ended first), the directory would stay until the machine
restarts, holding memory in /dev/shm; so each claimed directory records its owner's process
id, and `remove_orphans` removes those whose owner no longer runs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

OWNER = "owner"     # in a claimed directory: "PID PID-NAMESPACE" of the process that claimed it
PREFIX = "dtm"      # claimed directories lie one level inside base/dtm*/
RUN_ENV = "DTM_LAUNCH_RUN"  # in a rank's environment: the directory of its `dtm launch` run
ELASTIC = "elastic"  # in a run's directory: a rank declared its job elastic (launch.declare_elastic)
PART = "part-"      # in a run's directory: a file naming a directory a rank of the run claimed


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


def _write(path: str, text: str) -> None:
    """Write file `path` to a temporary name and rename it, so that a reader never sees half
    of it; not fsynced: these records need to outlive their writer, not the machine."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def note(name: str, text: str) -> None:
    """Tell this rank's `dtm launch` something (file `name` of its run's directory holds
    `text`); nothing for a rank started otherwise."""
    run = os.environ.get(RUN_ENV)
    if not run:
        return
    try:
        _write(os.path.join(run, name), text)
    except FileNotFoundError:  # the launcher has ended (and removed its run): nobody to tell
        pass


def _noted(run: str, prefix: str) -> list[str]:
    """What the ranks of run directory `run` noted in the files whose names start with `prefix`."""
    try:
        names = [n for n in os.listdir(run) if n.startswith(prefix)]
    except OSError:  # no such run
        return []
    texts = []
    for name in names:
        with open(os.path.join(run, name)) as f:
            texts.append(f.read())
    return texts


def claim(path: str) -> None:
    """Record this process as the owner of directory `path`, and note the directory for this
    rank's launcher (`note`)."""
    path = os.path.abspath(path)
    _write(os.path.join(path, OWNER), f"{os.getpid()} {_pid_namespace()}\n")
    note(PART + hashlib.blake2b(path.encode(), digest_size=8).hexdigest(), path)


def _owner_runs(path: str, namespace: str) -> bool | None:
    """Whether the process that claimed `path` still runs; None when that cannot be judged
    (no readable owner, or one of another PID namespace). A process id reused since reads
    as running, so its directory stays (never a live one goes)."""
    try:
        with open(os.path.join(path, OWNER)) as f:
            pid, ns = f.read().split()
    except (OSError, ValueError):
        return None
    if ns != namespace or not pid.isdigit() or int(pid) <= 0:
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        pass
    return True


def remove_orphans(base: str) -> list[str]:
    """Remove each claimed directory one level inside `base`/dtm*/ whose owner no longer
    runs, and a dtm* directory that this leaves empty. The paths removed."""
    try:
        groups = [os.path.join(base, n) for n in os.listdir(base) if n.startswith(PREFIX)]
    except OSError:  # no such base: nothing was left there
        return []
    paths = []
    for group in groups:
        try:
            paths += [os.path.join(group, n) for n in os.listdir(group)]
        except OSError:  # a segment, not a directory, or removed meanwhile
            continue
    namespace = _pid_namespace()
    return _remove([p for p in paths if _owner_runs(p, namespace) is False])


def remove_noted(run: str) -> list[str]:
    """Once the ranks of run directory `run` have ended: remove each directory they claimed
    (`note`d in `run`) unless its owner runs, and a dtm* directory that this leaves empty.
    One whose owner record is gone goes too: its rank made it, and what is in it now was
    put back after the rank removed its part (a peer's last read of it). The paths removed."""
    namespace = _pid_namespace()
    paths = [p for p in _noted(run, PART) if os.path.basename(os.path.dirname(p)).startswith(PREFIX)]
    return _remove([p for p in paths if os.path.isdir(p) and not _owner_runs(p, namespace)])


def _remove(paths: list[str]) -> list[str]:
    """Remove directories `paths`, and each parent they leave empty (the last part of that
    mesh on this host); `paths`."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    for group in {os.path.dirname(p) for p in paths}:
        try:
            os.rmdir(group)
        except OSError:  # a live rank's part is still in it
            pass
    return paths
