"""The reference interpreter: symbol binding from input shapes, input checks, in-place
`assign`, aliasing, the tensor store, `call`, and the errors a caller sees."""

from __future__ import annotations

import numpy as np
import pytest

from dtm.errors import DTMError, ErrorCode as E
from dtm.ir import parse
from dtm.ref import RefContext, run
from test_store_programs import fresh as memory_store

rng = np.random.default_rng(3)


def module(body: str):
    return parse("dtm 1.0\n" + body)


MLP = module("""
func @f(%x: f32[B, T, 8], %w: f32[8, 4]) -> (f32[B, T, 4], f32[B*T, 4], f32[T - 1, 4]) {
  %y = matmul %x, %w : f32[B, T, 4]
  %r = reshape %y {shape = [B*T, 4]} : f32[B*T, 4]
  %s = slice %r {start = [1, 0], stop = [T, 4], step = [1, 1]} : f32[T - 1, 4]
  return %y, %r, %s
}
""")


def test_symbols_bind_from_input_shapes():
    x, w = rng.standard_normal((2, 5, 8)).astype(np.float32), rng.standard_normal((8, 4)).astype(np.float32)
    y, r, s = run(MLP, "f", [x, w])
    np.testing.assert_allclose(y, x @ w, rtol=1e-6)
    np.testing.assert_array_equal(r, y.reshape(10, 4))
    np.testing.assert_array_equal(s, r[1:5])
    y2, _, s2 = run(MLP, "f", [x[:, :3], w])  # other sizes, same module
    assert y2.shape == (2, 3, 4) and s2.shape == (2, 4)


def test_linear_param_dims_solve_for_their_symbol():
    m = module("""
func @f(%x: f32[2*T + 1], %k: i64[]) -> (f32[T]) {
  %d = dynamic_slice %x, %k {axis = 0, size = T} : f32[T]
  return %d
}
""")
    x = np.arange(7, dtype=np.float32)
    np.testing.assert_array_equal(run(m, "f", [x, np.array(2)])[0], [2, 3, 4])
    with pytest.raises(DTMError) as e:
        run(m, "f", [np.arange(6, dtype=np.float32), np.array(0)])
    assert e.value.code is E.SHAPE_MISMATCH


@pytest.mark.parametrize("inputs,code,words", [
    ([np.zeros((2, 5, 8), np.float64), np.zeros((8, 4), np.float32)], E.DTYPE_MISMATCH, "input 0"),
    ([np.zeros((2, 5, 8), np.float32), np.zeros((8, 3), np.float32)], E.SHAPE_MISMATCH, "input 1"),
    ([np.zeros((2, 5), np.float32), np.zeros((8, 4), np.float32)], E.RANK_MISMATCH, "input 0"),
    ([np.zeros((2, 5, 8), np.float32)], E.OPERAND_COUNT, "takes 2"),
])
def test_inputs_are_checked(inputs, code, words):
    with pytest.raises(DTMError) as e:
        run(MLP, "f", inputs)
    assert e.value.code is code and words in str(e.value)


def test_inconsistent_symbol_is_an_error():
    m = module("""
func @f(%a: f32[B], %b: f32[B]) -> (f32[B]) {
  %c = add %a, %b : f32[B]
  return %c
}
""")
    with pytest.raises(DTMError) as e:
        run(m, "f", [np.zeros(3, np.float32), np.zeros(4, np.float32)])
    assert e.value.code is E.SHAPE_MISMATCH and "B = 4" in e.value.message and "B = 3" in e.value.message


def test_unknown_function():
    with pytest.raises(DTMError) as e:
        run(MLP, "nope", [])
    assert e.value.code is E.UNDEFINED_FUNC


KV = module("""
func @step(%cache: f32[4, 2], %new: f32[1, 2], %pos: i64[]) -> (f32[4, 2], f32[4, 2]) {
  %view = reshape %cache {shape = [4, 2]} : f32[4, 2]
  %c2 = dynamic_update_slice %cache, %new, %pos {axis = 0} : f32[4, 2]
  assign %cache, %c2
  return %c2, %view
}
""")


def test_assign_writes_the_callers_array_in_place():
    cache = np.zeros((4, 2), np.float32)
    for pos in range(4):
        c2, view = run(KV, "step", [cache, np.full((1, 2), pos + 1, np.float32), np.array(pos)])
        assert c2 is not cache and np.shares_memory(c2, cache) is False
        np.testing.assert_array_equal(view[pos], [0, 0])  # computed before the assign: unchanged
    np.testing.assert_array_equal(cache, [[1, 1], [2, 2], [3, 3], [4, 4]])


def test_assign_to_a_read_only_input_is_an_error():
    cache = np.zeros((4, 2), np.float32)
    cache.flags.writeable = False
    with pytest.raises(DTMError) as e:
        run(KV, "step", [cache, np.ones((1, 2), np.float32), np.array(0)])
    assert e.value.code is E.READ_ONLY_INPUT and "op 2 (assign)" in str(e.value)


def test_results_never_alias_inputs():
    m = module("""
func @f(%x: f32[3]) -> (f32[3], f32[1, 3]) {
  %r = reshape %x {shape = [1, 3]} : f32[1, 3]
  return %x, %r
}
""")
    x = np.ones(3, np.float32)
    a, r = run(m, "f", [x])
    assert not np.shares_memory(a, x) and not np.shares_memory(r, x) and r.flags.writeable


def test_store_get_and_put():
    m = module("""
func @f(%x: f32[2]) -> (f32[2]) {
  %old = store_get {key = "acc"} : f32[2]
  %new = add %old, %x : f32[2]
  store_put %new {key = "acc"}
  return %new
}
""")
    ctx = RefContext(store=memory_store())
    ctx.store.put("acc", np.zeros(2, np.float32))
    for _ in range(3):
        run(m, "f", [np.ones(2, np.float32)], ctx)
    np.testing.assert_array_equal(ctx.store.get_array("acc"), [3, 3])
    with pytest.raises(DTMError) as e:
        run(m, "f", [np.ones(2, np.float32)], RefContext(store=memory_store()))
    assert e.value.code is E.STORE_KEY_MISSING and "'acc'" in e.value.message
    ctx.store.put("acc", np.zeros(3, np.float32))
    with pytest.raises(DTMError) as e:
        run(m, "f", [np.ones(2, np.float32)], ctx)
    assert e.value.code is E.SHAPE_MISMATCH


def test_call_runs_another_function_and_its_assigns_reach_the_caller():
    m = module("""
func @bump(%p: f32[N], %d: f32[N]) -> (f32[N]) {
  %q = add %p, %d : f32[N]
  assign %p, %q
  return %q
}

func @main(%p: f32[N]) -> (f32[N], f32[N]) {
  %one = full {value = 1.0} : f32[N]
  %a = call %p, %one {callee = @bump} : f32[N]
  %b = mul %a, %a : f32[N]
  return %a, %b
}
""")
    p = np.full(3, 2.0, np.float32)
    a, b = run(m, "main", [p])
    np.testing.assert_array_equal(a, [3, 3, 3])
    np.testing.assert_array_equal(b, [9, 9, 9])
    np.testing.assert_array_equal(p, [3, 3, 3])


def test_single_device_collectives_and_p2p():
    m = module("""
mesh @m[x = 1]

func @f(%a: f32[2]) -> (f32[2], f32[2], f32[2]) {
  %s = all_reduce %a {mesh = @m, axes = ["x"], op = "avg"} : f32[2]
  %g = all_gather %a {mesh = @m, axes = ["x"], dim = 0} : f32[2]
  send %s {mesh = @m, axes = ["x"], dst = 0}
  %r = recv {mesh = @m, axes = ["x"], src = 0} : f32[2]
  return %s, %g, %r
}
""")
    a = np.array([1.0, 2.0], np.float32)
    for out in run(m, "f", [a]):
        np.testing.assert_array_equal(out, a)


def test_recv_with_nothing_sent_fails_at_once_on_one_device():
    m = module("""
mesh @m[x = 1]

func @f() -> (f32[2]) {
  %r = recv {mesh = @m, axes = ["x"], src = 0} : f32[2]
  return %r
}
""")
    with pytest.raises(DTMError) as e:
        run(m, "f", [])
    assert e.value.code is E.TIMEOUT


def test_a_gpt2_block_matches_torch():
    torch = pytest.importorskip("torch")
    m = module("""
func @block(%x: f32[B, T, 32], %g: f32[32], %b: f32[32], %wqkv: f32[32, 96], %wo: f32[32, 32], %w1: f32[32, 128], %w2: f32[128, 32]) -> (f32[B, T, 32]) {
  %h = layer_norm %x, %g, %b : f32[B, T, 32]
  %qkv = matmul %h, %wqkv : f32[B, T, 96]
  %q = slice %qkv {start = [0, 0, 0], stop = [B, T, 32], step = [1, 1, 1]} : f32[B, T, 32]
  %k = slice %qkv {start = [0, 0, 32], stop = [B, T, 64], step = [1, 1, 1]} : f32[B, T, 32]
  %v = slice %qkv {start = [0, 0, 64], stop = [B, T, 96], step = [1, 1, 1]} : f32[B, T, 32]
  %q4 = reshape %q {shape = [B, T, 4, 8]} : f32[B, T, 4, 8]
  %k4 = reshape %k {shape = [B, T, 4, 8]} : f32[B, T, 4, 8]
  %v4 = reshape %v {shape = [B, T, 4, 8]} : f32[B, T, 4, 8]
  %qh = permute %q4 {perm = [0, 2, 1, 3]} : f32[B, 4, T, 8]
  %kh = permute %k4 {perm = [0, 2, 1, 3]} : f32[B, 4, T, 8]
  %vh = permute %v4 {perm = [0, 2, 1, 3]} : f32[B, 4, T, 8]
  %a = scaled_dot_product_attention %qh, %kh, %vh {causal = true} : f32[B, 4, T, 8]
  %at = permute %a {perm = [0, 2, 1, 3]} : f32[B, T, 4, 8]
  %am = reshape %at {shape = [B, T, 32]} : f32[B, T, 32]
  %o = matmul %am, %wo : f32[B, T, 32]
  %x1 = add %x, %o : f32[B, T, 32]
  %h2 = layer_norm %x1 : f32[B, T, 32]
  %u = matmul %h2, %w1 : f32[B, T, 128]
  %gu = gelu %u {approximate = "tanh"} : f32[B, T, 128]
  %d = matmul %gu, %w2 : f32[B, T, 32]
  %y = add %x1, %d : f32[B, T, 32]
  return %y
}
""")
    shapes = [(2, 7, 32), (32,), (32,), (32, 96), (32, 32), (32, 128), (128, 32)]
    args = [(rng.standard_normal(s) * (1 if i < 3 else 0.2)).astype(np.float32) for i, s in enumerate(shapes)]
    (y,) = run(m, "block", args)
    x, g, b, wqkv, wo, w1, w2 = map(torch.from_numpy, args)
    F = torch.nn.functional
    q, k, v = (F.layer_norm(x, (32,), g, b) @ wqkv).split(32, dim=-1)
    heads = [t.reshape(2, 7, 4, 8).transpose(1, 2) for t in (q, k, v)]
    a = F.scaled_dot_product_attention(*heads, is_causal=True).transpose(1, 2).reshape(2, 7, 32)
    x1 = x + a @ wo
    ref = x1 + F.gelu(F.layer_norm(x1, (32,)) @ w1, approximate="tanh") @ w2
    np.testing.assert_allclose(y, ref.numpy(), rtol=1e-5, atol=1e-5)


def test_symbolic_bounds_are_checked_at_run_time():
    m = module("""
func @f(%x: f32[N], %y: f32[M], %k: i64[]) -> (f32[N - 2], f32[M]) {
  %s = slice %x {start = [2], stop = [N], step = [1]} : f32[N - 2]
  %d = dynamic_slice %x, %k {axis = 0, size = M} : f32[M]
  return %s, %d
}
""")
    x = np.arange(5, dtype=np.float32)
    s, d = run(m, "f", [x, np.zeros(2, np.float32), np.array(9)])
    np.testing.assert_array_equal(s, [2, 3, 4])
    np.testing.assert_array_equal(d, [3, 4])
    with pytest.raises(DTMError) as e:
        run(m, "f", [x[:1], np.zeros(1, np.float32), np.array(0)])
    assert e.value.code is E.INVALID_DIM
    with pytest.raises(DTMError) as e:
        run(m, "f", [x, np.zeros(6, np.float32), np.array(0)])
    assert e.value.code is E.ATTRIBUTE_VALUE and "dynamic_slice" in str(e.value)
