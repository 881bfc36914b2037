"""Every public function and class of the user-facing modules says what it is: a docstring
on each name a module exports (its `__all__`, else its names without a leading underscore),
so `help(dtm.add)` and the API reference have something to say (issue 36)."""

from __future__ import annotations

import importlib
import inspect

import pytest

MODULES = ["dtm", "dtm.functional", "dtm.nn", "dtm.nn.functional", "dtm.optim", "dtm.ir", "dtm.parallel",
           "dtm.store", "dtm.checkpoint", "dtm.elastic", "dtm.tasks", "dtm.data", "dtm.quant", "dtm.distributed",
           "dtm.utils.data"]


@pytest.mark.parametrize("name", MODULES)
def test_every_public_function_and_class_has_a_docstring(name):
    module = importlib.import_module(name)
    names = getattr(module, "__all__", [n for n in dir(module) if not n.startswith("_")])
    missing = [n for n in names if (obj := getattr(module, n, None)) is not None
               and (inspect.isfunction(obj) or inspect.isclass(obj)) and not (obj.__doc__ or "").strip()]
    assert missing == []
