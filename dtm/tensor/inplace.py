"""In-place ops and views with torch's semantics on the lazy Tensor.

`x += 1`, `x.add_(1)`, `x[i] = v` change the tensor itself, so every reference to it sees
the new value; and a view (`view`, `reshape`, basic indexing, `transpose`, `permute`,
`squeeze`, `unsqueeze`, `flatten`, `narrow`, `expand`, `.T`) shares its base's elements: a
write through the view changes the base, and a write to the base or to another view of it
changes every view (spec 1.7, "In-place ops and views").

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
through it changes t as an optimizer's update does, outside autograd.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import numpy as np

from .. import functional as F
from ..errors import ErrorCode
from .core import STATE, Tensor, assign, error, is_grad_enabled, no_grad, weak_append
from .dtypes import bool_
from .creation import full_like, rand, randn, zeros_like


# --- views ----------------------------------------------------------------------------------

def _as_view(out: Tensor, x: Tensor, fn: Callable[[Tensor], Tensor], writable: bool = True,
             detached: bool = False) -> Tensor:
    """Mark `out`, which is fn(x), a view of x's root base (composing x's own view function).
    A detached view (`.data`, and views of it) writes to its base outside autograd."""
    if out is x:  # a view that changes nothing (a reshape to the same shape) is the tensor itself
        return out
    if x._view is not None:
        base, inner, ok, free = x._view
        out._view = (base, lambda b: fn(inner(b)), ok and writable, free or detached)
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


def _getitem(self: Tensor, index: Any) -> Tensor:
    out = F.getitem(self, index)
    return _as_view(out, self, lambda b: F.getitem(b, index)) if _basic(index) else out


def _data(self: Tensor) -> Tensor:
    """Tensor.data: the value without gradient history, sharing it as torch's does: an
    in-place write to it (p.data.mul_(0.5), p.data[0] = 1) changes the tensor, even a
    parameter outside no_grad, and records no gradient."""
    return _as_view(self.detach(), self, Tensor.detach, detached=True)


def _set_data(self: Tensor, value: Any) -> None:
    """`t.data = v`: t takes v's value in place, outside autograd. Unlike torch, in t's own
    dtype and shape (v broadcast to it)."""
    write(_data(self), value, "t.data = value")


# --- writes ---------------------------------------------------------------------------------

def _castable(src, dst) -> bool:
    """torch.can_cast for an in-place result: no float into an integer tensor, nothing but a
    bool into a bool one."""
    return not ((src.is_float and not dst.is_float) or (dst is bool_ and src is not bool_))


def write(t: Tensor, new: Tensor, op: str = "in-place op") -> Tensor:
    """t takes the value `new` in place (what an in-place op computed from it), as torch's
    in-place ops do: in t's dtype and shape, seen by every reference and every view."""
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
        _set(t, new, op)
        return t
    base, fn, writable, detached = t._view
    if not writable:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"{op}: this view repeats elements of its base (expand), so an "
                    "in-place write is ambiguous; torch refuses it too (clone() it first)")
    if fn is not Tensor.detach:  # (.data itself covers its whole base: no scatter)
        new = F._scatter_into(base, fn(F.reshape(F._iota((base.numel(),), 0), base.shape)), new)
    with no_grad() if detached else nullcontext():
        _set(base, new, op)
    return t


def _set(base: Tensor, new: Tensor, op: str) -> None:
    """The base (not a view) takes `new`; then each of its live views is its function of it."""
    if base._op is None and base.requires_grad and is_grad_enabled():
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"{op}: a leaf tensor that requires grad is used in an in-place "
                    "op (torch raises too); change it under `with dtm.no_grad():`")
    trace = STATE.trace
    if base._op is None and base._buffer is not None and (base.requires_grad or trace is not None):
        assign([(base, new)])  # a parameter keeps being a leaf; inside dtm.jit, the step's effect
        if trace is not None:  # the traced step may not read it, or a view of it, again
            trace.updated.update(id(v) for v in _live_views(base))
            return
    else:
        _rebind(base, new)
    for v in _live_views(base):
        _rebind(v, v._view[1](base))


def _live_views(base: Tensor) -> list[Tensor]:
    return [v for v in (r() for r in base._views or ()) if v is not None]


def _rebind(t: Tensor, new: Tensor) -> None:
    """t names `new`'s value from now on: ops that read t so far keep its old value."""
    if new._op is None:  # a leaf's value: an op of its own, so that t never shares its buffer
        new = F.apply("broadcast_to", new, shape=new.shape)
    t._snapshot()
    t._type, t._op, t._inputs, t._attrs, t._buffer = new._type, new._op, new._inputs, new._attrs, None
    t.requires_grad = new.requires_grad
    for i in new._inputs:
        i._add_user(t)


def _setitem(self: Tensor, index: Any, value: Any) -> None:
    write(self, F.setitem(self, index, value), "x[index] = value")


# --- the in-place methods -------------------------------------------------------------------

def _inplace(fn: Callable, name: str) -> Callable:
    def method(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return write(self, fn(self, *args, **kwargs), name)
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
          "transpose": (F.transpose, None), "narrow": (F.narrow, None), "expand": (F.expand, _no_repeats)}


def install() -> None:
    """Attach the in-place operators and methods, and make the view ops' results views."""
    for name, fn in _OPERATORS.items():
        setattr(Tensor, name, _inplace(fn, name))
    for name, fn in _METHODS.items():
        setattr(Tensor, name, _inplace(fn, name))
    for name, (fn, writable) in _VIEWS.items():
        setattr(Tensor, name, _view_method(fn, writable))
    Tensor.T = property(_view_method(lambda x: F.permute(x, tuple(reversed(range(x.ndim))))))
    Tensor.mT = property(_view_method(lambda x: F.transpose(x, -2, -1)))
    Tensor.__getitem__ = _getitem
    Tensor.__setitem__ = _setitem
    Tensor.data = property(_data, _set_data)


install()
