"""The cuda backend's kernels run on the CPU, thread by thread: what tests the CUDA renderer
on machines without a GPU.

CUDA C's kernels are C with a few keywords, so the C compiler builds them too once those
keywords are defined away and blockIdx, threadIdx, blockDim and gridDim are variables that
a launch loop sets. `emulated(kernel, symbol)` gives a kernel as the cpu backend's
CFunction (`void symbol(void **bufs, int64_t *dims)`) that runs each of the kernel's
launches as the GPU would: every block of the grid, every thread of a block, one after
another; a product with the cpu runtime's GEMM where the GPU calls cuBLAS, then its epilogue
launch. A block launch (one block whose threads meet at barriers) runs its threads at once,
as OpenMP's, `__syncthreads()` an OpenMP barrier. The cpu backend's plan (dtm/runtime/cpu.py)
runs those functions, so a program of CUDA kernels runs whole, with its moves and
fallbacks, and is compared with the reference.

Launches take blocks of 3 threads and at most 2 blocks (by default), so that the grid-stride
loops wrap around in every launch of more than 6 work items (on a GPU only launches of more
than THREADS x MAX_BLOCKS items do), and the last block is only partly used: a kernel that
assumed a block size or one pass of the grid would fail on small tests.
"""

from __future__ import annotations

import dataclasses

from ...compiler import loopir as L
from ..cpu.render_c import CFunction, _params, _Renderer, gemm_library
from .render_cuda import THREADS, render_kernel

EMULATION = r"""/* CUDA's kernels on the CPU, one thread after another (dtm/backends/cuda/emulate.py) */
#pragma GCC optimize ("O1")  /* (they check results, not speed: less to compile than -O3) */
struct dtm_dim3 { unsigned x, y, z; };
static __thread struct dtm_dim3 blockIdx, threadIdx, blockDim, gridDim;
#define DTM_GLOBAL static
#define __device__ static
#define __forceinline__ inline
#define __launch_bounds__(n)
#include <omp.h>
static inline float __int_as_float(int32_t i) { float f; memcpy(&f, &i, 4); return f; }
static inline unsigned dtm_blocks(int64_t count, int64_t threads, int64_t cap) {
  int64_t b = (count + threads - 1) / threads;
  return (unsigned)(b < 1 ? 1 : b > cap ? cap : b);
}
/* a block whose threads meet at barriers: its threads are OpenMP's, __syncthreads() an
   (orphaned) OpenMP barrier, __shared__ memory a static of the kernel function */
#define __shared__ static
#define __syncthreads() _Pragma("omp barrier")
#define DTM_LAUNCH_BLOCK(threads, call) do { \
    const int dtm_threads_ = (threads); \
    _Pragma("omp parallel num_threads(dtm_threads_)") { \
      gridDim.x = 1; blockIdx.x = 0; blockDim.x = (unsigned)omp_get_num_threads(); \
      threadIdx.x = (unsigned)omp_get_thread_num(); call; } \
  } while (0)
#define DTM_LAUNCH(count, threads, cap, call) do { \
    gridDim.x = dtm_blocks(count, threads, cap); blockDim.x = (unsigned)(threads); \
    for (blockIdx.x = 0; blockIdx.x < gridDim.x; blockIdx.x++) \
      for (threadIdx.x = 0; threadIdx.x < blockDim.x; threadIdx.x++) call; \
  } while (0)
"""


def emulated(k: L.Kernel, symbol: str, threads: int = 3, cap: int = 2) -> CFunction:
    """Kernel k's CUDA launches as one C function `symbol`, run on the CPU (module docstring):
    blocks of `threads` threads (at most THREADS), at most `cap` of them."""
    assert 1 <= threads <= THREADS
    ck = render_kernel(k, f"{symbol}_g")
    r = _Renderer()
    code = [f"void {symbol}(void *const *bufs, const int64_t *dims) {{", *_params(k, False), "  (void)bufs; (void)dims;"]
    library = None
    args = ", ".join(ck.params)
    for launch in ck.launches:
        if launch.gemm is not None:
            g = launch.gemm
            r.gemm(dataclasses.replace(g, epilogue=None), 1, code)  # the product alone, as cuBLAS makes it
            library = gemm_library(g)
        if launch.kind == "block":
            code.append(f"  DTM_LAUNCH_BLOCK({threads}, {launch.symbol}({args}));")
        elif launch.symbol is not None:
            code.append(f"  DTM_LAUNCH({r.expr(launch.count)}, {threads}, {cap}, {launch.symbol}({args}));")
    code.append("}")
    helpers = {"dtm_cuda_emulation": EMULATION, **ck.helpers, **r.helpers}
    return CFunction(symbol, helpers, [ck.code], "\n".join(code), library)


__all__ = ["EMULATION", "emulated"]
