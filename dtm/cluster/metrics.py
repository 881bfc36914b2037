"""The coordinator's figures as Prometheus metrics over HTTP (prometheus_client).

    server = MetricsServer(coord, port=9464)     # 127.0.0.1 unless host says otherwise
    ... GET http://127.0.0.1:9464/metrics ...
    server.stop()

Every scrape reads the coordinator's last heartbeat of each rank (no copies kept): one gauge
or counter per figure, labelled by rank, plus `dtm_rank_info` whose labels carry the rank's
membership state and last operation; and one series per helper worker of a rank (labels
`rank` and `worker`) from the worker rows of its last heartbeat. Throughput is not served: a
viewer takes it from the counters' deltas (Prometheus's `rate()`, `dtm top`).

While it serves, the server names itself in a job file (jobfile.py) so that `dtm top` on this
machine finds it without being told the port.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server

from ..errors import DTMError, ErrorCode as E
from . import jobfile

if TYPE_CHECKING:
    from .coordinator import Coordinator, RankStatus

log = logging.getLogger("dtm.cluster")

DEFAULT_HOST = "127.0.0.1"  # metrics name the job's processes: not for other hosts unless asked


class _Collector:
    """Reads `coord` at each scrape."""

    def __init__(self, coord: "Coordinator"):
        self.coord = coord

    def collect(self) -> Iterator[Metric]:
        c = self.coord
        yield GaugeMetricFamily("dtm_mesh_world_size", "ranks in the mesh", value=c.world_size)
        yield GaugeMetricFamily("dtm_mesh_epoch", "the mesh's epoch (0 before it formed)",
                                value=c.view.epoch if c.view is not None else 0)
        fams = {
            "cpu": GaugeMetricFamily("dtm_rank_cpu_percent", "CPU use since the previous heartbeat, percent of one "
                                     "core (helper processes included)", labels=["rank"]),
            "rss": GaugeMetricFamily("dtm_rank_rss_bytes", "resident memory (helper processes included)",
                                     labels=["rank"]),
            "ops": CounterMetricFamily("dtm_rank_ops", "operations, items or steps done", labels=["rank"]),
            "sent": CounterMetricFamily("dtm_rank_sent_bytes", "bytes sent or written", labels=["rank"]),
            "recv": CounterMetricFamily("dtm_rank_received_bytes", "bytes received or read", labels=["rank"]),
            "age": GaugeMetricFamily("dtm_rank_heartbeat_age_seconds", "seconds since the rank was last heard",
                                     labels=["rank"]),
            "info": GaugeMetricFamily("dtm_rank_info", "1 for each rank; labels: membership state and last "
                                      "operation", labels=["rank", "state", "last_op", "name"]),
        }
        ranks = c.ranks()
        for r in ranks:
            rank = str(r.rank)
            hb = r.beat
            fams["info"].add_metric([rank, r.state, hb.last_op if hb else "", r.name], 1)
            fams["age"].add_metric([rank], r.age_s)
            if hb is None:
                continue
            fams["cpu"].add_metric([rank], hb.cpu_percent)
            fams["rss"].add_metric([rank], hb.rss_bytes)
            fams["ops"].add_metric([rank], hb.ops_done)
            fams["sent"].add_metric([rank], hb.bytes_sent)
            fams["recv"].add_metric([rank], hb.bytes_received)
        yield from fams.values()
        yield from _worker_families(ranks)


def _worker_families(ranks: "list[RankStatus]") -> list[Metric]:
    """One series per helper worker of each rank (labels `rank`, `worker`), from the worker
    rows of the rank's last heartbeat: a worker that ended is gone at the rank's next one."""
    labels = ["rank", "worker"]
    fams = [GaugeMetricFamily("dtm_worker_cpu_percent", "a helper worker's CPU use, percent of one core", labels=labels),
            GaugeMetricFamily("dtm_worker_rss_bytes", "a helper worker's resident memory", labels=labels),
            CounterMetricFamily("dtm_worker_ops", "files or tasks a helper worker finished", labels=labels),
            CounterMetricFamily("dtm_worker_sent_bytes", "bytes a helper worker wrote", labels=labels),
            CounterMetricFamily("dtm_worker_received_bytes", "bytes a helper worker read", labels=labels)]
    info = GaugeMetricFamily("dtm_worker_info", "1 for each helper worker; label: its state",
                             labels=[*labels, "state"])
    for r in ranks:
        for w in r.beat.workers if r.beat is not None else ():
            key = [str(r.rank), w.name]
            for fam, value in zip(fams, (w.cpu_percent, w.rss_bytes, w.ops, w.bytes_sent, w.bytes_received)):
                fam.add_metric(key, value)
            info.add_metric([*key, w.state], 1)
    return [*fams, info]


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class MetricsServer:
    """Serves `coord`'s figures at http://HOST:PORT/metrics on a daemon thread (see the
    module doc); port 0 takes a free one. E1005 when it cannot listen."""

    def __init__(self, coord: "Coordinator", *, host: str = DEFAULT_HOST, port: int = 0):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(coord))
        try:
            self._httpd, self._thread = start_http_server(port, host, registry)
        except OSError as e:
            raise DTMError(E.NOT_INITIALIZED, f"the metrics endpoint cannot listen at {host}:{port}: "
                                              f"{e.strerror or e}") from None
        self.address: tuple[str, int] = self._httpd.server_address[:2]
        self._job = jobfile.write(_address(*self.address), _address(*coord.address), coord.world_size,
                                  coord.token)
        log.info("coordinator: metrics at http://%s/metrics", _address(*self.address))

    @property
    def url(self) -> str:
        return f"http://{_address(*self.address)}/metrics"

    def stop(self) -> None:
        """Stop serving and remove the job file (twice is harmless)."""
        if self._job is None:
            return
        try:
            os.unlink(self._job)
        except OSError:
            pass
        self._job = None
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)
