#!/usr/bin/env python3
"""Write the execution vectors (spec 8.4) from the spec itself: for each op entry's (last) example
module (docs/spec/dtm-spec.md, 3.x), inputs drawn once (a fixed seed per op, values in the
op's domain: positive where a logarithm or a root needs it, indices in range, divisors that
are not zero), and the outputs the reference interpreter gives them (on one thread per rank
where the example declares a mesh). Symbolic dims of an example are bound to small sizes
(`SIZES`). The store ops run against a store holding random arrays under the keys the
example names.

    .venv/bin/python conformance/exec/tools/make_vectors.py          # write
    .venv/bin/python conformance/exec/tools/make_vectors.py --check  # compare with what is written; exit 1 on drift

Review `git diff conformance/exec` before committing: a changed expected output is a change
of the reference's semantics, which other implementations must follow.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import zlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]  # conformance/exec
sys.path.insert(0, str(ROOT.parents[1]))  # the repository, so `dtm` imports without installing

from dtm.ir import parse  # noqa: E402
from dtm.ir.dtypes import numpy_dtype  # noqa: E402
from dtm.ir.symbolic import is_static  # noqa: E402
from dtm.ir.version import SPEC_VERSION  # noqa: E402
from dtm.ref.context import RefContext  # noqa: E402
from dtm.ref.interpreter import run  # noqa: E402
from dtm.ref.local_group import run_spmd  # noqa: E402
from dtm.runtime.exec_vectors import DictStore, encode_array  # noqa: E402

SPEC = ROOT.parents[1] / "docs" / "spec" / "dtm-spec.md"
SIZES = {"B": 2, "T": 3, "V": 5, "N": 4, "S": 3, "D": 4, "H": 2, "K": 3, "M": 2}  # symbols; others: 3
POSITIVE = {"log", "log2", "sqrt", "rsqrt", "pow"}  # float operands drawn in [0.5, 4]
NONZERO_DIVISOR = {"div", "mod"}  # the second operand drawn away from zero
# ops without a vector of their own, and why (none now: send's and recv's entries end with
# a whole program, each rank sending to itself, after the halves of a pipeline)
SKIPPED: dict[str, str] = {}


def examples() -> dict[str, str]:
    """{op: the text of its entry's last example module}, in the spec's order (an entry's
    last example is a whole program where the first shows half of one: send, recv)."""
    lines = SPEC.read_text(encoding="utf-8").split("\n")
    out: dict[str, str] = {}
    op, decomposition, i = None, False, 0
    while i < len(lines):
        m = re.match(r"^#### `([a-z_0-9]+)`$", lines[i])
        if m:
            op, decomposition = m.group(1), False
        elif re.match(r"^#{1,3} ", lines[i]):
            op = None
        elif lines[i].strip() == "**Decomposition**":
            decomposition = True
        elif lines[i].startswith("```dtm") and op is not None and not decomposition:
            body, i = [], i + 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            out[op] = "\n".join(body) + "\n"
        i += 1
    return out


def _shape(t) -> tuple[int, ...]:
    return tuple(int(d) if is_static(d) else SIZES.get(str(d), 3) for d in t.shape)


def draw(op: str, func, rng: np.random.Generator) -> list[np.ndarray]:
    """Inputs for the example's function: in the op's domain, indices in range."""
    params = func.params
    shapes = [_shape(p.type) for p in params]
    out = []
    for k, (p, shape) in enumerate(zip(params, shapes)):
        dt = p.type.dtype
        if dt.is_quant:
            from dtm.ref.quant import quantize
            out.append(quantize(rng.standard_normal(shape).astype(np.float32), dt))
            continue
        npd = numpy_dtype(dt)
        if dt.name == "bool":
            a = rng.integers(0, 2, shape).astype(bool)
        elif dt.is_float:
            if op in POSITIVE:
                a = rng.uniform(0.5, 4.0, shape)
            elif op in NONZERO_DIVISOR and k == 1:
                a = rng.uniform(0.5, 3.0, shape) * rng.choice([-1, 1], shape)
            else:
                a = rng.standard_normal(shape)
        elif op in ("gather", "scatter_add", "check") and k == 1:
            bound = 1 if op == "check" else shapes[0][0]  # (the examples index dim 0; check's scales by 10)
            a = rng.integers(0, bound, shape)
        elif op in ("dynamic_slice", "dynamic_update_slice") and not shape:
            a = np.array(rng.integers(0, 5))
        elif op == "random":
            a = rng.integers(0, 2**32, shape, dtype=np.uint64)
        elif dt.name.startswith("u"):
            a = rng.integers(0, 10, shape)
        elif op in NONZERO_DIVISOR and k == 1:
            a = rng.integers(1, 6, shape) * rng.choice([-1, 1], shape)
        else:
            a = rng.integers(-6, 7, shape)
        out.append(np.asarray(a).astype(npd))
    return out


def make(op: str, text: str) -> dict:
    """The vector of `op`'s example: its files' JSON document."""
    module = parse(text)
    func = next(iter(module.funcs))
    f = module.funcs[func]
    rng = np.random.default_rng(zlib.crc32(op.encode()))
    meshes = list(module.meshes)
    ranks = module.meshes[meshes[0]].size if meshes else 1
    keys = sorted({o.attrs["key"] for o in f.ops if o.name == "store_get"})
    store = DictStore({k: rng.standard_normal(_shape(o.results[0].type)).astype(numpy_dtype(o.results[0].type.dtype))
                       for o in f.ops if o.name == "store_get" for k in [o.attrs["key"]]})
    before = {k: v.copy() for k, v in store.items.items()}
    inputs = [draw(op, f, rng) for _ in range(ranks)]
    given = [[x.copy() for x in row] for row in inputs]
    if meshes:
        outputs = run_spmd(module, func, inputs, meshes[0], timeout=30.0, stores=[store] * ranks)
    else:
        outputs = [run(module, func, inputs[0], RefContext(store=store))]
    targets = {i for o in f.ops if o.name == "assign" for i, p in enumerate(f.params) if p is o.operands[0]}
    dtypes = [p.type.dtype.name for p in f.params]
    results = [t.dtype.name for t, _ in f.result_types]
    doc = {"func": func, "ranks": ranks,
           "inputs": [[encode_array(x, d) for x, d in zip(row, dtypes)] for row in given],
           "outputs": [[encode_array(np.asarray(y), d) for y, d in zip(row, results)] for row in outputs]}
    if keys:
        doc["store"] = {k: encode_array(before[k]) for k in keys}
    if any(o.name == "store_put" for o in f.ops):
        doc["stored"] = {k: encode_array(v) for k, v in sorted(store.items.items())}
    if targets:
        doc["assigned"] = [{str(i): encode_array(row[i], dtypes[i]) for i in sorted(targets)} for row in inputs]
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the files; write nothing")
    args = ap.parse_args()
    vectors, drift = {}, []
    for op, text in examples().items():
        if op in SKIPPED:
            continue
        doc = make(op, text)
        module = parse(text)
        vectors[op] = {"ops": sorted({o.name for f in module.funcs.values() for o in f.ops}), "ranks": doc["ranks"]}
        arrays = [a for key in ("inputs", "outputs") for row in doc[key] for a in row]
        if any("hex" in a for a in arrays):
            vectors[op]["quantized"] = True
        files = {ROOT / "valid" / f"{op}.dtm": text, ROOT / "valid" / f"{op}.json": json.dumps(doc, indent=1) + "\n"}
        for path, content in files.items():
            if args.check:
                if not path.exists() or path.read_text(encoding="utf-8") != content:
                    drift.append(path.name)
            else:
                path.write_text(content, encoding="utf-8")
    manifest = json.dumps({"spec_version": ".".join(map(str, SPEC_VERSION)), "vectors": vectors,
                           "skipped": SKIPPED}, indent=1) + "\n"
    if args.check:
        if (ROOT / "manifest.json").read_text(encoding="utf-8") != manifest:
            drift.append("manifest.json")
        for name in drift:
            print(f"differs from what the spec and the reference give: {name}")
        return 1 if drift else 0
    (ROOT / "manifest.json").write_text(manifest, encoding="utf-8")
    print(f"{len(vectors)} vectors written to {ROOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
