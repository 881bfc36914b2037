"""`dtm top`: a live view of a running job's ranks, like htop for a mesh.

It reads the coordinator's Prometheus endpoint (metrics.py) about once a second and shows a
row per rank: CPU %, resident memory, operations done and their rate, bytes sent and received
and their rate, membership state and last operation, and how long ago the rank was last heard;
under each rank, indented, a row per helper worker it reported (ingest or process-task
workers: CPU, RSS, files or tasks, bytes and MB/s, state).
Rates come from the deltas between two scrapes, so the first frame shows none.

    address = find_local()                  # the newest live job file (jobfile.py), or None
    prev = None
    while ...: snap = scrape(address); console.print(table(snap, prev)); prev = snap

`table` takes rows, not an endpoint, so the ingest progress (dtm/data) and tests render
recorded figures with it.
"""

from __future__ import annotations

import math
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.live import Live
from rich.table import Table

from ..errors import DTMError, ErrorCode as E
from . import jobfile
from .activity import Row

SCRAPE_TIMEOUT_S = 2.0
MAX_SCRAPE_BYTES = 16 << 20  # a mesh of thousands of ranks is a few MB of exposition


@dataclass
class Snapshot:
    at: float                      # time.monotonic() of the scrape
    rows: dict[str, Row] = field(default_factory=dict)
    title: str = ""


def parse(text: str, at: float) -> Snapshot:
    """A Snapshot from Prometheus exposition text (metrics.py's names)."""
    rows: dict[str, Row] = {}
    size = epoch = 0
    fields = {"dtm_rank_cpu_percent": "cpu_percent", "dtm_rank_rss_bytes": "rss_bytes", "dtm_rank_ops_total": "ops",
              "dtm_rank_sent_bytes_total": "sent_bytes", "dtm_rank_received_bytes_total": "received_bytes",
              "dtm_rank_heartbeat_age_seconds": "age_s"}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "dtm_mesh_world_size":
                size = int(s.value)
            elif s.name == "dtm_mesh_epoch":
                epoch = int(s.value)
            elif "worker" in s.labels:
                _worker_sample(rows, s.labels, s.name, s.value)
            elif "rank" in s.labels:
                row = rows.setdefault(s.labels["rank"], Row(s.labels["rank"]))
                if s.name == "dtm_rank_info":
                    row.state, row.last_op = s.labels.get("state", ""), s.labels.get("last_op", "")
                elif s.name in fields:
                    kind = float if fields[s.name] in ("cpu_percent", "age_s") else int
                    setattr(row, fields[s.name], kind(s.value))
    ordered = dict(sorted(rows.items(), key=lambda kv: _order(kv[0])))
    return Snapshot(at, ordered, f"mesh of {size} rank(s), epoch {epoch}")


# metrics.py's per-worker series and the Row field each fills.
_WORKER_FIELDS = {"dtm_worker_cpu_percent": "cpu_percent", "dtm_worker_rss_bytes": "rss_bytes",
                  "dtm_worker_ops_total": "ops", "dtm_worker_sent_bytes_total": "sent_bytes",
                  "dtm_worker_received_bytes_total": "received_bytes"}


def _worker_sample(rows: dict[str, Row], labels: dict[str, str], name: str, value: float) -> None:
    """Put one `dtm_worker_*` sample in its worker's row, keyed `RANK/WORKER` so that it
    sorts under its rank (`_order`), and named indented as the rank's child."""
    rank, worker = labels.get("rank", ""), labels["worker"]
    row = rows.setdefault(f"{rank}/{worker}", Row(f"  {worker}"))
    if name == "dtm_worker_info":
        row.state = labels.get("state", "")
    elif name in _WORKER_FIELDS:
        setattr(row, _WORKER_FIELDS[name], float(value) if name == "dtm_worker_cpu_percent" else int(value))


def _order(key: str) -> tuple[int, str, str]:
    """Ranks in numeric order, each followed by its workers by name."""
    rank, _, worker = key.partition("/")
    return (int(rank), "", worker) if rank.isdigit() else (-1, rank, worker)


def scrape(address: str, timeout: float = SCRAPE_TIMEOUT_S) -> Snapshot:
    """GET http://ADDRESS/metrics and parse it; E0802 when it does not answer in `timeout` s,
    E1001 when nothing listens (the job ended)."""
    url = f"http://{address}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            body = r.read(MAX_SCRAPE_BYTES + 1)
    except TimeoutError:
        raise DTMError(E.TIMEOUT, f"dtm top: {url} did not answer within {timeout:g} s") from None
    except (urllib.error.URLError, OSError) as e:
        raise DTMError(E.PEER_LOST, f"dtm top: cannot read {url}: {getattr(e, 'reason', e)} (has the job "
                                    "ended?)") from None
    if len(body) > MAX_SCRAPE_BYTES:
        raise DTMError(E.LIMIT_EXCEEDED, f"dtm top: {url} sent more than {MAX_SCRAPE_BYTES} bytes")
    return parse(body.decode("utf-8", "replace"), time.monotonic())


def find_local() -> str | None:
    """The metrics address of the newest live job on this machine, or None."""
    jobs = jobfile.find()
    return str(jobs[0]["metrics"]) if jobs else None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # not reached


def _rate(cur: float, old: float | None, dt: float) -> float | None:
    return None if old is None or dt <= 0 else max(cur - old, 0) / dt


def table(snap: Snapshot, prev: Snapshot | None = None, *, ops_name: str = "ops", key_name: str = "rank") -> Table:
    """The view of `snap`; rates from the deltas to `prev` (none without it)."""
    dt = snap.at - prev.at if prev is not None else 0.0
    t = Table(title=snap.title or None, expand=False)
    for col in (key_name, "CPU %", "RSS", ops_name, f"{ops_name}/s", "sent", "recv", "MB/s", "state", "heard",
                "last op"):
        t.add_column(col, justify="left" if col in (key_name, "state", "last op") else "right", no_wrap=True)
    for key, r in snap.rows.items():
        old = prev.rows.get(key) if prev is not None else None
        ops_rate = _rate(r.ops, old.ops if old else None, dt)
        moved = _rate(r.sent_bytes + r.received_bytes, old.sent_bytes + old.received_bytes if old else None, dt)
        t.add_row(r.name, f"{r.cpu_percent:.0f}", human_bytes(r.rss_bytes), str(r.ops),
                  "-" if ops_rate is None else f"{ops_rate:.1f}", human_bytes(r.sent_bytes),
                  human_bytes(r.received_bytes), "-" if moved is None else f"{moved / 1e6:.1f}", r.state,
                  "-" if math.isinf(r.age_s) else f"{r.age_s:.1f}s", r.last_op[:40])
    return t


PIPE_WIDTH = 250  # wider than every column of `table` at full width (last op is cut at 40)


def table_console(*, stderr: bool = False) -> Console:
    """A Console for `table`: a terminal's own width; piped, wide enough that no column is
    squeezed (rich would assume 80 columns and cut every header)."""
    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=PIPE_WIDTH)


@contextmanager
def live_view(con: Console) -> Iterator[Live]:
    """A Live display on `con`. Piped, its last frame gets a newline of its own: rich leaves
    the output after the table's bottom border, where the next line would be glued."""
    with Live(console=con, auto_refresh=False, transient=False) as live:
        yield live
    if not con.is_terminal:
        con.line()


def run(address: str, *, interval: float = 1.0, iterations: int | None = None, console: Console | None = None) -> str:
    """Show the live view until the job ends, Ctrl-C, or `iterations` frames; why it ended."""
    prev: Snapshot | None = None
    frames = 0
    with live_view(console or table_console()) as live:
        try:
            while iterations is None or frames < iterations:
                try:
                    snap = scrape(address)
                except DTMError as e:
                    if prev is None:
                        raise
                    return f"the job ended ({e.message})"
                snap.title = f"dtm top {address}: {snap.title}"
                live.update(table(snap, prev), refresh=True)
                prev, frames = snap, frames + 1
                if iterations is None or frames < iterations:
                    time.sleep(interval)
        except KeyboardInterrupt:
            return "interrupted"
    return f"{frames} frame(s)"


def rows_of(items: Iterable[Row]) -> dict[str, Row]:
    return {r.name: r for r in items}
