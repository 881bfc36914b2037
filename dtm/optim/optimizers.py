"""SGD, Adam, AdamW, RMSprop and Adagrad, with PyTorch's update formulas (so a step matches torch's to rounding).

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
from typing import Any, Iterable

import numpy as np

from .. import functional as F
from ..errors import ErrorCode
from ..ir.dtypes import numpy_dtype
from ..tensor import STATE, Tensor, error, jit, no_grad
from ..tensor.core import assign, on_replay


class Optimizer:
    """torch.optim.Optimizer: the base of the optimizers. `params` holds tensors, or param
    groups ({"params": [...], setting: value, ...}) whose settings override `defaults`; an
    empty list is an error. A step updates every parameter with a gradient as one program
    (see the module doc)."""

    def __init__(self, params: Iterable[Tensor], defaults: dict):
        params = list(params)
        if not params:
            raise error(ErrorCode.OPERAND_COUNT, f"{type(self).__name__} got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[int, dict] = {}
        self._compiled: jit | None = None  # the eager step's program (see `step`)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim.Optimizer.zero_grad: every parameter's gradient to None, or with
        set_to_none=False each existing gradient set to zeros in place (its layout kept)."""
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none or p.grad is None:
                    p.grad = None
                else:
                    p.grad.zero_()

    def _scalars(self, group: dict, step: int) -> dict[str, float]:
        """The numbers a step of `group`'s parameters at step count `step` needs."""
        raise NotImplementedError

    def _update(self, p: Tensor, group: dict, state: dict, s: dict[str, Tensor]) -> tuple[Tensor, dict]:
        """p's new value and its state's ({name: new value}), from 0-d tensors `s`."""
        raise NotImplementedError

    def _state(self, state: dict, name: str, p: Tensor, fill: float = 0.0) -> Tensor:
        """p's state tensor `name`, made on first use: `fill` everywhere, laid out like p."""
        t = state.get(name)
        if t is None:
            t = state[name] = _like(p, np.full(p.shape, fill, numpy_dtype(p.dtype)))
        return t

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: {"state": {index: {name: value}}, "param_groups": [{setting:
        value, "params": [index, ...]}]}, parameters numbered in the order of the groups.
        The state's tensors are the optimizer's own (save them before the next step)."""
        index: dict[int, int] = {}
        groups = []
        for g in self.param_groups:
            ids = [index.setdefault(id(p), len(index)) for p in g["params"]]
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        state = {index[pid]: dict(s) for pid, s in self.state.items() if pid in index}
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def checkpoint_layouts(self) -> dict[str, Tensor]:
        """{"state/INDEX": parameter}, numbered as `state_dict` numbers them: a checkpoint
        load (dtm.checkpoint, spec 9.4.4) reads each saved state tensor of a parameter's
        shape laid out like that parameter, even before this optimizer has any state, so a
        rank reads only its pieces of it."""
        params = [p for g in self.param_groups for p in g["params"]]
        return {f"state/{i}": p for i, p in enumerate(dict.fromkeys(params))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from `state_dict` (from `state_dict()`, this optimizer's or one made alike
        on other parameters of the same shapes): the groups' settings and each parameter's
        state, copied into tensors laid out like the parameter."""
        try:
            saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        except (KeyError, TypeError):
            raise error(ErrorCode.MISSING_ATTRIBUTE, "load_state_dict: an optimizer state_dict holds 'state' and "
                        "'param_groups'") from None
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise error(ErrorCode.SHAPE_MISMATCH, "load_state_dict: the saved param groups hold "
                        f"{[len(g['params']) for g in saved_groups]} parameters, this optimizer's "
                        f"{[len(g['params']) for g in self.param_groups]}")
        params = {i: p for saved, own in zip(saved_groups, self.param_groups)
                  for i, p in zip(saved["params"], own["params"])}
        state: dict[int, dict] = {}
        for i, entries in saved_state.items():
            p = params.get(int(i))
            if p is None:
                raise error(ErrorCode.UNDEFINED_VALUE, f"load_state_dict: state for parameter {i}, which no group "
                            "holds")
            state[id(p)] = {name: self._loaded(name, v, p) for name, v in entries.items()}
        for own, saved in zip(self.param_groups, saved_groups):
            own.update({k: v for k, v in saved.items() if k != "params"})
        self.state = state
        self._compiled = None  # the eager step's program reads the state tensors it was traced with

    @staticmethod
    def _loaded(name: str, value: Any, p: Tensor) -> Any:
        """A saved state entry for p: a count, a plain value, or array data (a DTM tensor,
        numpy, or a torch tensor from torch's own state_dict) copied in p's dtype."""
        if name == "step":  # a count here (torch keeps a 0-d float tensor)
            return int(value.item() if isinstance(value, Tensor) else value)
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, Tensor) and p._mesh is not None and value._mesh == p._mesh and value.dtype == p.dtype:
            value.realize()  # a distributed value laid out as p is (a checkpoint read for it): its pieces
            if value._placements == p._placements and value.shape == p.shape:
                return Tensor(p._type, buffer=value._buffer)
        arr = value.numpy() if isinstance(value, Tensor) else np.asarray(value)
        if tuple(arr.shape) != p.shape:
            raise error(ErrorCode.SHAPE_MISMATCH, f"load_state_dict: state {name!r} has shape {tuple(arr.shape)}, "
                        f"its parameter is {p._type}")
        return _like(p, np.array(arr, dtype=numpy_dtype(p.dtype), copy=True))

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


def _like(p: Tensor, array: np.ndarray) -> Tensor:
    """A leaf holding `array`, laid out like p (split over its mesh when p is distributed)."""
    return Tensor(p._type, buffer=p._mesh.split(array, p.placements) if p._mesh is not None else array)


def _tensors(values: dict[str, float], like: Tensor) -> dict[str, Tensor]:
    """Each number as a 0-d tensor of `like`'s dtype (rounded once, as torch rounds a
    Python scalar it multiplies a tensor by)."""
    dtype = numpy_dtype(like.dtype)
    return {k: Tensor.from_numpy(np.array(v, dtype=dtype)) for k, v in values.items()}


class SGD(Optimizer):
    """torch.optim.SGD: p -= lr * g, g the gradient plus weight_decay * p. With momentum, a
    buffer b = momentum * b + (1 - dampening) * g (g itself on the first step) replaces g,
    or with nesterov g + momentum * b does (nesterov needs a momentum and no dampening: an
    error otherwise, as torch's)."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"SGD: nesterov momentum requires a momentum above 0 and zero "
                        f"dampening, found momentum={momentum}, dampening={dampening} (torch raises too)")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():  # torch's SGD keeps no count: a saved buffer means a step was taken
            if "momentum_buffer" in state:
                state.setdefault("step", 1)

    def _scalars(self, group, step):
        # the momentum buffer: the gradient itself on the first step (torch), then a blend
        first = step == 1
        return {"lr": group["lr"], "keep": 0.0 if first else group["momentum"],
                "take": 1.0 if first else 1 - group["dampening"], "momentum": group["momentum"]}

    def _update(self, p, group, state, s):
        g = p.grad
        if group["weight_decay"]:
            g = F.add(g, F.mul(p, group["weight_decay"]))
        new_state = {}
        if group["momentum"]:
            buf = F.add(F.mul(self._state(state, "momentum_buffer", p), s["keep"]), F.mul(g, s["take"]))
            new_state["momentum_buffer"] = buf
            g = F.add(g, F.mul(buf, s["momentum"])) if group["nesterov"] else buf
        return F.sub(p, F.mul(g, s["lr"])), new_state


class Adam(Optimizer):
    """Adam (Kingma and Ba, 2014) as torch computes it: weight_decay is an L2 term added to
    the gradient; amsgrad divides by the largest second moment seen so far. beta1 enters
    the program as a number of the step, so a schedule may cycle it (OneCycleLR)."""

    decoupled_weight_decay = False

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad))

    def _scalars(self, group, step):
        b1, b2 = group["betas"]
        lr = group["lr"]
        s = {"step_size": lr / (1 - b1 ** step), "bias2_sqrt": math.sqrt(1 - b2 ** step), "1-b1": 1 - b1}
        if self.decoupled_weight_decay:
            s["decay"] = 1 - lr * group["weight_decay"]
        return s

    def _update(self, p, group, state, s):
        _, b2 = group["betas"]
        g = p.grad
        m, v = self._state(state, "exp_avg", p), self._state(state, "exp_avg_sq", p)
        start = p
        if self.decoupled_weight_decay:
            start = F.mul(p, s["decay"])
        elif group["weight_decay"]:
            g = F.add(g, F.mul(p, group["weight_decay"]))
        m = F.add(m, F.mul(F.sub(g, m), s["1-b1"]))  # torch's lerp
        v = F.add(F.mul(v, b2), F.mul(F.mul(g, g), 1 - b2))
        new_state = {"exp_avg": m, "exp_avg_sq": v}
        if group["amsgrad"]:
            v = new_state["max_exp_avg_sq"] = F.maximum(self._state(state, "max_exp_avg_sq", p), v)
        denom = F.add(F.div(F.sqrt(v), s["bias2_sqrt"]), group["eps"])
        return F.sub(start, F.mul(F.div(m, denom), s["step_size"])), new_state


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov and Hutter, 2017): each step first
    scales the parameters by 1 - lr * weight_decay."""

    decoupled_weight_decay = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad)


class RMSprop(Optimizer):
    """RMSprop (Hinton's lecture 6e) as torch computes it: the gradient is divided by the
    root of a running mean of its square (centered: minus the square of its running mean),
    plus eps; with momentum, that quotient feeds a momentum buffer. lr and momentum enter
    the program as numbers of the step, so a schedule may change them (OneCycleLR cycles
    the momentum)."""

    def __init__(self, params, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
                 momentum: float = 0.0, centered: bool = False):
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                                      centered=centered))

    def _scalars(self, group, step):
        return {"lr": group["lr"], "momentum": group["momentum"]}

    def _update(self, p, group, state, s):
        alpha, g = group["alpha"], p.grad
        if group["weight_decay"]:
            g = F.add(g, F.mul(p, group["weight_decay"]))
        sq = F.add(F.mul(self._state(state, "square_avg", p), alpha), F.mul(F.mul(g, g), 1 - alpha))
        new_state = {"square_avg": sq}
        if group["centered"]:
            mean = self._state(state, "grad_avg", p)
            mean = new_state["grad_avg"] = F.add(mean, F.mul(F.sub(g, mean), 1 - alpha))  # torch's lerp
            sq = F.sub(sq, F.mul(mean, mean))
        step = F.div(g, F.add(F.sqrt(sq), group["eps"]))
        if group["momentum"] > 0:
            step = new_state["momentum_buffer"] = F.add(F.mul(self._state(state, "momentum_buffer", p),
                                                              s["momentum"]), step)
        return F.sub(p, F.mul(step, s["lr"])), new_state


class Adagrad(Optimizer):
    """Adagrad (Duchi et al., 2011) as torch computes it: the gradient is divided by the
    root of the sum of its squares so far (started at initial_accumulator_value) plus eps,
    at a learning rate lr / (1 + (step - 1) * lr_decay). As in torch, each parameter's
    state is made with the optimizer, so state_dict() holds it before the first step."""

    def __init__(self, params, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10):
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, eps=eps))
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.setdefault(id(p), {"step": 0})
                self._state(state, "sum", p, group["initial_accumulator_value"])

    def _scalars(self, group, step):
        return {"clr": group["lr"] / (1 + (step - 1) * group["lr_decay"])}

    def _update(self, p, group, state, s):
        g = p.grad
        if group["weight_decay"]:
            g = F.add(g, F.mul(p, group["weight_decay"]))
        total = F.add(self._state(state, "sum", p, group["initial_accumulator_value"]), F.mul(g, g))
        step = F.div(g, F.add(F.sqrt(total), group["eps"]))
        return F.sub(p, F.mul(step, s["clr"])), {"sum": total}
