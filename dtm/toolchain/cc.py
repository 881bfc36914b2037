"""Build C sources into shared objects with the system C compiler, cached on disk (layer
1.5, beneath the backends and comm): the cpu backend's kernels and runtime libraries, and
comm's C pumps and codec, are compiled here.

    so = build(source, "ring_pump", flags)      # the path of the object, from the cache when built before
    lib = load(so)                               # a ctypes.CDLL, once per process

The cache lives in $DTM_CACHE_DIR, else ~/.cache/dtm (or in a directory the caller names).
An object is named by the sha256 of its source, the flags, the compiler's path, its
`--version` text and what -march=native means on this CPU (`native_target`), so a second
build of the same source is a file lookup (no compiler call), and a new compiler, flags or
CPU never reuse a stale object. Objects are written to a temporary name and renamed into
place (os.replace is atomic), so processes that build the same object at the same time all
end with a complete one; and a process about to compile an object first takes a build lock
(flock, one of LOCK_STRIPES per directory), so that the ranks of a job starting together on
an empty cache compile each object once, the others waiting for it. Beside each object its
SHA-256 (`<key>.sha256`) is written, atomically, after a successful compile and before the object is renamed into place; an
object that does not match it (truncated, emptied, damaged on disk: loading it would crash
the process) is rebuilt, with one warning. The source is kept beside it (`<key>.c`); a
failed compile raises DTMError E0806 naming that file and quoting the compiler. The compiler
is $CC, else `cc`, else `gcc`. The cache is bounded ($DTM_CACHE_MAX, kernel_cache.py): the
least recently used objects go first. Loading uses ctypes, which releases the GIL during
each call.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from ..errors import DTMError, ErrorCode as E
from . import kernel_cache

log = logging.getLogger("dtm.compiler")

COMPILE_TIMEOUT = 300.0  # seconds for one compile
LOCK_STRIPES = 64  # build locks in a cache directory: objects whose keys fall on one wait for each other
BASE_FLAGS = ("-std=gnu11", "-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno")
STATS = {"compiles": 0, "hits": 0}  # counters, for tests and DTM_DEBUG
lock = threading.Lock()  # (the builds' counters and memos; the cpu backend's build takes it too)
_versions: dict[str, str] = {}
_targets: dict[str, str] = {}
_TARGET_FLAG = re.compile(r'"?(-m[^\s"]+|[lL][12]-cache-[^\s"]+|-target-cpu" "[^"]+|-target-feature" "[^"]+)')
_loaded: dict[str, ctypes.CDLL] = {}
_intact: set[Path] = set()  # objects this process checked against their checksum


class BuildError(DTMError):
    """The C compiler is missing or failed."""


def made(d: Path, variable: str) -> Path:
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
    return made(Path(os.environ.get("DTM_CACHE_DIR") or Path.home() / ".cache" / "dtm"), "DTM_CACHE_DIR")


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


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file renamed into place: a reader finds the
    old file or the whole new one, never a part."""
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


def build(source: str, name: str, flags: tuple, libs: tuple = ("-lm",), where: Path | None = None) -> Path:
    """The path of the shared object built from `source` with `flags` and linked with
    `libs`, in directory `where` (default: cache_dir()), from there when present."""
    cc = compiler()
    key = hashlib.sha256("\0".join([source, " ".join(flags + libs), cc, compiler_version(cc),
                                    native_target(cc)]).encode()).hexdigest()[:40]
    d = cache_dir() if where is None else where
    so, digest = d / f"{key}.so", d / f"{key}.sha256"
    if _cached(so, digest, name):
        return so
    with _building(d, key, name):
        if _cached(so, digest, name, quiet=True):  # another process built it meanwhile
            return so
        return _compile(source, name, flags, libs, cc, d, key)


def _cached(so: Path, digest: Path, name: str, quiet: bool = False) -> bool:
    """Whether object `so` is in the cache, intact (_checked); a hit counted."""
    if not (so.exists() and _checked(so, digest, name, quiet)):
        return False
    with lock:
        STATS["hits"] += 1
    return True


@contextlib.contextmanager
def _building(d: Path, key: str, name: str):
    """Held while this process builds object `key` in directory d: the ranks of a job (and
    the tests' processes) that start together with an empty cache wait for the one that
    builds an object instead of each building it again (4 ranks on 2 cores: 4 compiles of
    every kernel). An advisory lock (flock) on one of LOCK_STRIPES files in d/.locks, so
    their number stays bounded; it goes with the process that holds it, however that ends.
    Where the file cannot be locked (a read-only cache) the build goes on without it."""
    try:
        locks = made(d / ".locks", "DTM_CACHE_DIR")
        fd = os.open(locks / f"{int(key[:8], 16) % LOCK_STRIPES}", os.O_RDWR | os.O_CREAT, 0o644)
    except (OSError, BuildError):
        yield
        return
    try:
        deadline = time.monotonic() + COMPILE_TIMEOUT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BuildError(E.TIMEOUT, f"kernel {name}: another process held the build lock of {d} for "
                                     f"longer than {COMPILE_TIMEOUT:g} s") from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _compile(source: str, name: str, flags: tuple, libs: tuple, cc: str, d: Path, key: str) -> Path:
    """Compile `source` into d/<key>.so (see build)."""
    so, digest = d / f"{key}.so", d / f"{key}.sha256"
    src = d / f"{key}.c"
    try:
        write_atomic(src, source.encode())
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
            write_atomic(digest, _sha256(Path(tmp)).encode())
            os.replace(tmp, so)
        except OSError as e:
            raise _unwritable(d, name, e) from None
        with lock:
            STATS["compiles"] += 1
            _intact.add(so)
    finally:
        Path(tmp).unlink(missing_ok=True)
    kernel_cache.trim_later(d)  # the cache grew: keep it within its bound
    return so


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _checked(so: Path, digest: Path, name: str, quiet: bool = False) -> bool:
    """Whether cached object `so` is the one its build wrote (`digest` holds its SHA-256),
    checked once per process, before anything loads it; False (build it again) with a
    warning when it is not (unless `quiet`: said already), quietly when it has no checksum
    (an older cache)."""
    with lock:
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
        if quiet:
            return False
        log.warning("kernel %s: the cached object %s is damaged (it does not match the checksum its build "
                    "wrote): building it again", name, so)
        return False
    with lock:
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
    with lock:
        lib = _loaded.get(key)
        if lib is None:
            mode = ctypes.RTLD_GLOBAL if global_symbols else ctypes.RTLD_LOCAL
            lib = _loaded[key] = ctypes.CDLL(key, mode=mode)
    return lib


_TARGET_FEATURES = {"avx512bf16": "-mavx512bf16", "amx": "-mamx-bf16"}


def compiler_offers(feature: str) -> bool:
    """Whether -march=native lets the C compiler use `feature` ("avx512bf16", "amx") on this
    CPU: the detection the bf16 products' library is built with (its #if on the compiler's
    macros), as the f32 products' is for AVX-512."""
    flag = _TARGET_FEATURES[feature]
    return any(t == flag for t in native_target(compiler()).split())


__all__ = ["BuildError", "build", "load", "compiler", "compiler_version", "compiler_offers", "native_target",
           "cache_dir", "made", "STATS", "BASE_FLAGS", "COMPILE_TIMEOUT"]
