"""Optimizers and schedules, as in torch.optim."""

from . import lr_scheduler
from .optimizers import SGD, Adam, AdamW, Optimizer

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "lr_scheduler"]
