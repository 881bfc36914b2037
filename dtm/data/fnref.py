"""Ingest functions named for worker processes (dtm.tasks.names), E1304 when they cannot be."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ErrorCode as E
from ..tasks import names
from .errors import DataError


def _fail(why: str) -> DataError:
    return DataError(E.INGEST_FN_NOT_IMPORTABLE, f"the ingest function: {why}")


def name_of(fn: Callable[..., Any]) -> str:
    """"module:qualname" of `fn`, which ingest workers import; E1304 when there is none."""
    return names.name_of(fn, _fail)


def resolve(name: str) -> Callable[..., Any]:
    """The ingest function `name` names; E1304 when it does not import."""
    return names.resolve(name, _fail)
