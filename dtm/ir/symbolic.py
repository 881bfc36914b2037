"""Dimensions: a static `int`, or a `SymDim`, a polynomial over named symbols with integer
coefficients (`B`, `B*T`, `2*S + 1`, `T - 1`).

Polynomials in normal form compare and hash structurally, so `B*T == T*B` and reshape or
concat checks are exact equalities of normal forms. A `SymDim` whose symbols cancel becomes
a plain int again (`dim_sub(B + 1, B) == 1`), so static code never sees a constant SymDim.
"""

from __future__ import annotations

from typing import Union

from ..errors import ErrorCode
from .diagnostics import TypeRuleError

# Bounds on a symbolic dim's normal form, so that a short text such as (A+B+C)*(A+B+C)*...
# cannot make the reader expand millions of terms.
MAX_TERMS = 64
MAX_DEGREE = 16

# A monomial is a sorted tuple of symbol names, with repetition for powers: ("B", "T").
Monomial = tuple[str, ...]


class SymDim:
    """A dimension that depends on symbols; immutable, in normal form."""

    __slots__ = ("terms", "_hash")

    def __init__(self, terms: dict[Monomial, int]):
        # Normal form: zero terms dropped; higher degree first, then by names, constant last.
        items = [(m, c) for m, c in terms.items() if c != 0]
        items.sort(key=lambda mc: (-len(mc[0]), mc[0]))
        self.terms: tuple[tuple[Monomial, int], ...] = tuple(items)
        self._hash = hash(self.terms)

    @property
    def symbols(self) -> set[str]:
        return {s for m, _ in self.terms for s in m}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SymDim) and self.terms == other.terms

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return format_dim(self)


Dim = Union[int, SymDim]


def _as_terms(d: Dim) -> dict[Monomial, int]:
    if isinstance(d, int):
        return {(): d} if d else {}
    return dict(d.terms)


def _normalize(terms: dict[Monomial, int]) -> Dim:
    """An int when only the constant term is left, else a SymDim."""
    live = {m: c for m, c in terms.items() if c != 0}
    if not live:
        return 0
    if list(live) == [()]:
        return live[()]
    return SymDim(live)


def sym(name: str) -> SymDim:
    """The dim that is the symbol `name` alone (`sym("B")`), to build symbolic dims from."""
    return SymDim({(name,): 1})


def dim_add(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    terms = _as_terms(a)
    for m, c in _as_terms(b).items():
        terms[m] = terms.get(m, 0) + c
    out = _normalize(terms)
    if isinstance(out, SymDim) and len(out.terms) > MAX_TERMS:
        # Bounds a long sum as dim_mul bounds a product: each addition copies the terms,
        # so a dim of n terms would cost n^2.
        raise TypeRuleError(ErrorCode.INVALID_DIM, f"a sum of more than {MAX_TERMS} terms is too complex for a dim "
                            f"(limits: {MAX_TERMS} terms, degree {MAX_DEGREE})")
    return out


def dim_neg(a: Dim) -> Dim:
    if isinstance(a, int):
        return -a
    return _normalize({m: -c for m, c in a.terms})


def dim_sub(a: Dim, b: Dim) -> Dim:
    return dim_add(a, dim_neg(b))


def dim_mul(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    ta, tb = _as_terms(a), _as_terms(b)
    degree = max(map(len, ta), default=0) + max(map(len, tb), default=0)
    if len(ta) * len(tb) > MAX_TERMS or degree > MAX_DEGREE:
        raise TypeRuleError(ErrorCode.INVALID_DIM, f"the product ({format_dim(a)}) * ({format_dim(b)}) is too complex "
                            f"for a dim (limits: {MAX_TERMS} terms, degree {MAX_DEGREE})")
    terms: dict[Monomial, int] = {}
    for ma, ca in ta.items():
        for mb, cb in tb.items():
            m = tuple(sorted(ma + mb))
            terms[m] = terms.get(m, 0) + ca * cb
    return _normalize(terms)


def dim_prod(dims) -> Dim:
    out: Dim = 1
    for d in dims:
        out = dim_mul(out, d)
    return out


def dim_div_exact(a: Dim, n: int) -> Dim | None:
    """a / n when every coefficient of `a` is divisible by the positive int n, else None."""
    if isinstance(a, int):
        return a // n if a % n == 0 else None
    if any(c % n for _, c in a.terms):
        return None
    return _normalize({m: c // n for m, c in a.terms})


def is_static(d: Dim) -> bool:
    return isinstance(d, int)


def format_dim(d: Dim) -> str:
    """Canonical text: `2*B*T + S - 1`; coefficient 1 is omitted."""
    if isinstance(d, int):
        return str(d)
    parts: list[str] = []
    for i, (m, c) in enumerate(d.terms):
        mag = abs(c)
        body = "*".join(m) if m else str(mag)
        if m and mag != 1:
            body = f"{mag}*{body}"
        if i == 0:
            parts.append(("-" if c < 0 else "") + body)
        else:
            parts.append((" - " if c < 0 else " + ") + body)
    return "".join(parts)
