"""The frame codec (spec 9.1.1 to 9.1.3, 9.1.7) against an independent reading of the spec:
a bitwise CRC32C written from its definition, and header fields read at the offsets of the
spec's table with `struct`, not with the codec."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtm.errors import ErrorCode as E
from dtm.protocol import (FLAG_LAST, FLAG_RELAYED, HEADER_SIZE, MAGIC, MAX_PAYLOAD, PROTOCOL_VERSION, ChecksumError,
                          FrameDecoder, MsgType, ProtocolError, StaleEpochError, decode_header, encode_frame,
                          encode_header, verify_payload)


def crc32c_ref(data: bytes) -> int:
    """CRC32C from its definition: reflected polynomial 0x82F63B78, init and final XOR all ones."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def fields_at_spec_offsets(frame: bytes) -> dict:
    """The header as the table of spec 9.1.2 lays it out."""
    return {"magic": frame[0:4], "major": frame[4], "minor": frame[5], "type": frame[6], "flags": frame[7],
            "epoch": struct.unpack_from("<Q", frame, 8)[0], "length": struct.unpack_from("<Q", frame, 16)[0],
            "stream": struct.unpack_from("<I", frame, 24)[0], "crc": struct.unpack_from("<I", frame, 28)[0],
            "seq": struct.unpack_from("<Q", frame, 32)[0]}


def spec_crc(frame: bytes) -> int:
    covered = bytearray(frame[:28])
    covered[7] &= 0x0F  # per-hop flag bits are not covered
    return crc32c_ref(bytes(covered) + frame[HEADER_SIZE:])


def test_reference_crc32c_matches_the_standard_check_values():
    assert crc32c_ref(b"123456789") == 0xE3069283
    # RFC 3720, appendix B.4
    assert crc32c_ref(bytes(32)) == 0x8A9136AA
    assert crc32c_ref(b"\xff" * 32) == 0x62A8AB43
    assert crc32c_ref(bytes(range(32))) == 0x46DD794E


frame_args = st.fixed_dictionaries({
    "msg_type": st.sampled_from(list(MsgType)),
    "payload": st.binary(max_size=300),
    "epoch": st.integers(0, 2**64 - 1),
    "stream": st.integers(0, 2**32 - 1),
    "seq": st.integers(0, 2**64 - 1),
    "flags": st.integers(0, 255),
})


@settings(max_examples=200, deadline=None)
@given(frame_args)
def test_header_layout_and_crc_follow_the_spec(a):
    frame = encode_frame(a["msg_type"], a["payload"], epoch=a["epoch"], stream=a["stream"], seq=a["seq"],
                         flags=a["flags"])
    f = fields_at_spec_offsets(frame)
    assert (f["magic"], f["major"], f["minor"]) == (b"DTMW", *PROTOCOL_VERSION)
    assert (f["type"], f["flags"], f["epoch"], f["stream"], f["seq"], f["length"]) == \
        (int(a["msg_type"]), a["flags"], a["epoch"], a["stream"], a["seq"], len(a["payload"]))
    assert f["crc"] == spec_crc(frame)
    assert frame[HEADER_SIZE:] == a["payload"]
    h = decode_header(frame)
    assert (h.version, h.msg_type, h.flags, h.epoch, h.stream, h.seq, h.length, h.crc) == \
        (PROTOCOL_VERSION, a["msg_type"], a["flags"], a["epoch"], a["stream"], a["seq"], len(a["payload"]), f["crc"])
    verify_payload(h, a["payload"])


@settings(max_examples=100, deadline=None)
@given(st.lists(frame_args, max_size=6), st.data())
def test_decoder_gives_the_frames_back_in_any_pieces(frames, data):
    seqs: dict[int, int] = {}
    stream = b""
    for a in frames:  # numbered as a sender numbers them, so check_seq holds
        seq = seqs.get(a["stream"], 0)
        seqs[a["stream"]] = seq + 1
        stream += encode_frame(a["msg_type"], a["payload"], epoch=a["epoch"], stream=a["stream"], seq=seq,
                               flags=a["flags"])
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    dec = FrameDecoder(check_seq=True)
    got = []
    for lo, hi in zip([0] + cuts, cuts + [len(stream)]):
        got += dec.feed(stream[lo:hi])
    dec.close()
    assert [(h.msg_type, h.epoch, h.stream, h.flags, p) for h, p in got] == \
        [(a["msg_type"], a["epoch"], a["stream"], a["flags"], a["payload"]) for a in frames]


def test_zero_copy_parts_give_the_same_frame():
    tensor = np.arange(1000, dtype=np.float32).reshape(10, 100)
    parts = [b"\x01\x02", memoryview(tensor), bytearray(b"tail")]
    header = encode_header(MsgType.DATA, parts, epoch=1, stream=2, seq=3)
    joined = b"\x01\x02" + tensor.tobytes() + b"tail"
    assert header + joined == encode_frame(MsgType.DATA, joined, epoch=1, stream=2, seq=3)
    h = decode_header(header)
    assert h.length == len(joined)
    verify_payload(h, parts)


@settings(max_examples=150, deadline=None)
@given(st.binary(min_size=1, max_size=64), st.data())
def test_every_covered_bit_is_checked_and_no_uncovered_one(payload, data):
    frame = encode_frame(MsgType.LEAVE, payload, epoch=5, stream=1, seq=0, flags=FLAG_LAST)
    covered = [(i, b) for i in range(28) for b in range(8) if not (i == 7 and b >= 4)] + \
              [(i, b) for i in range(HEADER_SIZE, len(frame)) for b in range(8)]
    i, b = data.draw(st.sampled_from(covered))
    bad = bytearray(frame)
    bad[i] ^= 1 << b
    with pytest.raises(ProtocolError):  # a flipped magic, version, type or length fails earlier
        dec = FrameDecoder(max_payload=1 << 20)
        dec.feed(bytes(bad))
        dec.close()
    if 8 <= i < 28 and not 16 <= i < 24 or i >= HEADER_SIZE or (i == 7 and b < 4):
        with pytest.raises(ChecksumError):  # epoch, stream, crc, end-to-end flags, payload: the CRC catches it
            FrameDecoder().feed(bytes(bad))
    # a relay changes the hop flags and seq: the CRC still holds
    relayed = bytearray(frame)
    relayed[7] |= FLAG_RELAYED
    relayed[32:40] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    h = decode_header(bytes(relayed))
    verify_payload(h, payload)
    assert h.flags == FLAG_LAST | FLAG_RELAYED


def test_header_checks_in_the_order_of_the_spec():
    good = encode_frame(MsgType.LEAVE, b"x" * 10, epoch=3, stream=0, seq=0)

    def code_of(buf, **kw):
        with pytest.raises(ProtocolError) as e:
            decode_header(buf, **kw)
        return e.value.code

    assert code_of(good[:39]) is E.TRUNCATED_FRAME
    assert code_of(b"DTMX" + good[4:]) is E.BAD_MAGIC
    # magic is checked before the version, the version before the type, the type before the length
    assert code_of(b"XXXX\x02\x00\xff" + good[7:]) is E.BAD_MAGIC
    for major in (0, 2, 255):
        assert code_of(good[:4] + bytes([major]) + good[5:]) is E.UNSUPPORTED_PROTOCOL_VERSION
    assert code_of(good[:4] + b"\x02\x00\xff" + good[7:]) is E.UNSUPPORTED_PROTOCOL_VERSION
    for t in (0, 13, 255):
        assert code_of(good[:6] + bytes([t]) + good[7:]) is E.UNKNOWN_MESSAGE
    huge = good[:16] + struct.pack("<Q", 2**64 - 1) + good[24:]
    assert code_of(huge[:6] + b"\x00" + huge[7:]) is E.UNKNOWN_MESSAGE
    assert code_of(huge) is E.FRAME_TOO_LARGE
    assert code_of(good, max_payload=9) is E.FRAME_TOO_LARGE
    decode_header(good, max_payload=10)
    assert code_of(good, expected_epoch=4) is E.STALE_EPOCH
    decode_header(good, expected_epoch=3)
    decode_header(good, expected_epoch=2)  # a newer epoch than the receiver's is not refused
    # a newer minor is read; once negotiated, only that version is
    newer_minor = encode_frame(MsgType.LEAVE, b"", epoch=0, stream=0, seq=0, version=(PROTOCOL_VERSION[0], 9))
    assert decode_header(newer_minor).version == (PROTOCOL_VERSION[0], 9)
    assert code_of(newer_minor, expected_version=PROTOCOL_VERSION) is E.UNSUPPORTED_PROTOCOL_VERSION
    decode_header(good, expected_version=PROTOCOL_VERSION)


def test_a_length_far_beyond_memory_is_refused_before_anything_is_allocated():
    header = bytearray(encode_header(MsgType.DATA, b"", epoch=0, stream=0, seq=0))
    header[16:24] = struct.pack("<Q", 1 << 62)
    dec = FrameDecoder()
    with pytest.raises(ProtocolError) as e:
        dec.feed(bytes(header))
    assert e.value.code is E.FRAME_TOO_LARGE and str(MAX_PAYLOAD) in str(e.value)


def test_truncation_is_reported_when_the_stream_ends():
    frame = encode_frame(MsgType.CANCEL, b"abcdef", epoch=0, stream=0, seq=0)
    for n in range(1, len(frame)):
        dec = FrameDecoder()
        assert dec.feed(frame[:n]) == []
        with pytest.raises(ProtocolError) as e:
            dec.close()
        assert e.value.code is E.TRUNCATED_FRAME
    dec = FrameDecoder()
    dec.feed(b"")
    dec.close()
    with pytest.raises(ProtocolError) as e:
        verify_payload(decode_header(frame), b"abcde")
    assert e.value.code is E.TRUNCATED_FRAME


def test_stale_frames_are_skipped_and_the_stream_goes_on():
    stale = encode_frame(MsgType.DATA, b"s" * 1000, epoch=2, stream=1, seq=0)
    hello = encode_frame(MsgType.HELLO, b"h", epoch=0, stream=0, seq=0)
    error = encode_frame(MsgType.ERROR, b"e", epoch=0, stream=0, seq=1)
    fresh = encode_frame(MsgType.DATA, b"f", epoch=3, stream=1, seq=1)
    stream = stale + hello + error + fresh
    dec = FrameDecoder(expected_epoch=3, check_seq=True)
    got = []
    for i in range(0, len(stream), 7):
        got += dec.feed(stream[i:i + 7])
    dec.close()
    assert [(h.msg_type, p) for h, p in got] == [(MsgType.HELLO, b"h"), (MsgType.ERROR, b"e"), (MsgType.DATA, b"f")]
    assert len(dec.discarded) == 1 and isinstance(dec.discarded[0], StaleEpochError)
    assert dec.discarded[0].code is E.STALE_EPOCH and "epoch 2" in str(dec.discarded[0])
    # the stream ends inside a stale frame's payload
    dec = FrameDecoder(expected_epoch=3)
    dec.feed(stale[:-1])
    with pytest.raises(ProtocolError, match="stale frame"):
        dec.close()


def test_sequence_numbers_count_per_stream():
    def frames(*pairs):
        return b"".join(encode_frame(MsgType.CANCEL, b"", epoch=0, stream=s, seq=q) for s, q in pairs)

    assert len(FrameDecoder(check_seq=True).feed(frames((0, 0), (1, 0), (0, 1), (1, 1), (7, 0)))) == 5
    assert len(FrameDecoder(check_seq=True, next_seq={0: 4}).feed(frames((0, 4), (0, 5)))) == 2
    for bad in (frames((0, 1)), frames((0, 0), (0, 0)), frames((0, 0), (0, 2)), frames((3, 0), (3, 5))):
        with pytest.raises(ProtocolError) as e:
            FrameDecoder(check_seq=True).feed(bad)
        assert e.value.code is E.OUT_OF_SEQUENCE
    assert len(FrameDecoder().feed(frames((0, 9), (0, 3)))) == 2  # unchecked unless asked


def test_the_first_error_closes_the_decoder():
    dec = FrameDecoder()
    with pytest.raises(ProtocolError):
        dec.feed(b"NOPE" + bytes(40))
    good = encode_frame(MsgType.LEAVE, b"", epoch=0, stream=0, seq=0)
    for step in (lambda: dec.feed(good), dec.close):
        with pytest.raises(ProtocolError) as e:
            step()
        assert e.value.code is E.BAD_MAGIC


def test_errors_name_the_peer_once_the_transport_knows_it():
    frame = bytearray(encode_frame(MsgType.DATA, b"abc", epoch=0, stream=0, seq=0))
    frame[-1] ^= 0xFF
    with pytest.raises(ChecksumError) as e:
        FrameDecoder().feed(bytes(frame))
    named = e.value.at("rank 3 at 127.0.0.1:5001", "all_reduce #4")
    assert isinstance(named, ChecksumError) and named.code is E.CHECKSUM_MISMATCH
    assert str(named).startswith("E0906: peer rank 3 at 127.0.0.1:5001: during all_reduce #4: DATA frame")


def test_encoder_refuses_fields_that_do_not_fit():
    for kw in ({"epoch": -1}, {"epoch": 2**64}, {"stream": 2**32}, {"seq": -1}, {"flags": 256}):
        args = {"epoch": 0, "stream": 0, "seq": 0, **kw}
        with pytest.raises(ValueError):
            encode_header(MsgType.LEAVE, b"", **args)


def test_constants_are_the_spec_s():
    assert MAGIC == b"DTMW" and HEADER_SIZE == 40 and MAX_PAYLOAD == 2**30
    assert [(t.name, t.value) for t in MsgType] == [
        ("HELLO", 1), ("JOIN_MESH", 2), ("MESH_VIEW", 3), ("HEARTBEAT", 4), ("LEAVE", 5), ("COLLECTIVE_START", 6),
        ("DATA", 7), ("P2P_SEND", 8), ("ERROR", 9), ("CANCEL", 10), ("STORE_REQUEST", 11), ("STORE_REPLY", 12)]
