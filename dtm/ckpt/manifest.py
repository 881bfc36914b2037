"""A checkpoint's manifest (spec 9.4.2): the JSON document written last into a step
directory, and the tree encoding of the saved state's plain values and tensor references.

A tree node is one of: {"tensor": NAME} (a saved tensor), {"value": V} (null, a bool, an
int, a finite float or a string), {"float": "nan" | "inf" | "-inf"}, {"list": [NODE...]},
{"tuple": [NODE...]}, {"dict": [[KEY, NODE]...]} (KEY a string or an int, order kept).
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from ..ir.version import PACKAGE_VERSION, SPEC_VERSION
from .errors import CheckpointInvalid, CheckpointVersionError
from .place import Place

FORMAT = "dtm-checkpoint"
FORMAT_VERSION = (1, 0)  # major.minor: a reader reads every minor of its major (spec 9.4.2)
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 256 << 20  # bounded before it is read
MAX_DEPTH = 64


def is_tensor(x: Any) -> bool:
    """A dtm.Tensor (plain or distributed), a numpy array or anything array-like with a
    dtype and shape and `numpy()`: saved as a tensor, not a value (duck-typed, layer 8)."""
    known = _KNOWN_CLASSES.get(type(x))
    if known is not None:
        return known
    import numpy as np

    if isinstance(x, np.ndarray):
        _KNOWN_CLASSES[type(x)] = True
        return True
    found = hasattr(x, "shape") and hasattr(x, "dtype") and callable(getattr(x, "numpy", None))
    cls = type(x)
    if found and hasattr(cls, "shape") and hasattr(cls, "dtype") and callable(getattr(cls, "numpy", None)):
        _KNOWN_CLASSES[cls] = True  # (the class itself has them: so has every instance)
    return found


# The classes whose every instance is_tensor answers alike, with the answer: a snapshot
# walks a state of hundreds of nodes every training step. Plain values have no attributes
# of their own; a class is added once its own attributes make an instance a tensor.
_KNOWN_CLASSES: dict[type, bool] = {t: False for t in (type(None), bool, int, float, str, list, tuple, dict)}


def local_arrays(x: Any) -> list:
    """A distributed tensor's pieces as numpy arrays (None where another process holds one):
    its `local_arrays()` (no Tensor around each piece) when it has that, else its
    `local_shards()` as arrays."""
    import numpy as np

    if callable(getattr(x, "local_arrays", None)):
        return x.local_arrays()
    return [None if s is None else np.asarray(s) for s in x.local_shards()]


def is_object(v: Any) -> bool:
    """An object saved through its state dict (a model, an optimizer, a loader), not a tensor."""
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None)) \
        and not is_tensor(v)


def encode_state(state: dict, tensor: Callable[[str, Any], None]) -> dict:
    """The manifest's `state` field of a training state ({name: an object with
    state_dict(), a tensor or a plain value}); `tensor(name, x)` is called for each tensor.
    TypeError for a name or value a checkpoint does not hold."""
    entries: dict[str, dict] = {}
    for name, v in state.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise TypeError(f"a state name is a non-empty string without '/', not {name!r}")
        if is_object(v):
            entries[name] = {"kind": "object", "tree": encode(v.state_dict(), name, tensor)}
            if callable(getattr(v, "hf_config", None)):  # for `dtm checkpoint export`
                entries[name]["hf_config"] = v.hf_config()
        else:
            entries[name] = {"kind": "value", "tree": encode(v, name, tensor)}
    return entries


def encode(x: Any, name: str, tensor: Callable[[str, Any], None], depth: int = 0) -> dict:
    """The tree node of value `x` at path `name`; `tensor(name, x)` is called for each tensor."""
    if depth > MAX_DEPTH:
        raise TypeError(f"{name}: nested deeper than {MAX_DEPTH}")
    if type(x) is dict:  # (first: most nodes of a state dict are dicts, and a dict is never a tensor)
        return _encode_dict(x, name, tensor, depth)
    if is_tensor(x):
        tensor(name, x)
        return {"tensor": name}
    if x is None or isinstance(x, (bool, str)):
        return {"value": x}
    if isinstance(x, int) or type(x).__name__.startswith(("int", "uint")) and hasattr(x, "item"):
        return {"value": int(x)}
    if isinstance(x, float) or type(x).__name__.startswith("float") and hasattr(x, "item"):
        f = float(x)
        return {"value": f} if math.isfinite(f) else {"float": repr(f)}
    if isinstance(x, (list, tuple)):
        return {"list" if isinstance(x, list) else "tuple":
                [encode(v, f"{name}/{i}", tensor, depth + 1) for i, v in enumerate(x)]}
    if isinstance(x, dict):
        return _encode_dict(x, name, tensor, depth)
    raise TypeError(f"{name}: a {type(x).__name__} is not saved (a checkpoint holds tensors, objects with "
                    "state_dict(), and None, bool, int, float, str, list, tuple and dict)")


def _encode_dict(x: dict, name: str, tensor: Callable[[str, Any], None], depth: int) -> dict:
    """encode's node of the dict `x`: its items in order, keys strings or ints."""
    items = []
    for k, v in x.items():
        if not isinstance(k, (str, int)) or isinstance(k, bool):
            raise TypeError(f"{name}: a dict key is a string or an int, not {type(k).__name__}")
        items.append([k, encode(v, f"{name}/{k}", tensor, depth + 1)])
    return {"dict": items}


def decode(node: Any, tensor: Callable[[str], Any], where: str, depth: int = 0) -> Any:
    """The value of tree node `node`; `tensor(name)` gives each saved tensor. ValueError
    when the node is not one the encoding makes."""
    if not isinstance(node, dict) or len(node) != 1 or depth > MAX_DEPTH:
        raise ValueError(f"{where}: {str(node)[:80]} is not a value node")
    (kind, v), = node.items()
    if kind == "tensor" and isinstance(v, str):
        return tensor(v)
    if kind == "value" and (v is None or isinstance(v, (bool, int, float, str))):
        return v
    if kind == "float" and v in ("nan", "inf", "-inf"):
        return float(v)
    if kind in ("list", "tuple") and isinstance(v, list):
        out = [decode(n, tensor, where, depth + 1) for n in v]
        return out if kind == "list" else tuple(out)
    if kind == "dict" and isinstance(v, list):
        out = {}
        for item in v:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))):
                raise ValueError(f"{where}: a dict item is [key, node], not {str(item)[:80]}")
            out[item[0]] = decode(item[1], tensor, where, depth + 1)
        return out
    raise ValueError(f"{where}: {str(node)[:80]} is not a value node")


def new(step: int, entries: dict, tensors: list[dict], meshes: list[dict], created: float) -> dict:
    """The manifest document of a checkpoint."""
    return {"format": FORMAT, "format_version": "%d.%d" % FORMAT_VERSION, "dtm_version": PACKAGE_VERSION,
            "spec_version": ".".join(map(str, SPEC_VERSION)), "step": step, "time": created,
            "bytes": sum(t["nbytes"] for t in tensors), "meshes": meshes, "state": entries, "tensors": tensors}


def write(step_dir: str, doc: dict) -> None:
    """Write the manifest atomically: a temporary name, fsync, rename, fsync of the directory.
    The rename is the checkpoint's commit point."""
    write_json(step_dir, MANIFEST, doc, indent=1)


def write_json(step_dir: str, name: str, doc: dict, indent: int | None = None) -> None:
    """Write `doc` as file `name` of the step directory (a path or URL) atomically: in a
    directory a temporary name, fsync, rename, fsync of the directory; behind a URL one
    object written whole."""
    Place.of(step_dir).commit(name, json.dumps(doc, indent=indent, allow_nan=False).encode("utf-8"))


def read_json(step_dir: str, name: str, bound: int, what: str) -> Any:
    """The JSON document in file `name` of the step directory, its size checked against
    `bound` before it is read; E1403 naming `what` when it is larger or cannot be read or
    parsed."""
    place, path = Place.of(step_dir), f"{step_dir}/{name}"
    try:
        size = place.size(name)
        if size > bound:
            raise CheckpointInvalid(f"{path}: {size} bytes, the bound is {bound}", path)
        return json.loads(place.read(name).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointInvalid(f"{path}: {what} cannot be read: {e}", path) from None


def read(step_dir: str) -> dict:
    """The manifest of the step directory, checked: E1403 when it does not parse or lacks
    a field, E0601 when its major format version is newer than this reader's."""
    path = f"{step_dir}/{MANIFEST}"
    doc = read_json(step_dir, MANIFEST, MAX_MANIFEST_BYTES, "the manifest")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointInvalid(f"{path}: not a DTM checkpoint manifest (expected \"format\": \"{FORMAT}\")", path)
    version = str(doc.get("format_version", ""))
    try:
        major, minor = (int(p) for p in version.split("."))
    except ValueError:
        raise CheckpointInvalid(f"{path}: format_version {version!r} is not MAJOR.MINOR", path) from None
    if major > FORMAT_VERSION[0]:
        raise CheckpointVersionError(f"{path}: checkpoint format {version} (written by DTM "
                                     f"{doc.get('dtm_version', '?')}), this DTM {PACKAGE_VERSION} reads format "
                                     f"{FORMAT_VERSION[0]}.x; load it with a newer DTM", path)
    want = {"step": int, "time": (int, float), "bytes": int, "meshes": list, "state": dict, "tensors": list}
    for field, kind in want.items():
        if not isinstance(doc.get(field), kind) or isinstance(doc.get(field), bool):
            raise CheckpointInvalid(f"{path}: field {field!r} is missing or not a {getattr(kind, '__name__', 'number')}",
                                    path)
    for t in doc["tensors"]:
        if not (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("key"), str)
                and isinstance(t.get("dtype"), str) and isinstance(t.get("shape"), list)
                and isinstance(t.get("dir"), str) and isinstance(t.get("chunks"), list)):
            raise CheckpointInvalid(f"{path}: tensor entry {str(t)[:120]} lacks name, key, dtype, shape, dir or chunks",
                                    path)
    return doc
