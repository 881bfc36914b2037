"""Utilities of the user-facing API, as torch.utils: `dtm.utils.data` (Dataset, DataLoader)."""

from . import data

__all__ = ["data"]
