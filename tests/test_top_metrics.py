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
