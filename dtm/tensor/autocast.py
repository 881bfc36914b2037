"""Mixed precision as torch's CPU autocast: `dtm.autocast("cpu", dtype=dtm.bfloat16)`.

Inside the context (or a function decorated with it), the ops on torch's CPU autocast
lists behave as torch's do (torch/csrc/autograd/autocast_mode.cpp, CPU):
  - lower precision (`lower`): matmul (mm, bmm, `@`, einsum's products), linear (its bias
    too), conv1d/conv2d, scaled_dot_product_attention cast their float operands other than
    f64 to the autocast dtype and return it;
  - f32 (`fp32`): the losses (cross_entropy, nll_loss, mse_loss, l1_loss, binary cross
    entropy with and without logits) and prod compute in f32 from f16/bf16 operands;
  - every other op follows its operands' dtypes (f32 + bf16 promotes to f32).
The casts are ordinary, differentiable `cast` ops, recorded eagerly and inside dtm.jit
alike: the gradient of an f32 parameter read through one is f32 (its master weight stays
f32). dtm.jit keys its traces by the autocast state, so a function traced inside the
context is traced again outside it. The products of bf16 operands compile to the CPU's bf16
instructions where it has them (dtm.backends.cpu.c_bf16).

    with dtm.autocast("cpu", dtype=dtm.bfloat16):
        loss = loss_fn(model(x), y)       # products in bf16, the loss in f32
    loss.backward()                       # f32 gradients for the f32 weights
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from ..errors import ErrorCode, user_error as error
from .core import apply
from .dtypes import as_dtype, bfloat16, float16, float32, float64

DTYPES = (bfloat16, float16)  # the lower-precision dtypes CPU autocast offers (torch's too)


class _State(threading.local):
    dtype = None  # the autocast dtype in force on this thread, None outside every context


_STATE = _State()


def current():
    """The lower-precision dtype autocast casts to on this thread now, or None."""
    return _STATE.dtype


def is_autocast_enabled(device_type: str = "cpu") -> bool:
    return _STATE.dtype is not None


def get_autocast_dtype(device_type: str = "cpu"):
    return _STATE.dtype if _STATE.dtype is not None else bfloat16


class autocast:  # noqa: N801 - torch's name
    """torch.autocast for DTM's cpu backend: `autocast(device_type="cpu", dtype=bfloat16,
    enabled=True, cache_enabled=None)`, a context manager and a decorator. Only device type
    "cpu" exists (DTM's products run on the CPU); dtype is bfloat16 (the default) or float16."""

    def __init__(self, device_type: str = "cpu", dtype: Any = None, enabled: bool = True,
                 cache_enabled: bool | None = None):
        if not isinstance(device_type, str) or device_type != "cpu":
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"autocast: device_type must be 'cpu' (DTM runs its products on "
                        f"the CPU), found {device_type!r}")
        d = bfloat16 if dtype is None else as_dtype(dtype)
        if d not in DTYPES:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"autocast: CPU autocast supports dtype bfloat16 and float16, "
                        f"found {d}")
        self.device_type, self.fast_dtype, self.enabled = device_type, d, bool(enabled)
        self._prev: list = []

    def __enter__(self):
        self._prev.append(_STATE.dtype)
        _STATE.dtype = self.fast_dtype if self.enabled else None
        return self

    def __exit__(self, *exc):
        _STATE.dtype = self._prev.pop()
        return False

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(*a, **kw):
            with autocast(self.device_type, self.fast_dtype, self.enabled):
                return fn(*a, **kw)
        return wrapped


class _CpuAutocast(autocast):
    """torch.cpu.amp.autocast(enabled=True, dtype=bfloat16, cache_enabled=True): the device is the CPU."""

    def __init__(self, enabled: bool = True, dtype: Any = None, cache_enabled: bool | None = None):
        super().__init__("cpu", dtype, enabled, cache_enabled)


def _eligible(x: Any) -> bool:
    """A tensor autocast casts: a float one other than f64 (torch's rule)."""
    d = getattr(x, "dtype", None)
    return hasattr(x, "_type") and d is not None and d.is_float and d is not float64 and d.bits >= 16


def _cast_args(args: tuple, kwargs: dict, dtype) -> tuple[tuple, dict]:
    def one(x: Any) -> Any:
        if _eligible(x) and x.dtype is not dtype:
            return apply("cast", x, to=dtype)
        if isinstance(x, (list, tuple)) and any(_eligible(v) for v in x):
            return type(x)(one(v) for v in x)
        return x

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _casting(fn: Callable, to: Any) -> Callable:
    """fn, which inside autocast casts its float operands to `to` (None: the autocast dtype)
    first and runs with autocast off (as torch's dispatch does for the ops it calls)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        dtype = _STATE.dtype
        if dtype is None:
            return fn(*args, **kwargs)
        args, kwargs = _cast_args(args, kwargs, dtype if to is None else to)
        _STATE.dtype = None
        try:
            return fn(*args, **kwargs)
        finally:
            _STATE.dtype = dtype
    return wrapped


def lower(fn: Callable) -> Callable:
    """An op on torch's lower-precision list: inside autocast, its float operands (not f64)
    are cast to the autocast dtype."""
    return _casting(fn, None)


def fp32(fn: Callable) -> Callable:
    """An op on torch's f32 list: inside autocast, its f16 and bf16 operands are cast to f32."""
    return _casting(fn, float32)
