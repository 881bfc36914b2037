"""Runtime L1: one mesh rank per process (conformance level L1).

    pg = process_group.init()                  # dtm.init(): this process is rank pg.rank
    ex = executor()                            # the process's L1 executor, on that group
    outs = ex.run(local_module, "main", inputs)   # this rank's results

Where L0 runs every rank's local-view module on threads of one process, L1 runs only this
process's: the partitioner's module for `rank = process rank`, as a compiled plan of the
`cpu` backend. The plan's collective steps go over the process group's Communicator
(shared memory or TCP, dtm.comm) instead of the in-process DeviceGroup. A collective of the
IR names mesh axes; the group it runs on is this rank's row of the mesh along those axes,
in row-major rank order (RefContext.group), and mesh rank = process rank, so those ranks
are the Communicator's ranks as they are.

Plans are cached by module hash, so the step a training loop repeats compiles once.
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from ..compiler.passes import compile_func
from ..errors import DTMError
from ..ir.module import Module
from ..ref.context import RefContext
from .cpu import Plan, PlanCache
from .l0 import COLLECTIVES
from .process_group import ProcessGroup, current


# The IR attributes each collective passes on, in the Communicator's parameter order.
PARAMS = {"all_reduce": ("op",), "all_gather": ("dim",), "reduce_scatter": ("op", "dim"),
          "all_to_all": ("split_dim", "concat_dim"), "broadcast": ("src",)}


class ProcessPlan(Plan):
    """A cpu-backend plan whose collective steps run over the process group (mirrors
    l0.DevicePlan: it overrides the fallback step, the one place a collective runs;
    quantized operands and groups of one keep the reference implementation)."""

    pg: ProcessGroup

    def _fallback(self, step, vals, originals, bindings, ctx):
        op = step.op
        if op.name not in COLLECTIVES or op.operands[0].type.dtype.is_quant:
            return super()._fallback(step, vals, originals, bindings, ctx)
        ins, outs = self.fb_args[id(step)]
        group, _ = ctx.group(op.attrs["mesh"], op.attrs["axes"])
        if len(group) == 1:
            return super()._fallback(step, vals, originals, bindings, ctx)
        x = np.asarray(originals.get(ins[0], vals[ins[0]]), order="C")  # (ascontiguousarray: 0-d -> 1-d)
        try:
            y = self.pg.collective(op.name, x, group, **{k: op.attrs[k] for k in PARAMS[op.name]})
        except DTMError as e:
            raise DTMError(e.code, f"@{self.func.name} op {op.name} ({step.name}) on rank {ctx.rank}: "
                           f"{e.message}") from e
        vals[outs[0]] = y
        return ctx


class L1Executor:
    """Runs this process's local-view modules, with collectives over process group `pg`."""

    def __init__(self, pg: ProcessGroup):
        self.pg = pg
        self.plans = PlanCache(self._make, 256)

    def _make(self, module: Module, func: str) -> "ProcessPlan":
        plan = ProcessPlan(module, func, compile_func(module, func))
        plan.pg = self.pg
        return plan

    def plan(self, module: Module, func: str) -> "ProcessPlan":
        """The compiled plan of @func of `module`, cached by module (object, then hash)."""
        return self.plans.get(module, func)

    def run(self, module: Module, func: str, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Run this rank's local-view @func of `module` on `inputs`; its results."""
        ctx = RefContext(rank=self.pg.rank, meshes=dict(module.meshes), module=module,
                         timeout=getattr(getattr(self.pg.comm, "transport", None), "timeout", 60.0))
        return self.plan(module, func).run(inputs, ctx)


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


__all__ = ["L1Executor", "ProcessPlan", "executor"]
