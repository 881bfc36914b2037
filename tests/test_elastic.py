"""Live mesh resize (spec 9.6.7): real processes under `dtm launch --elastic`, one killed
with SIGKILL mid-training, ranks joining with `dtm launch --join`; the losses of every step
equal those of the same steps on one process (tests/elastic_train.py, the same global
batches). Also the shape policy alone, a resize below the minimum, and a coordinator killed
mid-training. Every wait is bounded."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from dtm.cluster.env import ElasticPolicy, elastic_env
from dtm.cluster.membership import join
from dtm.cluster.resize import ElasticCoordinator, give_way_order, shape_for
from dtm.errors import DTMError, ErrorCode as E
from dtm.protocol.messages import Member, MeshView
from launched import Launched

HERE = pathlib.Path(__file__).resolve()
SCRIPT = str(HERE.parent / "elastic_train.py")
DTM = str(pathlib.Path(sys.executable).parent / "dtm")
TIMEOUT_S = 240
RTOL = 2e-4  # the mesh changes how sums are split, so the float rounding differs a little


def test_give_way_order_and_shapes():
    axes = (("dp", 2), ("tp", 2))
    assert give_way_order(axes) == ("dp", "tp")
    assert give_way_order(axes, ("tp",)) == ("tp", "dp")
    order = give_way_order(axes)
    assert shape_for(axes, 4, order) == (("dp", 2), ("tp", 2))
    assert shape_for(axes, 3, order) == (("dp", 1), ("tp", 2))   # DP gives way, one rank spare
    assert shape_for(axes, 6, order) == (("dp", 3), ("tp", 2))   # grows along DP
    assert shape_for(axes, 10, order, most=8) == (("dp", 4), ("tp", 2))
    assert shape_for(axes, 1, order) == (("dp", 1), ("tp", 1))   # then TP gives way too
    assert shape_for(axes, 3, give_way_order(axes, ("tp",))) == (("dp", 2), ("tp", 1))
    assert shape_for((), 5, ()) == ()


def test_successor_waits_for_each_member_then_publishes():
    """A successor of a dp=3 mesh of epoch 4 (spec 9.6.7, "Succession"): ranks 0 and 1
    reconnect and rejoin, a second rejoin as rank 1 is refused (E1004), rank 2 never comes
    and is lost at the bound; the view of epoch 5 is dp=2 with the two in their order, and
    the ranks hear the successor's heartbeats through their Membership."""
    view = MeshView(4, 50, 2000, tuple(Member("127.0.0.1", 1 + r, "n") for r in range(3)), (("dp", 3),))
    policy = ElasticPolicy(1, 4, (("dp", 3),))
    coord = ElasticCoordinator.successor(view, b"tok", policy, host="127.0.0.1", host_rank=0,
                                         resize_timeout=1.5).start()
    got: dict[int, object] = {}

    def rejoin(rank: int) -> None:
        try:
            got[rank] = join(coord.address, b"tok", rank=rank, world_size=0, timeout=10)
        except DTMError as e:
            got[rank] = e

    threads = [threading.Thread(target=rejoin, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    with pytest.raises(DTMError) as again:
        join(coord.address, b"tok", rank=1, world_size=0, timeout=10)
    for t in threads:
        t.join(10)
    try:
        assert again.value.code is E.JOIN_REFUSED
        (m0, _), (m1, _) = got[0], got[1]
        assert (m0.rank, m1.rank, m0.view.epoch, m0.view.axes) == (0, 1, 5, (("dp", 2),))
        assert "rank 2 of epoch 4 did not reconnect" in coord.lost[2]
        assert coord.resizes == ["epoch 5: {'dp': 2} (0->0, 1->1)"]
    finally:
        for m, listener in (got[0], got[1]):
            listener.close()
            m.leave()
        coord.stop()


def test_every_member_lost_while_resizing_ends_the_job():
    """Both members of a dp=2 mesh (elastic 1:4) die one after the other: the first loss
    starts a resize, the second leaves nobody who holds the state, so the coordinator
    ends the job with E1010 at once instead of waiting for rejoins that cannot come."""
    coord = ElasticCoordinator(2, b"tok", axes=(("dp", 2),), elastic=(1, 4), heartbeat_ms=50,
                               timeout_ms=5000).start()
    got: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda r=r: got.__setitem__(
        r, join(coord.address, b"tok", rank=r, world_size=2, timeout=10))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    try:
        for r in (0, 1):  # a crash: the connection closes without Leave
            got[r][0]._sock.close()
            time.sleep(0.2)
        assert coord.finished.wait(5)
        assert coord.error is not None and coord.error.code is E.RESIZE_FAILED
        assert "every member was lost" in coord.error.message
    finally:
        for _m, listener in got.values():
            listener.close()
        coord.stop()


def test_elastic_policy_round_trips_through_the_environment():
    policy = ElasticPolicy(2, 8, (("dp", 2), ("tp", 2)), ("tp",))
    assert elastic_env(policy.env()) == policy
    assert elastic_env({}) is None
    with pytest.raises(DTMError, match="DTM_ELASTIC"):
        elastic_env({"DTM_ELASTIC": "3:2"})


def _reference(tmp_path: pathlib.Path, steps: int) -> dict[str, float]:
    out = tmp_path / "want.json"
    subprocess.run([sys.executable, SCRIPT, "--steps", str(steps), "--out", str(out)], check=True,
                   timeout=TIMEOUT_S, capture_output=True, env=_env())
    return json.loads(out.read_text())["losses"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTM_")}
    return dict(env, DTM_HEARTBEAT_MS="200", DTM_HEARTBEAT_TIMEOUT_MS="3000", **extra)


class Job(Launched):
    """A `dtm launch` of `args` (see launched.py)."""

    def __init__(self, args: list[str], env: dict[str, str]):
        super().__init__([DTM, "launch", *args], env)

    def wait_for(self, text: str, timeout: float) -> str:
        """The first line holding `text`."""
        return self.match(re.escape(text), timeout).string

    def finish(self, timeout: float = TIMEOUT_S) -> int:
        return super().finish(timeout)


def _close(got: dict[str, float], want: dict[str, float], steps: int) -> None:
    assert sorted(got, key=int) == [str(i) for i in range(steps)]
    bad = {k: (got[k], want[k]) for k in want if not abs(got[k] - want[k]) <= RTOL * abs(want[k])}
    assert not bad, f"losses differ from the single-process run: {bad}"


def _shrink_then_grow(tmp_path: pathlib.Path, steps: int, launch: list[str], kill: str, joiners: int) -> \
        tuple[str, dict, list[str]]:
    """A `dtm launch` of `launch` whose rank `kill` (RANK:STEP) dies, then `joiners` ranks started
    with --join once the mesh resized; both must succeed, and every step's loss must equal
    the single-process run's. The job's output, its rank 0's result file, the joiners' lines."""
    want = _reference(tmp_path, steps)
    out = tmp_path / "got.json"
    job = Job([*launch, SCRIPT, "--steps", str(steps), "--kill", kill, "--sleep", "0.3", "--out", str(out)], _env())
    address = job.wait_for("coordinator ", 120).split()[-1]
    job.wait_for("mesh resized to epoch 2", 120)
    joined = Job(["--join", address, "-n", str(joiners), SCRIPT, "--steps", str(steps), "--sleep", "0.3"], _env())
    assert joined.finish() == 0, "".join(joined.lines[-40:])
    assert job.finish() == 0, "".join(job.lines[-60:])
    got = json.loads(out.read_text())
    _close(got["losses"], want, steps)
    return "".join(job.lines), got, joined.lines


def test_shrink_dp_x_tp_then_grow(tmp_path):
    """DP=2 x TP=2; the process of rank 3 dies at step 4: the TP group it was in re-forms
    from the survivors' pieces and the snapshot's, as DP=1 x TP=2 (a spare ends); two ranks
    join: DP=2 x TP=2 again, the joiners' pieces from their peers. Every step's loss equals
    the single-process run's."""
    steps = 20
    text, got, joined = _shrink_then_grow(tmp_path, steps, ["-n", "4", "--axes", "dp=2,tp=2", "--elastic", "2:8"],
                                          kill="3:4", joiners=2)
    assert "epoch 2: {'dp': 1, 'tp': 2} (0->0, 1->1); 1 spare ended" in text, text[-3000:]
    assert "epoch 3: {'dp': 2, 'tp': 2} (0->0, 1->1, new->2, new->3)" in text, text[-3000:]
    assert got["axes"] == {"dp": 2, "tp": 2} and got["epoch"] == 3
    assert "the in-memory snapshot of step 4" in got["resizes"][0]   # the interrupted step, redone
    assert any("epoch 3 rank 3/4" in line for line in joined)  # a joiner trained


def test_tp_shrinks_to_one_process_and_grows_back(tmp_path):
    """TP=2 alone (`--elastic 1:4`): the process of rank 1 dies at step 3, and rank 0 goes
    on alone (TP=1: every piece of the lost rank's half from the snapshot); one rank joins
    and the mesh is TP=2 again. Same losses as one process."""
    text, got, _ = _shrink_then_grow(tmp_path, 14, ["-n", "2", "--axes", "tp=2", "--elastic", "1:4"], kill="1:3",
                                     joiners=1)
    assert "epoch 2: {'tp': 1} (0->0)" in text and "epoch 3: {'tp': 2} (0->0, new->1)" in text, text[-3000:]
    assert got["axes"] == {"tp": 2} and got["epoch"] == 3


def test_shrink_dp_uneven(tmp_path):
    """DP=4 loses a rank: DP=3, the global batch of 8 rows split 3/3/2; same losses."""
    steps = 8
    want = _reference(tmp_path, steps)
    out = tmp_path / "got.json"
    job = Job(["-n", "4", "--axes", "dp=4", "--elastic", "2:8", SCRIPT, "--steps", str(steps), "--kill", "1:3",
               "--out", str(out)], _env())
    assert job.finish() == 0, "".join(job.lines[-60:])
    got = json.loads(out.read_text())
    _close(got["losses"], want, steps)
    assert got["axes"] == {"dp": 3}


def test_a_hung_rank_is_lost_at_the_heartbeat_bound(tmp_path):
    """DP=2: the process of rank 1 stops (SIGSTOP) at step 3, its sockets open: the
    coordinator declares it lost once its heartbeats are 3 s late, and rank 0 goes on alone
    from the snapshot (the stopped process's store part cannot answer; the replica of its
    pieces on rank 0 is read instead). Same losses; the launcher ends the stopped process."""
    steps = 8
    want = _reference(tmp_path, steps)
    out = tmp_path / "got.json"
    job = Job(["-n", "2", "--axes", "dp=2", "--elastic", "1:4", SCRIPT, "--steps", str(steps), "--kill", "1:3",
               "--hang", "--out", str(out)], _env())
    assert job.finish() == 0, "".join(job.lines[-60:])
    text = "".join(job.lines)
    assert "no Heartbeat for" in text and "epoch 2: {'dp': 1} (0->0)" in text, text[-3000:]
    got = json.loads(out.read_text())
    _close(got["losses"], want, steps)


def test_below_the_minimum_ends_every_rank(tmp_path):
    """Two ranks, at least two: losing one leaves too few; the survivor ends with E1010
    naming the ranks and the step, never a hang."""
    job = Job(["-n", "2", "--axes", "dp=2", "--elastic", "2:4", SCRIPT, "--steps", "8", "--kill", "1:2"], _env())
    code = job.finish()
    text = "".join(job.lines)
    assert code != 0
    assert "E1010" in text and "at step 2" in text and "needs at least 2" in text, text[-3000:]


def test_a_second_failure_during_the_resize(tmp_path):
    """DP=2 x TP=2: rank 3 dies at step 4, and rank 2 dies as the resize starts, before it
    published its snapshot pieces. Whether the state survives depends on where the pieces'
    replicas were and how far the puts got when the processes died: either the two
    survivors go on with exactly the losses of one process, or each ends with E1010 naming
    the step and the rank it was; never a hang, never a wrong loss."""
    steps = 12
    want = _reference(tmp_path, steps)
    out = tmp_path / "got.json"
    job = Job(["-n", "4", "--axes", "dp=2,tp=2", "--elastic", "2:8", SCRIPT, "--steps", str(steps), "--kill", "3:4",
               "--die-resizing", "2", "--out", str(out)], _env())
    code = job.finish()
    text = "".join(job.lines)
    if code == 0:
        got = json.loads(out.read_text())
        _close(got["losses"], want, steps)
        assert got["axes"] == {"dp": 1, "tp": 2}, got
        return
    ended = [line for line in job.lines if "E1010" in line and "the resize at step 4 failed" in line]
    assert {line.split("]")[0] for line in ended} >= {"[rank 0", "[rank 1"}, text[-3000:]
    assert all("this process was rank" in line for line in ended), text[-3000:]


def _coordinator(env: dict[str, str], *args: str) -> tuple[subprocess.Popen, str]:
    """`dtm coordinator` in its own process, and the address it listens at."""
    coord = subprocess.Popen([DTM, "coordinator", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env)
    line = ""
    for _ in range(20):  # (a log line or two come first)
        line = coord.stdout.readline()
        if " listening at " in line or not line:
            break
    assert " listening at " in line, line
    return coord, line.split(" listening at ")[1].split()[0]


def test_coordinator_killed_then_a_rank(tmp_path):
    """DP=2 x TP=2 with the coordinator in its own process (`dtm coordinator --elastic`);
    SIGKILL it mid-training: the ranks agree on it at a step boundary, rank 0 runs the
    successor, everyone reconnects to it (epoch 2, same shape). Then rank 3 dies: the
    successor resizes the mesh to DP=1 x TP=2 (epoch 3). Every step's loss equals the
    single-process run's.

    Rank 3 dies 9 steps into epoch 2, so the snapshot in hand is in slot 0, where the
    snapshot adopted at the start of epoch 2 was (slots go round 0, 1, 2), and rank 1, which
    holds the only live copies of rank 1's and rank 3's blobs, publishes them 1 s late, each:
    rank 0 must wait for them. (It once found the adopted snapshot's blobs under the same
    keys and restored a mix of two steps, one CI run in many.)"""
    steps = 20
    want = _reference(tmp_path, steps)
    out = tmp_path / "got.json"
    env = _env(DTM_TOKEN="elastic-test-token")
    coord, address = _coordinator(env, "--world-size", "4", "--axes", "dp=2,tp=2", "--elastic", "2:8")
    try:
        job = Job(["-n", "4", "--coordinator", address, "--axes", "dp=2,tp=2", "--elastic", "2:8", SCRIPT,
                   "--steps", str(steps), "--kill", "3:+9:2", "--slow-publish", "1:1", "--sleep", "0.3",
                   "--out", str(out)], env)
        job.wait_for("step 2 ", 120)
        coord.send_signal(signal.SIGKILL)
        code = job.finish()
    finally:
        coord.kill()
        coord.wait()
    text = "".join(job.lines)
    assert code == 0, text[-3000:]
    assert "this rank runs its successor at" in text, text[-3000:]
    got = json.loads(out.read_text())
    _close(got["losses"], want, steps)
    assert got["epoch"] == 3 and got["axes"] == {"dp": 1, "tp": 2}, got
    assert "the coordinator was lost" in got["resizes"][0] and got["resizes"][1].startswith("Resized(epoch=3"), got


def test_coordinator_killed_without_the_policy(tmp_path):
    """Ranks not told the job's elastic policy (launched without --elastic) cannot run a
    successor: when the coordinator's process is killed each rank ends at its next step
    boundary with E1010 naming the cause, within the heartbeat bound."""
    env = _env(DTM_TOKEN="elastic-test-token")
    coord, address = _coordinator(env, "--world-size", "2", "--axes", "dp=2", "--elastic", "2:4")
    try:
        job = Job(["-n", "2", "--coordinator", address, SCRIPT, "--steps", "200", "--sleep", "0.2"], env)
        job.wait_for("step 2 ", 120)
        coord.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = job.finish(60)
        took = time.monotonic() - killed
    finally:
        coord.kill()
        coord.wait()
    text = "".join(job.lines)
    assert code != 0 and took < 30
    assert text.count("E1010") >= 2 and "is gone" in text and "not told the job's elastic policy" in text, \
        text[-3000:]
