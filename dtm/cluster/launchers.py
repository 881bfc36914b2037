"""Ranks started by other launchers (spec 9.6.1): when DTM_COORDINATOR is not set,
`dtm.init()` reads the variables of the launcher that started the process and takes its
rank, world size and coordinator from them, so that a DTM job runs as it is under
torchrun, Slurm's srun or Open MPI's mpirun:

    | launcher | rank | world size | coordinator host | coordinator port |
    |---|---|---|---|---|
    | torchrun | RANK | WORLD_SIZE | MASTER_ADDR | MASTER_PORT + 1 |
    | Open MPI (mpirun) | OMPI_COMM_WORLD_RANK | OMPI_COMM_WORLD_SIZE | MASTER_ADDR | MASTER_PORT + 1 |
    | Slurm (srun) | SLURM_PROCID | SLURM_NTASKS | the first host of SLURM_JOB_NODELIST (or MASTER_ADDR) | MASTER_PORT + 1, else 20000 + SLURM_JOB_ID mod 10000 |

DTM_COORDINATOR_PORT, when set, is the port under every launcher. The port is MASTER_PORT
+ 1 because torchrun's agent serves its own store at MASTER_PORT; the rank of rank 0
runs DTM's coordinator, as under `dtm launch` without --coordinator. The first launcher
of the table whose variables are there wins (torchrun inside a Slurm allocation is
torchrun's job). A world of one process needs no coordinator: nothing is taken then.

The cluster token is DTM_TOKEN. Without it, and only where the coordinator's host is a
loopback address, it is the launcher's job id (TORCHELASTIC_RUN_ID, the Open MPI job id,
SLURM_JOB_ID), so that two jobs on one machine never join each other's mesh; a job across
hosts must set DTM_TOKEN (E1005 otherwise), since a job id is no secret.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping

from ..errors import DTMError, ErrorCode as E
from .env import bad_variable

SLURM_PORT_BASE = 20000  # Slurm jobs without MASTER_PORT: 20000 + SLURM_JOB_ID mod 10000


def with_launcher(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with the DTM_* variables its launcher's give (`launcher_env`) added."""
    return {**environ, **launcher_env(environ)}


def launcher_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The DTM_* variables that the launcher's variables in `environ` give (see the module
    doc); {} when DTM_COORDINATOR is set or no launcher of the table started the process."""
    if environ.get("DTM_COORDINATOR", "").strip():
        return {}
    for launcher, rank_var, size_var, job_var in (("torchrun", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"),
                                                  ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                                   "OMPI_MCA_ess_base_jobid"),
                                                  ("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID")):
        if environ.get(rank_var, "").strip() and environ.get(size_var, "").strip():
            return _translate(environ, launcher, rank_var, size_var, job_var)
    return {}


def _translate(environ: Mapping[str, str], launcher: str, rank_var: str, size_var: str, job_var: str) -> dict:
    rank, size = (_count(environ, v) for v in (rank_var, size_var))
    if size < 1:
        raise bad_variable(size_var, environ[size_var], f"a world size of at least 1 ({launcher})")
    if rank >= size:
        raise bad_variable(rank_var, environ[rank_var], f"a rank below {size_var}={size} ({launcher})")
    if size == 1:
        return {}
    host = environ.get("MASTER_ADDR", "").strip()
    if not host and launcher == "Slurm":
        host = first_host(environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or "")
    if not host:
        raise DTMError(E.NOT_INITIALIZED, f"a job started by {launcher} needs the coordinator's host: set "
                                          "MASTER_ADDR (or DTM_COORDINATOR=HOST:PORT)")
    port = _port(environ, launcher)
    out = {"DTM_RANK": str(rank), "DTM_WORLD_SIZE": str(size),
           "DTM_COORDINATOR": f"[{host}]:{port}" if ":" in host else f"{host}:{port}"}
    if not environ.get("DTM_TOKEN"):
        if not _loopback(host):
            raise DTMError(E.NOT_INITIALIZED, f"a job started by {launcher} whose coordinator is at {host} (not this "
                                              "machine's loopback) needs DTM_TOKEN, the same secret on every rank: "
                                              "the cluster token proves each connection (spec 9.1.6)")
        out["DTM_TOKEN"] = f"{launcher}:{environ.get(job_var, '').strip() or host}:{port}"
    return out


def _count(environ: Mapping[str, str], name: str) -> int:
    text = environ[name].strip()
    if not text.isdigit():
        raise bad_variable(name, text, "a non-negative integer")
    return int(text)


def _port(environ: Mapping[str, str], launcher: str) -> int:
    for name, offset in (("DTM_COORDINATOR_PORT", 0), ("MASTER_PORT", 1)):
        text = environ.get(name, "").strip()
        if text:
            if not text.isdigit() or not 0 < int(text) + offset < 65536:
                raise bad_variable(name, text, "a port from 1 to 65534")
            return int(text) + offset
    job = environ.get("SLURM_JOB_ID", "").strip()
    if launcher == "Slurm" and job.isdigit():
        return SLURM_PORT_BASE + int(job) % 10000
    raise DTMError(E.NOT_INITIALIZED, f"a job started by {launcher} needs the coordinator's port: set MASTER_PORT "
                                      "(DTM uses the port after it) or DTM_COORDINATOR_PORT")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_RANGE = re.compile(r"^([^\[,]*)\[([^\]]*)\](.*)$")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "node[07-09,12],gpu1" -> "node07" (zero padding
    kept); "" for an empty list."""
    depth, item = 0, []
    for ch in nodelist.strip():
        if ch == "," and depth == 0:
            break
        depth += ch == "["
        depth -= ch == "]"
        item.append(ch)
    text = "".join(item)
    m = _RANGE.match(text)
    if m is None:
        return text
    prefix, ranges, suffix = m.groups()
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}{first_host(suffix) if '[' in suffix else suffix}"


__all__ = ["launcher_env", "with_launcher", "first_host"]
