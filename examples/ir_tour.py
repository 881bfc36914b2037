"""A tour of DTM IR (what `make demo` runs): parse, verify, print, hash, encode and build
a real module, an MLP with sharding annotations and a collective, and show what each step
found, including what a mistake looks like."""

from __future__ import annotations

import pathlib
import re
import time

from rich.console import Console
from rich.panel import Panel
from rich.syntax import Syntax

import dtm
from dtm import ir

HERE = pathlib.Path(__file__).resolve().parent
console = Console()


def step(title: str) -> None:
    console.rule(f"[bold cyan]{title}")


def main() -> None:
    path = HERE / "mlp.dtm"
    text = path.read_text()
    console.print(Panel.fit(f"DTM {dtm.__version__}, IR spec {'.'.join(map(str, ir.SPEC_VERSION))}: "
                            f"{len(ir.REGISTRY)} ops in the registry", style="bold"))

    step(f"1. parse {path.name}")
    t0 = time.perf_counter()
    module = ir.parse(text)
    console.print(f"meshes: {', '.join(str(m) for m in module.meshes.values())}")
    for f in module.funcs.values():
        console.print(f"func @{f.name}: {len(f.params)} params, {len(f.ops)} ops: "
                      f"{', '.join(op.name for op in f.ops)}")

    step("2. verify (shapes, dtypes, symbolic dims, shardings, collective groups)")
    ir.verify(module)
    console.print(f"ok in {(time.perf_counter() - t0) * 1e3:.2f} ms (parse + verify)")
    for f in module.funcs.values():
        for op in f.ops:
            for r in op.results:
                console.print(f"  @{f.name}: %{r.name:8} = {op.name:10} -> {r.type}"
                              + (f" {r.sharding}" if r.sharding else ""))

    step("3. canonical text (comments gone, attributes sorted, defaults dropped)")
    canonical = ir.format(module)
    console.print(Syntax(canonical, "text", word_wrap=True))

    step("4. hash: equal under renaming and layout, different under any change of meaning")
    h = module.hash()
    renamed = re.sub(r"%([A-Za-z_]\w*)", r"%renamed_\1", text).replace("  ", "    ")
    changed = text.replace('op = "sum"', 'op = "max"')
    console.print(f"original               {h}")
    console.print(f"values renamed, spaced {ir.parse(renamed).hash()}  (same: {ir.parse(renamed).hash() == h})")
    console.print(f"all_reduce sum -> max  {ir.parse(changed).hash()}  (same: {ir.parse(changed).hash() == h})")

    step("5. canonical encoding (the bytes another language reproduces)")
    blob = ir.encode(module)
    back = ir.decode(blob)
    console.print(f"{len(blob)} bytes; first 24: {blob[:24].hex(' ')}")
    console.print(f"decode(encode(m)) == m: {back == module}")

    step("6. build the local-view function from Python, no text")
    b = ir.Builder()
    b.mesh("mesh", dp=2, tp=2)
    f = b.func("mlp_rank")
    x = f.param("f32[B, 512]", name="x")
    w1 = f.param("f32[512, 1024]", name="w1")
    b1 = f.param("f32[1024]", name="b1")
    w2 = f.param("f32[1024, 512]", name="w2")
    a = f.gelu(f.add(f.matmul(x, w1), b1), approximate="tanh")
    f.ret(f.all_reduce(f.matmul(a, w2), mesh="mesh", axes=["tp"], op="sum"))
    built = b.build()
    console.print(Syntax(ir.format(built), "text", word_wrap=True))
    same = ir.encode(built) == ir.encode(_only(module, "mlp_rank"))
    console.print(f"same hash as the text's @mlp_rank: {same}")

    step("7. a mistake, as a user sees it")
    bad = text.replace("%partial = matmul %a, %w2 : f32[B, 512]", "%partial = matmul %w2, %a : f32[B, 512]")
    try:
        ir.verify(ir.parse(bad))
    except ir.IRError as e:
        console.print(ir.render(e, bad, path.name), style="red", markup=False, highlight=False)


def _only(module: ir.Module, name: str) -> ir.Module:
    """A copy of `module` holding just its meshes and function `name`."""
    m = ir.Module(module.version)
    m.meshes = dict(module.meshes)
    m.funcs = {name: module.funcs[name]}
    return m


if __name__ == "__main__":
    main()
