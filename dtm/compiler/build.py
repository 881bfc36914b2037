"""Build C sources into shared objects with the system C compiler, cached on disk.

    fn = load_kernel(source, "k3_softmax")      # ctypes function dtm_kernel(bufs, dims)
    fns = load_functions(cfuncs, names)         # many kernels, a few per compiler call

The cache lives in $DTM_CACHE_DIR, else ~/.cache/dtm (the runtime libraries in
$DTM_RUNTIME_DIR when it is set). An object is named by the sha256 of its source, the flags,
the compiler's path, its `--version` text and what -march=native means on this CPU, so a
second build of the same source is a file lookup (no compiler call), and a new compiler,
flags or CPU never reuse a stale object. Objects are written to a temporary name and renamed into place
(os.replace is atomic), so processes that build the same kernel at the same time all end
with a complete object. Beside each object its SHA-256 (`<key>.sha256`) is written,
atomically, after a successful compile and before the object is renamed into place; an
object that does not match it (truncated, emptied, damaged on disk: loading it would crash
the process) is rebuilt, with one warning. The kernel's source is kept beside it (`<key>.c`); a failed
compile raises DTMError E0806 naming that file and quoting the compiler. The compiler is
$CC, else `cc`, else `gcc`. The cache is bounded ($DTM_CACHE_MAX, kernel_cache.py): the least
recently used objects go first. Loading uses ctypes, which releases the GIL during each call.
A program's kernels compile a few per translation unit, the units in parallel; the runtime
library its products call starts compiling when its passes start (`prebuild_runtime`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..errors import DTMError, ErrorCode as E
from . import c_bf16, c_move, c_narrow, c_random, kernel_cache
from .c_runtime import SOURCES as _GEMM_SOURCES
from .render_c import render_unit, vector_math_decls

log = logging.getLogger("dtm.compiler")
# the runtime libraries by the name a kernel's CFunction.gemm_dtype gives: f32, f64, the
# products with narrow weights (c_narrow.py), bf16 x bf16 products (c_bf16.py); "move": the movement steps and the plan's
# launch loop (c_move.py), which the executor calls
RUNTIME_SOURCES = {**_GEMM_SOURCES, "narrow": c_narrow.SOURCE, "move": c_move.SOURCE + c_random.WORDS,
                   "bf16": c_bf16.SOURCE}

COMPILE_TIMEOUT = 300.0  # seconds for one compile
BASE_FLAGS = ("-std=gnu11", "-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno")
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
STATS = {"compiles": 0, "hits": 0}  # counters, for tests and DTM_DEBUG
_lock = threading.Lock()
_versions: dict[str, str] = {}
_targets: dict[str, str] = {}
_TARGET_FLAG = re.compile(r'"?(-m[^\s"]+|[lL][12]-cache-[^\s"]+|-target-cpu" "[^"]+|-target-feature" "[^"]+)')
_loaded: dict[str, ctypes.CDLL] = {}
_runtime: dict[str, ctypes.CDLL] = {}
_intact: set[Path] = set()  # objects this process checked against their checksum


class BuildError(DTMError):
    """The C compiler is missing or failed."""


def _made(d: Path, variable: str) -> Path:
    """Directory d, made when it is missing; E0806 naming it and the environment variable
    that sets it when it cannot be (a path under a file, a directory we may not write)."""
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(E.BUILD_FAILED, f"the kernel cache directory {d} cannot be made: {e.strerror or e}; "
                         f"set {variable} to a directory this process can write") from None
    return d


def _unwritable(d: Path, name: str, e: OSError) -> BuildError:
    """E0806 for a build that cannot write into its cache directory d (read-only, full)."""
    return BuildError(E.BUILD_FAILED, f"cannot write kernel {name} into the kernel cache directory {d}: "
                      f"{e.strerror or e}; set DTM_CACHE_DIR (DTM_RUNTIME_DIR for the runtime libraries) to a "
                      "directory this process can write")


def cache_dir() -> Path:
    return _made(Path(os.environ.get("DTM_CACHE_DIR") or Path.home() / ".cache" / "dtm"), "DTM_CACHE_DIR")


def runtime_dir() -> Path:
    """Where the runtime libraries (RUNTIME_SOURCES: DTM's own C, the same for every program)
    and the vector-math probe are built: $DTM_RUNTIME_DIR, else the kernel cache. Apart, a
    kernel cache can be emptied without building them again (benchmarks/train.py)."""
    where = os.environ.get("DTM_RUNTIME_DIR")
    return _made(Path(where), "DTM_RUNTIME_DIR") if where else cache_dir()


def compiler() -> str:
    """The path of the C compiler: $CC, else cc, else gcc."""
    cc = os.environ.get("CC")
    if cc:
        path = shutil.which(cc)
        if path is None:
            raise BuildError(E.BUILD_FAILED, f"the C compiler {cc!r} named by $CC was not found; install gcc "
                             "(e.g. apt-get install gcc) or set CC to a C compiler")
        return path
    for name in ("cc", "gcc"):
        path = shutil.which(name)
        if path is not None:
            return path
    raise BuildError(E.BUILD_FAILED, "no C compiler found (neither cc nor gcc is on PATH); the cpu backend "
                     "compiles kernels with one: install gcc (e.g. apt-get install gcc) or set CC")


def compiler_version(cc: str) -> str:
    v = _versions.get(cc)
    if v is None:
        try:
            out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise BuildError(E.BUILD_FAILED, f"cannot run the C compiler {cc!r}: {e}; install gcc or set CC") from None
        v = _versions[cc] = out.stdout.strip() or out.stderr.strip()
    return v


def native_target(cc: str) -> str:
    """What -march=native means to compiler `cc` on this machine: the CPU and the vector
    features its driver passes on (gcc's -m flags and cache sizes, clang's -target-cpu and
    -target-feature). Part of every object's cache key, so a cache shared by machines of
    different CPUs never loads code built for another one. Asked once per process."""
    target = _targets.get(cc)
    if target is None:
        try:
            out = subprocess.run([cc, "-march=native", "-###", "-E", "-x", "c", os.devnull], capture_output=True,
                                 text=True, timeout=60)
            text = "\n".join(line for line in (out.stderr + out.stdout).splitlines() if "cc1" in line)  # the compiler proper
        except (OSError, subprocess.TimeoutExpired):
            text = ""  # the build that follows says what is wrong with the compiler
        target = _targets[cc] = " ".join(_TARGET_FLAG.findall(text)) or platform.processor()
    return target


def kernel_flags() -> tuple:
    """The flags kernels compile with: KERNEL_FLAGS, and GCC_KERNEL_FLAGS when the compiler is GCC."""
    version = compiler_version(compiler())
    gcc = "Free Software Foundation" in version and "clang" not in version
    return KERNEL_FLAGS + GCC_KERNEL_FLAGS if gcc else KERNEL_FLAGS


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build(source: str, name: str = "kernel", flags: tuple | None = None, libs: tuple = ("-lm",),
          where: Path | None = None) -> Path:
    """The path of the shared object built from `source` with `flags` (default: a kernel's,
    kernel_flags()) and linked with `libs`, in directory `where` (default: cache_dir()),
    from there when present."""
    cc = compiler()
    flags = kernel_flags() if flags is None else flags
    key = hashlib.sha256("\0".join([source, " ".join(flags + libs), cc, compiler_version(cc),
                                    native_target(cc)]).encode()).hexdigest()[:40]
    d = cache_dir() if where is None else where
    so, digest = d / f"{key}.so", d / f"{key}.sha256"
    if so.exists() and _checked(so, digest, name):
        with _lock:
            STATS["hits"] += 1
        return so
    src = d / f"{key}.c"
    try:
        _write_atomic(src, source.encode())
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{key}.", suffix=".so.tmp")
    except OSError as e:
        raise _unwritable(d, name, e) from None
    os.close(fd)
    cmd = [cc, *flags, "-o", tmp, str(src), *libs]
    try:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise BuildError(E.TIMEOUT, f"compiling kernel {name} ({src}) took longer than {COMPILE_TIMEOUT:g} s") from None
        except OSError as e:
            raise BuildError(E.BUILD_FAILED, f"cannot run the C compiler {cc!r} on kernel {name} ({src}): {e}; "
                             "install gcc or set CC") from None
        if out.returncode != 0:
            raise BuildError(E.BUILD_FAILED, f"compiling kernel {name} failed: {_why(out, len(source))} "
                             f"(source: {src}; command: {' '.join(cmd)})")
        try:
            _write_atomic(digest, _sha256(Path(tmp)).encode())
            os.replace(tmp, so)
        except OSError as e:
            raise _unwritable(d, name, e) from None
        with _lock:
            STATS["compiles"] += 1
            _intact.add(so)
    finally:
        Path(tmp).unlink(missing_ok=True)
    kernel_cache.trim_later(d)  # the cache grew: keep it within its bound
    return so


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _checked(so: Path, digest: Path, name: str) -> bool:
    """Whether cached object `so` is the one its build wrote (`digest` holds its SHA-256),
    checked once per process, before anything loads it; False (build it again) with a
    warning when it is not, quietly when it has no checksum (an older cache)."""
    with _lock:
        if so in _intact:
            return True
    try:
        want = digest.read_text().strip()
    except FileNotFoundError:
        log.info("kernel %s: the cached object %s has no checksum: building it again", name, so)
        return False
    try:
        found = _sha256(so)
    except OSError:  # gone or unreadable since it was seen: built again like a damaged one
        found = ""
    if found != want:
        log.warning("kernel %s: the cached object %s is damaged (it does not match the checksum its build "
                    "wrote): building it again", name, so)
        return False
    with _lock:
        _intact.add(so)
    try:
        os.utime(so)  # used now: the cache's bound removes the least recently used first (kernel_cache.py)
    except OSError:  # (a cache shared read-only)
        pass
    return True


def _why(out: subprocess.CompletedProcess, source_bytes: int) -> str:
    """What went wrong, in one line: the compiler killed (by the kernel's out-of-memory
    killer, most often), else its first error line."""
    text = (out.stderr or out.stdout).strip()
    if out.returncode in (-9, 137) or "Killed signal" in text or "out of memory" in text.lower():
        return (f"the C compiler was killed, most likely out of memory ({source_bytes / 1e6:.1f} MB of C "
                f"source); free memory or report the program that made such a kernel")
    errors = [line for line in text.splitlines() if "error" in line.lower()]
    return (errors or text.splitlines() or [f"exit status {out.returncode}, no message"])[0]


def load(path: Path, global_symbols: bool = False) -> ctypes.CDLL:
    key = str(path)
    with _lock:
        lib = _loaded.get(key)
        if lib is None:
            mode = ctypes.RTLD_GLOBAL if global_symbols else ctypes.RTLD_LOCAL
            lib = _loaded[key] = ctypes.CDLL(key, mode=mode)
    return lib


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
    return _function(load(build(source, name)), symbol)


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
    sources = [render_unit(fs, vector) for fs, _ in units]
    # the longest compiles start first, so the last to finish is a short one
    order = sorted(range(len(units)), key=lambda u: -len(sources[u]))

    def one(u: int) -> Path:
        ns = units[u][1]
        return build(sources[u], ns[0] if len(ns) == 1 else f"{ns[0]} .. {ns[-1]}", libs=libs)

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
            load(build(probe, "vector_math_probe", libs=("-lm", "-lmvec"), where=runtime_dir()))
            _vector_math[cc] = True
        except (DTMError, OSError):
            _vector_math[cc] = False
    return _vector_math[cc]


def _anonymous(f) -> str:
    """Kernel f's C with its symbol replaced: equal for kernels that differ only by name."""
    return "\n".join([*f.decls, f.code]).replace(f.symbol, "@") + "\0" + "\n".join(sorted(f.helpers))


_TARGET_FEATURES = {"avx512bf16": "-mavx512bf16", "amx": "-mamx-bf16"}


def compiler_offers(feature: str) -> bool:
    """Whether -march=native lets the C compiler use `feature` ("avx512bf16", "amx") on this
    CPU: the detection the bf16 products' library is built with (its #if on the compiler's
    macros), as the f32 products' is for AVX-512."""
    flag = _TARGET_FEATURES[feature]
    return any(t == flag for t in native_target(compiler()).split())


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
