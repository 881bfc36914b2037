"""Host arrays for weights and plan slots (dtm/runtime/buffers.py): large ones start on a
2 MiB boundary of their own memory (asked for huge pages), small ones are numpy's; values
are copied exactly, and loaded weights land there."""

import sys

import ml_dtypes
import numpy as np
import pytest

import dtm
from dtm.runtime import buffers

LINUX = sys.platform.startswith("linux")


@pytest.mark.skipif(not LINUX, reason="huge pages are asked of Linux only")
def test_a_large_array_starts_on_a_huge_page_and_a_small_one_is_numpys():
    big = buffers.empty((3, 1 << 18), np.float32)           # 3 MiB
    assert big.shape == (3, 1 << 18) and big.dtype == np.float32 and big.flags.c_contiguous
    assert buffers.is_aligned(big) and big.flags.writeable
    big[...] = 7                                            # all of it is usable memory
    assert big.sum(dtype=np.float64) == 7 * big.size
    small = buffers.empty(100, np.uint8)
    assert small.shape == (100,) and small.base is None     # numpy's own allocation


@pytest.mark.parametrize("dtype", [np.float32, np.int64, ml_dtypes.bfloat16, np.uint8])
def test_a_copy_keeps_every_bit_and_owns_its_memory(dtype):
    rng = np.random.default_rng(0)
    src = rng.standard_normal((3 << 20) // np.dtype(dtype).itemsize).astype(dtype).reshape(3, -1)  # 3 MiB
    out = buffers.copy(src)
    assert out.dtype == src.dtype and out.shape == src.shape
    np.testing.assert_array_equal(out.view(np.uint8), src.view(np.uint8))
    src[...] = 0                                            # a copy, not a view
    assert out.view(np.uint8).any()
    if LINUX:
        assert buffers.is_aligned(out)


def test_loaded_weights_are_copies_on_huge_page_boundaries():
    lin = dtm.nn.Linear(1024, 1024)
    w = np.random.default_rng(1).standard_normal((1024, 1024)).astype(np.float32)
    lin.load_state_dict({"weight": w, "bias": np.zeros(1024, np.float32)})
    held = lin.weight.numpy()
    np.testing.assert_array_equal(held, w)
    if LINUX:
        assert buffers.is_aligned(held)
    w[...] = 0                                              # the module holds its own copy
    assert np.abs(lin.weight.numpy()).sum() > 0
    x = np.random.default_rng(2).standard_normal((2, 1024)).astype(np.float32)
    np.testing.assert_allclose(lin(dtm.tensor(x)).numpy(), x @ held.T, rtol=1e-4, atol=1e-4)
