"""SGD and AdamW, with PyTorch's update formulas (so a step matches torch's to rounding).

A step is written with tensor ops under no_grad and realized as one program for all
parameters; then each parameter takes its new value in place."""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from .. import functional as F
from ..errors import ErrorCode
from ..ir.dtypes import numpy_dtype
from ..tensor import Tensor, error, no_grad, realize, tensor, zeros_like


class Optimizer:
    def __init__(self, params: Iterable[Tensor], defaults: dict):
        params = list(params)
        if not params:
            raise error(ErrorCode.OPERAND_COUNT, f"{type(self).__name__} got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[int, dict] = {}
        self._scalars: dict[tuple, Tensor] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None

    def _update(self, p: Tensor, group: dict, state: dict) -> tuple[Tensor, dict]:
        raise NotImplementedError

    def _scalar(self, value: float, like: Tensor) -> Tensor:
        """A hyperparameter that changes between steps (learning rate, bias correction) as
        a 0-d tensor in `like`'s dtype, not a constant in the program: the step's program
        then stays the same from step to step and its compiled plan is replayed, where a
        baked-in constant would build new kernels every step."""
        key = (value, like.dtype)
        t = self._scalars.get(key)
        if t is None:
            t = self._scalars[key] = tensor(np.array(value, dtype=numpy_dtype(like.dtype)))
        return t

    @no_grad()
    def step(self) -> None:
        news, targets = [], []
        self._scalars = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state.setdefault(id(p), {})
                new_p, new_state = self._update(p, group, state)
                if p._mesh is not None:  # a distributed parameter keeps its layout (DDP, TP, FSDP)
                    new_p = new_p.redistribute(p.placements)
                news.append((p, new_p, state, new_state))
                targets.append(new_p)
                targets.extend(v for v in new_state.values() if isinstance(v, Tensor))
        realize(*targets)
        for p, new_p, state, new_state in news:
            p._set_value(new_p._buffer)
            for k, v in new_state.items():
                state[k] = Tensor(v.type, buffer=v._buffer) if isinstance(v, Tensor) else v


class SGD(Optimizer):
    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def _update(self, p, group, state):
        g = p.grad
        if group["weight_decay"]:
            g = F.add(g, F.mul(p, group["weight_decay"]))
        new_state = {}
        if group["momentum"]:
            buf = state.get("momentum_buffer")
            buf = g if buf is None else F.add(F.mul(buf, group["momentum"]), F.mul(g, 1 - group["dampening"]))
            new_state["momentum_buffer"] = buf
            g = F.add(g, F.mul(buf, group["momentum"])) if group["nesterov"] else buf
        return F.sub(p, F.mul(g, self._scalar(group["lr"], p))), new_state


class AdamW(Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _update(self, p, group, state):
        b1, b2 = group["betas"]
        lr, step, g = group["lr"], state.get("step", 0) + 1, p.grad
        m = state["exp_avg"] if "exp_avg" in state else zeros_like(p)
        v = state["exp_avg_sq"] if "exp_avg_sq" in state else zeros_like(p)
        decayed = F.mul(p, self._scalar(1 - lr * group["weight_decay"], p))
        m = F.add(m, F.mul(F.sub(g, m), 1 - b1))  # torch's lerp
        v = F.add(F.mul(v, b2), F.mul(F.mul(g, g), 1 - b2))
        step_size = self._scalar(lr / (1 - b1 ** step), p)
        denom = F.add(F.div(F.sqrt(v), self._scalar(math.sqrt(1 - b2 ** step), p)), group["eps"])
        new_p = F.sub(decayed, F.mul(F.div(m, denom), step_size))
        return new_p, {"exp_avg": m, "exp_avg_sq": v, "step": step}
