"""Programs of the cuda backend's kernels run on the CPU (dtm/backends/cuda/emulate.py): the
tests' way to check the CUDA renderer's output without a GPU."""

from __future__ import annotations

import numpy as np

from dtm.backends.cuda import passes as cuda
from dtm.backends.cuda.emulate import emulated
from dtm.runtime.cpu import Plan


def run_cuda_emulated(module, func: str, inputs: list) -> list[np.ndarray]:
    """Compile `func` with the cuda backend's passes, check that NVRTC compiles its unit to
    PTX without a warning, then run its kernels on the CPU by the emulator, with the cpu
    backend's plan around them (moves, fallbacks, memory): the function's results."""
    program = cuda.compile_func(module, func)
    log = cuda.build(program).log
    assert log == "", f"NVRTC warned of the rendered CUDA C:\n{log}"
    for i, step in enumerate(program.kernels):
        step.cfunc = emulated(step.kernel, f"dtm_k{i}")
    return Plan(module, func, program).run(inputs)
