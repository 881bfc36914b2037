"""Runtime L1: one mesh rank per process (conformance level L1).

    pg = process_group.init()                  # dtm.init(): this process is rank pg.rank
    ex = executor()                            # the process's L1 executor, on that group
    outs = ex.run(local_module, "main", inputs)   # this rank's results

Where L0 runs every rank's local-view module on threads of one process, L1 runs only this
process's: the partitioner's module for `rank = process rank`, as a compiled plan of the
`cpu` backend. The plan's collective steps go over the process group's Communicator
(shared memory or TCP, dtm.comm: `ProcessComm`) instead of the in-process DeviceGroup. A
collective of the IR names mesh axes; the group it runs on is this rank's row of the mesh along those axes,
in row-major rank order (RefContext.group), and mesh rank = process rank, so those ranks
are the Communicator's ranks as they are.

Plans are the `cpu` backend's, cached by module hash, so the step a training loop repeats
compiles once.
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from ..errors import DTMError
from ..ir.module import Module
from ..ref.context import RefContext
from .backend import compiled_plan
from .process_group import ProcessGroup, current


MIN_COMPRESS_ELEMENTS = 1024  # smaller all_reduces (a loss, a lone bias) stay exact: latency-bound anyway


class ProcessComm:
    """The `Comm` of this process's rank: a plan's collectives and send/recv over the
    process group's Communicator. The IR attributes of a collective other than its group
    (op, dim, src, split_dim, concat_dim) are the Communicator's parameters of those names.
    With `compress` (DDP(compress=...)), every float sum or avg all_reduce of at least
    MIN_COMPRESS_ELEMENTS elements (the gradient buckets) travels compressed (spec 9.5.1)."""

    takes_out = True  # collective(..., out=): an all_reduce writes its result there (ref.collectives.collective_into)

    def __init__(self, pg: ProcessGroup, compress: str | None = None):
        self.pg, self.compress = pg, compress

    def collective(self, name: str, attrs: dict, x: np.ndarray, group: tuple[int, ...], index: int, rank: int,
                   timeout: float, out: np.ndarray | None = None) -> np.ndarray | None:
        params = {k: v for k, v in attrs.items() if k not in ("mesh", "axes")}
        if (self.compress is not None and name == "all_reduce" and params.get("op") in ("sum", "avg")
                and np.asarray(x).dtype.kind == "f" and np.size(x) >= MIN_COMPRESS_ELEMENTS):
            params["compress"] = self.compress
        try:
            x = np.asarray(x, order="C")  # (not ascontiguousarray: that makes a 0-d x 1-d)
            return self.pg.collective(name, x, group, out=out, **params)
        except DTMError as e:
            raise DTMError(e.code, f"on rank {rank}: {e.message}") from e

    def send(self, src: int, dst: int, x: np.ndarray, timeout: float) -> None:
        self.pg.send(x, dst)

    def recv(self, src: int, dst: int, timeout: float) -> np.ndarray:
        return self.pg.recv(src)


class L1Executor:
    """Runs this process's local-view modules, with collectives over process group `pg`."""

    def __init__(self, pg: ProcessGroup):
        self.pg = pg
        self.comm = ProcessComm(pg)

    def run(self, module: Module, func: str, inputs: Sequence[np.ndarray],
            compress: str | None = None) -> list[np.ndarray]:
        """Run this rank's local-view @func of `module` on `inputs`; its results
        (`compress`: the gradient all_reduces' compression, see ProcessComm)."""
        comm = self.comm if compress is None else ProcessComm(self.pg, compress)
        ctx = RefContext(rank=self.pg.rank, meshes=dict(module.meshes), module=module, comm=comm,
                         timeout=getattr(getattr(self.pg.comm, "transport", None), "timeout", 60.0))
        return compiled_plan(module, func).run(inputs, ctx)


_EXECUTOR: L1Executor | None = None
_EXECUTOR_LOCK = threading.Lock()


def executor() -> L1Executor:
    """The L1 executor of the process group dtm.init() formed (a new one after re-init)."""
    global _EXECUTOR
    pg = current()
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None or _EXECUTOR.pg is not pg:
            _EXECUTOR = L1Executor(pg)
        return _EXECUTOR


__all__ = ["L1Executor", "ProcessComm", "executor"]
