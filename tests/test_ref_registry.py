"""The reference semantics cover the registry: every op has an implementation, and the
table holds nothing else (docs/architecture.md: a test that walks the registry fails when a layer
misses an op)."""

from __future__ import annotations

import inspect

import pytest

from dtm.ir import REGISTRY
from dtm.ref import IMPLS


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_registry_op_has_a_reference_impl(name):
    assert name in IMPLS, f"dtm/ref/ops.py has no IMPLS entry for registry op {name!r}"
    params = inspect.signature(IMPLS[name]).parameters
    assert list(params)[:2] == ["ctx", "attrs"], f"{name}: impl(ctx, attrs, *inputs, out_types)"
    assert "out_types" in params and params["out_types"].kind is inspect.Parameter.KEYWORD_ONLY


def test_no_impl_without_a_registry_op():
    assert set(IMPLS) - set(REGISTRY) == set()
