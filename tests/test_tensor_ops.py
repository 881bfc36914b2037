"""Every Tensor op, forward and backward, against PyTorch on random inputs.

The suite is a table: each `Case` is one call written once for both libraries (`fn(M, *xs)`
where `M` is `dtm` or `torch`, so `M.cat`, `M.nn.functional.pad`, `x.sum(-1)` read the same),
plus the specs of its inputs. For every float dtype the case allows, the inputs are drawn
from numpy with a seed fixed by the case id, handed to both libraries (non-contiguous
numpy views go to dtm as they are), and the outputs compared in value, shape and dtype.
Differentiable cases then compare the gradients of sum(out * cotangent), with a random
cotangent, against torch.autograd. Integer and bool cases compare exactly.

Every test runs once per backend (`ref`, and `cpu` when the compiler registers it), chosen
through DTM_BACKEND as a user would.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable

import ml_dtypes
import numpy as np
import pytest
import torch

import dtm
import dtm.runtime.backend

BACKENDS = ["ref"] + (["cpu"] if "cpu" in dtm.runtime.backend.BACKENDS else [])


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("DTM_BACKEND", request.param)
    return request.param


# --- dtypes and tolerances ----------------------------------------------------------------

NP = {"f16": np.float16, "bf16": ml_dtypes.bfloat16, "f32": np.float32, "f64": np.float64, "i8": np.int8,
      "u8": np.uint8, "i16": np.int16, "i32": np.int32, "i64": np.int64, "bool": np.bool_}
TORCH = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32, "f64": torch.float64,
         "i8": torch.int8, "u8": torch.uint8, "i16": torch.int16, "i32": torch.int32, "i64": torch.int64,
         "bool": torch.bool}
NAME_OF_TORCH = {v: k for k, v in TORCH.items()}

STD = ("f32", "f64")
ALL = ("f32", "f64", "f16", "bf16")  # elementwise, reductions, matmul
# Narrow floats: torch and the reference both compute in f32 and round once per op, but
# their f32 algorithms differ (libm vs Sleef, summation order), so a result may land one
# rounding step apart; the tolerances are a few ulps of the dtype.
TOL = {"f64": dict(rtol=1e-9, atol=1e-10), "f32": dict(rtol=2e-5, atol=2e-6),
       "f16": dict(rtol=4e-3, atol=4e-3), "bf16": dict(rtol=3e-2, atol=3e-2)}


# --- input specs --------------------------------------------------------------------------

@dataclass(frozen=True)
class A:
    """One input.

    kind: the test's float dtype as "f" (uniform in [lo, hi)), "pos" (positive), "nz" (away
    from zero), "distinct" (distinct values, exact in bf16: no ties for max-like ops),
    "halves" (k + 0.5: rounding ties), "zeros" (a few values, zero among them), "special"
    (NaN, infinities, signed zeros; forward only); the test's integer dtype as "int" or
    "intnz" (no zeros); "idx" (int64 indices in [lo, hi) for a dim of size hi); "mask"
    (bool); or a fixed dtype name ("i32", "f16", "bool", ...) drawn from [lo, hi).
    layout: "c" contiguous, "T" the transpose of an array (all axes reversed), "s" every
    other element of the last axis, "r" the last axis reversed (negative stride)."""

    shape: tuple
    kind: str = "f"
    layout: str = "c"
    lo: float = -2.0
    hi: float = 2.0
    grad: bool = True


def P(*shape, layout="c"):  # noqa: N802 - short spec constructors keep the table readable
    return A(shape, "pos", layout, 0.5, 2.0)


def NZ(*shape, layout="c"):  # noqa: N802
    return A(shape, "nz", layout, 0.5, 2.0)


def D(*shape, layout="c"):  # noqa: N802
    return A(shape, "distinct", layout)


def I(*shape, lo=-9, hi=10, layout="c"):  # noqa: N802, E743
    return A(shape, "int", layout, lo, hi, grad=False)


def INZ(*shape, lo=-9, hi=10, layout="c"):  # noqa: N802
    return A(shape, "intnz", layout, lo, hi, grad=False)


def IDX(shape, n, negative=True):  # noqa: N802
    return A(tuple(shape), "idx", lo=-n if negative else 0, hi=n, grad=False)


def MASK(*shape):  # noqa: N802
    return A(shape, "mask", grad=False)


def _draw(rng: np.random.Generator, spec: A, fdtype: str) -> np.ndarray:
    """The array for `spec`, laid out as the spec says (the values do not depend on it)."""
    shape = spec.shape
    base_shape = tuple(reversed(shape)) if spec.layout == "T" else shape
    if spec.layout == "s":
        base_shape = shape[:-1] + (2 * shape[-1],)
    n = int(np.prod(base_shape))
    if spec.kind in ("f", "pos", "nz", "distinct", "halves", "zeros", "special", "f16", "bf16", "f32", "f64"):
        if spec.kind == "distinct":
            assert n <= 400, "distinct values must stay exact in bf16"
            a = (rng.permutation(n) - n // 2).astype(np.float64) * 0.125
        elif spec.kind == "halves":
            a = rng.integers(-4, 4, n) + 0.5
        elif spec.kind == "zeros":
            a = rng.choice([0.0, 0.5, -1.5, 2.0], n)
        elif spec.kind == "special":
            a = rng.choice([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.5, 3.0], n)
        else:
            a = rng.uniform(spec.lo, spec.hi, n)
            if spec.kind == "nz":
                a *= rng.choice([-1.0, 1.0], n)
        a = a.astype(NP[spec.kind if spec.kind in NP else fdtype])
    elif spec.kind in ("int", "intnz"):
        a = rng.integers(int(spec.lo), int(spec.hi), n)
        if spec.kind == "intnz":
            a[a == 0] = 1
        a = a.astype(NP[fdtype])
    elif spec.kind == "idx":
        a = rng.integers(int(spec.lo), int(spec.hi), n).astype(np.int64) if spec.hi else np.zeros(n, np.int64)
    elif spec.kind == "mask":
        a = rng.random(n) < 0.5
    elif spec.kind == "bool":
        a = rng.random(n) < 0.5
    else:
        a = rng.integers(int(spec.lo), int(spec.hi), n).astype(NP[spec.kind])
    a = a.reshape(base_shape)
    if spec.layout == "T":
        a = a.T
    elif spec.layout == "s":
        a = a[..., ::2]
    elif spec.layout == "r":
        a = a[..., ::-1]
    assert a.shape == shape
    return a


def _is_float_spec(spec: A) -> bool:
    return spec.kind in ("f", "pos", "nz", "distinct", "halves", "zeros")


def _to_torch(a: np.ndarray, requires_grad: bool) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        t = torch.tensor(a.astype(np.float32)).to(torch.bfloat16)
    else:
        t = torch.tensor(a.copy())  # torch takes no negative strides
    return t.requires_grad_(requires_grad)


def _to_dtm(a: np.ndarray, requires_grad: bool, layout: str) -> dtm.Tensor:
    # Non-contiguous arrays reach dtm both ways: dtm.tensor (copy) and dtm.from_numpy.
    if layout == "s":
        t = dtm.from_numpy(a)
        return t.requires_grad_(True) if requires_grad else t
    return dtm.tensor(a, requires_grad=requires_grad)


def _as_np(t) -> np.ndarray:
    """An output as numpy, narrow floats widened to f32 (numpy's own dtype otherwise)."""
    if isinstance(t, torch.Tensor):
        t = t.detach()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    a = t.numpy()
    return a.astype(np.float32) if a.dtype == ml_dtypes.bfloat16 else a


def _outputs(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


# --- the table ----------------------------------------------------------------------------

@dataclass
class Case:
    id: str
    fn: Callable
    inputs: tuple
    dtypes: tuple = STD
    grad: bool = True
    tol: dict = field(default_factory=dict)  # per dtype, replacing TOL's entry
    torch_fn: Callable | None = None         # when the torch spelling differs


CASES: list[Case] = []


def case(id, fn, *inputs, **kw):
    CASES.append(Case(id, fn, inputs, **kw))


def _sel(x: torch.Tensor, dim: int, s: slice) -> torch.Tensor:
    """x[..., s] on dim `dim` for any step: torch's own slicing takes no negative step."""
    return x.index_select(dim, torch.arange(x.shape[dim])[list(range(x.shape[dim]))[s]])


def _setitem(x, index, v):
    """x with x[index] = v, on a copy so both libraries can differentiate through it."""
    y = x * 1
    y[index] = v
    return y


# elementwise binary ops, over broadcasting, size-0/size-1, rank-0 and non-contiguous shapes
_BCAST = [
    ("same", (3, 4), (3, 4)),
    ("row_col", (3, 1), (1, 4)),
    ("trailing", (2, 3, 4), (4,)),
    ("leading", (4,), (2, 3, 4)),
    ("rank0", (3, 4), ()),
    ("rank0_left", (), (2, 3)),
    ("size0", (0, 4), (1, 4)),
    ("size1", (1, 1), (1,)),
    ("size0_mid", (2, 0, 3), (2, 1, 3)),
]
_BINARY = [
    ("add", lambda M, x, y: x + y, A, A),
    ("sub", lambda M, x, y: x - y, A, A),
    ("mul", lambda M, x, y: x * y, A, A),
    ("div", lambda M, x, y: x / y, A, NZ),
    ("pow", lambda M, x, y: x ** y, P, A),
    ("maximum", lambda M, x, y: M.maximum(x, y), A, A),
    ("minimum", lambda M, x, y: M.minimum(x, y), A, A),
]


def _spec(kind, shape, layout="c"):
    return kind(shape, layout=layout) if kind is A else kind(*shape, layout=layout)


for _name, _fn, _ka, _kb in _BINARY:
    for _sid, _sa, _sb in _BCAST:
        case(f"{_name}-{_sid}", _fn, _spec(_ka, _sa), _spec(_kb, _sb), dtypes=ALL)
    case(f"{_name}-noncontig", _fn, _spec(_ka, (3, 4), "T"), _spec(_kb, (3, 4), "s"), dtypes=ALL)
    case(f"{_name}-negstride", _fn, _spec(_ka, (2, 5), "r"), _spec(_kb, (5,), "r"), dtypes=ALL)

# Python scalars on either side (the tensor keeps its dtype, f16 and bf16 included)
case("add-scalar", lambda M, x: x + 2.5, A((3, 4)), dtypes=ALL)
case("radd-int-scalar", lambda M, x: 3 + x, A((3, 4)), dtypes=ALL)
case("rsub-scalar", lambda M, x: 1.5 - x, A((3, 4)), dtypes=ALL)
case("mul-scalar", lambda M, x: x * -3, A((3, 4)), dtypes=ALL)
case("div-scalar", lambda M, x: x / 4.0, A((3, 4)), dtypes=ALL)
case("rdiv-scalar", lambda M, x: 2.0 / x, NZ(3, 4), dtypes=ALL)
case("pow-2", lambda M, x: x ** 2, A((3, 4)), dtypes=ALL)
case("pow-3", lambda M, x: x ** 3, A((3, 4)), dtypes=ALL)
case("pow-half", lambda M, x: x ** 0.5, P(3, 4), dtypes=ALL)
case("pow-neg", lambda M, x: x ** -1.5, P(3, 4), dtypes=ALL)
case("rpow", lambda M, x: 2 ** x, A((3, 4)), dtypes=ALL)
case("mul-scalar-inexact", lambda M, x: x * 0.1 - 0.3, A((3, 4)), dtypes=ALL)
case("mul-scalar-overflow", lambda M, x: x * 1e6, A((3, 4)), dtypes=ALL, tol={"f32": dict(rtol=2e-5, atol=1)})
case("eq-scalar-rounded", lambda M, x: (x * 0 + 0.1) == 0.1, A((3,)), dtypes=ALL, grad=False)
case("add-alpha", lambda M, x, y: M.add(x, y, alpha=2), A((3, 4)), A((4,)))
case("sub-alpha", lambda M, x, y: M.sub(x, y, alpha=0.5), A((3, 4)), A((4,)))
case("floordiv-float", lambda M, x, y: x // y, A((3, 4), lo=-6, hi=6), NZ(4), grad=False)
case("remainder-float", lambda M, x, y: x % y, A((3, 4), lo=-6, hi=6), NZ(4), grad=False)
case("fmod-float", lambda M, x, y: M.fmod(x, y), A((3, 4), lo=-6, hi=6), NZ(4), grad=False)
case("div-trunc", lambda M, x, y: M.div(x, y, rounding_mode="trunc"), A((3, 4), lo=-6, hi=6), NZ(4), grad=False)
case("div-floor", lambda M, x, y: M.div(x, y, rounding_mode="floor"), A((3, 4), lo=-6, hi=6), NZ(4), grad=False)
case("mixed-f32-f64", lambda M, x, y: x * y.double(), A((3, 4)), A((4,)))
case("mixed-f16-f32", lambda M, x, y: x.half() + y, A((3, 4)), A((4,)))

# elementwise unary ops
_UNARY = [
    ("neg", lambda M, x: -x, A),
    ("abs", lambda M, x: abs(x), NZ),
    ("exp", lambda M, x: M.exp(x), A),
    ("exp2", lambda M, x: M.exp2(x), A),
    ("log", lambda M, x: M.log(x), P),
    ("log2", lambda M, x: M.log2(x), P),
    ("sqrt", lambda M, x: x.sqrt(), P),
    ("rsqrt", lambda M, x: x.rsqrt(), P),
    ("reciprocal", lambda M, x: x.reciprocal(), NZ),
    ("sin", lambda M, x: M.sin(x), A),
    ("cos", lambda M, x: M.cos(x), A),
    ("tanh", lambda M, x: M.tanh(x), A),
    ("erf", lambda M, x: M.erf(x), A),
    ("sigmoid", lambda M, x: M.sigmoid(x), A),
    ("relu", lambda M, x: M.relu(x), NZ),
    ("relu_method", lambda M, x: x.relu(), NZ),
    ("gelu", lambda M, x: M.nn.functional.gelu(x), A),
    ("gelu_tanh", lambda M, x: M.nn.functional.gelu(x, approximate="tanh"), A),
    ("silu", lambda M, x: M.nn.functional.silu(x), A),
    ("sign", lambda M, x: x.sign(), NZ),
    ("floor", lambda M, x: x.floor(), A),
    ("ceil", lambda M, x: x.ceil(), A),
    ("round", lambda M, x: x.round(), A),
    ("trunc", lambda M, x: x.trunc(), A),
    ("clamp", lambda M, x: x.clamp(min=-0.5, max=0.7), A),
    ("clamp_min", lambda M, x: x.clamp(min=0.1), A),
    ("clamp_tensor", lambda M, x: M.clamp(x, max=x * 0 + 0.3), A),
]
for _name, _fn, _k in _UNARY:
    case(f"{_name}", _fn, _spec(_k, (3, 4)), dtypes=ALL)
    case(f"{_name}-noncontig", _fn, _spec(_k, (4, 2, 3), "T"), dtypes=ALL)
    case(f"{_name}-size0", _fn, _spec(_k, (0, 3)), dtypes=STD)
    case(f"{_name}-rank0", _fn, _spec(_k, ()), dtypes=STD)

# comparisons, where, masked_fill (forward: bool outputs; backward through where)
for _name, _fn in [("eq", lambda M, x, y: x == y), ("ne", lambda M, x, y: x != y), ("lt", lambda M, x, y: x < y),
                   ("le", lambda M, x, y: x <= y), ("gt", lambda M, x, y: x > y), ("ge", lambda M, x, y: x >= y)]:
    case(f"{_name}", _fn, D(3, 4), D(3, 1), dtypes=ALL, grad=False)
    case(f"{_name}-self", lambda M, x, f=_fn: f(M, x, x), A((2, 3)), grad=False)
    case(f"{_name}-scalar", lambda M, x, f=_fn: f(M, x, 0.25), D(5, 2), dtypes=ALL, grad=False)
case("where", lambda M, x, y: M.where(x > y, x, y), A((3, 4)), A((4,)), dtypes=ALL)
case("where-bcast-cond", lambda M, c, x, y: M.where(c, x, y), MASK(3, 1), A((1, 4)), A((3, 4)), dtypes=ALL)
case("where-scalar", lambda M, x: M.where(x > 0, x, 0.0), A((3, 4)), dtypes=ALL)
case("where-method", lambda M, x, y: x.where(x > 0, y), A((3, 4)), A((3, 4)))
case("where-size0", lambda M, c, x, y: M.where(c, x, y), MASK(0, 4), A((0, 1)), A((4,)))
case("masked_fill", lambda M, x, m: x.masked_fill(m, -1.5), A((3, 4)), MASK(3, 4), dtypes=ALL)
case("masked_fill-bcast", lambda M, x, m: x.masked_fill(m, float("-inf")).softmax(-1), A((2, 3, 4)), MASK(1, 4))
case("masked_fill-noncontig", lambda M, x, m: x.masked_fill(m, 2.0), A((3, 4), layout="T"), MASK(4))

# reductions
_RED_DIMS = [("all", {}), ("d0", dict(dim=0)), ("dneg", dict(dim=-1)), ("dtuple", dict(dim=(0, 2))),
             ("dneg_tuple", dict(dim=(-1, -2))), ("d1_keep", dict(dim=1, keepdim=True)),
             ("dtuple_keep", dict(dim=(0, -1), keepdim=True))]
for _name, _fn in [("sum", lambda M, x, **k: x.sum(**k)), ("mean", lambda M, x, **k: x.mean(**k)),
                   ("var", lambda M, x, **k: x.var(**k)), ("std", lambda M, x, **k: x.std(**k)),
                   ("var0", lambda M, x, **k: M.var(x, correction=0, **k)),
                   ("amax", lambda M, x, **k: x.amax(**k)), ("amin", lambda M, x, **k: M.amin(x, **k))]:
    for _did, _kw in _RED_DIMS:
        if _name in ("amax", "amin") and _did == "all":
            _kw = dict(dim=(0, 1, 2))
        _k = D if _name in ("amax", "amin") else A
        case(f"{_name}-{_did}", lambda M, x, f=_fn, kw=_kw: f(M, x, **kw), _spec(_k, (3, 4, 5)), dtypes=ALL,
             tol={"bf16": dict(rtol=5e-2, atol=5e-2)} if _name in ("var", "std", "var0") else {})
    case(f"{_name}-noncontig", lambda M, x, f=_fn: f(M, x, dim=1), _spec(_k, (4, 3, 5), "T"), dtypes=ALL)
for _name, _fn in [("prod", lambda M, x, **k: x.prod(**k))]:
    for _did, _kw in [("all", {}), ("d0", dict(dim=0)), ("dneg_keep", dict(dim=-1, keepdim=True))]:
        case(f"prod-{_did}", lambda M, x, kw=_kw: x.prod(**kw), NZ(3, 4), dtypes=ALL)
case("prod-zeros", lambda M, x: x.prod(-1), A((6, 3), "zeros"), dtypes=ALL)
case("prod-zeros-all", lambda M, x: x.prod(), A((3,), "zeros"))
case("prod-one-zero", lambda M, x: (x * M.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=x.dtype)).prod(1),
     A((2, 3)))
case("var-size1", lambda M, x: x.var(-1), A((3, 1)), grad=False)  # nan, and a warning from torch
case("var-correction0-size1", lambda M, x: x.var(-1, correction=0), A((3, 1)))
case("sum-size0", lambda M, x: x.sum(0), A((0, 4)))
case("sum-size0-all", lambda M, x: x.sum(), A((2, 0)))
case("sum-size1", lambda M, x: x.sum(-1, keepdim=True), A((3, 1)), dtypes=ALL)
case("sum-rank0", lambda M, x: x.sum(), A(()))
case("sum-rank0-dim", lambda M, x: x.sum(0), A(()))
case("mean-size1", lambda M, x: x.mean((0, 2)), A((1, 3, 1)))
case("prod-size0", lambda M, x: x.prod(1), A((3, 0)))
case("sum-dtype", lambda M, x: x.sum(dtype=M.float64), A((3, 4)))
for _name in ("max", "min"):
    case(f"{_name}-all", lambda M, x, n=_name: getattr(x, n)(), D(3, 4, 5), dtypes=ALL)
    case(f"{_name}-dim", lambda M, x, n=_name: getattr(x, n)(1), D(3, 4, 5), dtypes=ALL)
    case(f"{_name}-dneg-keep", lambda M, x, n=_name: getattr(M, n)(x, -1, keepdim=True), D(3, 4, 5), dtypes=ALL)
    case(f"{_name}-noncontig", lambda M, x, n=_name: getattr(x, n)(0), D(3, 4, layout="T"))
    case(f"{_name}-binary", lambda M, x, y, n=_name: getattr(M, n)(x, y), D(3, 4), A((4,)))
    case(f"arg{_name}", lambda M, x, n=_name: getattr(x, "arg" + n)(), D(3, 4, 5), dtypes=ALL, grad=False)
    case(f"arg{_name}-dim", lambda M, x, n=_name: getattr(M, "arg" + n)(x, dim=-2), D(3, 4, 5), dtypes=ALL,
         grad=False)
    case(f"arg{_name}-keep", lambda M, x, n=_name: getattr(x, "arg" + n)(0, keepdim=True), D(3, 4), grad=False)

# movement
case("reshape", lambda M, x: x.reshape(4, 3), A((3, 4)), dtypes=ALL)
case("reshape-minus1", lambda M, x: x.reshape(2, -1, 2), A((3, 4)))
case("reshape-tuple", lambda M, x: M.reshape(x, (-1,)), A((3, 4), layout="T"))
case("reshape-size0", lambda M, x: x.reshape(3, 0, 2), A((0, 6)))
case("reshape-rank0", lambda M, x: x.reshape(1, 1), A(()))
case("view", lambda M, x: x.view(-1), A((3, 4)), dtypes=ALL)
case("permute", lambda M, x: x.permute(2, 0, 1), A((2, 3, 4)), dtypes=ALL)
case("permute-neg", lambda M, x: M.permute(x, (-1, -3, -2)), A((2, 3, 4), layout="T"))
case("transpose", lambda M, x: x.transpose(0, -1), A((2, 3, 4)), dtypes=ALL)
case("transpose-same", lambda M, x: x.transpose(1, 1), A((2, 3)))
case("t", lambda M, x: x.t(), A((2, 3)))
case("T", lambda M, x: x.T, A((2, 3)))
case("mT", lambda M, x: x.mT, A((4, 2, 3)))
case("expand", lambda M, x: x.expand(2, 3, 4), A((3, 1)), dtypes=ALL)
case("expand-minus1", lambda M, x: x.expand(5, -1, -1), A((1, 3, 2)))
case("expand-size0", lambda M, x: x.expand(0, 4), A((1, 4)))
case("broadcast_to", lambda M, x: M.broadcast_to(x, (2, 3)), A((3,)))
case("squeeze", lambda M, x: x.squeeze(), A((1, 3, 1, 2)), dtypes=ALL)
case("squeeze-dim", lambda M, x: x.squeeze(-2), A((1, 3, 1, 2)))
case("squeeze-dim-not1", lambda M, x: x.squeeze(1), A((1, 3, 1, 2)))
case("squeeze-tuple", lambda M, x: x.squeeze((0, 2)), A((1, 3, 1, 2)))
case("squeeze-size0", lambda M, x: x.squeeze(), A((0, 1, 2)))
case("unsqueeze", lambda M, x: x.unsqueeze(0), A((3, 4)), dtypes=ALL)
case("unsqueeze-neg", lambda M, x: x.unsqueeze(-1), A((3, 4)))
case("unsqueeze-mid-neg", lambda M, x: M.unsqueeze(x, -2), A((3, 4)))
case("unsqueeze-rank0", lambda M, x: x.unsqueeze(0), A(()))
case("flatten", lambda M, x: x.flatten(), A((2, 3, 4), layout="T"), dtypes=ALL)
case("flatten-range", lambda M, x: x.flatten(1, -1), A((2, 3, 4)))
case("flatten-neg", lambda M, x: M.flatten(x, -3, -2), A((2, 3, 4)))
case("flatten-rank0", lambda M, x: x.flatten(), A(()))
case("flip", lambda M, x: x.flip((0, -1)), A((3, 4)), dtypes=ALL)
case("narrow", lambda M, x: x.narrow(-1, 1, 2), A((3, 4)))
case("contiguous", lambda M, x: x.T.contiguous(), A((3, 4)))
case("cat", lambda M, x, y: M.cat([x, y]), A((2, 3)), A((4, 3)), dtypes=ALL)
case("cat-neg", lambda M, x, y, z: M.cat((x, y, z), dim=-1), A((2, 3)), A((2, 1), layout="s"), A((2, 2)))
case("cat-size0", lambda M, x, y: M.cat([x, y], 0), A((0, 3)), A((2, 3)))
case("cat-promote", lambda M, x, y: M.cat([x, y.double()], 1), A((2, 3)), A((2, 2)))
case("cat-one", lambda M, x: M.cat([x], 1), A((2, 3)))
case("stack", lambda M, x, y: M.stack([x, y]), A((2, 3)), A((2, 3)), dtypes=ALL)
case("stack-neg", lambda M, x, y: M.stack([x, y], dim=-1), A((2, 3)), A((2, 3), layout="T"))
case("stack-rank0", lambda M, x, y: M.stack([x, y]), A(()), A(()))
case("split-int", lambda M, x: x.split(2, dim=-1), A((3, 5)), dtypes=ALL)
case("split-list", lambda M, x: M.split(x, [1, 0, 2], dim=0), A((3, 5)))
case("split-bigger", lambda M, x: x.split(10), A((3, 5)))
case("chunk", lambda M, x: x.chunk(3, dim=1), A((3, 5)), dtypes=ALL)
case("chunk-uneven", lambda M, x: x.chunk(4, -1), A((2, 6)))
case("chunk-more-than-size", lambda M, x: x.chunk(5, 0), A((3, 2)))
case("pad", lambda M, x: M.nn.functional.pad(x, (1, 2)), A((3, 4)), dtypes=ALL)
case("pad-2d", lambda M, x: M.nn.functional.pad(x, (0, 1, 2, 0), value=-1.0), A((2, 3, 4)))
case("pad-negative", lambda M, x: M.nn.functional.pad(x, (-1, 2, 1, -1)), A((3, 4)))
case("pad-size0", lambda M, x: M.nn.functional.pad(x, (1, 1)), A((2, 0)))
case("pad-reflect", lambda M, x: M.nn.functional.pad(x, (2, 1, 1, 0), mode="reflect"), A((2, 3, 4)))
case("pad-replicate", lambda M, x: M.nn.functional.pad(x, (-1, 3), mode="replicate"), A((2, 4)))
case("pad-circular", lambda M, x: M.nn.functional.pad(x, (1, 2, 3, 0), mode="circular"), A((2, 3, 4)))
case("gather", lambda M, x, i: x.gather(1, i), A((3, 4)), IDX((3, 5), 4, negative=False), dtypes=ALL)
case("gather-dim0", lambda M, x, i: M.gather(x, 0, i), A((3, 4)), IDX((2, 4), 3, negative=False))
case("gather-neg", lambda M, x, i: x.gather(-1, i), A((2, 3, 4), layout="T"), IDX((2, 3, 2), 4, negative=False))
case("gather-smaller", lambda M, x, i: x.gather(0, i), A((5, 4)), IDX((2, 2), 5, negative=False))
case("index_select", lambda M, x, i: x.index_select(-1, i), A((3, 4)), IDX((6,), 4, negative=False))
case("tril", lambda M, x: x.tril(), A((4, 5)), dtypes=ALL)
case("tril-neg", lambda M, x: M.tril(x, -1), A((2, 4, 3)))
case("triu", lambda M, x: x.triu(1), A((4, 5)), dtypes=ALL)
case("triu-neg-batch", lambda M, x: M.triu(x, diagonal=-2), A((2, 3, 5), layout="T"))

# indexing and slicing
_IX = [
    ("int", lambda x: x[1]),
    ("int-neg", lambda x: x[-1, 2]),
    ("slice", lambda x: x[1:3]),
    ("slice-step", lambda x: x[:, ::2]),
    ("slice-neg-bounds", lambda x: x[-3:-1, -100:100]),
    ("slice-empty", lambda x: x[2:1]),
    ("none", lambda x: x[None]),
    ("none-mid", lambda x: x[:, None, 1]),
    ("ellipsis", lambda x: x[..., 1]),
    ("ellipsis-none", lambda x: x[..., None]),
    ("ellipsis-mid", lambda x: x[1, ..., ::2]),
    ("list", lambda x: x[[0, 2, 2]]),
    ("list-neg-dim1", lambda x: x[:, [-1, 0]]),
]
for _iid, _ix in _IX:
    case(f"getitem-{_iid}", lambda M, x, f=_ix: f(x), A((4, 5)), dtypes=ALL if _iid == "int" else STD)
# torch has no negative slice steps: its side picks the same elements with index_select
case("getitem-neg-step", lambda M, x: x[::-1], A((4, 5)), dtypes=ALL,
     torch_fn=lambda M, x: _sel(x, 0, slice(None, None, -1)))
case("getitem-neg-step2", lambda M, x: x[3:0:-2, -1::-3], A((4, 5)),
     torch_fn=lambda M, x: _sel(_sel(x, 0, slice(3, 0, -2)), 1, slice(-1, None, -3)))
case("getitem-neg-step-empty", lambda M, x: x[1:3:-1], A((4, 5)), torch_fn=lambda M, x: _sel(x, 0, slice(1, 3, -1)))
case("getitem-neg-step-ellipsis", lambda M, x: x[1, ..., ::-1], A((3, 4, 5)),
     torch_fn=lambda M, x: _sel(x[1], -1, slice(None, None, -1)))
case("getitem-3d-mixed", lambda M, x: x[1:, None, ..., ::-2], A((3, 4, 5), layout="T"),
     torch_fn=lambda M, x: _sel(x[1:, None], 3, slice(None, None, -2)))
case("getitem-tensor", lambda M, x, i: x[i], A((4, 3)), IDX((5,), 4), dtypes=ALL)
case("getitem-tensor-2d", lambda M, x, i: x[:, i], A((4, 3)), IDX((2, 2), 3))
case("getitem-tensor-pair", lambda M, x, i, j: x[i, j], A((4, 3)), IDX((2, 3), 4), IDX((3,), 3))
case("getitem-tensor-adjacent", lambda M, x, i, j: x[:, i, j], A((2, 4, 3)), IDX((5,), 4), IDX((5,), 3))
case("getitem-tensor-split", lambda M, x, i, j: x[i, :, j], A((2, 4, 3)), IDX((5,), 2), IDX((1,), 3))
case("getitem-tensor-slice", lambda M, x, i: x[1:, i, ::2], A((3, 4, 5)), IDX((2,), 4))
case("getitem-tensor-repeat-grad", lambda M, x, i: x[i] * 2, A((3,)), IDX((10,), 3))
case("getitem-bool-mask", lambda M, x: x[M.tensor([True, False, True, True])], A((4, 3)))
case("getitem-bool-list", lambda M, x: x[:, [True, False, True]], A((4, 3)))
case("getitem-bool-mask-2d", lambda M, x: x[x > 0.5], A((4, 3)))
case("getitem-bool-mask-2d-of-3d", lambda M, x, m: x[m], A((2, 3, 4)), MASK(2, 3))
case("getitem-bool-mask-then-int", lambda M, x, m: x[m, 1], A((2, 3, 4)), MASK(2, 3))
case("setitem-int", lambda M, x, v: _setitem(x, 1, v), A((3, 4)), A((4,)))
case("setitem-slice-bcast", lambda M, x, v: _setitem(x, (slice(None), slice(None, None, 2)), v), A((3, 4)), A((3, 1)))
case("setitem-neg-step", lambda M, x, v: _setitem(x, (Ellipsis, slice(None, None, -2)), v), A((3, 4)), A((2,)),
     torch_fn=lambda M, x, v: _setitem(x, (Ellipsis, torch.tensor([3, 1])), v))
case("setitem-tensor", lambda M, x, i, v: _setitem(x, i, v), A((5, 3)), IDX((2,), 5),
     A((2, 3)))

# linear algebra and composites
case("matmul", lambda M, x, y: x @ y, A((3, 4)), A((4, 5)), dtypes=ALL,
     tol={"bf16": dict(rtol=5e-2, atol=8e-2)})
case("matmul-vec-vec", lambda M, x, y: M.matmul(x, y), A((4,)), A((4,)), dtypes=ALL)
case("matmul-vec-mat", lambda M, x, y: x @ y, A((4,)), A((4, 3)))
case("matmul-mat-vec", lambda M, x, y: x @ y, A((3, 4)), A((4,)))
case("matmul-batch-vec", lambda M, x, y: x @ y, A((2, 3, 4)), A((4,)))
case("matmul-vec-batch", lambda M, x, y: x @ y, A((4,)), A((2, 4, 3)))
case("matmul-batch-bcast", lambda M, x, y: x @ y, A((2, 1, 3, 4)), A((5, 4, 2)), dtypes=ALL,
     tol={"bf16": dict(rtol=5e-2, atol=8e-2)})
case("matmul-noncontig", lambda M, x, y: x @ y, A((3, 4), layout="T"), A((4, 5), layout="s"))
case("matmul-k0", lambda M, x, y: x @ y, A((3, 0)), A((0, 2)))
case("matmul-m0", lambda M, x, y: x @ y, A((0, 3)), A((3, 2)))
case("matmul-size1", lambda M, x, y: x @ y, A((1, 1)), A((1, 3)))
case("linear", lambda M, x, w, b: M.nn.functional.linear(x, w, b), A((2, 3, 4)), A((5, 4)), A((5,)), dtypes=ALL,
     tol={"bf16": dict(rtol=5e-2, atol=8e-2)})
for _name in ("softmax", "log_softmax"):
    case(f"{_name}", lambda M, x, n=_name: getattr(M, n)(x, -1), A((3, 5)), dtypes=ALL)
    case(f"{_name}-dim0", lambda M, x, n=_name: getattr(x, n)(0), A((3, 5)), dtypes=ALL)
    case(f"{_name}-3d-mid", lambda M, x, n=_name: getattr(M, n)(x, dim=-2), A((2, 3, 4), layout="T"))
    case(f"{_name}-size1", lambda M, x, n=_name: getattr(M, n)(x, dim=-1), A((3, 1)))
    case(f"{_name}-size0", lambda M, x, n=_name: getattr(M, n)(x, dim=-1), A((0, 4)))
    case(f"{_name}-large", lambda M, x, n=_name: getattr(M, n)(x * 100, dim=-1), A((2, 6)))
    case(f"{_name}-nn", lambda M, x, n=_name: getattr(M.nn.functional, n)(x, dim=1), A((2, 3)))
case("softmax-dtype", lambda M, x: M.softmax(x, -1, dtype=M.float64), A((2, 3)), dtypes=ALL)
case("where-two-scalars", lambda M, x: M.where(x > 0, 1.0, 0.0) * x, A((2, 3)), dtypes=ALL)
case("layer_norm", lambda M, x, w, b: M.nn.functional.layer_norm(x, (4,), w, b), A((2, 3, 4)), A((4,)), A((4,)),
     dtypes=ALL, tol={"f16": dict(rtol=1e-2, atol=1e-2), "bf16": dict(rtol=6e-2, atol=6e-2)})
case("layer_norm-2d-noaffine", lambda M, x: M.nn.functional.layer_norm(x, (3, 4)), A((2, 3, 4)))
case("layer_norm-weight-only", lambda M, x, w: M.nn.functional.layer_norm(x, (4,), w), A((3, 4)), A((4,)))

# cast / to
case("to-f64", lambda M, x: x.to(M.float64), A((3, 4)))
case("to-f16", lambda M, x: x.to(M.float16) * 3, A((3, 4)))
case("to-bf16", lambda M, x: x.to(dtype=M.bfloat16), A((3, 4)), tol={"f32": TOL["bf16"], "f64": TOL["bf16"]})
case("to-f32", lambda M, x: x.float(), A((3, 4)), dtypes=ALL)
case("to-i32", lambda M, x: x.to(M.int32), A((3, 4), lo=-5, hi=5), dtypes=ALL, grad=False)
case("to-bool", lambda M, x: x.bool(), A((3, 4), lo=-1, hi=1), grad=False)
case("to-cpu", lambda M, x: x.to("cpu", M.float64), A((3,)))
case("to-other", lambda M, x, y: x.to(y), A((3,)), A((2,), "f64", grad=False))
case("type_as", lambda M, x, y: x.type_as(y), A((3,)), A((2,), "i32", grad=False), grad=False)
case("double-half-bfloat16", lambda M, x: x.double().half().bfloat16().float(), A((3, 4)),
     tol={"f32": TOL["bf16"], "f64": TOL["bf16"]})

# rounding ties (torch rounds half to even) and IEEE special values (forward only)
case("round-halves", lambda M, x: x.round(), A((4, 4), "halves"), dtypes=ALL)
case("floor-ceil-trunc-halves", lambda M, x: x.floor() + x.ceil() * 10 + x.trunc() * 100, A((4, 4), "halves"))
_SPECIAL = [("maximum", lambda M, x, y: M.maximum(x, y)), ("minimum", lambda M, x, y: M.minimum(x, y)),
            ("add", lambda M, x, y: x + y), ("mul", lambda M, x, y: x * y), ("div", lambda M, x, y: x / y),
            ("eq", lambda M, x, y: x == y), ("lt", lambda M, x, y: x < y), ("ne", lambda M, x, y: x != y),
            ("where", lambda M, x, y: M.where(x > y, x, y)), ("pow", lambda M, x, y: x ** y),
            ("floordiv", lambda M, x, y: x // y), ("remainder", lambda M, x, y: x % y)]
for _name, _fn in _SPECIAL:
    case(f"special-{_name}", _fn, A((8, 8), "special"), A((8,), "special"), grad=False)
for _name, _fn in [("relu", lambda M, x: M.relu(x)), ("clamp", lambda M, x: x.clamp(-1, 1)),
                   ("exp", lambda M, x: M.exp(x)), ("log", lambda M, x: M.log(x)), ("sqrt", lambda M, x: x.sqrt()),
                   ("tanh", lambda M, x: M.tanh(x)), ("sigmoid", lambda M, x: M.sigmoid(x)),
                   ("sign", lambda M, x: x.sign()), ("abs", lambda M, x: x.abs()), ("floor", lambda M, x: x.floor()),
                   ("round", lambda M, x: x.round()), ("sum", lambda M, x: x.sum(-1)),
                   ("amax", lambda M, x: x.amax(-1)), ("max-dim", lambda M, x: x.max(-1)),
                   ("argmax", lambda M, x: x.argmax(-1)), ("argmin", lambda M, x: x.argmin(0)),
                   ("softmax", lambda M, x: M.softmax(x, -1)), ("to-f16", lambda M, x: x.half()),
                   ("masked-softmax", lambda M, x: M.softmax(x.masked_fill(x != x, float("-inf")), -1))]:
    case(f"special-{_name}", _fn, A((8, 8), "special"), grad=False)

# sorting, scans, einsum and the other names of issue 16 (tensor/extra_ops.py)
for _name, _fn in [("cumsum", lambda M, x: M.cumsum(x, 1)), ("cumsum-method", lambda M, x: x.cumsum(-2)),
                   ("sort", lambda M, x: x.sort()), ("sort-desc", lambda M, x: M.sort(x, 0, descending=True)),
                   ("topk", lambda M, x: x.topk(3)), ("topk-smallest", lambda M, x: M.topk(x, 2, 0, largest=False)),
                   ("repeat", lambda M, x: x.repeat(2, 1, 3)), ("unbind", lambda M, x: x.unbind(1)),
                   ("norm", lambda M, x: x.norm()), ("norm-1", lambda M, x: x.norm(1, dim=1)),
                   ("norm-inf", lambda M, x: M.norm(x, float("inf"), dim=0, keepdim=True)),
                   ("norm-3", lambda M, x: x.norm(3, dim=(0, 1)))]:
    case(_name, _fn, D(4, 6), dtypes=ALL)
case("norm-0", lambda M, x: x.norm(0, dim=1), A((4, 6), "zeros"), grad=False)
case("argsort", lambda M, x: M.argsort(x, -1, descending=True), D(4, 6), dtypes=ALL, grad=False)
for _name, _eq, _shapes in [("matmul", "ij,jk->ik", [(3, 4), (4, 5)]), ("implicit", "ij,jk", [(3, 4), (4, 5)]),
                            ("batched", "bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
                            ("attention", "bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)]),
                            ("ellipsis", "...ij,...jk->...ik", [(2, 3, 4), (4, 5)]), ("outer", "i,j->ij", [(3,), (4,)]),
                            ("diagonal", "ii->i", [(4, 4)]), ("trace", "ii", [(4, 4)]), ("sum", "ij->", [(3, 4)]),
                            ("transpose", "ij->ji", [(3, 4)]), ("three", "ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),
                            ("summed-early", "ij,k->jk", [(3, 4), (2,)]),
                            ("broadcast", "bij,bjk->bik", [(1, 3, 4), (2, 4, 5)])]:
    case(f"einsum-{_name}", lambda M, *xs, _eq=_eq: M.einsum(_eq, *xs), *(A(s) for s in _shapes))
case("bmm", lambda M, x, y: M.bmm(x, y), A((2, 3, 4)), A((2, 4, 5)), dtypes=ALL)
case("outer", lambda M, x, y: M.outer(x, y), A((3,)), A((4,)), dtypes=ALL)
case("isclose", lambda M, x, y: M.isclose(x, y, rtol=0.5, atol=0.1), A((4, 5)), A((4, 5)), grad=False)
case("any-all", lambda M, x: (x.any(), x.all(1), M.any(x, 0, keepdim=True)), A((4, 5), "zeros"), grad=False)
for _name, _fn in [("isnan", lambda M, x: M.isnan(x)), ("sort-values", lambda M, x: x.sort(-1)[0]),
                   ("topk-values", lambda M, x: x.topk(3, 0)[0]), ("cumsum", lambda M, x: x.cumsum(1)),
                   ("any", lambda M, x: x.any(1)), ("norm", lambda M, x: x.norm(dim=0))]:
    case(f"special-{_name}", _fn, A((8, 8), "special"), grad=False)

# a few compositions, to check gradients flowing through several ops and reused values
case("chain", lambda M, x, y: ((x @ y).tanh() * x.sum(-1, keepdim=True)).softmax(-1).log().mean(), A((3, 4)),
     A((4, 4)))
case("reuse", lambda M, x: x * x.exp() + x[::-1].sigmoid(), A((5,)), dtypes=ALL,
     torch_fn=lambda M, x: x * x.exp() + _sel(x, 0, slice(None, None, -1)).sigmoid())

_IDS = [c.id for c in CASES]
assert len(_IDS) == len(set(_IDS)), "duplicate case ids"
FLOAT_PARAMS = [pytest.param(c, d, id=f"{c.id}-{d}") for c in CASES for d in c.dtypes]

# --- integer and bool ops: exact, with PyTorch's promotion --------------------------------

CASES = []
INTS = ("i32", "i64")
MIXED = ("mixed",)  # inputs of fixed dtypes: run once
_IBCAST = [("same", (3, 4), (3, 4)), ("row_col", (3, 1), (1, 4)), ("rank0", (2, 3), ()), ("size0", (0, 3), (3,)),
           ("noncontig", (3, 4), (3, 4))]
for _name, _fn, _kb in [("add", lambda M, x, y: x + y, I), ("sub", lambda M, x, y: x - y, I),
                        ("mul", lambda M, x, y: x * y, I), ("floordiv", lambda M, x, y: x // y, INZ),
                        ("remainder", lambda M, x, y: x % y, INZ), ("truediv", lambda M, x, y: x / y, INZ),
                        ("fmod", lambda M, x, y: M.fmod(x, y), INZ),
                        ("div-trunc", lambda M, x, y: M.div(x, y, rounding_mode="trunc"), INZ),
                        ("div-floor", lambda M, x, y: M.div(x, y, rounding_mode="floor"), INZ),
                        ("maximum", lambda M, x, y: M.maximum(x, y), I),
                        ("minimum", lambda M, x, y: M.minimum(x, y), I),
                        ("eq", lambda M, x, y: x == y, I), ("lt", lambda M, x, y: x < y, I),
                        ("ge", lambda M, x, y: x >= y, I)]:
    for _sid, _sa, _sb in _IBCAST:
        _lay = "T" if _sid == "noncontig" else "c"
        case(f"int-{_name}-{_sid}", _fn, I(*_sa, layout=_lay), _kb(*_sb, layout="s" if _lay == "T" else "c"),
             dtypes=INTS + (("i8", "u8", "i16") if _sid == "same" else ()))
for _name, _fn in [("add-scalar", lambda M, x: x + 3), ("rsub-scalar", lambda M, x: 5 - x),
                   ("mul-float-scalar", lambda M, x: x * 2.5), ("sub-float-scalar", lambda M, x: x - 0.5),
                   ("truediv-scalar", lambda M, x: x / 4), ("rtruediv-scalar", lambda M, x: 7 / x),
                   ("floordiv-neg-scalar", lambda M, x: x // -2), ("rfloordiv-neg", lambda M, x: -7 // x),
                   ("remainder-neg-scalar", lambda M, x: x % -3), ("rremainder-neg", lambda M, x: -7 % x),
                   ("remainder-float-scalar", lambda M, x: x % 2.5), ("floordiv-float-scalar", lambda M, x: x // 1.5),
                   ("pow-2", lambda M, x: x ** 2), ("pow-3", lambda M, x: x ** 3), ("pow-0", lambda M, x: x ** 0),
                   ("pow-float", lambda M, x: x.abs() ** 0.5), ("rpow", lambda M, x: 2 ** x.abs()),
                   ("pow-tensor", lambda M, x: x ** (x.abs() % 4)), ("rpow-float", lambda M, x: 1.5 ** x),
                   ("eq-scalar", lambda M, x: x == 3), ("lt-float-scalar", lambda M, x: x < 2.5),
                   ("neg", lambda M, x: -x), ("abs", lambda M, x: abs(x)), ("sign", lambda M, x: x.sign()),
                   ("clamp", lambda M, x: x.clamp(-2, 3)), ("clamp-float", lambda M, x: x.clamp(min=0.5)),
                   ("relu", lambda M, x: M.relu(x)), ("floor", lambda M, x: x.floor()),
                   ("exp", lambda M, x: M.exp(x)), ("sqrt", lambda M, x: x.abs().sqrt()),
                   ("sigmoid", lambda M, x: M.sigmoid(x)), ("where-float", lambda M, x: M.where(x > 0, x, 0.5)),
                   ("where-int", lambda M, x: M.where(x > 0, x, -1)),
                   ("masked_fill-float", lambda M, x: x.masked_fill(x > 0, 2.5)),
                   ("sum", lambda M, x: x.sum()), ("sum-dim", lambda M, x: x.sum(-1, keepdim=True)),
                   ("prod", lambda M, x: (x % 3 + 1).prod(0)), ("max", lambda M, x: x.max()),
                   ("max-dim", lambda M, x: x.max(1)), ("min-dim", lambda M, x: M.min(x, 0, keepdim=True)),
                   ("amax", lambda M, x: x.amax((0, 1))), ("argmax", lambda M, x: x.argmax()),
                   ("argmin-dim", lambda M, x: x.argmin(-1)),
                   ("getitem", lambda M, x: x[1:, ::2]), ("getitem-list", lambda M, x: x[[2, 0, -1]]),
                   ("getitem-none", lambda M, x: x[None, -1, ..., None]),
                   ("cat", lambda M, x: M.cat([x, x[:1]])), ("stack", lambda M, x: M.stack([x, x], -1)),
                   ("split", lambda M, x: x.split(3, 1)), ("chunk", lambda M, x: x.chunk(2)),
                   ("reshape", lambda M, x: x.reshape(-1, 2)), ("permute", lambda M, x: x.permute(1, 0)),
                   ("flip", lambda M, x: x.flip((1,))), ("expand", lambda M, x: x[:1].expand(3, -1)),
                   ("squeeze", lambda M, x: x[:1].squeeze(0)), ("flatten", lambda M, x: x.flatten()),
                   ("pad", lambda M, x: M.nn.functional.pad(x, (1, 1), value=7)),
                   ("tril", lambda M, x: x.tril()), ("triu", lambda M, x: x.triu(-1)),
                   ("matmul", lambda M, x: x @ x.T), ("matmul-vec", lambda M, x: x[0] @ x[1]),
                   ("to-float", lambda M, x: x.float()), ("to-f16", lambda M, x: x.half()),
                   ("to-bool", lambda M, x: x.bool()), ("to-i8", lambda M, x: x.to(M.int8)),
                   ("to-long", lambda M, x: x.long())]:
    case(f"int-{_name}", _fn, INZ(4, 6), dtypes=INTS)
for _name, _fn in [("cumsum", lambda M, x: x.cumsum(1)), ("cumsum-0", lambda M, x: M.cumsum(x, 0)),
                   ("sort-values", lambda M, x: x.sort(0, descending=True)[0]),
                   ("topk-values", lambda M, x: x.topk(2)[0]), ("any", lambda M, x: x.any(1)),
                   ("all", lambda M, x: M.all(x)), ("repeat", lambda M, x: x.repeat(1, 2)),
                   ("unbind", lambda M, x: M.unbind(x)), ("isnan", lambda M, x: M.isnan(x)),
                   ("bmm", lambda M, x: M.bmm(x[None], x.T[None])),
                   ("einsum", lambda M, x: M.einsum("ij,kj->ik", x, x))]:
    case(f"int-{_name}", _fn, I(4, 6), dtypes=INTS + ("i8", "u8"))
case("bool-cumsum", lambda M, x: x.cumsum(0), MASK(3, 4), dtypes=MIXED)
case("bool-any-all", lambda M, x: (x.any(1), x.all(0), M.any(x)), MASK(3, 4), dtypes=MIXED)
case("bool-sort", lambda M, x: x.sort(1, descending=True)[0], MASK(3, 4), dtypes=MIXED)
case("int-neg-step", lambda M, x: x[::-2], I(5, 3), dtypes=INTS,
     torch_fn=lambda M, x: _sel(x, 0, slice(None, None, -2)))
case("int-gather", lambda M, x, i: x.gather(1, i), I(3, 4), IDX((3, 2), 4, negative=False), dtypes=INTS)
case("int-getitem-tensor", lambda M, x, i: x[:, i], I(3, 4), IDX((2, 3), 4), dtypes=INTS)
case("int-setitem-tensor", lambda M, x, i: _setitem(x, i, 100), I(5, 2), IDX((3,), 5), dtypes=INTS)
case("int-setitem-slice", lambda M, x, v: _setitem(x, (slice(None), slice(1, None, 2)), v), I(3, 5), I(3, 1),
     dtypes=INTS)
case("uint8-wrap", lambda M, x, y: x - y, A((6,), "u8", lo=0, hi=255), A((6,), "u8", lo=0, hi=255), dtypes=MIXED)
case("uint8-floordiv", lambda M, x, y: x // y, A((6,), "u8", lo=0, hi=255), A((6,), "u8", lo=1, hi=20), dtypes=MIXED)
# promotion: mixed dtypes, rank-0 tensors (a lower tier than tensors with dims), scalars
_PAIRS = [("i32", "i64"), ("i8", "u8"), ("u8", "i16"), ("i16", "i8"), ("i32", "f16"), ("i64", "f32"),
          ("u8", "bf16"), ("f16", "bf16"), ("f16", "f64"), ("bf16", "f32"), ("bool", "i32"), ("bool", "f16"),
          ("i8", "bool")]
for _a, _b in _PAIRS:
    for _name, _fn in [("add", lambda M, x, y: x + y), ("mul", lambda M, x, y: x * y), ("where", lambda M, x, y:
                       M.where(x > y, x, y)), ("cat", lambda M, x, y: M.cat([x, y])), ("lt", lambda M, x, y: x < y)]:
        case(f"promote-{_name}-{_a}-{_b}", _fn, A((3,), _a, lo=0, hi=5), A((3,), _b, lo=0, hi=5), dtypes=MIXED)
    case(f"promote-rank0-{_a}-{_b}", lambda M, x, y: x * y, A((3,), _a, lo=0, hi=5), A((), _b, lo=0, hi=5),
         dtypes=MIXED)
    case(f"promote-rank0-{_b}-{_a}", lambda M, x, y: x + y, A((3,), _b, lo=0, hi=5), A((), _a, lo=0, hi=5),
         dtypes=MIXED)
    case(f"promote-rank0-both-{_a}-{_b}", lambda M, x, y: x * y,
         A((), _a, lo=0, hi=5), A((), _b, lo=0, hi=5), dtypes=MIXED)
for _k in ("bool", "u8", "i16", "f16", "bf16"):
    for _name, _fn in [("int", lambda M, x: x + 3), ("float", lambda M, x: x * 2.5), ("bool", lambda M, x: x + True),
                       ("neg-int", lambda M, x: x * -1 if x.dtype != M.bool else x * 0)]:
        case(f"promote-scalar-{_name}-{_k}", _fn, A((3,), _k, lo=0, hi=5), dtypes=MIXED)
# bool
case("bool-and", lambda M, x, y: x & y, MASK(3, 4), MASK(4), dtypes=MIXED)
case("bool-or", lambda M, x, y: x | y, MASK(3, 4), MASK(3, 1), dtypes=MIXED)
case("bool-xor", lambda M, x, y: x ^ y, MASK(3, 4), MASK(3, 4), dtypes=MIXED)
case("bool-rand", lambda M, x: True & x, MASK(3,), dtypes=MIXED)
case("bool-invert", lambda M, x: ~x, MASK(3, 4), dtypes=MIXED)
case("bool-logical", lambda M, x, y: M.logical_or(M.logical_not(x), M.logical_and(x, y)), MASK(3, 4), MASK(4),
     dtypes=MIXED)
case("bool-logical-xor-int", lambda M, x, y: M.logical_xor(x, y), MASK(4), A((4,), "i32", lo=-1, hi=2), dtypes=MIXED)
case("bool-add", lambda M, x, y: x + y, MASK(3, 4), MASK(4), dtypes=MIXED)
case("bool-mul", lambda M, x, y: x * y, MASK(3, 4), MASK(4), dtypes=MIXED)
case("bool-sum", lambda M, x: x.sum(-1), MASK(3, 4), dtypes=MIXED)
case("bool-max", lambda M, x: x.max(), MASK(3, 4), dtypes=MIXED)
case("bool-max-dim", lambda M, x: x.max(1), MASK(3, 4), dtypes=MIXED)
case("bool-amin", lambda M, x: x.amin(0), MASK(3, 4), dtypes=MIXED)
case("bool-eq", lambda M, x, y: x == y, MASK(3, 4), MASK(4), dtypes=MIXED)
case("bool-where", lambda M, c, x: M.where(c, x, ~x), MASK(3, 4), MASK(4), dtypes=MIXED)
case("bool-getitem", lambda M, x, i: x[i, 1:], MASK(3, 4), IDX((2,), 3), dtypes=MIXED)
case("bool-cat", lambda M, x, y: M.cat([x, y], -1), MASK(3, 4), MASK(3, 1), dtypes=MIXED)
case("bool-to-float", lambda M, x: x.float() * 2, MASK(3, 4), dtypes=MIXED)
case("bool-tril", lambda M, x: x.tril(), MASK(3, 4), dtypes=MIXED)
case("bool-masked_fill", lambda M, x, m: x.masked_fill(m, True), MASK(3, 4), MASK(4), dtypes=MIXED)

_IDS = [c.id for c in CASES]
assert len(_IDS) == len(set(_IDS)), "duplicate case ids"
EXACT_PARAMS = [pytest.param(c, d, id=f"{c.id}-{d}") for c in CASES for d in c.dtypes]


def run_case(c: Case, dtype: str) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{c.id}/{dtype}".encode()))
    arrays = [_draw(rng, s, dtype) for s in c.inputs]
    wants_grad = [c.grad and _is_float_spec(s) and s.grad for s in c.inputs]
    tin = [_to_torch(a, g) for a, g in zip(arrays, wants_grad)]
    din = [_to_dtm(a, g, s.layout) for a, g, s in zip(arrays, wants_grad, c.inputs)]
    tout = _outputs((c.torch_fn or c.fn)(torch, *tin))
    dout = _outputs(c.fn(dtm, *din))
    assert len(dout) == len(tout), f"{len(dout)} outputs, torch gives {len(tout)}"
    for k, (d, t) in enumerate(zip(dout, tout)):
        assert isinstance(d, dtm.Tensor), f"output {k} is {type(d).__name__}"
        assert d.shape == tuple(t.shape), f"output {k}: shape {d.shape}, torch {tuple(t.shape)}"
        assert d.dtype.name == NAME_OF_TORCH[t.dtype], f"output {k}: dtype {d.dtype}, torch {t.dtype}"
        if t.dtype.is_floating_point:  # the test dtype's tolerance; int tests: the output's
            tol = c.tol.get(dtype, TOL.get(dtype, TOL[NAME_OF_TORCH[t.dtype]]))
            np.testing.assert_allclose(_as_np(d), _as_np(t), equal_nan=True, err_msg=f"output {k}", **tol)
        else:
            np.testing.assert_array_equal(_as_np(d), _as_np(t), err_msg=f"output {k}")
    tol = c.tol.get(dtype, TOL.get(dtype))
    if not any(wants_grad):
        return
    # gradients of sum(out * cotangent) over the float outputs
    t_loss, d_loss = 0, 0
    for d, t in zip(dout, tout):
        if not t.dtype.is_floating_point or not t.requires_grad:
            continue
        ct = _draw(rng, A(tuple(t.shape)), NAME_OF_TORCH[t.dtype])
        t_loss = t_loss + (t * _to_torch(ct, False)).sum()
        d_loss = d_loss + (d * dtm.tensor(ct)).sum()
    assert isinstance(t_loss, torch.Tensor), "torch's outputs do not depend on the inputs"
    t_loss.backward()
    d_loss.backward()
    for k, (d, t, g) in enumerate(zip(din, tin, wants_grad)):
        if not g:
            continue
        tg = t.grad if t.grad is not None else torch.zeros_like(t)
        assert d.grad is not None, f"input {k} has no grad"
        assert d.grad.shape == tuple(tg.shape), f"grad {k}: shape {d.grad.shape}, torch {tuple(tg.shape)}"
        assert d.grad.dtype.name == NAME_OF_TORCH[tg.dtype], f"grad {k}: dtype {d.grad.dtype}, torch {tg.dtype}"
        np.testing.assert_allclose(_as_np(d.grad), _as_np(tg), equal_nan=True, err_msg=f"grad of input {k}", **tol)


@pytest.mark.filterwarnings("ignore:.*degrees of freedom is <= 0")
@pytest.mark.parametrize("c,dtype", FLOAT_PARAMS)
def test_float_op(backend, c: Case, dtype: str):
    run_case(c, dtype)


@pytest.mark.parametrize("c,dtype", EXACT_PARAMS)
def test_exact_op(backend, c: Case, dtype: str):
    run_case(c, dtype)
