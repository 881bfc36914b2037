"""Movement ops whose index is data, compiled (program.MoveStep, c_move.py): gather,
dynamic_slice and dynamic_update_slice on the `cpu` backend agree with `ref` bit for bit
(every index dtype, clamped starts and indices, empty axes, narrow and quantized rows), run
as no fallback, and write in place only when nothing reads the operand afterwards."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import dtm
from dtm.errors import DTMError, ErrorCode
from dtm.ir import parse
from dtm.ir.dtypes import DTYPES
from dtm.ref import quant as refquant
from dtm.ref import run as ref_run
from dtm.runtime.backend import get_backend

from test_compiler_ops import Batch, randint, randn

CPU = get_backend("cpu")
INDEX_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


def _no_fallbacks(module, func="f"):
    prog = CPU.plan(module, func).program
    assert not prog.fallbacks, [s.op.name for s in prog.fallbacks]
    return prog


def _same_bits(module, inputs, func="f"):
    want = ref_run(module, func, [np.array(x, copy=True) for x in inputs])
    got = CPU.run(module, func, [np.array(x, copy=True) for x in inputs])
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert w.tobytes() == g.tobytes()


@pytest.mark.parametrize("idt", INDEX_DTYPES, ids=lambda d: np.dtype(d).name)
def test_clamped_indices_and_starts_of_every_integer_dtype(idt):
    info = np.iinfo(idt)
    bt = Batch()
    x = randn((6, 3, 4))
    for axis in (0, 1, 2):
        idx = np.array([[0, 1], [info.max, info.min], [2, 5]], idt)
        bt.add("gather", x, idx, axis=axis)
        for s in (0, 1, 4, info.max, info.min):
            start = np.array(s, idt)
            bt.add("dynamic_slice", x, start, axis=axis, size=2)
            upd = randn(tuple(2 if k == axis else d for k, d in enumerate(x.shape)))
            bt.add("dynamic_update_slice", x, upd, start, axis=axis)
    _no_fallbacks(bt.module())
    _same_bits(bt.module(), bt.inputs)


def test_every_element_dtype_and_edge_shapes():
    bt = Batch()
    for dt in (np.float64, np.int8, np.uint16, np.int64, np.bool_):
        x = randint((5, 7), dt) if dt not in (np.float64, np.bool_) else \
            (randn((5, 7), dt) if dt == np.float64 else randn((5, 7)) > 0)
        bt.add("gather", x, np.array([4, 0, 9], np.int32), axis=1)
        bt.add("dynamic_update_slice", x, x[:2], np.array(7, np.int64), axis=0)
        bt.add("dynamic_slice", x, np.array(-2, np.int64), axis=1, size=7)  # the whole axis
    bf = randn((4, 6)).astype(ml_dtypes.bfloat16)
    bt.add("gather", bf, np.array([3, -1], np.int64), axis=0)
    bt.add("dynamic_update_slice", bf, bf[:, :2], np.array(3, np.int64), axis=1)
    bt.add("gather", randn((0, 3)), np.array([0, 2], np.int64), axis=0)           # from an empty axis: zeros
    bt.add("gather", randn((4, 3)), np.zeros((0,), np.int64), axis=0)             # no indices
    bt.add("dynamic_slice", randn((4, 3)), np.array(2, np.int64), axis=0, size=0)  # an empty window
    bt.add("dynamic_update_slice", randn((4, 0)), randn((2, 0)), np.array(1, np.int64), axis=0)
    _no_fallbacks(bt.module())
    _same_bits(bt.module(), bt.inputs)


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
def test_gather_of_quantized_rows(dtype):
    """A quantized table's rows (whole blocks) gathered: the bytes of the reference's."""
    w = randn((7, 64))
    storage = refquant.quantize(w, DTYPES[dtype])
    m = parse(f"""dtm 1.0
func @f(%w: {dtype}[7, 64], %i: i64[2, 2]) -> ({dtype}[2, 2, 64], f32[2, 2, 64]) {{
  %r = gather %w, %i {{axis = 0}} : {dtype}[2, 2, 64]
  %y = cast %r {{to = f32}} : f32[2, 2, 64]
  return %r, %y
}}
""")
    _no_fallbacks(m)
    _same_bits(m, [storage, np.array([[6, 0], [-4, 99]], np.int64)])


IN_PLACE = """dtm 1.0
func @f(%cache: f32[8, 4], %row: f32[1, 4], %pos: i64[]) -> (f32[8, 4]{extra_type}) {{
  %c = mul %cache, %cache : f32[8, 4]
  %y = dynamic_update_slice %c, %row, %pos {{axis = 0}} : f32[8, 4]
  %z = add %y, %y : f32[8, 4]
  return %z{extra}
}}
"""


@pytest.mark.parametrize("live", [False, True])
def test_update_in_place_only_over_a_dead_operand(live):
    """Over its operand's memory when nothing reads the operand afterwards (the window alone
    is written); a copy first when the operand is still read (returned, here)."""
    m = parse(IN_PLACE.format(extra=", %c" if live else "", extra_type=", f32[8, 4]" if live else ""))
    prog = _no_fallbacks(m)
    (dus,) = prog.moves[1:] if len(prog.moves) > 1 else prog.moves
    out, operand = dus.outputs[0], dus.inputs[0]
    assert (out.alias is operand) == (not live) and (out.slot == operand.slot) == (not live)
    for pos in (-3, 0, 5, 7, 12):
        ins = [randn((8, 4)), randn((1, 4)), np.array(pos, np.int64)]
        _same_bits(m, ins)
        _same_bits(m, ins)  # the frame's memory again: the copy is made every run


DONATE = """dtm 1.0
func @f(%cache: f32[8, 4], %row: f32[2, 4], %pos: i64[]) -> (f32[8, 4]{extra_type}) {{
  %y = dynamic_update_slice %cache, %row, %pos {{axis = 0}} : f32[8, 4]
  return %y{extra}
}}
"""


def test_donated_input_is_updated_in_place_and_returned():
    m = parse(DONATE.format(extra="", extra_type=""))
    plan = CPU.plan(m, "f")
    cache, row = randn((8, 4)), randn((2, 4))
    want = ref_run(m, "f", [cache.copy(), row, np.array(9, np.int64)])[0]
    (got,) = plan.run([cache, row, np.array(9, np.int64)], donated=frozenset({0}))
    assert got is cache and np.array_equal(got, want)
    # not donated, read-only, or passed twice: a fresh result, the input untouched
    for ins, donated in (([cache.copy(), row, np.array(1)], frozenset()),
                         ([np.array(cache, copy=True), row, np.array(1)], frozenset({1}))):
        before = ins[0].copy()
        (y,) = plan.run(ins, donated=donated)
        assert y is not ins[0] and np.array_equal(ins[0], before)
    ro = cache.copy()
    ro.flags.writeable = False
    (y,) = plan.run([ro, row, np.array(1)], donated=frozenset({0}))
    assert y is not ro and np.array_equal(y, ref_run(m, "f", [ro, row, np.array(1)])[0])


def test_donated_input_still_read_afterwards_is_not_written():
    m = parse(DONATE.format(extra=", %cache", extra_type=", f32[8, 4]"))
    cache = randn((8, 4))
    before = cache.copy()
    y, back = CPU.plan(m, "f").run([cache, randn((2, 4)), np.array(3, np.int64)], donated=frozenset({0}))
    assert np.array_equal(cache, before) and np.array_equal(back, before) and not np.array_equal(y, before)


def test_update_wider_than_its_operand_at_run_time_is_an_error():
    m = parse("""dtm 1.0
func @f(%x: f32[N, 4], %u: f32[M, 4], %p: i64[]) -> (f32[N, 4]) {
  %y = dynamic_update_slice %x, %u, %p {axis = 0} : f32[N, 4]
  return %y
}
""")
    _no_fallbacks(m)
    _same_bits(m, [randn((5, 4)), randn((3, 4)), np.array(4, np.int64)])
    with pytest.raises(DTMError) as e:
        CPU.run(m, "f", [randn((2, 4)), randn((3, 4)), np.array(0, np.int64)])
    assert e.value.code == ErrorCode.SHAPE_MISMATCH


def test_kv_cache_steps_return_the_donated_arrays():
    """GPT-2's decoding step donates its caches: each comes back as the same array, updated."""
    from dtm.models.gpt2 import GPT2, GPT2Config

    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    dtm.manual_seed(0)
    model = GPT2(cfg).eval()
    kv = [dtm.tensor(np.zeros((1, 2, 32, 16), np.float32)) for _ in range(2)]
    arrays = [t._buffer for t in kv]
    _, *new = model._jitted_step(padded=False, greedy=False)(dtm.tensor(np.array([[5, 6]])), dtm.tensor(np.int64(0)), *kv)
    assert all(t._buffer is a for t, a in zip(new, arrays))
    assert np.abs(arrays[0][:, :, :2]).sum() > 0 and not arrays[0][:, :, 2:].any()
