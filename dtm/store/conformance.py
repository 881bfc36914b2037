"""The runner for the quota vectors in `conformance/quotas/` (spec 9.4.14).

    results = run_quota_vectors()   # default root: the repository's conformance/quotas

- `manifest.json["sizes"]`: `[TEXT, BYTES or CODE]`: the size notation of 9.4.13 (what
  `--memory-quota`, `--store-quota` and their variables take): TEXT must read as BYTES, or
  be refused with CODE.
- `valid/NAME.json["steps"]`: store operations in order on an empty store, each with its
  outcome: `{"quota": PREFIX, "bytes": N or null}` sets (or removes) a quota;
  `{"put": KEY, "dtype", "shape", "expect": "ok" or CODE}` puts a tensor of zeros, which
  must succeed or fail with CODE (9.2.7: E1103) and then change nothing;
  `{"delete": KEY}`; `{"du": PREFIX, "expect": N}`: the bytes stored under PREFIX.

Each vector runs on two stores: a directory store in a temporary directory (indexed in
SQLite) and a process-local `memory://` store (indexed by ref objects), the result's kind
naming which. `tests/test_quota_conformance.py` and `dtm conformance quotas` both call
`run_quota_vectors`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import pathlib
import tempfile
from typing import Iterator

import numpy as np

from ..errors import DTMError
from ..ir.conformance import VectorResult, manifest_or_failure
from ..ir.dtypes import DTYPES
from ..ir.types import TensorType
from ..ref import quant
from ..runtime.host import parse_bytes
from . import open as open_store
from .store import Store

DEFAULT_ROOT = pathlib.Path(__file__).resolve().parents[2] / "conformance" / "quotas"
KINDS = ("directory", "memory")
_names = itertools.count()


@contextlib.contextmanager
def _empty_store(kind: str) -> Iterator[Store]:
    if kind == "memory":
        st = open_store(f"memory://dtm-quota-vector-{next(_names)}")
        try:
            yield st
        finally:
            for k in st.keys():
                st.delete(k)
        return
    with tempfile.TemporaryDirectory(prefix="dtm-quota-vector-") as tmp, open_store(tmp) as st:
        yield st


def _zeros(dtype: str, shape: list[int]) -> np.ndarray:
    """A tensor of zeros of `dtype` and logical `shape` (a quantized one as its block storage)."""
    dt = DTYPES[dtype]
    return np.zeros(quant.storage_shape(TensorType(dt, tuple(shape))), quant.storage_dtype(dt))


def _step_differs(st: Store, i: int, step: dict) -> str | None:
    if "quota" in step:
        st.set_quota(step["bytes"], step["quota"])
    elif "put" in step:
        key, had = step["put"], step["put"] in st
        before = st.du("")
        try:
            st.put_array(key, _zeros(step["dtype"], step["shape"]), dtype=step["dtype"])
            got = "ok"
        except DTMError as e:
            got = e.code.value
        if got != step["expect"]:
            return f"step {i}: put {key!r} {step['dtype']}{step['shape']}: {got}, expected {step['expect']}"
        if got != "ok" and ((key in st) != had or st.du("") != before):
            return f"step {i}: the refused put {key!r} changed the store"
    elif "delete" in step:
        st.delete(step["delete"])
    else:
        got = st.du(step["du"])
        if got != step["expect"]:
            return f"step {i}: du({step['du']!r}) is {got}, expected {step['expect']}"
    return None


def check(path: pathlib.Path, kind: str) -> str | None:
    """Run vector `path`'s steps on an empty store of `kind`; None when each gives its outcome."""
    steps = json.loads(path.read_text(encoding="utf-8"))["steps"]
    with _empty_store(kind) as st:
        for i, step in enumerate(steps):
            problem = _step_differs(st, i, step)
            if problem:
                return problem
    return None


def _size_differs(text: str, want: int | str) -> str | None:
    try:
        got: int | str = parse_bytes(text, "size vector")
    except DTMError as e:
        got = e.code.value
    return None if got == want else f"{text!r} reads as {got}, expected {want}"


def run_quota_vectors(root: pathlib.Path | None = None) -> list[VectorResult]:
    """The size vectors (kind "size"), then every vector of the manifest on each store kind;
    a vector that cannot be read, or a manifest of another spec version, is a failure
    naming it, and the others still run."""
    root = pathlib.Path(root) if root is not None else DEFAULT_ROOT
    manifest = manifest_or_failure(root, this_version=True)
    if isinstance(manifest, VectorResult):
        return [manifest]
    results = []
    for text, want in manifest.get("sizes", []):
        problem = _size_differs(text, want)
        results.append(VectorResult(repr(text), "size", problem is None, problem or ""))
    for name in manifest.get("vectors", []):
        for kind in KINDS:
            try:
                problem = check(root / "valid" / f"{name}.json", kind)
            except (OSError, ValueError, KeyError, TypeError) as e:
                problem = f"cannot read the vector: {type(e).__name__}: {e}"
            results.append(VectorResult(name, kind, problem is None, problem or ""))
    return results


__all__ = ["run_quota_vectors", "check", "DEFAULT_ROOT", "KINDS"]
