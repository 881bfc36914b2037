"""dtm.save and dtm.load: nested dicts, lists and tuples of tensors and plain values
(int, float, str, bool, None) in one file, never pickle.

    dtm.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 1000}, "ckpt.safetensors")
    ckpt = dtm.load("ckpt.safetensors")

The file is safetensors (weights.py): the tensors by number, and in its metadata the
structure as JSON, where each tensor appears as {"tensor": number}, a dict as {"dict":
[[key, value], ...]} (so int keys, an optimizer state's, stay ints), a list as {"list":
[...]} and a tuple as {"tuple": [...]}. A tensor reached twice (tied weights) is stored
once and loads as one tensor. Loading reads JSON and array bytes only: nothing in the file
is executed. A plain safetensors file (module.save) loads as its dict of tensors.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import DTMError, ErrorCode
from ..functional import check_device
from ..tensor import Tensor, error
from .weights import read_safetensors, save_safetensors

FORMAT = "dtm.save/1"
MAX_DEPTH = 256  # nesting beyond this is a corrupt or hostile file, not a checkpoint


def save(obj: Any, path: str) -> None:
    """Write `obj` to `path` atomically (a crash leaves the old file or the new one)."""
    tensors: dict[str, Tensor] = {}
    names: dict[int, str] = {}

    def encode(x: Any, where: str) -> Any:
        if isinstance(x, Tensor):
            if id(x) not in names:
                names[id(x)] = str(len(names))
                tensors[names[id(x)]] = x
            return {"tensor": names[id(x)]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, dict):
            for k in x:
                if isinstance(k, bool) or not isinstance(k, (int, str)):
                    raise error(ErrorCode.ATTRIBUTE_TYPE, f"dtm.save: key {k!r} of {where} is a {type(k).__name__}; "
                                "keys must be str or int")
            return {"dict": [[k, encode(v, f"{where}[{k!r}]")] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            return {"tuple" if isinstance(x, tuple) else "list": [encode(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        raise error(ErrorCode.ATTRIBUTE_TYPE, f"dtm.save: {where} is a {type(x).__name__}; dtm.save stores tensors, "
                    "dicts, lists, tuples, int, float, str, bool and None")

    structure = json.dumps(encode(obj, "the object"))
    save_safetensors(tensors, path, metadata={"format": FORMAT, "structure": structure})


def load(path: str, map_location: Any = None, weights_only: bool = True) -> Any:
    """What `save` wrote to `path`, with fresh tensors; a DTMError naming the file when it
    is not such a file or is damaged. `map_location`, as torch.load takes it, may name the
    CPU (where every DTM tensor loads) and nothing else; `weights_only` is always the case
    here (the file holds no code)."""
    if map_location is not None:
        check_device(map_location, f"dtm.load({path!r})")
    tensors, metadata = read_safetensors(path)
    if metadata.get("format") != FORMAT:
        if "structure" in metadata:
            raise DTMError(ErrorCode.UNSUPPORTED_VERSION, f"{path}: saved as format {metadata.get('format')!r}, "
                           f"this DTM reads {FORMAT!r}")
        return tensors

    def bad(why: str) -> DTMError:
        return DTMError(ErrorCode.BAD_ENCODING, f"{path}: damaged dtm.save file: {why}")

    def decode(x: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise bad(f"nested deeper than {MAX_DEPTH}")
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if not isinstance(x, dict) or len(x) != 1:
            raise bad(f"unexpected {type(x).__name__} in the structure")
        (kind, body), = x.items()
        if kind == "tensor":
            if body not in tensors:
                raise bad(f"the structure names tensor {body!r}, which the file does not hold")
            return tensors[body]
        if kind in ("list", "tuple") and isinstance(body, list):
            items = [decode(v, depth + 1) for v in body]
            return items if kind == "list" else tuple(items)
        if kind == "dict" and isinstance(body, list):
            out = {}
            for pair in body:
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (int, str))
                        and not isinstance(pair[0], bool)):
                    raise bad("a dict entry is not a [key, value] pair")
                out[pair[0]] = decode(pair[1], depth + 1)
            return out
        raise bad(f"unknown entry {kind!r}")

    try:
        structure = json.loads(metadata["structure"])
    except (KeyError, ValueError, RecursionError) as e:
        raise bad(f"the structure is not JSON ({type(e).__name__})") from None
    return decode(structure, 0)


__all__ = ["save", "load"]
