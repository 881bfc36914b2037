"""An in-process device group for the reference interpreter (conformance level L0): one
thread per rank of a mesh, each with its own RefContext, meeting at every collective.

    outs = run_spmd(module, "step", [inputs_rank0, inputs_rank1, ...], "mesh")

Rank r is the row-major index over the mesh's axes (RefContext.group has the group rules).
A collective completes when every member of the group has called it: the n-th collective a
rank issues on a group meets the n-th of every other member (`LocalGroup.meet`, the one
rendezvous of the ranks of a process, which L0's devices use too). Each member posts its
operand, computes its own result from all of them in group order (so reductions are
deterministic), and leaves once every member has finished reading. Nothing waits forever: a
rank that waits `timeout` seconds raises DTMError (TIMEOUT) naming the op, the rank and the
ranks that did not arrive, and when one rank fails the others stop waiting at once.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import numpy as np

from ..errors import DTMError, ErrorCode as E
from ..ir.module import Module
from .collectives import describe, result
from .context import DEFAULT_TIMEOUT_S, Mailbox, RefContext, TensorStore
from .interpreter import run


class Meeting:
    """One collective of one group: the members' calls, operands and (for algorithms that
    read each other's partial results) outputs, and how far each member has got."""

    __slots__ = ("what", "inputs", "outputs", "phase", "left")

    def __init__(self, n: int):
        self.what: list[str | None] = [None] * n
        self.inputs: list[np.ndarray | None] = [None] * n
        self.outputs: list[np.ndarray | None] = [None] * n
        self.phase = [0] * n
        self.left = 0


class LocalGroup:
    """The `Comm` of ranks that are threads of one process: the reference collectives."""

    def __init__(self, size: int):
        self.size = size
        self._cond = threading.Condition()
        self._meetings: dict[tuple[tuple[int, ...], int], Meeting] = {}
        self._joined: dict[tuple[int, tuple[int, ...]], int] = {}  # (rank, group) -> collectives so far
        self._mailbox = Mailbox()
        self.aborted: str | None = None

    def collective(self, name: str, attrs: dict, x: np.ndarray, group: tuple[int, ...], index: int, rank: int,
                   timeout: float) -> np.ndarray | None:
        with self.meet(describe(name, attrs, x), x, group, index, rank, timeout) as (m, _step):
            return result(name, attrs, m.inputs, index)

    @contextmanager
    def meet(self, what: str, x: np.ndarray, group: tuple[int, ...], index: int, rank: int,
             timeout: float) -> Iterator[tuple[Meeting, Callable[[], None]]]:
        """Join the group's next collective, described by `what`, with operand `x`; yields
        (the meeting, `step`) once every member has joined and their calls match. `step()`
        waits until every member has called it as often (between the steps of an algorithm
        that reads the others' partial results). Leaving waits until no member can still
        read this one's buffers."""
        n = len(group)
        deadline = time.monotonic() + timeout
        with self._cond:
            seq = self._joined.get((rank, group), 0)
            self._joined[(rank, group)] = seq + 1
            m = self._meetings.setdefault((group, seq), Meeting(n))
            m.what[index], m.inputs[index] = what, x
            self._wait(m, index, 1, what, group, rank, deadline, timeout)
        if len(set(m.what)) > 1:
            calls = "; ".join(f"rank {r}: {w}" for r, w in zip(group, m.what))
            raise DTMError(E.COLLECTIVE_MISMATCH, f"collective #{seq} of group {list(group)} does not match "
                           f"across ranks ({calls})")
        phase = [1]

        def step() -> None:
            phase[0] += 1
            with self._cond:
                self._wait(m, index, phase[0], what, group, rank, deadline, timeout)

        try:
            yield m, step
            step()  # nobody leaves while another member may still read its buffers
        finally:
            with self._cond:
                m.left += 1
                if m.left == n:
                    del self._meetings[(group, seq)]

    def _wait(self, m: Meeting, index: int, phase: int, what: str, group: tuple[int, ...], rank: int,
              deadline: float, timeout: float) -> None:
        """Mark member `index` at `phase` and wait until every member is there. Caller holds _cond."""
        m.phase[index] = phase
        self._cond.notify_all()
        while min(m.phase) < phase:
            if self.aborted is not None:
                raise DTMError(E.TIMEOUT, f"{what} on rank {rank}: abandoned, {self.aborted}")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [group[i] for i, p in enumerate(m.phase) if p < phase]
                step = "" if phase == 1 else f" (step {phase - 1})"
                raise DTMError(E.TIMEOUT, f"{what}{step} on rank {rank}: waited {timeout:g} s for ranks {missing} "
                               f"of group {list(group)}")
            self._cond.wait(left)

    def send(self, src: int, dst: int, x: np.ndarray, timeout: float) -> None:
        self._mailbox.send(src, dst, x, timeout)

    def recv(self, src: int, dst: int, timeout: float) -> np.ndarray:
        return self._mailbox.recv(src, dst, timeout)

    def abort(self, reason: str) -> None:
        """Wake every waiting rank: it raises instead of waiting for a rank that failed."""
        with self._cond:
            self.aborted = reason
            self._cond.notify_all()
        self._mailbox.abort(reason)


def run_spmd(module: Module, func: str, per_rank_inputs: Sequence[Sequence[np.ndarray]], mesh_name: str, *,
             timeout: float = DEFAULT_TIMEOUT_S, stores: Sequence[TensorStore] | None = None) -> list[list[np.ndarray]]:
    """Run `func` on every rank of mesh `mesh_name` at once, rank r on per_rank_inputs[r]
    (and with tensor store stores[r] when given, else the process's); returns each rank's results. When a rank
    fails, raises its error (DTMError: with the rank prefixed to the message)."""
    mesh = module.meshes.get(mesh_name)
    if mesh is None:
        raise DTMError(E.UNDEFINED_MESH, f"run_spmd: mesh @{mesh_name} is not declared")
    if len(per_rank_inputs) != mesh.size:
        raise DTMError(E.INVALID_GROUP, f"run_spmd: mesh @{mesh_name} has {mesh.size} ranks, "
                       f"found inputs for {len(per_rank_inputs)}")
    group = LocalGroup(mesh.size)
    results: list[list[np.ndarray] | None] = [None] * mesh.size
    failures: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def rank_main(r: int) -> None:
        ctx = RefContext(rank=r, meshes=dict(module.meshes), comm=group, timeout=timeout,
                         store=stores[r] if stores is not None else None)
        try:
            results[r] = run(module, func, per_rank_inputs[r], ctx)
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            with lock:
                failures.append((r, e))
            group.abort(f"rank {r} failed: {e}")

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"dtm-ref-rank{r}", daemon=True)
               for r in range(mesh.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        r, e = failures[0]  # the first to fail is the cause; the rest were abandoned
        if isinstance(e, DTMError):
            raise DTMError(e.code, f"rank {r}: {e.message}") from e
        e.add_note(f"on rank {r} of run_spmd")
        raise e
    return results  # type: ignore[return-value]
