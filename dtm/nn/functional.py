"""torch.nn.functional for DTM: the tensor ops (re-exported from dtm.functional) plus the
losses and layers that are compositions of them."""

from __future__ import annotations

import numpy as np

from ..errors import ErrorCode
from ..functional import (gelu, layer_norm, linear, log_softmax, pad, relu, scaled_dot_product_attention, sigmoid,
                          silu, softmax, tanh, take)
from .. import functional as F
from ..tensor import Tensor, error, rand


def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Tensor:
    """Mean negative log-likelihood of class indices `target` under softmax(`logits`).
    logits: [N, C] (or [C]); target: [N] integer class ids; entries equal to
    `ignore_index` count neither in the sum nor in the mean."""
    if label_smoothing:
        raise error(ErrorCode.ATTRIBUTE_VALUE, "cross_entropy: label_smoothing is not supported")
    if logits.ndim == 1:
        logits, target = F.unsqueeze(logits, 0), F.reshape(target, (1,))
    if logits.ndim != 2 or target.ndim != 1 or target.shape[0] != logits.shape[0]:
        raise error(ErrorCode.SHAPE_MISMATCH, f"cross_entropy: expected logits [N, C] and target [N], "
                    f"found {logits.type} and {target.type}")
    if not target.dtype.is_int:
        raise error(ErrorCode.DTYPE_MISMATCH, f"cross_entropy: target must hold integer class ids, found {target.dtype}")
    n_classes = logits.shape[1]

    def fault(v: np.ndarray) -> str | None:  # as torch: a class id in [0, C), no wrapping
        bad = ((v < 0) | (v >= n_classes)) & (v != ignore_index)
        return (f"cross_entropy: target {v[bad].flat[0]} is out of bounds for {n_classes} classes "
                f"(expected 0 <= target < {n_classes}, or ignore_index={ignore_index})") if bad.any() else None
    F._check_values(target, ErrorCode.INDEX_OUT_OF_RANGE, fault)
    logp = log_softmax(logits, dim=-1)
    keep = target != ignore_index
    safe = F.where(keep, target, 0)
    picked = F.squeeze(F.gather(logp, 1, F.unsqueeze(safe, 1)), 1)
    losses = F.neg(F.where(keep, picked, 0.0))
    if reduction == "none":
        return losses
    total = F.sum(losses)
    if reduction == "sum":
        return total
    if reduction != "mean":
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"cross_entropy: reduction must be 'mean', 'sum' or 'none', found {reduction!r}")
    return F.div(total, F.sum(F.cast(keep, logits.dtype)))


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """Zero each element with probability p and scale the rest by 1 / (1 - p)."""
    if not training or p == 0.0:
        return x
    if not 0.0 <= p < 1.0:
        raise error(ErrorCode.ATTRIBUTE_VALUE, f"dropout: p must be in [0, 1), found {p}")
    keep = rand(*x.shape) >= p
    return F.where(keep, F.mul(x, 1.0 / (1.0 - p)), 0.0)


def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    """Rows of `weight` at `ids` (any shape of integer ids)."""
    return take(weight, ids, 0, wrap=False)  # torch: a negative id is out of range


def mse_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    d = F.sub(input, target)
    sq = F.mul(d, d)
    return F.mean(sq) if reduction == "mean" else F.sum(sq) if reduction == "sum" else sq


__all__ = ["cross_entropy", "dropout", "embedding", "mse_loss", "gelu", "layer_norm", "linear", "log_softmax",
           "pad", "relu", "scaled_dot_product_attention", "sigmoid", "silu", "softmax", "tanh"]
