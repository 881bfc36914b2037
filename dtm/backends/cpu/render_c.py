"""The C renderer: one loop-IR Kernel -> one C11 function

    void <symbol>(void *const *bufs, const int64_t *dims)

`bufs` are the kernel's buffers in the order of its params, `dims` the values of its
symbols in the order of `kernel.dims`. `render_unit` puts several into one translation
unit (the build compiles a plan's kernels a few per compiler call). Numerics follow the spec (2.8): f32 computes in
float and f64 in double, without contraction into fused multiply-adds (-ffp-contract=off)
or any fast-math; integers wrap (arithmetic in an unsigned type, then converted back, so no
signed overflow is undefined), integer division by zero gives 0 and MIN / -1 wraps;
float-to-int conversion truncates and saturates (NaN -> 0). Transcendental functions are
the C library's (within a few ulp), erf on f32 goes through double. Max and min propagate
NaN. The outer loop runs on OpenMP threads when the work is large enough; reductions over
the innermost loop are marked `omp simd reduction` (the spec leaves the accumulation order
of reductions unspecified), so they vectorise (max and min with a flag that restores a NaN
the lanes' combination drops); a reduction down columns
keeps one accumulator per column of a block in a local array, its column loop `omp simd`.

A Gemm statement calls the runtime library's tiled matrix product (c_runtime.py), passing
its epilogue as a callback that runs on each finished block of the product.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...compiler import loopir as L
from ...compiler.loopir import INDEX
from ...ir.dtypes import DType
from . import c_convert, c_random
from .c_narrow import HEADER as NARROW_HEADER
from .c_bf16 import HEADER as BF16_HEADER
from .c_runtime import HEADER

PARALLEL_WORK = 1 << 15

CTYPE = {"bool": "uint8_t", "i8": "int8_t", "i16": "int16_t", "i32": "int32_t", "i64": "int64_t",
         "u8": "uint8_t", "u16": "uint16_t", "u32": "uint32_t", "u64": "uint64_t",
         "f32": "float", "f64": "double",
         # narrow floats as their bits, read and written only by casts (c_convert.py), and
         # quantized blocks as bytes (casts, and the runtime's products in c_narrow.py)
         "f16": "uint16_t", "bf16": "uint16_t", "f8e4m3": "uint8_t", "f8e5m2": "uint8_t",
         "q8_0": "uint8_t", "q4_0": "uint8_t"}
# the unsigned type integer arithmetic wraps in (at least as wide as int: no promotion surprises)
WRAP = {"i8": "uint32_t", "i16": "uint32_t", "i32": "uint32_t", "i64": "uint64_t",
        "u8": "uint32_t", "u16": "uint32_t", "u32": "uint32_t", "u64": "uint64_t"}
_UNARY_FN = {"exp": "exp", "exp2": "exp2", "log": "log", "log2": "log2", "sqrt": "sqrt", "sin": "sin",
             "cos": "cos", "tanh": "tanh", "floor": "floor", "ceil": "ceil", "round": "rint", "abs": "fabs"}


def ctype(dt) -> str:
    return "int64_t" if dt is INDEX else CTYPE[dt.name]


def _name(dt) -> str:
    return "i64" if dt is INDEX else dt.name


def _is_float(dt) -> bool:
    return dt is not INDEX and dt.is_float


def _is_signed(dt) -> bool:
    return dt is INDEX or dt.kind.value == "signed"


def literal(value, dt) -> str:
    """A C literal of dtype dt, exact (floats as hex)."""
    if dt is INDEX:
        v = int(value)
        return str(v) if abs(v) < 2**31 else f"INT64_C({v})"
    name = dt.name
    if name in ("f32", "f64"):
        x = float(np.float32(value)) if name == "f32" else float(value)
        suffix = "f" if name == "f32" else ""
        if math.isnan(x):
            return f"(({ctype(dt)})NAN)"
        if math.isinf(x):
            return f"(({ctype(dt)})INFINITY)" if x > 0 else f"(-({ctype(dt)})INFINITY)"
        return f"{x.hex()}{suffix}"
    if name == "bool":
        return "1" if value else "0"
    v = int(value)
    info = np.iinfo(np.dtype({"i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64, "u8": np.uint8,
                              "u16": np.uint16, "u32": np.uint32, "u64": np.uint64}[name]))
    if name == "i64" and v == info.min:
        return "INT64_MIN"
    if name == "i32" and v == info.min:
        return "INT32_MIN"
    if name == "u64":
        return f"UINT64_C({v})"
    if name == "i64":
        return f"INT64_C({v})"
    if name == "u32":
        return f"{v}u"
    return f"(({ctype(dt)}){v})"


class _Renderer:
    def __init__(self):
        self.helpers: dict[str, str] = {}

    # -- helpers emitted once per unit --
    def helper(self, name: str, code: str) -> str:
        self.helpers.setdefault(name, code)
        return name

    def f2i(self, dst: DType) -> str:
        t = CTYPE[dst.name]
        info = np.iinfo(np.dtype({"i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
                                  "u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "u64": np.uint64}[dst.name]))
        hi, lo = float(info.max), float(info.min)  # as the reference: t >= float(max) saturates
        return self.helper(f"dtm_f2i_{dst.name}", f"""static inline {t} dtm_f2i_{dst.name}(double x) {{
  double t = trunc(x);
  if (t != t) return 0;
  if (t >= {hi.hex()}) return ({t}){literal(int(info.max), dst)};
  if (t <= {lo.hex()}) return ({t}){literal(int(info.min), dst)};
  return ({t})t;
}}""")

    def intdiv(self, dt: DType, mod: bool) -> str:
        t, w = CTYPE[dt.name], WRAP[dt.name]
        fn = f"dtm_{'mod' if mod else 'div'}_{dt.name}"
        if dt.kind.value == "signed":
            minus_one = "0" if mod else f"({t})(({w})0 - ({w})x)"
            body = f"return y == 0 ? 0 : (y == -1 ? {minus_one} : ({t})(x {'%' if mod else '/'} y));"
        else:
            body = f"return y == 0 ? 0 : ({t})(x {'%' if mod else '/'} y);"
        return self.helper(fn, f"static inline {t} {fn}({t} x, {t} y) {{ {body} }}")

    def philox_uniform(self, dt: DType) -> str:
        """The helper giving a uniform draw in [0, 1) of dtype dt (f32 or f64) for element i
        under key (k0, k1): Philox4x32-10 of counter (i mod 2^32, i >> 32, 0, 0), its first
        words made into a float exactly as dtm.ref.philox does, so the bits are the reference's."""
        self.helper("dtm_philox", c_random.PHILOX)
        fn = f"dtm_uniform_{dt.name}"
        return self.helper(fn, c_random.uniform(fn, dt.name))

    def bitcast(self, src, dst: DType) -> str:
        s, t = ctype(src), CTYPE[dst.name]
        fn = f"dtm_bitcast_{_name(src)}_{dst.name}"
        if dst.name == "bool":
            code = f"static inline uint8_t {fn}({s} x) {{ uint8_t r; memcpy(&r, &x, 1); return r != 0; }}"
        else:
            code = f"static inline {t} {fn}({s} x) {{ {t} r; memcpy(&r, &x, sizeof r); return r; }}"
        return self.helper(fn, code)

    # -- expressions --
    def expr(self, e: L.Expr) -> str:
        if isinstance(e, L.Const):
            return literal(e.value, e.dtype)
        if isinstance(e, (L.Sym, L.Var)):
            return e.name
        if isinstance(e, L.Load):
            return f"{e.buf}[{self.expr(e.index)}]"
        assert isinstance(e, L.Op), e
        args = [self.expr(a) for a in e.args]
        if e.dtype is INDEX:
            return self.index_op(e.op, args)
        return self.value_op(e, args)

    def index_op(self, op: str, a: list) -> str:
        if op in ("+", "*", "/", "%", "<", "<=", ">=", "&&"):
            return f"({a[0]} {op} {a[1]})"
        if op == "min":
            return f"({a[0]} < {a[1]} ? {a[0]} : {a[1]})"
        if op == "max":
            return f"({a[0]} > {a[1]} ? {a[0]} : {a[1]})"
        if op == "select":
            return f"({a[0]} ? {a[1]} : {a[2]})"
        raise AssertionError(op)

    def value_op(self, e: L.Op, a: list) -> str:
        op, dt = e.op, e.dtype
        t = ctype(dt)
        src = e.args[0].dtype if e.args else dt
        fl = _is_float(src)
        sfx = "f" if src is not INDEX and src.name == "f32" else ""
        one = f"1.0{sfx}"
        if op == "cast":
            return self.cast(a[0], src, dt)
        if op == "bitcast":
            return f"{self.bitcast(src, dt)}({a[0]})"
        if op == "philox_uniform":
            return f"{self.philox_uniform(dt)}({a[0]}, {a[1]}, (uint64_t){a[2]})"
        if op == "where":
            return f"({a[0]} ? {a[1]} : {a[2]})"
        if op in ("eq", "ne", "lt", "le", "gt", "ge"):
            sym = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}[op]
            return f"(uint8_t)({a[0]} {sym} {a[1]})"
        if op == "logical_not":
            return f"(uint8_t)(!{a[0]})"
        if op in ("logical_and", "logical_or", "logical_xor"):
            sym = {"logical_and": "&&", "logical_or": "||", "logical_xor": "!="}[op]
            return f"(uint8_t)(({a[0]} != 0) {sym} ({a[1]} != 0))"
        if fl:
            if op in _UNARY_FN:
                return f"{_UNARY_FN[op]}{sfx}({a[0]})"
            if op == "neg":
                return f"(-{a[0]})"
            if op == "sign":
                return f"({a[0]} > 0 ? {one} : ({a[0]} < 0 ? -{one} : {a[0]}))"
            if op == "rsqrt":
                return f"({one} / sqrt{sfx}({a[0]}))"
            if op == "reciprocal":
                return f"({one} / {a[0]})"
            if op == "erf":
                return f"(float)erf((double){a[0]})" if sfx else f"erf({a[0]})"
            if op == "sigmoid":
                return f"({one} / ({one} + exp{sfx}(-{a[0]})))"
            if op in ("add", "sub", "mul", "div"):
                return f"({a[0]} {'+-*/'['add sub mul div'.split().index(op)]} {a[1]})"
            if op == "pow":
                return f"pow{sfx}({a[0]}, {a[1]})"
            if op == "mod":
                return f"fmod{sfx}({a[0]}, {a[1]})"
            if op == "max":
                return f"(({a[0]} > {a[1]} || {a[0]} != {a[0]}) ? {a[0]} : {a[1]})"
            if op == "min":
                return f"(({a[0]} < {a[1]} || {a[0]} != {a[0]}) ? {a[0]} : {a[1]})"
            raise NotImplementedError(f"C for {op} on {_name(src)}")
        # integers (bool only reaches the logical ops and comparisons above)
        w = WRAP.get(_name(src), "uint64_t")
        signed = _is_signed(src)
        if op == "neg":
            return f"({t})(({w})0 - ({w}){a[0]})"
        if op == "abs":
            return f"({a[0]} < 0 ? ({t})(({w})0 - ({w}){a[0]}) : {a[0]})" if signed else a[0]
        if op == "sign":
            return f"({t})(({a[0]} > 0) - ({a[0]} < 0))" if signed else f"({t})({a[0]} > 0)"
        if op in ("add", "sub", "mul"):
            sym = {"add": "+", "sub": "-", "mul": "*"}[op]
            return f"({t})(({w}){a[0]} {sym} ({w}){a[1]})"
        if op in ("div", "mod"):
            return f"{self.intdiv(src, op == 'mod')}({a[0]}, {a[1]})"
        if op == "max":
            return f"({a[0]} > {a[1]} ? {a[0]} : {a[1]})"
        if op == "min":
            return f"({a[0]} < {a[1]} ? {a[0]} : {a[1]})"
        raise NotImplementedError(f"C for {op} on {_name(src)}")

    def cast(self, x: str, src, dst) -> str:
        t = ctype(dst)
        if _name(src) in c_convert.NARROW_FLOATS or _name(dst) in c_convert.NARROW_FLOATS:
            self.helper("dtm_narrow_floats", c_convert.narrow_float_helpers())
            return c_convert.cast_expr(x, _name(src) if src is not INDEX else "index", _name(dst),
                                       lambda _: self.f2i(dst))
        if dst is not INDEX and dst.name == "bool":
            return f"(uint8_t)({x} != 0)"
        if _is_float(src) and not _is_float(dst):
            return f"{self.f2i(dst)}((double){x})"
        return f"(({t}){x})"

    # -- statements --
    def loop_pragmas(self, s: L.Loop) -> list[str]:
        """The pragmas before loop s: OpenMP's threads for a parallel loop with work enough,
        its vector lanes for a reduction or independent iterations."""
        if s.parallel is not None and not (isinstance(s.parallel, L.Const) and s.parallel.value < PARALLEL_WORK):
            return [f"#pragma omp parallel for{' simd' if s.simd else ''} schedule(static) "
                    f"if({self.expr(s.parallel)} >= {PARALLEL_WORK})"]
        if s.reduction is not None:
            return ["#pragma omp simd " + " ".join(f"reduction({op}:{var})" for op, var in s.reduction)]
        return ["#pragma omp simd"] if s.simd else []

    def body(self, stmts: list, depth: int, out: list) -> None:
        pad = "  " * depth
        for s in stmts:
            if isinstance(s, L.Loop):
                out += [pad + p for p in self.loop_pragmas(s)]
                out.append(f"{pad}for (int64_t {s.var} = {self.expr(s.start)}; {s.var} < {self.expr(s.stop)}; "
                           f"{s.var}++) {{")
                self.body(s.body, depth + 1, out)
                out.append(f"{pad}}}")
            elif isinstance(s, L.Let):
                out.append(f"{pad}{ctype(s.var.dtype)} {s.var.name} = {self.expr(s.value)};")
            elif isinstance(s, L.Assign):
                out.append(f"{pad}{s.var.name} = {self.expr(s.value)};")
            elif isinstance(s, L.Bind):
                out.append(f"{pad}const int64_t {s.name} = {self.expr(s.value)};")
            elif isinstance(s, L.Store):
                out.append(f"{pad}{s.buf}[{self.expr(s.index)}] = {self.expr(s.value)};")
            elif isinstance(s, L.If):
                out.append(f"{pad}if ({self.expr(s.cond)}) {{")
                self.body(s.body, depth + 1, out)
                out.append(f"{pad}}}")
            elif isinstance(s, L.Array):
                out.append(f"{pad}{ctype(s.dtype)} {s.name}[{s.size}];")
            elif isinstance(s, L.Gemm):
                self.gemm(s, depth, out)
            elif isinstance(s, L.Quant):
                self.helper("dtm_narrow_floats", c_convert.narrow_float_helpers())
                self.helper("dtm_quant_blocks", c_convert.QUANT_C)
                fn = f"dtm_{'quantize' if s.quantize else 'dequantize'}_{s.dtype.name}"
                out.append(f"{pad}{fn}({self.expr(s.blocks)}, {s.src}, {s.dst});")
            else:  # pragma: no cover
                raise AssertionError(s)

    def gemm(self, g: L.Gemm, depth: int, out: list) -> None:
        pad = "  " * depth
        nb = "1"
        for d in g.batch:
            nb = f"({nb} * {self.expr(d)})"
        out.append(f"{pad}{{")
        out.append(f"{pad}  const int64_t nbatch = {nb};")
        out.append(f"{pad}  int64_t offs_small[48];")
        out.append(f"{pad}  int64_t *offs = nbatch <= 16 ? offs_small : (int64_t *)malloc((size_t)(3 * nbatch) * "
                   "sizeof(int64_t));")
        out.append(f"{pad}  if (!offs) return;")
        out.append(f"{pad}  for (int64_t bt = 0; bt < nbatch; bt++) {{")
        stride = "1"
        binds = []
        for pos, (name, d) in enumerate(reversed(list(zip(g.batch_vars, g.batch)))):
            e = f"(bt / {stride})" if pos == len(g.batch_vars) - 1 else f"((bt / {stride}) % {self.expr(d)})"
            binds.append(f"{pad}    const int64_t {name} = {e};")
            stride = f"({stride} * {self.expr(d)})"
        out.extend(reversed(binds))
        for k, st in enumerate((g.a, g.b, g.c)):
            out.append(f"{pad}    offs[3 * bt + {k}] = {self.expr(st.offset)};")
        out.append(f"{pad}  }}")
        ctx = "NULL"
        epi = "NULL"
        if g.epilogue:
            ctx_t, epi_fn, fields = self.ctx
            out.append(f"{pad}  struct {ctx_t} ctx = {{{', '.join(fields)}}};")
            ctx, epi = "&ctx", epi_fn
        fn = (f"dtm_rt_gemm_{g.ab_dtype.name}" if g.ab_dtype is not None
              else f"dtm_rt_gemm_{g.dtype.name}" + (f"_{g.b_dtype.name}" if g.b_dtype is not None else ""))
        b = f"(const uint8_t *){g.b.buf}" if g.b_dtype is not None else g.b.buf
        out.append(f"{pad}  {fn}(nbatch, offs, {self.expr(g.m)}, {self.expr(g.n)}, {self.expr(g.k)}, "
                   f"{g.a.buf}, {self.expr(g.a.rows)}, {self.expr(g.a.cols)}, "
                   f"{b}, {self.expr(g.b.rows)}, {self.expr(g.b.cols)}, "
                   f"{g.c.buf}, {self.expr(g.c.rows)}, {epi}, {ctx});")
        out.append(f"{pad}  if (offs != offs_small) free(offs);")
        out.append(f"{pad}}}")


def _params(k: L.Kernel, indirect: bool) -> list[str]:
    """Declarations of the kernel's buffers and dims, from bufs/dims or from the ctx struct."""
    lines = []
    aliased = set(k.aliases) | set(k.aliases.values())
    for i, p in enumerate(k.params):
        t = CTYPE[p.dtype.name]
        const = "" if p.output else "const "
        restrict = "" if p.name in aliased else "restrict "
        src = f"ctx->{p.name}" if indirect else f"({const}{t} *)bufs[{i}]"
        lines.append(f"  {const}{t} *{restrict}{p.name} = {src};")
    for i, d in enumerate(k.dims):
        src = f"ctx->{d}" if indirect else f"dims[{i}]"
        lines.append(f"  const int64_t {d} = {src};")
    return lines


def _find_gemm(body: list) -> L.Gemm | None:
    for s in body:
        if isinstance(s, L.Gemm):
            return s
        if isinstance(s, L.Loop):
            g = _find_gemm(s.body)
            if g:
                return g
    return None


@dataclass
class CFunction:
    """One kernel as C: the function `symbol`, the declarations it needs before it, and the
    static helpers it calls (named by what they do, so units can share them)."""

    symbol: str
    helpers: dict
    decls: list
    code: str
    gemm_dtype: str | None  # the runtime library it calls, if any: f32, f64, narrow or bf16 (build.RUNTIME_SOURCES)


def render_kernel(k: L.Kernel, symbol: str = "dtm_kernel") -> CFunction:
    """The C function of one kernel (see the module docstring)."""
    r = _Renderer()
    gemm = _find_gemm(k.body)
    pre: list[str] = []
    if gemm is not None and gemm.epilogue:
        ctx_t, epi_fn = f"{symbol}_ctx", f"{symbol}_epilogue"
        fields = [f"  {'' if p.output else 'const '}{CTYPE[p.dtype.name]} *{p.name};" for p in k.params]
        fields += [f"  int64_t {d};" for d in k.dims]
        pre.append(f"struct {ctx_t} {{\n" + "\n".join(fields) + "\n};")
        r.ctx = (ctx_t, epi_fn, [p.name for p in k.params] + list(k.dims))
        epi: list[str] = []
        r.body(gemm.epilogue, 1, epi)
        pre.append(f"static void {epi_fn}(const void *ctx_, int64_t bt, int64_t i0_, int64_t i1_, "
                   f"int64_t j0_, int64_t j1_) {{\n  const struct {ctx_t} *ctx = (const struct {ctx_t} *)ctx_;\n"
                   + "\n".join(_params(k, True) + ["  (void)bt; (void)i0_; (void)i1_; (void)j0_; (void)j1_;"] + epi)
                   + "\n}")
    main: list[str] = [f"void {symbol}(void *const *bufs, const int64_t *dims) {{"]
    main += _params(k, False)
    main.append("  (void)bufs; (void)dims;")
    r.body(k.body, 1, main)
    main.append("}")
    return CFunction(symbol, r.helpers, pre, "\n".join(main), None if gemm is None else gemm_library(gemm))


def gemm_library(g: L.Gemm) -> str:
    """The runtime library whose product Gemm statement g calls (build.RUNTIME_SOURCES)."""
    return "narrow" if g.b_dtype is not None else g.ab_dtype.name if g.ab_dtype is not None else g.dtype.name


# The C library's math functions the kernels call that glibc's libmvec has vector versions of.
VECTOR_MATH = {"exp": 1, "exp2": 1, "log": 1, "log2": 1, "sin": 1, "cos": 1, "tanh": 1, "erf": 1, "pow": 2}


def vector_math_decls() -> list[str]:
    """Declarations that let the C compiler call the vector versions of VECTOR_MATH in
    vectorized loops (`omp declare simd`: the f32 and f64 versions of each), where
    `build.vector_math()` found them."""
    out = []
    for fn, arity in VECTOR_MATH.items():
        for ct, sfx in (("double", ""), ("float", "f")):
            out += ["#pragma omp declare simd notinbranch", f"{ct} {fn}{sfx}({', '.join([ct] * arity)});"]
    return out


def render_unit(funcs: list[CFunction], vector_math: bool = False) -> str:
    """One C translation unit holding `funcs` (helpers once each); with `vector_math`, the
    math functions may be called in their vector versions (glibc's libmvec)."""
    lines = ["/* DTM kernels */", "#include <stdint.h>", "#include <stdlib.h>", "#include <string.h>",
             "#include <math.h>", *(vector_math_decls() if vector_math else []), ""]
    if any(f.gemm_dtype in ("f32", "f64") for f in funcs):
        lines += [HEADER, ""]
    if any(f.gemm_dtype == "narrow" for f in funcs):
        lines += [NARROW_HEADER, ""]
    if any(f.gemm_dtype == "bf16" for f in funcs):
        lines += [BF16_HEADER, ""]
    helpers: dict = {}
    for f in funcs:
        helpers.update(f.helpers)
    lines += list(helpers.values())
    for f in funcs:
        lines += f.decls
        lines.append(f.code)
        lines.append("")
    return "\n".join(lines)
