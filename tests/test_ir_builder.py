"""The Builder builds the same module (same hash) as the equivalent text, and reports every
fault as an IRError with a code."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import dtm.ir as ir
from dtm.ir import Partial, Replicate, Shard, Sharding, TensorType
from dtm.ir.dtypes import DTYPES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ir_corpus import CORPUS, T1  # noqa: E402


def same(m: ir.Module, text: str) -> None:
    want = ir.verify(ir.parse(text))
    assert m.hash() == want.hash(), f"builder:\n{ir.format(m)}\ntext:\n{ir.format(want)}"
    assert m == want
    assert ir.parse(ir.format(m)) == want
    assert ir.decode(ir.encode(m)) == want


def code_of(fn) -> str:
    with pytest.raises(ir.IRError) as ei:
        fn()
    assert isinstance(ei.value, ir.IRError)
    return ei.value.code.value


def test_t1_by_builder():
    b = ir.Builder()
    b.mesh("m", dp=2, tp=2)
    f = b.func("mlp")
    x = f.param("f32[B, 784]", name="x", sharding="@m[shard(0), replicate]")
    w1 = f.param("f32[784, 256]", name="w1", sharding="@m[replicate, shard(1)]")
    b1 = f.param("f32[256]", name="b1")
    w2 = f.param("f32[256, 10]", name="w2", sharding="@m[replicate, shard(0)]")
    h = f.matmul(x, w1, name="h")
    assert str(h.type) == "f32[B, 256]"
    hb = f.add(h, b1)
    a = f.gelu(hb, approximate="tanh")
    y = f.matmul(a, w2, sharding="@m[shard(0), partial(sum)]")
    r = f.all_reduce(y, mesh="m", axes=["tp"], op="sum")
    s = f.reduce_sum(r, axes=[1], keepdims=True)
    assert str(s.type) == "f32[B, 1]"
    f.constant(type="f32[1, 2]", value=[[1.0, 2.5]])
    f.full(type="f32[B, 10]", value=0)
    f.ret(r)
    b.task("t", "mlp", inputs=["x", "w1", "b1", "w2"], outputs=["y"])
    same(b.build(), T1)


def test_t1_by_builder_with_objects():
    f32 = DTYPES["f32"]
    B = ir.sym("B")
    b = ir.Builder((1, 0))
    b.mesh("m", dp=2, tp=2)
    f = b.func("mlp")
    x = f.param(TensorType(f32, (B, 784)), sharding=Sharding("m", (Shard(0), Replicate())))
    w1 = f.param(TensorType(f32, (784, 256)), sharding=Sharding("m", (Replicate(), Shard(1))))
    b1 = f.param(TensorType(f32, (256,)))
    w2 = f.param(TensorType(f32, (256, 10)), sharding=Sharding("m", (Replicate(), Shard(0))))
    h = f.op("matmul", x, w1)
    hb = f.op("add", h, b1)
    a = f.op("gelu", hb, approximate="tanh")
    y = f.op("matmul", a, w2, sharding=Sharding("m", (Shard(0), Partial("sum"))))
    r = f.op("all_reduce", y, mesh="@m", axes=("tp",))
    f.op("reduce_sum", r, axes=(1,), keepdims=True)
    f.op("constant", type=TensorType(f32, (1, 2)), value=np.array([[1.0, 2.5]]).tolist())
    f.op("full", type="f32[B, 10]", value=0.0)
    f.ret(r)
    b.task("t", "@mlp", inputs=("x", "w1", "b1", "w2"), outputs=("y",), after=())
    same(b.build(), T1)


def test_names_do_not_matter():
    def build(names):
        b = ir.Builder()
        f = b.func("f")
        x = f.param("f32[4]", name=names[0])
        y = f.neg(x, name=names[1])
        f.ret(y)
        return b.build()

    assert build(["x", "y"]).hash() == build(["a", "b"]).hash() == build([None, None]).hash()


def test_unnamed_values_print_and_reparse():
    b = ir.Builder()
    f = b.func("f")
    x = f.param("f32[4]")
    y = f.param("f32[4]")
    z = f.add(x, y)
    w = f.mul(z, z)
    f.ret(w)
    m = b.build()
    text = ir.format(m)
    assert ir.parse(text) == m
    assert len(set(v for v in text.split() if v.startswith("%"))) >= 4


def test_duplicate_names_in_builder_still_print_validly():
    b = ir.Builder()
    f = b.func("f")
    x = f.param("f32[4]", name="a")
    y = f.neg(x, name="a")
    z = f.neg(y, name="a")
    f.ret(z)
    m = b.build()
    assert ir.verify(ir.parse(ir.format(m))) == m


def test_attribute_normalisation_equals_text():
    def mk(**kw):
        b = ir.Builder()
        f = b.func("f")
        x = f.param("f32[3, 4]")
        y = f.reduce_sum(x, **kw)
        f.ret(y)
        return b.build()

    text = "dtm 1.0\nfunc @f(%x: f32[3, 4]) -> (f32[3]) {\n  %y = reduce_sum %x {axes = [1]} : f32[3]\n  return %y\n}\n"
    same(mk(axes=[1]), text)
    same(mk(axes=(1,)), text)
    same(mk(axes=[1], keepdims=False), text)
    same(mk(axes=[np.int64(1)]), text)


def test_full_scalar_normalisation():
    for v in (0, 0.0, -0, 0.0e3):
        b = ir.Builder()
        f = b.func("f")
        z = f.full(type="f32[2]", value=v)
        f.ret(z)
        same(b.build(), "dtm 1.0\nfunc @f() -> (f32[2]) {\n  %z = full {value = 0.0} : f32[2]\n  return %z\n}\n")
    b = ir.Builder()
    f = b.func("f")
    z = f.full(type="i32[2]", value=3.0)
    f.ret(z)
    same(b.build(), "dtm 1.0\nfunc @f() -> (i32[2]) {\n  %z = full {value = 3} : i32[2]\n  return %z\n}\n")


@pytest.mark.parametrize("name", ["unary", "binary", "reduce", "movement", "linalg_creation", "composite",
                                  "collectives", "quant", "state_store", "calls_tasks", "symbolic"])
def test_corpus_rebuilt_from_its_own_ops(name):
    """Rebuild every corpus module op by op through the Builder (inferring types where it
    can, declaring them where the op needs it) and get the same hash."""
    src = ir.verify(ir.parse(CORPUS[name]))
    b = ir.Builder(src.version)
    for mname, mesh in src.meshes.items():
        b.mesh(mname, **dict(mesh.axes))
    for fname, fn in src.funcs.items():
        fb = b.func(fname)
        env = {}
        for p in fn.params:
            env[id(p)] = fb.param(p.type, name=p.name, sharding=p.sharding)
        for op in fn.ops:
            opdef = ir.REGISTRY[op.name]
            kw = {}
            if opdef.declared or op.name == "call":
                kw["type"] = [r.type for r in op.results] if len(op.results) != 1 else op.results[0].type
            if len(op.results) == 1 and op.results[0].sharding is not None:
                kw["sharding"] = op.results[0].sharding
            attrs = dict(op.attrs)
            if "value" in attrs and isinstance(attrs["value"], ir.Literal):
                attrs["value"] = attrs["value"].to_numpy().tolist()
            out = fb.op(op.name, *[env[id(v)] for v in op.operands], **kw, **attrs)
            outs = () if out is None else (out if isinstance(out, tuple) else (out,))
            assert [o.type for o in outs] == [r.type for r in op.results]
            for r, o in zip(op.results, outs):
                env[id(r)] = o
        fb.ret(*[env[id(v)] for v in fn.returns])
        fb.func.result_types = list(fn.result_types)
    for t in src.tasks.values():
        b.task(t.name, t.func, t.inputs, t.outputs, t.after)
    m = b.build()
    assert m.hash() == src.hash()


# --- errors -----------------------------------------------------------------------------------

def fb():
    b = ir.Builder()
    b.mesh("m", dp=2, tp=2)
    return b, b.func("f")


def test_unknown_op():
    b, f = fb()
    x = f.param("f32[4]")
    assert code_of(lambda: f.op("frobnicate", x)) == "E0301"
    with pytest.raises(AttributeError):
        f.frobnicate  # noqa: B018


@pytest.mark.parametrize("call, code", [
    (lambda f, x, y: f.reduce_sum(x), "E0303"),
    (lambda f, x, y: f.reduce_sum(x, axes=[0], bogus=1), "E0304"),
    (lambda f, x, y: f.reduce_sum(x, axes="0"), "E0305"),
    (lambda f, x, y: f.reduce_sum(x, axes=[0], keepdims=1), "E0305"),
    (lambda f, x, y: f.reduce_sum(x, axes=[5]), "E0306"),
    (lambda f, x, y: f.gelu(x, approximate="fast"), "E0306"),
    (lambda f, x, y: f.cast(x, to="f31"), "E0401"),
    (lambda f, x, y: f.add(x, y), "E0402"),
    (lambda f, x, y: f.add(x, f.param("f32[5]")), "E0403"),
    (lambda f, x, y: f.matmul(x, x), "E0406"),
    (lambda f, x, y: f.reshape(x, shape=[-1]), "E0405"),
    (lambda f, x, y: f.cast(f.param("q8_0[32]"), to="i32"), "E0408"),
    (lambda f, x, y: f.add(f.param("q8_0[32]"), f.param("q8_0[32]")), "E0408"),
    (lambda f, x, y: f.constant(type="f32[2]", value=[[1.0], 2.0]), "E0410"),
    (lambda f, x, y: f.full(type="f32[2]", value="zero"), "E0305"),
    (lambda f, x, y: f.full(value=0.0), "E0307"),
    (lambda f, x, y: f.all_reduce(x, mesh="nope", axes=["tp"]), "E0205"),
    (lambda f, x, y: f.all_reduce(x, mesh="m", axes=["zz"]), "E0501"),
    (lambda f, x, y: f.all_reduce(x, mesh="m", axes=["tp", "tp"]), "E0506"),
    (lambda f, x, y: f.broadcast(x, mesh="m", axes=["tp"], src=2), "E0506"),
    (lambda f, x, y: f.reduce_scatter(f.param("f32[3]"), mesh="m", axes=["tp"], dim=0), "E0403"),
    (lambda f, x, y: f.call(x, callee="nope"), "E0203"),
    (lambda f, x, y: f.param("f32[B"), "E0102"),
    (lambda f, x, y: f.param("f31[4]"), "E0401"),
    (lambda f, x, y: f.param("q8_0[31]"), "E0408"),
    (lambda f, x, y: f.param("f32[4]", sharding="@m[bogus]"), "E0507"),
    (lambda f, x, y: f.param("f32[4]", sharding="m[replicate]"), "E0102"),
])
def test_op_errors_are_irerrors_with_codes(call, code):
    b, f = fb()
    x = f.param("f32[4]")
    y = f.param("i32[4]")
    assert code_of(lambda: call(f, x, y)) == code


@pytest.mark.parametrize("setup, code", [
    (lambda b, f, x: f.ret(f.neg(x, sharding="@zz[replicate]")), "E0205"),
    (lambda b, f, x: f.ret(f.neg(x, sharding="@m[replicate]")), "E0504"),
    (lambda b, f, x: f.ret(f.neg(x, sharding="@m[shard(1), replicate]")), "E0502"),
    (lambda b, f, x: f.ret(f.neg(x, sharding="@m[shard(0), shard(0)]")), "E0503"),
    (lambda b, f, x: b.mesh("bad", a=0), "E0505"),
    (lambda b, f, x: b.task("t", "nope", ["x"], []), "E0203"),
    (lambda b, f, x: b.task("t", "f", [], []), "E0302"),
    (lambda b, f, x: b.task("t", "f", ["x"], [], after=["u"]), "E0208"),
    (lambda b, f, x: b.task("t", "f", ["x"], [], after=["t"]), "E0209"),
    (lambda b, f, x: f.ret(f.full(type="f32[C]", value=0.0)), "E0409"),
    (lambda b, f, x: f.ret(f.constant(type="f32[3]", value=[1.0, 2.0])), "E0410"),
    (lambda b, f, x: f.ret(f.add(x, x, type="f32[5]")), "E0404"),
])
def test_build_errors_are_irerrors_with_codes(setup, code):
    b, f = fb()
    x = f.param("f32[4]")
    setup(b, f, x)
    if not f.func.returns and not f.func.result_types:
        f.ret()
    assert code_of(b.build) == code


def test_task_attribute_errors():
    b, f = fb()
    assert code_of(lambda: b.task("t", "f", "x", [])) == "E0305"
    assert code_of(lambda: b.task("t", "f", [1], [])) == "E0305"


def test_errors_from_builder_have_no_location():
    b, f = fb()
    x = f.param("f32[4]")
    with pytest.raises(ir.IRError) as ei:
        f.add(x, f.param("f32[5]"))
    assert ei.value.line is None and ei.value.col is None
    assert str(ei.value).startswith("E0403: ")


@pytest.mark.parametrize("n", [1, 3])
def test_wrong_operand_count_is_irerror(n):
    b, f = fb()
    x = f.param("f32[4]")
    assert code_of(lambda: f.add(*[x] * n)) == "E0302"


def test_non_value_operand_is_irerror():
    b, f = fb()
    x = f.param("f32[4]")
    assert code_of(lambda: f.add(x, 1.0)) == "E0302"


@pytest.mark.parametrize("func, mesh, axis", [("my func", None, "dp"), ("1f", None, "dp"), ("f", "my mesh", "dp"),
                                             ("f", "m-n", "dp"), ("f", "m", "a.b"), ("f", "m", "a b")])
def test_unprintable_function_mesh_and_axis_names_are_refused(func, mesh, axis):
    b = ir.Builder()
    if mesh is not None:
        b.mesh(mesh, **{axis: 2})
    f = b.func(func)
    x = f.param("f32[4]")
    f.ret(x)
    assert code_of(b.build) == "E0211"


def test_dotted_function_and_mesh_names_round_trip():
    b = ir.Builder()
    b.mesh("m.n", dp=2)
    f = b.func("f.g")
    f.ret(f.param("f32[4]", sharding="@m.n[replicate]"))
    m = b.build()
    assert ir.parse(ir.format(m)) == m


def test_unprintable_value_names_are_renumbered_by_the_printer():
    b = ir.Builder()
    f = b.func("f")
    x = f.param("f32[4]", name="a b")
    f.ret(f.neg(x, name="%y z"))
    m = b.build()
    text = ir.format(m)
    assert "a b" not in text and "y z" not in text
    assert ir.parse(text) == m
