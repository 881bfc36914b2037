"""A step given up while it runs (live resize: dtm.elastic).

While dtm.elastic runs a training step's body, a collective that fails because a peer died
returns a stand-in filled with NaN and marks the epoch broken (ProcessGroup._poisonable):
the step is redone on the resized mesh, and nothing it computes is used. `abandon()` says
so to the executors, which check `abandoned()` after each step that is not a compiled
kernel (a collective is one) and skip the rest of the program, giving stand-ins for its
results: the rest would only compute on NaN (a GPT-2 124M step's backward and optimizer
ran on for 3 s on two cores before the resize could start). `resume()` once the body has
ended (ProcessGroup.poison set False).
"""

from __future__ import annotations

import numpy as np

_abandoned = False


def abandon() -> None:
    """The step now running is given up: executors skip the rest of its programs."""
    global _abandoned
    _abandoned = True


def resume() -> None:
    """Steps run to their end again."""
    global _abandoned
    _abandoned = False


def abandoned() -> bool:
    """Whether the step now running was given up."""
    return _abandoned


def stand_in(shape, dtype) -> np.ndarray:
    """What a given-up step gives for a result of this shape and numpy dtype: NaN for
    floating-point and complex dtypes, zeros for integers and booleans (spec 9.6.7)."""
    dtype = np.dtype(dtype)
    return np.full(shape, np.nan if dtype.kind in "fc" else 0, dtype)


__all__ = ["abandon", "abandoned", "resume", "stand_in"]
