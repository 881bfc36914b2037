"""torch.nn.functional for DTM: the tensor ops (re-exported from dtm.functional) plus the
losses and layers that are compositions of them."""

from __future__ import annotations

import itertools
import math

import numpy as np

from ..errors import ErrorCode
from ..functional import (dropout, gelu, layer_norm, linear, log_softmax, pad, relu, scaled_dot_product_attention,
                          sigmoid, silu, softmax, tanh, take)
from .. import functional as F
from ..tensor import Tensor, arange, error, int64, no_grad, tensor as as_tensor
from ..tensor.extra_ops import norm
from ..tensor import autocast as _autocast  # torch's CPU autocast lists


@_autocast.fp32
def cross_entropy(logits: Tensor, target: Tensor, weight: Tensor | None = None, size_average=None,
                  ignore_index: int = -100, reduce=None, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Tensor:
    """torch.nn.functional.cross_entropy, in torch's argument order: mean negative
    log-likelihood of class indices `target` under softmax(`logits`) over the class dim 1:
    logits [N, C] (or [C], or [N, C, d1, ...] with target [N, d1, ...]), target integer
    class ids; entries equal to `ignore_index` count neither in the sum nor in the mean. A
    class `weight` [C] scales each row's loss by its class's weight, and the mean divides by
    the weights of the rows counted. With `label_smoothing` e the target is the mix
    (1 - e) * one_hot + e / C, computed as torch does: the loss is (1 - e) * nll + e / C *
    (-sum over classes of weight * log-probability), each reduced alike. torch's deprecated
    size_average and reduce are refused (use `reduction`)."""
    _no_legacy_reduction("cross_entropy", size_average, reduce)
    if not 0.0 <= label_smoothing <= 1.0:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"cross_entropy: label_smoothing must be in [0, 1], found {label_smoothing}")
    logp, target, shape = _class_rows("cross_entropy", log_softmax(logits, dim=1 if logits.ndim > 1 else 0), target,
                                      ignore_index)
    weight = _class_weight("cross_entropy", weight, logp)
    keep = target != ignore_index
    losses, counted = _picked_nll(logp, target, keep, weight)
    if label_smoothing:
        per_class = logp if weight is None else F.mul(logp, weight)
        smooth = F.neg(F.where(keep, F.sum(per_class, -1), 0.0))
        losses = F.add(F.mul(losses, 1.0 - label_smoothing), F.mul(smooth, label_smoothing / logp.shape[1]))
    return _reduced("cross_entropy", losses, counted, reduction, shape)


def _no_legacy_reduction(name: str, size_average, reduce) -> None:
    """torch's deprecated size_average / reduce arguments: refused, naming `reduction`."""
    if size_average is not None or reduce is not None:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"{name}: size_average and reduce are deprecated in torch and not "
                    "taken here; pass reduction='mean', 'sum' or 'none'")


def _class_weight(name: str, weight, logp: Tensor) -> Tensor | None:
    """A loss's class weight: None, or a float tensor [C] in the log-probabilities' dtype."""
    if weight is None:
        return None
    weight = as_tensor(weight)
    if weight.shape != (logp.shape[1],) or not weight.dtype.is_float:
        raise error(ErrorCode.SHAPE_MISMATCH, f"{name}: weight must be a float tensor [{logp.shape[1]}] (one per "
                    f"class), found {weight._type}")
    return F.cast(weight, logp.dtype)


@_autocast.fp32
def nll_loss(input: Tensor, target: Tensor, weight: Tensor | None = None, size_average=None,
             ignore_index: int = -100, reduce=None, reduction: str = "mean") -> Tensor:
    """torch.nn.functional.nll_loss, in torch's argument order: -weight[t] * input[t] for each
    row's class id t, over log-probabilities `input` shaped as cross_entropy's logits. The
    mean divides by the sum of the weights of the rows counted (those whose target is not
    `ignore_index`)."""
    _no_legacy_reduction("nll_loss", size_average, reduce)
    logp, target, shape = _class_rows("nll_loss", input, target, ignore_index)
    weight = _class_weight("nll_loss", weight, logp)
    losses, counted = _picked_nll(logp, target, target != ignore_index, weight)
    return _reduced("nll_loss", losses, counted, reduction, shape)


def _class_rows(name: str, input: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor, tuple]:
    """input [N, C, d1, ...] (or [C]) and target [N, d1, ...] (or []) as rows [M, C] and
    ids [M], the class dim moved last, the ids checked as torch checks them (E0808); and
    target's shape, for an unreduced loss."""
    shape = target.shape
    if input.ndim == 1:
        input, target = F.unsqueeze(input, 0), F.reshape(target, (1,))
    if input.ndim < 2 or target.shape != input.shape[:1] + input.shape[2:]:
        raise error(ErrorCode.SHAPE_MISMATCH, f"{name}: expected input [N, C, d1, ...] and target [N, d1, ...], "
                    f"found {input._type} and {target._type}")
    if not target.dtype.is_int:
        raise error(ErrorCode.DTYPE_MISMATCH, f"{name}: target must hold integer class ids, found {target.dtype}")
    n_classes = input.shape[1]
    if input.ndim > 2:
        input = F.reshape(F.permute(input, (0, *range(2, input.ndim), 1)), (-1, n_classes))
    message = (f"{name}: target {{value}} is out of bounds for {n_classes} classes "
               f"(expected 0 <= target < {n_classes}, or ignore_index={ignore_index})")

    def fault(v: np.ndarray) -> str | None:  # as torch: a class id in [0, C), no wrapping
        bad = ((v < 0) | (v >= n_classes)) & (v != ignore_index)
        return message.replace("{value}", str(v[bad].flat[0])) if bad.any() else None

    def mask(t: Tensor) -> Tensor | None:
        outside = F._outside(t, 0, n_classes)
        return None if outside is None else F.logical_and(outside, F.ne(t, ignore_index))
    target = F._checked(F.reshape(target, (-1,)), F.ValueCheck(ErrorCode.INDEX_OUT_OF_RANGE, fault, mask, message))
    return input, target, shape


def _picked_nll(logp: Tensor, target: Tensor, keep: Tensor, weight: Tensor | None) -> tuple[Tensor, Tensor]:
    """Each row's -logp[target] (times weight[target]; 0 where not `keep`), and the weight
    each row counts with in a mean."""
    safe = F.where(keep, target, 0)
    # `where`, not a product with 0: an ignored row's -inf log-probability must not give NaN
    picked = F.where(keep, F.neg(F.squeeze(F.gather(logp, 1, F.unsqueeze(safe, 1)), 1)), 0.0)
    if weight is None:
        return picked, F.cast(keep, logp.dtype)
    counted = F.where(keep, take(weight, safe, 0), 0.0)
    return F.mul(picked, counted), counted


def _reduced(name: str, losses: Tensor, counted: Tensor, reduction: str, shape: tuple) -> Tensor:
    """A loss per row reduced as torch's `reduction` says: 'none' (in target's shape),
    'sum', or 'mean' (divided by the rows' total weight)."""
    _check_reduction(name, reduction)
    if reduction == "none":
        return F.reshape(losses, shape)
    total = F.sum(losses)
    return total if reduction == "sum" else F.div(total, F.sum(counted))


def _check_reduction(name: str, reduction: str) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"{name}: reduction must be 'mean', 'sum' or 'none', "
                    f"found {reduction!r}")


def embedding(ids: Tensor, weight: Tensor, padding_idx: int | None = None) -> Tensor:
    """Rows of `weight` at `ids` (any shape of integer ids). The row at `padding_idx`
    receives no gradient: where an id is the padding index, the row is read from the
    detached weight."""
    rows = take(weight, ids, 0, wrap=False)  # torch: a negative id is out of range
    if padding_idx is None:
        return rows
    if not -weight.shape[0] <= padding_idx < weight.shape[0]:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"embedding: padding_idx {padding_idx} is out of range for "
                    f"{weight.shape[0]} embeddings")
    pad = F.unsqueeze(F.eq(F.as_tensor(ids), padding_idx % weight.shape[0]), -1)
    return F.where(pad, take(weight.detach(), ids, 0, wrap=False), rows)


def one_hot(tensor: Tensor, num_classes: int = -1) -> Tensor:
    """int64 [..., num_classes]: 1 at each id's class, else 0. With num_classes=-1 the
    classes are 0..max(tensor), which reads the ids (as torch does); a given num_classes
    keeps it lazy, and an id outside [0, num_classes) raises E0808 as torch does (when the
    program runs, for ids it computes)."""
    if not tensor.dtype.is_int:
        raise error(ErrorCode.DTYPE_MISMATCH, f"one_hot: expected integer class ids, found {tensor.dtype}")
    if num_classes == -1:
        ids = tensor.numpy()
        if not ids.size:
            raise error(ErrorCode.ATTRIBUTE_VALUE, "one_hot: cannot infer num_classes from an empty tensor")
        if ids.min() < 0:
            raise error(ErrorCode.ATTRIBUTE_VALUE, "one_hot: class ids must be non-negative")
        num_classes = int(ids.max()) + 1
    elif num_classes < 0:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"one_hot: num_classes must be -1 or non-negative, found {num_classes}")
    else:
        tensor = F._checked(tensor, F._index_check(f"one_hot with {num_classes} classes", num_classes, False))
    return F.cast(F.eq(F.unsqueeze(tensor, -1), arange(num_classes, dtype=int64)), int64)


def normalize(input: Tensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12) -> Tensor:
    """input / max(||input||_p, eps) along `dim`: unit vectors, except that vectors shorter
    than eps are scaled by 1 / eps rather than blown up."""
    return F.div(input, F.clamp(norm(input, p, dim, keepdim=True), min=eps))


def batch_norm(input: Tensor, running_mean: Tensor | None, running_var: Tensor | None, weight: Tensor | None = None,
               bias: Tensor | None = None, training: bool = False, momentum: float | Tensor = 0.1,
               eps: float = 1e-5) -> Tensor:
    """torch.nn.functional.batch_norm of [N, C, *] per channel (dim 1). Training normalises
    by the batch's mean and biased variance and, where running stats are given, blends the
    batch's mean and unbiased variance into them in place with weight `momentum` (a tensor
    for a cumulative average, so a jitted step recomputes it); otherwise the running stats
    normalise."""
    if input.ndim < 2:
        raise error(ErrorCode.SHAPE_MISMATCH, f"batch_norm: expected [N, C, *] input, found {input._type}")
    axes = (0,) + tuple(range(2, input.ndim))
    if training:
        mean, var = F.mean(input, axes, keepdim=True), F.var(input, axes, keepdim=True, correction=0)
        if running_mean is not None:
            _update_running_stats(running_mean, running_var, mean, var, input.numel() // input.shape[1], momentum)
    elif running_mean is None or running_var is None:
        raise error(ErrorCode.UNDEFINED_VALUE, "batch_norm: running_mean and running_var are needed unless training")
    else:
        mean, var = _per_channel(running_mean, input.ndim), _per_channel(running_var, input.ndim)
    return _channel_affine(F.mul(F.sub(input, mean), F.rsqrt(F.add(var, eps))), weight, bias)


def _update_running_stats(running_mean: Tensor, running_var: Tensor, mean: Tensor, var: Tensor, n: int,
                          momentum: float | Tensor) -> None:
    """running = (1 - momentum) running + momentum batch, in place and outside autograd (as
    torch); the variance blended in is the unbiased one, from the `n` values per channel."""
    if n < 2:
        raise error(ErrorCode.SHAPE_MISMATCH, f"batch_norm: expected more than 1 value per channel when training, "
                    f"found {n}")
    keep = 1.0 - momentum  # a float or a tensor, as momentum is
    unbiased = F.mul(F.reshape(var, (-1,)), n / (n - 1))
    # one write each: inside dtm.jit a second in-place op would read the updated buffer (E0207)
    with no_grad():
        running_mean.copy_(F.add(F.mul(running_mean, keep), F.mul(F.reshape(mean, (-1,)), momentum)))
        running_var.copy_(F.add(F.mul(running_var, keep), F.mul(unbiased, momentum)))


def group_norm(input: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """torch.nn.functional.group_norm of [N, C, *]: the channels split into `num_groups`
    consecutive groups, each sample's group normalised by its own mean and biased variance,
    then the per-channel affine."""
    if input.ndim < 2 or input.shape[1] % num_groups:
        raise error(ErrorCode.SHAPE_MISMATCH, f"group_norm: expected [N, C, *] input with C divisible by "
                    f"num_groups={num_groups}, found {input._type}")
    grouped = F.reshape(input, (input.shape[0], num_groups, -1))
    mean, var = F.mean(grouped, -1, keepdim=True), F.var(grouped, -1, keepdim=True, correction=0)
    normed = F.reshape(F.mul(F.sub(grouped, mean), F.rsqrt(F.add(var, eps))), input.shape)
    return _channel_affine(normed, weight, bias)


def rms_norm(input: Tensor, normalized_shape, weight: Tensor | None = None, eps: float | None = None) -> Tensor:
    """torch.nn.functional.rms_norm: input / sqrt(mean(input^2) + eps) over the trailing
    `normalized_shape` dims, times weight. eps=None is torch's default, the input dtype's
    machine epsilon."""
    shape = F._normalized_shape("rms_norm", input, normalized_shape)
    if eps is None:
        import ml_dtypes  # here: importing it costs half a second, and `import dtm` does not (test_ir_roundtrip)

        eps = float(ml_dtypes.finfo(F.numpy_dtype(input.dtype)).eps)  # ml_dtypes' finfo knows bf16 too
    axes = tuple(range(input.ndim - len(shape), input.ndim))
    normed = F.mul(input, F.rsqrt(F.add(F.mean(F.mul(input, input), axes, keepdim=True), eps)))
    return normed if weight is None else F.mul(normed, weight)


def _per_channel(t: Tensor, ndim: int) -> Tensor:
    """A [C] tensor shaped [1, C, 1, ...] to broadcast over an ndim-d [N, C, *] input."""
    return F.reshape(t, (1, -1) + (1,) * (ndim - 2))


def _channel_affine(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """x * weight + bias with [C] weight and bias applied along x's channel dim 1."""
    if weight is not None:
        x = F.mul(x, _per_channel(weight, x.ndim))
    return x if bias is None else F.add(x, _per_channel(bias, x.ndim))


@_autocast.lower
def conv1d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1,
           groups: int = 1) -> Tensor:
    """torch.nn.functional.conv1d: input [N, C_in, L] (or unbatched [C_in, L]), weight
    [C_out, C_in / groups, k], bias [C_out]; stride, padding and dilation an int or a
    1-tuple, padding also 'valid' (none) or 'same' (the output as long as the input,
    stride 1). Composed of pad, strided slices and a matrix product (see `_conv`)."""
    return _conv("conv1d", 1, input, weight, bias, stride, padding, dilation, groups)


@_autocast.lower
def conv2d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1,
           groups: int = 1) -> Tensor:
    """torch.nn.functional.conv2d: input [N, C_in, H, W] (or unbatched [C_in, H, W]),
    weight [C_out, C_in / groups, kH, kW], bias [C_out]; stride, padding and dilation an
    int or a pair, padding also 'valid' or 'same' (stride 1). Composed as conv1d is."""
    return _conv("conv2d", 2, input, weight, bias, stride, padding, dilation, groups)


def _conv_tuple(name: str, what: str, value, dims: int) -> tuple[int, ...]:
    """A convolution's int-or-sequence argument (stride, padding, dilation, kernel_size)
    as `dims` ints, refused as torch refuses a sequence of another length."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return (int(value),) * dims
    if isinstance(value, (tuple, list)) and len(value) == dims and all(isinstance(v, (int, np.integer)) for v in value):
        return tuple(int(v) for v in value)
    shown = list(value) if isinstance(value, (tuple, list)) else value
    raise error(ErrorCode.ATTRIBUTE_VALUE, f"{name}: expected {what} to be a single integer value or a list of {dims} "
                f"values to match the convolution dimensions, but got {what}={shown}")


def _same_padding(dilation: tuple[int, ...], kernel: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """padding='same' as torch pads it: d * (k - 1) in all per dim, the odd one on the right."""
    total = [d * (k - 1) for d, k in zip(dilation, kernel)]
    return tuple(t // 2 for t in total), tuple(t - t // 2 for t in total)


def _conv(name: str, dims: int, input: Tensor, weight: Tensor, bias: Tensor | None, stride, padding, dilation,
          groups: int) -> Tensor:
    """An N-d convolution (cross-correlation, as torch's) as im2col and one product: the
    zero-padded input's window at each of the k1 * k2 * ... kernel offsets is a strided
    slice [N, C, *out]; stacked they are the columns [N, groups, C/groups * K, L], which
    the weight [groups, C_out/groups, C/groups * K] multiplies. Everything is a movement op
    or a matmul, so autodiff differentiates it and the compiler fuses it with no conv op
    in the IR; the slices' gradients are pads that sum back into the input's gradient."""
    stride, dilation = _conv_tuple(name, "stride", stride, dims), _conv_tuple(name, "dilation", dilation, dims)
    if any(s <= 0 for s in stride):
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"{name}: non-positive stride is not supported, found {list(stride)}")
    if any(d <= 0 for d in dilation):
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"{name}: dilation should be greater than zero, but got "
                    f"{list(dilation)}")
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups <= 0:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"{name}: non-positive groups is not supported, found {groups!r}")
    if not isinstance(input, Tensor) or not isinstance(weight, Tensor):
        raise error(ErrorCode.ATTRIBUTE_TYPE, f"{name}: input and weight must be tensors, found "
                    f"{type(input).__name__} and {type(weight).__name__}")
    if input.ndim not in (dims + 1, dims + 2):
        raise error(ErrorCode.RANK_MISMATCH, f"Expected {dims + 1}D (unbatched) or {dims + 2}D (batched) input to "
                    f"{name}, but got input of size: {list(input.shape)}")
    if weight.ndim != dims + 2:
        raise error(ErrorCode.RANK_MISMATCH, f"{name}: expected a {dims + 2}-D weight [C_out, C_in / groups, "
                    f"{', '.join('k' * dims)}], but got weight of size {list(weight.shape)}")
    dtype = F.result_type(input, weight)
    if not dtype.is_float:
        raise error(ErrorCode.DTYPE_MISMATCH, f"{name}: expected floating-point input and weight, found "
                    f"{input.dtype} and {weight.dtype}")
    unbatched = input.ndim == dims + 1
    x = F.unsqueeze(F.cast(input, dtype), 0) if unbatched else F.cast(input, dtype)
    w = F.cast(weight, dtype)
    n, c = x.shape[:2]
    out_c, c_group = w.shape[:2]
    kernel = w.shape[2:]
    if out_c % groups:
        raise error(ErrorCode.SHAPE_MISMATCH, f"Given groups={groups}, expected weight to be divisible by {groups} at "
                    f"dimension 0, but got weight of size {list(w.shape)} instead")
    if c != c_group * groups:
        raise error(ErrorCode.SHAPE_MISMATCH, f"Given groups={groups}, weight of size {list(w.shape)}, expected "
                    f"input{list(x.shape)} to have {c_group * groups} channels, but got {c} channels instead")
    if bias is not None and tuple(bias.shape) != (out_c,):
        raise error(ErrorCode.SHAPE_MISMATCH, f"Given weight of size {list(w.shape)}, expected bias to be "
                    f"1-dimensional with {out_c} elements, but got bias of size {list(bias.shape)} instead")
    if isinstance(padding, str):
        if padding == "valid":
            low = high = (0,) * dims
        elif padding == "same":
            if any(s != 1 for s in stride):
                raise error(ErrorCode.ATTRIBUTE_VALUE, f"{name}: padding='same' is not supported for strided "
                            f"convolutions, found stride={list(stride)}")
            low, high = _same_padding(dilation, kernel)
        else:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"{name}: Invalid padding string: {padding!r}, should be one of "
                        "'valid', 'same'")
    else:
        low = high = _conv_tuple(name, "padding", padding, dims)
        if any(p < 0 for p in low):
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"{name}: negative padding is not supported, found {list(low)}")
    spatial = tuple(s + lo + hi for s, lo, hi in zip(x.shape[2:], low, high))
    reach = tuple(d * (k - 1) + 1 for d, k in zip(dilation, kernel))  # the dilated kernel's extent
    if any(r > s for r, s in zip(reach, spatial)):
        raise error(ErrorCode.SHAPE_MISMATCH, f"{name}: Calculated padded input size per channel: "
                    f"({' x '.join(map(str, spatial))}). Kernel size: ({' x '.join(map(str, reach))}). "
                    "Kernel size can't be greater than actual input size")
    out = tuple((s - r) // st + 1 for s, r, st in zip(spatial, reach, stride))
    x = F.pad(x, [p for lo, hi in zip(reversed(low), reversed(high)) for p in (lo, hi)])
    windows = []
    for offsets in itertools.product(*(range(k) for k in kernel)):  # row-major, as the weight's kernel dims
        win = x
        for a, (o, d, st, m) in enumerate(zip(offsets, dilation, stride, out)):
            win = F._slice(win, 2 + a, o * d, o * d + (m - 1) * st + 1, st)
        windows.append(win)
    k, length = math.prod(kernel), math.prod(out)
    cols = F.reshape(F.stack(windows, 2), (n, groups, c_group * k, length))
    y = F.matmul(F.reshape(w, (groups, out_c // groups, c_group * k)), cols)  # [N, groups, C_out/groups, L]
    y = F.reshape(y, (n, out_c) + out)
    if bias is not None:
        y = F.add(y, _per_channel(F.cast(bias, dtype), y.ndim))
    return F.squeeze(y, 0) if unbatched else y


@_autocast.fp32
def mse_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """torch.nn.functional.mse_loss: (input - target)^2, reduced."""
    d = F.sub(input, target)
    return _elementwise("mse_loss", F.mul(d, d), reduction)


@_autocast.fp32
def l1_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """torch.nn.functional.l1_loss: |input - target|, reduced."""
    return _elementwise("l1_loss", F.abs(F.sub(input, target)), reduction)


@_autocast.fp32
def binary_cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None, size_average=None,
                         reduce=None, reduction: str = "mean") -> Tensor:
    """torch.nn.functional.binary_cross_entropy of probabilities `input`: -(t log x +
    (1 - t) log(1 - x)), each log clamped to >= -100 as torch does, so that x = 0 or 1
    gives a finite loss."""
    _no_legacy_reduction("binary_cross_entropy", size_average, reduce)
    log_x = F.clamp(F.log(input), min=-100.0)
    log_1mx = F.clamp(F.log(F.sub(1.0, input)), min=-100.0)
    losses = F.neg(F.add(F.mul(target, log_x), F.mul(F.sub(1.0, target), log_1mx)))
    return _elementwise("binary_cross_entropy", losses if weight is None else F.mul(losses, weight), reduction)


@_autocast.fp32
def binary_cross_entropy_with_logits(input: Tensor, target: Tensor, weight: Tensor | None = None, size_average=None,
                                     reduce=None, reduction: str = "mean", pos_weight: Tensor | None = None) -> Tensor:
    """torch.nn.functional.binary_cross_entropy_with_logits: binary_cross_entropy of
    sigmoid(input), in torch's stable form (1 - t) x + w_t (log(1 + e^-|x|) + max(-x, 0)),
    w_t = 1 + (pos_weight - 1) t weighing the positive term, so no exp overflows."""
    _no_legacy_reduction("binary_cross_entropy_with_logits", size_average, reduce)
    softplus_neg = F.add(F.log(F.add(1.0, F.exp(F.neg(F.abs(input))))), F.relu(F.neg(input)))
    log_weight = 1.0 if pos_weight is None else F.add(F.mul(F.sub(pos_weight, 1.0), target), 1.0)
    losses = F.add(F.mul(F.sub(1.0, target), input), F.mul(log_weight, softplus_neg))
    return _elementwise("binary_cross_entropy_with_logits", losses if weight is None else F.mul(losses, weight),
                        reduction)


def _elementwise(name: str, losses: Tensor, reduction: str) -> Tensor:
    """An elementwise loss reduced as torch's `reduction` says: 'mean', 'sum' or 'none'."""
    _check_reduction(name, reduction)
    return F.mean(losses) if reduction == "mean" else F.sum(losses) if reduction == "sum" else losses


__all__ = ["cross_entropy", "nll_loss", "l1_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
           "dropout", "embedding", "mse_loss", "gelu", "layer_norm", "linear", "log_softmax",
           "pad", "relu", "scaled_dot_product_attention", "sigmoid", "silu", "softmax", "tanh", "one_hot", "normalize",
           "batch_norm", "group_norm", "rms_norm", "conv1d", "conv2d"]
