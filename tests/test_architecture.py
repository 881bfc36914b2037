"""The house rules that keep the package readable (docs/architecture.md, "The layers"): no
file imports a less basic layer than its own (`LAYERS`, the page's table), no two files
under dtm/ import each other, directly or round a circle (imports inside functions count;
`if TYPE_CHECKING:` ones do not), and the public names the README promises are reachable
from `import dtm` alone, with one signature wherever they are exposed."""

from __future__ import annotations

import ast
import graphlib
import inspect
import pathlib
import subprocess
import sys

import dtm

PKG = pathlib.Path(dtm.__file__).parent


def _imports(path: pathlib.Path) -> set[pathlib.Path]:
    """The files under dtm/ that `path` imports (a package's __init__.py for a package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in node.body for n in ast.walk(child)}
    here = list(path.relative_to(PKG.parent).with_suffix("").parts)[:-1]
    targets = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets += [a.name.split(".") for a in node.names if a.name.split(".")[0] == "dtm"]
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            mod = base + (node.module.split(".") if node.module else [])
            if mod and mod[0] == "dtm":
                targets += [mod + [a.name] for a in node.names]
    found = set()
    for t in targets:
        for n in range(len(t), 1, -1):
            base = PKG.parent.joinpath(*t[:n])
            hit = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            if hit.is_file():
                found.add(hit)
                break
    return found - {path, PKG / "__init__.py"}  # the package's face hands names on to everyone


# docs/architecture.md's table: each package's row (a lower number is more basic). Files
# outside the rows (the package's face, the error table, the debugging switches) may import
# and be imported by any.
LAYERS = {"ir": 1, "toolchain": 1.5, "ref": 2, "compiler": 3, "backends": 3, "protocol": 4, "comm": 5, "cluster": 6,
          "runtime": 7, "store": 8, "tasks": 8, "data": 8, "quant": 8, "ckpt": 8, "elastic": 8,
          "tensor": 9, "functional": 9, "nn": 9, "optim": 9, "utils": 9, "distributed": 9, "parallel": 9,
          "autograd": 9, "models": 10, "cli": 11}
OUTSIDE = {"__init__", "__main__", "errors", "debug"}


def _layer(path: pathlib.Path) -> float | None:
    top = path.relative_to(PKG).parts[0].removesuffix(".py")
    return None if top in OUTSIDE else LAYERS[top]


def test_every_file_has_a_layer_and_imports_none_above_it():
    upward = []
    for p in PKG.rglob("*.py"):
        mine = _layer(p)
        if mine is None:
            continue
        for q in _imports(p):
            theirs = _layer(q)
            if theirs is not None and theirs > mine:
                upward.append(f"{p.relative_to(PKG.parent)} (layer {mine}) imports {q.relative_to(PKG.parent)} "
                              f"(layer {theirs})")
    assert upward == []


def _cycle(graph: dict) -> list | None:
    """One circle of files importing each other, or None (the standard library's
    topological sort names the circle it meets)."""
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        return e.args[1]
    return None


def test_no_file_under_dtm_imports_round_a_circle():
    graph = {p: _imports(p) for p in PKG.rglob("*.py") if p != PKG / "__init__.py"}
    assert len(graph) > 100
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(str(p.relative_to(PKG.parent)) for p in cycle)


def test_the_check_finds_a_circle():
    a, b, c = (pathlib.Path(f"/x/{n}.py") for n in "abc")
    assert sorted(set(_cycle({a: {b}, b: {c}, c: {a}}))) == [a, b, c]
    assert _cycle({a: {b}, b: {c}, c: set()}) is None


def test_import_dtm_reaches_debug_and_collectives_have_one_signature():
    code = "import dtm; print(dtm.debug.count_kernels.__name__, dtm.distributed.all_to_all is dtm.all_to_all)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["count_kernels", "True"], out.stderr
    for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        f = getattr(dtm, name)
        assert f is getattr(dtm.distributed, name) is getattr(dtm.parallel, name)
    # torch.distributed's order: the tensor, the reduce op, then the dim
    # (compress, issue 19's quantized collectives, comes last, after the axis)
    assert list(inspect.signature(dtm.reduce_scatter).parameters) == ["x", "op", "dim", "axis", "compress"]
    params = inspect.signature(dtm.all_to_all).parameters
    assert (params["split_dim"].default, params["concat_dim"].default) == (0, 0)
