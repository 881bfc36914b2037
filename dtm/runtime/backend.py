"""Backends run an IR function on numpy buffers: `get_backend(name).run(module, func, inputs)`.

`ref` is the numpy reference interpreter (dtm/ref), the oracle; `cpu` compiles the function
into fused C kernels (dtm/runtime/cpu.py). The name comes from the argument, else `DTM_BACKEND`, else `cpu`.
"""

from __future__ import annotations

import os
from typing import Protocol, Sequence

import numpy as np

from ..errors import DTMError, ErrorCode
from ..ir.module import Module
from ..ref.context import RefContext
from ..ref.interpreter import run as ref_run
from .cpu import CpuBackend, Plan
from .host import check_free


class Backend(Protocol):
    name: str

    def run(self, module: Module, func: str, inputs: Sequence[np.ndarray]) -> list[np.ndarray]: ...


class RefBackend:
    name = "ref"

    def run(self, module: Module, func: str, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        # each result larger than the memory free is refused before numpy allocates it
        return ref_run(module, func, inputs, RefContext(check_memory=check_free))


BACKENDS: dict[str, Backend] = {"ref": RefBackend(), "cpu": CpuBackend()}


def get_backend(name: str | None = None) -> Backend:
    name = name or os.environ.get("DTM_BACKEND") or "cpu"
    backend = BACKENDS.get(name)
    if backend is None:
        raise DTMError(ErrorCode.UNKNOWN_BACKEND, f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
    return backend


def release_plans() -> None:
    """Let the `cpu` backend's cached plans drop the memory they keep between runs (their
    frames, and the last inputs, which hold a step's weights alive): after a process mesh
    resized, the plans of its old shape would otherwise keep the old shards' memory."""
    BACKENDS["cpu"].plans.release()


def compiled_plan(module: Module, func: str) -> Plan:
    """The `cpu` backend's compiled plan of @func, from its cache: what L0's devices and
    L1's rank run, with their device group in the context."""
    return BACKENDS["cpu"].plan(module, func)
