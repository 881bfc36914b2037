"""Choosing the next token from a batch of logits rows, by the rules of Hugging Face
transformers' `generate(do_sample=True)`: TemperatureLogitsWarper, then TopKLogitsWarper,
then TopPLogitsWarper, then one draw from the softmax of what is left.

It runs on the host in numpy: a decoding step hands back one row of logits per sequence,
and sorting a row of 50257 floats there costs less than a round trip through a compiled plan
(DTM has no sort op to do it on the device)."""

from __future__ import annotations

import numpy as np

from ..errors import DTMError, ErrorCode


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Refuse the values transformers' warpers refuse (E0306), before any decoding step runs."""
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature > 0):
        raise DTMError(ErrorCode.ATTRIBUTE_VALUE, f"generate: temperature must be a number > 0, found {temperature!r} "
                       "(for greedy decoding, use do_sample=False)")
    if top_k is not None and (not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or top_k < 0):
        raise DTMError(ErrorCode.ATTRIBUTE_VALUE, f"generate: top_k must be an integer >= 0 (0: no top-k), "
                       f"found {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 <= top_p <= 1.0):
        raise DTMError(ErrorCode.ATTRIBUTE_VALUE, f"generate: top_p must be in [0, 1], found {top_p!r}")


def warp_logits(logits: np.ndarray, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None) -> np.ndarray:
    """Logits [B, V] as transformers' warpers leave them, in float32: divided by `temperature`,
    then every token below the k-th largest set to -inf (ties with it kept), then the tokens
    outside the smallest set whose probability reaches `top_p` set to -inf (the most likely
    token always kept). A warper transformers would leave out (temperature 1, top_k None or
    0, top_p None or 1) changes nothing."""
    check_sampling(temperature, top_k, top_p)
    scores = np.asarray(logits, dtype=np.float32)
    if temperature != 1.0:
        scores = scores / np.float32(temperature)
    if top_k:
        k = min(int(top_k), scores.shape[-1])
        kth = np.partition(scores, -k, axis=-1)[..., -k, None]
        scores = np.where(scores < kth, np.float32(-np.inf), scores)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(scores, axis=-1, kind="stable")  # ascending, as TopPLogitsWarper sorts
        ascending = np.take_along_axis(scores, order, axis=-1)
        cumulative = np.cumsum(_softmax(ascending), axis=-1)
        drop_sorted = cumulative <= np.float32(1.0 - top_p)
        drop_sorted[..., -1] = False  # min_tokens_to_keep = 1
        drop = np.empty_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        scores = np.where(drop, np.float32(-np.inf), scores)
    return scores


def sample(scores: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """One token per row of warped logits [B, V], int64 [B, 1]: the first token whose
    cumulative probability exceeds the row's uniform draw in [0, 1) (inverse-CDF sampling,
    so a fixed draw gives a fixed token; `<=` so that a draw of 0 never picks a token of
    probability 0)."""
    probs = _softmax(scores.astype(np.float64))
    cdf = np.cumsum(probs, axis=-1)
    u = np.asarray(uniform, dtype=np.float64).reshape(-1, 1)
    picked = (cdf <= u * cdf[:, -1:]).sum(-1, keepdims=True)
    return np.minimum(picked, probs.shape[-1] - 1).astype(np.int64)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


__all__ = ["check_sampling", "sample", "warp_logits"]
