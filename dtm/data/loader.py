"""`dtm.data.Loader`: batches of token windows from an ingest's shards, for a training loop.

    loader = dtm.data.Loader(st, "corpus", batch_size=8, block_size=256, shuffle=True, seed=1)
    for step, (x, y) in zip(range(steps), loader):   # x, y: [8, 256] int64; y is x shifted by one
        ...

What a batch is (nanoGPT's get_batch, made repeatable): each 1-D token shard is cut into
non-overlapping windows of `block_size + 1` tokens, starting every `block_size` tokens
(windows never cross shards: a shard is a document). Batch `i` takes windows
`i*B ... i*B + B-1` of the run of epochs over them; with `shuffle`, each epoch's order is a
permutation seeded by (seed, epoch), else the windows' own order. So batch `i` is a pure
function of the manifest, `seed` and `i`: a Loader made again (another process, after a
restart) with `start=i` yields exactly the batches the first one yielded from step `i` on.

A background thread prepares the next `prefetch` batches while the loop trains. Batches are
dtm Tensors (int64), or numpy arrays with `numpy=True`. Each batch yielded counts as one
step in this process's activity (its heartbeats' ops_done when it is a rank).
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..cluster.activity import activity
from ..errors import DTMError, ErrorCode as E
from .errors import DataError
from .manifest import Manifest, load

PREFETCH = 2
WAIT_S = 60.0  # the longest a consumer waits for one batch (a stuck store read ends in E0802)

# What batches are wrapped in. dtm/data sits below the user-facing API (docs/architecture.md, layer 8),
# so `dtm/__init__.py` installs `Tensor.from_numpy` here; until then batches are numpy.
_tensor_factory: Callable[[np.ndarray], Any] = lambda a: a


def set_tensor_factory(factory: Callable[[np.ndarray], Any]) -> None:
    """Install what the loader wraps each batch's arrays in (unless it was made with
    numpy=True); `dtm/__init__.py` installs Tensor.from_numpy."""
    global _tensor_factory
    _tensor_factory = factory


class Loader:
    """See the module doc. `store`: a Store, a path or URL, or None for the current store."""

    def __init__(self, store, prefix: str, batch_size: int, block_size: int = 256, *, shuffle: bool = True,
                 seed: int = 0, start: int = 0, prefetch: int = PREFETCH, numpy: bool = False,
                 timeout: float = WAIT_S):
        from .. import store as stores

        if batch_size < 1 or block_size < 1 or start < 0 or prefetch < 1:
            raise DataError(E.ATTRIBUTE_VALUE, f"batch_size={batch_size}, block_size={block_size}, start={start}, "
                                               f"prefetch={prefetch}: the sizes must be >= 1 and start >= 0")
        st = stores.current() if store is None else \
            stores.open(store) if isinstance(store, (str, os.PathLike)) else store
        self.prefix, self.batch_size, self.block_size = prefix.rstrip("/"), batch_size, block_size
        self.shuffle, self.seed, self.numpy, self.timeout = shuffle, seed, numpy, timeout
        self.manifest: Manifest = load(st, self.prefix)
        self._tokens = [self._shard(st, s) for s in self.manifest.shards]
        per_shard = np.array([max(len(t) - 1, 0) // block_size for t in self._tokens], np.int64)
        self._ends = np.cumsum(per_shard)   # window g lies in shard searchsorted(ends, g, "right")
        self.windows = int(self._ends[-1]) if len(self._ends) else 0
        if self.windows < batch_size:
            raise DataError(E.DATA_TOO_SMALL, f"{self.prefix!r} holds {self.manifest.elements} tokens in "
                                              f"{len(self._tokens)} shard(s): {self.windows} window(s) of "
                                              f"{block_size + 1} tokens, fewer than one batch of {batch_size}")
        self._perms: dict[int, np.ndarray] = {}
        self.step = start   # the next batch __next__ yields
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _shard(self, st, s) -> np.ndarray:
        from ..store import KeyMissing

        where = f"{self.prefix!r}: shard {s.key!r} (from {s.source})"
        try:
            info = st.info(s.key)
        except KeyMissing:
            raise DataError(E.DATA_MANIFEST_MISSING, f"{where} is listed in the manifest but not stored") from None
        if info.checksum != s.checksum or tuple(info.shape) != s.shape:
            raise DataError(E.DATA_MANIFEST_INVALID, f"{where} was replaced after the manifest was written")
        a = st.get_array(s.key)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise DataError(E.DATA_MANIFEST_INVALID, f"{where} holds {info.dtype}{list(info.shape)}: the loader reads "
                                                     "1-D integer token shards")
        return a

    # --- batches as pure functions of their index --------------------------------------------------

    def _order(self, epoch: int) -> np.ndarray | None:
        if not self.shuffle:
            return None
        if epoch not in self._perms:
            if len(self._perms) > 2:   # batches straddle at most two epochs
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
        return self._perms[epoch]

    def batch(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch `i` as numpy (x, y), each [batch_size, block_size] int64."""
        idx = np.arange(i * self.batch_size, (i + 1) * self.batch_size, dtype=np.int64)
        epochs, pos = np.divmod(idx, self.windows)
        windows = pos.copy()
        for e in np.unique(epochs):
            order = self._order(int(e))
            if order is not None:
                windows[epochs == e] = order[pos[epochs == e]]
        shards = np.searchsorted(self._ends, windows, side="right")
        starts = (windows - np.concatenate(([0], self._ends))[shards]) * self.block_size
        rows = np.stack([self._tokens[s][o:o + self.block_size + 1] for s, o in zip(shards, starts)])
        rows = rows.astype(np.int64)
        return rows[:, :-1], rows[:, 1:]

    # --- iterating, with a prefetching thread ---------------------------------------------------------

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, args=(self.step,), name="dtm-loader", daemon=True)
            self._thread.start()
            _prefetching.add(self)
        try:
            i, item = self._queue.get(timeout=self.timeout)
        except queue.Empty:
            raise DTMError(E.TIMEOUT, f"loader {self.prefix!r}: batch {self.step} was not ready within "
                                      f"{self.timeout:g} s") from None
        if isinstance(item, BaseException):
            raise item
        self.step = i + 1
        a = activity()
        a.items += 1
        a.bytes_read += item[0].nbytes + item[1].nbytes
        return item if self.numpy else (_tensor_factory(item[0]), _tensor_factory(item[1]))

    def _produce(self, i: int) -> None:
        while not self._stop.is_set():
            try:
                item: object = self.batch(i)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put((i, item), timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            i += 1

    # --- resuming (a checkpoint's state holds the loader: spec 9.4) -------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The next batch's index and what fixes the order of the batches: a loader made
        alike and given this yields the batches this one yields next."""
        return {"step": self.step, "batch_size": self.batch_size, "block_size": self.block_size,
                "shuffle": self.shuffle, "seed": self.seed, "windows": self.windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from `state` (from `state_dict()`): the next batch is batch `state["step"]`.
        E0306 when the saved order is not this loader's (another batch size, block size,
        shuffle, seed or number of windows would yield other batches)."""
        mine = self.state_dict()
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise DataError(E.ATTRIBUTE_VALUE, f"loader {self.prefix!r}: load_state_dict expects a dict with an int "
                                               f"'step' >= 0, found {str(state)[:120]}")
        differ = {k: (state.get(k), v) for k, v in mine.items() if k != "step" and state.get(k) != v}
        if differ:
            raise DataError(E.ATTRIBUTE_VALUE, f"loader {self.prefix!r}: the saved state yields other batches than "
                            "this loader: " + ", ".join(f"{k} saved {a!r}, here {b!r}" for k, (a, b) in differ.items()))
        self.close()  # batches prefetched from the old position are dropped
        self._queue = queue.Queue(maxsize=self._queue.maxsize)
        self._stop = threading.Event()
        self._thread = None
        self.step = step

    def close(self) -> None:
        """Stop the prefetching thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        _prefetching.discard(self)

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Loaders whose prefetching thread runs. At exit each is stopped before the interpreter
# finalizes: a daemon thread still inside numpy's C++ code (np.unique's sort) is then ended
# by pthread_exit, whose unwinding through a noexcept frame aborts the whole process
# ("terminate called without an active exception", about one exit in thirty).
_prefetching: "weakref.WeakSet[Loader]" = weakref.WeakSet()


@atexit.register
def _stop_prefetching() -> None:
    for loader in list(_prefetching):
        loader.close()
