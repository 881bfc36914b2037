"""dtm.comm.nontemporal: the streaming copy writes exactly the bytes numpy's copy writes,
whatever the alignment of either end and the length (head, 64-byte body, tail)."""

import platform

import numpy as np
import pytest

from dtm.comm import nontemporal

GUARD = 128  # bytes on either side of the destination that must stay as they were


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="streaming stores are x86-64's")
def test_the_streaming_copy_is_built_here():
    assert nontemporal._stream_copy() is not None  # else every test below checks numpy against itself


@pytest.mark.parametrize("nbytes", [0, 1, 15, 63, 64, 65, 127, 1000, 4096, (4 << 20) + 23])
@pytest.mark.parametrize("dst_off,src_off", [(0, 0), (1, 0), (0, 3), (17, 40), (63, 63)])
def test_streaming_copy_equals_numpy(nbytes, dst_off, src_off):
    rng = np.random.default_rng(nbytes + 7 * dst_off + src_off)
    src_buf = rng.integers(0, 256, size=nbytes + src_off, dtype=np.uint8)
    dst_buf = rng.integers(0, 256, size=nbytes + dst_off + 2 * GUARD, dtype=np.uint8)
    want = dst_buf.copy()
    want[GUARD + dst_off:GUARD + dst_off + nbytes] = src_buf[src_off:]
    nontemporal.copy_out(dst_buf[GUARD + dst_off:GUARD + dst_off + nbytes], src_buf[src_off:],
                           result_bytes=nontemporal.STREAM_BYTES)
    np.testing.assert_array_equal(dst_buf, want)


def test_a_view_it_cannot_stream_into_is_copied_by_numpy():
    src = np.arange(64, dtype=np.float32)
    dst = np.zeros(128, np.float32)
    nontemporal.copy_out(dst[::2], src, result_bytes=nontemporal.STREAM_BYTES)  # strided: numpy's copy
    np.testing.assert_array_equal(dst[::2], src)
    assert not dst[1::2].any()
