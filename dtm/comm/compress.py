"""Codecs of the compressed collectives (spec 9.5.1): f32 chunks to the compressed chunks of
`dtm.protocol.compressed` (an 8-byte head, then q8_0 blocks or bf16 values) and back.

    codec = codec_for("q8_0")
    buf = np.empty(codec.chunk_bytes(n), np.uint8)
    codec.encode(x_f32, buf)              # head + blocks
    codec.decode_add(buf, acc_f32)        # acc += decoded values (f32), one ring hop
    codec.decode(buf, out_f32)

q8_0 is the GGML reference quantizer of `dtm.ref.quant` bit for bit; bf16 rounds to
nearest even. Both run in C (`quant_codec.c`) where a compiler is there, else in numpy
(the reference itself); the two agree bit for bit (tests/test_quant_collectives.py).
DTM_QUANT_CODEC=numpy forces numpy.
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import cache
from pathlib import Path

import numpy as np

from ..errors import DTMError, ErrorCode as E
from ..ir.dtypes import DTYPES, NARROW_FLOATS, numpy_dtype
from ..protocol.compressed import ENCODINGS, HEAD_SIZE, body_bytes, check_chunk, pack_head
from ..ref import quant as ref_quant

log = logging.getLogger("dtm.comm")

SOURCE = Path(__file__).with_name("quant_codec.c")
FLAGS = ("-std=gnu11", "-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=off",
         "-mprefer-vector-width=512")
COMPRESSIONS = tuple(ENCODINGS)  # "q8_0", "bf16"
_P = ctypes.c_void_p
_N = ctypes.c_int64


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("DTM_QUANT_CODEC", "") == "numpy":
        return None
    try:
        from ..toolchain import build, load
        lib = load(build(SOURCE.read_text(), "quant_codec", FLAGS))
    except DTMError as e:
        log.info("compressed collectives encode with numpy: %s", e)
        return None
    for name, args in (("dtm_q8_encode", [_P, _N, _P]), ("dtm_q8_decode", [_P, _N, _P]),
                       ("dtm_q8_decode_add", [_P, _N, _P]), ("dtm_q8_add_encode", [_P, _N, _P, _P, ctypes.c_int32]),
                       ("dtm_bf16_encode", [_P, _N, _P]), ("dtm_bf16_decode", [_P, _N, _P]),
                       ("dtm_bf16_decode_add", [_P, _N, _P])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    return lib


class Codec:
    """One encoding of compressed chunks. Buffers: f32 arrays (contiguous) and uint8
    arrays of exactly `chunk_bytes(count)` bytes."""

    def __init__(self, name: str, native: bool = True):
        self.name = name
        self.lib = _library() if native else None

    def chunk_bytes(self, count: int) -> int:
        return HEAD_SIZE + body_bytes(self.name, count)

    def check(self, buf: np.ndarray, count: int, who: str) -> None:
        """The chunk a peer sent: well-formed, of this encoding, holding `count` elements
        (E0910 naming `who` otherwise)."""
        try:
            encoding, got = check_chunk(buf)
        except DTMError as e:
            raise DTMError(E.BAD_PAYLOAD, f"{who}: {e.message}") from None
        if (encoding, got) != (self.name, count):
            raise DTMError(E.BAD_PAYLOAD, f"{who}: a compressed chunk of {got} {encoding} elements, this rank "
                                          f"expected {count} {self.name} elements")

    def encode(self, x: np.ndarray, buf: np.ndarray) -> None:
        n = x.size
        buf[:HEAD_SIZE] = np.frombuffer(pack_head(self.name, n), np.uint8)
        body = buf[HEAD_SIZE:]
        if self.lib is not None and n:
            fn = self.lib.dtm_q8_encode if self.name == "q8_0" else self.lib.dtm_bf16_encode
            fn(x.ctypes.data, n, body.ctypes.data)
        elif self.name == "q8_0":
            nb = -(-n // 32)
            padded = np.zeros(nb * 32, np.float32)
            padded[:n] = x
            body[:] = ref_quant.quantize(padded, DTYPES["q8_0"])
        else:
            body.view(np.uint16)[:] = x.astype(numpy_dtype(DTYPES["bf16"])).view(np.uint16)

    def _decoded(self, buf: np.ndarray, n: int) -> np.ndarray:
        body = buf[HEAD_SIZE:]
        if self.name == "q8_0":
            return ref_quant.dequantize(body, DTYPES["q8_0"], np.float32)[:n]
        return body.view(numpy_dtype(DTYPES["bf16"])).astype(np.float32)

    def decode(self, buf: np.ndarray, out: np.ndarray) -> None:
        n = out.size
        if self.lib is not None and n:
            fn = self.lib.dtm_q8_decode if self.name == "q8_0" else self.lib.dtm_bf16_decode
            fn(buf[HEAD_SIZE:].ctypes.data, n, out.ctypes.data)
        elif n:
            out[:] = self._decoded(buf, n)

    def decode_add(self, buf: np.ndarray, acc: np.ndarray) -> None:
        """acc = decoded + acc, in f32."""
        n = acc.size
        if self.lib is not None and n:
            fn = self.lib.dtm_q8_decode_add if self.name == "q8_0" else self.lib.dtm_bf16_decode_add
            fn(buf[HEAD_SIZE:].ctypes.data, n, acc.ctypes.data)
        elif n:
            np.add(self._decoded(buf, n), acc, out=acc)

    def add_encode(self, buf: np.ndarray, acc: np.ndarray, out: np.ndarray, keep: bool = False) -> None:
        """acc = decoded + acc, then `out` = acc encoded (one hop of the ring's reduce-scatter);
        with `keep`, acc = `out` decoded (a finished chunk: the owner keeps what the others get)."""
        if self.lib is not None and self.name == "q8_0" and acc.size:
            out[:HEAD_SIZE] = np.frombuffer(pack_head(self.name, acc.size), np.uint8)
            self.lib.dtm_q8_add_encode(buf[HEAD_SIZE:].ctypes.data, acc.size, acc.ctypes.data,
                                       out[HEAD_SIZE:].ctypes.data, int(keep))
            return
        self.decode_add(buf, acc)
        self.encode(acc, out)
        if keep:
            self.decode(out, acc)


@cache
def codec_for(name: str, native: bool = True) -> Codec:
    return Codec(name, native)


def check_compress(compress: str | None, dtype: np.dtype, op: str | None, what: str) -> str | None:
    """The compression a collective asked for, checked: None, "auto", or a name of
    COMPRESSIONS for a float operand (E0402 otherwise), and sum or avg for a reduction
    (E0306); an unknown name is E0306."""
    if compress is None:
        return None
    if compress != "auto" and compress not in COMPRESSIONS:
        raise DTMError(E.ATTRIBUTE_VALUE, f"{what}: compress={compress!r} is not a compression; use one of "
                                          f"{', '.join(repr(c) for c in COMPRESSIONS)}, 'auto' or None")
    dt = np.dtype(dtype)
    if dt.kind != "f" and dt not in NARROW_FLOATS:
        raise DTMError(E.DTYPE_MISMATCH, f"{what}: compress={compress!r} needs a float operand, found {dt}; "
                                         "integers and booleans travel uncompressed (compress=None)")
    if op is not None and op not in ("sum", "avg"):
        raise DTMError(E.ATTRIBUTE_VALUE, f"{what}: compress={compress!r} applies to op 'sum' and 'avg', "
                                          f"not {op!r}")
    return compress


__all__ = ["COMPRESSIONS", "Codec", "codec_for", "check_compress"]
