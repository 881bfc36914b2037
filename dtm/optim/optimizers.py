"""SGD and AdamW, with PyTorch's update formulas (so a step matches torch's to rounding).

A step is written with tensor ops under no_grad and run as one program for all parameters:
each parameter and each piece of state (a leaf tensor per parameter, laid out like it)
takes its new value in place (`dtm.tensor.core.assign`). Eagerly that program is the
optimizer's own dtm.jit function, recorded at the first step and replayed after; inside a
dtm.jit training step it is part of the traced program.

What changes from step to step as a number (the learning rate, the bias corrections of a
step count) enters the program as 0-d tensors, not constants: the program stays the same,
so its compiled plan is replayed. They are computed in Python, in double precision as
torch computes them, by `_scalars(group, step)`; inside dtm.jit the same computation runs
before each replay (`on_replay`), writing into the tensors the traced program reads.
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from .. import functional as F
from ..errors import ErrorCode
from ..ir.dtypes import numpy_dtype
from ..tensor import STATE, Tensor, error, jit, no_grad
from ..tensor.core import assign, on_replay


class Optimizer:
    def __init__(self, params: Iterable[Tensor], defaults: dict):
        params = list(params)
        if not params:
            raise error(ErrorCode.OPERAND_COUNT, f"{type(self).__name__} got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[int, dict] = {}
        self._compiled: jit | None = None  # the eager step's program (see `step`)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None

    def _scalars(self, group: dict, step: int) -> dict[str, float]:
        """The numbers a step of `group`'s parameters at step count `step` needs."""
        raise NotImplementedError

    def _update(self, p: Tensor, group: dict, state: dict, s: dict[str, Tensor]) -> tuple[Tensor, dict]:
        """p's new value and its state's ({name: new value}), from 0-d tensors `s`."""
        raise NotImplementedError

    def _state(self, state: dict, name: str, p: Tensor) -> Tensor:
        """p's state tensor `name`, made on first use: zeros, laid out like p."""
        t = state.get(name)
        if t is None:
            zeros = np.zeros(p.shape, numpy_dtype(p.dtype))
            t = state[name] = Tensor(p._type, buffer=p._mesh.split(zeros, p.placements) if p._mesh is not None
                                     else zeros)
        return t

    @no_grad()
    def step(self) -> None:
        if STATE.trace is not None:  # inside dtm.jit: this step is part of the traced program
            self._record()
            return
        # Eagerly, the step is a dtm.jit program of its own, traced for this pattern of
        # parameters with gradients and of equal step counts, and replayed after: the
        # updates are recorded once, not at every step.
        params = [p for g in self.param_groups for p in g["params"]]
        grads = [p.grad for p in params]
        counts: dict = {}
        pattern = tuple(None if p.grad is None else
                        counts.setdefault((self.state.get(id(p), {}).get("step", 0), p.dtype), len(counts))
                        for p in params)
        if self._compiled is None:
            self._compiled = jit(self._traced)
        try:
            self._compiled(pattern, *[g for g in grads if g is not None])
        finally:
            for p, g in zip(params, grads):
                p.grad = g

    def _traced(self, pattern: tuple, *grads: Tensor) -> tuple:
        """The step on the gradients `grads` (placeholders while traced) of the parameters
        `pattern` marks, for the eager step's dtm.jit program."""
        it = iter(grads)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = next(it) if p.grad is not None else None
        self._record()
        return ()

    def _record(self) -> None:
        """Record the step: every update as an assignment (run now when eager; the traced
        program's in-place writes inside dtm.jit), and its bookkeeping for replays."""
        pairs = []
        slots: dict[tuple, tuple[dict, list[Tensor]]] = {}  # (group, step, dtype) -> (0-d tensors, their params)
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state.setdefault(id(p), {})
                state["step"] = state.get("step", 0) + 1
                key = (gi, state["step"], p.dtype)
                if key not in slots:
                    slots[key] = (_tensors(self._scalars(group, state["step"]), p), [])
                s, stepped = slots[key]
                stepped.append(p)
                new_p, new_state = self._update(p, group, state, s)
                if p._mesh is not None:  # a distributed parameter keeps its layout (DDP, TP, FSDP)
                    new_p = new_p.redistribute(p.placements)
                pairs.append((p, new_p))
                pairs.extend((state[k], v) for k, v in new_state.items())
        assign(pairs)
        on_replay(lambda: self._advance(list(slots.items())))

    def _advance(self, slots: list) -> None:
        """A replayed step's bookkeeping: its parameters' step counts, and the numbers of
        their new counts written into the 0-d tensors the traced step reads."""
        for (gi, _, _), (s, stepped) in slots:
            for p in stepped:
                self.state[id(p)]["step"] += 1
            values = self._scalars(self.param_groups[gi], self.state[id(stepped[0])]["step"])
            for name, t in s.items():
                t._buffer[...] = values[name]


def _tensors(values: dict[str, float], like: Tensor) -> dict[str, Tensor]:
    """Each number as a 0-d tensor of `like`'s dtype (rounded once, as torch rounds a
    Python scalar it multiplies a tensor by)."""
    dtype = numpy_dtype(like.dtype)
    return {k: Tensor.from_numpy(np.array(v, dtype=dtype)) for k, v in values.items()}


class SGD(Optimizer):
    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def _scalars(self, group, step):
        # the momentum buffer: the gradient itself on the first step (torch), then a blend
        first = step == 1
        return {"lr": group["lr"], "keep": 0.0 if first else group["momentum"],
                "take": 1.0 if first else 1 - group["dampening"]}

    def _update(self, p, group, state, s):
        g = p.grad
        if group["weight_decay"]:
            g = F.add(g, F.mul(p, group["weight_decay"]))
        new_state = {}
        if group["momentum"]:
            buf = F.add(F.mul(self._state(state, "momentum_buffer", p), s["keep"]), F.mul(g, s["take"]))
            new_state["momentum_buffer"] = buf
            g = F.add(g, F.mul(buf, group["momentum"])) if group["nesterov"] else buf
        return F.sub(p, F.mul(g, s["lr"])), new_state


class AdamW(Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _scalars(self, group, step):
        b1, b2 = group["betas"]
        lr = group["lr"]
        return {"decay": 1 - lr * group["weight_decay"], "step_size": lr / (1 - b1 ** step),
                "bias2_sqrt": math.sqrt(1 - b2 ** step)}

    def _update(self, p, group, state, s):
        b1, b2 = group["betas"]
        g = p.grad
        m, v = self._state(state, "exp_avg", p), self._state(state, "exp_avg_sq", p)
        decayed = F.mul(p, s["decay"])
        m = F.add(m, F.mul(F.sub(g, m), 1 - b1))  # torch's lerp
        v = F.add(F.mul(v, b2), F.mul(F.mul(g, g), 1 - b2))
        denom = F.add(F.div(F.sqrt(v), s["bias2_sqrt"]), group["eps"])
        new_p = F.sub(decayed, F.mul(F.div(m, denom), s["step_size"]))
        return new_p, {"exp_avg": m, "exp_avg_sq": v}
