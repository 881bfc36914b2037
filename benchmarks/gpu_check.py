"""Issue 35's check on a real GPU, as one script (a GPU session has about 15 minutes of
device time: run this first, then fix what it finds).

1. GPT-2's forward, training and decoding steps (a small configuration) through the cuda
   backend's passes, compiled by NVRTC for the GPU's own architecture (sm_90 without one).
2. With a GPU: each unit's PTX loaded by the driver (cuModuleLoadData: the driver's JIT
   accepts what NVRTC made) and every launch's function found in it.
3. With a GPU: programs made only of kernels (elementwise, softmax, layer norm, full sums:
   the grid, block and serial launches) run on the GPU through the driver API, their
   launches as render_cuda says (blocks(count) x THREADS; one block; one thread), and
   compared with the reference; then a 4096 x 4096 softmax timed against the cpu backend.

There is no executor of whole programs on the GPU yet (products need cuBLAS, moves and
fallbacks their own steps): this checks what the renderer makes, on the hardware.

    python benchmarks/gpu_check.py          # prints each check; exits non-zero when one fails
"""

from __future__ import annotations

import ctypes
import ctypes.util
import pathlib
import sys
import time

import numpy as np

import dtm
from dtm.backends.cuda import passes as cuda
from dtm.backends.cuda.render_cuda import THREADS, blocks, render_program
from dtm.backends.gpu_probe import unavailable
from dtm.ir.dtypes import numpy_dtype
from dtm.ref import run as ref_run
from dtm.runtime.backend import get_backend
from dtm.toolchain import nvrtc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from test_compiler_ops import one_op  # noqa: E402 - a module of one op, as the op table's tests build it
from test_cuda_render import STEPS  # noqa: E402 - the GPT-2 steps those tests check on the CPU


class Driver:
    """The few calls of CUDA's driver API this check makes (ctypes on libcuda)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(ctypes.util.find_library("cuda"))
        self.call("cuInit", 0)
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), 0)
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.call("cuDeviceGetAttribute", ctypes.byref(major), 75, dev)  # COMPUTE_CAPABILITY_MAJOR
        self.call("cuDeviceGetAttribute", ctypes.byref(minor), 76, dev)  # COMPUTE_CAPABILITY_MINOR
        self.arch = f"sm_{major.value}{minor.value}"
        name = ctypes.create_string_buffer(256)
        self.call("cuDeviceGetName", name, 256, dev)
        self.name = name.value.decode()
        self.ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(self.ctx), dev)
        self.call("cuCtxSetCurrent", self.ctx)

    def call(self, fn: str, *args) -> None:
        rc = getattr(self.lib, fn)(*args)
        if rc != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(text))
            raise RuntimeError(f"{fn}: error {rc} ({(text.value or b'?').decode()})")

    def module(self, ptx: str) -> ctypes.c_void_p:
        mod = ctypes.c_void_p()
        self.call("cuModuleLoadData", ctypes.byref(mod), ctypes.c_char_p(ptx.encode()))
        return mod

    def function(self, mod: ctypes.c_void_p, symbol: str) -> ctypes.c_void_p:
        fn = ctypes.c_void_p()
        self.call("cuModuleGetFunction", ctypes.byref(fn), mod, symbol.encode())
        return fn

    def alloc(self, nbytes: int) -> ctypes.c_uint64:
        ptr = ctypes.c_uint64()
        self.call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(max(nbytes, 1)))
        return ptr

    def put(self, ptr: ctypes.c_uint64, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a)
        self.call("cuMemcpyHtoD_v2", ptr, a.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(a.nbytes))

    def get(self, ptr: ctypes.c_uint64, a: np.ndarray) -> None:
        self.call("cuMemcpyDtoH_v2", a.ctypes.data_as(ctypes.c_void_p), ptr, ctypes.c_size_t(a.nbytes))

    def launch(self, fn: ctypes.c_void_p, grid: int, block: int, args: list) -> None:
        params = (ctypes.c_void_p * max(len(args), 1))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        self.call("cuLaunchKernel", fn, grid, 1, 1, block, 1, 1, 0, None, params, None)

    def sync(self) -> None:
        self.call("cuCtxSynchronize")


def gpt2_units(arch: str) -> list[tuple]:
    """(name, PTX, program) of GPT-2's three steps (tests/test_cuda_render.py's), for `arch`."""
    out = []
    for name, (fn, args) in sorted(STEPS.items()):
        program = cuda.compile_func(fn.ir(*args), "main")
        ptx = cuda.build(program, arch)
        assert ptx.log == "", ptx.log
        out.append((name, ptx.text, program))
    return out


def run_on_gpu(drv: Driver, module, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """A program of kernels only, each buffer its own device memory, run on the GPU."""
    program = cuda.compile_func(module, "f", upto="lower_loops")
    assert not program.fallbacks and not program.moves and not program.symbols, "kernels only, static shapes"
    unit, kernels = render_program(program)
    ptx = nvrtc.compile_ptx(unit, "gpu_check", drv.arch)
    assert ptx.log == "", ptx.log
    mod = drv.module(ptx.text)
    dev = {}
    for b in program.buffers:
        shape, dt = b.type.shape, numpy_dtype(b.type.dtype)
        host = inputs[b.index] if b.kind == "param" else (b.data if b.kind == "const" else np.empty(shape, dt))
        dev[id(b)] = (drv.alloc(np.asarray(host).nbytes), np.ascontiguousarray(host))
        if b.kind in ("param", "const"):
            drv.put(dev[id(b)][0], dev[id(b)][1])
    for step, ck in zip(program.kernels, kernels):
        args = [dev[id(b)][0] for b in step.args]
        for launch in ck.launches:
            assert launch.gemm is None and launch.symbol, "no products here"
            count = launch.count.value  # (static shapes: a literal)
            grid, block = {"grid": (blocks(count), THREADS), "block": (1, THREADS), "serial": (1, 1),
                           "quant": (blocks(count), THREADS)}[launch.kind]
            drv.launch(drv.function(mod, launch.symbol), grid, block, args)
    drv.sync()
    outs = []
    for b in program.returns:
        ptr, host = dev[id(b)]
        got = np.empty_like(host)
        drv.get(ptr, got)
        outs.append(got)
    return outs


def main() -> int:
    failed = 0
    why = unavailable("cuda")
    has_gpu = why.startswith("the NVIDIA driver sees")
    drv = Driver() if has_gpu else None
    arch = drv.arch if drv else nvrtc.DEFAULT_ARCH
    print(f"device: {drv.name + ' (' + arch + ')' if drv else 'none: ' + why}; NVRTC {nvrtc.version()}")
    t = time.perf_counter()
    units = gpt2_units(arch)
    print(f"1. GPT-2's steps compiled for {arch} without a warning in {time.perf_counter() - t:.1f} s: "
          + ", ".join(f"{name} {len(text) // 1024} KiB of PTX" for name, text, _ in units))
    if drv is None:
        print("2-3. skipped: no GPU here")
        return 0
    for name, text, program in units:
        mod = drv.module(text)
        symbols = [launch.symbol for ck in program.launches for launch in ck.launches if launch.symbol]
        for s in symbols:
            drv.function(mod, s)
        print(f"2. {name}: the driver loaded the PTX and found its {len(symbols)} functions")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 700)).astype(np.float32)
    cases = [("exp", (x,), {}), ("softmax", (x,), {"axis": 1}), ("layer_norm", (x,), {}),
             ("reduce_sum", (x,), {"axes": [0, 1]}), ("softmax", (x[:1],), {"axis": 1}), ("cumsum", (x[0],), {"axis": 0})]
    for op, arrays, attrs in cases:
        module = one_op(op, *arrays, **attrs)
        want = ref_run(module, "f", list(arrays))[0]
        try:
            got = run_on_gpu(drv, module, list(arrays))[0]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
            print(f"3. {op} {attrs} on {arrays[0].shape}: the GPU agrees with the reference")
        except Exception as e:  # (report every case, then fail)
            failed += 1
            print(f"3. {op} {attrs} on {arrays[0].shape}: FAILED: {e}")
    big = rng.standard_normal((4096, 4096)).astype(np.float32)
    module = one_op("softmax", big, axis=1)
    run_on_gpu(drv, module, [big])
    t = time.perf_counter()
    run_on_gpu(drv, module, [big])
    gpu_s = time.perf_counter() - t
    cpu = get_backend("cpu")
    cpu.run(module, "f", [big])
    t = time.perf_counter()
    cpu.run(module, "f", [big])
    cpu_s = time.perf_counter() - t
    print(f"softmax 4096 x 4096 (copies and compile cache included on the GPU): GPU {gpu_s * 1e3:.1f} ms, "
          f"cpu backend {cpu_s * 1e3:.1f} ms ({cpu_s / gpu_s:.1f}x)")
    print(f"dtm {dtm.__version__}: {failed} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
