"""What stops a checkpoint save before it can hurt one already on disk (spec 9.4.3): a save
into a root another job is saving into, a disk too small for the checkpoint (refused before
anything is written), a disk that fills during the save; and the per-rank byte quota of the
mesh's store (DTM_STORE_QUOTA, `dtm launch --store-quota`). In each case the earlier
checkpoint stays loadable and the error says so."""

from __future__ import annotations

import errno
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import dtm
from dtm.errors import ErrorCode

ROOT = pathlib.Path(__file__).resolve().parent.parent
WAIT_S = 60  # a subprocess starting dtm on a loaded 2-core machine

# A job that starts a save of step 2 and stays inside it (its write of the first tensor
# sleeps), as a long save of another job would.
SLOW_SAVER = r'''
import sys, time
import numpy as np
import dtm
from dtm.store.store import Store

real = Store.put_array
def slow(self, *a, **k):
    print("saving", flush=True)
    time.sleep(120)
    return real(self, *a, **k)
Store.put_array = slow
dtm.checkpoint.save({"w": np.ones(4, np.float32)}, sys.argv[1], step=2).wait()
'''


def _steps(root) -> list[str]:
    """The step directories under `root` (beside them: the save lock, `.save.lock`)."""
    return sorted(n for n in os.listdir(root) if not n.startswith("."))


def _saved(root, step: int, value: float) -> None:
    dtm.checkpoint.save({"w": np.full(4, value, np.float32)}, root, step=step).wait()


def _loads(root, value: float, step: int) -> None:
    state = {"w": np.zeros(4, np.float32)}
    dtm.checkpoint.load(state, root)
    np.testing.assert_array_equal(state["w"], np.full(4, value, np.float32))
    assert [c.step for c in dtm.checkpoint.list(root)][-1] == step


def test_a_save_into_a_root_another_job_is_saving_into_is_refused(tmp_path):
    root = tmp_path / "run"
    _saved(root, 1, 1.0)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    other = subprocess.Popen([sys.executable, "-c", SLOW_SAVER, str(root)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        line = other.stdout.readline()  # (bounded: the job's put sleeps only after printing)
        assert line.strip() == "saving", other.stderr.read()[-3000:]
        with pytest.raises(dtm.DTMError) as e:
            dtm.checkpoint.save({"w": np.full(4, 3.0, np.float32)}, root, step=3).wait()
        assert e.value.code is ErrorCode.CHECKPOINT_BUSY
        assert f"process {other.pid}" in e.value.message and "step 2" in e.value.message, e.value.message
        assert "earlier checkpoints are kept" in e.value.message
        with pytest.raises(dtm.DTMError) as e:  # the same step too: its unfinished directory is the other's
            dtm.checkpoint.save({"w": np.full(4, 3.0, np.float32)}, root, step=2).wait()
        assert e.value.code is ErrorCode.CHECKPOINT_BUSY
    finally:
        other.kill()
        other.wait(WAIT_S)
    _loads(root, 1.0, 1)
    _saved(root, 2, 2.0)  # the killed job's lock went with it; its unfinished step 2 is replaced
    _loads(root, 2.0, 2)


def test_a_checkpoint_larger_than_the_free_disk_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    root = tmp_path / "run"
    _saved(root, 1, 1.0)
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(dtm.DTMError) as e:
        dtm.checkpoint.save({"w": np.ones(100_000, np.float32)}, root, step=2).wait()
    assert e.value.code is ErrorCode.STORE_IO_ERROR
    assert "400,000 bytes" in e.value.message and "1,000 bytes free" in e.value.message, e.value.message
    assert "earlier checkpoints are kept" in e.value.message
    assert _steps(root) == ["step-000000000001"]


def test_a_disk_that_fills_during_the_save_leaves_the_earlier_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "run"
    _saved(root, 1, 1.0)
    from dtm.store.store import Store

    real, calls = Store.put_array, []

    def fills(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(root))
        return real(self, *a, **k)

    monkeypatch.setattr(Store, "put_array", fills)
    with pytest.raises(dtm.DTMError) as e:
        dtm.checkpoint.save({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}, root, step=2).wait()
    assert e.value.code is ErrorCode.STORE_IO_ERROR
    assert "No space left on device" in e.value.message and "earlier checkpoints are kept" in e.value.message
    assert _steps(root) == ["step-000000000001"]  # the unfinished step is gone
    _loads(root, 1.0, 1)


FULL_DISK = r'''
import sys
import numpy as np
import dtm

root = sys.argv[1] + "/run"
dtm.checkpoint.save({"w": np.ones(4, np.float32)}, root, step=1).wait()
dtm.checkpoint.save({"w": np.full(1 << 18, 1.5, np.float32)}, root, step=2).wait()   # 1 MiB: fits
try:
    dtm.checkpoint.save({"w": np.ones(3 << 18, np.float32)}, root, step=3).wait()    # 3 MiB beside it: not
    raise SystemExit("a checkpoint larger than the disk was saved")
except dtm.DTMError as e:
    assert e.code is dtm.ErrorCode.STORE_IO_ERROR and "earlier checkpoints are kept" in e.message, e
assert [c.step for c in dtm.checkpoint.list(root)] == [1, 2]
state = {"w": np.zeros(1 << 18, np.float32)}
dtm.checkpoint.load(state, root)
assert (state["w"] == 1.5).all()
print("ok")
'''


def test_a_real_full_disk(tmp_path):
    """A 4 MiB tmpfs, mounted in a mount namespace of the test's own (no root needed where
    user namespaces are allowed): a checkpoint of 1 MiB fits, one of 3 MiB beside it does not."""
    mount = "mount -t tmpfs -o size=4m none \"$1\" && shift && exec \"$@\""
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", mount, "sh", str(tmp_path), "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace for a small tmpfs here: {probe.stderr.decode()[-200:]}")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(["unshare", "-rm", "sh", "-c", mount, "sh", str(tmp_path), sys.executable, "-c", FULL_DISK,
                          str(tmp_path)], env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


QUOTA_JOB = r'''
import numpy as np
import dtm

dtm.init()
st = dtm.store.mesh(replicas=1)
me = dtm.rank()
st.put(f"small/{me}", np.ones(1000, np.float32))           # 4 KB: fits
try:
    st.put(f"big/{me}", np.ones(400_000, np.float32))      # 1.6 MB past the 1 MB quota
    raise SystemExit("a put past the store quota was kept")
except dtm.DTMError as e:
    assert e.code is dtm.ErrorCode.STORE_QUOTA_EXCEEDED, e
    assert "1,600,000 bytes" in e.message and "quota" in e.message and "in use" in e.message, e.message
    print("refused:", e.message, flush=True)
dtm.distributed.barrier()
assert st.get(f"small/{me}").sum() == 1000
print("ok", flush=True)
'''


def test_launch_gives_every_rank_a_store_quota(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(QUOTA_JOB)
    env = dict(os.environ, PYTHONPATH=str(ROOT), DTM_HOST="127.0.0.1")
    env.pop("DTM_STORE_QUOTA", None)
    out = subprocess.run([sys.executable, "-m", "dtm.cli", "launch", "-n", "2", "--store-quota", "1M", str(job)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("ok") == 2 and out.stdout.count("refused:") == 2, out.stdout


def test_a_long_save_shows_its_progress_on_stderr(tmp_path, monkeypatch, capsys):
    """`progress=True`: once the save has run AFTER_S (here 0), a bar of the bytes written
    on stderr, ending at the checkpoint's whole size."""
    import time

    from dtm.ckpt import progress
    from dtm.store.store import Store

    monkeypatch.setattr(progress, "AFTER_S", 0.0)
    real = Store.put_array
    monkeypatch.setattr(Store, "put_array", lambda *a, **k: time.sleep(0.3) or real(*a, **k))
    state = {f"t{i}": np.ones(25_000, np.float32) for i in range(4)}  # 4 x 100 kB
    dtm.checkpoint.save(state, tmp_path / "run", step=1, progress=True).wait()
    time.sleep(0.5)  # (the bar's last refresh, on its own thread)
    err = capsys.readouterr().err
    assert "checkpoint step 1" in err and "400.0" in err and "kB" in err, err
