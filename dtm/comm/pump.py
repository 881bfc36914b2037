"""The ring's frame loop in C (`ring_pump.c`), for the TCP transport.

Python's ring spends about a quarter of a 4-rank all_reduce's CPU on per-frame work around
the syscalls; `ring_pump.c` runs the same frames (headers, CRC32C, chunk numbers, the
reduction) without it. This module builds and loads it, mirrors its state struct, and
says whether it can be used here:

- the crc32c package must expose its hardware routine (`_crc32c_hw_adler`, x86-64 with
  SSE4.2), which the C code calls so that DTM computes every CRC32C with that one package;
- a C compiler must be there (the same one the cpu backend uses);
- DTM_RING_PUMP=0 turns it off (Python's ring then runs, as on any other transport);
- the pass must be one the C code can compute (`can_run`).

`RingPassState` turns a ring plan (`algorithms.ring_schedule`) into the pump's state and
keeps the arrays that state points into alive; `TcpTransport.ring_pass` drives it.
`CompressedPassState` does the same for a compressed pass (spec 9.5.1), which runs in the
pump built together with the codec (`compressed_ring_pump`); `compressed_ring_pass` drives it.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import crc32c
import numpy as np

from ..toolchain import build, load
from ..errors import DTMError
from ..protocol.compressed import ENCODINGS
from ..protocol.frame import FLAG_COMPRESSED, HEADER_SIZE
from ..protocol.messages import DATA_HEADER_SIZE
from .algorithms import RingReceive
from .transport import byte_view

log = logging.getLogger("dtm.comm")

SOURCE = Path(__file__).with_name("ring_pump.c")
FLAGS = ("-std=gnu11", "-O3", "-march=native", "-fPIC", "-shared")
SLICE_MS = 50  # the longest one call runs before Python looks at deadlines and signals
FRAMING = HEADER_SIZE + DATA_HEADER_SIZE  # frame header and chunk header of a Data frame (72, as in the C)

# Return values of dtm_ring_pump
DONE, YIELD, HANDOFF, LEFT_CLOSED, LEFT_ERROR, RIGHT_ERROR, BAD_CRC, BAD_CHUNK = range(8)
# recv_flags bits
RECV_REDUCE, RECV_FORWARD, RECV_FINISH, RECV_KEEP = 1, 2, 4, 8

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
        ("codec", ctypes.c_int32), ("data_flags", ctypes.c_int32),
        ("recv_elem", I64P), ("recv_count", I64P), ("recv_enc", I64P),
        ("first_elem", I64P), ("first_count", I64P),
        ("nfirst", ctypes.c_int64), ("decode_first", ctypes.c_int32),
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


@cache
def compressed_ring_pump() -> tuple[ctypes._CFuncPtr, int] | None:
    """(dtm_ring_pump with the codec inside, the CRC routine's address) for compressed
    passes, or None where it cannot run (as `ring_pump`; DTM_QUANT_CODEC=numpy also turns
    it off). One object of ring_pump.c and quant_codec.c, built with the codec's flags
    (-ffp-contract=off: the codec's arithmetic is the reference's, bit for bit)."""
    if os.environ.get("DTM_RING_PUMP", "1") == "0" or os.environ.get("DTM_QUANT_CODEC", "") == "numpy":
        return None
    crc = crc32c_routine()
    if crc is None:
        return None
    from .compress import FLAGS as CODEC_FLAGS, SOURCE as CODEC_SOURCE
    try:
        fn = load(build(CODEC_SOURCE.read_text() + "\n" + SOURCE.read_text(), "ring_pump_quant",
                        CODEC_FLAGS)).dtm_ring_pump
    except DTMError as e:
        log.info("the compressed ring pump is off: %s", e)
        return None
    fn.argtypes = [ctypes.POINTER(PumpState)]
    fn.restype = ctypes.c_int
    return fn, crc


def can_run(op: str, dtype: np.dtype, reduces: bool, finished_dtype: np.dtype | None = None) -> bool:
    """Whether ring_pump.c can compute a ring pass over elements of `dtype`: one that only
    moves chunks always; one that reduces only with sum or avg on f32 or f64 (`land` adds
    4- or 8-byte floats and divides finished chunks), whose finished chunks are copied to a
    buffer of the same dtype (`finished_dtype`; None: no such copy)."""
    return not reduces or (op in ("sum", "avg") and dtype in (np.float32, np.float64)
                           and (finished_dtype is None or finished_dtype == dtype))


class RingPassState:
    """One ring pass as ring_pump.c runs it: its `PumpState` (`state`, made by `begin`) and
    everything that state points into, kept alive as long as this object, that is while the
    pump runs (the C code reads and writes them between its calls).

    The plan in bytes of `work`, per receive: `recv_off`, `recv_len`, `recv_flags`
    (RECV_* bits) and `pre` (the address of a payload Python took before the pump ran, see
    `take`; 0: the pump reads it); per send: `send_off`, `send_len`, the first block's
    chunks and then room for each receive the pump passes on."""

    def __init__(self, work: np.ndarray, first: Sequence[tuple[int, int]], plan: Sequence[RingReceive]):
        item = work.itemsize
        self.work, self.reduces = work, any(r.reduce for r in plan)
        self.recv_off = np.array([r.a * item for r in plan], np.int64)
        self.recv_len = np.array([(r.b - r.a) * item for r in plan], np.int64)
        self.recv_flags = np.array([RECV_REDUCE * r.reduce + RECV_FORWARD * r.forward + RECV_FINISH * r.finish
                                    for r in plan], np.int64)
        self.send_off = np.zeros(len(first) + len(plan), np.int64)
        self.send_len = np.zeros_like(self.send_off)
        self.send_off[:len(first)] = [work.ctypes.data + a * item for a, _ in first]  # addresses
        self.send_len[:len(first)] = [(b - a) * item for a, b in first]
        self.nfirst = len(first)
        self.pre = np.zeros(len(plan), np.int64)
        self.early: list[np.ndarray] = []  # the payloads `pre` points at
        self.watch_fds = np.zeros(0, np.int32)
        self.prefix, self.tmp, self.finished = b"", np.empty(0, np.uint8), None
        self.state = PumpState()  # zeroed until `begin` fills it

    def largest_receive(self) -> int:
        """The bytes of the largest receive: what the scratch for reduced chunks must hold."""
        return int(self.recv_len.max())

    def begin(self, *, left: int, right: int, crc: int, op: str, n: int, stream: int, epoch: int, seq: int,
              out_version: tuple[int, int], in_version: tuple[int, int], prefix: bytes, tmp: np.ndarray,
              finished: np.ndarray | None, finished_base: int) -> None:
        """Fill `state` for a pass of a group of `n` reducing with `op`: it reads the
        socket `left` and writes `right` (file descriptors), sends `prefix` (the
        CollectiveStart frame) before its first Data frame and reduces each received chunk
        from `tmp` (at least `largest_receive` bytes). `finished` holds `work`'s elements
        from `finished_base` on; the other arguments are the frames' header fields."""
        self.prefix, self.tmp, self.finished = prefix, tmp, finished
        item = self.work.itemsize
        i64 = lambda a: a.ctypes.data_as(I64P)  # noqa: E731
        self.state = PumpState(
            left=left, right=right, slice_ms=SLICE_MS,
            crc=crc, item=item,
            divide_by=n if op == "avg" and self.reduces else 0, out_version=tuple(out_version),
            in_version=tuple(in_version), stream=stream, epoch=epoch, coll_seq=seq, base=self.work.ctypes.data,
            tmp=tmp.ctypes.data, finished=finished.ctypes.data if finished is not None else None,
            finished_base=finished_base * item,
            prefix=ctypes.cast(ctypes.c_char_p(prefix), ctypes.c_void_p), prefix_len=len(prefix),
            nrecv=len(self.recv_off), nsend=self.nfirst, recv_off=i64(self.recv_off), recv_len=i64(self.recv_len),
            recv_flags=i64(self.recv_flags), pre=i64(self.pre), send_off=i64(self.send_off),
            send_len=i64(self.send_len))

    def watch(self, fds: Sequence[int]) -> None:
        """The other sockets: one turning readable ends the pump's call (YIELD)."""
        self.watch_fds = np.array(fds, np.int32)
        self.state.watch = self.watch_fds.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.state.nwatch = len(self.watch_fds)

    def take(self, j: int, payload: np.ndarray) -> None:
        """Receive j's payload arrived before the pump ran: the pump reads it from there."""
        self.early.append(payload)
        self.pre[j] = payload.ctypes.data

    def call(self, fn: ctypes._CFuncPtr) -> int:
        """One call of `dtm_ring_pump` (`fn`, from `ring_pump()`): its status (DONE, ...)."""
        return fn(ctypes.byref(self.state))

    def receiving(self) -> bool:
        """The pump still reads the left connection."""
        return self.state.rh < self.state.nrecv

    def sending(self) -> bool:
        """The pump still writes the right connection: bytes queued, or chunks to pass on."""
        s = self.state
        return s.prefix_sent < s.prefix_len or s.sh < s.nsend or bool((self.recv_flags[s.rh:] & RECV_FORWARD).any())

    def receive_view(self, j: int) -> memoryview:
        """Where receive j's payload goes (its size is the frame's)."""
        return byte_view(self.work)[self.recv_off[j]:self.recv_off[j] + self.recv_len[j]]

    def landing(self) -> memoryview:
        """Where the payload of the current receive lands: the scratch, when the chunk is
        reduced, else its place in `work`."""
        s = self.state
        at, nbytes = s.recv_off[s.rh], s.recv_len[s.rh]
        if s.recv_flags[s.rh] & RECV_REDUCE:
            return memoryview(self.tmp)[:nbytes]
        return byte_view(self.work)[at:at + nbytes]

    def sending_payload(self) -> memoryview:
        """The payload of the Data frame being sent (send number `state.sh`)."""
        s = self.state
        return _at(s.send_off[s.sh], s.send_len[s.sh])


def _at(address: int, nbytes: int) -> memoryview:
    """The `nbytes` bytes at `address` (of a buffer this pass keeps alive), without a copy."""
    return memoryview((ctypes.c_char * int(nbytes)).from_address(int(address))).cast("B")


class CompressedPassState(RingPassState):
    """A compressed ring pass (spec 9.5.1) as ring_pump.c runs it with the codec inside
    its loop: `algorithms.compressed_ring`'s chunks, frames and arithmetic, bit for bit.
    `work` holds the f32 values; each receive lands in its own room of `recv_arena` and
    each re-encoded chunk in its own of `send_arena`, laid out as compressed_ring lays
    them out (`compressed_arenas` says how large), so that both stay valid until sent."""

    def __init__(self, work: np.ndarray, first: Sequence[tuple[int, int]], plan: Sequence[RingReceive], codec,
                 mode: str, recv_arena: np.ndarray, send_arena: np.ndarray):
        size = codec.chunk_bytes
        self.work, self.reduces, self.codec, self.mode = work, any(r.reduce for r in plan), codec, mode
        self.arenas = (recv_arena, send_arena)
        keep = mode == "reduce_scatter"
        self.recv_elem = np.array([r.a for r in plan], np.int64)
        self.recv_count = np.array([r.b - r.a for r in plan], np.int64)
        self.recv_len = np.array([size(r.b - r.a) for r in plan], np.int64)
        self.recv_off = recv_arena.ctypes.data + np.concatenate([[0], np.cumsum(self.recv_len)[:-1]]).astype(np.int64) \
            if len(plan) else np.zeros(0, np.int64)
        self.recv_flags = np.array([RECV_REDUCE * r.reduce + RECV_FORWARD * r.forward + RECV_FINISH * r.finish
                                    + RECV_KEEP * (r.reduce and r.finish and keep) for r in plan], np.int64)
        # The send arena in compressed_ring's order: the first block's chunks, then each re-encoding.
        first_len = [size(b - a) for a, b in first]
        enc_len = [size(r.b - r.a) if r.reduce and not (r.finish and keep) else 0 for r in plan]
        at = send_arena.ctypes.data + np.concatenate([[0], np.cumsum(first_len + enc_len)]).astype(np.int64)
        self.recv_enc = np.where(np.array(enc_len, np.int64) > 0, at[len(first):len(first) + len(plan)], 0) \
            .astype(np.int64) if len(plan) else np.zeros(0, np.int64)
        self.first_elem = np.array([a for a, _ in first], np.int64)
        self.first_count = np.array([b - a for a, b in first], np.int64)
        self.send_off = np.zeros(len(first) + len(plan), np.int64)
        self.send_len = np.zeros_like(self.send_off)
        self.send_off[:len(first)] = at[:len(first)]
        self.send_len[:len(first)] = first_len
        self.nfirst = len(first)
        self.pre = np.zeros(len(plan), np.int64)
        self.early: list[np.ndarray] = []
        self.watch_fds = np.zeros(0, np.int32)
        self.prefix, self.tmp, self.finished = b"", np.empty(0, np.uint8), None
        self.state = PumpState()

    def largest_receive(self) -> int:
        return 0  # (receives land in the arena, not in the scratch)

    def begin(self, **kw) -> None:
        super().begin(**kw)
        s, i64 = self.state, (lambda a: a.ctypes.data_as(I64P))  # noqa: E731
        s.divide_by = 0  # avg divides after the pass, in Python, as compressed_ring's caller does
        s.codec = ENCODINGS[self.codec.name]
        s.data_flags = FLAG_COMPRESSED
        s.recv_elem, s.recv_count, s.recv_enc = i64(self.recv_elem), i64(self.recv_count), i64(self.recv_enc)
        s.first_elem, s.first_count = i64(self.first_elem), i64(self.first_count)
        s.nfirst = self.nfirst
        s.decode_first = self.mode == "all_gather"

    def receive_view(self, j: int) -> memoryview:
        return _at(self.recv_off[j], self.recv_len[j])

    def landing(self) -> memoryview:
        s = self.state
        return _at(s.recv_off[s.rh], s.recv_len[s.rh])
