"""The shared-memory point-to-point channel as a byte stream: whatever is written comes out
in order, whole, across the ring's end, against a plain bytes reference (two ranks' ends
mapped in one process)."""

from __future__ import annotations

import os
import uuid

import pytest
from hypothesis import given, settings, strategies as st

from dtm.comm import segment
from dtm.comm.channel import Channels

pytestmark = pytest.mark.skipif(not segment.SUPPORTED, reason="shared-memory channels need Linux on x86-64")

CAPACITY = 1000  # rounded up to 1024: writes of any size wrap around its end


def _pair():
    name = f"dtmtest_{uuid.uuid4().hex[:12]}"
    first = Channels(0, [0, 1], name, CAPACITY, timeout=5.0)
    second = Channels(1, [0, 1], name, CAPACITY, timeout=5.0)
    return first, second


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 700), min_size=1, max_size=3), st.integers(1, 1500)),
                min_size=1, max_size=40))
def test_what_is_written_is_read_in_order(steps):
    first, second = _pair()
    try:
        out, into = first.to[1], second.frm[0]
        sent, received, counter = bytearray(), bytearray(), 0
        for sizes, read_size in steps:
            views = []
            for size in sizes:
                views.append(memoryview(bytes((counter + i) % 251 for i in range(size))))
                counter += size
            try:
                n = out.sendmsg(views)
            except BlockingIOError:
                n = 0
                assert sum(v.nbytes for v in views) > 0 and len(sent) - len(received) == out.capacity
            sent += b"".join(bytes(v) for v in views)[:n]
            counter -= sum(v.nbytes for v in views) - n  # what did not fit is offered again next time
            buf = bytearray(read_size)
            try:
                got = into.recv_into(buf)
            except BlockingIOError:
                got = 0
                assert len(sent) == len(received), "the ring said empty while it held bytes"
            received += buf[:got]
            assert received == sent[:len(received)]
        while len(received) < len(sent):
            buf = bytearray(4096)
            received += buf[:into.recv_into(buf)]
        assert received == sent
    finally:
        second.close()
        first.close()


def test_the_name_is_gone_once_both_ends_mapped_it():
    first, second = _pair()
    name = first.segment.mapping.name
    assert os.path.exists(f"/dev/shm/{name}")
    first.unlink_when_mapped()
    assert not os.path.exists(f"/dev/shm/{name}")
    second.close()
    first.close()
