"""Learning-rate schedules, as in torch.optim.lr_scheduler."""

from __future__ import annotations

import math

from .optimizers import Optimizer


class CosineAnnealingLR:
    """lr(t) = eta_min + (base_lr - eta_min) * (1 + cos(pi * t / T_max)) / 2, with an
    optional linear warm-up over the first `warmup` steps (0 by default, as in torch).
    Past T_max the cosine continues, as torch's closed form does; pick T_max = steps."""

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0, warmup: int = 0):  # noqa: N803
        self.optimizer, self.T_max, self.eta_min, self.warmup = optimizer, T_max, eta_min, warmup
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.last_epoch = 0
        self._set(0)

    def lr_at(self, base: float, t: int) -> float:
        if t < self.warmup:
            return base * (t + 1) / self.warmup
        t -= self.warmup  # past T_max the cosine goes on (back up), as torch's does
        return self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * t / self.T_max)) / 2

    def _set(self, t: int) -> None:
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = self.lr_at(base, t)

    def step(self) -> None:
        self.last_epoch += 1
        self._set(self.last_epoch)

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]
