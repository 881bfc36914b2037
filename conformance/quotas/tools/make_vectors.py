#!/usr/bin/env python3
"""Write the quota vectors (spec 9.4.14): the size notation of 9.4.13, and sequences of store
operations under the per-prefix quotas of 9.2.7 with the outcome of each.

The outcomes come from the rules themselves, modelled here in a few lines (a dict of keys
to byte counts, not a store): a put of `nbytes` under `key` would use `du(p) - old +
nbytes` under each quota's prefix `p` that `key` starts with, `old` being what the key
holds now (0 for a new key); when that passes a quota the put fails with E1103 and changes
nothing. A tensor's bytes are its storage size: elements times the dtype's size, or for a
quantized dtype its blocks times the block's bytes (2.2). Sizes are written by hand with
their byte counts, each from 9.4.13's rule.

    .venv/bin/python conformance/quotas/tools/make_vectors.py          # write
    .venv/bin/python conformance/quotas/tools/make_vectors.py --check  # compare; exit 1 on drift
"""

from __future__ import annotations

import json
import math
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]  # conformance/quotas
sys.path.insert(0, str(ROOT.parents[1]))  # the repository, so `dtm` imports without installing

from dtm.ir.conformance import generator_main  # noqa: E402
from dtm.ir.dtypes import DTYPES  # noqa: E402
from dtm.ir.version import SPEC_VERSION  # noqa: E402

KI, MI, GI, TI = 1 << 10, 1 << 20, 1 << 30, 1 << 40
# (text, its bytes or the error code): 9.4.13's notation
SIZES = [
    ("1000000", 1000000), ("0", 0), ("2G", 2 * GI), ("512M", 512 * MI), ("1.5G", 3 * GI // 2), ("3T", 3 * TI),
    ("64K", 64 * KI), ("1KiB", KI), ("1MiB", MI), ("2GB", 2 * GI), ("100B", 100), ("1k", KI), ("2gib", 2 * GI),
    ("0.1G", GI // 10), ("0.5K", 512), (".5M", MI // 2), ("1.7", 1), ("1.", 1), (" 8M ", 8 * MI), ("4 G", 4 * GI),
    ("", "E0306"), ("12X", "E0306"), ("-1G", "E0306"), ("+1", "E0306"), ("1e3", "E0306"), ("inf", "E0306"),
    ("nan", "E0306"), (".", "E0306"), ("G", "E0306"), ("1.5.5", "E0306"), ("1 GB B", "E0306"), ("0x10", "E0306"),
]

# name: (what it pins, its steps without outcomes). A step is {"quota": PREFIX, "bytes": N or
# null (removed)}, {"put": KEY, "dtype": D, "shape": [...]}, {"delete": KEY} or {"du": PREFIX}.
VECTORS = {
    "whole_store": ("the prefix \"\" limits the whole store; a refused put leaves no key", [
        {"quota": "", "bytes": 100}, {"put": "a", "dtype": "f32", "shape": [16]}, {"put": "b", "dtype": "f32", "shape": [10]},
        {"du": ""}, {"put": "b", "dtype": "f32", "shape": [9]}, {"du": ""}, {"put": "c", "dtype": "u8", "shape": [1]}]),
    "prefix": ("a quota limits only keys under its prefix", [
        {"quota": "tmp/", "bytes": 64}, {"put": "tmp/x", "dtype": "f64", "shape": [8]}, {"put": "tmp/y", "dtype": "u8", "shape": [1]},
        {"put": "keep/y", "dtype": "f64", "shape": [100]}, {"put": "tmpfile", "dtype": "u8", "shape": [65]},
        {"du": "tmp/"}, {"du": ""}]),
    "nested": ("every quota whose prefix a key starts with is checked", [
        {"quota": "run/", "bytes": 100}, {"quota": "run/grads/", "bytes": 40}, {"put": "run/grads/w", "dtype": "f32", "shape": [10]},
        {"put": "run/grads/b", "dtype": "f32", "shape": [1]}, {"put": "run/w", "dtype": "f32", "shape": [15]},
        {"put": "run/v", "dtype": "f32", "shape": [1]}, {"du": "run/"}, {"du": "run/grads/"}]),
    "replacing": ("a put that replaces a key counts the old tensor's bytes as freed", [
        {"quota": "", "bytes": 100}, {"put": "w", "dtype": "f32", "shape": [20]}, {"put": "w", "dtype": "f32", "shape": [25]},
        {"put": "w", "dtype": "f32", "shape": [26]}, {"du": ""}, {"put": "w", "dtype": "f16", "shape": [50]}, {"du": ""}]),
    "delete_frees": ("a delete gives its bytes back", [
        {"quota": "q/", "bytes": 48}, {"put": "q/a", "dtype": "i64", "shape": [4]}, {"put": "q/b", "dtype": "i64", "shape": [4]},
        {"delete": "q/a"}, {"put": "q/b2", "dtype": "i64", "shape": [2]}, {"du": "q/"}]),
    "lowered_below_use": ("a quota set below what is in use refuses every put that would leave more than it, "
                          "a smaller replacement included", [
        {"put": "m/a", "dtype": "f32", "shape": [30]}, {"quota": "m/", "bytes": 100},
        {"put": "m/a", "dtype": "f32", "shape": [28]}, {"put": "m/a", "dtype": "f32", "shape": [25]},
        {"put": "m/b", "dtype": "bool", "shape": [0]}, {"du": "m/"}]),
    "zero_and_removed": ("a quota of 0 admits only empty tensors; a removed quota no longer limits", [
        {"quota": "z/", "bytes": 0}, {"put": "z/empty", "dtype": "f32", "shape": [0, 3]}, {"put": "z/one", "dtype": "u8", "shape": [1]},
        {"quota": "z/", "bytes": None}, {"put": "z/one", "dtype": "u8", "shape": [1]}, {"du": "z/"}]),
    "storage_sizes": ("a tensor's bytes are its storage: narrow floats, booleans, quantized blocks", [
        {"quota": "", "bytes": 200}, {"put": "h", "dtype": "bf16", "shape": [2, 8]}, {"put": "f8", "dtype": "f8e4m3", "shape": [10]},
        {"put": "q", "dtype": "q8_0", "shape": [2, 32]}, {"du": ""}, {"put": "q4", "dtype": "q4_0", "shape": [64]},
        {"put": "q4", "dtype": "q4_0", "shape": [32]}, {"du": ""}]),
}


def nbytes(dtype: str, shape: list[int]) -> int:
    """A tensor's storage size (2.1, 2.2)."""
    dt = DTYPES[dtype]
    if dt.is_quant:
        return math.prod(shape[:-1]) * (shape[-1] // dt.block) * dt.itemsize
    return math.prod(shape) * dt.itemsize


def outcomes(steps: list[dict]) -> list[dict]:
    """The steps with what each gives: a put's "expect" ("ok" or "E1103"), a du's bytes."""
    held: dict[str, int] = {}
    quotas: dict[str, int] = {}
    out = []
    for step in steps:
        step = dict(step)
        if "quota" in step:
            if step["bytes"] is None:
                quotas.pop(step["quota"], None)
            else:
                quotas[step["quota"]] = step["bytes"]
        elif "put" in step:
            key, n = step["put"], nbytes(step["dtype"], step["shape"])
            over = [p for p, limit in quotas.items() if key.startswith(p)
                    and sum(b for k, b in held.items() if k.startswith(p)) - held.get(key, 0) + n > limit]
            step["expect"] = "E1103" if over else "ok"
            if not over:
                held[key] = n
        elif "delete" in step:
            del held[step["delete"]]
        else:
            step["expect"] = sum(b for k, b in held.items() if k.startswith(step["du"]))
        out.append(step)
    return out


def files() -> dict[pathlib.Path, str]:
    out = {ROOT / "valid" / f"{name}.json": json.dumps({"pins": pins, "steps": outcomes(steps)}, indent=1) + "\n"
           for name, (pins, steps) in VECTORS.items()}
    out[ROOT / "manifest.json"] = json.dumps({"spec_version": ".".join(map(str, SPEC_VERSION)),
                                              "sizes": [list(s) for s in SIZES], "vectors": sorted(VECTORS)},
                                             indent=1) + "\n"
    return out


def main(argv: list[str] | None = None) -> int:
    return generator_main(argv, __doc__.split("\n")[0], files(), "the spec's rules",
                          f"{len(VECTORS)} vectors and {len(SIZES)} sizes written to {ROOT}")

if __name__ == "__main__":
    sys.exit(main())
