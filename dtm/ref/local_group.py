"""An in-process device group for the reference interpreter (conformance level L0): one
thread per rank of a mesh, each with its own RefContext, exchanging numpy arrays through a
shared rendezvous.

    outs = run_spmd(module, "step", [inputs_rank0, inputs_rank1, ...], "mesh")

Rank r is the row-major index over the mesh's axes (RefContext.group has the group rules).
A collective completes when every member of the group has called it: the n-th collective a
rank issues on a group meets the n-th of every other member. Each member contributes a copy
of its operand and reads all contributions in group order, so reductions run in group order
and are deterministic. Nothing waits forever: a rank that waits `timeout` seconds raises
DTMError (TIMEOUT) naming the op, the rank and the ranks that did not arrive, and when one
rank fails the others stop waiting at once.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import numpy as np

from ..errors import DTMError, ErrorCode as E
from ..ir.module import Module
from .context import DEFAULT_TIMEOUT_S, Mailbox, RefContext
from .interpreter import run


class LocalGroup:
    """The `Comm` of ranks that are threads of one process."""

    def __init__(self, size: int):
        self.size = size
        self._cond = threading.Condition()
        self._slots: dict[tuple[tuple[int, ...], int], dict] = {}
        self._issued: dict[tuple[int, tuple[int, ...]], int] = {}  # (rank, group) -> collectives so far
        self._mailbox = Mailbox()
        self.aborted: str | None = None

    def exchange(self, op: str, group: tuple[int, ...], rank: int, x: np.ndarray, timeout: float) -> list[np.ndarray]:
        deadline = time.monotonic() + timeout
        with self._cond:
            seq = self._issued.get((rank, group), 0)
            self._issued[(rank, group)] = seq + 1
            slot = self._slots.setdefault((group, seq), {"values": {}, "reads": 0})
            slot["values"][rank] = (op, np.array(x, copy=True))
            self._cond.notify_all()
            while len(slot["values"]) < len(group):
                if self.aborted is not None:
                    raise DTMError(E.TIMEOUT, f"{op} on rank {rank}: abandoned, {self.aborted}")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in group if r not in slot["values"]]
                    raise DTMError(E.TIMEOUT, f"{op} on rank {rank}: waited {timeout:g} s for ranks {missing} "
                                   f"of group {list(group)}")
                self._cond.wait(left)
            slot["reads"] += 1
            if slot["reads"] == len(group):
                del self._slots[(group, seq)]
            values = slot["values"]
        ops = {values[r][0] for r in group}
        if len(ops) > 1:
            calls = "; ".join(f"rank {r}: {values[r][0]}" for r in group)
            raise DTMError(E.COLLECTIVE_MISMATCH, f"collective #{seq} of group {list(group)} does not match "
                           f"across ranks ({calls})")
        return [values[r][1] for r in group]

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
             timeout: float = DEFAULT_TIMEOUT_S, stores: Sequence[dict] | None = None) -> list[list[np.ndarray]]:
    """Run `func` on every rank of mesh `mesh_name` at once, rank r on per_rank_inputs[r]
    (and with tensor store stores[r] when given); returns each rank's results. When a rank
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
                         store=stores[r] if stores is not None else {})
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
