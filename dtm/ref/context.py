"""The execution context of the reference interpreter: who this rank is, where it sits on
each mesh, its tensor store, and how it talks to the other ranks.

The tensor store is the process's (spec 9.2): `dtm.store` (layer 8) binds its `current`
here with `bind_process_store`, because this layer may not import it; a context may carry
its own store instead (a test's private `memory://` store).

Group semantics (normative, spec "Collectives"): a rank's coordinates on a mesh are its
index unravelled row-major over the mesh's axes. The group of a rank for `axes` is every
rank that shares its coordinates on each mesh axis *not* in `axes`; a member's index within
the group is its coordinates on `axes` raveled row-major in the order `axes` lists them.
So on a 2 x 2 mesh [dp, tp], rank 3 = (1, 1) has group [2, 3] for ["tp"], [1, 3] for
["dp"], [0, 1, 2, 3] for ["dp", "tp"] and [0, 2, 1, 3] for ["tp", "dp"].
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from ..errors import DTMError, ErrorCode as E
from ..ir.dtypes import DType
from ..ir.types import Mesh

DEFAULT_TIMEOUT_S = 60.0


class Comm(Protocol):
    """What the reference ops need from a device group. Ranks are global (row-major over
    the mesh); `group` lists the global ranks of one group in group order."""

    def collective(self, name: str, attrs: dict, x: np.ndarray, group: tuple[int, ...], index: int, rank: int,
                   timeout: float) -> np.ndarray | None:
        """This rank's result of IR collective `name` (with the op's `attrs`) over `group`,
        of which it is member `index`: what `collectives.result` gives for every member's
        operand. Blocks until the whole group has called it; raises DTMError: TIMEOUT after
        `timeout` seconds, COLLECTIVE_MISMATCH when the members' calls differ."""
        ...

    def send(self, src: int, dst: int, x: np.ndarray, timeout: float) -> None:
        """Queue a copy of `x` for `dst`; returns without waiting for the receiver."""
        ...

    def recv(self, src: int, dst: int, timeout: float) -> np.ndarray:
        """The oldest tensor `src` queued for `dst` (FIFO per ordered pair of ranks)."""
        ...


class TensorStore(Protocol):
    """What store_get / store_put need from a tensor store (dtm.store.Store has more).
    Both raise DTMError subclasses naming the key: E0804 missing, E0402 / E0403 another type."""

    def get_array(self, key: str, dtype: DType | None = None, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The array under `key`, checked to be of `dtype` and `shape` (logical: quantized
        types come as their uint8 block storage)."""
        ...

    def put_array(self, key: str, a: np.ndarray, dtype: DType | str | None = None) -> object:
        """Store a copy of `a` under `key` as `dtype` (default: a's own), replacing any earlier one."""
        ...


_process_store: Callable[[], TensorStore] | None = None


def bind_process_store(current: Callable[[], TensorStore]) -> None:
    """Make `current()` the store every context without its own store reads and writes."""
    global _process_store
    _process_store = current


def process_store() -> TensorStore:
    """The process's tensor store (what dtm.store.current() returns)."""
    assert _process_store is not None, "dtm/__init__.py binds dtm.store.current before any program runs"
    return _process_store()


class Mailbox:
    """Point-to-point queues between ranks of one process: FIFO per ordered pair (src, dst).
    `send` never blocks (it is buffered); `recv` waits up to `timeout` seconds."""

    def __init__(self):
        self._queues: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self._cond = threading.Condition()
        self.aborted: str | None = None  # set by the device group when a rank fails

    def send(self, src: int, dst: int, x: np.ndarray, timeout: float) -> None:
        with self._cond:
            self._queues[(src, dst)].append(np.array(x, copy=True))
            self._cond.notify_all()

    def recv(self, src: int, dst: int, timeout: float) -> np.ndarray:
        deadline = time.monotonic() + timeout
        with self._cond:
            queue = self._queues[(src, dst)]
            while not queue:
                left = deadline - time.monotonic()
                if self.aborted is not None:
                    raise DTMError(E.TIMEOUT, f"recv on rank {dst} from rank {src}: abandoned, {self.aborted}")
                if left <= 0:
                    raise DTMError(E.TIMEOUT, f"recv on rank {dst}: nothing arrived from rank {src} "
                                   f"in {timeout:g} s")
                self._cond.wait(left)
            return queue.popleft()

    def abort(self, reason: str) -> None:
        with self._cond:
            self.aborted = reason
            self._cond.notify_all()


@dataclass
class RefContext:
    """Per-rank state of one reference execution.

    rank:    this rank's global index (row-major over the mesh's axes); 0 on one device.
    meshes:  the meshes collectives name; `run` fills it from the module when empty.
    store:   the tensor store that store_get / store_put read and write; None: the process's
             (`process_store()`, looked up at each op so that dtm.store.use takes effect).
    comm:    the device group; None on a single device, where only groups of one work.
    timeout: seconds a collective or recv waits before raising DTMError (TIMEOUT).
    module:  the module being run (set by `run`; `call` runs its other functions).
    check_memory: called as check_memory(nbytes, what) before an op allocates a result of a
             type not met earlier in the run, to refuse it when the machine lacks the memory
             (the runtime passes its probe of free memory, a less basic layer's); None: only
             the system's refusal, numpy's MemoryError, is reported (E0810).
    """

    rank: int = 0
    meshes: dict[str, Mesh] = field(default_factory=dict)
    store: TensorStore | None = None
    comm: Comm | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    module: object | None = None
    check_memory: Callable[[int, str], None] | None = None
    _mailbox: Mailbox | None = field(default=None, repr=False)

    def p2p(self) -> Comm:
        """Where send and recv go: the device group, or on one device a private mailbox
        (so a rank can send to itself; a recv with nothing queued times out at once)."""
        if self.comm is not None:
            return self.comm
        if self._mailbox is None:
            self._mailbox = Mailbox()
        return _SelfMailbox(self._mailbox)

    def tensor_store(self) -> TensorStore:
        return self.store if self.store is not None else process_store()

    def mesh(self, name: str) -> Mesh:
        m = self.meshes.get(name)
        if m is None:
            raise DTMError(E.UNDEFINED_MESH, f"mesh @{name} is not declared")
        if not 0 <= self.rank < m.size:
            raise DTMError(E.INVALID_GROUP, f"rank {self.rank} is not on mesh @{name} of {m.size} ranks")
        return m

    def coords(self, mesh: str) -> dict[str, int]:
        """This rank's coordinate on every axis of `mesh` (row-major unravel of rank)."""
        m = self.mesh(mesh)
        idx = np.unravel_index(self.rank, tuple(s for _, s in m.axes))
        return {a: int(i) for (a, _), i in zip(m.axes, idx)}

    def group(self, mesh: str, axes: Sequence[str]) -> tuple[tuple[int, ...], int]:
        """(global ranks of this rank's group in group order, this rank's index in it)."""
        m = self.mesh(mesh)
        for a in axes:
            if a not in dict(m.axes):
                raise DTMError(E.UNKNOWN_MESH_AXIS, f"mesh @{mesh} has axes {[a for a, _ in m.axes]}, not {a!r}")
        members = group_ranks(m.axes, self.rank, axes)
        return members, members.index(self.rank)


def group_ranks(mesh_axes: Sequence[tuple[str, int]], rank: int, axes: Sequence[str]) -> tuple[int, ...]:
    """The group of `rank` along `axes` on a mesh of `mesh_axes` (the module docstring's
    rule): every rank that shares its coordinates off `axes`, row-major over `axes` in the
    order given."""
    sizes = dict(mesh_axes)
    mine = dict(zip(sizes, np.unravel_index(rank, tuple(sizes.values()))))
    members = []
    for combo in itertools.product(*(range(sizes[a]) for a in axes)):  # row-major over axes
        c = dict(mine, **dict(zip(axes, combo)))
        members.append(int(np.ravel_multi_index(tuple(c[a] for a in sizes), tuple(sizes.values()))))
    return tuple(members)


class _SelfMailbox:
    """A single rank's mailbox: nobody else can send, so an empty queue fails at once."""

    def __init__(self, mailbox: Mailbox):
        self.mailbox = mailbox

    def send(self, src: int, dst: int, x: np.ndarray, timeout: float) -> None:
        self.mailbox.send(src, dst, x, timeout)

    def recv(self, src: int, dst: int, timeout: float) -> np.ndarray:
        return self.mailbox.recv(src, dst, 0.0)
