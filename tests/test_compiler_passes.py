"""The IR-to-IR passes one at a time: decompose produces exactly the spec's normative
decompositions (3.9), simplify's rules, and their results verify."""

from __future__ import annotations

import os
import pathlib
import re

import numpy as np
import pytest

from dtm.compiler.decompose import decompose
from dtm.compiler.irutil import with_func
from dtm.compiler.schedule import fuse
from dtm.compiler.simplify import simplify
from dtm.ir import parse, verify
from dtm.ir.module import Func
from dtm.ref import run as ref_run

SPEC = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "spec" / "dtm-spec.md").read_text()
BLOCKS = [parse(b) for b in re.findall(r"```dtm\n(.*?)```", SPEC, re.S)]
COMPOSITES = ["softmax", "log_softmax", "layer_norm", "gelu", "silu", "scaled_dot_product_attention"]


def _spec_func(name: str) -> tuple:
    for m in BLOCKS:
        if name in m.funcs:
            return m, m.funcs[name]
    raise KeyError(name)


def _same_program(a: Func, b: Func) -> None:
    """Equal op for op: names, operands (by position), attributes (floats rounded to the
    result dtype), result types; and the same returns."""
    ids_a = {v: i for i, v in enumerate(a.params)}
    ids_b = {v: i for i, v in enumerate(b.params)}
    assert len(a.ops) == len(b.ops), ([op.name for op in a.ops], [op.name for op in b.ops])
    for n, (x, y) in enumerate(zip(a.ops, b.ops)):
        assert x.name == y.name, (n, x.name, y.name)
        assert [ids_a[v] for v in x.operands] == [ids_b[v] for v in y.operands], (n, x.name)
        assert [r.type for r in x.results] == [r.type for r in y.results], (n, x.name)
        for k in x.attrs:
            va, vb = x.attrs[k], y.attrs[k]
            if isinstance(va, float) and x.results and x.results[0].type.dtype.name == "f32":
                assert np.float32(va) == np.float32(vb) or (np.isnan(va) and np.isnan(vb)), (n, k, va, vb)
            else:
                assert va == vb, (n, x.name, k, va, vb)
        for r in x.results:
            ids_a[r] = len(ids_a)
        for r in y.results:
            ids_b[r] = len(ids_b)
    assert [ids_a[v] for v in a.returns] == [ids_b[v] for v in b.returns]


@pytest.mark.parametrize("name", COMPOSITES)
def test_decompose_is_the_spec_decomposition(name):
    module, example = _spec_func(f"{name}_example")
    _, want = _spec_func(f"{name}_decomposed")
    got = simplify(decompose(example))  # gelu's example shares 0.5 * x between its two forms: CSE
    verify(with_func(module, got))
    _same_program(got, want)


def test_decomposition_runs_like_the_composite():
    for name in COMPOSITES:
        module, example = _spec_func(f"{name}_example")
        rng = np.random.default_rng(1)
        ins = [rng.standard_normal([d if isinstance(d, int) else 3 for d in p.type.shape]).astype(np.float32)
               for p in example.params]
        got = ref_run(with_func(module, decompose(example)), example.name, ins)
        for g, w in zip(got, ref_run(module, example.name, ins)):
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-6)


def test_narrow_float_composites_stay_composite():
    m = parse("dtm 1.0\n\nfunc @f(%x: f16[4, 8]) -> (f16[4, 8]) {\n  %y = softmax %x {axis = 1} : f16[4, 8]\n"
              "  return %y\n}\n")
    assert [op.name for op in decompose(m.funcs["f"]).ops] == ["softmax"]
    assert fuse(m.funcs["f"]).groups[0].kind == "fallback"


SIMPLIFY = parse("""dtm 1.0

func @f(%x: f32[B, 4], %i: i32[4], %p: f32[4]) -> (f32[B, 4], f32[B, 4], i32[4], f32[2, 2], f32[4, B], f32[B, 4], f32[4], f32[B, 4]) {
  %one = full {value = 1.0} : f32[]
  %zero = full {value = 0.0} : f32[]
  %izero = full {value = 0} : i32[]
  %two = full {value = 2.0} : f32[]
  %a = mul %x, %one : f32[B, 4]
  %b = sub %a, %zero : f32[B, 4]
  %fz = add %x, %zero : f32[B, 4]
  %iz = add %i, %izero : i32[4]
  %t = add %two, %two : f32[]
  %bb = broadcast_to %t {shape = [4]} : f32[4]
  %r = reshape %bb {shape = [2, 2]} : f32[2, 2]
  %p1 = permute %x {perm = [1, 0]} : f32[4, B]
  %p2 = permute %p1 {perm = [1, 0]} : f32[B, 4]
  %p3 = permute %p2 {perm = [1, 0]} : f32[4, B]
  %d = mul %x, %two : f32[B, 4]
  %d2 = mul %x, %two : f32[B, 4]
  %e = add %d, %d2 : f32[B, 4]
  %dead = exp %x : f32[B, 4]
  %pp = reshape %p {shape = [4]} : f32[4]
  assign %p, %pp
  %s = reduce_sum %x {axes = []} : f32[B, 4]
  return %b, %fz, %iz, %r, %p3, %e, %pp, %s
}
""")


def test_simplify_rules():
    f = simplify(SIMPLIFY.funcs["f"])
    verify(with_func(SIMPLIFY, f))
    x, i, p = f.params
    ret = f.returns
    assert ret[0] is x                              # x * 1 - 0
    assert ret[1] is not x                          # x + 0.0 is not x for floats (-0.0 + 0.0 = +0.0)
    assert ret[2] is i                              # integer + 0
    by = {r: op for op in f.ops for r in op.results}
    assert by[ret[3]].name == "full" and by[ret[3]].attrs["value"] == 4.0   # folded
    assert by[ret[4]].name == "permute" and by[ret[4]].operands[0] is x     # permute chain
    e = by[ret[5]]
    assert e.operands[0] is e.operands[1]           # common subexpression
    assert ret[6] is not p                          # never replaced by an assigned parameter
    assert ret[7] is x                              # a reduction over no axes
    assert "exp" not in [op.name for op in f.ops]   # dead code
    assert "assign" in [op.name for op in f.ops]    # effects stay
    rng = np.random.default_rng(0)
    ins = [rng.standard_normal((3, 4)).astype(np.float32), np.arange(4, dtype=np.int32),
           rng.standard_normal(4).astype(np.float32)]
    want = ref_run(SIMPLIFY, "f", [a.copy() for a in ins])
    got = ref_run(with_func(SIMPLIFY, f), "f", [a.copy() for a in ins])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


SLICES = parse("""dtm 1.0

func @f(%x: f32[2, 6, 8], %w: f32[8, 5], %b: f32[5], %v: f32[2, 6, 5]) -> (f32[2, 5], f32[2, 6, 5], f32[5, 2], f32[2, 1, 5], f32[2, 2]) {
  %n = reduce_sum %x {axes = [2], keepdims = true} : f32[2, 6, 1]
  %c = sub %x, %n : f32[2, 6, 8]
  %h = mul %c, %c : f32[2, 6, 8]
  %y = matmul %h, %w : f32[2, 6, 5]
  %yb = add %y, %b : f32[2, 6, 5]
  %g = tanh %yb : f32[2, 6, 5]
  %last = slice %g {start = [0, 5, 0], stop = [2, 6, 5], step = [1, 1, 1]} : f32[2, 1, 5]
  %r = reshape %last {shape = [2, 5]} : f32[2, 5]
  %u = exp %v : f32[2, 6, 5]
  %ut = permute %u {perm = [2, 0, 1]} : f32[5, 2, 6]
  %u0 = slice %ut {start = [0, 0, 0], stop = [5, 2, 1], step = [1, 1, 1]} : f32[5, 2, 1]
  %u1 = reshape %u0 {shape = [5, 2]} : f32[5, 2]
  %k = neg %v : f32[2, 6, 5]
  %k0 = slice %k {start = [0, 0, 0], stop = [2, 1, 5], step = [1, 1, 1]} : f32[2, 1, 5]
  %k1 = slice %k {start = [0, 1, 0], stop = [2, 2, 5], step = [1, 1, 1]} : f32[2, 1, 5]
  %kk = add %k0, %k1 : f32[2, 1, 5]
  %s = reduce_sum %v {axes = [1], keepdims = false} : f32[2, 5]
  %s0 = slice %s {start = [0, 1], stop = [2, 5], step = [1, 2]} : f32[2, 2]
  return %r, %u, %u1, %kk, %s0
}
""")


def test_a_slice_is_computed_from_slices_of_what_only_it_reads():
    """logits[:, -1] of tanh(norm(x) @ w + b): one row per sequence all the way up (the
    product included); exp(v) is returned whole as well, so its slice stays a slice; two
    different slices of neg(v) keep neg whole; a strided slice of a reduction (keepdims false)
    reduces a strided slice. Same values as the program, through the reference."""
    f = simplify(SLICES.funcs["f"])
    verify(with_func(SLICES, f))
    shapes = {op.name: [] for op in f.ops}
    for op in f.ops:
        shapes[op.name].append(tuple(op.results[0].type.shape) if op.results else ())
    assert shapes["matmul"] == [(2, 1, 5)], shapes["matmul"]       # one row of each product
    assert shapes["tanh"] == [(2, 1, 5)] and shapes["reduce_sum"].count((2, 1, 1)) == 1
    assert shapes["exp"] == [(2, 6, 5)] and shapes["neg"] == [(2, 6, 5)], shapes
    assert (2, 2) in shapes["reduce_sum"] and (2, 5) not in shapes["reduce_sum"], shapes["reduce_sum"]
    rng = np.random.default_rng(1)
    ins = [rng.standard_normal(s).astype(np.float32) for s in [(2, 6, 8), (8, 5), (5,), (2, 6, 5)]]
    for got, want in zip(ref_run(with_func(SLICES, f), "f", ins), ref_run(SLICES, "f", ins)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


MASKED = parse("""dtm 1.0

func @f(%s: f32[2, 8, 8], %keep: bool[8, 8]) -> (f32[2, 8, 8], f32[2, 8, 8]) {
  %ninf = full {value = -inf} : f32[]
  %m = where %keep, %s, %ninf : f32[2, 8, 8]
  %p = softmax %m {axis = 2} : f32[2, 8, 8]
  %m2 = where %keep, %s, %ninf : f32[2, 8, 8]
  %p2 = softmax %m2 {axis = 2} : f32[2, 8, 8]
  return %p, %p2
}
""")


def test_an_op_of_a_select_with_a_small_branch_computes_that_branch_small():
    """exp(where(mask, s, -inf) - max): exp runs on the scores everywhere and on -inf - max
    once per row (vector exp takes a slow path for -inf, element by element); the ops the
    rule emits are themselves simplified, so the second, equal softmax is the first. Same
    values as the program, NaN for a fully masked row included."""
    f = simplify(decompose(MASKED.funcs["f"]))
    verify(with_func(MASKED, f))
    exps = sorted(tuple(op.results[0].type.shape) for op in f.ops if op.name == "exp")
    assert exps == [(2, 8, 1), (2, 8, 8)], exps
    assert f.returns[0] is f.returns[1]
    rng = np.random.default_rng(3)
    keep = np.tril(np.ones((8, 8), bool))
    keep[5] = False  # a fully masked row: NaN either way
    ins = [rng.standard_normal((2, 8, 8)).astype(np.float32), keep]
    got, want = ref_run(with_func(MASKED, f), "f", ins), ref_run(MASKED, "f", ins)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


BROKEN = """dtm 1.0

func @f(%x: f32[4]) -> (f32[4]) {
  %y = exp %x : f32[4]
  return %y
}
"""


def _misnamed(f: Func) -> Func:
    """A pass with a bug: it renames exp to an op the registry does not have."""
    op = f.ops[0]
    bad = type(op)("not_an_op", op.operands, op.attrs, op.results, op.loc)
    return Func(f.name, list(f.params), list(f.result_types), [bad], list(f.returns), f.loc, f.return_loc)


def test_a_compile_verifies_its_program_and_with_the_debug_flag_every_pass(monkeypatch):
    """By default run_passes verifies the program it starts from; DTM_DEBUG=verify (this suite
    sets it, conftest.py) verifies each pass's output too, so a pass with a bug fails there."""
    from dtm.compiler.passes import run_passes
    from dtm.errors import DTMError

    assert "verify" in os.environ["DTM_DEBUG"].split(",")
    module = parse(BROKEN)
    with pytest.raises(DTMError, match="not_an_op"):
        run_passes(module, "f", [("misnamed", _misnamed)])
    monkeypatch.setenv("DTM_DEBUG", "")
    assert run_passes(module, "f", [("misnamed", _misnamed)]).ops[0].name == "not_an_op"  # not checked
    broken = parse(BROKEN)
    broken.funcs["f"] = _misnamed(broken.funcs["f"])
    with pytest.raises(DTMError, match="not_an_op"):                 # the program given is
        run_passes(broken, "f", [])
