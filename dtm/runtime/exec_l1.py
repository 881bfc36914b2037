"""Execution vectors over processes (L1): each vector with a mesh runs with every rank a
process of its own, started by `dtm launch` on 127.0.0.1, its rank's inputs through L1's
executor (collectives, send and recv over the wire between the processes). The vectors of
one rank count share one launch. Each rank writes its outputs as JSON (exec_vectors'
`encode_array`: nothing is unpickled), which are compared with the vector's.

    results = run_l1_vectors()                         # a VectorResult (kind "l1") per vector with a mesh
    problems = run_l1(root, vectors)                   # {name: None, or the first difference}
    python -m dtm.cli launch -n 8 -m dtm.runtime.exec_l1 ROOT OUT NAME...   # one launch, by hand
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

from ..ir.conformance import VectorResult
from .exec_vectors import Vector, compare, decode_array, default_root, encode_array, load, read_vectors, runs_on

LAUNCH_TIMEOUT_S = 300.0  # one launch: every rank's start, join and vectors


def run_l1_vectors(root: pathlib.Path | None = None) -> list[VectorResult]:
    """Every vector with a mesh of directory `root` (default: the repository's) over
    processes; the vectors that cannot be read are failures of kind "valid", as in
    exec_vectors.run_exec_vectors."""
    root = root or default_root()
    vectors, results = read_vectors(root)
    mine = [v for v in vectors if runs_on(v, "l0")]  # (what runs on L0's devices runs on processes)
    for name, problem in run_l1(root, mine).items():
        results.append(VectorResult(name, "l1", problem is None, problem or ""))
    return results


def run_l1(root: pathlib.Path, vectors: list[Vector], timeout: float = LAUNCH_TIMEOUT_S) -> dict[str, str | None]:
    """{vector name: None when every rank gave its outputs, else the first problem}."""
    by_ranks: dict[int, list[Vector]] = {}
    for v in vectors:
        by_ranks.setdefault(v.ranks, []).append(v)
    problems: dict[str, str | None] = {}
    for ranks, group in sorted(by_ranks.items()):
        with tempfile.TemporaryDirectory(prefix="dtm-exec-l1-") as out:
            cmd = [sys.executable, "-m", "dtm.cli", "launch", "-n", str(ranks), "-m", "dtm.runtime.exec_l1",
                   str(root), out, *(v.name for v in group)]
            env = dict(os.environ, DTM_HOST="127.0.0.1")
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
                failed = None if proc.returncode == 0 else \
                    f"dtm launch -n {ranks} exited {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}"
            except subprocess.TimeoutExpired:
                failed = f"dtm launch -n {ranks} did not finish within {timeout:g} s"
            for v in group:
                problems[v.name] = failed or _compare(v, pathlib.Path(out))
    return problems


def _compare(v: Vector, out: pathlib.Path) -> str | None:
    """What the ranks wrote to `out` against vector v (exec_vectors.compare)."""
    outs, inputs = [], []
    for r in range(v.ranks):
        path = out / f"{v.name}.{r}.json"
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            return f"rank {r} wrote no result ({e})"
        if "error" in doc:
            return f"rank {r} raised {doc['error']}"
        outs.append([decode_array(a, f"rank {r} output {i}") for i, a in enumerate(doc["outputs"])])
        inputs.append({int(i): decode_array(a, f"rank {r} input {i}") for i, a in doc["assigned"].items()})
    return compare(v, outs, inputs)


def _rank_main(root: pathlib.Path, out: pathlib.Path, names: list[str]) -> None:
    """One rank's side of a launch: join the mesh, run each vector on this rank's inputs."""
    from ..errors import DTMError
    from . import l1
    from .process_group import init

    rank = init(timeout=60).rank
    for name in names:
        v = load(root, name)
        inputs = [x.copy() for x in v.inputs[rank]]
        func = v.module.funcs[v.func]
        try:
            outs = l1.executor().run(v.module, v.func, inputs)
            doc = {"outputs": [encode_array(np.asarray(o), t.dtype.name) for o, (t, _) in zip(outs, func.result_types)],
                   "assigned": {str(i): encode_array(inputs[i], func.params[i].type.dtype.name)
                                for i in v.assigned[rank]}}
        except DTMError as e:
            doc = {"error": f"{e.code.value}: {e.message}"}
        (out / f"{name}.{rank}.json").write_text(json.dumps(doc), encoding="utf-8")


if __name__ == "__main__":
    _rank_main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3:])
