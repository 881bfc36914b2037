"""Tensor ops a torch user reaches for beyond dtm/functional.py, each composed from the ops
there (so every backend, the compiler's fusion and autodiff handle them with no new rule),
except sorting and running sums, which need the IR's `argsort` and `cumsum`: neither has an
exact composition whose code stays small (a rank by pairwise comparison is n^2 for a
vocabulary of 50k; a scan of log2(n) shifted adds, inlined, grew its C with n).

    cumsum       the IR's cumsum (a loop along the dim), after torch's promotion of the dtype
    sort, topk   argsort, then gather the values
    einsum       the equation parsed into diagonals, sums, permutes, reshapes and matmuls
    multinomial  with replacement: inverse CDF; without: the exponential race (smallest E/p)

Importing this module attaches the Tensor methods it adds (`x.cumsum(0)`, `x.topk(3)`, ...).
"""

from __future__ import annotations

import builtins
import math
import string
from collections import namedtuple
from typing import Any, Sequence

import numpy as np

from .. import functional as F
from ..errors import ErrorCode, user_error as error
from ..ir.dtypes import numpy_dtype
from ..ir.types import TensorType
from .core import Tensor, apply, normalize_dim
from .creation import GENERATOR, Generator, full, zeros
from .dtypes import DEFAULT_FLOAT, as_dtype, bool_, float64, int64

SortResult = namedtuple("SortResult", ["values", "indices"])  # torch.return_types.sort / topk

# --- scans --------------------------------------------------------------------------------


def cumsum(x: Tensor, dim: int, dtype: Any = None) -> Tensor:
    """torch.cumsum. Integer and bool inputs sum in (and give) int64, as in torch. The IR's
    cumsum adds left to right, floats in f64 rounded once per element: torch's CPU kernel
    also accumulates f32 sequentially in double, so f32 results agree to the last bit."""
    d = normalize_dim(dim, x.ndim) if x.ndim else 0
    out_dtype = as_dtype(dtype) if dtype is not None else (x.dtype if x.dtype.is_float else int64)
    x = F.cast(x, out_dtype)
    return apply("cumsum", x, axis=d) if x.ndim else x


# --- sorting ------------------------------------------------------------------------------


def argsort(x: Tensor, dim: int = -1, descending: bool = False, stable: bool = False) -> Tensor:
    """torch.argsort. Always stable (equal values keep their order), which torch's
    stable=False allows; NaN sorts above every number, as in torch."""
    if x.ndim == 0:
        normalize_dim(dim, 0)
        return F.as_tensor(0, int64)
    src = F.cast(x, "u8") if x.dtype is bool_ else x
    return apply("argsort", src, axis=normalize_dim(dim, x.ndim), descending=bool(descending))


def sort(x: Tensor, dim: int = -1, descending: bool = False, stable: bool = False) -> SortResult:
    """torch.sort: (values, indices); differentiable in the values (through gather)."""
    idx = argsort(x, dim, descending, stable)
    return SortResult(F.gather(x, normalize_dim(dim, x.ndim) if x.ndim else 0, idx) if x.ndim else x, idx)


def topk(x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> SortResult:  # noqa: A002
    """torch.topk: the k largest (or smallest) along `dim`, in order (sorted=False may
    return any order in torch; this one is always sorted)."""
    d = normalize_dim(dim, x.ndim) if x.ndim else 0
    n = x.shape[d] if x.ndim else 1
    if not 0 <= k <= n:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"topk: k={k} is out of range for a dim of size {n} ({x._type})")
    idx = argsort(x, d, descending=largest)
    if x.ndim == 0:
        return SortResult(x, idx)
    idx = F.narrow(idx, d, 0, k)
    return SortResult(F.gather(x, d, idx), idx)


# --- linear algebra -----------------------------------------------------------------------


def bmm(a: Tensor, b: Tensor) -> Tensor:
    """torch.bmm: batched matmul of two rank-3 tensors with equal batch sizes (no broadcasting)."""
    if a.ndim != 3 or b.ndim != 3:
        raise error(ErrorCode.RANK_MISMATCH, f"bmm: both operands must have rank 3, got {a._type} and {b._type}")
    if a.shape[0] != b.shape[0]:
        raise error(ErrorCode.SHAPE_MISMATCH, f"bmm: batch sizes differ: {a._type} and {b._type}")
    return F.matmul(a, b)


def outer(a: Tensor, b: Tensor) -> Tensor:
    """torch.outer of two vectors: a broadcasting multiply, exact as torch's."""
    if a.ndim != 1 or b.ndim != 1:
        raise error(ErrorCode.RANK_MISMATCH, f"outer: both operands must be vectors, got {a._type} and {b._type}")
    return F.mul(F.unsqueeze(a, 1), F.unsqueeze(b, 0))


def _diagonal(x: Tensor, i: int, j: int) -> Tensor:
    """The diagonal over dims i < j (equal sizes), as the last dim: the two dims moved to
    the end and flattened, then every (n+1)-th element."""
    n = x.shape[i]
    rest = [a for a in range(x.ndim) if a not in (i, j)]
    flat = F.reshape(F.permute(x, rest + [i, j]), tuple(x.shape[a] for a in rest) + (n * n,))
    starts, stops, steps = [0] * flat.ndim, list(flat.shape), [1] * flat.ndim
    steps[-1] = n + 1
    return apply("slice", flat, start=tuple(starts), stop=tuple(stops), step=tuple(steps)) if n > 1 else flat


def _einsum_terms(equation: str, operands: Sequence[Tensor]) -> tuple[list[list[str]], list[str]]:
    """Each operand's subscripts and the output's, one letter per dim, `...` spelled out as
    letters no operand uses (right-aligned, so they broadcast as numpy does)."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        raise error(ErrorCode.OPERAND_COUNT, f"einsum: {equation!r} names {len(terms)} operands, "
                    f"{len(operands)} were given")
    spare = [c for c in string.ascii_letters if c not in eq]
    n_ell = builtins.max([x.ndim - len(t.replace("...", "")) for t, x in zip(terms, operands) if "..." in t],
                         default=0)
    ell = spare[:n_ell]
    out_terms = []
    for t, x in zip(terms, operands):
        if not builtins.all(c.isalpha() for c in t.replace("...", "")):
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"einsum: {equation!r}: subscripts must be letters")
        if "..." in t:
            k = x.ndim - len(t.replace("...", ""))
            t = t.replace("...", "".join(ell[n_ell - k:]) if k else "")
        if len(t) != x.ndim:
            raise error(ErrorCode.RANK_MISMATCH, f"einsum: {equation!r}: subscripts {t!r} for an operand {x._type}")
        out_terms.append(list(t))
    if arrow:
        out = list(rhs.replace("...", "".join(ell)))
        if not builtins.all(c.isalpha() for c in out) or len(set(out)) != len(out):
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"einsum: {equation!r}: bad output subscripts")
        unknown = set(out) - {c for t in out_terms for c in t}
        if unknown:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"einsum: {equation!r}: output subscripts {sorted(unknown)} "
                        "appear in no operand")
    else:  # implicit output: `...`, then the letters used once, in alphabetical order (torch's rule)
        counts: dict[str, int] = {}
        for t in out_terms:
            for c in t:
                counts[c] = counts.get(c, 0) + 1
        out = ell + sorted(c for c, k in counts.items() if k == 1 and c not in ell)
    return out_terms, out


def einsum(equation: str, *operands: Tensor) -> Tensor:
    """torch.einsum: repeated subscripts in one operand take its diagonal, subscripts no
    later term needs are summed out as early as possible, and each pair of operands is one
    batched matmul (batch: shared and kept; contracted: shared and summed)."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    terms, out = _einsum_terms(equation, operands)
    sizes: dict[str, int] = {}
    for t, x in zip(terms, operands):
        for c, s in zip(t, x.shape):
            if sizes.get(c, 1) != 1 and s != 1 and sizes[c] != s:
                raise error(ErrorCode.SHAPE_MISMATCH, f"einsum: {equation!r}: subscript {c!r} has sizes "
                            f"{sizes[c]} and {s}")
            sizes[c] = builtins.max(sizes.get(c, 1), s)
    xs = list(operands)
    for k in range(len(xs)):
        x, t = xs[k], terms[k]
        while len(set(t)) != len(t):  # a repeated subscript: its diagonal
            c = next(c for c in t if t.count(c) > 1)
            i = t.index(c)
            j = t.index(c, i + 1)
            x = _diagonal(x, i, j)
            t = [a for n, a in enumerate(t) if n not in (i, j)] + [c]
        xs[k], terms[k] = x, t
    for k in range(len(xs)):  # sum out what only this operand names
        later = set(out).union(*(terms[m] for m in range(len(xs)) if m != k))
        gone = [i for i, c in enumerate(terms[k]) if c not in later]
        if gone:
            xs[k] = F.sum(xs[k], gone)
            terms[k] = [c for i, c in enumerate(terms[k]) if i not in gone]
    x, t = xs[0], terms[0]
    for k in range(1, len(xs)):
        later = set(out).union(*terms[k + 1:])
        x, t = _contract(x, t, xs[k], terms[k], later, sizes)
    gone = [i for i, c in enumerate(t) if c not in out]
    if gone:
        x = F.sum(x, gone)
        t = [c for i, c in enumerate(t) if i not in gone]
    return F.permute(x, [t.index(c) for c in out]) if t != out else x


def _contract(a: Tensor, ta: list[str], b: Tensor, tb: list[str], keep: set[str],
              sizes: dict[str, int]) -> tuple[Tensor, list[str]]:
    """One pairwise step of einsum: a (subscripts ta) times b (tb), summing over the shared
    subscripts not in `keep`, as one matmul of shape [batch, a-only, shared] @ [batch, shared, b-only]."""
    batch = [c for c in ta if c in tb and c in keep]
    summed = [c for c in ta if c in tb and c not in keep]
    a_only = [c for c in ta if c not in tb]
    b_only = [c for c in tb if c not in ta]

    def arrange(x: Tensor, t: list[str], order: list[str], groups: list[list[str]]) -> Tensor:
        x = F.permute(x, [t.index(c) for c in order]) if order != t else x
        x = F.expand(x, [sizes[c] for c in order])  # size-1 dims broadcast against the other operand
        return F.reshape(x, [math.prod(sizes[c] for c in g) for g in groups])

    am = arrange(a, ta, batch + a_only + summed, [batch, a_only, summed])
    bm = arrange(b, tb, batch + summed + b_only, [batch, summed, b_only])
    prod = F.matmul(am, bm)
    return F.reshape(prod, [sizes[c] for c in batch + a_only + b_only]), batch + a_only + b_only


# --- reductions and comparisons -----------------------------------------------------------


def isnan(x: Tensor) -> Tensor:
    """torch.isnan: NaN is the one value unequal to itself; integers are never NaN."""
    return F.ne(x, x) if x.dtype.is_float else full(x.shape, False, bool_)


def isclose(a: Tensor, b: Any, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False) -> Tensor:
    """torch.isclose: |a - b| <= atol + rtol * |b|, equal infinities close, NaN close to NaN
    only with equal_nan."""
    b = F.as_tensor(b, a.dtype if not isinstance(b, Tensor) else None)
    d = F.result_type(a, b)
    a, b = F.cast(a, d), F.cast(b, d)
    close = F.eq(a, b)
    if d.is_float:
        diff = F.abs(F.sub(a, b))
        close = F.logical_or(close, F.le(diff, F.add(F.mul(F.abs(b), rtol), atol)))
        if equal_nan:
            close = F.logical_or(close, F.logical_and(isnan(a), isnan(b)))
    return close


def allclose(a: Tensor, b: Any, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False) -> bool:
    """torch.allclose: a Python bool (this reads the values, so it runs the pending graph)."""
    return builtins.bool(all(isclose(a, b, rtol, atol, equal_nan)).item())


def _truth(x: Tensor) -> Tensor:
    return x if x.dtype is bool_ else F.ne(x, F.as_tensor(0, x.dtype))


def any(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:  # noqa: A001 - torch's name
    """torch.any: is any element nonzero (uint8 input gives uint8, as in torch); False
    over no elements (the reduction's identity: amax, which raises there, is not used)."""
    r = F._extremum("reduce_max", _truth(x), F._axes(dim, x.ndim), keepdim)
    return F.cast(r, "u8") if x.dtype.name == "u8" else r


def all(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:  # noqa: A001 - torch's name
    """torch.all: is every element nonzero (uint8 input gives uint8, as in torch); True
    over no elements."""
    r = F._extremum("reduce_min", _truth(x), F._axes(dim, x.ndim), keepdim)
    return F.cast(r, "u8") if x.dtype.name == "u8" else r


def norm(x: Tensor, p: Any = "fro", dim=None, keepdim: bool = False, dtype: Any = None) -> Tensor:
    """torch.norm as a vector norm over `dim` (all dims by default): p = 'fro' or 2, 1,
    inf, -inf, 0 (the count of nonzeros) or any other number, sum(|x|^p)^(1/p)."""
    if dtype is not None:
        x = F.cast(x, dtype)
    if not x.dtype.is_float:
        raise error(ErrorCode.DTYPE_MISMATCH, f"norm: needs a float tensor, this one is {x._type}")
    if p == "fro":
        p = 2
    if isinstance(p, str):
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"norm: p={p!r} is not supported (a number, inf, or 'fro')")
    a = F.abs(x)
    if p == math.inf:
        return F.amax(a, dim, keepdim)
    if p == -math.inf:
        return F.amin(a, dim, keepdim)
    if p == 0:
        return F.sum(F.cast(F.ne(a, 0.0), x.dtype), dim, keepdim)
    if p == 1:
        return F.sum(a, dim, keepdim)
    if p == 2:
        return _root(F.sum(F.mul(x, x), dim, keepdim), 2)
    return _root(F.sum(F.pow(a, p), dim, keepdim), p)


def _root(s: Tensor, p: float) -> Tensor:
    """s^(1/p) of a sum s >= 0, with torch's gradient at s = 0: zero, where the root's own
    derivative is infinite and would make the gradient of a zero vector's norm NaN."""
    zero = F.eq(s, 0.0)  # (not s > 0: a NaN sum stays NaN)
    safe = F.where(zero, 1.0, s)
    return F.where(zero, 0.0, F.sqrt(safe) if p == 2 else F.pow(safe, 1.0 / p))


# --- movement -----------------------------------------------------------------------------


def repeat(x: Tensor, *sizes) -> Tensor:
    """Tensor.repeat: tile x `sizes` times along each dim (leading sizes add dims), as one
    broadcast: each dim d becomes a pair (repeats, d), broadcast, then merged."""
    reps = [int(s) for s in (sizes[0] if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) else sizes)]
    if len(reps) < x.ndim:
        raise error(ErrorCode.RANK_MISMATCH, f"repeat: {len(reps)} sizes for a tensor of rank {x.ndim}")
    shape = [1] * (len(reps) - x.ndim) + list(x.shape)
    paired = F.reshape(x, [v for d in shape for v in (1, d)])
    tiled = F.expand(paired, [v for r, d in zip(reps, shape) for v in (r, d)])
    return F.reshape(tiled, [r * d for r, d in zip(reps, shape)])


def unbind(x: Tensor, dim: int = 0) -> tuple[Tensor, ...]:
    """torch.unbind: the slices along `dim`, each without that dim."""
    d = normalize_dim(dim, x.ndim)
    return tuple(F.squeeze(F.narrow(x, d, i, 1), d) for i in range(x.shape[d]))


# --- creation -----------------------------------------------------------------------------


def linspace(start: float, end: float, steps: int, dtype: Any = None, requires_grad: bool = False) -> Tensor:
    """torch.linspace, by the formula of torch's CPU kernel: in the output dtype (double
    for integers), the first half counted up from start and the second half down from end,
    so both ends are exact. (torch's vectorised loop adds the step lane by lane, so its
    middle values may differ from these in the last bit.)"""
    d = as_dtype(dtype) if dtype is not None else DEFAULT_FLOAT
    if steps < 0:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"linspace: steps must be non-negative, got {steps}")
    npd = np.dtype(numpy_dtype(d)).type if d.is_float else np.float64
    i = np.arange(steps)
    if steps == 1:
        values = np.array([start], npd)
    else:
        step = (npd(end) - npd(start)) / npd(steps - 1)
        values = np.where(i < steps // 2, npd(start) + step * i.astype(npd),
                          npd(end) - step * (steps - i - 1).astype(npd))
    out = Tensor.from_numpy(np.asarray(values).astype(numpy_dtype(d)))
    return out.requires_grad_(True) if requires_grad else out


def empty(*size, dtype: Any = None, requires_grad: bool = False) -> Tensor:
    """torch.empty: uninitialised in torch; zeros here (reading it is as defined as can be)."""
    return zeros(*size, dtype=dtype, requires_grad=requires_grad)


# --- sampling -----------------------------------------------------------------------------


def _uniform(shape: tuple[int, ...], generator: Generator | None) -> Tensor:
    """Uniform f64 draws in [0, 1) from `generator` (the default one when None)."""
    gen = generator if generator is not None else GENERATOR
    return apply("random", gen.key(), type=TensorType(float64, shape), distribution="uniform")


def multinomial(input: Tensor, num_samples: int, replacement: bool = False,  # noqa: A002 - torch's name
                generator: Generator | None = None) -> Tensor:
    """torch.multinomial: `num_samples` category indices per row of non-negative weights
    (1-D or 2-D). With replacement: the first category whose cumulative weight exceeds
    u * total. Without: the exponential race, each category's E / w with E ~ Exp(1); the
    num_samples smallest win, which draws categories one at a time in proportion to the
    weights left, as torch does. Samples follow torch's distribution, not its numbers."""
    if input.ndim not in (1, 2):
        raise error(ErrorCode.RANK_MISMATCH, f"multinomial: weights must be 1-D or 2-D, got {input._type}")
    if not input.dtype.is_float:
        raise error(ErrorCode.DTYPE_MISMATCH, f"multinomial: weights must be float, got {input._type}")
    n = input.shape[-1]
    if num_samples <= 0 or (not replacement and num_samples > n):
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"multinomial: cannot draw {num_samples} samples from {n} categories"
                    + ("" if replacement else " without replacement"))
    w = F.cast(input.detach(), float64)
    lead = w.shape[:-1]
    if replacement:
        cdf = cumsum(w, -1)
        total = F.narrow(cdf, -1, n - 1, 1)
        u = F.mul(_uniform(lead + (num_samples,), generator), total)
        below = F.le(F.unsqueeze(cdf, -2), F.unsqueeze(u, -1))  # [..., samples, categories]
        idx = F.sum(F.cast(below, int64), -1)
        return F.minimum(idx, F.as_tensor(n - 1, int64))  # u * total rounding up to total
    e = F.neg(F.log(F.sub(1.0, _uniform(lead + (n,), generator))))  # Exp(1), finite: 1 - u > 0
    race = F.where(F.gt(w, 0.0), F.div(e, w), math.inf)
    return F.narrow(argsort(race, -1), -1, 0, num_samples)


def randperm(n: int, generator: Generator | None = None, dtype: Any = int64, requires_grad: bool = False) -> Tensor:
    """torch.randperm: a random permutation of 0..n-1, the order of n uniform draws (every
    permutation equally likely, ties having probability ~0); torch's distribution, not its numbers."""
    if n < 0:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"randperm: n must be non-negative, found {n}")
    out = F.cast(argsort(_uniform((n,), generator)), dtype)
    return out.requires_grad_(True) if requires_grad else out


def _type(x: Tensor, dtype: Any = None, non_blocking: bool = False) -> Any:
    """Tensor.type: with no dtype, the tensor type's name ('dtm.FloatTensor', torch's
    names under dtm); with one (a dtype, or such a name, torch's or dtm's), a cast."""
    if dtype is None:
        return f"dtm.{_TENSOR_TYPES[x.dtype.name]}"
    if isinstance(dtype, str) and dtype.rpartition(".")[2] in _DTYPE_OF_TYPE:
        dtype = _DTYPE_OF_TYPE[dtype.rpartition(".")[2]]
    return F.cast(x, dtype)


_TENSOR_TYPES = {"f32": "FloatTensor", "f64": "DoubleTensor", "f16": "HalfTensor", "bf16": "BFloat16Tensor",
                 "i64": "LongTensor", "i32": "IntTensor", "i16": "ShortTensor", "i8": "CharTensor",
                 "u8": "ByteTensor", "bool": "BoolTensor"}
_DTYPE_OF_TYPE = {v: k for k, v in _TENSOR_TYPES.items()}

_METHODS = {
    "cumsum": cumsum, "argsort": argsort, "sort": sort, "topk": topk, "repeat": repeat, "unbind": unbind,
    "norm": norm, "any": any, "all": all, "isnan": isnan, "isclose": isclose, "allclose": allclose,
    "outer": outer, "bmm": bmm, "multinomial": multinomial, "type": _type,
}
for _name, _fn in _METHODS.items():
    setattr(Tensor, _name, _fn)

__all__ = ["cumsum", "argsort", "sort", "topk", "bmm", "outer", "einsum", "isnan", "isclose", "allclose", "any",
           "all", "norm", "repeat", "unbind", "linspace", "empty", "multinomial", "randperm", "SortResult"]
