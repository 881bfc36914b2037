"""Initialising parameters in place, named and computed as in torch.nn.init.

    dtm.nn.init.xavier_uniform_(layer.weight)
    dtm.nn.init.trunc_normal_(emb.weight, std=0.02)

Each function gives `tensor` a new value under no_grad and returns it: a parameter stays
the same leaf (optimizers holding it see the new value). The fans and gains are torch's, so
the distributions are torch's; the numbers themselves come from DTM's generator
(`dtm.manual_seed`), not torch's.
"""

from __future__ import annotations

import math

from .. import functional as F
from ..errors import ErrorCode
from ..tensor import Tensor, error, float32, float64, full, no_grad, rand, randn


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """The gain torch recommends for `nonlinearity` (param: leaky_relu's negative slope)."""
    if nonlinearity in ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                        "conv_transpose3d", "sigmoid"):
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else param
        if isinstance(slope, bool) or not isinstance(slope, (int, float)):
            raise error(ErrorCode.ATTRIBUTE_TYPE, f"calculate_gain: negative_slope {slope!r} is not a number")
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise error(ErrorCode.ATTRIBUTE_VALUE, f"calculate_gain: unsupported nonlinearity {nonlinearity!r}")


def _calculate_fan_in_and_fan_out(tensor: Tensor) -> tuple[int, int]:
    """torch's fans: dim 1 is the inputs, dim 0 the outputs, and the dims after them (a
    convolution's kernel) multiply both."""
    if tensor.ndim < 2:
        raise error(ErrorCode.RANK_MISMATCH, f"fan in and fan out cannot be computed for a {tensor._type} "
                    "(it needs at least 2 dims)")
    receptive = math.prod(tensor.shape[2:])
    return tensor.shape[1] * receptive, tensor.shape[0] * receptive


def _fan(tensor: Tensor, mode: str) -> int:
    if mode not in ("fan_in", "fan_out"):
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"mode must be 'fan_in' or 'fan_out', found {mode!r}")
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return fan_in if mode == "fan_in" else fan_out


def _set(tensor: Tensor, value: Tensor) -> Tensor:
    with no_grad():
        tensor._set_value(F.cast(value, tensor.dtype).numpy())
    return tensor


def _draw_dtype(tensor: Tensor):
    """Random numbers are drawn in f64 for an f64 tensor, else in f32 and rounded once: a
    draw in [0, 1) made in f16 could round up to 1."""
    if not tensor.dtype.is_float:
        raise error(ErrorCode.DTYPE_MISMATCH, f"random initialisation needs a float tensor, found {tensor.dtype}")
    return float64 if tensor.dtype is float64 else float32


def uniform_(tensor: Tensor, a: float = 0.0, b: float = 1.0) -> Tensor:
    """Values drawn uniformly from [a, b)."""
    u = rand(*tensor.shape, dtype=_draw_dtype(tensor))
    return _set(tensor, F.add(F.mul(u, b - a), a))


def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0) -> Tensor:
    """Values drawn from N(mean, std^2)."""
    z = randn(*tensor.shape, dtype=_draw_dtype(tensor))
    return _set(tensor, F.add(F.mul(z, std), mean))


def constant_(tensor: Tensor, val: float) -> Tensor:
    return _set(tensor, full(tensor.shape, val, dtype=tensor.dtype))


def zeros_(tensor: Tensor) -> Tensor:
    return constant_(tensor, 0)


def ones_(tensor: Tensor) -> Tensor:
    return constant_(tensor, 1)


def xavier_uniform_(tensor: Tensor, gain: float = 1.0) -> Tensor:
    """U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)) (Glorot and Bengio, 2010)."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    a = math.sqrt(3.0) * gain * math.sqrt(2.0 / (fan_in + fan_out))
    return uniform_(tensor, -a, a)


def xavier_normal_(tensor: Tensor, gain: float = 1.0) -> Tensor:
    """N(0, std^2) with std = gain * sqrt(2 / (fan_in + fan_out))."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return normal_(tensor, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)))


def _kaiming_std(tensor: Tensor, a: float, mode: str, nonlinearity: str) -> float:
    return calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode))


def kaiming_uniform_(tensor: Tensor, a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu") -> Tensor:
    """U(-bound, bound) with bound = gain * sqrt(3 / fan) (He et al., 2015); with torch's
    defaults and a = sqrt(5) this is nn.Linear's own initialisation."""
    if tensor.numel() == 0:  # torch warns and leaves an empty tensor alone
        return tensor
    bound = math.sqrt(3.0) * _kaiming_std(tensor, a, mode, nonlinearity)
    return uniform_(tensor, -bound, bound)


def kaiming_normal_(tensor: Tensor, a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu") -> Tensor:
    """N(0, std^2) with std = gain / sqrt(fan)."""
    if tensor.numel() == 0:
        return tensor
    return normal_(tensor, 0.0, _kaiming_std(tensor, a, mode, nonlinearity))


def _erfinv(y: Tensor) -> Tensor:
    """The inverse error function on (-1, 1): Winitzki's closed-form estimate (relative
    error about 2e-3), then two Newton steps on erf, which the IR has, to full precision."""
    w = F.log(F.sub(1.0, F.mul(y, y)))
    t = F.add(2 / (math.pi * 0.147), F.mul(w, 0.5))
    x = F.mul(F.sign(y), F.sqrt(F.sub(F.sqrt(F.sub(F.mul(t, t), F.div(w, 0.147))), t)))
    for _ in range(2):
        slope = F.mul(F.exp(F.neg(F.mul(x, x))), 2 / math.sqrt(math.pi))
        x = F.sub(x, F.div(F.sub(F.erf(x), y), slope))
    return x


def trunc_normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0) -> Tensor:
    """N(mean, std^2) restricted to [a, b], drawn as torch draws it: a uniform draw between
    the normal CDF's values at a and b, mapped back through the inverse CDF."""
    if not a < b:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"trunc_normal_: a must be less than b, found a={a}, b={b}")
    lo, hi = (0.5 * (1 + math.erf((v - mean) / (std * math.sqrt(2.0)))) for v in (a, b))
    u = rand(*tensor.shape, dtype=_draw_dtype(tensor))
    y = F.add(F.mul(u, 2 * (hi - lo)), 2 * lo - 1)  # uniform in [2 lo - 1, 2 hi - 1)
    x = F.add(F.mul(_erfinv(y), std * math.sqrt(2.0)), mean)
    return _set(tensor, F.clamp(x, a, b))


__all__ = ["calculate_gain", "uniform_", "normal_", "constant_", "zeros_", "ones_", "xavier_uniform_",
           "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_"]
