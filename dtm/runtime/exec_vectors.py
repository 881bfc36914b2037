"""Execution vectors (spec 8.4): programs with inputs and the outputs the spec's semantics
give them, which every implementation runs on each of its executors. One vector per op:
the example module of the op's spec entry (3.x), its inputs drawn once, its expected
outputs computed by the reference interpreter (conformance/exec/tools/make_vectors.py).

    conformance/exec/manifest.json     {"spec_version", "vectors": {NAME: {"ops": [...], "ranks": n}}}
    conformance/exec/valid/NAME.dtm    the module (the spec's example, verbatim)
    conformance/exec/valid/NAME.json   {"func", "ranks", "inputs", "outputs", "store", "stored", "assigned"}

`inputs` and `outputs` hold one list per rank (one rank: one list) of arrays, each
{"dtype", "shape", "data"}: `data` the elements in row-major order as JSON numbers (floats
that are not finite as the strings "nan", "inf", "-inf"; bool as true / false), or, for a
quantized dtype, "hex" in place of `data`: its block storage (spec 2.2), the logical shape
in "shape". `store` is what the tensor store
holds before the run ({key: array}), `stored` what it must hold after; `assigned` maps a
parameter's position to the value an `assign` leaves in it. Floats compare within a few
units in the last place of their dtype (an implementation's libm may differ from another's
by that much: `TOLERANCES`), with NaN where NaN is expected; everything else bit for bit.

Executors here: `ref` (the reference interpreter; a vector with a mesh runs on one thread
per rank), `cpu` (the compiled plans; vectors of one rank), `l0` (the in-process
multi-device executor; vectors with a mesh); exec_l1.py runs the vectors with a mesh over
processes, a rank each.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Sequence

import ml_dtypes  # noqa: F401 - registers bf16 and the f8 dtypes with numpy
import numpy as np

from ..errors import DTMError, ErrorCode
from ..ir.conformance import VectorResult, manifest_or_failure
from ..ir.dtypes import DTYPES, from_numpy, numpy_dtype
from ..ir.module import Module
from ..ir.parser import parse
from ..ref.interpreter import run as ref_run
from ..ref.local_group import run_spmd
from . import execute
from .l0 import L0Executor

EXECUTORS = ("ref", "cpu", "l0")  # in this process (exec_l1.py: the vectors with a mesh over processes)
# relative and absolute tolerance by float dtype: a few ulps (spec 2.8 lets transcendental
# functions differ from the exactly rounded result by that much)
TOLERANCES = {"f64": (1e-12, 1e-12), "f32": (2e-5, 2e-6), "f16": (4e-3, 4e-3), "bf16": (3e-2, 3e-2),
              "f8e4m3": (1.3e-1, 1.3e-1), "f8e5m2": (2.6e-1, 2.6e-1)}


@dataclass
class Vector:
    """One execution vector, read from its two files."""

    name: str
    module: Module
    func: str
    ranks: int
    mesh: str | None
    inputs: list[list[np.ndarray]]
    outputs: list[list[np.ndarray]]
    store: dict[str, np.ndarray]
    stored: dict[str, np.ndarray]
    assigned: list[dict[int, np.ndarray]]


# --- arrays in JSON --------------------------------------------------------------------------

def encode_array(a: np.ndarray, dtype: str | None = None) -> dict:
    """The JSON form of array `a` of DTM dtype `dtype` (see the module docstring); by default
    the dtype numpy's dtype of `a` stands for (a quantized array must name its own)."""
    a = np.asarray(a)
    dtype = dtype or from_numpy(a.dtype).name
    dt = DTYPES[dtype]
    if dt.is_quant:  # the block storage [..., blocks * itemsize] of a logical [..., blocks * block]
        shape = list(a.shape[:-1]) + [a.shape[-1] // dt.itemsize * dt.block]
        return {"dtype": dtype, "shape": shape, "hex": a.tobytes().hex()}
    if DTYPES[dtype].is_float:
        data = [float(v) if np.isfinite(v) else ("nan" if np.isnan(v) else "inf" if v > 0 else "-inf")
                for v in a.astype(np.float64).reshape(-1)]
    else:
        data = a.reshape(-1).tolist()
    return {"dtype": dtype, "shape": list(a.shape), "data": data}


def decode_array(d: dict, where: str) -> np.ndarray:
    """An array from its JSON form; ValueError naming `where` when it is not one."""
    try:
        dt, shape = DTYPES[d["dtype"]], tuple(int(n) for n in d["shape"])
        if dt.is_quant:
            storage = shape[:-1] + (shape[-1] // dt.block * dt.itemsize,)
            return np.frombuffer(bytes.fromhex(d["hex"]), np.uint8).copy().reshape(storage)
        flat = [float(v) if isinstance(v, str) else v for v in d["data"]]
        a = np.array(flat, dtype=np.float64 if dt.is_float else None).astype(numpy_dtype(dt))
        if a.size != int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"{a.size} elements for the shape {list(shape)}")
        return a.reshape(shape)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: not an array ({e})") from None


# --- reading and running ---------------------------------------------------------------------

def default_root() -> pathlib.Path:
    return pathlib.Path(__file__).resolve().parents[2] / "conformance" / "exec"


def load(root: pathlib.Path, name: str) -> Vector:
    """Vector `name` of directory `root`; ValueError (or DTMError for its module) when a file
    is missing or not what the format says."""
    base = root / "valid" / name
    module = parse(base.with_suffix(".dtm").read_text(encoding="utf-8"))
    doc = json.loads(base.with_suffix(".json").read_text(encoding="utf-8"))
    ranks = int(doc.get("ranks", 1))

    def arrays(key: str) -> list[list[np.ndarray]]:
        rows = doc[key]
        if len(rows) != ranks:
            raise ValueError(f"{name}.json: {key} has {len(rows)} rank(s), the vector {ranks}")
        return [[decode_array(a, f"{name}.json {key}[{r}][{i}]") for i, a in enumerate(row)]
                for r, row in enumerate(rows)]

    meshes = list(module.meshes)
    return Vector(name, module, doc["func"], ranks, meshes[0] if meshes else None, arrays("inputs"),
                  arrays("outputs"), {k: decode_array(v, f"{name}.json store {k}") for k, v in doc.get("store", {}).items()},
                  {k: decode_array(v, f"{name}.json stored {k}") for k, v in doc.get("stored", {}).items()},
                  [{int(i): decode_array(v, f"{name}.json assigned {i}") for i, v in row.items()}
                   for row in doc.get("assigned", [{}] * ranks)])


class DictStore:
    """A tensor store in a dict, for the vectors of store_get and store_put."""

    def __init__(self, items: dict[str, np.ndarray]):
        self.items = {k: v.copy() for k, v in items.items()}

    def get_array(self, key, dtype=None, shape=None):
        if key not in self.items:
            raise DTMError(ErrorCode.STORE_KEY_MISSING, f"store_get: no key {key!r}")
        return self.items[key].copy()

    def put_array(self, key, a, dtype=None):
        self.items[key] = np.array(a, copy=True)


def run_one(v: Vector, executor: str) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]], dict]:
    """The vector's outputs on `executor`, its inputs after the run (what `assign` left in
    them) and the store after it."""
    inputs = [[x.copy() for x in row] for row in v.inputs]
    store = DictStore(v.store)
    if executor == "ref":
        from ..ref.context import RefContext
        if v.mesh is None:
            outs = [ref_run(v.module, v.func, inputs[0], RefContext(store=store))]
        else:
            outs = run_spmd(v.module, v.func, inputs, v.mesh, timeout=30.0, stores=[store] * v.ranks)
    elif executor == "cpu":
        outs = [execute.run(v.module, v.func, inputs[0], "cpu")]
    else:
        ex = L0Executor(v.ranks, timeout=30.0)
        try:
            outs = ex.run([v.module] * v.ranks, v.func, inputs)
        finally:
            ex.close()
    return [[np.asarray(o) for o in row] for row in outs], inputs, store.items


def runs_on(v: Vector, executor: str) -> bool:
    """Whether `executor` runs vector `v`: the reference every vector; the cpu backend the
    vectors of one rank that do not touch a store (its store ops are the reference's); L0
    the vectors with a mesh."""
    store_ops = any(op.name.startswith("store_") for f in v.module.funcs.values() for op in f.ops)
    if executor == "ref":
        return True
    if executor == "cpu":
        return v.mesh is None and not store_ops
    return v.mesh is not None and not store_ops  # l0 (and exec_l1's processes)


def differences(got: Sequence[np.ndarray], want: Sequence[np.ndarray], what: str) -> str | None:
    """The first way `got` differs from `want` (count, shape, dtype, a value), or None."""
    if len(got) != len(want):
        return f"{what}: {len(got)} arrays, {len(want)} expected"
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"{what} {i}: {g.dtype}{list(g.shape)}, expected {w.dtype}{list(w.shape)}"
        name = next((n for n, d in DTYPES.items() if not d.is_quant and numpy_dtype(d) == w.dtype), None)
        if name in TOLERANCES:
            g64, w64 = g.astype(np.float64), w.astype(np.float64)
            rtol, atol = TOLERANCES[name]
            bad = ~(np.isclose(g64, w64, rtol=rtol, atol=atol, equal_nan=True) | ((g64 == w64) & np.isinf(w64)))
        elif name is not None:
            bad = g != w
        else:  # (quantized block bytes)
            bad = np.ascontiguousarray(g).view(np.uint8) != np.ascontiguousarray(w).view(np.uint8)
        if bad.any():
            at = np.unravel_index(int(np.flatnonzero(bad.reshape(-1))[0]), bad.shape) if bad.ndim else ()
            if name is None:
                return f"{what} {i}: the block bytes differ"
            return f"{what} {i}: at {list(map(int, at))} {g[at].item()!r}, expected {w[at].item()!r}"
    return None


def compare(v: Vector, outs: Sequence, inputs: Sequence) -> str | None:
    """The first way a run's outputs (`outs`, a list per rank) or the inputs an `assign`
    wrote (`inputs[rank][position]`) differ from vector `v`'s, or None."""
    for r in range(v.ranks):
        where = f"rank {r} output" if v.ranks > 1 else "output"
        problem = differences(outs[r], v.outputs[r], where)
        if problem:
            return problem
        for i, want in v.assigned[r].items():
            problem = differences([inputs[r][i]], [want], f"assigned input {i}")
            if problem:
                return problem
    return None


def check(v: Vector, executor: str) -> str | None:
    """None when `executor` gives vector `v`'s expected outputs, store and assigned values,
    else the first difference."""
    outs, inputs, store = run_one(v, executor)
    problem = compare(v, outs, inputs)
    if problem:
        return problem
    if executor == "ref" and v.stored:
        missing = sorted(set(v.stored) - set(store))
        if missing:
            return f"the store lacks {missing} after the run"
        for k, want in v.stored.items():
            problem = differences([np.asarray(store[k])], [want], f"stored {k!r}")
            if problem:
                return problem
    return None


def read_vectors(root: pathlib.Path) -> tuple[list[Vector], list[VectorResult]]:
    """The manifest's vectors that can be read, and a failure (kind "valid") naming each
    that cannot (a missing file, an array that is not one) or the manifest itself (another
    spec version)."""
    manifest = manifest_or_failure(root, this_version=True)
    if isinstance(manifest, VectorResult):
        return [], [manifest]
    vectors, problems = [], []
    for name in sorted(manifest.get("vectors", {})):
        try:
            vectors.append(load(root, name))
        except (OSError, ValueError, KeyError, DTMError) as e:
            problems.append(VectorResult(name, "valid", False, f"cannot read the vector: {e}"))
    return vectors, problems


def run_exec_vectors(root: pathlib.Path | None = None, executors: Sequence[str] = EXECUTORS) -> list[VectorResult]:
    """Every vector of the manifest on each executor that runs it (a result's kind:
    "ref", "cpu" or "l0"). A vector that cannot be read (a missing file, an array that is
    not one, a manifest of another spec version) is a failure that names it (kind "valid"),
    and the others still run."""
    vectors, results = read_vectors(root or default_root())
    for v in vectors:
        for executor in executors:
            if not runs_on(v, executor):
                continue
            try:
                problem = check(v, executor)
            except DTMError as e:
                problem = f"raised {e.code.value}: {e.message}"
            results.append(VectorResult(v.name, executor, problem is None, problem or ""))
    return results


__all__ = ["run_exec_vectors", "read_vectors", "runs_on", "compare", "differences", "load", "check", "Vector", "encode_array",
           "decode_array", "EXECUTORS", "TOLERANCES", "default_root", "run_one", "DictStore"]
