"""Learning-rate schedules, as in torch.optim.lr_scheduler.

Each schedule is a closed form of the step count: `lr(i, t)` is group i's learning rate
after t calls of `step()`, from the group's `initial_lr` (set by the first schedule made on
the optimizer, as torch does). torch computes most of them recursively from the previous
value; the closed forms agree with it to rounding, and stay right when schedules are
chained by SequentialLR or resumed from a state_dict.

    sched = SequentialLR(opt, [LinearLR(opt, 0.01, total_iters=100),
                               CosineAnnealingLR(opt, T_max=steps - 100)], milestones=[100])
"""

from __future__ import annotations

import bisect
import math
from typing import Any, Callable, Sequence

from ..errors import ErrorCode
from ..tensor import error
from .optimizers import Optimizer


class LRScheduler:
    """Sets each param group's "lr" to `lr(i, t)` at construction (t = 0) and at each
    `step()` (t + 1)."""

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1):
        self.optimizer = self._checked(optimizer)
        for g in optimizer.param_groups:
            g.setdefault("initial_lr", g["lr"])
        self.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
        self.last_epoch = last_epoch
        self.step()

    def _checked(self, optimizer: Optimizer) -> Optimizer:
        if not isinstance(optimizer, Optimizer):
            raise error(ErrorCode.ATTRIBUTE_TYPE, f"{type(self).__name__} needs a dtm.optim optimizer, found "
                        f"{type(optimizer).__name__}")
        return optimizer

    def lr(self, i: int, t: int) -> float:
        """Param group i's learning rate at step t."""
        raise NotImplementedError

    def _set(self, t: int) -> None:
        for i, g in enumerate(self.optimizer.param_groups):
            g["lr"] = self.lr(i, t)

    def step(self) -> None:
        self.last_epoch += 1
        self._set(self.last_epoch)

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """The schedule's position and settings: its plain values (as torch, it leaves out
        the optimizer and LambdaLR's functions; SequentialLR's parts need only its count)."""
        return {k: v for k, v in vars(self).items() if _plain(v)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self._set(self.last_epoch)


def _plain(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_plain(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str))


class LambdaLR(LRScheduler):
    """lr = initial_lr * lr_lambda(t): one function, or one per param group."""

    def __init__(self, optimizer: Optimizer, lr_lambda: Callable[[int], float] | Sequence[Callable[[int], float]],
                 last_epoch: int = -1):
        n = len(optimizer.param_groups)
        self.lr_lambdas = list(lr_lambda) if isinstance(lr_lambda, (list, tuple)) else [lr_lambda] * n
        if len(self.lr_lambdas) != n:
            raise error(ErrorCode.OPERAND_COUNT, f"LambdaLR: {len(self.lr_lambdas)} lr_lambdas for {n} param groups")
        super().__init__(optimizer, last_epoch)

    def lr(self, i: int, t: int) -> float:
        return self.base_lrs[i] * self.lr_lambdas[i](t)


class StepLR(LRScheduler):
    """lr = initial_lr * gamma ** (t // step_size)."""

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1):
        if step_size <= 0:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"StepLR: step_size must be positive, found {step_size}")
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer, last_epoch)

    def lr(self, i: int, t: int) -> float:
        return self.base_lrs[i] * self.gamma ** (t // self.step_size)


class MultiStepLR(LRScheduler):
    """lr = initial_lr * gamma ** (the number of milestones <= t); a milestone given twice
    counts twice, as in torch."""

    def __init__(self, optimizer: Optimizer, milestones: Sequence[int], gamma: float = 0.1, last_epoch: int = -1):
        self.milestones, self.gamma = sorted(milestones), gamma
        super().__init__(optimizer, last_epoch)

    def lr(self, i: int, t: int) -> float:
        return self.base_lrs[i] * self.gamma ** bisect.bisect_right(self.milestones, t)


class ExponentialLR(LRScheduler):
    """lr = initial_lr * gamma ** t."""

    def __init__(self, optimizer: Optimizer, gamma: float, last_epoch: int = -1):
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def lr(self, i: int, t: int) -> float:
        return self.base_lrs[i] * self.gamma ** t


class ConstantLR(LRScheduler):
    """lr = initial_lr * factor for the first total_iters steps, then initial_lr."""

    def __init__(self, optimizer: Optimizer, factor: float = 1.0 / 3, total_iters: int = 5, last_epoch: int = -1):
        if not 0 <= factor <= 1:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"ConstantLR: factor must be in [0, 1], found {factor}")
        self.factor, self.total_iters = factor, total_iters
        super().__init__(optimizer, last_epoch)

    def lr(self, i: int, t: int) -> float:
        return self.base_lrs[i] * (self.factor if t < self.total_iters else 1.0)


class LinearLR(LRScheduler):
    """The factor of initial_lr goes linearly from start_factor to end_factor over
    total_iters steps, then stays: a warm-up with the defaults end_factor=1."""

    def __init__(self, optimizer: Optimizer, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
                 total_iters: int = 5, last_epoch: int = -1):
        if not 0 < start_factor <= 1 or not 0 <= end_factor <= 1:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"LinearLR: start_factor must be in (0, 1] and end_factor in "
                        f"[0, 1], found {start_factor} and {end_factor}")
        self.start_factor, self.end_factor, self.total_iters = start_factor, end_factor, total_iters
        super().__init__(optimizer, last_epoch)

    def lr(self, i: int, t: int) -> float:
        done = min(self.total_iters, t) / self.total_iters if self.total_iters else 1.0
        return self.base_lrs[i] * (self.start_factor + (self.end_factor - self.start_factor) * done)


class CosineAnnealingLR(LRScheduler):
    """lr(t) = eta_min + (initial_lr - eta_min) * (1 + cos(pi * t / T_max)) / 2, with an
    optional linear warm-up over the first `warmup` steps (0 by default, as in torch).
    Past T_max the cosine continues, as torch's closed form does; pick T_max = steps."""

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0, warmup: int = 0,  # noqa: N803
                 last_epoch: int = -1):
        self.T_max, self.eta_min, self.warmup = T_max, eta_min, warmup
        super().__init__(optimizer, last_epoch)

    def lr(self, i: int, t: int) -> float:
        base = self.base_lrs[i]
        if t < self.warmup:
            return base * (t + 1) / self.warmup
        t -= self.warmup  # past T_max the cosine goes on (back up), as torch's does
        return self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * t / self.T_max)) / 2


class OneCycleLR(LRScheduler):
    """The 1cycle policy (Smith and Topin, 2017), as torch computes it: the lr rises from
    max_lr / div_factor to max_lr over the first pct_start of total_steps, then anneals to
    initial_lr / final_div_factor (three_phase: back to the initial lr first). Momentum
    (SGD's momentum, Adam's beta1) cycles the other way between max_momentum and
    base_momentum unless cycle_momentum is False."""

    def __init__(self, optimizer: Optimizer, max_lr: float | Sequence[float], total_steps: int | None = None,
                 epochs: int | None = None, steps_per_epoch: int | None = None, pct_start: float = 0.3,
                 anneal_strategy: str = "cos", cycle_momentum: bool = True, base_momentum: float = 0.85,
                 max_momentum: float = 0.95, div_factor: float = 25.0, final_div_factor: float = 1e4,
                 three_phase: bool = False, last_epoch: int = -1):
        if total_steps is None:
            if not epochs or not steps_per_epoch or epochs <= 0 or steps_per_epoch <= 0:
                raise error(ErrorCode.ATTRIBUTE_VALUE, "OneCycleLR: give total_steps, or positive epochs and "
                            "steps_per_epoch")
            total_steps = epochs * steps_per_epoch
        if total_steps <= 0:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"OneCycleLR: total_steps must be positive, found {total_steps}")
        if not 0 <= pct_start <= 1:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"OneCycleLR: pct_start must be in [0, 1], found {pct_start}")
        if anneal_strategy not in ("cos", "linear"):
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"OneCycleLR: anneal_strategy must be 'cos' or 'linear', "
                        f"found {anneal_strategy!r}")
        groups = optimizer.param_groups
        max_lrs = list(max_lr) if isinstance(max_lr, (list, tuple)) else [max_lr] * len(groups)
        if len(max_lrs) != len(groups):
            raise error(ErrorCode.OPERAND_COUNT, f"OneCycleLR: {len(max_lrs)} max_lr values for {len(groups)} groups")
        self.total_steps, self.cycle_momentum = total_steps, cycle_momentum
        self.anneal = _cos if anneal_strategy == "cos" else _linear
        up = float(pct_start * total_steps) - 1
        # (last step of the phase, its start and end lr, its start and end momentum)
        self.phases = ([(up, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                        (float(2 * pct_start * total_steps) - 2, "max_lr", "initial_lr", "base_momentum",
                         "max_momentum"),
                        (total_steps - 1, "initial_lr", "min_lr", "max_momentum", "max_momentum")] if three_phase else
                       [(up, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                        (total_steps - 1, "max_lr", "min_lr", "base_momentum", "max_momentum")])
        self.use_beta1 = "betas" in groups[0]
        if cycle_momentum and not self.use_beta1 and "momentum" not in groups[0]:
            raise error(ErrorCode.ATTRIBUTE_VALUE, "OneCycleLR: cycle_momentum needs an optimizer with momentum "
                        "or betas")
        for g, top in zip(groups, max_lrs):
            g["initial_lr"], g["max_lr"], g["min_lr"] = top / div_factor, top, top / div_factor / final_div_factor
            g["max_momentum"], g["base_momentum"] = max_momentum, base_momentum
        super().__init__(optimizer, last_epoch)

    def _point(self, i: int, t: int) -> tuple[float, float]:
        """Group i's (lr, momentum) at step t."""
        if t > self.total_steps:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"OneCycleLR: stepped {t} times, past total_steps "
                        f"{self.total_steps}")
        g, start = self.optimizer.param_groups[i], 0.0
        for k, (end, lr0, lr1, m0, m1) in enumerate(self.phases):
            if t <= end or k == len(self.phases) - 1:
                pct = (t - start) / (end - start)
                return self.anneal(g[lr0], g[lr1], pct), self.anneal(g[m0], g[m1], pct)
            start = end
        raise AssertionError("unreachable: the last phase always matches")

    def lr(self, i: int, t: int) -> float:
        return self._point(i, t)[0]

    def _set(self, t: int) -> None:
        super()._set(t)
        if not self.cycle_momentum:
            return
        for i, g in enumerate(self.optimizer.param_groups):
            m = self._point(i, t)[1]
            if self.use_beta1:
                g["betas"] = (m, *g["betas"][1:])
            else:
                g["momentum"] = m


def _cos(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)


def _linear(start: float, end: float, pct: float) -> float:
    return (end - start) * pct + start


class SequentialLR(LRScheduler):
    """Runs `schedulers` one after another: schedulers[k] takes over at step
    milestones[k - 1] and counts its own steps from there (nanoGPT's warm-up then cosine)."""

    def __init__(self, optimizer: Optimizer, schedulers: Sequence[LRScheduler], milestones: Sequence[int],
                 last_epoch: int = -1):
        if len(milestones) != len(schedulers) - 1 or not schedulers:
            raise error(ErrorCode.OPERAND_COUNT, f"SequentialLR: {len(schedulers)} schedulers need "
                        f"{len(schedulers) - 1} milestones, found {len(milestones)}")
        if any(s.optimizer is not optimizer for s in schedulers):
            raise error(ErrorCode.ATTRIBUTE_VALUE, "SequentialLR: every scheduler must drive the given optimizer")
        self.schedulers, self.milestones = list(schedulers), list(milestones)
        super().__init__(optimizer, last_epoch)

    def lr(self, i: int, t: int) -> float:
        k = bisect.bisect_right(self.milestones, t)
        return self.schedulers[k].lr(i, t - (self.milestones[k - 1] if k else 0))


class ReduceLROnPlateau(LRScheduler):
    """torch's ReduceLROnPlateau: `step(metric)` after each evaluation; once the metric has
    not improved (by `threshold`, relative or absolute, in `mode` "min" or "max") for more
    than `patience` steps, each group's lr becomes max(lr * factor, its min_lr), unless
    that changes it by eps or less; then `cooldown` steps pass before bad steps count.
    Not a closed form of the count: it follows the metrics it is given, and writes the
    group's "lr" as the other schedules do (a jitted step reads it before each replay)."""

    def __init__(self, optimizer: Optimizer, mode: str = "min", factor: float = 0.1, patience: int = 10,
                 threshold: float = 1e-4, threshold_mode: str = "rel", cooldown: int = 0,
                 min_lr: float | Sequence[float] = 0.0, eps: float = 1e-8):
        self.optimizer = self._checked(optimizer)
        n = len(optimizer.param_groups)
        if factor >= 1.0:
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"ReduceLROnPlateau: factor must be < 1, found {factor}")
        if mode not in ("min", "max") or threshold_mode not in ("rel", "abs"):
            raise error(ErrorCode.ATTRIBUTE_VALUE, f"ReduceLROnPlateau: mode must be 'min' or 'max' and "
                        f"threshold_mode 'rel' or 'abs', found {mode!r} and {threshold_mode!r}")
        self.min_lrs = list(min_lr) if isinstance(min_lr, (list, tuple)) else [min_lr] * n
        if len(self.min_lrs) != n:
            raise error(ErrorCode.OPERAND_COUNT, f"ReduceLROnPlateau: {len(self.min_lrs)} min_lr values for {n} "
                        "param groups")
        self.mode, self.factor, self.patience, self.threshold = mode, factor, patience, threshold
        self.threshold_mode, self.cooldown, self.eps = threshold_mode, cooldown, eps
        self.best = math.inf if mode == "min" else -math.inf
        self.last_epoch = self.num_bad_epochs = self.cooldown_counter = 0

    def _better(self, a: float) -> bool:
        """Whether metric `a` improves on the best so far by more than the threshold."""
        if self.mode == "min":
            return a < (self.best * (1 - self.threshold) if self.threshold_mode == "rel" else
                        self.best - self.threshold)
        return a > (self.best * (1 + self.threshold) if self.threshold_mode == "rel" else self.best + self.threshold)

    def step(self, metrics: Any) -> None:  # type: ignore[override]
        """Count one evaluation with value `metrics` (a number or a 0-d tensor)."""
        current = float(metrics)
        self.last_epoch += 1
        if self._better(current):
            self.best, self.num_bad_epochs = current, 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0
        if self.num_bad_epochs > self.patience:
            self._reduce()
            self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0

    def _reduce(self) -> None:
        for g, floor in zip(self.optimizer.param_groups, self.min_lrs):
            new = max(g["lr"] * self.factor, floor)
            if g["lr"] - new > self.eps:  # a change of eps or less is not made, as torch
                g["lr"] = new

    def load_state_dict(self, state: dict[str, Any]) -> None:
        vars(self).update(state)  # the lrs themselves are in the optimizer's state_dict


__all__ = ["LRScheduler", "LambdaLR", "StepLR", "MultiStepLR", "ExponentialLR", "ConstantLR", "LinearLR",
           "CosineAnnealingLR", "OneCycleLR", "SequentialLR", "ReduceLROnPlateau"]
