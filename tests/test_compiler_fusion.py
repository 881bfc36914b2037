"""What the cpu backend fuses: kernel counts for the patterns the compiler promises, each also
checked against the reference, plus programs that stress the index arithmetic of fusion
(views into views, reductions over inner and outer axes, broadcasting)."""

from __future__ import annotations

import numpy as np
import pytest

import dtm
import dtm.debug
from dtm import functional as F
from dtm.ir import parse, verify
from dtm.compiler.irutil import with_func
from dtm.backends.cpu.passes import compile_func
from dtm.ref import run as ref_run
from dtm.runtime.backend import get_backend

CPU = get_backend("cpu")
rng = np.random.default_rng(11)


def T(*shape, scale=1.0):
    return dtm.tensor((rng.standard_normal(shape) * scale).astype(np.float32))


def same(fn, *args, tol=1e-5):
    """fn on the cpu backend agrees with fn on ref (both through dtm.jit)."""
    want = dtm.jit(fn, backend="ref")(*args)
    got = dtm.jit(fn, backend="cpu")(*args)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    for w, g in zip(want, got):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=tol, atol=tol)


def count(fn, *args) -> int:
    same(fn, *args)
    return dtm.debug.count_kernels(fn, *args)


def test_softmax_over_the_last_axis_is_one_kernel():
    assert count(lambda x: F.softmax(x, -1), T(4, 33)) == 1
    assert count(lambda x: F.log_softmax(x, -1), T(2, 3, 17)) == 1


def test_layer_norm_is_one_kernel():
    w, b = T(48), T(48)
    assert count(lambda x: F.layer_norm(x, 48, w, b), T(2, 5, 48)) == 1
    assert count(lambda x: F.layer_norm(x, 48), T(7, 48)) == 1


def test_gelu_of_linear_is_one_kernel():
    w, b = T(40, 24), T(24)
    assert count(lambda x: F.gelu(x @ w + b), T(6, 40)) == 1
    assert count(lambda x: F.gelu(x @ w + b, approximate="tanh"), T(3, 6, 40)) == 1
    wt = T(24, 40)
    assert count(lambda x, r: F.linear(x, wt, b) + r, T(6, 40), T(6, 24)) == 1  # residual, transposed weight


def test_elementwise_chain_is_one_kernel():
    y = T(5, 1)
    assert count(lambda x: F.tanh(F.exp(x) * 2.0 + y).sigmoid() - x.permute(1, 0).transpose(0, 1), T(5, 7)) == 1


def test_causal_attention_is_at_most_three_kernels():
    q, k, v = T(2, 4, 9, 16), T(2, 4, 9, 16), T(2, 4, 9, 16)
    n = count(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v)
    assert n <= 3


def test_heads_split_from_one_qkv_product_are_read_in_place():
    """GPT-2's attention input: one product for q, k and v with its bias, split into heads by
    a reshape and slices. The bias is the product's epilogue, the products of attention read
    q, k and v where that product wrote them, and the softmax is q @ k^T's epilogue (its rows
    whole): 3 kernels (qkv, q @ k^T with softmax, p @ v), no copy."""
    w, b = T(16, 3 * 16, scale=0.3), T(3 * 16)

    def attention(x):
        qkv = (x @ w + b).reshape(2, 5, 4, 3, 4)  # [B, T, heads, (q, k, v), head_dim]
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    assert count(attention, T(2, 5, 16)) == 3


@pytest.mark.parametrize("m, n", [(6, 40), (3, 100), (40, 256), (5, 300)])
def test_a_row_reduction_of_a_product_is_its_epilogue(m, n):
    """Softmax over a product's rows and a residual's layer norm after a projection run in the
    product's epilogue on whole rows (the runtime never splits rows of at most WHOLE_ROWS
    columns between threads, even when there are fewer rows than columns): one kernel.
    Wider rows get a kernel of their own; both agree with the reference."""
    a, b, r, g, bb = T(m, 24), T(24, n, scale=0.5), T(m, n), T(n), T(n)
    fused = 1 if n <= 256 else 2
    assert count(lambda a, b: F.softmax(a @ b, -1), a, b) == fused
    assert count(lambda a, b, r: F.layer_norm(r + a @ b, n, g, bb), a, b, r) == fused


def test_a_narrow_weights_product_keeps_its_layer_norm_apart():
    """The narrow weights' runtime splits a product by columns: a row reduction after it is a
    kernel of its own (reading rows split between threads would see half a row)."""
    lin = dtm.nn.Linear(32, 64)
    dtm.quant.quantize(lin, "q8_0")
    g, bb = T(64), T(64)
    fn = lambda x: F.layer_norm(lin(x), 64, g, bb)  # noqa: E731
    x = T(40, 32)
    same(fn, x, tol=5e-2)  # the narrow product rounds its activations as well (spec 2.2.4)
    assert dtm.debug.count_kernels(fn, x) == 2


def test_a_merged_kernel_stores_a_bounded_number_of_values():
    """An optimizer's update of many same-shape weights merges into kernels of at most
    MERGE_STORES outputs each (the C compiler's time grows faster than a kernel's size), and
    agrees with the reference."""
    from dtm.compiler.passes import dump
    from dtm.compiler.schedule import MERGE_STORES

    xs = [T(96) for _ in range(20)]

    def update(s, *xs):  # two outputs per weight, all reading the array s: one kernel without the bound
        return tuple(y for x in xs for y in (x - s * x * x, x * 0.9 + s))

    s = T(96)
    same(update, s, *xs)
    text = dump(compile_func(dtm.jit(update).ir(s, *xs), "main", upto="lower_loops"))
    outputs = [line.count("out out") for line in text.splitlines() if line.startswith("kernel ")]
    assert sum(outputs) == 40 and max(outputs) == MERGE_STORES and len(outputs) >= 2, outputs


def test_kernels_that_share_only_a_scalar_stay_apart_and_share_a_body():
    """Merging saves a pass over memory only when the kernels read one array: the AdamW
    updates of same-shaped weights, which share only the step's scalars, stay apart (and
    share one C body: share.py); a shared array still merges."""
    from dtm.backends.cpu.build import _anonymous

    lr, a, b = dtm.tensor(np.float32(0.01)), T(64), T(64)
    program = compile_func(dtm.jit(lambda lr, a, b: (a - lr * a, b - lr * b)).ir(lr, a, b), "main")
    assert len(program.kernels) == 2 and len({_anonymous(s.cfunc) for s in program.kernels}) == 1
    same(lambda lr, a, b: (a - lr * a, b - lr * b), lr, a, b)
    assert count(lambda lr, a, b: (a - lr * b, b - lr * b), lr, a, b) == 1  # both read b


def test_mlp_block_kernels():
    """A transformer MLP: layer_norm, gelu(x @ w1 + b1), x @ w2 + b2 + residual: 3 kernels."""
    w1, b1, w2, b2, g, bb = T(32, 64, scale=0.2), T(64), T(64, 32, scale=0.2), T(32), T(32), T(32)

    def mlp(x):
        h = F.layer_norm(x, 32, g, bb)
        return x + F.gelu(h @ w1 + b1) @ w2 + b2

    assert count(mlp, T(2, 6, 32)) == 3


def test_reductions_over_outer_and_middle_axes():
    same(lambda x: x.sum(0) * 2.0, T(7, 5))
    same(lambda x: x - x.mean(1, keepdim=True), T(3, 6, 4))
    same(lambda x: (x.amax(dim=(0, 2)), x.argmax(1)), T(3, 6, 4))
    same(lambda x: F.softmax(x, 0) + F.softmax(x, 1), T(4, 6))


def test_views_into_views():
    same(lambda x: x.reshape(4, 6).transpose(0, 1).reshape(3, 8)[1:, ::2].flip(0) * 1.5, T(2, 12))
    same(lambda x: F.cat([x, x.flip(1) * 2.0], dim=1).reshape(-1)[3:40], T(4, 5))
    same(lambda x: F.pad(x.transpose(0, 1), (1, 2, 0, 1), value=-3.0).sum(1), T(3, 4))
    same(lambda x: x.expand(3, 4, 5) + x.transpose(1, 2).reshape(4, 5), T(4, 5)[None].reshape(1, 4, 5))


def test_matmul_operands_are_views_and_epilogues_see_broadcasts():
    a, b = T(3, 8, 5), T(5, 7)
    same(lambda a, b: (a.transpose(1, 2)[:, ::2] @ a[0, :, :3] + 1.0).relu(), a, b)
    same(lambda a, b: F.softmax(a @ b, -1), a, b)
    same(lambda a, b: (a @ b) * (a @ b).sum(-1, keepdim=True), a, b)


def test_decompose_and_simplify_results_verify():
    m = parse("""dtm 1.0

func @f(%x: f32[B, 16], %w: f32[16], %b: f32[16], %q: f32[B, 2, 5, 8]) -> (f32[B, 16], f32[B, 16], f32[B, 2, 5, 8]) {
  %a = softmax %x {axis = 1} : f32[B, 16]
  %n = layer_norm %x, %w, %b : f32[B, 16]
  %one = full {value = 1.0} : f32[]
  %n1 = mul %n, %one : f32[B, 16]
  %o = scaled_dot_product_attention %q, %q, %q {causal = true} : f32[B, 2, 5, 8]
  return %a, %n1, %o
}
""")
    for upto in ("decompose", "simplify"):
        f = compile_func(m, "f", upto=upto)
        verify(with_func(m, f))
        assert not any(op.name in ("softmax", "layer_norm", "scaled_dot_product_attention") for op in f.ops)
    assert not any(op.name == "mul" and op.results[0].name == "n1" for op in compile_func(m, "f", upto="simplify").ops)


def test_symbolic_programs_agree_with_ref():
    m = parse("""dtm 1.0

func @f(%x: f32[B, T, 8], %w: f32[8, 4], %k: f32[B, T, 4]) -> (f32[B, T, 4], f32[B*T, 4], f32[T - 1, 4], f32[B, T, 4]) {
  %y = matmul %x, %w : f32[B, T, 4]
  %r = reshape %y {shape = [B*T, 4]} : f32[B*T, 4]
  %s = slice %r {start = [1, 0], stop = [T, 4], step = [1, 1]} : f32[T - 1, 4]
  %sm = softmax %y {axis = 2} : f32[B, T, 4]
  %z = add %sm, %k : f32[B, T, 4]
  return %y, %r, %s, %z
}
""")
    plan = CPU.plan(m, "f")
    for b, t in ((2, 5), (1, 3), (3, 1)):
        ins = [rng.standard_normal(s).astype(np.float32) for s in ((b, t, 8), (8, 4), (b, t, 4))]
        for got, want in zip(CPU.run(m, "f", ins), ref_run(m, "f", ins)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert CPU.plan(m, "f") is plan


@pytest.mark.parametrize("n", [1, 2])
def test_kv_cache_style_update(n):
    """assign of a concat into a parameter (a KV cache), reading it before."""
    m = parse("""dtm 1.0

func @f(%cache: f32[4, 3], %new: f32[1, 3]) -> (f32[4, 3]) {
  %s = slice %cache {start = [1, 0], stop = [4, 3], step = [1, 1]} : f32[3, 3]
  %c = concat %s, %new {axis = 0} : f32[4, 3]
  %t = mul %cache, %cache : f32[4, 3]
  assign %cache, %c
  return %t
}
""")
    c0 = rng.standard_normal((4, 3)).astype(np.float32)
    new = rng.standard_normal((1, 3)).astype(np.float32)
    a, b = c0.copy(), c0.copy()
    for _ in range(n):
        (t1,) = ref_run(m, "f", [a, new])
        (t2,) = CPU.run(m, "f", [b, new])
        np.testing.assert_array_equal(t1, t2)
        np.testing.assert_array_equal(a, b)


SHARED = parse("""dtm 1.0

func @f(%x: f32[6, 10]) -> (f32[6, 10], f32[6, 1], f32[6], f32[6, 10], f32[10, 6]) {
  %m = reduce_max %x {axes = [1], keepdims = true} : f32[6, 1]
  %d = sub %x, %m : f32[6, 10]
  %e = exp %d : f32[6, 10]
  %s = reduce_sum %e {axes = [1], keepdims = true} : f32[6, 1]
  %y = div %e, %s : f32[6, 10]
  %s2 = reduce_sum %e {axes = [1]} : f32[6]
  %c = reduce_sum %x {axes = [0], keepdims = true} : f32[1, 10]
  %z = mul %y, %c : f32[6, 10]
  %t = permute %y {perm = [1, 0]} : f32[10, 6]
  %u = mul %t, %t : f32[10, 6]
  return %y, %m, %s2, %z, %u
}
""")


def test_row_kernels_share_reductions_and_store_row_values():
    prog = compile_func(SHARED, "f")
    x = rng.standard_normal((6, 10)).astype(np.float32)
    for got, want in zip(CPU.run(SHARED, "f", [x]), ref_run(SHARED, "f", [x])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # y, m and s2 come from one row kernel; the column sum and the transposed product are others
    row = [s for s in prog.kernels if s.group.kind == "reduce" and s.group.axes == (1,)]
    assert len(row) == 1 and len(row[0].outputs) >= 3, str(prog)


def test_a_collective_orders_after_its_producer_even_when_consumers_recompute_constants():
    """%b recomputes the constant %c, so its kernel's first op precedes the all_reduce; the
    collective only reads %a, and ordering it after every earlier reader of %a (as for an
    assign) made a cycle. Run on two ranks of the reference group against numpy."""
    from dtm.runtime import l0

    text = """dtm 1.0
mesh @m[tp = 2]
func @main(%x: f32[4]) -> (f32[4]) {
  %c = full {value = 2.0} : f32[]
  %a = add %x, %c : f32[4]
  %r = all_reduce %a {mesh = @m, axes = ["tp"], op = "sum"} : f32[4]
  %b = mul %r, %a : f32[4]
  %d = add %b, %c : f32[4]
  return %d
}
"""
    module = parse(text)
    verify(module)
    compile_func(module, "main")  # used to raise "the kernel graph has a cycle"
    xs = [rng.standard_normal(4).astype(np.float32) for _ in range(2)]
    outs = l0.executor().run([module, module], "main", [[x] for x in xs])  # compiled plans on two devices
    r = (xs[0] + 2) + (xs[1] + 2)
    for x, (o,) in zip(xs, outs):
        np.testing.assert_allclose(o, r * (x + 2) + 2, rtol=1e-6)


def test_a_sampling_loops_concat_chain_stays_small(tmp_path, monkeypatch):
    """`idx = dtm.cat([idx, next], 1)` a token at a time, realized once: one concat of every
    token (not a nest of them, whose C source tripled each token and hit 600 MB by the 17th),
    computed right for 500 tokens with a kernel of bounded size."""
    monkeypatch.setenv("DTM_CACHE_DIR", str(tmp_path))
    idx = dtm.tensor(np.zeros((2, 1), np.int64))
    for i in range(500):
        idx = dtm.cat([idx, dtm.tensor(np.array([[i + 1], [-i - 1]], np.int64)) * 1], dim=1)  # computed: recorded
    np.testing.assert_array_equal(idx.numpy(), np.arange(501) * np.array([[1], [-1]]))
    largest = max(p.stat().st_size for p in tmp_path.glob("*.c"))
    assert largest < 500 * 1000, f"{largest} bytes of C for 500 tokens"


def test_concats_nested_along_other_axes_grow_the_code_linearly(tmp_path, monkeypatch):
    """A nest no simplification flattens (each level concatenates along the other axis):
    each level's code is a few lines, not three times the level below."""
    monkeypatch.setenv("DTM_CACHE_DIR", str(tmp_path))
    sizes = []
    for depth in (6, 12):
        x = T(2, 2)
        want = x.numpy()
        x = x * 1  # a computed value: a cat of values all known is numpy's and compiles nothing
        for k in range(depth):
            y = T(*x.shape)
            x, want = dtm.cat([x, y], dim=k % 2), np.concatenate([want, y.numpy()], axis=k % 2)
        np.testing.assert_array_equal((x * 1).numpy(), want)
        sizes.append(max(p.stat().st_size for p in tmp_path.glob("*.c")))
    assert sizes[1] < 3 * sizes[0], sizes  # linear: about twice; a threefold growth would be 729 times


def test_an_inlined_expression_has_a_size_limit():
    """x = x * x + x, 13 times: inlined whole, every copy counted, far past INLINE_LIMIT ops,
    so the fuser stores intermediates (the kernel then reads them back, computed once); two
    levels stay inlined. Exact either way."""
    from dtm.compiler.schedule import INLINE_LIMIT

    def f(x, levels):
        for _ in range(levels):
            x = x * x + x
        return x

    x = T(8, scale=0.01)
    stored = []
    for levels in (2, 13):
        same(lambda x: f(x, levels), x)
        module = dtm.jit(lambda x: f(x, levels)).ir(x)
        sched = compile_func(module, "main", upto="fuse")
        stored.append(len(sched.stored))
    assert stored[0] == 1 and stored[1] > 1, stored
    assert INLINE_LIMIT >= 1000  # real programs (GPT-2's training step) stay below 200



def test_a_residual_stream_is_not_recomputed_by_every_reader():
    """x = x + layer_norm(x) @ w, layer after layer: inlined whole, every layer's kernels
    would re-add all earlier layers' products (loads quadratic in depth; GPT-2's layer norm
    weight gradients took 157 ms of a 1.3 s step so). With some residuals stored, the
    loads the kernels make grow linearly: twice the depth, about twice the loads."""
    import re

    from dtm.compiler.passes import dump

    def f(x, ws, depth):
        for w in ws[:depth]:
            x = x + F.layer_norm(x, (16,)) @ w
        return x

    x, ws = T(8, 16), [T(16, 16, scale=0.25) for _ in range(24)]
    loads = {}
    for depth in (12, 24):
        same(lambda x, *ws: f(x, ws, depth), x, *ws, tol=1e-4)
        program = compile_func(dtm.jit(lambda x, *ws: f(x, ws, depth)).ir(x, *ws), "main", upto="lower_loops")
        loads[depth] = len(re.findall(r"= in\d+\[", dump(program)))
    assert loads[24] <= 2.2 * loads[12], loads  # 258 -> 948 (3.7x) without the rule


def test_reductions_down_columns_keep_a_block_of_accumulators():
    """Sums, products, max and min over outer dims (a bias's gradient, a norm over the batch)
    run rows outside, a block of columns inside, one local array of accumulators per
    reduction: 70 columns are a block of 64 and one of 6; a mean and the variance that reads
    it are two sweeps; the normalised full-shape value is stored by the same kernel; NaNs in
    a column propagate through max and min; symbolic rows. Against the reference."""
    from dtm.compiler.passes import dump

    x = rng.standard_normal((3, 50, 70)).astype(np.float32)
    x[1, 7, 3] = np.nan
    x[2, 49, 69] = np.nan
    t = dtm.tensor(x)

    def stats(x):
        mean = x.mean(dim=(0, 1), keepdim=True)
        var = ((x - mean) ** 2).mean(dim=(0, 1), keepdim=True)
        return x.sum(dim=0), x.amax(dim=(0, 1)), x.amin(dim=1), (x - mean) / (var + 1e-5).sqrt(), \
            (x * 0.5 + 1.0).prod(dim=0)

    same(stats, t, tol=1e-4)
    program = compile_func(dtm.jit(stats).ir(t), "main", upto="lower_loops")
    text = dump(program)
    assert "f32[64]" in text and "(vectorised)" in text, text
    got = dtm.jit(stats)(t)
    assert np.isnan(got[1].numpy()[3]) and np.isnan(got[2].numpy()[2, 69]) and not np.isnan(got[2].numpy()[0, 3])
    m = parse("dtm 1.0\n\nfunc @f(%x: f32[B, 70]) -> (f32[70], f32[70]) {\n"
              "  %s = reduce_sum %x {axes = [0]} : f32[70]\n  %m = reduce_max %x {axes = [0]} : f32[70]\n"
              "  return %s, %m\n}\n")
    for rows in (1, 5, 130):
        a = rng.standard_normal((rows, 70)).astype(np.float32)
        for g, w in zip(CPU.plan(m, "f").run([a]), ref_run(m, "f", [a])):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dt", ["f32", "f64"])
def test_a_dropout_mask_is_drawn_inside_its_consumers_kernel(dt):
    """Uniform draws are compiled (Philox in C, c_random.py), fused with what reads them:
    dropout is one kernel, and its draws are the reference's to the bit."""
    m = parse(f"""dtm 1.0
func @f(%k: u32[2], %x: {dt}[37, 129]) -> ({dt}[37, 129], {dt}[37, 129]) {{
  %u = random %k {{distribution = "uniform"}} : {dt}[37, 129]
  %p = full {{value = 0.1}} : {dt}[]
  %keep = ge %u, %p : bool[37, 129]
  %s = full {{value = 1.1111111}} : {dt}[]
  %xs = mul %x, %s : {dt}[37, 129]
  %z = full {{value = 0.0}} : {dt}[]
  %y = where %keep, %xs, %z : {dt}[37, 129]
  return %u, %y
}}
""")
    verify(m)
    x = rng.standard_normal((37, 129)).astype(np.float32 if dt == "f32" else np.float64)
    for key in ([0, 0], [12345, 678], [0xFFFFFFFF, 0x80000001]):
        k = np.array(key, np.uint32)
        got, want = CPU.run(m, "f", [k, x]), ref_run(m, "f", [k, x])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    assert CPU.plan(m, "f").kernel_count == 1


def _philox_calls(body: list) -> int:
    from dtm.compiler import loopir as L
    n = 0
    for s in body:
        if isinstance(s, (L.Loop, L.If)):
            n += _philox_calls(s.body)
        for e in [getattr(s, a) for a in ("value", "index", "cond") if hasattr(s, a)]:
            stack = [e]
            while stack:
                x = stack.pop()
                if isinstance(x, L.Op):
                    n += x.op == "philox_uniform"
                    stack.extend(x.args)
                elif isinstance(x, L.Load):
                    stack.append(x.index)
    return n


@pytest.mark.parametrize("dt", ["f32", "f64"])
def test_a_row_kernel_draws_each_element_once(dt):
    """A dropout whose result a row kernel reduces (a layer norm of the residual, over the
    dropped values: two passes and the stores) draws each element once, in a vectorised
    loop over the row before the passes, which then read the stored mask; the mask is the
    reference's to the bit (the sums' order is unspecified: the values to rounding)."""
    m = parse(f"""dtm 1.0
func @f(%k: u32[2], %x: {dt}[37, 129], %r: {dt}[37, 129]) -> ({dt}[37, 129], bool[37, 129]) {{
  %u = random %k {{distribution = "uniform"}} : {dt}[37, 129]
  %p = full {{value = 0.1}} : {dt}[]
  %keep = ge %u, %p : bool[37, 129]
  %s = full {{value = 1.1111111}} : {dt}[]
  %xs = mul %x, %s : {dt}[37, 129]
  %z = full {{value = 0.0}} : {dt}[]
  %d = where %keep, %xs, %z : {dt}[37, 129]
  %h = add %d, %r : {dt}[37, 129]
  %sum = reduce_sum %h {{axes = [1], keepdims = true}} : {dt}[37, 1]
  %n = full {{value = 129.0}} : {dt}[]
  %mean = div %sum, %n : {dt}[37, 1]
  %c = sub %h, %mean : {dt}[37, 129]
  %c2 = mul %c, %c : {dt}[37, 129]
  %ss = reduce_sum %c2 {{axes = [1], keepdims = true}} : {dt}[37, 1]
  %y = div %c, %ss : {dt}[37, 129]
  return %y, %keep
}}
""")
    verify(m)
    npt = np.float32 if dt == "f32" else np.float64
    x, r = (rng.standard_normal((37, 129)).astype(npt) for _ in range(2))
    for key in ([0, 0], [12345, 678], [0xFFFFFFFF, 0x80000001]):
        k = np.array(key, np.uint32)
        (y, keep), (y_ref, keep_ref) = CPU.run(m, "f", [k, x, r]), ref_run(m, "f", [k, x, r])
        np.testing.assert_array_equal(keep, keep_ref)
        np.testing.assert_allclose(y, y_ref, rtol=1e-4 if dt == "f32" else 1e-12, atol=1e-7 if dt == "f32" else 1e-15)
    steps = CPU.plan(m, "f").program.steps
    assert len(steps) == 1
    assert _philox_calls(steps[0].kernel.body) == 1


def _kernels_with(steps: list, op: str) -> int:
    """How many of the steps' kernels compute `op` somewhere in their loop IR (epilogues included)."""
    from dtm.compiler import loopir as L

    def has(body: list) -> bool:
        for s in body:
            if isinstance(s, (L.Loop, L.If)) and has(s.body):
                return True
            if isinstance(s, L.Gemm) and s.epilogue and has(s.epilogue):
                return True
            stack = [getattr(s, a) for a in ("value", "index", "cond") if hasattr(s, a)]
            while stack:
                x = stack.pop()
                if isinstance(x, L.Op):
                    if x.op == op:
                        return True
                    stack.extend(x.args)
                elif isinstance(x, L.Load):
                    stack.append(x.index)
        return False

    return sum(has(s.kernel.body) for s in steps if hasattr(s, "kernel"))


def test_dropout_over_a_softmax_stores_the_softmax():
    """Attention's dropout: where(keep, softmax(q k^T) * s, 0), its probabilities read again
    later (by the backward pass; here by a product of what the dropout fed). The softmax is
    stored, by q k^T's epilogue, as without dropout: the later reader does not run the softmax
    again from a stored q k^T (its exponentials are computed in one kernel), and the dropout
    is an elementwise kernel whose draws vectorise. The mask is the reference's to the bit."""
    m = parse("""dtm 1.0
func @f(%k: u32[2], %a: f32[6, 24], %b: f32[24, 40], %v: f32[40, 8], %w: f32[8, 40]) -> (f32[6, 40], bool[6, 40]) {
  %s = matmul %a, %b : f32[6, 40]
  %y = softmax %s {axis = 1} : f32[6, 40]
  %u = random %k {distribution = "uniform"} : f32[6, 40]
  %p = full {value = 0.1} : f32[]
  %keep = ge %u, %p : bool[6, 40]
  %c = full {value = 1.1111111} : f32[]
  %ys = mul %y, %c : f32[6, 40]
  %z = full {value = 0.0} : f32[]
  %d = where %keep, %ys, %z : f32[6, 40]
  %o = matmul %d, %v : f32[6, 8]
  %h = matmul %o, %w : f32[6, 40]
  %gy = mul %y, %h : f32[6, 40]
  return %gy, %keep
}
""")
    verify(m)
    args = [rng.standard_normal(s).astype(np.float32) for s in ((6, 24), (24, 40), (40, 8), (8, 40))]
    for key in ([0, 0], [12345, 678]):
        k = np.array(key, np.uint32)
        (gy, keep), (gy_ref, keep_ref) = CPU.run(m, "f", [k, *args]), ref_run(m, "f", [k, *args])
        np.testing.assert_array_equal(keep, keep_ref)
        np.testing.assert_allclose(gy, gy_ref, rtol=1e-4, atol=1e-6)
    assert _kernels_with(CPU.plan(m, "f").program.steps, "exp") == 1


def test_dropout_over_a_causal_softmax_stores_the_softmax():
    """The same with a causal mask (GPT-2's attention): the softmax of masked scores is a
    where(causal, row value, full value), which the dropout's scaling is not pushed into
    while the backward pass reads the softmax itself (both would then compute it apart)."""
    m = parse("""dtm 1.0
func @f(%k: u32[2], %a: f32[2, 6, 24], %b: f32[2, 24, 6], %v: f32[2, 6, 8], %w: f32[2, 8, 6]) -> (f32[2, 6, 6], bool[2, 6, 6]) {
  %s = matmul %a, %b : f32[2, 6, 6]
  %r = iota {dim = 0} : i64[6, 6]
  %c = iota {dim = 1} : i64[6, 6]
  %future = gt %c, %r : bool[6, 6]
  %fb = broadcast_to %future {shape = [2, 6, 6]} : bool[2, 6, 6]
  %ninf = full {value = -inf} : f32[]
  %ms = where %fb, %ninf, %s : f32[2, 6, 6]
  %y = softmax %ms {axis = 2} : f32[2, 6, 6]
  %u = random %k {distribution = "uniform"} : f32[2, 6, 6]
  %p = full {value = 0.1} : f32[]
  %keep = ge %u, %p : bool[2, 6, 6]
  %sc = full {value = 1.1111111} : f32[]
  %ys = mul %y, %sc : f32[2, 6, 6]
  %z = full {value = 0.0} : f32[]
  %d = where %keep, %ys, %z : f32[2, 6, 6]
  %o = matmul %d, %v : f32[2, 6, 8]
  %h = matmul %o, %w : f32[2, 6, 6]
  %gy = mul %y, %h : f32[2, 6, 6]
  return %gy, %keep
}
""")
    verify(m)
    args = [rng.standard_normal(s).astype(np.float32) for s in ((2, 6, 24), (2, 24, 6), (2, 6, 8), (2, 8, 6))]
    for key in ([0, 0], [12345, 678]):
        k = np.array(key, np.uint32)
        (gy, keep), (gy_ref, keep_ref) = CPU.run(m, "f", [k, *args]), ref_run(m, "f", [k, *args])
        np.testing.assert_array_equal(keep, keep_ref)
        np.testing.assert_allclose(gy, gy_ref, rtol=1e-4, atol=1e-6)
    assert _kernels_with(CPU.plan(m, "f").program.steps, "exp") == 1
