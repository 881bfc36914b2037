"""The loop IR: what one compiled kernel does, as loops over index variables, scalar
temporaries, loads and stores on flat buffers, and accumulators. `lower.py` builds it from
the fused groups; a backend renders it (dtm/backends/cpu/render_c.py: C); `str(kernel)` prints it.

Expressions are immutable and compare structurally, so the lowering can memoise on them:

    Const(1.5, f32)                  a literal of a dtype (INDEX for index arithmetic)
    Sym("i0")                        an index variable (loop variable or a symbolic dim)
    Var("t3", f32)                   a scalar temporary or accumulator
    Load("b0", index)                element `index` of flat buffer b0
    Op("exp", (x,), f32)             a DTM op on scalars; index arithmetic uses the INDEX
                                     ops "+", "*", "/", "%", "min", "max", "<", ">=", "select"

Statements:

    Loop(var, start, stop, body, parallel=work)   for var in [start, stop)
    Let(var, expr)          declare a temporary       Assign(var, expr)   update it
    Bind(name, expr)        declare an index variable (int64)
    Store(buf, index, expr) If(cond, body)
    Array(name, dtype, size)  declare a small local buffer (accumulators for a block of columns)
    Gemm(...)               a call of the runtime's matrix product, with an epilogue body
    Quant(...)              quantize or dequantize whole blocks (q8_0, q4_0) of one buffer

Buffers are flat and contiguous (row-major); index expressions compute the flat offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from ..ir.dtypes import DType
from ..ir.symbolic import Dim, SymDim, format_dim


class _Index:
    """The pseudo dtype of index arithmetic: int64 in C."""

    name = "index"

    def __repr__(self) -> str:
        return "index"


INDEX: Any = _Index()


# --- expressions -------------------------------------------------------------------------

@dataclass(frozen=True)
class Const:
    value: Any
    dtype: Any

    def __str__(self) -> str:
        if self.dtype is INDEX:
            return str(self.value)
        return f"{self.value!r}:{self.dtype}"


@dataclass(frozen=True)
class Sym:
    name: str
    dtype: Any = INDEX

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Var:
    name: str
    dtype: Any

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Load:
    buf: str
    index: "Expr"
    dtype: Any

    def __str__(self) -> str:
        return f"{self.buf}[{self.index}]"


@dataclass(frozen=True)
class Op:
    op: str
    args: tuple
    dtype: Any
    attrs: tuple = ()  # extra static arguments, e.g. (("to", f32),) for cast

    def __str__(self) -> str:
        if self.dtype is INDEX and self.op in ("+", "*", "/", "%", "<", ">=", "<=", "&&"):
            return f"({self.args[0]} {self.op} {self.args[1]})"
        extra = "".join(f", {k}={v}" for k, v in self.attrs)
        return f"{self.op}({', '.join(map(str, self.args))}{extra})"


Expr = Union[Const, Sym, Var, Load, Op]


def free_syms(e: Expr, out: set | None = None) -> set:
    """The names of the index variables and temporaries an expression reads."""
    out = set() if out is None else out
    stack = [e]
    while stack:
        x = stack.pop()
        if isinstance(x, (Sym, Var)):
            out.add(x.name)
        elif isinstance(x, Load):
            stack.append(x.index)
        elif isinstance(x, Op):
            stack.extend(x.args)
    return out


def loads_of(e: Expr, out: list | None = None) -> list:
    """Every Load inside an expression."""
    out = [] if out is None else out
    stack = [e]
    while stack:
        x = stack.pop()
        if isinstance(x, Load):
            out.append(x)
            stack.append(x.index)
        elif isinstance(x, Op):
            stack.extend(x.args)
    return out


# --- index arithmetic, folded as it is built ----------------------------------------------

def idx(v: int | Expr) -> Expr:
    return Const(int(v), INDEX) if isinstance(v, int) else v


def _is(e: Expr, value: int) -> bool:
    return isinstance(e, Const) and e.value == value


def iadd(a, b) -> Expr:
    a, b = idx(a), idx(b)
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(a.value + b.value, INDEX)
    if _is(a, 0):
        return b
    if _is(b, 0):
        return a
    if _splits(a) and _splits(b):
        return _recombined(a, b)
    return Op("+", (a, b), INDEX)


def _splits(e: Expr) -> bool:
    """Whether e may hold a piece of a split index (a / or % of a constant) at the top of
    one of its terms."""
    while isinstance(e, Op) and e.op in ("+", "*"):
        if e.op == "*" and not isinstance(e.args[1], Const):
            return False
        if e.op == "+" and _splits(e.args[1]):
            return True
        e = e.args[0]
    return isinstance(e, Op) and e.op in ("/", "%") and isinstance(e.args[1], Const)


def _terms(e: Expr, scale: int, out: list) -> None:
    """e * scale as (coefficient, term) pairs of a sum."""
    if isinstance(e, Op) and e.op == "+":
        _terms(e.args[0], scale, out)
        _terms(e.args[1], scale, out)
    elif isinstance(e, Op) and e.op == "*" and isinstance(e.args[1], Const):
        _terms(e.args[0], scale * e.args[1].value, out)
    else:
        out.append((scale, e))


def _recombined(a: Expr, b: Expr) -> Expr:
    """a + b with the pieces of a split index joined again: c*(z % m) + c*m*(z / m) is c*z
    for every non-negative z (a reshape's split dims read back through contiguous strides:
    (i % 32) + ((i / 32) % 3) * 32 + (i / 96) * 96 is i), so a kernel indexes by i, not by
    divisions in its innermost loop, which would keep it from vectorising."""
    terms: list = []
    _terms(a, 1, terms)
    _terms(b, 1, terms)
    joined = True
    while joined:
        joined = False
        for i, (c, t) in enumerate(terms):
            if not (isinstance(t, Op) and t.op == "%" and isinstance(t.args[1], Const)):
                continue
            z, m = t.args[0], t.args[1]
            quotient = idiv(z, m)
            j = next((j for j, (cj, tj) in enumerate(terms) if cj == c * m.value and tj == quotient), None)
            if j is not None:
                terms[i] = (c, z)
                del terms[j]
                joined = True
                break
    out: Expr = Const(0, INDEX)
    for c, t in terms:
        term = imul(t, c)
        out = term if _is(out, 0) else Op("+", (out, term), INDEX)
    return out


def imul(a, b) -> Expr:
    a, b = idx(a), idx(b)
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(a.value * b.value, INDEX)
    if _is(a, 0) or _is(b, 0):
        return Const(0, INDEX)
    if _is(a, 1):
        return b
    if _is(b, 1):
        return a
    return Op("*", (a, b), INDEX)


def isub(a, b) -> Expr:
    b = idx(b)
    if isinstance(b, Const):
        return iadd(a, -b.value)
    return iadd(a, imul(b, -1))


def idiv(a, b) -> Expr:
    """Floor division of non-negative indices."""
    a, b = idx(a), idx(b)
    if isinstance(a, Const) and isinstance(b, Const) and b.value:
        return Const(a.value // b.value, INDEX)
    if _is(b, 1) or _is(a, 0):
        return a
    if isinstance(b, Const) and isinstance(a, Op) and a.op == "/" and isinstance(a.args[1], Const):
        return Op("/", (a.args[0], Const(a.args[1].value * b.value, INDEX)), INDEX)  # (z / p) / q = z / (p q)
    return Op("/", (a, b), INDEX)


def imod(a, b) -> Expr:
    a, b = idx(a), idx(b)
    if isinstance(a, Const) and isinstance(b, Const) and b.value:
        return Const(a.value % b.value, INDEX)
    if _is(b, 1) or _is(a, 0):
        return Const(0, INDEX)
    return Op("%", (a, b), INDEX)


def imin(a, b) -> Expr:
    a, b = idx(a), idx(b)
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(min(a.value, b.value), INDEX)
    return Op("min", (a, b), INDEX)


def imax(a, b) -> Expr:
    a, b = idx(a), idx(b)
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(max(a.value, b.value), INDEX)
    return Op("max", (a, b), INDEX)


def icmp(op: str, a, b) -> Expr:
    """An index comparison ("<", "<=", ">="), a C int (0 or 1)."""
    a, b = idx(a), idx(b)
    if isinstance(a, Const) and isinstance(b, Const):
        return Const(int({"<": a.value < b.value, "<=": a.value <= b.value, ">=": a.value >= b.value}[op]), INDEX)
    return Op(op, (a, b), INDEX)


def iand(a, b) -> Expr:
    a, b = idx(a), idx(b)
    if _is(a, 1):
        return b
    if _is(b, 1):
        return a
    if _is(a, 0) or _is(b, 0):
        return Const(0, INDEX)
    return Op("&&", (a, b), INDEX)


def dim_expr(d: Dim) -> Expr:
    """A dim (an int or a polynomial over symbols) as an index expression over the
    kernel's dim arguments, which are named after the symbols."""
    if isinstance(d, int):
        return Const(d, INDEX)
    assert isinstance(d, SymDim)
    total: Expr = Const(0, INDEX)
    for mono, coeff in d.terms:
        term: Expr = Const(coeff, INDEX)
        for s in mono:
            term = imul(term, Sym(s))
        total = iadd(total, term)
    return total


def flat_index(index: tuple, shape: tuple) -> Expr:
    """The row-major flat offset of `index` in a buffer of `shape`."""
    out: Expr = Const(0, INDEX)
    stride: Expr = Const(1, INDEX)
    for i, d in reversed(list(zip(index, shape))):
        out = iadd(out, imul(i, stride))
        stride = imul(stride, dim_expr(d))
    return out


# --- statements --------------------------------------------------------------------------

@dataclass
class Loop:
    var: str
    start: Expr
    stop: Expr
    body: list
    parallel: Expr | None = None      # run the iterations on threads when this work estimate is large
    reduction: tuple | None = None    # (("+", var), ...): the body only accumulates into these (vectorisable)
    simd: bool = False                # iterations independent (each writes its own elements): vectorise


@dataclass
class Let:
    var: Var
    value: Expr


@dataclass
class Assign:
    var: Var
    value: Expr


@dataclass
class Bind:
    name: str
    value: Expr


@dataclass
class Store:
    buf: str
    index: Expr
    value: Expr


@dataclass
class If:
    cond: Expr
    body: list


@dataclass
class Array:
    name: str
    dtype: Any
    size: int


@dataclass
class Strided:
    """A matrix operand of Gemm: element (i, k) of batch entry `bt` is at
    buf[offset + i * rows + k * cols], offset an expression over the batch variables."""

    buf: str
    offset: Expr
    rows: Expr
    cols: Expr


@dataclass
class Gemm:
    """C[b] = A[b] @ B[b] for every batch entry b, then `epilogue` (a body over the index
    variables batch_vars + (i, j), run once per element after its sum is complete) reads
    the product with Load(c.buf, ...) and stores the final value in place."""

    dtype: DType
    batch: tuple                     # batch dims (index expressions)
    batch_vars: tuple                # names of the batch index variables
    m: Expr
    n: Expr
    k: Expr
    a: Strided
    b: Strided
    c: Strided
    epilogue: list | None = None
    ivar: str = "i"
    jvar: str = "j"
    b_dtype: DType | None = None     # B's buffer holds this narrow dtype (c_narrow.py), else dtype
    ab_dtype: DType | None = None    # both A's and B's buffers hold this dtype (bf16: c_bf16.py), else dtype


@dataclass
class Quant:
    """Quantize (f32 -> `dtype`, a block type) or dequantize (`dtype` -> f32) `blocks` blocks
    of 32 elements, buffer `src` into buffer `dst`, both contiguous (dtm.ref.quant's rules,
    bit for bit: the runtime's C in render_c.QUANT_C)."""

    quantize: bool
    dtype: DType
    blocks: Expr
    src: str
    dst: str


Stmt = Union[Loop, Let, Assign, Bind, Store, If, Array, Gemm, Quant]


@dataclass
class Param:
    name: str
    dtype: DType
    output: bool
    shape: tuple = ()


@dataclass
class Kernel:
    """One compiled function: buffer parameters, then one int64 per symbol in `dims`."""

    name: str
    params: list
    dims: list
    body: list
    aliases: dict = field(default_factory=dict)  # output param -> input param it may share memory with
    consts: dict = field(default_factory=dict)   # dim -> its value in this kernel: a literal that
                                                 # kernels sharing this body differ in (share.py)

    def __str__(self) -> str:
        return format_kernel(self)


# --- printing -----------------------------------------------------------------------------

def _fmt_type(p: Param) -> str:
    return f"{p.dtype}[{', '.join(format_dim(d) for d in p.shape)}]"


def format_kernel(k: Kernel) -> str:
    params = ", ".join(f"{'out' if p.output else 'in'} {p.name}: {_fmt_type(p)}" for p in k.params)
    dims = f"; dims {', '.join(f'{d}={k.consts[d]}' if d in k.consts else d for d in k.dims)}" if k.dims else ""
    lines = [f"kernel {k.name}({params}{dims})"]
    for out, inp in k.aliases.items():
        lines.append(f"  # {out} may share memory with {inp} (in place)")
    _fmt_body(k.body, 1, lines)
    return "\n".join(lines)


def _fmt_body(body: list, depth: int, lines: list) -> None:
    pad = "  " * depth
    for s in body:
        if isinstance(s, Loop):
            par = f"  (parallel when {s.parallel} is large)" if s.parallel is not None else ""
            red = "".join(f"  (reduction {op} into {var})" for op, var in s.reduction or ())
            red += "  (vectorised)" if s.simd else ""
            lines.append(f"{pad}for {s.var} in {s.start}..{s.stop}:{par}{red}")
            _fmt_body(s.body, depth + 1, lines)
        elif isinstance(s, Let):
            lines.append(f"{pad}{s.var.name}: {s.var.dtype} = {s.value}")
        elif isinstance(s, Assign):
            lines.append(f"{pad}{s.var.name} = {s.value}")
        elif isinstance(s, Bind):
            lines.append(f"{pad}{s.name} = {s.value}")
        elif isinstance(s, Store):
            lines.append(f"{pad}{s.buf}[{s.index}] = {s.value}")
        elif isinstance(s, If):
            lines.append(f"{pad}if {s.cond}:")
            _fmt_body(s.body, depth + 1, lines)
        elif isinstance(s, Array):
            lines.append(f"{pad}{s.name}: {s.dtype}[{s.size}]")
        elif isinstance(s, Gemm):
            batch = f" for ({', '.join(s.batch_vars)}) in [{', '.join(map(str, s.batch))}]" if s.batch else ""
            lines.append(f"{pad}gemm {s.dtype}{batch}: {s.c.buf}[{s.m} x {s.n}] = "
                         f"{s.a.buf}[{s.m} x {s.k}] @ {s.b.buf}[{s.k} x {s.n}]")
            for name, st in (("a", s.a), ("b", s.b), ("c", s.c)):
                lines.append(f"{pad}  {name}: {st.buf} + {st.offset}, strides ({st.rows}, {st.cols})")
            if s.epilogue:
                lines.append(f"{pad}  epilogue over ({s.ivar}, {s.jvar}):")
                _fmt_body(s.epilogue, depth + 2, lines)
        elif isinstance(s, Quant):
            what = f"quantize f32 -> {s.dtype}" if s.quantize else f"dequantize {s.dtype} -> f32"
            lines.append(f"{pad}{s.dst} = {what} {s.src} ({s.blocks} blocks of 32)")
        else:  # pragma: no cover
            lines.append(f"{pad}{s!r}")
