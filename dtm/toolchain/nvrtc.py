"""Compile CUDA C to PTX with NVRTC, cached on disk (layer 1.5, beside cc.py): the cuda
backend's kernels.

    ptx = compile_ptx(source, "dtm_k0 .. dtm_k9")     # Ptx(text, log), from the cache when compiled before

NVRTC is a library that compiles CUDA C in process; it needs no GPU and no driver, so the
kernels of every program can be compiled (and checked) on any x86-64 or arm64 machine. It
comes from PyPI's `nvidia-cuda-nvrtc` wheel (`pip install -e '.[cuda]'`; `[test]` has it
too), found among the installed `nvidia` packages; `$DTM_NVRTC` names another libnvrtc.so,
else the system's is used. PTX is made for the virtual architecture of `arch` (compute_90
for "sm_90": the driver finishes it for the GPU it loads on, that one or a later one),
with the spec's numerics (2.8): no contraction into fused multiply-adds (`-fmad=false`),
IEEE division and square root, denormals kept. The compiler's log is kept with the PTX: a
kernel DTM renders compiles without a warning (but for two about unused names, QUIET), and
the tests hold it to that.

The cache is `<cache_dir()>/cuda/<key>.ptx`, the key the sha256 of the source, the options
and NVRTC's version; written atomically, like the C kernels' objects.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import importlib.util
import os
import threading
from dataclasses import dataclass

from ..errors import ErrorCode as E
from .cc import BuildError, cache_dir, made, write_atomic

DEFAULT_ARCH = "sm_90"
NUMERICS = ("-fmad=false", "--prec-div=true", "--prec-sqrt=true", "--ftz=false")
# Generated code declares names that some kernels do not read (an index bound for a load a
# select discards, a loop variable a broadcast does not use): NVRTC's "declared but never
# referenced" (177) and "set but never used" (550) are silenced; every other warning stays
# in the log.
QUIET = ("--diag-suppress=177,550",)
_lib: ctypes.CDLL | None = None
_lock = threading.Lock()


@dataclass(frozen=True)
class Ptx:
    """The PTX of one compile, and NVRTC's log (empty when it warned of nothing)."""

    text: str
    log: str


def library_path() -> str | None:
    """Where libnvrtc is: $DTM_NVRTC, else the newest among the installed `nvidia` wheels
    (nvidia/cu13/lib/libnvrtc.so.13, ...), else the system's; None when there is none."""
    env = os.environ.get("DTM_NVRTC")
    if env:
        return env
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec is not None else []:
        found = sorted(p for p in glob.glob(os.path.join(base, "*", "lib", "libnvrtc.so*")) if "builtins" not in p)
        if found:
            return found[-1]
    return ctypes.util.find_library("nvrtc")


def library() -> ctypes.CDLL:
    """NVRTC, loaded once; E0806 naming what installs it when it cannot be had."""
    global _lib
    with _lock:
        if _lib is None:
            path = library_path()
            if path is None:
                raise BuildError(E.BUILD_FAILED, "NVRTC (CUDA's run-time compiler) was not found: install it with "
                                 "pip install -e '.[cuda]' (PyPI's nvidia-cuda-nvrtc), or set DTM_NVRTC to the path "
                                 "of a libnvrtc.so")
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                raise BuildError(E.BUILD_FAILED, f"NVRTC at {path} cannot be loaded: {e}") from None
            lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            _lib = lib
    return _lib


def version() -> tuple[int, int]:
    """NVRTC's version, (major, minor)."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def options(arch: str = DEFAULT_ARCH) -> tuple[str, ...]:
    """NVRTC's options for PTX of `arch` ("sm_90") with the spec's numerics."""
    if not (arch.startswith("sm_") and arch[3:].isdigit()):
        raise BuildError(E.BUILD_FAILED, f"a CUDA architecture is named sm_<number> (sm_90), not {arch!r}")
    return (f"--gpu-architecture=compute_{arch[3:]}", "--std=c++17", *NUMERICS, *QUIET)


def compile_ptx(source: str, name: str, arch: str = DEFAULT_ARCH) -> Ptx:
    """The PTX of CUDA C `source` (kernels `name`, for messages), from the cache when it was
    compiled before; E0806 quoting NVRTC's first error and naming the source's file."""
    opts = options(arch)
    key = hashlib.sha256("\0".join([source, " ".join(opts), "%d.%d" % version()]).encode()).hexdigest()[:40]
    d = made(cache_dir() / "cuda", "DTM_CACHE_DIR")
    ptx_path, log_path = d / f"{key}.ptx", d / f"{key}.log"
    if ptx_path.exists() and log_path.exists():
        return Ptx(ptx_path.read_text(), log_path.read_text())
    src = d / f"{key}.cu"
    write_atomic(src, source.encode())
    text, log, ok = _nvrtc(source, f"{key}.cu", opts)
    if not ok:
        errors = [line for line in log.splitlines() if "error" in line]
        raise BuildError(E.BUILD_FAILED, f"NVRTC failed on kernels {name}: {(errors or log.splitlines() or ['?'])[0]} "
                         f"(source: {src})")
    write_atomic(log_path, log.encode())
    write_atomic(ptx_path, text.encode())
    return Ptx(text, log)


def _nvrtc(source: str, filename: str, opts: tuple) -> tuple[str, str, bool]:
    """One NVRTC compile: (PTX, log, whether it compiled)."""
    lib = library()
    prog = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), filename.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        args = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
        rc = lib.nvrtcCompileProgram(prog, len(opts), args)
        size = ctypes.c_size_t()
        _check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
        buf = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.value.decode(errors="replace").strip()
        if rc != 0:
            return "", log or lib.nvrtcGetErrorString(rc).decode(), False
        _check(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
        buf = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
        return buf.value.decode(), log, True
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _check(rc: int, call: str) -> None:
    if rc != 0:
        raise BuildError(E.BUILD_FAILED, f"NVRTC's {call} failed: {library().nvrtcGetErrorString(rc).decode()}")


__all__ = ["Ptx", "compile_ptx", "library_path", "options", "version", "DEFAULT_ARCH"]
