"""store_get / store_put inside programs (spec 3.13, 9.2) run against the store the process
opened with dtm.store.use, on every backend: the reference interpreter (`ref`), compiled
plans (`cpu`), L0's in-process devices; L1's processes are in test_l1_store.py. Results are
checked against numpy, and what a program put is what `st.get` reads afterwards."""

from __future__ import annotations

import uuid

import ml_dtypes
import numpy as np
import pytest

import dtm
from dtm import ir
from dtm.errors import DTMError, ErrorCode as E
from dtm.ir import DTYPES
from dtm.ref import RefContext, dequantize, quantize
from dtm.ref import run as ref_run
from dtm.runtime.backend import get_backend
from dtm.runtime.l0 import L0Executor

# Puts its input, reads it back through the store, squares it, and stores the square and a
# bf16 and a q8_0 copy (types whose storage alone does not name them).
PROGRAM = ir.verify(ir.parse("""dtm 1.0

func @f(%x: f32[N, 32]) -> (f32[N, 32], q8_0[N, 32]) {
  store_put %x {key = "prog/x"}
  %y = store_get {key = "prog/x"} : f32[N, 32]
  %z = mul %y, %y : f32[N, 32]
  store_put %z {key = "prog/z"}
  %h = cast %z {to = bf16} : bf16[N, 32]
  store_put %h {key = "prog/h"}
  %q = cast %x {to = q8_0} : q8_0[N, 32]
  store_put %q {key = "prog/q"}
  %q2 = store_get {key = "prog/q"} : q8_0[N, 32]
  return %z, %q2
}
"""))

X = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)


def fresh() -> dtm.store.Store:
    """A new, empty store that leaves nothing on disk (memory:// stores of one name are one)."""
    return dtm.store.open(f"memory://{uuid.uuid4().hex}")


@pytest.fixture
def st():
    """A fresh process store for each test."""
    return dtm.store.use(fresh())


@pytest.mark.parametrize("backend", ["ref", "cpu"])
def test_a_program_puts_and_gets_through_the_process_store(st, backend):
    z, q = get_backend(backend).run(PROGRAM, "f", [X])
    np.testing.assert_array_equal(z, X * X)
    np.testing.assert_array_equal(q, quantize(X, DTYPES["q8_0"]))
    assert sorted(st.keys("prog/")) == ["prog/h", "prog/q", "prog/x", "prog/z"]
    np.testing.assert_array_equal(st.get("prog/z").numpy(), X * X)
    h = st.get_array("prog/h")
    assert h.dtype == ml_dtypes.bfloat16 and str(st.info("prog/h").dtype) == "bf16"
    np.testing.assert_array_equal(h, (X * X).astype(ml_dtypes.bfloat16))
    info = st.info("prog/q")
    assert str(info.dtype) == "q8_0" and tuple(info.shape) == (3, 32)
    np.testing.assert_array_equal(dequantize(st.get_array("prog/q"), DTYPES["q8_0"], np.float32),
                                  dequantize(quantize(X, DTYPES["q8_0"]), DTYPES["q8_0"], np.float32))


@pytest.mark.parametrize("backend", ["ref", "cpu"])
def test_store_get_reads_what_the_process_put_before_the_program(st, backend):
    m = ir.verify(ir.parse("""dtm 1.0

func @f() -> (f64[2, 2]) {
  %w = store_get {key = "weights/w"} : f64[2, 2]
  %y = add %w, %w : f64[2, 2]
  return %y
}
"""))
    w = np.arange(4.0).reshape(2, 2)
    st.put("weights/w", w)
    np.testing.assert_array_equal(get_backend(backend).run(m, "f", [])[0], w + w)
    st.put("weights/w", np.zeros((2, 3)))  # a later put with another shape: E0403, naming the key
    with pytest.raises(DTMError) as e:
        get_backend(backend).run(m, "f", [])
    assert e.value.code is E.SHAPE_MISMATCH and "'weights/w'" in e.value.message
    st.put("weights/w", np.zeros((2, 2), np.float32))  # the dtype is checked before the shape
    with pytest.raises(DTMError) as e:
        get_backend(backend).run(m, "f", [])
    assert e.value.code is E.DTYPE_MISMATCH
    st.delete("weights/w")
    with pytest.raises(DTMError) as e:
        get_backend(backend).run(m, "f", [])
    assert e.value.code is E.STORE_KEY_MISSING and "'weights/w'" in e.value.message


def test_dtm_store_use_switches_the_store_programs_see(st):
    m = ir.verify(ir.parse('dtm 1.0\n\nfunc @f(%x: f32[2]) -> () {\n  store_put %x {key = "k"}\n  return\n}\n'))
    other = fresh()
    ref_run(m, "f", [np.ones(2, np.float32)])
    dtm.store.use(other)
    assert dtm.store.current() is other
    ref_run(m, "f", [np.full(2, 2, np.float32)])
    np.testing.assert_array_equal(st.get("k").numpy(), [1, 1])
    np.testing.assert_array_equal(other.get("k").numpy(), [2, 2])


def test_a_context_may_carry_its_own_store(st):
    m = ir.verify(ir.parse('dtm 1.0\n\nfunc @f(%x: f32[2]) -> () {\n  store_put %x {key = "k"}\n  return\n}\n'))
    private = fresh()
    ref_run(m, "f", [np.ones(2, np.float32)], RefContext(store=private))
    assert private.keys() == ["k"] and st.keys() == []


def rank_program(rank: int) -> ir.Module:
    """Rank `rank` of two puts its x, waits at a barrier, and gets the other rank's."""
    return ir.verify(ir.parse(f"""dtm 1.0

mesh @m[dp = 2]

func @f(%x: f32[2, 3]) -> (f32[2, 3]) {{
  store_put %x {{key = "ranks/{rank}"}}
  barrier {{mesh = @m, axes = ["dp"]}}
  %y = store_get {{key = "ranks/{1 - rank}"}} : f32[2, 3]
  %z = sub %y, %x : f32[2, 3]
  return %z
}}
"""))


def test_l0_devices_share_the_process_store(st):
    xs = [np.full((2, 3), r + 1, np.float32) * np.arange(3, dtype=np.float32) for r in range(2)]
    outs = L0Executor(2, timeout=10).run([rank_program(0), rank_program(1)], "f", [[x] for x in xs])
    np.testing.assert_array_equal(outs[0][0], xs[1] - xs[0])
    np.testing.assert_array_equal(outs[1][0], xs[0] - xs[1])
    for r in range(2):
        np.testing.assert_array_equal(st.get(f"ranks/{r}").numpy(), xs[r])
