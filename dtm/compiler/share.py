"""Kernels that differ only in integer constants share one C function.

A training step repeats the same work on tensors of different sizes: AdamW's update of each
weight, the layer norms of differently shaped activations, products whose only difference
is their extents. Lowered, such kernels are the same loop IR but for the integer literals of
their index arithmetic (extents, strides, offsets). `share_kernels` finds them and gives
each group one body in which every literal that differs between its members is an int64
argument: a name in `Kernel.dims` whose value per kernel is `Kernel.consts[name]`. The C
compiler then sees the body once (a third less C for GPT-2's step, a fifth for the char
model's), and the build's cache of equal sources (build.load_functions) shares the object.

Literals the members agree on stay literal, and a divisor (the right operand of an index
"/" or "%") is never made an argument: the C compiler turns a division by a constant into a
multiply and a shift, by a variable into a division instruction tens of cycles long.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace
from functools import cache

from . import loopir as L
from .loopir import INDEX
from .program import Program

_HOLE = object()        # where a template has an integer literal that may become an argument
_DIVIDES = ("/", "%")   # index ops whose right operand stays literal


@cache
def _fields(t: type) -> tuple:
    """The field names of loop-IR statement type t, or () for anything else (looked up once)."""
    return tuple(f.name for f in fields(t)) if is_dataclass(t) else ()


def _divides_by_literal(x: L.Op) -> bool:
    """Whether index op x divides by an integer literal (which stays literal)."""
    return x.dtype is INDEX and x.op in _DIVIDES and type(x.args[1]) is L.Const


def _template(x, values: list):
    """A hashable picture of loop-IR node `x` with every integer index literal (not a
    divisor) replaced by _HOLE; the literals are appended to `values`, in walk order."""
    t = type(x)
    if t is L.Const:
        if x.dtype is INDEX:
            values.append(x.value)
            return _HOLE
        return x
    if t is L.Op:
        args = tuple([_template(a, values) for a in x.args])
        if _divides_by_literal(x):
            values.pop()  # the divisor is part of the structure, not an argument
            args = args[:1] + (x.args[1],)
        return (L.Op, x.op, args, x.dtype, x.attrs)
    if t is L.Load:
        return (L.Load, x.buf, _template(x.index, values), x.dtype)
    if t is L.Sym or t is L.Var:
        return x
    if t is list or t is tuple:
        return tuple([_template(e, values) for e in x])
    names = _fields(t)
    if names:
        return (t, *[_template(getattr(x, name), values) for name in names])
    return x


def _filled(x, names: dict, position: list):
    """Node `x` rebuilt with the integer literals at the walk positions in `names` (the
    order of _template) replaced by the symbols named there."""
    t = type(x)
    if t is L.Const:
        if x.dtype is not INDEX:
            return x
        position[0] += 1
        name = names.get(position[0] - 1)
        return x if name is None else L.Sym(name)
    if t is L.Op:
        if _divides_by_literal(x):
            return L.Op(x.op, (_filled(x.args[0], names, position), x.args[1]), x.dtype, x.attrs)
        return L.Op(x.op, tuple(_filled(a, names, position) for a in x.args), x.dtype, x.attrs)
    if t is L.Load:
        return L.Load(x.buf, _filled(x.index, names, position), x.dtype)
    if t is L.Sym or t is L.Var:
        return x
    if t is list:
        return [_filled(e, names, position) for e in x]
    if t is tuple:
        return tuple(_filled(e, names, position) for e in x)
    if fields_of_t := _fields(t):
        return replace(x, **{name: _filled(getattr(x, name), names, position) for name in fields_of_t})
    return x


def _shape(k: L.Kernel) -> tuple:
    """What the C of kernel k depends on besides its name, its params' shapes and the
    literals _template takes out."""
    return (tuple((p.name, p.dtype, p.output) for p in k.params), tuple(k.dims), tuple(sorted(k.aliases.items())))


def share_kernels(program: Program) -> Program:
    groups: dict = {}  # template -> [(step, its literals)]
    for step in program.kernels:
        values: list = []
        key = (_shape(step.kernel), _template(step.kernel.body, values))
        groups.setdefault(key, []).append((step, values))
    for members in groups.values():
        distinct = {tuple(values) for _, values in members}
        if len(distinct) < 2:
            continue
        # a literal that differs is an argument; literals that agree in every member (an
        # extent and the stride it is) are one argument
        argument: dict = {}  # the literals' values in the members -> the argument's name
        names = {}
        for i, column in enumerate(zip(*distinct)):
            if len(set(column)) > 1:
                names[i] = argument.setdefault(column, f"dtm_c{len(argument)}")  # no other name starts so
        body = _filled(members[0][0].kernel.body, names, [0])
        for step, values in members:
            k = step.kernel
            step.kernel = replace(k, body=body, dims=[*k.dims, *argument.values()],
                                  consts={**k.consts, **{name: int(values[i]) for i, name in names.items()}})
    return program
