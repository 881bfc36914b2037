"""The cpu backend's builds (dtm/toolchain compiles and caches them): a program's kernels,
a few per translation unit, the units in parallel (`load_functions`); the runtime libraries
its kernels call (the products, narrow weights, bf16, the moves and launch loop: DTM's own
C, the same for every program), started when its passes start (`prebuild_runtime`) and
built in $DTM_RUNTIME_DIR when set; the probe of the C library's vector math.

    fn = load_kernel(source, "k3_softmax")      # ctypes function dtm_kernel(bufs, dims)
    fns = load_functions(cfuncs, names)         # many kernels, a few per compiler call
"""

from __future__ import annotations

import ctypes
import os
import platform
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ...errors import DTMError
from ...toolchain import BASE_FLAGS, build, cache_dir, compiler, compiler_version, load, made
from ...toolchain.cc import lock as _lock
from . import c_bf16, c_move, c_narrow, c_random
from .c_runtime import SOURCES as _GEMM_SOURCES
from .render_c import render_unit, vector_math_decls

# the runtime libraries by the name a kernel's CFunction.gemm_dtype gives: f32, f64, the
# products with narrow weights (c_narrow.py), bf16 x bf16 products (c_bf16.py); "move": the movement steps and the plan's
# launch loop (c_move.py), which the executor calls
RUNTIME_SOURCES = {**_GEMM_SOURCES, "narrow": c_narrow.SOURCE, "move": c_move.SOURCE + c_random.WORDS,
                   "bf16": c_bf16.SOURCE}

# x86 compilers use 256-bit vectors by default even where -march=native offers AVX-512 (older
# CPUs slowed their clock for 512-bit work); kernels' loops (an epilogue's tanh) then run half
# as wide. Where the CPU has no AVX-512 the preference changes nothing.
WIDE_VECTORS = ("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ()
KERNEL_FLAGS = BASE_FLAGS + ("-ffp-contract=off",) + WIDE_VECTORS     # every float op rounds as written
RUNTIME_FLAGS = BASE_FLAGS + ("-ffp-contract=fast",)    # the matrix product: FMAs (order unspecified)
# GCC's own (clang has no such parameter): a vectorised loop's remainder (at most a vector's
# length less one) runs scalar instead of through narrower vector loops of its own; a training
# step's kernels compile in 10% less time (2.77 -> 2.48 s of CPU for the char model's)
GCC_KERNEL_FLAGS = ("--param=vect-epilogues-nomask=0",)

UNIT_BYTES = 40_000     # about this much kernel C per translation unit and core (16 ms of GCC per KB here)
_runtime: dict[str, ctypes.CDLL] = {}


def runtime_dir() -> Path:
    """Where the runtime libraries (RUNTIME_SOURCES: DTM's own C, the same for every program)
    and the vector-math probe are built: $DTM_RUNTIME_DIR, else the kernel cache. Apart, a
    kernel cache can be emptied without building them again (benchmarks/train.py)."""
    where = os.environ.get("DTM_RUNTIME_DIR")
    return made(Path(where), "DTM_RUNTIME_DIR") if where else cache_dir()


def kernel_flags() -> tuple:
    """The flags kernels compile with: KERNEL_FLAGS, and GCC_KERNEL_FLAGS when the compiler is GCC."""
    version = compiler_version(compiler())
    gcc = "Free Software Foundation" in version and "clang" not in version
    return KERNEL_FLAGS + GCC_KERNEL_FLAGS if gcc else KERNEL_FLAGS


def runtime_library(dtype: str = "f32") -> ctypes.CDLL:
    """The runtime library for products of `dtype` ("f32", "f64" or "narrow"), built and loaded once per
    process with its symbols global, so the kernels that call it resolve against it."""
    if dtype not in _runtime:
        _runtime[dtype] = load(_build_runtime(dtype), global_symbols=True)
    return _runtime[dtype]


def _build_runtime(dtype: str) -> Path:
    with _lock:
        started = _prebuilds.pop(dtype, None)
    if started is not None:
        return started.result()  # a failed build raises its error here, and is tried again next time
    return _compile_runtime(dtype)


def _compile_runtime(dtype: str) -> Path:
    return build(RUNTIME_SOURCES[dtype], f"dtm_runtime_{dtype}", RUNTIME_FLAGS, where=runtime_dir())


_prebuilds: dict[str, Future] = {}


def prebuild_runtime(dtypes: set) -> None:
    """Start building the runtime libraries `dtypes` now, in the background, and the probe
    of vector_math: a program's first compile spends most of a second in Python (fusing,
    lowering) on one core while the other waits; the library (0.6 s of C compile, the same for
    every program) is built there meanwhile, from the cache when it is already built."""
    with _lock:
        for dtype in sorted(dtypes):
            if dtype not in _prebuilds and dtype not in _runtime:
                _start(dtype, _compile_runtime, dtype)
        # the probe of the vector math functions the kernels' C is written for, too
        if "vector_math" not in _prebuilds and not _vector_math and _vector_math_allowed():
            _start("vector_math", _probe_vector_math)


def _start(key: str, fn, *args) -> None:
    """fn(*args) on a thread of its own, its future in _prebuilds[key] (the caller holds _lock)."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtm-prebuild")
    _prebuilds[key] = pool.submit(fn, *args)
    pool.shutdown(wait=False)


def _function(lib: ctypes.CDLL, symbol: str):
    fn = getattr(lib, symbol)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = None
    return fn


def load_kernel(source: str, name: str = "kernel", gemm_dtype: str | None = None, symbol: str = "dtm_kernel"):
    """The kernel function `symbol(void **bufs, int64_t *dims)` of `source`, built and loaded
    (after the runtime library for `gemm_dtype`, when it calls one)."""
    if gemm_dtype:
        runtime_library(gemm_dtype)
    return _function(load(build(source, name, kernel_flags())), symbol)


def _units(sizes: dict[int, int], cores: int) -> list[list[int]]:
    """Kernels (position -> bytes of C) in translation units that take about as long to
    compile: a multiple of `cores` units of about UNIT_BYTES each, every kernel, largest
    first, into the unit with the least C so far. Each unit costs a compiler start (50 ms)."""
    n = min(len(sizes), cores * -(-sum(sizes.values()) // (cores * UNIT_BYTES)))
    units: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(sizes, key=lambda i: (-sizes[i], i)):
        u = load.index(min(load))
        units[u].append(i)
        load[u] += sizes[i]
    return [sorted(u) for u in units]


def load_functions(funcs: list, names: list[str]) -> list:
    """The kernels `funcs` (render_c.CFunction), built a few per translation unit, units
    compiled in parallel (the runtime library beside them, when a kernel calls it); their
    ctypes functions, in order. A kernel whose C is another's but for its name (each layer
    of a model repeats its kernels, share.py makes more of them alike) is built once and shared."""
    if not funcs:
        return []
    first: dict[str, int] = {}  # a kernel's C with its own name taken out -> the first kernel with that C
    source_of = [first.setdefault(_anonymous(f), i) for i, f in enumerate(funcs)]
    unique = sorted(set(source_of))
    parts = _units({i: len(funcs[i].code) + sum(map(len, funcs[i].decls)) for i in unique}, os.cpu_count() or 1)
    units = [([funcs[i] for i in part], [names[i] for i in part]) for part in parts]
    vector = vector_math()
    libs = ("-lm", "-lmvec") if vector else ("-lm",)
    flags = kernel_flags()
    sources = [render_unit(fs, vector) for fs, _ in units]
    # the longest compiles start first, so the last to finish is a short one
    order = sorted(range(len(units)), key=lambda u: -len(sources[u]))

    def one(u: int) -> Path:
        ns = units[u][1]
        return build(sources[u], ns[0] if len(ns) == 1 else f"{ns[0]} .. {ns[-1]}", flags, libs=libs)

    runtimes = sorted({f.gemm_dtype for f in funcs if f.gemm_dtype} - set(_runtime))
    with _lock:  # one already building in the background is waited for below, not by a worker here
        to_build = [dt for dt in runtimes if dt not in _prebuilds]
    with ThreadPoolExecutor(max_workers=max(1, min(len(units) + len(to_build), os.cpu_count() or 1))) as pool:
        building = [pool.submit(_build_runtime, dt) for dt in to_build]
        built_units = dict(zip(order, pool.map(one, order)))
        paths = [built_units[u] for u in range(len(units))]
        for b in building:
            b.result()
    for dt in runtimes:
        runtime_library(dt)  # loaded first, its symbols global: the kernels' calls resolve against it
    built = [_function(load(path), f.symbol) for path, (fs, _) in zip(paths, units) for f in fs]
    by_index = dict(zip([i for part in parts for i in part], built))
    return [by_index[i] for i in source_of]


_VECTOR_MATH_PROBE = """#include <math.h>
#include <stdint.h>
{decls}
void dtm_probe(const float *restrict x, float *restrict y, int64_t n) {{
  for (int64_t i = 0; i < n; i++) y[i] = tanhf(x[i]) + expf(x[i]);
}}
"""
_vector_math: dict[str, bool] = {}


def vector_math() -> bool:
    """Whether kernels may call the C library's vector math functions (glibc's libmvec:
    tanh, exp, ... 8 or 16 lanes at a time, within a few ulp like the scalar ones): probed
    once per process and compiler by building a function that uses them (started beside the
    runtime libraries, prebuild_runtime), as DTM_VECTOR_MATH=0 forbids. No compiler: False,
    not remembered (the build says why)."""
    if not _vector_math_allowed():
        return False
    with _lock:
        started = _prebuilds.pop("vector_math", None)
    if started is not None:
        started.result()
    return _probe_vector_math()


def _vector_math_allowed() -> bool:
    return os.environ.get("DTM_VECTOR_MATH", "1") != "0"


def _probe_vector_math() -> bool:
    try:
        cc = compiler()
    except DTMError:
        return False
    if cc not in _vector_math:
        try:
            probe = _VECTOR_MATH_PROBE.format(decls="\n".join(vector_math_decls()))
            load(build(probe, "vector_math_probe", kernel_flags(), libs=("-lm", "-lmvec"), where=runtime_dir()))
            _vector_math[cc] = True
        except (DTMError, OSError):
            _vector_math[cc] = False
    return _vector_math[cc]


def _anonymous(f) -> str:
    """Kernel f's C with its symbol replaced: equal for kernels that differ only by name."""
    return "\n".join([*f.decls, f.code]).replace(f.symbol, "@") + "\0" + "\n".join(sorted(f.helpers))


def _bf16_lib() -> ctypes.CDLL:
    lib = runtime_library("bf16")
    lib.dtm_rt_bf16_kernel.restype = ctypes.c_int
    lib.dtm_rt_bf16_force.argtypes = [ctypes.c_int]
    return lib


def bf16_kernel() -> str:
    """The microkernel the bf16 products run in this process: "avx512bf16" or "portable"
    (c_bf16.py)."""
    return c_bf16.KERNELS[_bf16_lib().dtm_rt_bf16_kernel()]


class bf16_forced:  # noqa: N801 - a context manager, like a function
    """Inside, the bf16 products run `kernel` ("portable", or "avx512bf16" where built with
    it), whatever DTM_BF16_PORTABLE says: for tests comparing the two on one machine."""

    def __init__(self, kernel: str):
        self.code = {v: k for k, v in c_bf16.KERNELS.items()}[kernel]

    def __enter__(self):
        _bf16_lib().dtm_rt_bf16_force(self.code)

    def __exit__(self, *exc):
        _bf16_lib().dtm_rt_bf16_force(-1)
