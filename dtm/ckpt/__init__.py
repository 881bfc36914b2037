"""Checkpoints (spec 9.4): `save` a training state (objects with state_dict(), tensors,
plain values) into a directory, `load` it back in place onto whatever mesh and placements
the live tensors have now, `list` the complete ones.

    h = dtm.checkpoint.save({"model": m, "optim": opt, "step": 100}, "runs/a", step=100)
    h.wait()                                     # or h.done(), h.progress()
    dtm.checkpoint.load(state, "runs/a")         # the newest complete checkpoint
    dtm.checkpoint.list("runs/a")                # [Checkpoint(step, time, size, mesh, ...)]

Layout: ROOT/step-NNNNNNNNNNNN/ is a directory tensor store (dtm/store: Zarr v3 arrays with
CRC32C chunks, every tensor an array, none inline), and its `manifest.json`, written last
(temporary name, fsync, rename, fsync), is the commit point: a step directory without it
is an unfinished save, which list and load do not see. A distributed tensor is put piece by
piece by the ranks that hold it (dtm/store/sharded.py) and got back with the live tensor's
mesh and placements, each rank reading only the chunks its piece overlaps.

Layer: `dtm/ckpt` is row 8 of DESIGN.md's table. It imports the store, the runtime's
process group, `dtm/ir` and `dtm/errors`, and never the user-facing API: tensors, modules
and optimizers are duck-typed (`shape`, `dtype`, `numpy()`, `device_mesh`, `placements`,
`local_shards()`, `state_dict()`, `load_state_dict()`, `copy_()`).
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import store as _store
from ..errors import DTMError, ErrorCode
from ..runtime import process_group
from ..store import format as fmt
from ..store.crc import checksum as _crc
from ..store.files import fsync_dir
from ..store.errors import ChecksumError, KeyMissing, StoreCorrupt, StoreIOError
from ..store.store import as_store_dtype
from . import manifest as mf
from .errors import (CheckpointChunkError, CheckpointError, CheckpointExists, CheckpointInvalid, CheckpointKeyError,
                     CheckpointTypeError, CheckpointVersionError, NotACheckpoint)

__all__ = ["save", "load", "list", "verify", "export", "read_manifest", "Handle", "Checkpoint", "VerifyReport",
           "CheckpointError", "NotACheckpoint", "CheckpointInvalid", "CheckpointVersionError", "CheckpointExists",
           "CheckpointChunkError", "CheckpointKeyError", "CheckpointTypeError"]

_list = list  # (the module's `list` is the function below)
_STEP_DIR = re.compile(r"^step-(\d{12})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:012d}"


# --- saving -----------------------------------------------------------------------------

class _Frozen:
    """A copy of a distributed tensor's pieces taken when `save` was called, with what the
    store's sharded put reads (duck-typed as dtm/store/sharded.py expects)."""

    def __init__(self, x: Any):
        self.device_mesh = x.device_mesh
        self.placements = tuple(x.placements)
        self.dtype, self.shape = x.dtype, tuple(x.shape)
        self._pieces = [None if s is None else np.array(np.asarray(s), copy=True) for s in x.local_shards()]

    def local_shards(self) -> _list:
        return self._pieces


@dataclass
class _Item:
    name: str
    key: str
    value: Any          # a _Frozen, or a numpy copy
    dtype: Any
    nbytes: int


class Handle:
    """A save in progress: `wait()` until it is complete (raising its error), `done()`,
    `progress()` (the fraction of the bytes written, 1.0 when committed)."""

    def __init__(self, path: str, step: int, total: int):
        self.path, self.step = path, step
        self._total, self._written = max(total, 1), 0
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._delivered = False
        self._thread: threading.Thread | None = None

    def wait(self, timeout: float | None = None) -> "Handle":
        if not self._done.wait(timeout):
            raise DTMError(ErrorCode.TIMEOUT, f"the save of step {self.step} into {self.path} was not done within "
                           f"{timeout} s ({self.progress():.0%} written)")
        if self._error is not None:
            self._delivered = True
            raise self._error
        return self

    def done(self) -> bool:
        return self._done.is_set()

    def progress(self) -> float:
        return 1.0 if self._done.is_set() and self._error is None else min(self._written / self._total, 0.99)

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.done() else f"{self.progress():.0%}"
        return f"<checkpoint save step={self.step} {self.path} {state}>"


_last: Handle | None = None
_last_lock = threading.Lock()


def _process_group():
    """The process group of a mesh of several processes, else None."""
    if process_group.is_initialized() and process_group.world_size() > 1:
        return process_group.current()
    return None


def save(state: dict, path: str | os.PathLike, step: int, keep: int | None = None) -> Handle:
    """Save `state` ({name: an object with state_dict(), a tensor, or a plain value}) as
    checkpoint `step` under directory `path`; every rank calls it. The values are copied
    before it returns; in one process the files are written by a background thread
    (on a mesh of processes, before it returns). `keep=N` removes all but the newest N
    complete checkpoints once this one is complete. Raises the error of an earlier save that
    failed and was not waited for."""
    global _last
    if not isinstance(state, dict):
        raise DTMError(ErrorCode.ATTRIBUTE_TYPE, f"checkpoint.save takes a dict of named state, not "
                       f"{type(state).__name__}")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= int(step) < 10 ** 12:
        raise DTMError(ErrorCode.ATTRIBUTE_VALUE, f"checkpoint.save: step is an int from 0 to 10**12 - 1, not {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise DTMError(ErrorCode.ATTRIBUTE_VALUE, f"checkpoint.save: keep is None or an int >= 1, not {keep!r}")
    with _last_lock:
        previous, _last = _last, None
    if previous is not None:
        previous._done.wait()
        if previous._error is not None and not previous._delivered:
            previous._delivered = True
            raise previous._error
    root = os.path.abspath(os.fspath(path))
    items: _list[_Item] = []
    meshes: _list[dict] = []

    def take(name: str, x: Any) -> None:
        mesh = getattr(x, "device_mesh", None)
        if mesh is not None:
            value = _Frozen(x)
            desc = {"axes": [[a, n] for a, n in mesh.axes]}
            if desc not in meshes:
                meshes.append(desc)
        else:
            value = np.array(x.numpy() if callable(getattr(x, "numpy", None)) else x, copy=True)
        dt = as_store_dtype(x.dtype)
        items.append(_Item(name, f"t/{len(items)}", value, dt, fmt.plan(dt, tuple(x.shape)).nbytes))

    entries = {}
    try:
        for name, v in state.items():
            if not isinstance(name, str) or not name or "/" in name:
                raise TypeError(f"a state name is a non-empty string without '/', not {name!r}")
            if _is_object(v):
                entries[name] = {"kind": "object", "tree": mf.encode(v.state_dict(), name, take)}
                if callable(getattr(v, "hf_config", None)):  # for `dtm checkpoint export`
                    entries[name]["hf_config"] = v.hf_config()
            else:
                entries[name] = {"kind": "value", "tree": mf.encode(v, name, take)}
    except TypeError as e:
        raise DTMError(ErrorCode.ATTRIBUTE_TYPE, f"checkpoint.save: {e}") from None
    h = Handle(root, int(step), sum(i.nbytes for i in items))
    pg = _process_group()
    job = (h, root, int(step), keep, entries, items, meshes, pg)
    if pg is not None:
        _write(*job)
    else:
        h._thread = threading.Thread(target=_write, args=job, name=f"dtm-checkpoint-{step}", daemon=True)
        h._thread.start()
    with _last_lock:
        _last = h
    return h


def _is_object(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None)) \
        and not mf.is_tensor(v)


def _write(h: Handle, root: str, step: int, keep: int | None, entries: dict, items: _list[_Item],
           meshes: _list[dict], pg: Any) -> None:
    """Write checkpoint `step` (spec 9.4.3) and record the outcome in `h`."""
    lead = pg is None or pg.rank == 0
    step_dir = os.path.join(root, step_dir_name(step))
    made = False
    try:
        err = None
        if lead:
            try:
                made = _prepare(root, step_dir)
            except DTMError as e:
                err = e
        if pg is not None:
            codes = pg.all_gather(np.array([[0 if err is None else 1]], np.int64), dim=0)
            if codes.any() and err is None:
                err = DTMError(ErrorCode.STORE_IO_ERROR, f"rank 0 could not prepare {step_dir}")
        if err is not None:
            raise err
        tensors = []
        st = _store.open(step_dir, inline_bytes=0)
        try:
            for it in items:
                if isinstance(it.value, _Frozen):
                    info = st.put(it.key, it.value, it.dtype)
                elif lead:
                    info = st.put_array(it.key, it.value, it.dtype)
                else:
                    info = None
                h._written += it.nbytes
                if lead:
                    tensors.append(_tensor_entry(step_dir, it, info))
        finally:
            st.close()
        if lead:
            mf.write(step_dir, mf.new(step, entries, tensors, meshes, time.time()))
        if pg is not None:
            pg.barrier()
        if lead and keep is not None:
            _prune(root, keep)
    except BaseException as e:  # noqa: BLE001 - recorded, raised by wait() and the next save
        if lead and made and not os.path.exists(os.path.join(step_dir, mf.MANIFEST)):
            shutil.rmtree(step_dir, ignore_errors=True)
        if isinstance(e, OSError):
            e = StoreIOError(f"checkpoint step {step} was not saved, the earlier checkpoints are kept: "
                             f"{e.strerror or e}", e.filename or step_dir)
        elif isinstance(e, DTMError) and not isinstance(e, CheckpointError):
            e = e.in_context(f"checkpoint step {step} into {root} was not saved, the earlier checkpoints are kept")
        h._error = e
    finally:
        h._done.set()


def _prepare(root: str, step_dir: str) -> bool:
    """Make the step directory, removing what an unfinished save of the same step left;
    E1404 when the step is already complete, E1104 when the root is not a directory."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise StoreIOError("the checkpoint path is not a directory", root)
    if os.path.exists(os.path.join(step_dir, mf.MANIFEST)):
        raise CheckpointExists(f"{step_dir} is already a complete checkpoint; save another step, or remove it",
                               step_dir)
    if os.path.exists(step_dir):
        shutil.rmtree(step_dir)  # an unfinished save's leftovers (it never had a manifest)
    try:
        os.makedirs(step_dir)
    except OSError as e:
        raise StoreIOError(f"cannot create the checkpoint directory: {e.strerror or e}", step_dir) from None
    return True


def _tensor_entry(step_dir: str, it: _Item, info: Any) -> dict:
    """The manifest's entry of a saved tensor: its type, layout at save time, chunks and CRCs."""
    layout, _ = fmt.parse_metadata(_read(os.path.join(step_dir, info.dir, "zarr.json")))
    chunks = []
    for i in layout.chunks():
        rel = f"{info.dir}/{layout.chunk_key(i)}"
        p = os.path.join(step_dir, rel)
        if not os.path.exists(p):
            continue  # (an empty piece's chunk is never written: reads fill it with zeros)
        with open(p, "rb") as f:
            f.seek(-fmt.CRC_BYTES, os.SEEK_END)
            crc = int.from_bytes(f.read(fmt.CRC_BYTES), "little")
        chunks.append({"file": rel, "crc32c": f"{crc:08x}", "box": [_list(b) for b in layout.chunk_box(i)]})
    v = it.value
    entry = {"name": it.name, "key": it.key, "dtype": it.dtype.name, "shape": _list(layout.shape),
             "nbytes": layout.nbytes, "checksum": info.checksum, "dir": info.dir,
             "chunk_shape": _list(layout.chunk_shape), "chunks": chunks, "mesh": None, "placements": None}
    if isinstance(v, _Frozen):
        entry["mesh"] = {"axes": [[a, n] for a, n in v.device_mesh.axes]}
        entry["placements"] = [str(p) for p in v.placements]
    return entry


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _prune(root: str, keep: int) -> None:
    """Remove all but the newest `keep` complete checkpoints: each made invisible first (its
    manifest removed, the directory synced), then deleted."""
    for step, d in _complete(root)[:-keep]:
        os.remove(os.path.join(d, mf.MANIFEST))
        fsync_dir(d)
        shutil.rmtree(d, ignore_errors=True)


# --- finding and listing ------------------------------------------------------------------

def _complete(root: str) -> _list[tuple[int, str]]:
    """(step, directory) of each complete checkpoint under `root`, oldest first."""
    out = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        d = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(d, mf.MANIFEST)):
            out.append((int(m.group(1)), d))
    return sorted(out)


def _root(path: str | os.PathLike) -> str:
    root = os.path.abspath(os.fspath(path))
    if not os.path.isdir(root):
        raise NotACheckpoint(f"{root} is not a checkpoint directory ({'a file' if os.path.exists(root) else 'absent'})",
                             root)
    return root


def _find(path: str | os.PathLike, step: int | None) -> str:
    """The step directory of checkpoint `step` (None: the newest complete one), E1401 else."""
    root = _root(path)
    found = _complete(root)
    if not found:
        unfinished = sorted(n for n in os.listdir(root) if _STEP_DIR.match(n))
        raise NotACheckpoint(f"{root} holds no complete checkpoint (expected step-NNNNNNNNNNNN/{mf.MANIFEST}"
                             + (f"; unfinished saves without a manifest: {unfinished}" if unfinished else "") + ")",
                             root)
    if step is None:
        return found[-1][1]
    for s, d in found:
        if s == step:
            return d
    raise NotACheckpoint(f"{root} holds no complete checkpoint of step {step}; it holds steps {[s for s, _ in found]}",
                         root)


@dataclass
class Checkpoint:
    """A complete checkpoint: its step, when it was committed (Unix seconds), its tensor
    bytes, the meshes its tensors were laid out on ("dp=2 x tp=2"; None: no mesh)."""

    step: int
    time: float
    size: int
    mesh: str | None
    path: str
    dtm_version: str = ""
    tensors: int = 0


def _mesh_text(meshes: _list[dict]) -> str | None:
    return ", ".join(" x ".join(f"{a}={n}" for a, n in m["axes"]) for m in meshes) or None


def list(path: str | os.PathLike) -> _list[Checkpoint]:  # noqa: A001 - dtm.checkpoint.list, as the issue names it
    """The complete checkpoints under `path`, oldest first (E1401 when it is not a directory)."""
    out = []
    for _, d in _complete(_root(path)):
        doc = mf.read(d)
        out.append(Checkpoint(doc["step"], float(doc["time"]), doc["bytes"], _mesh_text(doc["meshes"]), d,
                              str(doc.get("dtm_version", "")), len(doc["tensors"])))
    return out


def read_manifest(path: str | os.PathLike, step: int | None = None) -> dict:
    """The manifest of checkpoint `step` (None: the newest complete one) under `path`."""
    return mf.read(_find(path, step))


# --- loading ------------------------------------------------------------------------------

def _flat_tensors(x: Any, name: str, out: dict) -> dict:
    """{name: tensor} of the tensors in live value `x`, named as `save` names them."""
    if mf.is_tensor(x):
        out[name] = x
    elif isinstance(x, (_list, tuple)):
        for i, v in enumerate(x):
            _flat_tensors(v, f"{name}/{i}", out)
    elif isinstance(x, dict):
        for k, v in x.items():
            _flat_tensors(v, f"{name}/{k}", out)
    return out


def load(state: dict, path: str | os.PathLike, step: int | None = None, strict: bool = True) -> dict:
    """Load checkpoint `step` (None: the newest complete one) under `path` into `state`, in
    place: each object's load_state_dict, each tensor's copy_, each plain value replaced.
    A tensor is read laid out like the live one (its mesh and placements now), each rank
    reading only the chunks its pieces overlap. Every check (keys with `strict`, dtypes,
    shapes, chunks) passes before anything in `state` changes. Returns `state`."""
    step_dir = _find(path, step)
    doc = mf.read(step_dir)
    saved = doc["state"]
    by_name = {t["name"]: t for t in doc["tensors"]}
    live = {name: (v.state_dict() if _is_object(v) else v) for name, v in state.items()}
    missing, unexpected = [], []
    for name in state:
        if name not in saved:
            missing.append(name)
    for name, entry in saved.items():
        if not isinstance(entry, dict) or entry.get("kind") not in ("object", "value") or "tree" not in entry:
            raise CheckpointInvalid(f"{step_dir}/{mf.MANIFEST}: state entry {name!r} is not {{kind, tree}}", step_dir)
        if name not in state:
            unexpected.append(name)
        elif entry["kind"] == "object" and _is_object(state[name]):
            have = set(map(str, live[name])) if isinstance(live[name], dict) else set()
            keys = {str(k) for k, _ in entry["tree"].get("dict", [])}
            missing += [f"{name}/{k}" for k in sorted(have - keys)]
            unexpected += [f"{name}/{k}" for k in sorted(keys - have)]
    if strict and (missing or unexpected):
        raise CheckpointKeyError(sorted(missing), sorted(unexpected), step_dir)
    names = [n for n in state if n in saved]
    live_tensors: dict[str, Any] = {}
    for n in names:
        _flat_tensors(live[n], n, live_tensors)
    for tname, t in by_name.items():  # every check before any read
        x = live_tensors.get(tname)
        if x is None:
            continue
        want = f"{_list(t['shape'])}"
        have = f"{_list(x.shape)}"
        if have != want:
            raise CheckpointTypeError(ErrorCode.SHAPE_MISMATCH, tname, have, want, step_dir)
        if as_store_dtype(x.dtype).name != t["dtype"]:
            raise CheckpointTypeError(ErrorCode.DTYPE_MISMATCH, tname, as_store_dtype(x.dtype).name, t["dtype"],
                                      step_dir)
    dropped = set(unexpected)
    read: dict[str, Any] = {}
    st = _store.open(step_dir)
    try:
        for n in names:
            for tname in _tensor_names(saved[n]["tree"], step_dir):
                if tname in read or any(tname == d or tname.startswith(d + "/") for d in dropped):
                    continue
                t = by_name.get(tname)
                if t is None:
                    raise CheckpointInvalid(f"{step_dir}/{mf.MANIFEST}: {tname!r} is in the state but not among "
                                            "the tensors", step_dir)
                read[tname] = _read_tensor(st, step_dir, t, live_tensors.get(tname))
    finally:
        st.close()
    values = {}
    for n in names:
        try:
            value = mf.decode(saved[n]["tree"], lambda k: read.get(k), f"{step_dir}/{mf.MANIFEST}")
        except ValueError as e:
            raise CheckpointInvalid(str(e), step_dir) from None
        if isinstance(value, dict) and saved[n]["kind"] == "object":
            value = {k: v for k, v in value.items() if f"{n}/{k}" not in dropped}
        values[n] = value
    for n, value in values.items():  # every value read and checked: now change the state
        obj = state[n]
        if saved[n]["kind"] == "object" and _is_object(obj):
            if "strict" in inspect.signature(obj.load_state_dict).parameters:
                obj.load_state_dict(value, strict=strict)
            else:
                obj.load_state_dict(value)
        elif mf.is_tensor(obj) and callable(getattr(obj, "copy_", None)) and value is not None:
            obj.copy_(value)
        elif isinstance(obj, np.ndarray) and value is not None:
            np.copyto(obj, np.asarray(value))
        else:
            state[n] = value
    return state


def _tensor_names(node: Any, where: str) -> _list[str]:
    """The tensor names a tree node refers to, in order."""
    out: _list[str] = []

    def walk(n: Any, depth: int) -> None:
        if depth > mf.MAX_DEPTH or not isinstance(n, dict) or len(n) != 1:
            return
        (kind, v), = n.items()
        if kind == "tensor" and isinstance(v, str):
            out.append(v)
        elif kind in ("list", "tuple") and isinstance(v, _list):
            for c in v:
                walk(c, depth + 1)
        elif kind == "dict" and isinstance(v, _list):
            for c in v:
                if isinstance(c, _list) and len(c) == 2:
                    walk(c[1], depth + 1)
    walk(node, 0)
    return out


def _read_tensor(st: Any, step_dir: str, t: dict, like: Any) -> Any:
    """Saved tensor `t`, laid out like the live tensor `like` (a distributed tensor on its
    mesh with its placements; else a whole numpy array); store errors named for the checkpoint."""
    name, key = t["name"], t["key"]
    try:
        if st.info(key).dir != t["dir"]:
            raise CheckpointInvalid(f"{step_dir}: tensor {name!r}: the store's version of {key!r} is not the "
                                    f"manifest's {t['dir']}", step_dir)
        mesh = getattr(like, "device_mesh", None) if like is not None else None
        if mesh is not None:
            return st.get(key, mesh=mesh, placements=tuple(like.placements))
        return np.array(st.get_array(key))
    except ChecksumError as e:
        why = e.message.split(": ", 1)[-1]
        raise CheckpointChunkError(name, e.chunk, os.path.join(step_dir, t["dir"], e.chunk), why) from None
    except StoreCorrupt as e:
        raise CheckpointChunkError(name, "zarr.json", os.path.join(step_dir, t["dir"], "zarr.json"),
                                   e.message) from None
    except KeyMissing:
        raise CheckpointInvalid(f"{step_dir}: tensor {name!r} ({key!r}) is in the manifest but not in the "
                                "checkpoint's store", step_dir) from None


# --- exporting ----------------------------------------------------------------------------

def export(path: str | os.PathLike, out: str | os.PathLike, step: int | None = None) -> dict[str, str]:
    """Write each group of checkpoint `step` (a top-level name of its state that holds
    tensors: "model", "optim") as `OUT/<group>.safetensors`, its tensors whole and named by
    their path in the group with dots (`h.0.attn.c_attn.weight`, `state.3.exp_avg`), for
    safetensors and transformers to read. Returns {group: file}. (The `dtm checkpoint export`
    command writes a group saved from a model that records its Hugging Face config as that
    model's own checkpoint directory instead.)"""
    from safetensors.numpy import save_file

    step_dir = _find(path, step)
    doc = mf.read(step_dir)
    by_name = {t["name"]: t for t in doc["tensors"]}
    os.makedirs(out, exist_ok=True)
    written = {}
    st = _store.open(step_dir)
    try:
        for group, entry in doc["state"].items():
            names = _tensor_names(entry["tree"], step_dir)
            if not names:
                continue
            arrays = {n.split("/", 1)[1].replace("/", ".") if "/" in n else n:
                      np.ascontiguousarray(_read_tensor(st, step_dir, by_name[n], None)) for n in names}
            file = os.path.join(out, f"{group}.safetensors")
            save_file(arrays, file + ".tmp", metadata={"format": "pt", "dtm_step": str(doc["step"])})
            os.replace(file + ".tmp", file)
            written[group] = file
    finally:
        st.close()
    return written


# --- verifying ----------------------------------------------------------------------------

@dataclass
class VerifyReport:
    """What `verify` found: `bad` lists (step, tensor, chunk file, problem)."""

    checkpoints: int = 0
    tensors: int = 0
    chunks: int = 0
    bad: _list[tuple[int, str, str, str]] = field(default_factory=_list)

    @property
    def ok(self) -> bool:
        return not self.bad


def verify(path: str | os.PathLike, step: int | None = None) -> VerifyReport:
    """Re-read every chunk of every complete checkpoint under `path` (or of `step`) and check
    its length, its own CRC32C and the manifest's."""
    report = VerifyReport()
    dirs = [_find(path, step)] if step is not None else [d for _, d in _complete(_root(path))]
    if not dirs:
        _find(path, None)  # E1401, naming what is there
    for d in dirs:
        doc = mf.read(d)
        report.checkpoints += 1
        for t in doc["tensors"]:
            report.tensors += 1
            try:
                layout, _ = fmt.parse_metadata(_read(os.path.join(d, t["dir"], "zarr.json")))
            except (OSError, ValueError, KeyError, TypeError) as e:
                report.bad.append((doc["step"], t["name"], f"{t['dir']}/zarr.json", f"unreadable: {e}"))
                continue
            want = layout.chunk_data_bytes + fmt.CRC_BYTES
            for c in t["chunks"]:
                report.chunks += 1
                rel = c.get("file", "?")
                try:
                    raw = _read(os.path.join(d, rel))
                except OSError as e:
                    report.bad.append((doc["step"], t["name"], rel, f"cannot be read: {e.strerror or e}"))
                    continue
                if len(raw) != want:
                    report.bad.append((doc["step"], t["name"], rel, f"{len(raw)} bytes, expected {want} (truncated)"))
                    continue
                stored = int.from_bytes(raw[-fmt.CRC_BYTES:], "little")
                got = _crc(memoryview(raw)[:-fmt.CRC_BYTES])
                if got != stored:
                    report.bad.append((doc["step"], t["name"], rel, f"CRC32C {got:08x}, the chunk says {stored:08x}"))
                elif f"{stored:08x}" != c.get("crc32c"):
                    report.bad.append((doc["step"], t["name"], rel,
                                       f"CRC32C {stored:08x}, the manifest says {c.get('crc32c')}"))
    return report
