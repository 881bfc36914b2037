"""The build and the kernel cache: a second build is a cache hit (no compiler call), builds
racing in two processes both succeed, compile failures and a missing compiler are DTMErrors
that say where and what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from dtm.backends.cpu import build as B

from dtm.toolchain import cc as T
from dtm.errors import DTMError, ErrorCode as E

SRC = """#include <stdint.h>
/* %s */
void dtm_kernel(void *const *bufs, const int64_t *dims) {
  double *out = (double *)bufs[0];
  out[0] = (double)dims[0] * 2.5;
}
"""


def _call(fn, n: int) -> float:
    import ctypes

    out = (ctypes.c_double * 1)()
    bufs = (ctypes.c_void_p * 1)(ctypes.addressof(out))
    dims = (ctypes.c_int64 * 1)(n)
    fn(bufs, dims)
    return out[0]


def test_second_build_hits_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DTM_CACHE_DIR", str(tmp_path))
    src = SRC % uuid.uuid4().hex
    before = T.STATS["compiles"]
    so = T.build(src, "k", B.kernel_flags())
    assert T.STATS["compiles"] == before + 1
    assert so.parent == tmp_path and so.exists() and so.with_suffix(".c").read_text() == src

    def no_compiler(*a, **kw):
        raise AssertionError("the compiler ran on a cache hit")

    monkeypatch.setattr(T.subprocess, "run", no_compiler)
    hits = T.STATS["hits"]
    assert T.build(src, "k", B.kernel_flags()) == so
    assert T.STATS["hits"] == hits + 1
    assert _call(B.load_kernel(src, "k"), 4) == 10.0


def test_flags_and_source_are_part_of_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("DTM_CACHE_DIR", str(tmp_path))
    src = SRC % uuid.uuid4().hex
    a = T.build(src, "k", B.kernel_flags())
    b = T.build(src, "k", flags=B.KERNEL_FLAGS + ("-DDTM_TEST_FLAG",))
    c = T.build(src + "\n", "k", B.kernel_flags())
    assert len({a, b, c}) == 3


def test_gcc_alone_gets_its_own_kernel_flags(monkeypatch):
    """GCC_KERNEL_FLAGS (a --param clang rejects) join the kernel flags only for GCC, told
    apart by its --version text."""
    cc = T.compiler()
    monkeypatch.setitem(T._versions, cc, "gcc (Debian 12.2.0-14) 12.2.0\nCopyright (C) 2022 Free Software Foundation, Inc.")
    assert B.kernel_flags() == B.KERNEL_FLAGS + B.GCC_KERNEL_FLAGS
    monkeypatch.setitem(T._versions, cc, "Debian clang version 14.0.6\nTarget: x86_64-pc-linux-gnu")
    assert B.kernel_flags() == B.KERNEL_FLAGS


def test_concurrent_builds_in_two_processes(tmp_path):
    src = SRC % uuid.uuid4().hex
    script = textwrap.dedent(f"""
        import sys
        from dtm.backends.cpu import build as B
        from dtm.toolchain import cc as T
        fn = B.load_kernel({src!r}, "race")
        import ctypes
        out = (ctypes.c_double * 1)()
        fn((ctypes.c_void_p * 1)(ctypes.addressof(out)), (ctypes.c_int64 * 1)(2))
        assert out[0] == 5.0, out[0]
        print("ok", T.STATS["compiles"] + T.STATS["hits"])
    """)
    env = dict(os.environ, DTM_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.startswith("ok 1")
    sos = list(tmp_path.glob("*.so"))
    assert len(sos) == 1 and not list(tmp_path.glob("*.tmp"))


def test_processes_building_one_kernel_compile_it_once(tmp_path):
    """The ranks of a job starting together on an empty cache: one compiles each object, the
    others wait for it (cc._building), instead of all compiling it. The compiler is made slow
    (a wrapper that sleeps 1.5 s first) so that the three processes' builds overlap."""
    wrapper = tmp_path / "slow-cc"
    wrapper.write_text('#!/bin/sh\ncase "$*" in *" -o "*) sleep 1.5;; esac\nexec gcc "$@"\n')
    wrapper.chmod(0o755)
    src = SRC % uuid.uuid4().hex
    script = textwrap.dedent(f"""
        import ctypes
        from dtm.backends.cpu import build as B
        from dtm.toolchain import cc as T
        T.compiler_version(T.compiler()), T.native_target(T.compiler())  # (before the race: the same start for all)
        fn = B.load_kernel({src!r}, "race")
        out = (ctypes.c_double * 1)()
        fn((ctypes.c_void_p * 1)(ctypes.addressof(out)), (ctypes.c_int64 * 1)(2))
        assert out[0] == 5.0, out[0]
        print("compiles", T.STATS["compiles"])
    """)
    cache = tmp_path / "cache"
    env = dict(os.environ, DTM_CACHE_DIR=str(cache), DTM_RUNTIME_DIR=str(tmp_path / "runtime"), CC=str(wrapper))
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    compiles = 0
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        compiles += int(out.split()[-1])
    assert compiles == 1
    assert len(list(cache.glob("*.so"))) == 1


def test_compile_error_names_the_source_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DTM_CACHE_DIR", str(tmp_path))
    src = "void dtm_kernel(void) { this is not C; }\n"
    with pytest.raises(DTMError) as e:
        T.build(src, "k_bad", B.kernel_flags())
    assert e.value.code is E.BUILD_FAILED
    path = next(tmp_path.glob("*.c"))
    assert str(path) in e.value.message and "k_bad" in e.value.message
    assert "error" in e.value.message and "\n" not in e.value.message  # the compiler's first error line
    assert path.read_text() == src
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob("*.tmp"))


def test_a_killed_compiler_says_it_was_killed(tmp_path, monkeypatch):
    """A compiler the out-of-memory killer ends (as a kernel of hundreds of MB of C did)."""
    cc = tmp_path / "cc-killed"
    cc.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo fake-cc 1.0; exit 0; }\n'
                  'echo "cc: fatal error: Killed signal terminated program cc1" >&2\nkill -9 $$\n')
    cc.chmod(0o755)
    monkeypatch.setenv("DTM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(cc))
    with pytest.raises(DTMError) as e:
        T.build(SRC % uuid.uuid4().hex, "k_big", B.kernel_flags())
    assert e.value.code is E.BUILD_FAILED
    assert "k_big" in e.value.message and "killed" in e.value.message and "out of memory" in e.value.message


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DTM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(DTMError) as e:
        T.build(SRC % uuid.uuid4().hex, "k", B.kernel_flags())
    assert e.value.code is E.BUILD_FAILED
    assert "no-such-cc" in e.value.message and "install gcc" in e.value.message and "CC" in e.value.message


def test_missing_compiler_through_the_backend(tmp_path, monkeypatch):
    import numpy as np

    from dtm.ir import parse
    from dtm.runtime.cpu import CpuBackend

    monkeypatch.setenv("DTM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/bin/cc")
    m = parse("dtm 1.0\n\nfunc @f(%x: f32[3]) -> (f32[3]) {\n  %y = exp %x : f32[3]\n  return %y\n}\n")
    with pytest.raises(DTMError) as e:
        CpuBackend().run(m, "f", [np.zeros(3, np.float32)])
    assert e.value.code is E.BUILD_FAILED and "install gcc" in e.value.message


def test_math_runs_in_vector_versions_where_the_c_library_has_them(tmp_path, monkeypatch):
    """Where glibc's libmvec is there, a tanh kernel calls its vector version (the test
    cannot pass through the scalar loop: the shared object must name a _ZGV symbol), and
    agrees with numpy in f32 and f64; where it is not, the probe says so."""
    import ctypes.util

    import numpy as np

    from dtm.ir import parse

    if not B.vector_math():
        assert ctypes.util.find_library("mvec") is None, "libmvec is here, but the probe found no vector math"
        return
    monkeypatch.setenv("DTM_CACHE_DIR", str(tmp_path))
    for dt, np_dt, rtol in (("f32", np.float32, 2e-6), ("f64", np.float64, 1e-13)):
        m = parse(f"dtm 1.0\n\nfunc @f(%x: {dt}[4096]) -> ({dt}[4096]) {{\n  %y = tanh %x : {dt}[4096]\n"
                  f"  %z = exp %y : {dt}[4096]\n  return %z\n}}\n")
        x = np.concatenate([np.linspace(-20, 20, 4090), [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30]]).astype(np_dt)
        from dtm.runtime.cpu import CpuBackend
        (got,) = CpuBackend().run(m, "f", [x])
        np.testing.assert_allclose(got, np.exp(np.tanh(x.astype(np.float64))).astype(np_dt), rtol=rtol,
                                   equal_nan=True)
    assert any(b"_ZGV" in so.read_bytes() for so in tmp_path.glob("*.so") if "probe" not in so.name)


_RUN_CACHED = """
import ctypes, sys
from dtm.backends.cpu import build as B
from dtm.toolchain import cc as T
fn = B.load_kernel(sys.argv[1], "cached")
out = (ctypes.c_double * 1)()
fn((ctypes.c_void_p * 1)(ctypes.addressof(out)), (ctypes.c_int64 * 1)(2))
print(out[0], T.STATS["compiles"], T.STATS["hits"])
"""


@pytest.mark.parametrize("damage", ["empty", "truncated", "flipped"])
def test_a_damaged_cached_object_is_rebuilt_with_one_warning(tmp_path, damage):
    """A cached .so cut short or changed on disk crashed every later run (a bus error in
    dlopen, or "file too short") and was never rebuilt: each run checks it against the
    checksum written beside it and builds it again, saying so."""
    src = SRC % uuid.uuid4().hex
    env = dict(os.environ, DTM_CACHE_DIR=str(tmp_path))

    def run() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _RUN_CACHED, src], env=env, capture_output=True, text=True,
                              timeout=120)

    first = run()
    assert first.returncode == 0 and first.stdout.split() == ["5.0", "1", "0"], first.stderr
    so = next(tmp_path.glob("*.so"))
    assert so.with_suffix(".sha256").exists()
    data = so.read_bytes()
    so.write_bytes({"empty": b"", "truncated": data[:len(data) // 2],
                    "flipped": data[:100] + bytes([data[100] ^ 0xFF]) + data[101:]}[damage])
    again = run()
    assert again.returncode == 0 and again.stdout.split() == ["5.0", "1", "0"], again.stderr
    assert again.stderr.count("is damaged") == 1 and str(so) in again.stderr
    third = run()  # repaired: a plain cache hit, nothing said
    assert third.stdout.split() == ["5.0", "0", "1"] and "is damaged" not in third.stderr, third.stderr


def test_an_object_without_a_checksum_is_rebuilt_quietly(tmp_path, monkeypatch):
    """A cache from before checksums: its objects are built again once, without a warning."""
    monkeypatch.setenv("DTM_CACHE_DIR", str(tmp_path))
    src = SRC % uuid.uuid4().hex
    so = T.build(src, "k", B.kernel_flags())
    so.with_suffix(".sha256").unlink()
    T._intact.discard(so)
    before = T.STATS["compiles"]
    assert T.build(src, "k", B.kernel_flags()) == so and T.STATS["compiles"] == before + 1
    assert so.with_suffix(".sha256").exists()


def test_the_products_library_builds_while_the_passes_run(tmp_path):
    """A program with f32 products starts the runtime library's build (the slowest compile of
    a small program's first run) and the probe of the vector math functions when its passes
    start, on another core; both are then taken from those builds, each compiled once."""
    code = textwrap.dedent("""
        from dtm.backends.cpu import build as B
        from dtm.toolchain import cc as T
        from dtm.backends.cpu.passes import compile_func
        from dtm.ir import parse
        m = parse("dtm 1.0\\n\\nfunc @f(%a: f32[8, 8], %b: f32[8, 8]) -> (f32[8, 8]) {\\n"
                  "  %c = matmul %a, %b : f32[8, 8]\\n  return %c\\n}\\n")
        compile_func(m, "f")
        assert "f32" in B._prebuilds and "vector_math" in B._prebuilds, B._prebuilds
        B.runtime_library("f32")
        assert B.vector_math()
        assert T.STATS["compiles"] == 2 and not B._prebuilds, (T.STATS, B._prebuilds)
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "DTM_RUNTIME_DIR"}  # (where one is set, it holds them built)
    env["DTM_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_cpu_is_part_of_the_key(tmp_path, monkeypatch):
    # -march=native builds for this CPU: a cache shared with a machine of another CPU (a home
    # directory on a network drive) must not hand out this machine's objects there
    monkeypatch.setenv("DTM_CACHE_DIR", str(tmp_path))
    src = SRC % uuid.uuid4().hex
    cc = T.compiler()
    assert "-m" in T.native_target(cc)  # gcc's -m flags, clang's -target-feature
    here = T.build(src, "k", B.kernel_flags())
    monkeypatch.setitem(T._targets, cc, T.native_target(cc) + " -mno-avx512f")
    there = T.build(src, "k", B.kernel_flags())
    assert here != there and here.exists() and there.exists()


def test_the_runtime_libraries_build_where_DTM_RUNTIME_DIR_says(tmp_path):
    code = textwrap.dedent("""
        import numpy as np, os
        from dtm.backends.cpu import build as B
        from dtm.toolchain import cc as T
        from dtm.ir import parse
        from dtm.runtime.backend import get_backend
        m = parse("dtm 1.0\\n\\nfunc @f(%a: f32[8, 8], %b: f32[8, 8]) -> (f32[8, 8]) {\\n"
                  "  %c = matmul %a, %b : f32[8, 8]\\n  return %c\\n}\\n")
        a = np.arange(64, dtype=np.float32).reshape(8, 8)
        np.testing.assert_allclose(get_backend("cpu").plan(m, "f").run([a, a])[0], a @ a)
        print("ok")
    """)
    kernels, runtime = tmp_path / "kernels", tmp_path / "runtime"
    env = dict(os.environ, DTM_CACHE_DIR=str(kernels), DTM_RUNTIME_DIR=str(runtime))
    for _ in range(2):  # the second process finds the runtime library built, in a new kernel cache
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
        sources = {p.read_text().splitlines()[0] for p in runtime.glob("*.c")}
        # the products, the launch loop (c_move.py) and the vector-math probe
        assert any("runtime library" in s for s in sources) and len(list(runtime.glob("*.so"))) == 3
        assert all(p.read_text().startswith("/* DTM kernels */") for p in kernels.glob("*.c"))
        assert len(list(kernels.glob("*.so"))) == 1
        env["DTM_CACHE_DIR"] = str(tmp_path / "kernels2")
        kernels = tmp_path / "kernels2"


def test_kernels_split_into_units_that_compile_in_about_equal_time():
    sizes = {i: s for i, s in enumerate([25_000, 900, 12_000, 4_000, 30_000, 7_000, 3_000, 18_000] * 3)}
    units = B._units(sizes, cores=2)
    assert sorted(i for u in units for i in u) == sorted(sizes)  # every kernel once
    assert len(units) % 2 == 0 and len(units) == 2 * -(-sum(sizes.values()) // (2 * B.UNIT_BYTES))
    loads = [sum(sizes[i] for i in u) for u in units]
    assert max(loads) - min(loads) <= max(sizes.values())
    assert B._units({0: 100, 1: 200}, cores=16) == [[1], [0]]  # no empty unit


def test_a_trace_starts_the_runtime_libraries(tmp_path):
    # dtm.jit's trace (and autodiff) runs before the passes: the libraries start building then
    code = textwrap.dedent("""
        import numpy as np
        import dtm
        from dtm.backends.cpu import build as B
        from dtm.toolchain import cc as T
        f = dtm.jit(lambda x: x * 2, backend="cpu")
        f.ir(dtm.tensor(np.ones(3, np.int64)))  # a trace, no compile
        assert {"f32", "move"} <= set(B._prebuilds) and "i64" not in B._prebuilds, B._prebuilds
        np.testing.assert_array_equal(f(dtm.tensor(np.arange(3))).numpy(), np.arange(3) * 2)
        print("ok")
    """)
    env = dict(os.environ, DTM_CACHE_DIR=str(tmp_path), DTM_RUNTIME_DIR=str(tmp_path / "runtime"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# --- the bound on the cache (kernel_cache.py) -------------------------------------------------

def _key(i: int) -> str:
    return f"{i:040x}"


def _fake_key(d, i: int, size: int, used: float) -> None:
    for suffix, n in (("so", size), ("c", 100), ("sha256", 64)):
        p = d / f"{_key(i)}.{suffix}"
        p.write_bytes(b"x" * n)
        os.utime(p, (used, used))


def test_the_cache_sheds_its_least_recently_used_kernels_past_its_bound(tmp_path):
    from dtm.toolchain import kernel_cache as K

    now = 1_000_000_000.0
    for i in range(10):  # key i last used i hours (and a minute) ago: 9 is the oldest
        _fake_key(tmp_path, i, 10_000, now - 3600 * i - 60)
    (tmp_path / "store").mkdir()                         # the default tensor store lives here
    (tmp_path / "store" / "index.sqlite").write_bytes(b"y" * 500_000)
    (tmp_path / "notes.txt").write_bytes(b"z" * 500_000)  # not a build's file
    dead = tmp_path / f".{_key(42)}.abc.so.tmp"           # a build that died, long ago
    dead.write_bytes(b"t")
    os.utime(dead, (now - 7200, now - 7200))
    fresh = tmp_path / f".{_key(43)}.abc.so.tmp"          # a build in flight
    fresh.write_bytes(b"t")
    os.utime(fresh, (now, now))
    each = 10_000 + 100 + 64
    assert K.trim(tmp_path, limit=20 * each, now=now) == []          # within the bound: nothing goes
    removed = K.trim(tmp_path, limit=8 * each, now=now)
    assert removed == [_key(9), _key(8), _key(7), _key(6)]          # down to 3/4 of the bound, oldest first
    left = sorted(p.name for p in tmp_path.iterdir())
    assert [n for n in left if n.endswith(".so") and not n.startswith(".")] == [f"{_key(i)}.so" for i in range(6)]
    assert not any(n.startswith((_key(9), _key(6))) for n in left)  # whole keys: object, source, checksum
    assert "notes.txt" in left and (tmp_path / "store" / "index.sqlite").exists() and fresh.exists()
    assert not dead.exists()
    # a key used within MIN_AGE_S stays even past the bound (another process may be loading it)
    assert K.trim(tmp_path, limit=1, now=now, min_age_s=3600 * 3) == [_key(5), _key(4), _key(3)]
    assert {p.name[:40] for p in tmp_path.glob("*.so")} == {_key(0), _key(1), _key(2)}


def test_a_cache_hit_marks_the_kernel_used_and_the_bound_is_read_from_the_environment(tmp_path, monkeypatch):
    from dtm.toolchain import kernel_cache as K

    monkeypatch.setenv("DTM_CACHE_DIR", str(tmp_path))
    src = SRC % uuid.uuid4().hex
    so = T.build(src, "k", B.kernel_flags())
    assert (tmp_path / K.MARKER).exists()                 # the compile had this cache looked at
    os.utime(so, (1e9, 1e9))
    T._intact.discard(so)                                 # as a new process finds it
    assert T.build(src, "k", B.kernel_flags()) == so and so.stat().st_mtime > 1e9 + 3600
    for text, want in (("0", 0), ("500M", 500 << 20), ("2G", 2 << 30), ("1.5GiB", int(1.5 * (1 << 30))),
                       ("123456", 123456), ("", K.DEFAULT_MAX_BYTES), ("lots", K.DEFAULT_MAX_BYTES)):
        monkeypatch.setenv("DTM_CACHE_MAX", text)
        assert K.max_bytes() == want, text
