"""The CUDA renderer: one loop-IR Kernel -> the CUDA C of its launches.

CUDA C's scalar code is C's, so the expressions, casts and helpers are the C renderer's
(dtm/backends/cpu/render_c.py: the same numerics, spec 2.8), the helpers marked
`__device__`. What differs is how the work is spread:

    grid      the kernel's outer parallel loop spread over the GPU's threads: thread t of the
              grid runs iterations t, t + stride, ... (a grid-stride loop), each one the
              loop's whole body, as one OpenMP thread runs it on the CPU;
    serial    a kernel whose top level is not one parallel loop (a full reduction, a scan,
              several loops in sequence) runs on one thread: correct, slow; the shared
              memory reductions that would spread it are not written yet;
    gemm      a product (the loop IR's Gemm statement) is a call of cuBLAS, made by the
              host (`Launch.gemm`), then its epilogue as a grid kernel over the product's
              rows, one row per thread (a row epilogue needs the whole row);
    quant     q8_0 / q4_0 (de)quantization, one block of 32 per thread.

Every launch is a `__global__` function `extern "C"` (its name unmangled, for the driver's
cuModuleGetFunction; DTM_GLOBAL, which emulate.py defines otherwise) whose parameters are
the kernel's buffers then its dims, by value:

    DTM_GLOBAL void __launch_bounds__(256) dtm_k3(float *__restrict__ out0, const float *__restrict__ in0, const int64_t n)

A grid launch of `count` work items takes `blocks(count)` blocks of THREADS threads.

`render_program` puts every kernel of a program into one translation unit, which NVRTC
compiles to PTX in one call (dtm/toolchain/nvrtc.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...compiler import loopir as L
from ...compiler.program import Program
from ...errors import DTMError, ErrorCode as E
from ..cpu import c_convert
from ..cpu.render_c import CTYPE, _Renderer

THREADS = 256  # threads per block of every launch
MAX_BLOCKS = 65535  # blocks of a launch at most: a grid-stride loop takes the rest


def blocks(count: int, cap: int = MAX_BLOCKS) -> int:
    """The blocks of a launch of `count` work items (at least one: CUDA refuses an empty grid)."""
    return max(1, min(-(-count // THREADS), cap))


# What CUDA C lacks of C's headers: the fixed-width types, their literals' macros, NAN and
# INFINITY (NVRTC compiles without the C library's headers), and C's `restrict`.
PRELUDE = """/* DTM kernels, CUDA C */
typedef signed char int8_t; typedef short int16_t; typedef int int32_t; typedef long long int64_t;
typedef unsigned char uint8_t; typedef unsigned short uint16_t; typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#define INT64_C(x) x##LL
#define UINT64_C(x) x##ULL
#define INT32_MIN (-2147483647 - 1)
#define INT64_MIN (-INT64_C(9223372036854775807) - 1)
#define NAN __int_as_float(0x7fc00000)
#define INFINITY __int_as_float(0x7f800000)
#define restrict __restrict__
#define DTM_GLOBAL extern "C" __global__
"""

QUANT_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}  # a block of 32 values: an f16 scale, then the values


class UnsupportedKernel(DTMError):
    """A kernel whose loop IR the CUDA renderer cannot spread over threads correctly."""


@dataclass
class Launch:
    """One step of a kernel on the GPU: a `__global__` function over `count` work items
    (grid: the parallel loop's iterations; serial: 1; quant: blocks; gemm: the epilogue's
    rows), or, for kind "gemm", first the cuBLAS product `gemm` (then `symbol`, its
    epilogue, when the product has one)."""

    kind: str                     # "grid", "serial", "gemm", "quant"
    symbol: str | None            # the __global__ function, None for a product without epilogue
    count: L.Expr                 # work items, over the kernel's dims
    gemm: L.Gemm | None = None


@dataclass
class CudaKernel:
    """One loop-IR kernel as CUDA C: its launches, in order, and the code of their
    functions (the helpers they call by name, once per unit)."""

    name: str
    launches: list
    helpers: dict
    code: str
    params: list = field(default_factory=list)  # the kernel's params then dims, the functions' arguments


def device_code(c: str) -> str:
    """A C helper as CUDA device code: its functions `__device__`, OpenMP's pragmas dropped
    (a helper runs on one thread; the launch spreads the work)."""
    lines = [line for line in c.split("\n") if not line.lstrip().startswith("#pragma omp")]
    # (not static: NVRTC warns of a static function a unit does not call; an unused one is
    # dropped from the PTX all the same, the unit being compiled whole)
    return "\n".join(lines).replace("static inline ", "__device__ __forceinline__ ").replace(
        "static void ", "__device__ void ")


class _CudaRenderer(_Renderer):
    def helper(self, name: str, code: str) -> str:
        return super().helper(name, device_code(code))

    def index_op(self, op: str, a: list) -> str:
        # an index divided by a dim of size 0 is read only inside a loop of no iterations:
        # 0 there, where C's compiler keeps the division and NVRTC warns of it
        if op in ("/", "%") and a[1] == "0":
            return "0"
        return super().index_op(op, a)

    def loop_pragmas(self, s: L.Loop) -> list[str]:
        # a thread's own loop. NVRTC unrolls nests of constant trips whole (4 x 16 x 64
        # iterations of a column sum: minutes of compile): an outer loop is kept rolled, the
        # innermost one it may still unroll
        return ["#pragma unroll 1"] if any(isinstance(x, L.Loop) for x in s.body) else []

    def body(self, stmts: list, depth: int, out: list) -> None:
        pad = "  " * depth
        for s in stmts:
            if isinstance(s, L.Quant):
                self.helper("dtm_narrow_floats", c_convert.narrow_float_helpers())
                self.helper("dtm_quant_blocks", c_convert.QUANT_C)
                fn = f"dtm_{'quantize' if s.quantize else 'dequantize'}_{s.dtype.name}"
                out.append(f"{pad}{fn}({self.expr(s.blocks)}, {s.src}, {s.dst});")
            elif isinstance(s, L.Gemm):
                raise UnsupportedKernel(E.BUILD_FAILED, "a product inside a loop or after other statements of its "
                                        "kernel: the cuda backend calls cuBLAS for a kernel that is one product")
            else:
                super().body([s], depth, out)


def _signature(k: L.Kernel, symbol: str, extra: tuple = ()) -> str:
    aliased = set(k.aliases) | set(k.aliases.values())
    args = []
    for p in k.params:
        const = "" if p.output else "const "
        restrict = "" if p.name in aliased else "__restrict__ "
        args.append(f"{const}{CTYPE[p.dtype.name]} *{restrict}{p.name}")
    args += [f"const int64_t {d}" for d in k.dims]
    args += [f"const int64_t {x}" for x in extra]
    return f"DTM_GLOBAL void __launch_bounds__({THREADS}) {symbol}({', '.join(args)})"


def _grid_loop(var: str, start: str, stop: str, pad: str) -> str:
    return (f"{pad}for (int64_t {var} = {start} + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; {var} < {stop}; "
            f"{var} += (int64_t)gridDim.x * blockDim.x) {{")


def _assigned(stmts: list, out: set) -> set:
    """The names of the temporaries `stmts` assign (Assign) or write (Store to an Array)."""
    for s in stmts:
        if isinstance(s, L.Assign):
            out.add(s.var.name)
        elif isinstance(s, L.Store):
            out.add(s.buf)
        elif isinstance(s, (L.Loop, L.If)):
            _assigned(s.body, out)
    return out


def _grid_split(body: list):
    """(prefix, loop) when `body` is declarations every thread may make alike (Bind, Let of
    values the loop never reassigns) and then one parallel loop; else None."""
    *prefix, last = body or [None]
    if not (isinstance(last, L.Loop) and last.parallel is not None):
        return None
    if not all(isinstance(s, (L.Bind, L.Let)) for s in prefix):
        return None
    written = _assigned(last.body, set())
    if any(isinstance(s, L.Let) and s.var.name in written for s in prefix):
        return None
    return prefix, last


def render_kernel(k: L.Kernel, symbol: str) -> CudaKernel:
    """The CUDA C of one kernel (see the module docstring)."""
    r = _CudaRenderer()
    code: list[str] = []
    launches: list[Launch] = []
    body = k.body
    if len(body) == 1 and isinstance(body[0], L.Gemm):
        g = body[0]
        launches.append(Launch("gemm", f"{symbol}_epilogue" if g.epilogue else None, _rows(g), g))
        if g.epilogue:
            code += _epilogue(r, k, g, f"{symbol}_epilogue")
    elif len(body) == 1 and isinstance(body[0], L.Quant):
        q = body[0]
        launches.append(Launch("quant", symbol, q.blocks))
        code += _quant(r, k, q, symbol)
    elif (split := _grid_split(body)) is not None:
        prefix, loop = split
        launches.append(Launch("grid", symbol, L.isub(loop.stop, loop.start)))
        code.append(_signature(k, symbol) + " {")
        r.body(prefix, 1, code)
        code.append(_grid_loop(loop.var, r.expr(loop.start), r.expr(loop.stop), "  "))
        r.body(loop.body, 2, code)
        code += ["  }", "}"]
    else:
        launches.append(Launch("serial", symbol, L.Const(1, L.INDEX)))
        code.append(_signature(k, symbol) + " {")
        code.append("  if (blockIdx.x != 0 || threadIdx.x != 0) return;")
        r.body(body, 1, code)
        code.append("}")
    return CudaKernel(k.name, launches, r.helpers, "\n".join(code), [p.name for p in k.params] + list(k.dims))


def _rows(g: L.Gemm) -> L.Expr:
    """The rows of a product, over all its batch entries: its epilogue's work items."""
    n = g.m
    for d in g.batch:
        n = L.imul(n, d)
    return n


def _epilogue(r: _CudaRenderer, k: L.Kernel, g: L.Gemm, symbol: str) -> list[str]:
    """The epilogue of product `g` after cuBLAS made it: one thread per row of one batch
    entry, over all of the row's columns (the bounds its body loops between)."""
    m = r.expr(g.m)
    code = [_signature(k, symbol) + " {", _grid_loop("row_", "0", r.expr(_rows(g)), "  ")]
    code += [f"    const int64_t bt = row_ / {m};", f"    const int64_t i0_ = row_ % {m}, i1_ = i0_ + 1;",
             f"    const int64_t j0_ = 0, j1_ = {r.expr(g.n)};",
]
    r.body(g.epilogue, 2, code)
    code += ["  }", "}"]
    return code


def _quant(r: _CudaRenderer, k: L.Kernel, q: L.Quant, symbol: str) -> list[str]:
    """(De)quantization of whole blocks, one block per thread."""
    r.helper("dtm_narrow_floats", c_convert.narrow_float_helpers())
    r.helper("dtm_quant_blocks", c_convert.QUANT_C)
    size = QUANT_BLOCK_BYTES[q.dtype.name]
    src, dst = (f"{q.src} + b_ * 32", f"{q.dst} + b_ * {size}") if q.quantize else \
        (f"{q.src} + b_ * {size}", f"{q.dst} + b_ * 32")
    fn = f"dtm_{'quantize' if q.quantize else 'dequantize'}_{q.dtype.name}"
    return [_signature(k, symbol) + " {", _grid_loop("b_", "0", r.expr(q.blocks), "  "),
            f"    {fn}(1, {src}, {dst});", "  }", "}"]


def render_program(program: Program) -> tuple[str, list[CudaKernel]]:
    """Every kernel of `program` as CUDA C, in one translation unit: (source, kernels)."""
    kernels = [render_kernel(step.kernel, f"dtm_k{i}") for i, step in enumerate(program.kernels)]
    helpers: dict = {}
    for ck in kernels:
        helpers.update(ck.helpers)
    return "\n".join([PRELUDE, *helpers.values(), *(ck.code for ck in kernels), ""]), kernels


__all__ = ["CudaKernel", "Launch", "PRELUDE", "THREADS", "UnsupportedKernel", "device_code", "render_kernel",
           "render_program"]
