"""Write the checkpoint conformance vectors (conformance/checkpoint/README.md, spec 9.4.8).

    .venv/bin/python conformance/checkpoint/tools/make_vectors.py [OUT]   # OUT: default conformance/checkpoint

Lays a two-layer model (Linear(4, 5), ReLU, Linear(5, 3)) and its AdamW out by DP=2 x TP=2
on 4 virtual devices of this process (layer 0 column-parallel, layer 2 row-parallel: 5
features over tp=2 give pieces of 3 and 2), sets its weights and AdamW state (as after two
steps) to exact values, saves it as checkpoint step 2 and writes it into valid/two_layer/
in canonical form: the manifest's `time` fixed, each version
directory named by its tensor's index (`@0000000000000001` ...), and without the store's
own index (index.sqlite, store.json), which a reader that reads by the manifest does not
need. Then writes manifest.json: the loads a reader must make of it (onto 1 rank, and onto
3 ranks with the placements listed) with the expected CRC32C of every piece, computed here
from the saved values with numpy and spec 2.7's split, and the damaged copies with the
error codes they must give. Run again, on any machine, it writes the same bytes."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE.parent.parent))

import dtm  # noqa: E402
from dtm import nn  # noqa: E402
from dtm.ckpt import manifest as mf  # noqa: E402
from dtm.parallel import DDP, tensor_parallel  # noqa: E402
from dtm.store.crc import checksum  # noqa: E402
from dtm.store.files import WRITERS  # noqa: E402

STEP = 2
TIME = 1767225600.0  # 2026-01-01T00:00:00Z: the manifest's commit time, fixed
VALID = "two_layer"
STEP_DIR = f"step-{STEP:012d}"

# Placements of each tensor on the 3-rank mesh `x`: uneven shards along dim 0 (5 rows: 2, 2
# and 1), layer 2's weight state along dim 1 (5 columns), layer 2's bias state replicated.
THREE_RANKS = {"model/0.weight": ["shard(0)"], "model/0.bias": ["shard(0)"], "model/2.weight": ["shard(1)"],
               "model/2.bias": ["replicate"]}
for i, p in enumerate(["0.weight", "0.bias", "2.weight", "2.bias"]):
    for s in ("exp_avg", "exp_avg_sq"):
        THREE_RANKS[f"optim/state/{i}/{s}"] = THREE_RANKS[f"model/{p}"]


def exact(shape: tuple[int, ...], salt: int, scale: int) -> np.ndarray:
    """Values k / scale with small integers k: exact in f32, so the same on every machine
    (no kernel computes them)."""
    n = int(np.prod(shape))
    return ((np.arange(n) * 7 + salt) % 23 - 11).reshape(shape).astype(np.float32) / scale


def save_two_layer(root: str) -> None:
    """The model laid out by DP=2 x TP=2, its weights and its AdamW state (as after STEP
    steps) set to exact values, saved as checkpoint STEP."""
    dtm.devices(4)
    mesh = dtm.Mesh({"dp": 2, "tp": 2})
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    DDP(tensor_parallel(model, mesh, {"0": "colwise", "2": "rowwise"}), mesh)  # (sets the placements)
    opt = dtm.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    shapes = [tuple(p.shape) for p in model.parameters()]
    model.load_state_dict({n: exact(s, i, 16) for i, (n, s) in enumerate(zip(model.state_dict(), shapes))})
    opt.load_state_dict({"param_groups": opt.state_dict()["param_groups"],
                         "state": {i: {"step": STEP, "exp_avg": exact(s, i + 3, 64),
                                       "exp_avg_sq": np.abs(exact(s, i + 5, 256))} for i, s in enumerate(shapes)}})
    dtm.checkpoint.save({"model": model, "optim": opt, "step": STEP}, root, step=STEP).wait()


def canonical(step_dir: pathlib.Path) -> dict:
    """Rename the version directories by tensor index, fix the time, drop the store's index."""
    doc = json.loads((step_dir / mf.MANIFEST).read_text())
    for i, t in enumerate(doc["tensors"]):
        new = f"{t['dir'].rsplit('@', 1)[0]}@{i + 1:016x}"
        os.rename(step_dir / t["dir"], step_dir / new)
        for c in t["chunks"]:
            c["file"] = new + c["file"][len(t["dir"]):]
        t["dir"] = new
    doc["time"] = TIME
    for name in ("index.sqlite", "store.json"):
        (step_dir / name).unlink()
    (step_dir / WRITERS).rmdir()  # (the store's, empty once its writers are done)
    (step_dir / mf.MANIFEST).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def whole(step_dir: pathlib.Path, t: dict) -> np.ndarray:
    """A saved tensor put together from its chunk files (each its box's values, C order, then
    its CRC32C): numpy only, as an implementation in another language would."""
    out = np.zeros(t["shape"], np.float32)
    chunk = tuple(t["chunk_shape"])
    for c in t["chunks"]:
        raw = (step_dir / c["file"]).read_bytes()
        assert f"{checksum(raw[:-4]):08x}" == c["crc32c"]
        box = tuple(slice(a, b) for a, b in c["box"])
        out[box] = np.frombuffer(raw[:-4], "<f4").reshape(chunk)[tuple(slice(0, b - a) for a, b in c["box"])]
    return out


def pieces(a: np.ndarray, placement: str, ranks: int) -> list[np.ndarray]:
    """Each rank's piece of `a` on a 1-axis mesh (spec 2.7: chunks of ceil(n / ranks))."""
    if placement == "replicate":
        return [a] * ranks
    dim = int(placement[len("shard("):-1])
    size = -(-a.shape[dim] // ranks)
    return [a[(slice(None),) * dim + (slice(r * size, (r + 1) * size),)] for r in range(ranks)]


def piece_json(p: np.ndarray) -> dict:
    return {"shape": list(p.shape), "crc32c": f"{checksum(np.ascontiguousarray(p, '<f4').tobytes()):08x}"}


def main(root: pathlib.Path = HERE) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        save_two_layer(tmp)
        out = root / "valid" / VALID
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        shutil.copytree(pathlib.Path(tmp) / STEP_DIR, out / STEP_DIR)
    doc = canonical(out / STEP_DIR)
    by_name = {t["name"]: t for t in doc["tensors"]}
    values = {n: whole(out / STEP_DIR, t) for n, t in by_name.items()}
    first = f'{STEP_DIR}/{by_name["model/0.weight"]["chunks"][0]["file"]}'  # damage paths: from the root
    manifest = {
        "spec_version": doc["spec_version"],
        "format_version": doc["format_version"],
        "valid": {VALID: {
            "what": "a two-layer model (Linear(4, 5), ReLU, Linear(5, 3)) with AdamW state (step counts 2), "
                    "saved with DP=2 x TP=2 (layer 0 colwise, layer 2 rowwise) as checkpoint step 2",
            "step": STEP,
            "values": {"step": STEP, "optim/param_groups/0/lr": 0.01, "optim/param_groups/0/weight_decay": 0.1,
                       "optim/state/0/step": STEP},
            "loads": [
                {"name": "one_rank", "mesh": None,
                 "tensors": {n: {"placements": None, "pieces": [piece_json(a)]} for n, a in values.items()}},
                {"name": "three_ranks", "mesh": {"axes": [["x", 3]]},
                 "tensors": {n: {"placements": THREE_RANKS[n],
                                 "pieces": [piece_json(p) for p in pieces(a, THREE_RANKS[n][0], 3)]}
                             for n, a in values.items()}},
            ]}},
        "invalid": {
            "truncated_chunk": {"base": VALID, "what": "a chunk file of model/0.weight lost its last 5 bytes",
                                "damage": {"truncate": first, "remove_bytes": 5}, "code": "E1102"},
            "flipped_byte": {"base": VALID, "what": "one bit flipped in the values of a chunk of model/0.weight",
                             "damage": {"flip": first, "offset": 3, "mask": 16}, "code": "E1102"},
            "missing_chunk": {"base": VALID, "what": "a chunk file of model/0.weight the manifest lists was removed",
                              "damage": {"remove": first}, "code": "E1102"},
            "newer_major": {"base": VALID, "what": "the manifest says format_version 2.0: a newer major version",
                            "damage": {"manifest": {"format_version": "2.0"}}, "code": "E0601"},
            "not_a_checkpoint": {"base": VALID, "what": "a directory with files but no step-NNNNNNNNNNNN/manifest.json",
                                 "damage": {"remove": f"{STEP_DIR}/{mf.MANIFEST}"}, "code": "E1401"},
        },
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
