"""Gradient clipping, named and computed as in torch.nn.utils.

    loss.backward()
    dtm.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()

Both are lazy tensor ops, like the rest of a step: nothing is read back to Python (unless
`error_if_nonfinite` asks for the norm's value), so a training step that clips is still
one program, inside `dtm.jit` too.
"""

from __future__ import annotations

import math
from typing import Iterable

from .. import functional as F
from ..errors import ErrorCode
from ..tensor import Tensor, error, float32, no_grad, zeros


def _with_grads(parameters: Tensor | Iterable[Tensor]) -> list[Tensor]:
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    return [p for p in params if p.grad is not None]


def clip_grad_norm_(parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> Tensor:
    """Scale the gradients of `parameters` together so that their norm (of all of them as
    one vector; `norm_type` p, or inf for the largest magnitude) is at most `max_norm`:
    each is multiplied by min(1, max_norm / (norm + 1e-6)). Returns the norm before
    clipping (an f32 0-d tensor), as torch.nn.utils.clip_grad_norm_ does."""
    params = _with_grads(parameters)
    if not params:
        return zeros(())
    p = float(norm_type)
    with no_grad():
        grads = [F.cast(q.grad, float32).abs() for q in params]
        # the norm of all of them as one vector: folded pairwise from each gradient's, not a
        # stack of them (a concat of one scalar per weight, which its reduction's kernel reads
        # through a select per weight: GPT-2's 148 made the largest kernel of its step)
        if p == math.inf:
            total = _pairwise(F.maximum, [g.amax() for g in grads])
        else:
            total = F.pow(_pairwise(F.add, [F.pow(g, p).sum() for g in grads]), 1.0 / p)
        if error_if_nonfinite and not math.isfinite(total.item()):
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"clip_grad_norm_: the total norm of order {norm_type} of the "
                        "gradients is not finite, so they cannot be clipped; pass error_if_nonfinite=False to "
                        "scale them anyway")
        coef = F.clamp(F.div(max_norm, F.add(total, 1e-6)), max=1.0)
        for q in params:
            q.grad = F.mul(q.grad, F.cast(coef, q.grad.dtype))
    return total


def _pairwise(op, xs: list[Tensor]) -> Tensor:
    """op folded over xs as a balanced tree (a sum rounds as a pairwise sum does)."""
    while len(xs) > 1:
        xs = [op(xs[i], xs[i + 1]) if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


def clip_grad_value_(parameters: Tensor | Iterable[Tensor], clip_value: float) -> None:
    """Clamp every gradient of `parameters` into [-clip_value, clip_value]."""
    with no_grad():
        for q in _with_grads(parameters):
            q.grad = F.clamp(q.grad, -clip_value, clip_value)


__all__ = ["clip_grad_norm_", "clip_grad_value_"]
