"""The CUDA renderer: one loop-IR Kernel -> the CUDA C of its launches.

CUDA C's scalar code is C's, so the expressions, casts and helpers are the C renderer's
(dtm/backends/cpu/render_c.py: the same numerics, spec 2.8), the helpers marked
`__device__`. What differs is how the work is spread:

    grid      the kernel's outer parallel loop spread over the GPU's threads: thread t of the
              grid runs iterations t, t + stride, ... (a grid-stride loop), each one the
              loop's whole body, as one OpenMP thread runs it on the CPU;
    block     a kernel whose top level is loops in sequence (the reductions and stores of
              one row: a layer norm while decoding; a loss's sum) runs on one block: every
              thread holds the kernel's temporaries alike, a loop that stores each
              iteration's own elements is spread over the threads, a reduction too, each
              thread's partial then combined through shared memory and given to all;
    serial    any other kernel (a scan, a reduction whose loops also store) runs on one
              thread: correct, slow;
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

import math
from dataclasses import dataclass, field

import numpy as np

from ...compiler import loopir as L
from ...compiler.program import Program
from ...errors import DTMError, ErrorCode as E
from ...ir.dtypes import numpy_dtype
from ..cpu import c_convert
from ..cpu.render_c import CTYPE, _Renderer, ctype

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


class UnsupportedKernel(DTMError):
    """A kernel whose loop IR the CUDA renderer cannot spread over threads correctly."""


@dataclass
class Launch:
    """One step of a kernel on the GPU: a `__global__` function over `count` work items
    (grid: the parallel loop's iterations; block and serial: 1; quant: blocks; gemm: the epilogue's
    rows), or, for kind "gemm", first the cuBLAS product `gemm` (then `symbol`, its
    epilogue, when the product has one)."""

    kind: str                     # "grid", "block", "serial", "gemm", "quant"
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

    def gemm(self, g: L.Gemm, depth: int, out: list) -> None:
        raise UnsupportedKernel(E.BUILD_FAILED, "a product inside a loop or after other statements of its "
                                "kernel: the cuda backend calls cuBLAS for a kernel that is one product")


def _signature(k: L.Kernel, symbol: str) -> str:
    aliased = set(k.aliases) | set(k.aliases.values())
    args = []
    for p in k.params:
        const = "" if p.output else "const "
        restrict = "" if p.name in aliased else "__restrict__ "
        args.append(f"{const}{CTYPE[p.dtype.name]} *{restrict}{p.name}")
    args += [f"const int64_t {d}" for d in k.dims]
    return f"DTM_GLOBAL void __launch_bounds__({THREADS}) {symbol}({', '.join(args)})"


def _grid_loop(var: str, start: str, stop: str, pad: str) -> str:
    return (f"{pad}for (int64_t {var} = {start} + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; {var} < {stop}; "
            f"{var} += (int64_t)gridDim.x * blockDim.x) {{")


def _grid_split(body: list):
    """(prefix, loop) when `body` is declarations every thread may make alike (Bind, Let of
    values the loop never reassigns) and then one parallel loop; else None."""
    *prefix, last = body or [None]
    if not (isinstance(last, L.Loop) and last.parallel is not None):
        return None
    if not all(isinstance(s, (L.Bind, L.Let)) for s in prefix):
        return None
    if any(isinstance(s, L.Let) and s.var.name in _assigned(last.body) for s in prefix):
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
    elif (plan := _block_plan(body)) is not None:
        launches.append(Launch("block", symbol, L.Const(1, L.INDEX)))
        code += _block(r, k, plan, symbol)
    else:
        launches.append(Launch("serial", symbol, L.Const(1, L.INDEX)))
        code.append(_signature(k, symbol) + " {")
        code.append("  if (blockIdx.x != 0 || threadIdx.x != 0) return;")
        r.body(body, 1, code)
        code.append("}")
    return CudaKernel(k.name, launches, r.helpers, "\n".join(code), [p.name for p in k.params] + list(k.dims))


# the loop IR's reduction marks (OpenMP's names) as its ops
_COMBINE = {"+": "add", "*": "mul", "max": "max", "min": "min"}


def _identity(fn: str, dt) -> L.Const:
    """The value that `fn` (add, mul, max, min) combined with x leaves x."""
    if fn in ("add", "mul"):
        return L.Const(0 if fn == "add" else 1, dt)
    if dt.is_float:
        return L.Const(-math.inf if fn == "max" else math.inf, dt)
    info = np.iinfo(np.uint8 if dt.name == "bool" else numpy_dtype(dt))
    return L.Const(int(info.min) if fn == "max" else int(info.max), dt)


def _walk(stmts: list):
    """Every statement of `stmts`, those in loops' and ifs' bodies included."""
    for s in stmts:
        yield s
        if isinstance(s, (L.Loop, L.If)):
            yield from _walk(s.body)


def _assigned(stmts: list) -> set:
    """The names of the temporaries `stmts` assign."""
    return {s.var.name for s in _walk(stmts) if isinstance(s, L.Assign)}


def _reads(stmts: list, name: str) -> int:
    """How many times statements `stmts` read temporary `name`."""
    def count(e) -> int:
        if isinstance(e, L.Var):
            return int(e.name == name)
        if isinstance(e, L.Load):
            return count(e.index)
        return sum(count(a) for a in e.args) if isinstance(e, L.Op) else 0
    return sum(count(e) for s in _walk(stmts) for e in _exprs(s))


def _injective(index: L.Expr, var: str) -> bool:
    """Whether `index` steps by a non-zero constant with `var` and holds it nowhere else
    (the flat offsets of a loop over an output's elements): iterations store apart."""
    terms: list = []
    L._terms(index, 1, terms)
    own = [c for c, t in terms if t == L.Sym(var)]
    return len(own) == 1 and own[0] != 0 and all(var not in L.free_syms(t) for c, t in terms if t != L.Sym(var))


def _reduction(loop: L.Loop, outer: dict):
    """[(fn, name, dtype)] for a loop that only accumulates into temporaries declared before
    it (`outer`: name -> dtype): each by one Assign `v = fn(v, x)` that is the loop's only
    read of v, or as the lowering marked it (`loop.reduction`: a float max's where); and
    stores nothing. None when the loop is not such a reduction."""
    inner = list(_walk(loop.body))
    if any(isinstance(s, (L.Store, L.Array, L.Gemm, L.Quant)) for s in inner):
        return None
    targets = _assigned(loop.body) & set(outer)
    marked = {var: _COMBINE.get(op) for op, var in loop.reduction or ()}
    out = []
    for v in sorted(targets):
        if v in marked:
            fn = marked[v]
        else:
            updates = [s for s in inner if isinstance(s, L.Assign) and s.var.name == v]
            u = updates[0].value if len(updates) == 1 else None
            fn = u.op if (isinstance(u, L.Op) and u.op in ("add", "mul", "max", "min")
                          and u.args[0] == L.Var(v, outer[v]) and _reads(loop.body, v) == 1) else None
        if fn is None:
            return None
        out.append((fn, v, outer[v]))
    return out


def _block_plan(body: list) -> list | None:
    """How each top-level statement runs in one block of threads that all hold the same
    temporaries: ("all", s) every thread alike (declarations, updates of temporaries),
    ("one", s) thread 0, then the block waits (a store), ("spread", loop) its iterations over
    the threads (a loop storing each iteration's own elements), ("reduce", loop, vars) spread,
    then each thread's partial combined through shared memory and given to all. None when a
    statement fits none of them (the kernel then runs on one thread)."""
    outer: dict = {}
    plan: list = []
    for s in body:
        if isinstance(s, (L.Bind, L.Let, L.Assign)):
            if isinstance(s, L.Let):
                outer[s.var.name] = s.var.dtype
            plan.append(("all", s))
        elif isinstance(s, L.Store):
            plan.append(("one", s))
        elif isinstance(s, L.If) and not any(isinstance(x, (L.Store, L.Loop, L.Array, L.Gemm, L.Quant))
                                             for x in _walk(s.body)):
            plan.append(("all", s))
        elif isinstance(s, L.Loop):
            inner = list(_walk(s.body))
            if not _assigned(s.body) & set(outer):
                stores = [x for x in inner if isinstance(x, L.Store)]
                loads = {ld.buf for x in inner for e in _exprs(x) for ld in L.loads_of(e)}
                if any(isinstance(x, (L.Array, L.Gemm, L.Quant)) for x in inner) or \
                        any(st.buf in loads or not _injective(st.index, s.var) for st in stores):
                    return None
                plan.append(("spread", s))
            elif (vars_ := _reduction(s, outer)) is not None:
                plan.append(("reduce", s, vars_))
            else:
                return None
        else:
            return None
    return plan if any(kind in ("spread", "reduce") for kind, *_ in plan) else None


def _exprs(s) -> list:
    """The expressions statement s itself holds (not those of the statements in its body)."""
    if isinstance(s, (L.Let, L.Assign, L.Bind)):
        return [s.value]
    if isinstance(s, L.Store):
        return [s.index, s.value]
    if isinstance(s, L.If):
        return [s.cond]
    if isinstance(s, L.Loop):
        return [s.start, s.stop]
    return []


def _block(r: _CudaRenderer, k: L.Kernel, plan: list, symbol: str) -> list[str]:
    """A kernel of one block of THREADS threads running `plan` (_block_plan)."""
    code = [_signature(k, symbol) + " {", f"  __shared__ uint64_t dtm_red_[{THREADS}];  /* a partial per thread */"]
    for kind, s, *extra in plan:
        if kind == "all":
            r.body([s], 1, code)
        elif kind == "one":
            code.append("  if (threadIdx.x == 0) {")
            r.body([s], 2, code)
            code += ["  }", "  __syncthreads();"]
        else:
            reduced = extra[0] if kind == "reduce" else []
            for fn, v, dt in reduced:  # each thread's partial starts from fn's identity
                code.append(f"  const {ctype(dt)} {v}_before = {v}; {v} = {r.expr(_identity(fn, dt))};")
            code.append(f"  for (int64_t {s.var} = {r.expr(s.start)} + threadIdx.x; {s.var} < {r.expr(s.stop)}; "
                        f"{s.var} += blockDim.x) {{")
            r.body(s.body, 2, code)
            code += ["  }", "  __syncthreads();"]
            for fn, v, dt in reduced:
                t = ctype(dt)
                combined = r.expr(L.Op(fn, (L.Var("a_", dt), L.Var("b_", dt)), dt))
                code += [f"  (({t} *)dtm_red_)[threadIdx.x] = {v};", "  __syncthreads();",
                         "  if (threadIdx.x == 0) {",
                         "    for (unsigned t_ = 1; t_ < blockDim.x; t_++) {",
                         f"      const {t} a_ = {v}, b_ = (({t} *)dtm_red_)[t_]; {v} = {combined};", "    }",
                         f"    (({t} *)dtm_red_)[0] = {v};", "  }", "  __syncthreads();",
                         f"  {v} = (({t} *)dtm_red_)[0];", "  __syncthreads();",
                         f"  {{ const {t} a_ = {v}_before, b_ = {v}; {v} = {combined}; }}"]
    code.append("}")
    return code


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
             f"    const int64_t j0_ = 0, j1_ = {r.expr(g.n)};"]
    r.body(g.epilogue, 2, code)
    code += ["  }", "}"]
    return code


def _quant(r: _CudaRenderer, k: L.Kernel, q: L.Quant, symbol: str) -> list[str]:
    """(De)quantization of whole blocks, one block per thread."""
    r.helper("dtm_narrow_floats", c_convert.narrow_float_helpers())
    r.helper("dtm_quant_blocks", c_convert.QUANT_C)
    values, size = q.dtype.block, q.dtype.itemsize  # a block's values, its bytes (an f16 scale, then the values)
    src, dst = (f"{q.src} + b_ * {values}", f"{q.dst} + b_ * {size}") if q.quantize else \
        (f"{q.src} + b_ * {size}", f"{q.dst} + b_ * {values}")
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
