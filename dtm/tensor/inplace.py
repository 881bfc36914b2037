"""In-place ops and views with torch's semantics on the lazy Tensor.

`x += 1`, `x.add_(1)`, `x[i] = v` change the tensor itself, so every reference to it sees
the new value; and a view (`view`, `reshape`, basic indexing, `transpose`, `permute`,
`squeeze`, `unsqueeze`, `flatten`, `unflatten`, `narrow`, `select`, `diagonal`, `movedim`,
`swapaxes`, `view_as`, `expand`, `expand_as`, `.T`, `t`, the pieces of `split`, `chunk` and
`unbind`, and `detach()`) shares its base's elements: a write through the view changes the
base, and a write to the base or to another view of it changes every view (spec 1.7,
"In-place ops and views").

How, in a lazy graph. A Tensor names a value; an in-place op makes it name a new one
(`_rebind`): ops recorded before it keep reading the old value (a snapshot), later ones read
the new, which is what torch's eager order gives. A view records its root base and the
function that computes it from the base. A write to a view is a write to the base: the
view's new elements are scattered into the base at the positions the view reads (the same
function applied to an iota of the base's shape); then every live view of the base is
rebound to its function of the base's new value. A leaf that holds a value and requires
grad (a parameter) is updated as an optimizer updates it (`assign`): under `no_grad` only,
as in torch; inside `dtm.jit` as the traced step's `assign` effect, after which the step
may not read it again (E0207, not a stale value). `t.data` is a view too, detached: a write
through it changes t as an optimizer's update does, outside autograd; so is `t.detach()`.

The old value an in-place write leaves to earlier ops is a snapshot that remembers the
write: backward() refuses it where an op saved it for its gradient, as torch's version
counter does (tensor/versions.py); the in-place op's own reads of it are accepted.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import numpy as np

from .. import functional as F
from ..errors import ErrorCode
from .core import (STATE, VIEW_HOOKS, Tensor, _copy as _copy_value, assign, enable_grad, error, is_grad_enabled, no_grad, normalize_dim, realize,
                   weak_append)
from ..ir.types import TensorType
from .dtypes import bool_
from .creation import full_like, rand, randn, zeros_like


# --- views ----------------------------------------------------------------------------------

def _as_view(out: Tensor, x: Tensor, fn: Callable[[Tensor], Tensor], writable: bool | str = True,
             detached: bool = False) -> Tensor:
    """Mark `out`, which is fn(x), a view of x's root base (composing x's own view function).
    A detached view (`.data`, and views of it) writes to its base outside autograd.
    `writable`: False for a view that repeats elements; the name of the function for one of
    several views that one call returns (unbind, split, chunk), which torch lets no in-place
    op change while it records gradients."""
    if out is x:  # a view that changes nothing (a reshape to the same shape) is the tensor itself
        return out
    if x._view is not None:
        base, inner, ok, free = x._view
        out._view = (base, lambda b: fn(inner(b)), False if False in (ok, writable) else ok if isinstance(ok, str)
                     else writable, free or detached)
    else:
        base = x
        out._view = (base, fn, writable, detached)
    base._views = weak_append(base._views, out)
    return out


def _view_method(fn: Callable, writable: Callable[..., bool] | None = None) -> Callable:
    def method(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        out = fn(self, *args, **kwargs)
        ok = writable(self, out) if writable is not None else True
        return _as_view(out, self, lambda b: fn(b, *args, **kwargs), ok)
    method.__name__ = getattr(fn, "__name__", "view")
    return method


def _no_repeats(x: Tensor, out: Tensor) -> bool:
    """Whether `out` holds each element of x at most once (not an expand to a larger size):
    writes through it are allowed."""
    return out.numel() == x.numel()


def _basic(index: Any) -> bool:
    """Basic indexing (ints, slices, None, ...) gives a view; integer tensors and lists copy."""
    parts = index if isinstance(index, tuple) else (index,)
    return not any(isinstance(i, (Tensor, list, np.ndarray)) for i in parts)


def _iter(self: Tensor):
    """Iterating a tensor gives its views along dim 0, as torch's; those of a known value
    (a batch of indices drawn for a data loader) at once from its array."""
    n = len(self)
    if not F._known(self):
        for k in range(n):
            yield _getitem(self, k)
        return
    b, t = self._buffer, TensorType(self.dtype, self.shape[1:])
    for k in range(n):
        yield _as_view(Tensor(t, buffer=np.asarray(b[k])), self, lambda base, k=k: F.getitem(base, k))


def _getitem(self: Tensor, index: Any) -> Tensor:
    if type(index) is slice and index.step is None and self._type.shape and F._known(self):  # (quick: data[i:i + T])
        a = self._buffer[index]
        out = Tensor(TensorType(self.dtype, a.shape), buffer=a if a.flags.c_contiguous else np.ascontiguousarray(a))
        return _as_view(out, self, lambda b: F.getitem(b, index))
    out = F.getitem(self, index)
    return _as_view(out, self, lambda b: F.getitem(b, index)) if _basic(index) else out


_DETACHED = Tensor.detach  # the core's: a new tensor, the same value, no history, no view


def _data(self: Tensor) -> Tensor:
    """Tensor.data and Tensor.detach(): the value without gradient history, sharing it as
    torch's does: an in-place write to it (p.data.mul_(0.5), p.detach().zero_()) changes
    the tensor, even a parameter outside no_grad, and records no gradient."""
    return _as_view(_DETACHED(self), self, _DETACHED, detached=True)


def _clone(self: Tensor) -> Tensor:
    """A copy that shares nothing (torch's clone): with gradient history when self has it."""
    if self.requires_grad:
        return F.add(self, 0)
    if self._buffer is not None:
        return Tensor(self._type, buffer=_copy_value(self._buffer))
    return _DETACHED(self)


def _split_views(x: Tensor, pieces: tuple, d: int, name: str) -> tuple:
    """Each piece of split / chunk along dim d is a view of x: its narrow of x."""
    at = 0
    for p in pieces:
        n = p.shape[d]
        _as_view(p, x, lambda b, a=at, n=n: F.narrow(b, d, a, n), name)
        at += n
    return pieces


def _split(self: Tensor, split_size_or_sections: Any, dim: int = 0) -> tuple:
    return _split_views(self, F.split(self, split_size_or_sections, dim), normalize_dim(dim, self.ndim), "split")


def _chunk(self: Tensor, chunks: int, dim: int = 0) -> tuple:
    return _split_views(self, F.chunk(self, chunks, dim), normalize_dim(dim, self.ndim), "chunk")


def _unbind(self: Tensor, dim: int = 0) -> tuple:
    """torch.unbind: the slices along `dim` without it, each a view of self."""
    d = normalize_dim(dim, self.ndim)
    return tuple(_as_view(F.squeeze(F.narrow(self, d, i, 1), d), self,
                          lambda b, i=i: F.squeeze(F.narrow(b, d, i, 1), d), "unbind") for i in range(self.shape[d]))


def _select(x: Tensor, dim: int, index: int) -> Tensor:
    """torch.select: x[..., index, ...] at `dim`, without that dim."""
    return F.getitem(x, (slice(None),) * normalize_dim(dim, x.ndim) + (index,))


def _diagonal(x: Tensor, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Tensor:
    """torch.diagonal: the elements x[..., i, i + offset] of dims dim1 and dim2, as a last
    dim (the other dims first, in order): a strided slice of the two dims flattened."""
    d1, d2 = normalize_dim(dim1, x.ndim), normalize_dim(dim2, x.ndim)
    if d1 == d2:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"diagonal: dim1 and dim2 are both dim {d1} (torch refuses it too)")
    rest = [a for a in range(x.ndim) if a not in (d1, d2)]
    n, m = x.shape[d1], x.shape[d2]
    k = max(min(n, m - offset), 0) if offset >= 0 else max(min(n + offset, m), 0)
    start = offset if offset >= 0 else -offset * m
    flat = F.reshape(F.permute(x, tuple(rest) + (d1, d2)), tuple(x.shape[a] for a in rest) + (n * m,))
    if k == 0:
        return F._slice(flat, len(rest), 0, 0, 1)
    return F._slice(flat, len(rest), start, start + (k - 1) * (m + 1) + 1, m + 1)


def _movedim(x: Tensor, source: Any, destination: Any) -> Tensor:
    """torch.movedim: dims `source` moved to positions `destination`, the others in order."""
    src = [normalize_dim(a, x.ndim) for a in ((source,) if isinstance(source, int) else source)]
    dst = [normalize_dim(a, x.ndim) for a in ((destination,) if isinstance(destination, int) else destination)]
    if len(src) != len(dst) or len(set(src)) != len(src) or len(set(dst)) != len(dst):
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"movedim: source {list(src)} and destination {list(dst)} must be "
                    "distinct dims, as many of each")
    order: list[int | None] = [None] * x.ndim
    for s_, d_ in zip(src, dst):
        order[d_] = s_
    others = iter(a for a in range(x.ndim) if a not in src)
    return F.permute(x, tuple(a if a is not None else next(others) for a in order))


def _unflatten(x: Tensor, dim: int, sizes: Any) -> Tensor:
    """torch.unflatten: dim `dim` split into `sizes` (one of them may be -1)."""
    d = normalize_dim(dim, x.ndim)
    return F.reshape(x, x.shape[:d] + tuple(sizes) + x.shape[d + 1:])


def _set_data(self: Tensor, value: Any) -> None:
    """`t.data = v`: t takes v's value in place, outside autograd. Unlike torch, in t's own
    dtype and shape (v broadcast to it)."""
    write(_data(self), value, "t.data = value")


# --- writes ---------------------------------------------------------------------------------

def _castable(src, dst) -> bool:
    """torch.can_cast for an in-place result: no float into an integer tensor, nothing but a
    bool into a bool one."""
    return not ((src.is_float and not dst.is_float) or (dst is bool_ and src is not bool_))


def write(t: Tensor, new: Tensor, op: str = "in-place op", earlier: list[Tensor] | None = None) -> Tensor:
    """t takes the value `new` in place (what an in-place op computed from it), as torch's
    in-place ops do: in t's dtype and shape, seen by every reference and every view.
    `earlier`: the ops that read t before the in-place op began (`_readers`); its own
    computation's reads of t are then not refused by backward() (torch's original_self)."""
    new = F.as_tensor(new)
    if not _castable(new.dtype, t.dtype):
        raise error(ErrorCode.DTYPE_MISMATCH, f"{op}: result type {new.dtype} can't be cast to the tensor's "
                    f"{t.dtype} in place (torch raises too)")
    if new.shape != t.shape:
        try:
            fits = np.broadcast_shapes(new.shape, t.shape) == t.shape
        except ValueError:  # shapes that do not broadcast at all
            fits = False
        if not fits:
            raise error(ErrorCode.SHAPE_MISMATCH, f"{op}: a result of shape {list(new.shape)} does not fit the "
                        f"tensor's {list(t.shape)} in place")
        new = F.expand(new, t.shape)
    new = F.cast(new, t.dtype)
    if t._view is None:
        _set(t, new, op, t, earlier)
        return t
    base, fn, writable, detached = t._view
    if not writable:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"{op}: this view repeats elements of its base (expand), so an "
                    "in-place write is ambiguous; torch refuses it too (clone() it first)")
    if isinstance(writable, str) and is_grad_enabled() and not detached and (t.requires_grad or base.requires_grad):
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"{op}: this {t._type} is one of the views {writable} returned, and "
                    "torch refuses to change such a view in place while it records gradients; use the out-of-place "
                    "op, or change a clone() of it")
    with no_grad() if detached else nullcontext():  # a detached view writes outside autograd
        if fn is not _DETACHED:  # (.data itself covers its whole base: no scatter)
            new = F._scatter_into(base, fn(F.reshape(F._iota((base.numel(),), 0), base.shape)), new)
        _set(base, new, op, t, earlier)
    return t


def _set(base: Tensor, new: Tensor, op: str, own: Tensor | None = None, earlier: list[Tensor] | None = None) -> None:
    """The base (not a view) takes `new`; then each of its live views is its function of it.
    (`own`, `earlier`: the tensor written and its readers before the write, see write.)"""
    if base._op is None and base.requires_grad and is_grad_enabled():
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"{op}: a leaf tensor that requires grad is used in an in-place "
                    "op (torch raises too); change it under `with dtm.no_grad():`")
    trace = STATE.trace
    if base._op is None and base._buffer is not None and (base.requires_grad or trace is not None):
        if trace is not None:  # inside dtm.jit, the step's effect: the step may not read it, or a view of it, again
            assign([(base, new)])
            trace.updated.update(id(v) for v in _live_views(base))
            return
        realize(new)  # a parameter keeps being a leaf, as an optimizer's update (`assign`) leaves it
        base._set_value(new._buffer, op)  # (which rebinds its views: _views_changed)
        return
    _rebind(base, new, op, earlier if base is own else None)
    _views_changed(base, op, own, earlier)


def _views_changed(base: Tensor, op: str, own: Tensor | None = None, earlier: list[Tensor] | None = None) -> None:
    """Each live view of `base`, which has a new value, names its function of it."""
    for v in _live_views(base):
        # a view that records gradient history keeps doing so after a write under no_grad (an
        # optimizer's step on its base), as torch's views do
        with enable_grad() if v.requires_grad and base.requires_grad else nullcontext():
            _rebind(v, v._view[1](base), op, earlier if v is own else None)


def _live_views(base: Tensor) -> list[Tensor]:
    return [v for v in (r() for r in base._views or ()) if v is not None]


def _rebind(t: Tensor, new: Tensor, op: str = "an in-place op", earlier: list[Tensor] | None = None) -> None:
    """t names `new`'s value from now on: ops that read t so far keep its old value, in a
    snapshot that backward() refuses where an op saved it (torch's version counter). With
    `earlier`, the readers of t before the in-place op that computed `new`: the op's own
    reads (the others) get a snapshot of their own, which backward() accepts."""
    if new._op is None:  # a leaf's value: an op of its own, so that t never shares its buffer
        new = F.apply("broadcast_to", new, shape=new.shape)
    old = t._snapshot(op)
    if earlier is not None and old._written is not None:
        _own_reads(old, earlier)
    t._type, t._op, t._inputs, t._attrs, t._buffer = new._type, new._op, new._inputs, new._attrs, None
    t._saves, t._freed = new._saves, False  # (a new value: a graph no backward() went through)
    # A tensor with gradient history written under no_grad (or through .data, detach()) keeps
    # requiring grad, as in torch, where the gradient then goes through as if nothing had
    # changed; DTM cannot compute that, so backward() refuses it (versions.check).
    cut = t.requires_grad and not new.requires_grad and not is_grad_enabled()
    t.requires_grad = new.requires_grad or cut
    t._written = (None, old._written[1] if old._written is not None else op, True) if cut else None
    for i in new._inputs:
        i._add_user(t)


def _readers(t: Tensor) -> list[Tensor]:
    """The ops that have read t so far (kept alive, so that no new op takes one's id)."""
    return [u for u in (r() for r in t._users or ()) if u is not None]


def _own_reads(old: Tensor, earlier: list[Tensor]) -> None:
    """Move the readers of snapshot `old` that are not in `earlier` (the in-place op's own
    computation) to a second snapshot of the same value, which backward() accepts: torch
    saves the value an in-place op overwrites when its gradient reads it."""
    before = {id(u) for u in earlier}
    own = None
    for ref in old._users or ():
        u = ref()
        if u is None or id(u) in before or not u._inputs:
            continue
        if own is None:
            own = Tensor(old._type, old._op, old._inputs, old._attrs, old._buffer, old.requires_grad)
            own._mesh, own._placements, own._freed, own._saves = old._mesh, old._placements, old._freed, old._saves
            own._written = old._written[:2] + (True,)
        u._inputs = tuple(own if i is old else i for i in u._inputs)
        own._add_user(u)


def _setitem(self: Tensor, index: Any, value: Any) -> None:
    write(self, F.setitem(self, index, value), "x[index] = value")


# --- the in-place methods -------------------------------------------------------------------

def _inplace(fn: Callable, name: str) -> Callable:
    def method(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        earlier = _readers(self)
        return write(self, fn(self, *args, **kwargs), name, earlier)
    method.__name__ = name
    return method


def _zero(x: Tensor) -> Tensor:
    return zeros_like(x)


def _fill(x: Tensor, value: Any) -> Tensor:
    return F.expand(F.as_tensor(value, x.dtype), x.shape) if isinstance(value, Tensor) else full_like(x, value)


def _copy(x: Tensor, src: Tensor, non_blocking: bool = False) -> Tensor:
    return F.as_tensor(src)


def _uniform(x: Tensor, a: float = 0.0, b: float = 1.0, generator=None) -> Tensor:
    return F.add(F.mul(rand(*x.shape, generator=generator, dtype=x.dtype), b - a), a)


def _normal(x: Tensor, mean: float = 0.0, std: float = 1.0, generator=None) -> Tensor:
    return F.add(F.mul(randn(*x.shape, generator=generator, dtype=x.dtype), std), mean)


_OPERATORS = {"__iadd__": F.add, "__isub__": F.sub, "__imul__": F.mul, "__itruediv__": F.div,
              "__ifloordiv__": F.floor_divide, "__imod__": F.remainder, "__ipow__": F.pow,
              "__iand__": F.logical_and, "__ior__": F.logical_or, "__ixor__": F.logical_xor}
_METHODS = {"add_": F.add, "sub_": F.sub, "mul_": F.mul, "div_": F.div, "pow_": F.pow, "neg_": F.neg,
            "abs_": F.abs, "exp_": F.exp, "log_": F.log, "sqrt_": F.sqrt, "rsqrt_": F.rsqrt,
            "sigmoid_": F.sigmoid, "tanh_": F.tanh, "floor_": F.floor, "ceil_": F.ceil, "round_": F.round,
            "clamp_": F.clamp, "clip_": F.clamp, "relu_": F.relu, "masked_fill_": F.masked_fill,
            "lerp_": lambda x, end, w: F.add(x, F.mul(F.sub(end, x), w)),
            "zero_": _zero, "fill_": _fill, "copy_": _copy, "uniform_": _uniform, "normal_": _normal,
            "index_add_": F.index_add, "scatter_": F.scatter}
_VIEWS = {"view": (F.reshape, None), "reshape": (F.reshape, None), "flatten": (F.flatten, None),
          "squeeze": (F.squeeze, None), "unsqueeze": (F.unsqueeze, None), "permute": (F.permute, None),
          "transpose": (F.transpose, None), "narrow": (F.narrow, None), "expand": (F.expand, _no_repeats),
          "swapaxes": (F.transpose, None), "swapdims": (F.transpose, None), "movedim": (_movedim, None),
          "moveaxis": (_movedim, None), "select": (_select, None), "diagonal": (_diagonal, None),
          "unflatten": (_unflatten, None), "t": (lambda x: F.transpose(x, 0, 1) if x.ndim == 2 else x, None),
          "view_as": (lambda x, other: F.reshape(x, other.shape), None),
          "expand_as": (lambda x, other: F.expand(x, other.shape), _no_repeats)}


# torch's functions that give views as their Tensor methods do (torch.transpose(x, 0, 1) is
# x.transpose(0, 1)): dtm.<name> is the method, so that a write through the result reaches x
VIEW_FUNCTIONS = ("reshape", "transpose", "permute", "squeeze", "unsqueeze", "flatten", "narrow", "split", "chunk",
                  "unbind", "select", "movedim", "moveaxis", "swapaxes", "swapdims", "diagonal", "t", "unflatten",
                  "detach")


def view_function(name: str) -> Callable:
    """dtm.<name>(x, ...): x.<name>(...), a view of x where the method gives one."""
    def function(input: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A002 - torch's name
        return getattr(F.as_tensor(input), name)(*args, **kwargs)
    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"torch.{name}: x.{name}(...), sharing x's elements where it is a view."
    return function


def install() -> None:
    """Attach the in-place operators and methods, and make the view ops' results views."""
    VIEW_HOOKS[0] = _views_changed
    for name, fn in _OPERATORS.items():
        setattr(Tensor, name, _inplace(fn, name))
    for name, fn in _METHODS.items():
        setattr(Tensor, name, _inplace(fn, name))
    for name, (fn, writable) in _VIEWS.items():
        setattr(Tensor, name, _view_method(fn, writable))
    Tensor.T = property(_view_method(lambda x: F.permute(x, tuple(reversed(range(x.ndim))))))
    Tensor.mT = property(_view_method(lambda x: F.transpose(x, -2, -1)))
    Tensor.__getitem__ = _getitem
    Tensor.__iter__ = _iter
    Tensor.__setitem__ = _setitem
    Tensor.data = property(_data, _set_data)
    Tensor.detach, Tensor.clone = _data, _clone
    Tensor.split, Tensor.chunk, Tensor.unbind = _split, _chunk, _unbind


install()
