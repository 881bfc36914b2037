"""The runner for the checkpoint vectors in `conformance/checkpoint/` (spec 9.4.8).

    results = run_checkpoint_vectors()   # default root: the repository's conformance/checkpoint
    print(summary(results))              # one line per failing vector, then "N passed, M failed"

Each vector works on a copy of a checkpoint root in a temporary directory (the files under
`conformance/` are never written): `valid/NAME/` is a checkpoint root without the store's
own index, which this implementation rebuilds in the copy (spec 9.2.12) before loading.

- `manifest.json["valid"][NAME]["loads"]`: each load reads the checkpoint into a state
  shaped as its manifest's trees say, every tensor laid out as the load lists it (whole on
  no mesh; else on the load's mesh of virtual devices with its placements), and must give
  each rank's piece with the shape and CRC32C (of its little-endian bytes in row-major
  order) listed, and the plain `values` listed (by their path in the state).
- `manifest.json["invalid"][NAME]`: a copy of valid vector `base` with one `damage` (a
  chunk truncated, a bit flipped, a file removed, manifest fields replaced) must fail with
  the error `code` in each load its base lists, changing nothing.

Nothing here is a pytest test: `tests/test_checkpoint_conformance.py` and
`dtm conformance checkpoint` both call `run_checkpoint_vectors`.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import tempfile
from typing import Any, Callable

import numpy as np

from .. import store as _store
from ..errors import DTMError
from ..ir.conformance import VectorResult, manifest_or_failure, summary  # one result type and report for every vector set
from ..ir.conformance import load_manifest as _load_manifest
from ..ir.types import Placement, Replicate, Shard
from ..runtime import l0
from ..runtime.mesh import DeviceMesh
from ..store.crc import checksum
from . import _flat_tensors, _complete, load, read_manifest
from . import manifest as mf

DEFAULT_ROOT = pathlib.Path(__file__).resolve().parents[2] / "conformance" / "checkpoint"


class _Like:
    """What a load needs of a live tensor (its type, mesh and placements): the template a
    vector's load is read into."""

    def __init__(self, entry: dict, mesh: DeviceMesh | None, placements: tuple[Placement, ...] | None):
        self.shape, self.dtype = tuple(entry["shape"]), entry["dtype"]
        self.device_mesh, self.placements = mesh, placements

    def numpy(self) -> np.ndarray:  # (marks it a tensor: mf.is_tensor)
        raise TypeError("a load template holds no values")


def _placement(text: str) -> Placement:
    """A placement as spec 2.7 prints it: `replicate` or `shard(D)`."""
    if text == "replicate":
        return Replicate()
    if text.startswith("shard(") and text.endswith(")") and text[6:-1].isdigit():
        return Shard(int(text[6:-1]))
    raise ValueError(f"{text!r} is not a placement a load reads into (replicate, shard(D))")


def _mesh(desc: dict | None) -> DeviceMesh | None:
    """The mesh of virtual devices a load names ({"axes": [[name, size], ...]}), or None."""
    if desc is None:
        return None
    axes = tuple((str(a), int(n)) for a, n in desc["axes"])
    size = int(np.prod([n for _, n in axes]))
    devices = l0.executor().devices
    if len(devices) < size:  # (only ever more devices: meshes made before keep theirs)
        devices = l0.set_device_count(size).devices
    return DeviceMesh(axes, tuple(devices[:size]))


def _template(ckpt: pathlib.Path, tensors: dict, mesh: DeviceMesh | None) -> dict:
    """A state shaped as the checkpoint's manifest says, each tensor a `_Like` laid out as
    `tensors` ({name: {"placements": [...] or None}}) lists it."""
    doc = read_manifest(ckpt)
    by_name = {t["name"]: t for t in doc["tensors"]}

    def like(name: str) -> _Like:
        spec = tensors.get(name, {}).get("placements")
        return _Like(by_name[name], mesh if spec is not None else None,
                     tuple(_placement(p) for p in spec) if spec is not None else None)

    return {n: mf.decode(e["tree"], like, str(ckpt)) for n, e in doc["state"].items()}


def _pieces(x: Any) -> list[np.ndarray]:
    """A loaded tensor's pieces in rank order (one, a whole array, on no mesh)."""
    if callable(getattr(x, "local_shards", None)):
        return [np.asarray(p.numpy()) for p in x.local_shards()]
    return [np.asarray(x)]


def _at(state: Any, path: str) -> Any:
    """The value at `path` (keys and indices joined by `/`) in a loaded state."""
    for part in path.split("/"):
        if isinstance(state, dict):
            state = state[part] if part in state else state[int(part)]
        else:
            state = state[int(part)]
    return state


def _check_load(ckpt: pathlib.Path, case: dict, values: dict) -> str | None:
    """Load the checkpoint as `case` says; None when every piece and value is the one listed."""
    state = _template(ckpt, case["tensors"], _mesh(case["mesh"]))
    load(state, ckpt)
    loaded: dict = {}
    for n in state:
        _flat_tensors(state[n], n, loaded)
    if set(loaded) != set(case["tensors"]):
        return f"loaded tensors {sorted(loaded)}, the vector lists {sorted(case['tensors'])}"
    for name, want in case["tensors"].items():
        got = _pieces(loaded[name])
        if len(got) != len(want["pieces"]):
            return f"{name}: {len(got)} pieces, expected {len(want['pieces'])}"
        for r, (p, w) in enumerate(zip(got, want["pieces"])):
            crc = f"{checksum(np.ascontiguousarray(p).astype(p.dtype.newbyteorder('<')).tobytes()):08x}"
            if list(p.shape) != w["shape"] or crc != w["crc32c"]:
                return f"{name}, rank {r}: shape {list(p.shape)} CRC32C {crc}, expected {w['shape']} {w['crc32c']}"
    for path, want in values.items():
        try:
            got = _at(state, path)
        except (KeyError, IndexError, ValueError, TypeError):
            return f"the loaded state has no value at {path!r}"
        if got != want:
            return f"{path}: {got!r}, expected {want!r}"
    return None


def _damage(ckpt: pathlib.Path, damage: dict) -> None:
    """Apply one damage, as manifest.json's `invalid` entries describe it, to a copy."""
    if "truncate" in damage:
        f = ckpt / damage["truncate"]
        f.write_bytes(f.read_bytes()[:-int(damage["remove_bytes"])])
    elif "flip" in damage:
        f = ckpt / damage["flip"]
        raw = bytearray(f.read_bytes())
        raw[int(damage["offset"])] ^= int(damage["mask"])
        f.write_bytes(bytes(raw))
    elif "remove" in damage:
        (ckpt / damage["remove"]).unlink()
    elif "manifest" in damage:
        (step, d), = _complete(str(ckpt))
        f = pathlib.Path(d) / mf.MANIFEST
        f.write_text(json.dumps({**json.loads(f.read_text()), **damage["manifest"]}))
    else:
        raise ValueError(f"unknown damage {sorted(damage)}")


def _with_copy(vector: pathlib.Path, run: Callable[[pathlib.Path], str | None]) -> str | None:
    """`run` on a copy of checkpoint root `vector` whose store indexes are rebuilt."""
    with tempfile.TemporaryDirectory(prefix="dtm-ckpt-vector-") as tmp:
        ckpt = pathlib.Path(tmp) / vector.name
        shutil.copytree(vector, ckpt)
        for step_dir in sorted(ckpt.glob("step-*")):
            _store.recover(step_dir)
        return run(ckpt)


def _valid(vector: pathlib.Path, case: dict, values: dict) -> str | None:
    def run(ckpt: pathlib.Path) -> str | None:
        try:
            return _check_load(ckpt, case, values)
        except (DTMError, KeyError, ValueError, TypeError) as e:
            return f"load failed: {type(e).__name__}: {e}"
    return _with_copy(vector, run)


def _invalid(vector: pathlib.Path, entry: dict, case: dict) -> str | None:
    def run(ckpt: pathlib.Path) -> str | None:
        state = _template(ckpt, case["tensors"], _mesh(case["mesh"]))
        try:
            _damage(ckpt, entry["damage"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"its damage {entry.get('damage')} cannot be applied: {e}"
        before = {n: _flat_tensors(v, n, {}) for n, v in state.items()}
        try:
            load(state, ckpt)
        except DTMError as e:
            if e.code.value != entry["code"]:
                return f"{e.code.value} ({e}), expected {entry['code']}"
            changed = [n for n, v in state.items() if _flat_tensors(v, n, {}) != before[n]]
            return f"it failed but changed {changed}" if changed else None
        return f"it loaded, expected {entry['code']}"
    return _with_copy(vector, run)


def load_manifest(root: pathlib.Path | None = None) -> dict:
    """The vectors' manifest.json (default root: the repository's conformance/checkpoint)."""
    return _load_manifest(pathlib.Path(root) if root is not None else DEFAULT_ROOT)


def run_checkpoint_vectors(root: pathlib.Path | None = None) -> list[VectorResult]:
    """Run every vector under `root` (default: the repository's conformance/checkpoint): each
    load of each valid checkpoint, then each damaged copy, sorted by name."""
    root = pathlib.Path(root) if root is not None else DEFAULT_ROOT
    manifest = manifest_or_failure(root)
    if isinstance(manifest, VectorResult):
        return [manifest]
    results = []
    valid = manifest.get("valid", {})
    dirs = {p.name for p in (root / "valid").iterdir() if p.is_dir()} if (root / "valid").is_dir() else set()
    for name in sorted(set(valid) | dirs):
        if name not in dirs or name not in valid:
            results.append(VectorResult(name, "valid", False, f"in the manifest, but valid/{name}/ is missing"
                                        if name not in dirs else f"valid/{name}/ has no manifest entry"))
            continue
        for case in valid[name].get("loads", []):
            problem = _valid(root / "valid" / name, case, valid[name].get("values", {}))
            results.append(VectorResult(f"{name}/{case['name']}", "valid", problem is None, problem or ""))
    for name, entry in sorted(manifest.get("invalid", {}).items()):
        base = entry.get("base")
        if base not in dirs or base not in valid:
            results.append(VectorResult(name, "invalid", False, f"its base valid/{base}/ is missing"))
            continue
        for case in valid[base].get("loads", []):  # every load of its base must refuse it
            problem = _invalid(root / "valid" / base, entry, case)
            results.append(VectorResult(f"{name}/{case['name']}", "invalid", problem is None, problem or ""))
    return results


__all__ = ["run_checkpoint_vectors", "summary", "load_manifest", "DEFAULT_ROOT", "VectorResult"]
