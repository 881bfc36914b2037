"""What a killed rank leaves on its host (dtm/cluster/leftovers.py): a directory its rank
claimed goes once its owner no longer runs, never while it runs, and never one nobody
claimed or one claimed in another PID namespace."""

from __future__ import annotations

import os
import subprocess
import sys

from dtm.cluster.leftovers import OWNER, RUN_ENV, claim, remove_noted, remove_orphans, scratch_base


def _ended_pid() -> int:
    """The id of a process that has ended (and was reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(60)
    return p.pid


def _claimed_by(path, pid: int, namespace: str | None = None) -> None:
    """A directory claimed as a rank claims its part, then its record made to name `pid`
    (and `namespace`)."""
    path.mkdir(parents=True)
    claim(str(path))
    ns = namespace or (path / OWNER).read_text().split()[1]
    (path / OWNER).write_text(f"{pid} {ns}\n")


def test_only_the_directories_of_owners_that_ended_go(tmp_path):
    dead = _ended_pid()
    _claimed_by(tmp_path / "dtmA_store" / "rank-0", dead)
    _claimed_by(tmp_path / "dtmA_store" / "rank-1", dead)
    _claimed_by(tmp_path / "dtmB_store" / "rank-0", dead)
    _claimed_by(tmp_path / "dtmB_store" / "rank-1", os.getpid())      # its owner runs
    _claimed_by(tmp_path / "dtmC_store" / "rank-0", dead, "pid:[1]")  # another PID namespace
    (tmp_path / "dtmD_store" / "rank-0").mkdir(parents=True)           # nobody claimed it
    _claimed_by(tmp_path / "other" / "rank-0", dead)                   # not a dtm directory
    (tmp_path / "dtmE_segment").write_bytes(b"a shared-memory segment")
    removed = remove_orphans(str(tmp_path))
    assert sorted(os.path.relpath(p, tmp_path) for p in removed) == ["dtmA_store/rank-0", "dtmA_store/rank-1",
                                                                   "dtmB_store/rank-0"]
    assert not (tmp_path / "dtmA_store").exists()  # emptied: removed with its last part
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("*/rank-*"))
    assert left == ["dtmB_store/rank-1", "dtmC_store/rank-0", "dtmD_store/rank-0", "other/rank-0"]
    assert (tmp_path / "dtmE_segment").exists()
    assert remove_orphans(str(tmp_path / "missing")) == []


def test_a_claim_names_this_process_and_the_base_follows_the_environment(tmp_path, monkeypatch):
    (tmp_path / "part").mkdir()
    claim(str(tmp_path / "part"))
    pid, ns = (tmp_path / "part" / OWNER).read_text().split()
    assert int(pid) == os.getpid() and ns == os.readlink("/proc/self/ns/pid")
    assert [p.name for p in (tmp_path / "part").iterdir()] == [OWNER]  # no temporary name left
    monkeypatch.setenv("DTM_MESH_STORE", str(tmp_path))
    assert scratch_base() == str(tmp_path)


def test_a_launcher_removes_what_its_ranks_claimed_wherever_it_lies_but_never_a_live_one(tmp_path, monkeypatch):
    """Issue 29: a part in a base the launcher does not know stayed. Each directory a rank
    of the run claims is noted in the run's directory; the launcher removes those whose
    owner does not run (the owner record gone too: a peer's last read put files back after
    its rank removed it), and nothing that the run did not note."""
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv(RUN_ENV, str(run))
    dead, live, emptied = tmp_path / "a" / "dtmA_store" / "rank-0", tmp_path / "b" / "dtmB_store" / "rank-1", \
        tmp_path / "a" / "dtmA_store" / "rank-2"
    _claimed_by(dead, _ended_pid())
    _claimed_by(live, os.getpid())
    _claimed_by(emptied, _ended_pid())
    (emptied / OWNER).unlink()
    monkeypatch.delenv(RUN_ENV)
    outside = tmp_path / "a" / "dtmC_store" / "rank-0"
    _claimed_by(outside, _ended_pid())  # claimed by a rank of no launcher's run: noted nowhere
    assert sorted(remove_noted(str(run))) == sorted([str(dead), str(emptied)])
    assert not (tmp_path / "a" / "dtmA_store").exists() and live.exists()
    assert outside.exists() and len(list(run.iterdir())) == 3  # the run's three claims, noted
    assert remove_noted(str(tmp_path / "no-run")) == []
