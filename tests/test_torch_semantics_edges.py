"""Issue 37 (part 7): edges where DTM gave a value and torch raises or gives another, each
now as torch does or a DTMError at the user's line: max/min/argmax over no elements,
Python numbers that do not fit a dtype, integers to negative integer powers, a layer_norm
whose squares overflow, memory no machine has, and a kernel cache directory that cannot be
used. Every case whose answer torch defines is compared with torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import dtm
import dtm.nn.functional as F
from dtm import toolchain as build
from dtm.errors import DTMError, ErrorCode, TensorError
from dtm.ir.types import TensorType
from dtm.ref.interpreter import run as ref_run
from test_tensor_ops import backend  # noqa: F401 - the fixture: a test on each backend, ref and cpu


def raised_here(info: pytest.ExceptionInfo, code: ErrorCode, *words: str) -> None:
    """The error carries `code` and names each of `words`, at a line of this file."""
    e = info.value
    assert (e.code, (e.where or "").rpartition(":")[0]) == (code, __file__), e
    assert all(w in e.message for w in words), e.message


def numpy_of(value) -> np.ndarray:
    """A result as numpy: a tensor, or the values of a (values, indices) pair."""
    if isinstance(value, tuple):
        value = value[0]
    return np.asarray(value.float().numpy() if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16
                      else value.numpy())


def as_torch(make, code: ErrorCode) -> None:
    """make(lib) raises in DTM (a TensorError with `code`, at this file) exactly where it
    raises in torch, and otherwise gives torch's values, dtype and shape."""
    try:
        want = numpy_of(make(torch))
    except (RuntimeError, IndexError, TypeError, ValueError):
        with pytest.raises(TensorError) as e:
            numpy_of(make(dtm))
        raised_here(e, code)
        return
    got = numpy_of(make(dtm))
    assert got.shape == want.shape and got.dtype == want.dtype, (got, want)
    np.testing.assert_array_equal(got, want)


# --- max, min, argmax, argmin over no elements ----------------------------------------------

REDUCTIONS = {
    "max()": lambda m: m.zeros(0).max(),
    "min()": lambda m: m.zeros(0).min(),
    "argmax()": lambda m: m.zeros(0).argmax(),
    "argmin()": lambda m: m.zeros(0).argmin(),
    "amax()": lambda m: m.zeros(0).amax(),
    "amin()": lambda m: m.zeros(0, 3).amin(),
    "bool max()": lambda m: m.zeros(0, dtype=m.bool).max(),
    "max(0) of [0]": lambda m: m.zeros(0).max(0),
    "min(0) of [0, 3]": lambda m: m.zeros(0, 3).min(0),
    "amax(0) of [0, 3]": lambda m: m.zeros(0, 3).amax(0),
    "argmax(0) of [0, 3]": lambda m: m.zeros(0, 3).argmax(0),
    "amax((0, 1)) of [0, 3]": lambda m: m.zeros(0, 3).amax((0, 1)),
    "amin(1) of [3, 0]": lambda m: m.zeros(3, 0).amin(1),
    # a dim of size 0 that is not reduced: an empty result, as in torch
    "max(1) of [0, 3]": lambda m: m.zeros(0, 3).max(1),
    "amax(1, keepdim) of [0, 3]": lambda m: m.zeros(0, 3).amax(1, keepdim=True),
    "argmin(0, keepdim) of [3, 0]": lambda m: m.zeros(3, 0).argmin(0, keepdim=True),
    "max(0) of [3, 0]": lambda m: m.zeros(3, 0).max(0),
    "any of [0]": lambda m: m.zeros(0).any(),
    "all(1) of [3, 0]": lambda m: m.zeros(3, 0).all(1),
}


@pytest.mark.parametrize("case", REDUCTIONS)
def test_reductions_over_no_elements_as_torch(backend, case):
    as_torch(REDUCTIONS[case], ErrorCode.SHAPE_MISMATCH)


def test_reduction_over_no_elements_names_the_dim():
    with pytest.raises(TensorError) as e:
        dtm.zeros(4, 0).argmax(-1)
    raised_here(e, ErrorCode.SHAPE_MISMATCH, "argmax", "dim 1", "f32[4, 0]", "size 0")


# --- Python numbers that do not fit a dtype -------------------------------------------------

FILLS = {
    "tensor 2**40 i32": lambda m: m.tensor([2**40], dtype=m.int32),
    "tensor scalar 2**40 i32": lambda m: m.tensor(2**40, dtype=m.int32),
    "tensor nested 2**40 i16": lambda m: m.tensor([[1, 2], [3, 2**40]], dtype=m.int16),
    "tensor 2**63 i64": lambda m: m.tensor([2**63], dtype=m.int64),
    "tensor 256 u8": lambda m: m.tensor([256], dtype=m.uint8),
    "tensor -1 u8 wraps": lambda m: m.tensor([-1, -255], dtype=m.uint8),
    "tensor -256 u8": lambda m: m.tensor([-256], dtype=m.uint8),
    "tensor 1e20 i32": lambda m: m.tensor([1e20], dtype=m.int32),
    "tensor -1.5 u8": lambda m: m.tensor([-1.5], dtype=m.uint8),
    "tensor nan i32": lambda m: m.tensor([float("nan")], dtype=m.int32),
    "tensor 2.5 i32 truncates": lambda m: m.tensor([2.5, -2.5], dtype=m.int32),
    "tensor 1e40 f32 is inf": lambda m: m.tensor([1e40], dtype=m.float32),
    "tensor numpy array wraps": lambda m: m.tensor(np.array([2**40, 3]), dtype=m.int32),
    "tensor numpy scalar in a list": lambda m: m.tensor([np.int64(2**40)], dtype=m.int32),
    "full 2**40 i32": lambda m: m.full((2,), 2**40, dtype=m.int32),
    "full -1 u8 wraps": lambda m: m.full((2,), -1, dtype=m.uint8),
    "full 300 u8": lambda m: m.full((2,), 300, dtype=m.uint8),
    "full 1e40 f32": lambda m: m.full((2,), 1e40, dtype=m.float32),
    "full 7e4 f16": lambda m: m.full((2,), 7e4, dtype=m.float16),
    "full inf f16": lambda m: m.full((2,), float("inf"), dtype=m.float16),
    "full 2.5 i32 truncates": lambda m: m.full((2,), 2.5, dtype=m.int32),
    "full inf i32": lambda m: m.full((2,), float("inf"), dtype=m.int32),
    "full_like 1000 i8": lambda m: m.full_like(m.ones(2, dtype=m.int8), 1000),
    "masked_fill 1000 i8": lambda m: m.ones(2, dtype=m.int8).masked_fill(m.tensor([True, False]), 1000),
    "masked_fill -1 u8 wraps": lambda m: m.ones(2, dtype=m.uint8).masked_fill(m.tensor([True, False]), -1),
    "masked_fill 2.7 i8 truncates": lambda m: m.ones(2, dtype=m.int8).masked_fill(m.tensor([True, False]), 2.7),
    "masked_fill 1e39 f32": lambda m: m.zeros(2).masked_fill(m.tensor([True, False]), 1e39),
    "where 200 i8": lambda m: m.where(m.tensor([True, False]), m.ones(2, dtype=m.int8), 200),
    "where 127 i8": lambda m: m.where(m.tensor([True, False]), m.ones(2, dtype=m.int8), 127),
    "where 2.5 i8 promotes": lambda m: m.where(m.tensor([True, False]), m.ones(2, dtype=m.int8), 2.5),
    "clamp max 1000 i8": lambda m: m.ones(2, dtype=m.int8).clamp(max=1000),
    "clamp min -1 u8 wraps": lambda m: m.ones(2, dtype=m.uint8).clamp(min=-1),
    "i8 + 1000 wraps": lambda m: m.ones(2, dtype=m.int8) + 1000,
    "u8 * -1 wraps": lambda m: m.ones(2, dtype=m.uint8) * -1,
    "i8 == 1000": lambda m: m.ones(2, dtype=m.int8) == 1000,
}


@pytest.mark.parametrize("case", FILLS)
def test_numbers_that_do_not_fit_the_dtype_as_torch(backend, case):
    as_torch(FILLS[case], ErrorCode.LITERAL_MISMATCH)


def test_setitem_number_that_does_not_fit_raises():
    for lib in (torch, dtm):
        x = lib.ones(3, dtype=lib.int8)
        with pytest.raises((RuntimeError, TensorError)) as e:
            x[0] = 1000
    raised_here(e, ErrorCode.LITERAL_MISMATCH, "1000", "i8")


# --- integers to integer powers -------------------------------------------------------------

POWERS = {
    "tensor ** -1": lambda m: m.tensor([2, 3]) ** -1,
    "u8 ** -1": lambda m: m.tensor([2], dtype=m.uint8) ** -1,
    "i8 ** 1000 (the exponent does not fit)": lambda m: m.tensor([1], dtype=m.int8) ** 1000,
    "negative tensor exponents": lambda m: m.tensor([0, 2, 1, -1, -1, 0]) ** m.tensor([-1, -1, -2, -3, -2, 0]),
    "0 ** tensor": lambda m: 0 ** m.tensor([-1, -2, 0, 3]),
    "2 ** tensor": lambda m: 2 ** m.tensor([-1, 0, 5]),
}


@pytest.mark.parametrize("case", POWERS)
def test_integer_powers_as_torch(backend, case):
    code = ErrorCode.LITERAL_MISMATCH if "fit" in case else ErrorCode.ATTRIBUTE_VALUE
    as_torch(POWERS[case], code)


def test_pow_of_two_numbers_to_a_negative_power_raises():
    """torch.pow refuses two numbers (a TypeError); DTM refuses the negative power, which it
    gave as 0."""
    with pytest.raises(TypeError):
        torch.pow(2, -1)
    with pytest.raises(TensorError) as e:
        dtm.pow(2, -1)
    raised_here(e, ErrorCode.ATTRIBUTE_VALUE, "negative integer powers")


# --- layer_norm whose squares overflow ------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("affine", [False, True])
def test_layer_norm_of_overflowing_squares_is_nan_as_torch(backend, dtype, affine):
    """Row 0's squares overflow f32 (torch's kernel gives NaN there, DTM gave 0s); row 1 is
    an ordinary row and keeps its accuracy."""
    rows = [[1e38, -1e38, 1e38], [1.0, 2.0, 4.0]]

    def norm(m):
        x = m.tensor(rows, dtype=getattr(m, dtype))
        w, b = (m.tensor([2.0, 1.0, 0.5], dtype=x.dtype), m.tensor([0.0, 1.0, -1.0], dtype=x.dtype)) if affine \
            else (None, None)
        return (torch.nn.functional if m is torch else F).layer_norm(x, (3,), w, b)

    want, got = numpy_of(norm(torch)), numpy_of(norm(dtm))
    assert np.isnan(want[0]).all() and np.isnan(got[0]).all()
    np.testing.assert_allclose(got[1].astype(np.float32), want[1].astype(np.float32), rtol=1e-2 if dtype == "bfloat16"
                               else 1e-6, atol=1e-6)


# --- memory no machine has ------------------------------------------------------------------

def test_arange_too_large_raises_before_allocating():
    """torch raises a RuntimeError from its allocator; DTM refuses before allocating."""
    with pytest.raises(TensorError) as e:
        dtm.arange(10**12)
    raised_here(e, ErrorCode.OUT_OF_MEMORY, "(1000000000000,)", "GiB", "memory free")


@pytest.mark.parametrize("make", [lambda: dtm.ones(10**6, 1) * dtm.ones(1, 10**6),
                                  lambda: dtm.ones(10**6, 1) @ dtm.ones(1, 10**6)], ids=["product", "matmul"])
def test_a_result_of_1e12_elements_raises_before_allocating(backend, make):
    y = make()
    with pytest.raises(TensorError) as e:
        y.realize()
    raised_here(e, ErrorCode.OUT_OF_MEMORY, "@main", "f32[1000000, 1000000]", "GiB", "memory free")


@pytest.mark.skipif(Path("/proc/sys/vm/overcommit_memory").exists()
                    and Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1",
                    reason="the system grants any allocation (overcommit_memory=1) and kills the process later")
def test_memory_the_system_refuses_is_reported():
    """The reference interpreter run without the runtime's check of free memory: numpy's
    MemoryError (4 TB, which no machine here can give) is E0810 naming the op and result."""
    b = dtm.ir.Builder()
    f = b.func("main")
    x, y = f.param("f32[1000000, 1]", name="x"), f.param("f32[1, 1000000]", name="y")
    f.ret(f.mul(x, y))
    with pytest.raises(TensorError) as e:
        ref_run(b.build(), "main", [np.ones((10**6, 1), np.float32), np.ones((1, 10**6), np.float32)])
    raised_here(e, ErrorCode.OUT_OF_MEMORY, "op 0 (mul)", str(TensorType(dtm.float32, (10**6, 10**6))))


# --- a kernel cache directory that cannot be used ---------------------------------------------

def _cache_under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "cache"


def _cache_that_is_a_file(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("")
    return tmp_path / "file"


@pytest.mark.parametrize("where", [_cache_under_a_file, _cache_that_is_a_file, lambda tmp: Path("/proc/self")],
                         ids=["under a file", "a file", "not writable"])
def test_unusable_cache_dir_is_a_build_error(tmp_path, monkeypatch, where):
    """A path under a file, a file, a directory no file can be made in (/proc/self: even
    root cannot): E0806 naming the directory, not an OSError."""
    d = where(tmp_path)
    monkeypatch.setenv("DTM_CACHE_DIR", str(d))
    monkeypatch.delenv("DTM_RUNTIME_DIR", raising=False)
    with pytest.raises(DTMError) as e:
        build.build("int dtm_edge_probe(void) { return %d; }" % id(d), "edge_probe", build.BASE_FLAGS)
    assert e.value.code is ErrorCode.BUILD_FAILED and str(d) in e.value.message, e.value
