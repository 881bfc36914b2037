"""The environment a rank starts from (spec 9.6), so that `dtm launch`, Slurm, Kubernetes or
any other launcher can start ranks:

    DTM_COORDINATOR              host:port of the coordinator ([v6addr]:port for IPv6)
    DTM_RANK                     this process's rank; unset: the coordinator chooses
    DTM_WORLD_SIZE               the number of ranks; unset or 1 without a coordinator: one process
    DTM_TOKEN                    the cluster token every connection proves (9.1.6)
    DTM_COORDINATOR_EXTERNAL     1: a coordinator already runs at DTM_COORDINATOR; otherwise
                                 rank 0 runs one there, in a thread
    DTM_HOST                     the address peers reach this rank at (default: the address it
                                 reaches the coordinator from)
    DTM_MESH_AXES                mesh axes, e.g. "dp=2,tp=2" (read where the coordinator runs)
    DTM_HEARTBEAT_MS             heartbeat interval (read where the coordinator runs)
    DTM_HEARTBEAT_TIMEOUT_MS     silence after which a rank is lost (read where the coordinator runs)
    DTM_METRICS_PORT             serve the coordinator's Prometheus metrics at this port (0: any
                                 free one); `dtm launch` and `dtm coordinator` serve them anyway
    DTM_METRICS_HOST             the address the metrics are served at (default 127.0.0.1)
    DTM_ELASTIC                  MIN:MAX of an elastic job (`dtm launch --elastic`): what a rank
                                 needs to run the coordinator when the job's own is lost
    DTM_ELASTIC_AXES             with DTM_ELASTIC: the job's first mesh axes ("dp=2,tp=2")
    DTM_GIVE_WAY                 with DTM_ELASTIC: the axes that shrink first ("tp,dp")
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import DTMError, ErrorCode as E
from .heartbeat import HEARTBEAT_MS, TIMEOUT_MS

Axes = tuple[tuple[str, int], ...]


def bad_variable(name: str, value: str, want: str) -> DTMError:
    """E1005 for environment variable `name`, whose `value` is not the `want`ed kind."""
    return DTMError(E.NOT_INITIALIZED, f"{name}={value!r}: expected {want}")


def parse_address(text: str, name: str = "address") -> tuple[str, int]:
    """"host:port" or "[v6addr]:port" -> (host, port)."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise bad_variable(name, text, "HOST:PORT with a port from 1 to 65535")
    return host, int(port)


def parse_axes(text: str, name: str = "axes") -> Axes:
    """"dp=2,tp=2" -> (("dp", 2), ("tp", 2)); "" -> () (one flat axis)."""
    axes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        axis, sep, size = item.partition("=")
        if not sep or not axis.isidentifier() or not size.isdigit() or int(size) < 1:
            raise bad_variable(name, text, "NAME=SIZE pairs separated by commas, e.g. dp=2,tp=2")
        axes.append((axis, int(size)))
    return tuple(axes)


def _int(environ: Mapping[str, str], name: str, default: int, least: int) -> int:
    value = environ.get(name, "").strip()
    if not value:
        return default
    if not value.lstrip("-").isdigit() or int(value) < least:
        raise bad_variable(name, value, f"an integer of at least {least}")
    return int(value)


def heartbeat_env(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """DTM_HEARTBEAT_MS and DTM_HEARTBEAT_TIMEOUT_MS, or their defaults."""
    heartbeat_ms = _int(environ, "DTM_HEARTBEAT_MS", HEARTBEAT_MS, 1)
    return heartbeat_ms, _int(environ, "DTM_HEARTBEAT_TIMEOUT_MS", max(TIMEOUT_MS, heartbeat_ms), heartbeat_ms)


def metrics_env(environ: Mapping[str, str] = os.environ) -> tuple[str, int] | None:
    """(host, port) from DTM_METRICS_HOST and DTM_METRICS_PORT; None when the port is unset."""
    if not environ.get("DTM_METRICS_PORT", "").strip():
        return None
    port = _int(environ, "DTM_METRICS_PORT", 0, 0)
    if port > 65535:
        raise bad_variable("DTM_METRICS_PORT", str(port), "a port from 0 to 65535")
    return environ.get("DTM_METRICS_HOST", "").strip() or "127.0.0.1", port


@dataclass(frozen=True)
class ElasticPolicy:
    """What an elastic job's coordinator decides shapes by (spec 9.6.7): at least `least`
    and at most `most` ranks, the axes of its first view, the axes that give way first."""

    least: int
    most: int
    axes: Axes = ()
    give_way: tuple[str, ...] = ()

    def env(self) -> dict[str, str]:
        """The policy as the DTM_ELASTIC* variables a launcher gives its ranks."""
        return {"DTM_ELASTIC": f"{self.least}:{self.most}",
                "DTM_ELASTIC_AXES": ",".join(f"{a}={n}" for a, n in self.axes),
                "DTM_GIVE_WAY": ",".join(self.give_way)}


def elastic_env(environ: Mapping[str, str] = os.environ) -> ElasticPolicy | None:
    """The job's elastic policy from DTM_ELASTIC, DTM_ELASTIC_AXES and DTM_GIVE_WAY; None
    when DTM_ELASTIC is unset (the rank was not told the policy)."""
    text = environ.get("DTM_ELASTIC", "").strip()
    if not text:
        return None
    least, sep, most = text.partition(":")
    if not sep or not least.isdigit() or not most.isdigit() or not 1 <= int(least) <= int(most):
        raise bad_variable("DTM_ELASTIC", text, "MIN:MAX with 1 <= MIN <= MAX")
    give_way = tuple(filter(None, (s.strip() for s in environ.get("DTM_GIVE_WAY", "").split(","))))
    return ElasticPolicy(int(least), int(most), parse_axes(environ.get("DTM_ELASTIC_AXES", ""), "DTM_ELASTIC_AXES"),
                         give_way)


@dataclass(frozen=True)
class RankEnv:
    coordinator: tuple[str, int] | None
    rank: int              # -1: the coordinator chooses
    world_size: int        # 0: unknown (the coordinator knows)
    token: bytes
    external: bool         # True: do not run the coordinator in rank 0
    host: str | None
    axes: Axes
    heartbeat_ms: int
    timeout_ms: int

    @property
    def single(self) -> bool:
        """A world of one process, which needs no coordinator."""
        return self.coordinator is None and self.world_size in (0, 1)

    @property
    def hosts_coordinator(self) -> bool:
        return self.coordinator is not None and self.rank == 0 and not self.external


def rank_env(environ: Mapping[str, str] = os.environ) -> RankEnv:
    """The DTM_* variables of `environ`, checked (E1005 naming the variable on a bad one).
    (`dtm.init()` adds those another launcher's variables give: launchers.py.)"""
    text = environ.get("DTM_COORDINATOR", "").strip()
    coordinator = parse_address(text, "DTM_COORDINATOR") if text else None
    world_size = _int(environ, "DTM_WORLD_SIZE", 0, 1)
    rank = _int(environ, "DTM_RANK", -1, 0)
    if world_size and rank >= world_size:
        raise bad_variable("DTM_RANK", str(rank), f"a rank below DTM_WORLD_SIZE={world_size}")
    if coordinator is None and world_size > 1:
        raise DTMError(E.NOT_INITIALIZED, f"DTM_WORLD_SIZE={world_size} but DTM_COORDINATOR is not set: ranks find "
                                          "each other through the coordinator (or start them with `dtm launch`)")
    external = environ.get("DTM_COORDINATOR_EXTERNAL", "").strip() not in ("", "0")
    if coordinator is not None and rank == 0 and not external and not world_size:
        raise DTMError(E.NOT_INITIALIZED, "rank 0 runs the coordinator and needs DTM_WORLD_SIZE (or set "
                                          "DTM_COORDINATOR_EXTERNAL=1 when a coordinator already runs)")
    heartbeat_ms, timeout_ms = heartbeat_env(environ)
    return RankEnv(coordinator, rank, world_size, environ.get("DTM_TOKEN", "").encode("utf-8"), external,
                   environ.get("DTM_HOST", "").strip() or None,
                   parse_axes(environ.get("DTM_MESH_AXES", ""), "DTM_MESH_AXES"), heartbeat_ms, timeout_ms)
