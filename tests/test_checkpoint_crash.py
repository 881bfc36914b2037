"""A checkpoint save killed at any moment (spec 9.4): 20 times, a process that saves one
step after another (keep=2) is SIGKILLed after a random delay (every other time counted
from its first completed save, so that a loaded machine still makes progress); every
checkpoint `list` shows is complete (verify passes), `load` takes the newest one with
exactly its values, and the next process saves on from there."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np

TIMEOUT_S = 60  # a saver's start, or one save, on a loaded machine

SAVER = r'''
import sys
import numpy as np
import dtm

root, first = sys.argv[1], int(sys.argv[2])
print("ready", flush=True)
for step in range(first, first + 1000):
    state = {"w": dtm.tensor(np.full((256, 256), step, np.float32)),
             "b": dtm.tensor(np.arange(1000, dtype=np.int64) + step), "step": step}
    dtm.checkpoint.save(state, root, step=step, keep=2).wait()
    print("saved", step, flush=True)
'''


def test_kills_at_random_moments_leave_the_newest_complete_checkpoint(tmp_path):
    import dtm

    root = str(tmp_path / "run")
    rng = np.random.default_rng(0)
    newest = -1
    for i in range(20):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, root, str(newest + 1)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
        try:
            assert lines.get(timeout=TIMEOUT_S).strip() == "ready"
            if i % 2:  # every other kill comes after a save went through: on a loaded machine one save
                assert lines.get(timeout=TIMEOUT_S).startswith("saved")  # may outlast every delay below
            time.sleep(float(rng.uniform(0.0, 0.4)))
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=TIMEOUT_S)
        steps = [c.step for c in dtm.checkpoint.list(root)]
        assert steps == sorted(steps) and len(steps) <= 3  # keep=2, and one more a kill may leave
        if not steps:
            continue
        assert steps[-1] >= newest  # nothing complete was lost
        newest = steps[-1]
        for step in steps:
            assert dtm.checkpoint.verify(root, step=step).ok
        state = {"w": dtm.zeros(256, 256), "b": dtm.zeros(1000, dtype=dtm.int64), "step": None}
        dtm.checkpoint.load(state, root)
        assert state["step"] == newest
        np.testing.assert_array_equal(state["w"].numpy(), np.full((256, 256), newest, np.float32))
        np.testing.assert_array_equal(state["b"].numpy(), np.arange(1000) + newest)
    assert newest >= 5  # the saves did get somewhere between the kills
