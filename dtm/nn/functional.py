"""torch.nn.functional for DTM: the tensor ops (re-exported from dtm.functional) plus the
losses and layers that are compositions of them."""

from __future__ import annotations

import numpy as np

from ..errors import ErrorCode
from ..functional import (dropout, gelu, layer_norm, linear, log_softmax, pad, relu, scaled_dot_product_attention,
                          sigmoid, silu, softmax, tanh, take)
from .. import functional as F
from ..tensor import Tensor, arange, error, int64
from ..tensor.extra_ops import norm


def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Tensor:
    """Mean negative log-likelihood of class indices `target` under softmax(`logits`).
    logits: [N, C] (or [C]); target: [N] integer class ids; entries equal to
    `ignore_index` count neither in the sum nor in the mean. With `label_smoothing` e the
    target is the mix (1 - e) * one_hot + e / C, computed as torch does: the loss is
    (1 - e) * nll + e / C * (-sum of the log-probabilities), each reduced alike."""
    if not 0.0 <= label_smoothing <= 1.0:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"cross_entropy: label_smoothing must be in [0, 1], found {label_smoothing}")
    if logits.ndim == 1:
        logits, target = F.unsqueeze(logits, 0), F.reshape(target, (1,))
    if logits.ndim != 2 or target.ndim != 1 or target.shape[0] != logits.shape[0]:
        raise error(ErrorCode.SHAPE_MISMATCH, f"cross_entropy: expected logits [N, C] and target [N], "
                    f"found {logits._type} and {target._type}")
    if not target.dtype.is_int:
        raise error(ErrorCode.DTYPE_MISMATCH, f"cross_entropy: target must hold integer class ids, found {target.dtype}")
    n_classes = logits.shape[1]

    message = (f"cross_entropy: target {{value}} is out of bounds for {n_classes} classes "
               f"(expected 0 <= target < {n_classes}, or ignore_index={ignore_index})")

    def fault(v: np.ndarray) -> str | None:  # as torch: a class id in [0, C), no wrapping
        bad = ((v < 0) | (v >= n_classes)) & (v != ignore_index)
        return message.replace("{value}", str(v[bad].flat[0])) if bad.any() else None

    def mask(t: Tensor) -> Tensor | None:
        outside = F._outside(t, 0, n_classes)
        return None if outside is None else F.logical_and(outside, F.ne(t, ignore_index))
    target = F._checked(target, F.ValueCheck(ErrorCode.INDEX_OUT_OF_RANGE, fault, mask, message))
    logp = log_softmax(logits, dim=-1)
    keep = target != ignore_index
    safe = F.where(keep, target, 0)
    picked = F.squeeze(F.gather(logp, 1, F.unsqueeze(safe, 1)), 1)
    losses = F.neg(F.where(keep, picked, 0.0))
    if label_smoothing:
        smooth = F.neg(F.where(keep, F.sum(logp, -1), 0.0))
        losses = F.add(F.mul(losses, 1.0 - label_smoothing), F.mul(smooth, label_smoothing / logits.shape[1]))
    if reduction == "none":
        return losses
    total = F.sum(losses)
    if reduction == "sum":
        return total
    if reduction != "mean":
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"cross_entropy: reduction must be 'mean', 'sum' or 'none', found {reduction!r}")
    return F.div(total, F.sum(F.cast(keep, logits.dtype)))


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


def mse_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    if reduction not in ("mean", "sum", "none"):
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"mse_loss: reduction must be 'mean', 'sum' or 'none', found {reduction!r}")
    d = F.sub(input, target)
    sq = F.mul(d, d)
    return F.mean(sq) if reduction == "mean" else F.sum(sq) if reduction == "sum" else sq


__all__ = ["cross_entropy", "dropout", "embedding", "mse_loss", "gelu", "layer_norm", "linear", "log_softmax",
           "pad", "relu", "scaled_dot_product_attention", "sigmoid", "silu", "softmax", "tanh", "one_hot", "normalize"]
