"""The coordinator's Prometheus metrics, `dtm top`'s view of them, the job file it finds them
by, and how a rank's heartbeats carry its ingest workers' figures (issue 18)."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from dtm.cli import main
from dtm.cluster import jobfile, top
from dtm.cluster.activity import Row, activity
from dtm.cluster.coordinator import Coordinator
from dtm.cluster.membership import join
from dtm.runtime.process_group import ProcessGroup

TOKEN = b"top-test"


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _samples(text: str) -> dict:
    return {(s.name, s.labels.get("rank")): (s.value, s.labels) for f in text_string_to_metric_families(text)
            for s in f.samples}


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path / "dtm"


@pytest.fixture
def mesh(runtime_dir):
    """A coordinator serving metrics and one member whose heartbeats carry a ProcessGroup's
    figures, with ingest activity added as dtm.data adds it."""
    coord = Coordinator(1, TOKEN, heartbeat_ms=50, timeout_ms=5000, metrics=("127.0.0.1", 0)).start()
    m, listener = join(coord.address, TOKEN, timeout=10)
    pg = ProcessGroup(0, 1, membership=m)
    a = activity()
    saved = (a.items, a.bytes_read, a.bytes_written, a.state, a.workers)
    a.items, a.bytes_read, a.bytes_written, a.state = 42, 1000, 2000, "ingest: 42/50 files"
    a.report_worker(Row("w0 1", 100.0, 2 << 30))
    a.report_worker(Row("w1 2", 50.0, 1 << 30))
    m.start(pg.figures)
    yield coord
    a.items, a.bytes_read, a.bytes_written, a.state, a.workers = saved
    m.leave("done")
    listener.close()
    coord.stop()


def _wait_for_beat(coord) -> None:
    deadline = time.monotonic() + 10
    while not coord.last_heartbeats() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert coord.last_heartbeats(), "no heartbeat within 10 s"


def test_metrics_parse_with_prometheus_parser_and_carry_the_rank_activity(mesh):
    _wait_for_beat(mesh)
    text = _get(mesh.metrics.url)
    s = _samples(text)
    assert s[("dtm_mesh_world_size", None)][0] == 1 and s[("dtm_mesh_epoch", None)][0] == 1
    assert s[("dtm_rank_ops_total", "0")][0] == 42
    assert s[("dtm_rank_received_bytes_total", "0")][0] == 1000
    assert s[("dtm_rank_sent_bytes_total", "0")][0] == 2000
    assert s[("dtm_rank_cpu_percent", "0")][0] >= 150.0            # the workers' CPU is the rank's
    assert s[("dtm_rank_rss_bytes", "0")][0] > 3 << 30
    assert 0 <= s[("dtm_rank_heartbeat_age_seconds", "0")][0] < 5
    info = s[("dtm_rank_info", "0")][1]
    assert info["state"] == "member" and info["last_op"] == "ingest: 42/50 files"
    assert mesh.metrics.address[0] == "127.0.0.1"


def test_job_file_names_the_endpoint_and_goes_with_it(mesh, runtime_dir):
    host, port = mesh.metrics.address
    assert top.find_local() == f"{host}:{port}"
    (runtime_dir / "job-999999999.json").write_text(json.dumps({"pid": 999999999, "metrics": "127.0.0.1:1",
                                                                "started": time.time() + 100}))
    assert top.find_local() == f"{host}:{port}"  # the stale (dead pid) file is ignored, and removed
    assert not (runtime_dir / "job-999999999.json").exists()
    mesh.stop()
    assert top.find_local() is None


def test_dtm_top_once_reads_the_local_job(mesh):
    _wait_for_beat(mesh)
    r = CliRunner().invoke(main, ["top", "--once"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "member" in r.output and "42" in r.output and "ingest: 42/50 files" in r.output


RECORDED = """\
# TYPE dtm_mesh_world_size gauge
dtm_mesh_world_size 2.0
# TYPE dtm_mesh_epoch gauge
dtm_mesh_epoch 1.0
# TYPE dtm_rank_cpu_percent gauge
dtm_rank_cpu_percent{rank="0"} 97.5
dtm_rank_cpu_percent{rank="1"} 12.0
# TYPE dtm_rank_rss_bytes gauge
dtm_rank_rss_bytes{rank="0"} 524288000.0
dtm_rank_rss_bytes{rank="1"} 1048576.0
# TYPE dtm_rank_ops counter
dtm_rank_ops_total{rank="0"} %d
dtm_rank_ops_total{rank="1"} 7.0
# TYPE dtm_rank_sent_bytes counter
dtm_rank_sent_bytes_total{rank="0"} %d
dtm_rank_sent_bytes_total{rank="1"} 0.0
# TYPE dtm_rank_received_bytes counter
dtm_rank_received_bytes_total{rank="0"} 0.0
dtm_rank_received_bytes_total{rank="1"} 0.0
# TYPE dtm_rank_heartbeat_age_seconds gauge
dtm_rank_heartbeat_age_seconds{rank="0"} 0.25
dtm_rank_heartbeat_age_seconds{rank="1"} 6.5
# TYPE dtm_rank_info gauge
dtm_rank_info{last_op="all_reduce f32[1024]",name="rank 0",rank="0",state="member"} 1.0
dtm_rank_info{last_op="",name="rank 1",rank="1",state="lost"} 1.0
"""


def test_table_renders_a_recorded_snapshot_with_rates_from_deltas():
    before = top.parse(RECORDED % (100, 0), at=10.0)
    after = top.parse(RECORDED % (150, 20_000_000), at=12.0)
    console = Console(record=True, width=160)
    console.print(top.table(after, before))
    lines = console.export_text().splitlines()
    row0 = next(line for line in lines if "all_reduce" in line).split()
    # rank, CPU %, RSS, ops, ops/s, sent, recv, MB/s, state, heard, last op
    assert row0[:6] == ["│", "0", "│", "98", "│", "500.0"]  # 97.5 rounds to 98; 524288000 B = 500 MiB
    assert "150" in row0 and "25.0" in row0 and "10.0" in row0 and "member" in row0 and "0.2s" in row0
    row1 = next(line for line in lines if "lost" in line)
    assert "6.5s" in row1 and " 7 " in row1 and "0.0" in row1
    first = Console(record=True, width=160)
    first.print(top.table(before))  # no earlier frame: no rates
    assert "-" in next(line for line in first.export_text().splitlines() if "all_reduce" in line)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_dtm_top_live_in_tmux(mesh, tmp_path):
    _wait_for_beat(mesh)
    host, port = mesh.metrics.address
    session = f"dtm-top-{os.getpid()}"
    env = os.pathsep.join(sys.path)
    cmd = f"COLUMNS=250 PYTHONPATH={env} {sys.executable} -m dtm.cli top --coordinator {host}:{port} --interval 0.2"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "250", "-y", "20", cmd], check=True, timeout=10)
    try:
        screen = ""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "ingest: 42/50" not in screen:
            time.sleep(0.3)
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True,
                                    timeout=10).stdout
        assert "ingest: 42/50" in screen and "member" in screen, screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], timeout=10)


# --- helper workers as rows of their own (issue 29) ------------------------------------------------

def _worker_samples(url: str) -> dict[tuple[str, str, str], float]:
    """(series, rank, worker) -> value of every `dtm_worker_*` sample."""
    return {(s.name, s.labels["rank"], s.labels["worker"]): s.value
            for f in text_string_to_metric_families(_get(url)) for s in f.samples if "worker" in s.labels}


def _wait_until(cond, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_each_worker_is_a_series_with_rank_and_worker_labels(mesh):
    url = mesh.metrics.url
    s = _wait_until(lambda: _worker_samples(url) or None, "worker series")
    assert s[("dtm_worker_cpu_percent", "0", "w0 1")] == 100.0
    assert s[("dtm_worker_rss_bytes", "0", "w1 2")] == 1 << 30
    assert {w for (_, _, w) in s} == {"w0 1", "w1 2"}
    assert {n for (n, _, _) in s} >= {"dtm_worker_ops_total", "dtm_worker_sent_bytes_total",
                                      "dtm_worker_received_bytes_total", "dtm_worker_info"}


def test_dtm_top_once_shows_a_row_per_worker_under_its_rank(mesh):
    _wait_until(lambda: _worker_samples(mesh.metrics.url), "worker series")
    r = CliRunner().invoke(main, ["top", "--once"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    rank_line = next(i for i, line in enumerate(lines) if "ingest: 42/50 files" in line)
    w0 = next(i for i, line in enumerate(lines) if "w0 1" in line)
    w1 = next(i for i, line in enumerate(lines) if "w1 2" in line)
    assert rank_line < w0 < w1
    assert "2.0 GiB" in lines[w0] and "1.0 GiB" in lines[w1]


def test_a_dropped_worker_leaves_the_metrics(mesh):
    url = mesh.metrics.url
    _wait_until(lambda: _worker_samples(url), "worker series")
    activity().drop_worker("w0 1")
    _wait_until(lambda: {w for (_, _, w) in _worker_samples(url)} == {"w1 2"}, "w0 1 gone")


def test_too_many_workers_are_cut_to_the_spec_bound(mesh):
    from dtm.protocol.messages import MAX_WORKER_NAME_BYTES, MAX_WORKERS

    long_name = "a" * 300  # sorts first: kept, its name cut
    for i in range(MAX_WORKERS + 10):
        activity().report_worker(Row(f"extra {i:03d}", 1.0, 1 << 20, ops=i))
    activity().report_worker(Row(long_name, 1.0, 1 << 20))
    url = mesh.metrics.url
    names = _wait_until(lambda: {w for (n, _, w) in _worker_samples(url) if n == "dtm_worker_info"}
                        if len(_worker_samples(url)) > 12 else None, "the extra workers")
    assert len(names) == MAX_WORKERS                   # the first 64 by name; the rest stay in the totals
    assert "a" * MAX_WORKER_NAME_BYTES in names and "extra 000" in names and "w0 1" not in names
    assert all(len(n.encode()) <= MAX_WORKER_NAME_BYTES for n in names)


def test_a_process_task_lane_reports_its_worker_and_drops_it():
    from dtm.tasks.watch import forget, watched

    class Proc:  # what the lane's WorkerProcess offers: its Popen and its name
        def __init__(self, child: subprocess.Popen):
            self.proc, self.name = child, f"process 0.1 (pid {child.pid})"

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    proc = Proc(child)
    try:
        watched(proc).finished(4096, 1024)
        watched(proc).tick(time.monotonic(), "task load")
        row = activity().workers[proc.name]
        assert (row.ops, row.received_bytes, row.sent_bytes, row.state) == (1, 4096, 1024, "task load")
        assert row.rss_bytes > 0                            # read from the child's /proc
        forget(proc)
        assert proc.name not in activity().workers
    finally:
        child.kill()
        child.wait()
