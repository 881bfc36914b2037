"""The cpu executor: plans are compiled once and replayed, one plan serves every shape of a
symbolic function, memory is reused (in place where safe), and the debug switches print
what they promise. Also the passes' own pieces: the pass list, loop-IR printing."""

from __future__ import annotations

import gc
import importlib
import weakref

import numpy as np
import pytest

import dtm
import dtm.debug
from dtm import functional as F
from dtm import toolchain
from dtm.backends.cpu.passes import PASSES, compile_func
from dtm.compiler import loopir as L
from dtm.ir import parse
from dtm.ref import run as ref_run
from dtm.runtime import cpu as cpu_mod
from dtm.runtime.backend import BACKENDS, get_backend

CPU = get_backend("cpu")
rng = np.random.default_rng(5)


def T(*shape):
    return dtm.tensor(rng.standard_normal(shape).astype(np.float32))


def test_cpu_is_the_default_and_ref_is_registered(monkeypatch):
    monkeypatch.delenv("DTM_BACKEND", raising=False)
    assert get_backend().name == "cpu" and get_backend("ref").name == "ref" and "ref" in BACKENDS


def test_pass_list():
    assert [name for name, _ in PASSES] == ["widen", "decompose", "simplify", "fuse", "lower_loops", "plan_memory",
                                           "share_kernels", "render_c"]


def test_jit_replays_its_plan_without_recompiling():
    w = dtm.tensor(rng.standard_normal((8, 8)).astype(np.float32))
    f = dtm.jit(lambda x: F.softmax(x @ w, -1) * 2.0, backend="cpu")
    x = dtm.tensor(rng.standard_normal((3, 8)).astype(np.float32))
    first = f(x).numpy()
    plans, compiles, hits = cpu_mod.STATS["plans"], toolchain.STATS["compiles"], toolchain.STATS["hits"]
    for _ in range(3):
        np.testing.assert_array_equal(f(x).numpy(), first)
    assert (cpu_mod.STATS["plans"], toolchain.STATS["compiles"], toolchain.STATS["hits"]) == (plans, compiles, hits)
    want = dtm.jit(lambda x: F.softmax(x @ w, -1) * 2.0, backend="ref")(x).numpy()
    np.testing.assert_allclose(first, want, rtol=1e-5, atol=1e-6)


def test_replayed_plan_reads_the_arrays_of_each_call_and_keeps_no_result_alive():
    """A plan remembers the arrays of its last call (their pointers are not filled again):
    new arrays, and new values in the same arrays, are what it reads; a result the caller
    drops is freed."""
    f = dtm.jit(lambda x, w: x @ w + 1.0, backend="cpu")
    w = rng.standard_normal((8, 8)).astype(np.float32)
    wt = dtm.from_numpy(w)
    for _ in range(3):
        x = rng.standard_normal((3, 8)).astype(np.float32)
        np.testing.assert_allclose(f(dtm.from_numpy(x), wt).numpy(), x @ w + 1.0, rtol=1e-5, atol=1e-5)
    w[...] = rng.standard_normal((8, 8))  # the same array, new values
    np.testing.assert_allclose(f(dtm.from_numpy(x), wt).numpy(), x @ w + 1.0, rtol=1e-5, atol=1e-5)
    w2 = rng.standard_normal((8, 8)).astype(np.float32)  # another array
    np.testing.assert_allclose(f(dtm.from_numpy(x), dtm.from_numpy(w2)).numpy(), x @ w2 + 1.0, rtol=1e-5, atol=1e-5)
    y = f(dtm.from_numpy(x), wt)
    result = weakref.ref(y._buffer)
    del y
    gc.collect()
    assert result() is None


def test_released_plans_hold_no_input_and_run_again():
    """After release_plans (a process mesh resized), a cached plan keeps none of its last
    call's arrays alive (a step's weights of the old shape) and runs again correctly."""
    from dtm.runtime.backend import release_plans

    f = dtm.jit(lambda x, w: x @ w + 1.0, backend="cpu")
    x = rng.standard_normal((3, 8)).astype(np.float32)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    f(dtm.from_numpy(x), dtm.from_numpy(w.copy()))
    held = dtm.from_numpy(w.copy())
    f(dtm.from_numpy(x), held)
    last = weakref.ref(held._buffer)
    del held
    gc.collect()
    assert last() is not None  # the plan remembers its last call's arrays
    release_plans()
    gc.collect()
    assert last() is None
    np.testing.assert_allclose(f(dtm.from_numpy(x), dtm.from_numpy(w)).numpy(), x @ w + 1.0, rtol=1e-5, atol=1e-5)


def test_jit_forgets_the_traces_of_an_old_mesh_generation(monkeypatch):
    """Traces key on the process meshes' generation, which only grows: once a mesh resized,
    the traces of the old generation can never be called again, and go."""
    jit_mod = importlib.import_module("dtm.tensor.jit")  # (the package's `jit` is the class)
    f = dtm.jit(lambda x: x * 2.0, backend="cpu")
    x = dtm.from_numpy(np.ones(4, np.float32))
    f(x)
    f(dtm.from_numpy(np.ones(5, np.float32)))
    assert len(f.cache) == 2
    monkeypatch.setattr(jit_mod, "mesh_generation", lambda: 10**6)
    np.testing.assert_array_equal(f(x).numpy(), np.full(4, 2.0, np.float32))
    assert len(f.cache) == 1


def test_normal_draws_are_the_references_bits():
    """The cpu backend's normal draws take their Philox words from C (c_random.WORDS): the
    reference's bits, across the chunks the draw is made in and a counter's 2^32 carry."""
    from dtm.ref import philox

    m = parse("""dtm 1.0

func @f(%k: u32[2]) -> (f32[1048579]) {
  %a = random %k {distribution = "normal"} : f32[1048579]
  return %a
}
""")
    key = np.array([0xDEADBEEF, 7], np.uint32)
    got = get_backend("cpu").run(m, "f", [key])[0]
    want = ref_run(m, "f", [key])[0]
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()
    big = np.array([0xFFFFFFFF, 0x80000005], np.uint32)
    for a, b in zip(cpu_mod._philox_words(big, 2**32 - 3, 7), philox._words(big, 2**32 - 3, 7)):
        assert a.tolist() == b.tolist()


def test_repeat_feeds_a_result_back_as_an_argument():
    """jit._repeat: n calls as one loop in C, result feed[0] becoming tensor argument feed[1]
    and scalar argument advance[0] growing by advance[1] after each call, against the same
    recurrence in numpy; the `ref` backend has no such loop (None: the caller loops)."""
    w = rng.standard_normal((5, 5)).astype(np.float32)
    step = dtm.jit(lambda ids, pos, w: ((ids * 7 + pos * 3) % 11, w.sum(0) + pos), backend="cpu")
    ids, pos = np.array([[2, 9]], np.int64), np.array(4, np.int64)
    (last, tail), ran = step._repeat(6, (dtm.from_numpy(ids), dtm.from_numpy(pos), dtm.tensor(w)),
                                     feed=(0, 0), advance=(1, 2))
    want, x, p = [], np.array([[2, 9]]), 4
    for _ in range(6):
        x = (x * 7 + p * 3) % 11
        want.append(x)
        p += 2
    np.testing.assert_array_equal(ran, np.stack(want))
    np.testing.assert_array_equal(last.numpy(), want[-1])
    np.testing.assert_allclose(tail.numpy(), w.sum(0) + 4 + 5 * 2, rtol=1e-5)  # the last call's pos
    assert int(pos) == 4 + 6 * 2 and (ids == want[-1]).all()  # the arguments' arrays, written in place
    ref = dtm.jit(lambda ids, pos: (ids + pos) % 11, backend="ref")
    assert ref._repeat(3, (dtm.from_numpy(ids.copy()), dtm.from_numpy(pos.copy())), feed=(0, 0), advance=(1, 1)) is None


SYM = parse("""dtm 1.0

func @f(%x: f32[B, T], %b: f32[T]) -> (f32[B, T], f32[B], f32[T, B]) {
  %y = add %x, %b : f32[B, T]
  %e = exp %y : f32[B, T]
  %s = reduce_sum %e {axes = [1]} : f32[B]
  %t = permute %e {perm = [1, 0]} : f32[T, B]
  return %e, %s, %t
}
""")


def test_one_plan_serves_every_shape_of_a_symbolic_function():
    backend = cpu_mod.CpuBackend()
    plans = cpu_mod.STATS["plans"]
    for b, t in ((2, 3), (5, 1), (1, 7), (0, 4), (3, 0)):
        x = rng.standard_normal((b, t)).astype(np.float32)
        bias = rng.standard_normal(t).astype(np.float32)
        for got, want in zip(backend.run(SYM, "f", [x, bias]), ref_run(SYM, "f", [x, bias])):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert cpu_mod.STATS["plans"] == plans + 1


def test_inputs_are_checked_like_the_reference():
    from dtm.errors import DTMError, ErrorCode as E

    with pytest.raises(DTMError) as e:
        CPU.run(SYM, "f", [np.zeros((2, 3), np.float32), np.zeros(4, np.float32)])
    assert e.value.code is E.SHAPE_MISMATCH
    with pytest.raises(DTMError) as e:
        CPU.run(SYM, "f", [np.zeros((2, 3), np.float64), np.zeros(3, np.float32)])
    assert e.value.code is E.DTYPE_MISMATCH


def test_results_never_alias_inputs_and_non_contiguous_inputs_work():
    m = parse("dtm 1.0\n\nfunc @f(%x: f32[3, 4]) -> (f32[3, 4], f32[3, 4]) {\n"
              "  %y = neg %x : f32[3, 4]\n  return %x, %y\n}\n")
    x = rng.standard_normal((4, 3)).astype(np.float32).T  # not C-contiguous
    a, y = CPU.run(m, "f", [x])
    assert not np.may_share_memory(a, x)
    np.testing.assert_array_equal(a, x)
    np.testing.assert_array_equal(y, -x)


def test_temporaries_share_memory_and_kernels_work_in_place():
    m = parse("""dtm 1.0

func @f(%x: f32[16, 16], %w: f32[16, 16]) -> (f32[16, 16]) {
  %a = matmul %x, %w : f32[16, 16]
  %b = matmul %a, %w : f32[16, 16]
  %c = matmul %b, %w : f32[16, 16]
  %d = matmul %c, %w : f32[16, 16]
  %s0 = softmax %d {axis = 0} : f32[16, 16]
  %s1 = softmax %s0 {axis = 1} : f32[16, 16]
  %e = matmul %s1, %w : f32[16, 16]
  return %e
}
""")
    prog = compile_func(m, "f")
    temps = [b for b in prog.buffers if b.kind == "temp"]
    assert len(prog.slots) < len(temps)
    assert any(b.alias is not None for b in temps), str(prog)
    ins = [rng.standard_normal((16, 16)).astype(np.float32) * 0.3 for _ in range(2)]
    np.testing.assert_allclose(CPU.run(m, "f", ins)[0], ref_run(m, "f", ins)[0], rtol=1e-4, atol=1e-6)


def test_debug_prints_kernels_and_times(monkeypatch, capsys):
    monkeypatch.setenv("DTM_DEBUG", "2")
    m = parse("dtm 1.0\n\nfunc @f(%x: f32[5]) -> (f32[5]) {\n  %y = tanh %x : f32[5]\n"
              "  %z = mul %y, %y : f32[5]\n  return %z\n}\n")
    cpu_mod.CpuBackend().run(m, "f", [np.ones(5, np.float32)])
    err = capsys.readouterr().err
    assert "k0_tanh_mul" in err and " ms" in err and "void dtm_k0(" in err and "tanhf(" in err


def test_debug_passes_prints_every_pass(monkeypatch, capsys):
    monkeypatch.setenv("DTM_DEBUG", "passes")
    m = parse("dtm 1.0\n\nfunc @f(%x: f32[5]) -> (f32[5]) {\n  %y = silu %x : f32[5]\n  return %y\n}\n")
    compile_func(m, "f")
    err = capsys.readouterr().err
    for name, _ in PASSES:
        assert f"=== pass {name} ===" in err
    assert "sigmoid" in err and "kernel k0" in err and "schedule of @f" in err


def test_debug_helpers():
    x = dtm.tensor(np.ones((2, 3), np.float32))
    assert dtm.debug.count_kernels(lambda x: (x * 2).exp(), x) == 1
    assert dtm.debug.kernels(lambda x: x.sum(1), x) == ["k0_reduce_sum"]
    text = dtm.debug.explain(lambda x: F.softmax(x, -1), x)
    assert "=== pass render_c ===" in text and "reduce_max" in text


def test_loop_ir_prints():
    k = L.Kernel("k", [L.Param("out0", dtm.float32, True, (4,)), L.Param("in0", dtm.float32, False, (4,))], [],
                 [L.Loop("i0", L.Const(0, L.INDEX), L.Const(4, L.INDEX),
                         [L.Store("out0", L.Sym("i0"), L.Op("exp", (L.Load("in0", L.Sym("i0"), dtm.float32),),
                                                             dtm.float32))])])
    text = str(k)
    assert "kernel k(out out0: f32[4], in in0: f32[4])" in text
    assert "for i0 in 0..4:" in text and "out0[i0] = exp(in0[i0])" in text


def test_index_arithmetic_folds():
    i = L.Sym("i")
    assert L.iadd(L.imul(i, 1), 0) == i
    assert L.imul(L.Const(3, L.INDEX), L.Const(4, L.INDEX)) == L.Const(12, L.INDEX)
    assert L.imod(i, 1) == L.Const(0, L.INDEX)
    assert L.idiv(i, 1) == i
    assert str(L.flat_index((L.Sym("a"), L.Sym("b")), (3, 5))) == "(b + (a * 5))"
    # a reshape's split dims read back through contiguous strides are the index itself, in
    # any order of the terms; pieces that do not add up stay as they are
    pieces = [L.imod(i, 32), L.imul(L.imod(L.idiv(i, 32), 3), 32), L.imul(L.idiv(i, 96), 96)]
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        e = L.iadd(L.iadd(pieces[order[0]], pieces[order[1]]), pieces[order[2]])
        assert e == i, str(e)
    assert str(L.iadd(L.iadd(pieces[0], pieces[1]), L.imul(L.Sym("j"), 96))) == \
        "((i % 32) + (((i / 32) % 3) * 32)) + (j * 96)".join("()")
    assert str(L.iadd(L.imod(i, 32), L.imul(L.idiv(i, 32), 64))) == "((i % 32) + ((i / 32) * 64))"
    assert L.idiv(L.idiv(i, 4), 8) == L.idiv(i, 32)


def test_threads_can_share_a_plan():
    import threading

    m = SYM
    x = rng.standard_normal((64, 128)).astype(np.float32)
    bias = rng.standard_normal(128).astype(np.float32)
    want = ref_run(m, "f", [x, bias])
    errors = []

    def work():
        try:
            for _ in range(5):
                for g, w in zip(CPU.run(m, "f", [x, bias]), want):
                    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


UPDATES = """dtm 1.0

func @step(%p: f32[64, 32], %m: f32[64, 32], %g: f32[64, 32], %lr: f32[]) -> (f32[]) {
  %m2 = mul %m, %lr : f32[64, 32]
  %m3 = add %m2, %g : f32[64, 32]
  %u = mul %m3, %lr : f32[64, 32]
  %p2 = sub %p, %u : f32[64, 32]
  %s = reduce_sum %g {axes = [0, 1]} : f32[]
  assign %p, %p2
  assign %m, %m3
  return %s
}
"""


def test_updates_are_written_in_place_by_the_kernels_that_compute_them():
    """An optimizer-like step: the kernel computing the new weight and state writes them into
    the parameters' own arrays (no temporary, no assign copy), equal to the reference; a
    parameter passed as a non-contiguous view still gets its update; a read-only one is an
    error before anything runs."""
    from dtm.compiler.program import FallbackStep
    from dtm.errors import DTMError, ErrorCode as E
    from dtm.ref import run as ref_run
    from dtm.runtime.cpu import CpuBackend

    m = parse(UPDATES)
    cpu = CpuBackend()
    plan = cpu.plan(m, "step")
    assigns = [s for s in plan.program.steps if isinstance(s, FallbackStep) and s.op.name == "assign"]
    assert len(assigns) == 2 and {id(s) for s in assigns} == plan.program.done_in_place
    rng = np.random.default_rng(5)
    args = [rng.standard_normal((64, 32)).astype(np.float32) for _ in range(3)] + [np.float32(0.9)]
    want = [np.array(a, copy=True) for a in args]
    (s_want,) = ref_run(m, "step", want)
    wide = np.zeros((64, 64), np.float32)
    wide[:, ::2] = args[0]
    got = [wide[:, ::2], np.array(args[1]), np.array(args[2]), np.array(args[3])]  # p: a strided view
    (s_got,) = cpu.run(m, "step", got)
    np.testing.assert_allclose(s_got, s_want, rtol=1e-5)
    np.testing.assert_allclose(wide[:, ::2], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    ro = [np.array(a) for a in args]
    ro[1].flags.writeable = False
    with pytest.raises(DTMError) as e:
        cpu.run(m, "step", ro)
    assert e.value.code is E.READ_ONLY_INPUT
    np.testing.assert_array_equal(ro[0], args[0])  # nothing ran


def test_an_update_that_reads_its_parameter_elsewhere_is_not_written_in_place():
    """p' = p + flip(p): a kernel writing p in place would read elements it already wrote, so
    the update goes through a temporary and the assign's copy."""
    from dtm.compiler.program import FallbackStep
    from dtm.ref import run as ref_run
    from dtm.runtime.cpu import CpuBackend

    m = parse("""dtm 1.0

func @f(%p: f32[8, 5]) -> (f32[]) {
  %f = flip %p {axes = [0]} : f32[8, 5]
  %q = add %p, %f : f32[8, 5]
  %s = reduce_sum %p {axes = [0, 1]} : f32[]
  assign %p, %q
  return %s
}
""")
    x = np.arange(40, dtype=np.float32).reshape(8, 5)
    want, got = x.copy(), x.copy()
    ref_run(m, "f", [want])
    cpu = CpuBackend()
    cpu.run(m, "f", [got])
    np.testing.assert_array_equal(got, want)
    plan = cpu.plan(m, "f")
    assert not plan.program.done_in_place
    assert any(isinstance(s, FallbackStep) and s.op.name == "assign" for s in plan.program.steps)


@pytest.mark.parametrize("a_t", [False, True], ids=["A", "At"])
@pytest.mark.parametrize("b_t", [False, True], ids=["B", "Bt"])
def test_products_in_every_layout_match_numpy(a_t, b_t):
    """The tiled product packs each operand by its layout (rows or columns contiguous, whole
    16-deep blocks transposed in registers, the rest element by element): shapes with whole
    and partial tiles, depths past one packed slice, widths past one packed panel, each
    layout, against numpy in float64."""
    shapes = [(1, 33, 17), (5, 7, 3), (12, 32, 16), (24, 32, 16), (12, 32, 385), (37, 70, 130), (200, 96, 800),
              (13, 1030, 40), (3, 1, 50)]
    for M, N, K in shapes:
        a = rng.standard_normal((K, M) if a_t else (M, K)).astype(np.float32)
        b = rng.standard_normal((N, K) if b_t else (K, N)).astype(np.float32)
        got = dtm.jit(lambda x, y: (x.transpose(0, 1) if a_t else x) @ (y.transpose(0, 1) if b_t else y))(
            dtm.tensor(a), dtm.tensor(b)).numpy()
        want = (a.T if a_t else a).astype(np.float64) @ (b.T if b_t else b).astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(K), err_msg=f"{M}x{N}x{K}")


@pytest.mark.parametrize("b_t", [False, True], ids=["B", "Bt"])
def test_a_wide_matrix_vector_product_spans_several_blocks_of_columns(b_t):
    """One row against a B wider than a thread's block of columns (16384, rows of B
    contiguous) or than its groups of four dot products (columns contiguous): every block
    and the ragged last one, with a bias in the epilogue, against numpy in float64."""
    N, K = 40_003, 7
    x, bias = rng.standard_normal((1, K)).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    w = rng.standard_normal((N, K) if b_t else (K, N)).astype(np.float32)
    got = dtm.jit(lambda x, w, c: x @ (w.transpose(0, 1) if b_t else w) + c)(
        dtm.tensor(x), dtm.tensor(w), dtm.tensor(bias)).numpy()
    want = x.astype(np.float64) @ (w.T if b_t else w) + bias
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("a_t", [False, True], ids=["A", "At"])
@pytest.mark.parametrize("b_t", [False, True], ids=["B", "Bt"])
def test_products_of_a_few_rows_match_numpy(a_t, b_t):
    """Products of 2 to 17 rows (a short prompt, a batch decoding): unpacked, B read once for
    all rows, by rows of B (up to 8 rows) or by dot products (up to 16), the packed product
    past that or in any other layout. Row counts around each limit, ragged groups of four
    rows and columns, depths with tails, and a bias and relu in the epilogue, against numpy
    in float64."""
    for M, N, K in [(2, 300, 37), (3, 1001, 770), (5, 513, 16), (8, 300, 9), (9, 301, 64), (13, 999, 35),
                    (16, 260, 100), (17, 300, 20)]:
        a = rng.standard_normal((K, M) if a_t else (M, K)).astype(np.float32)
        b, bias = rng.standard_normal((N, K) if b_t else (K, N)).astype(np.float32), rng.standard_normal(N).astype(np.float32)
        got = dtm.jit(lambda x, y, c: F.relu((x.transpose(0, 1) if a_t else x) @ (y.transpose(0, 1) if b_t else y) + c))(
            dtm.tensor(a), dtm.tensor(b), dtm.tensor(bias)).numpy()
        want = np.maximum((a.T if a_t else a).astype(np.float64) @ (b.T if b_t else b) + bias, 0)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(K), err_msg=f"{M}x{N}x{K}")
    for M, N, K in [(3, 1001, 770), (13, 999, 35)]:  # the f64 library's instance, to f64 precision
        a, b = rng.standard_normal((K, M) if a_t else (M, K)), rng.standard_normal((N, K) if b_t else (K, N))
        got = dtm.jit(lambda x, y: (x.transpose(0, 1) if a_t else x) @ (y.transpose(0, 1) if b_t else y))(
            dtm.tensor(a), dtm.tensor(b)).numpy()
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, (a.T if a_t else a) @ (b.T if b_t else b), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(0, 128, 512), (2, 0, 64), (0, 64, 0), (3, 5, 0)], ids=["M0", "K0", "M0N0", "N0"])
def test_an_empty_product_with_an_epilogue_gives_numpys_result(shape):
    """A product with no rows or no columns (a rank's empty shard of a batch smaller than
    the mesh) is an empty result, and one with no contracted dim is zeros through its
    epilogue: the library divided by the row count (SIGFPE, the process killed)."""
    M, K, N = shape
    a, b = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
    got = dtm.jit(lambda x, y: F.relu(x @ y + 1.0))(dtm.tensor(a), dtm.tensor(b)).numpy()
    np.testing.assert_array_equal(got, np.maximum(a @ b + 1.0, 0))


def test_a_rows_product_by_dot_products_does_not_depend_on_the_other_rows():
    """A Linear's product of one row and of a few (a token, a prompt, a batch) sums each dot
    product in the same order, so a row's result is the same bits in any company; and both
    match numpy in float64."""
    N, K = 300, 770
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((16, K)).astype(np.float32)
    product = dtm.jit(lambda x, w: x @ w.transpose(0, 1))
    alone = product(dtm.tensor(x[:1]), dtm.tensor(w)).numpy()
    for M in (2, 5, 16):
        got = product(dtm.tensor(x[:M]), dtm.tensor(w)).numpy()
        np.testing.assert_array_equal(got[:1], alone, err_msg=f"{M} rows")
        np.testing.assert_allclose(got, x[:M].astype(np.float64) @ w.T, rtol=1e-4, atol=1e-4 * np.sqrt(K))


@pytest.mark.parametrize("a_t", [False, True], ids=["A", "At"])
def test_a_square_product_split_by_columns_runs_its_epilogue_on_every_block(a_t):
    """A square product wider than WHOLE_ROWS is split between threads by columns (each
    thread reads all of A, packs half of B), rows split a wider-than-square one: a bias, a
    residual and a relu in the epilogue must land on every block of either split, against
    numpy in float64."""
    for M, N, K in [(300, 300, 70), (301, 300, 70)]:
        a = rng.standard_normal((K, M) if a_t else (M, K)).astype(np.float32)
        b, bias, res = (rng.standard_normal(s).astype(np.float32) for s in [(K, N), (N,), (M, N)])
        got = dtm.jit(lambda x, y, c, r: F.relu((x.transpose(0, 1) if a_t else x) @ y + c) + r)(
            dtm.tensor(a), dtm.tensor(b), dtm.tensor(bias), dtm.tensor(res)).numpy()
        want = np.maximum((a.T if a_t else a).astype(np.float64) @ b + bias, 0) + res
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3, err_msg=f"{M}x{N}x{K}")


def test_a_long_contracted_dim_is_split_between_threads_and_the_epilogue_sees_the_sum():
    """x^T @ dy with many more rows than columns (a weight's gradient) is computed as one
    partial product per thread over its own rows, summed by rows; the epilogue (a bias and
    a relu) must see the whole sum, and transposed rows that fill no whole sliver of the
    packed panel (37 = 3 * 12 + 1) pack with zeros. Against numpy in float64."""
    x, dy, b = rng.standard_normal((1000, 37)).astype(np.float32), rng.standard_normal((1000, 45)).astype(np.float32), \
        rng.standard_normal(45).astype(np.float32)
    got = dtm.jit(lambda x, dy, b: F.relu(x.transpose(0, 1) @ dy + b))(dtm.tensor(x), dtm.tensor(dy), dtm.tensor(b))
    want = np.maximum(x.T.astype(np.float64) @ dy.astype(np.float64) + b, 0)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-3)


def test_a_batch_of_sequences_sharing_a_weight_is_one_product():
    """x[2, 3, 5, 8] @ w[8, 7]: the batch dims are rows of one 30-row product (w packed once,
    not six times), the epilogue still sees each element's batch index (a residual of the
    full shape, a bias broadcast along the middle dim). A weight that varies along a batch
    dim keeps that dim a batch of products. All against the reference."""
    x, w, b = T(2, 3, 5, 8), T(8, 7), T(3, 1, 7)
    res, ws = T(2, 3, 5, 7), T(3, 8, 7)

    def gemm_of(fn, *args):
        program = compile_func(dtm.jit(fn).ir(*args), "main", upto="lower_loops")
        return next(s for step in program.kernels for s in step.kernel.body if isinstance(s, L.Gemm))

    one = gemm_of(lambda x, w, b, r: F.gelu(x @ w + b) + r, x, w, b, res)
    assert (one.batch, str(one.m)) == ((), "30"), (one.batch, one.m)
    shared_outer = gemm_of(lambda x, w: x @ w, x, ws)
    assert len(shared_outer.batch) == 2, shared_outer.batch  # ws varies along dim 1
    for fn, args in [(lambda x, w, b, r: F.gelu(x @ w + b) + r, (x, w, b, res)), (lambda x, w: x @ w, (x, ws)),
                     (lambda x, w: x.transpose(1, 2) @ w, (x, w)), (lambda x, w: x[:, :, 1:4] @ w + 1.0, (x, w))]:
        np.testing.assert_allclose(dtm.jit(fn)(*args).numpy(), dtm.jit(fn, backend="ref")(*args).numpy(),
                                   rtol=1e-5, atol=1e-5)


SCATTER = parse("""dtm 1.0

func @f(%x: f32[6, 4], %i: i64[5], %u: f32[5, 4], %j: i32[3], %v: i32[3, 2]) -> (f32[6, 4], f32[6, 4], f32[6, 4], i32[4, 2]) {
  %e = exp %x : f32[6, 4]
  %a = scatter_add %e, %i, %u {axis = 0} : f32[6, 4]
  %d = mul %a, %e : f32[6, 4]
  %z = full {value = 0.5} : f32[6, 4]
  %b = scatter_add %z, %i, %u {axis = 0} : f32[6, 4]
  %c = scatter_add %x, %i, %u {axis = 0} : f32[6, 4]
  %k = full {value = 7} : i32[4, 2]
  %n = scatter_add %k, %j, %v {axis = 0} : i32[4, 2]
  %s = add %b, %x : f32[6, 4]
  return %d, %s, %c, %n
}
""")


def test_scatter_add_writes_into_planned_memory_in_place_over_a_dead_operand():
    prog = compile_func(SCATTER, "f")
    steps = [s for s in prog.fallbacks if s.op.name == "scatter_add"]
    over_z, over_e, over_x, over_k = (s.outputs[0] for s in steps)  # in the order they run
    # %e is read again (by %d): its scatter gets a slot of its own; the dead full's is reused
    assert over_e.kind == "temp" and over_e.slot is not None and over_e.alias is None, str(prog)
    assert over_z.alias is not None and over_z.slot == over_z.alias.slot, str(prog)
    assert over_x.kind == "output" and over_k.kind == "output"  # returned: fresh arrays
    ins = [rng.standard_normal((6, 4)).astype(np.float32), np.array([0, 5, 5, 9, -2]),
           rng.standard_normal((5, 4)).astype(np.float32), np.array([3, 3, 1], np.int32),
           np.array([[2**31 - 1, 1], [5, 6], [-7, 8]], np.int32)]
    want = ref_run(SCATTER, "f", ins)
    x, i, u = ins[:3]
    np.add.at(expected := x.copy(), np.clip(i, 0, 5), u)  # independent of DTM: numpy's own
    np.testing.assert_array_equal(want[2], expected)
    for _ in range(2):  # replayed: planned memory holds no trace of the last call
        got = CPU.run(SCATTER, "f", ins)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got[2], expected)
