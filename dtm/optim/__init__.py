"""Optimizers and schedules, as in torch.optim."""

from . import lr_scheduler
from .optimizers import SGD, AdamW, Optimizer

__all__ = ["Optimizer", "SGD", "AdamW", "lr_scheduler"]
