"""The ring's frame loop in C (`ring_pump.c`), for the TCP transport.

Python's ring spends about a quarter of a 4-rank all_reduce's CPU on per-frame work around
the syscalls; `ring_pump.c` runs the same frames (headers, CRC32C, chunk numbers, the
reduction) without it. This module builds and loads it, mirrors its state struct, and
says whether it can be used here:

- the crc32c package must expose its hardware routine (`_crc32c_hw_adler`, x86-64 with
  SSE4.2), which the C code calls so that DTM computes every CRC32C with that one package;
- a C compiler must be there (the same one the cpu backend uses);
- DTM_RING_PUMP=0 turns it off (Python's ring then runs, as on any other transport).

`TcpTransport.ring_pass` drives it.
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import cache
from pathlib import Path

import crc32c

from ..compiler.build import build, load
from ..errors import DTMError
from ..protocol.frame import HEADER_SIZE
from ..protocol.messages import DATA_HEADER_SIZE

log = logging.getLogger("dtm.comm")

SOURCE = Path(__file__).with_name("ring_pump.c")
FLAGS = ("-std=gnu11", "-O3", "-march=native", "-fPIC", "-shared")
SLICE_MS = 50  # the longest one call runs before Python looks at deadlines and signals
FRAMING = HEADER_SIZE + DATA_HEADER_SIZE  # frame header and chunk header of a Data frame (72, as in the C)

# Return values of dtm_ring_pump
DONE, YIELD, HANDOFF, LEFT_CLOSED, LEFT_ERROR, RIGHT_ERROR, BAD_CRC = range(7)
# recv_flags bits
RECV_REDUCE, RECV_FORWARD, RECV_FINISH = 1, 2, 4

I64P = ctypes.POINTER(ctypes.c_int64)


class PumpState(ctypes.Structure):
    """`pump_t` of ring_pump.c, field for field."""

    _fields_ = [
        ("left", ctypes.c_int32), ("right", ctypes.c_int32),
        ("nwatch", ctypes.c_int32), ("slice_ms", ctypes.c_int32),
        ("watch", ctypes.POINTER(ctypes.c_int32)),
        ("crc", ctypes.c_void_p),
        ("item", ctypes.c_int32), ("divide_by", ctypes.c_int32),
        ("out_version", ctypes.c_uint8 * 2), ("in_version", ctypes.c_uint8 * 2),
        ("stream", ctypes.c_uint32),
        ("epoch", ctypes.c_uint64), ("coll_seq", ctypes.c_uint64),
        ("base", ctypes.c_void_p), ("tmp", ctypes.c_void_p),
        ("finished", ctypes.c_void_p), ("finished_base", ctypes.c_int64),
        ("prefix", ctypes.c_void_p), ("prefix_len", ctypes.c_int64),
        ("nrecv", ctypes.c_int64), ("nsend", ctypes.c_int64),
        ("recv_off", I64P), ("recv_len", I64P), ("recv_flags", I64P),
        ("pre", I64P),
        ("send_off", I64P), ("send_len", I64P),
        ("prefix_sent", ctypes.c_int64), ("sh", ctypes.c_int64), ("soff", ctypes.c_int64),
        ("rh", ctypes.c_int64), ("rhlen", ctypes.c_int64), ("roff", ctypes.c_int64),
        ("seq_out", ctypes.c_uint64), ("seq_in", ctypes.c_uint64),
        ("shdr", ctypes.c_uint8 * FRAMING), ("rhdr", ctypes.c_uint8 * FRAMING),
        ("bytes_out", ctypes.c_int64), ("bytes_in", ctypes.c_int64),
        ("err", ctypes.c_int32),
    ]


def crc32c_routine() -> int | None:
    """The address of the crc32c package's hardware CRC32C routine (`uint32_t f(uint32_t
    crc, const unsigned char *data, unsigned long len)`, the register not inverted), checked
    against the package's own function; None where it has none."""
    if not getattr(crc32c, "hardware_based", False):
        return None
    try:
        from crc32c import _crc32c as ext
        routine = ctypes.CDLL(ext.__file__)._crc32c_hw_adler
    except (ImportError, OSError, AttributeError):
        return None
    routine.argtypes = [ctypes.c_uint32, ctypes.c_char_p, ctypes.c_ulong]
    routine.restype = ctypes.c_uint32
    probe = b"123456789"
    if routine(0xFFFFFFFF, probe, len(probe)) ^ 0xFFFFFFFF != crc32c.crc32c(probe):
        return None
    return ctypes.cast(routine, ctypes.c_void_p).value


@cache
def ring_pump() -> tuple[ctypes._CFuncPtr, int] | None:
    """(dtm_ring_pump, the CRC routine's address), or None where the pump cannot run."""
    if os.environ.get("DTM_RING_PUMP", "1") == "0":
        return None
    crc = crc32c_routine()
    if crc is None:
        log.info("the ring pump is off: the crc32c package has no hardware routine to call from C")
        return None
    try:
        fn = load(build(SOURCE.read_text(), "ring_pump", FLAGS)).dtm_ring_pump
    except DTMError as e:
        log.info("the ring pump is off: %s", e)
        return None
    fn.argtypes = [ctypes.POINTER(PumpState)]
    fn.restype = ctypes.c_int
    return fn, crc
