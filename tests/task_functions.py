"""Task functions for tests/test_tasks*.py that worker processes import by name (a test
module's own functions would do too; these keep the worker's imports small)."""

import os
import signal
import time

import numpy as np


def scale(a):
    """Python-heavy work on a worker process: plain numpy on the Tensor's values."""
    return np.asarray(a) * 2.0


def split(a):
    x = np.asarray(a)
    return x[: len(x) // 2].copy(), x[len(x) // 2:].copy()


def boom(a):
    raise ValueError("bad token in the input")


def die_once(a):
    """SIGKILL its own worker the first time (a marker file remembers), then add one."""
    marker = os.environ["DTM_TEST_MARKER"]
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return np.asarray(a) + 1.0


def die(a):
    os.kill(os.getpid(), signal.SIGKILL)


def hang(a):
    time.sleep(120)
    return a


def slow(a):
    time.sleep(0.3)
    return np.asarray(a) + 1.0


# Compiled tasks (traced with dtm.jit on dtm Tensors; tests/test_tasks_ray.py)

def mix(x, w):
    h = x @ w
    return h * h + 1.0, h.sum(dim=1)


def plus_one(a):
    return a + 1.0


def mul(a, b):
    return a * b


# A program with its own store_get / store_put (tests/test_tasks.py, ray_tasks_script.py):
# its task must read `hparams/w` (FRESH) from its graph's store, whatever the default holds.
STORE_MODULE = """\
dtm 1.0
func @load() -> (f32[2]) {
  %w = store_get {key = "hparams/w"} : f32[2]
  %y = add %w, %w : f32[2]
  store_put %w {key = "seen/w"}
  return %y
}
task @read = @load {inputs = [], outputs = ["out"]}
"""
FRESH = np.array([1.0, 2.0], np.float32)


def doubled_from_current_store():
    """Reads `hparams/w` from dtm.store.current(): the task's graph's store, wherever it runs."""
    import dtm

    return np.asarray(dtm.store.current().get_array("hparams/w")) * 2.0


def parent_pid(a):
    """The pid of its worker's parent: the fork server's, not the graph's process."""
    return np.array([os.getppid()], np.int64)


def environment_marker(a):
    """$DTM_TEST_MARKER as its worker sees it, as bytes."""
    return np.frombuffer(os.environ["DTM_TEST_MARKER"].encode(), np.uint8)
