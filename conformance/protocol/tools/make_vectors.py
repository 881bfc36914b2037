#!/usr/bin/env python3
"""Write the wire protocol conformance vectors (spec 9.1.12) from the frames declared below:

- valid/NAME.json: a byte stream and, for each frame, the header and message it was built
  from (not what decoding gives: the runner checks that decoding agrees);
- invalid/NAME.json: a byte stream with one fault, built by hand below; the code it must
  raise is declared next to it and written to manifest.json, then checked against the
  implementation, which never decides it;
- handshake.json: HMAC answers, negotiations, a whole handshake, and refused handshakes;
- manifest.json: every vector with what it shows, and CRC32C check values.

Run it after changing the vectors or the codec, and review `git diff conformance/protocol`:
a changed byte is a change of the wire format every other implementation must follow.

    .venv/bin/python conformance/protocol/tools/make_vectors.py          # write
    .venv/bin/python conformance/protocol/tools/make_vectors.py --check  # write nothing; exit 1 on drift

Exit status: 0 when the files are (now) what this script writes and every vector passes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import re
import struct
import sys

from crc32c import crc32c

ROOT = pathlib.Path(__file__).resolve().parents[1]  # conformance/protocol
sys.path.insert(0, str(ROOT.parents[1]))  # the repository, so `dtm` imports without installing

from dtm.ir.version import SPEC_VERSION  # noqa: E402
from dtm.protocol import (FLAG_COMPRESSED, FLAG_LAST, FLAG_RELAYED, PROTOCOL_VERSION, Cancel, Cap, CollectiveStart, Data,  # noqa: E402
                          Error, Handshake, Heartbeat, Hello, JoinMesh, Leave, Member, MeshView, MsgType, P2PSend,
                          encode_frame, encode_message, hmac_answer, level_caps)
from dtm.protocol.messages import FLAG_EXPECT_SHAPE, StoreReply, StoreRequest, WorkerRow, int_to_json  # noqa: E402
from dtm.protocol.conformance import header_to_json, run_protocol_vectors, summary  # noqa: E402
from dtm.protocol.frame import MESSAGE_SINCE, FrameDecoder  # noqa: E402


def fixed_bytes(label: str, n: int = 32) -> bytes:
    """Deterministic stand-ins for random challenges, so the vectors never change by chance."""
    return hashlib.sha256(label.encode()).digest()[:n]


TOKEN = b"vector-cluster-token"
C_CONNECT, C_ACCEPT = fixed_bytes("dtm vectors: connecting challenge"), fixed_bytes("dtm vectors: accepting challenge")
L1_CAPS = int(level_caps(1))

HELLO_C = Hello(((1, 0),), 1, L1_CAPS, 1 << 30, -1, "127.0.0.1:4242", C_CONNECT)
HELLO_A = Hello(((1, 0),), 1, L1_CAPS, 1 << 26, 0, "coordinator", C_ACCEPT,
                hmac_answer(TOKEN, C_CONNECT, responder_challenge=C_ACCEPT, role="accept"))
VIEW = MeshView(7, 500, 10000, tuple(Member("127.0.0.1", 29500 + r, "node-a" if r < 2 else "node-b")
                                     for r in range(4)), (("dp", 2), ("tp", 2)))
ALL_REDUCE = CollectiveStart(17, "all_reduce", "sum", "f32", (1024, 768), (0, 1, 2, 3), -1, "train.py:42")
BF16_BYTES = struct.pack("<4H", 0x3F80, 0xC000, 0x7F80, 0x0000)  # bf16 1.0, -2.0, inf, 0.0

# Compressed chunks (spec 9.5.1): an 8-byte head (encoding, 0, 0, count) then the body.
# q8_0 of the 40 values 0, 1, ..., 39 (two blocks, the second padded with 24 zeros), as
# dtm.ref.quant quantizes them: block 0 has amax 31, d = 31/127; block 1 amax 39, d = 39/127.
def _q8_chunk(values) -> bytes:
    import numpy as np
    from dtm.ir.dtypes import DTYPES
    from dtm.ref.quant import quantize
    padded = np.zeros(-(-len(values) // 32) * 32, np.float32)
    padded[:len(values)] = values
    return struct.pack("<BBHI", 1, 0, 0, len(values)) + quantize(padded, DTYPES["q8_0"]).tobytes()


Q8_CHUNK = _q8_chunk(list(range(40)))
BF16_CHUNK = struct.pack("<BBHI", 2, 0, 0, 4) + BF16_BYTES

# Live resize (spec 9.6.7), the example of its text: an elastic mesh dp=2,tp=2 of epoch 3
# (ranks 0 and 1 on node-a, 2 and 3 on node-b) loses rank 3; ranks 0, 1 and 2 rejoin with new
# data addresses; the view of epoch 4 is dp=1,tp=2 (old ranks 0 and 1, in that order), and
# rank 2 is a spare. A rank's control stream had its two Hellos, JoinMesh and heartbeats
# before the rejoin; the coordinator's, its Hello, the view of epoch 1 and relayed heartbeats.
RESIZE_REJOIN = JoinMesh(2, 0, "10.0.0.2", 41232, "node-b", 4242)
RESIZE_LOST = Error("E1001", "the coordinator lost rank 3: its connection closed without Leave: the process ended "
                    "or was killed; its last operation was all_reduce #812", 3)
RESIZE_NOTICE = Error("E1009", "the mesh of epoch 3 resizes: rank 3 was lost; rejoin at the next step boundary", -1)
RESIZE_VIEW = MeshView(4, 500, 5000, (Member("10.0.0.1", 41230, "node-a"), Member("10.0.0.1", 41231, "node-a")),
                       (("dp", 1), ("tp", 2)))
RESIZE_SPARE = Error("E1004", "the mesh of epoch 4 ({'dp': 1, 'tp': 2}) has no place for rank 2: 3 ranks for 2 "
                     "places; it ends", -1)


# The mesh's store (spec 9.2.11): a client's requests and a service's replies on stream 0 of
# their own connection, after the handshake. The connecting peer (the client) sent two Hellos
# (seq 0 and 1), the accepting one (the service) one (seq 0), so each side's first frame after
# the handshake has seq 2 and 1. Requests are numbered 0, 1, 2, ...; a tensor's Data frames
# carry the request's id as their `seq`.
STORE_EPOCH = 1
KEY_1024 = "/".join(["é" * 127] * 4 + ["é" * 2])  # a valid store key (9.2.1) of the most bytes a key holds
assert len(KEY_1024.encode()) == 1024
STORE_V = (1, 1)  # the store's messages are 1.1's: a store connection between current peers speaks 1.1
V1_0 = (1, 0)
W_BYTES = struct.pack("<2f", 1.0, -2.0)  # f32[2] of layer0/w
W_CHECKSUM = f"{crc32c(W_BYTES):08x}"
WRITTEN = 1767225600.25  # 2026-01-01T00:00:00.25Z, seconds since the Unix epoch
PUT_W = StoreRequest(0, "put", "layer0/w", "f32", (2,), 0, len(W_BYTES))
GET_W = StoreRequest(1, "get", "layer0/w", "f32", (2,), FLAG_EXPECT_SHAPE, 0)
GET_SCALAR = StoreRequest(2, "get", "step", "", (), FLAG_EXPECT_SHAPE, 0)
KEYS_ALL = StoreRequest(3, "keys", "", "", (), 0, 0)
PUT_EMPTY = StoreRequest(4, "put", "empty", "f32", (0, 4), 0, 0)
REPLY_PUT_W = StoreReply(0, "", "", "f32", (2,), len(W_BYTES), 1, W_CHECKSUM, WRITTEN, ())
REPLY_GET_W = StoreReply(1, "", "", "f32", (2,), len(W_BYTES), 1, W_CHECKSUM, WRITTEN, ())
REPLY_KEYS = StoreReply(3, "", "", "", (), 0, 0, "", 0.0, (("layer0/b", 16), ("layer0/w", 8)))
REPLY_MISSING = StoreReply(2, "E0804", "the tensor store holds no key 'step'", "", (), 0, 0, "", 0.0, ())


def store_request_bytes(id_: int, op: bytes, key: bytes, dtype: bytes, shape: tuple[int, ...], flags: int,
                        nbytes: int) -> bytes:
    """A StoreRequest payload written field by field from the table of spec 9.1.5, with no
    check, for the invalid vectors (the message class refuses to build them)."""
    out = struct.pack("<Q", id_)
    for s in (op, key, dtype):
        out += struct.pack("<H", len(s)) + s
    out += struct.pack("<B", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
    return out + struct.pack("<BQ", flags, nbytes)


def frame(msg, *, epoch=0, stream=0, seq=0, flags=0, version=None) -> dict:
    """A frame as the vectors hold it: its bytes and the JSON it was built from; by default
    of the lowest protocol version that has its message (a 1.0 message: 1.0, which every
    1.x receiver reads)."""
    version = version or MESSAGE_SINCE.get(type(msg).TYPE, V1_0)
    data = encode_message(msg, epoch=epoch, stream=stream, seq=seq, flags=flags, version=version)
    header = FrameDecoder().feed(data)[0][0]  # length and crc as the encoder wrote them
    return {"bytes": data, "json": {"header": header_to_json(header), "message_type": type(msg).__name__,
                                    "message": msg.to_json()}}


def raw(msg_type: int, payload: bytes, *, epoch=0, stream=0, seq=0, flags=0, version=None) -> bytes:
    """A frame around any payload, with a correct CRC (for payload faults), of the lowest
    version that has its message by default."""
    version = version or MESSAGE_SINCE.get(msg_type, V1_0)
    return encode_frame(msg_type, payload, epoch=epoch, stream=stream, seq=seq, flags=flags, version=version)


def patch(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new):]


def flip(data: bytes, offset: int) -> bytes:
    return patch(data, offset, bytes([data[offset] ^ 0x01]))


# --- valid streams: name -> (what it shows, frames, decoder) -----------------------------------------

def _hello_newer_minor() -> dict:
    hello = Hello(((1, 7),), 1, L1_CAPS, 1 << 30, -1, "from the future", C_CONNECT)
    extra = bytes.fromhex("0100000000000000")  # a field 1.7 appended to Hello; 1.0 ignores it
    data = raw(MsgType.HELLO, hello.encode() + extra, version=(1, 7))
    header = FrameDecoder().feed(data)[0][0]
    return {"bytes": data, "json": {"header": header_to_json(header), "message_type": "Hello",
                                    "message": hello.to_json(), "trailing": extra.hex()}}


VALID = {
    "hello_connect": ("the connecting peer's first Hello: no answer", [frame(HELLO_C)], {}),
    "hello_accept": ("the accepting peer's Hello, answering the connecting peer's challenge", [frame(HELLO_A)], {}),
    "hello_newer_minor": ("a Hello of protocol 1.7 with a field 1.0 does not know at its end: ignored",
                          [_hello_newer_minor()], {}),
    "hello_l1_with_quant": ("a collective connection's Hello that takes compressed chunks: level L1 with CAP_QUANT "
                            "and CAP_CHECKSUMS named one by one (8.2: the level of what the connection offers)",
                            [frame(Hello(((1, 0),), 1, L1_CAPS | int(Cap.QUANT | Cap.CHECKSUMS), 1 << 30, 1,
                                         "127.0.0.1:4243", C_CONNECT))], {}),
    "hello_all_caps": ("a level-3 Hello with every capability bit and an unknown bit 63 (ignored)",
                       [frame(Hello(((1, 0),), 3, int(level_caps(3)) | 1 << 63, 1 << 16, 5, "", C_ACCEPT))], {}),
    "join_mesh": ("a rank asks to join as any rank of 4",
                  [frame(JoinMesh(-1, 4, "127.0.0.1", 29501, "node-a", 31337))], {}),
    "mesh_view": ("a 2x2 mesh (dp, tp) over two nodes, epoch 7, in a frame of epoch 7",
                  [frame(VIEW, epoch=7, seq=3)], {"expected_epoch": 6, "next_seq": {"0": 3}}),
    "mesh_view_flat": ("one rank, no axes", [frame(MeshView(1, 1, 1, (Member("::1", 1, ""),), ()), epoch=1)], {}),
    "heartbeat": ("a heartbeat with CPU, memory and bytes moved",
                  [frame(Heartbeat(3, 187.5, 512 << 20, 1 << 33, 12345, 99, "all_reduce #17 at train.py:42"),
                         epoch=7, seq=12)], {"expected_epoch": 7, "next_seq": {"0": 12}}),
    "heartbeat_workers": ("a heartbeat with the optional worker section (9.1.5): two helper workers' rows",
                          [frame(Heartbeat(3, 187.5, 512 << 20, 1 << 33, 12345, 99, "ingest: 12/50 files",
                                           (WorkerRow("ingest 1 (pid 4242)", 97.5, 3 << 20, 12, 4096, 8192, "file 12"),
                                            WorkerRow("ingest 2 (pid 4243)", 0.0, 1 << 20, 0, 0, 0, ""))),
                                 epoch=7, seq=13)], {"expected_epoch": 7, "next_seq": {"0": 13}}),
    "heartbeat_coordinator": ("the coordinator's own heartbeat to a member of a mesh past 64 members (9.6.4): "
                              "rank 4294967295, RELAYED; a member counts it as the coordinator heard",
                              [frame(Heartbeat(0xFFFFFFFF, 3.5, 60 << 20, 0, 0, 0, ""), epoch=1, seq=40,
                                     flags=FLAG_RELAYED)], {"expected_epoch": 1, "next_seq": {"0": 40}}),
    "leave": ("the worked example of spec 9.1.11", [frame(Leave(2, "done"), epoch=3, seq=5)], {"next_seq": {"0": 5}}),
    "leave_unicode": ("strings are UTF-8: a reason in Greek and an emoji",
                      [frame(Leave(0, "τέλος 🏁"), epoch=1)], {}),
    "collective_start": ("an all_reduce(sum) of f32[1024, 768] over 4 ranks", [frame(ALL_REDUCE, epoch=7, stream=2)],
                         {"expected_epoch": 7}),
    "collective_start_broadcast": ("a broadcast from root 1 of a rank-0 bf16 tensor",
                                   [frame(CollectiveStart(0, "broadcast", "", "bf16", (), (1, 3), 1, "model.py:7"),
                                          epoch=2, stream=4)], {}),
    "data": ("the last chunk of a collective: 4 bf16 values", [frame(Data(17, 3, 1, 24, BF16_BYTES), epoch=7,
                                                                     stream=2, flags=FLAG_LAST)], {}),
    "data_relayed": ("the same chunk as `data`, forwarded by a relay: RELAYED set, another seq, the same crc",
                     [frame(Data(17, 3, 1, 24, BF16_BYTES), epoch=7, stream=2, flags=FLAG_LAST | FLAG_RELAYED)], {}),
    "data_compressed_q8_0": ("a compressed chunk (spec 9.5.1) of a compressed all_reduce: COMPRESSED and LAST set; "
                             "head (encoding 1 = q8_0, count 40), then 2 q8_0 blocks of 34 bytes (f16 scale, 32 int8) "
                             "holding 0, 1, ..., 39 and 24 zeros",
                             [frame(Data(17, 0, 0, 0, Q8_CHUNK), epoch=7, stream=2, flags=FLAG_LAST | FLAG_COMPRESSED)],
                             {}),
    "data_compressed_empty": ("a compressed chunk of count 0 (an empty chunk of an uneven split, 9.5.1): the "
                              "head alone, no body", [frame(Data(17, 2, 0, 0, struct.pack("<BBHI", 1, 0, 0, 0)),
                                                            epoch=7, stream=2, flags=FLAG_COMPRESSED)], {}),
    "data_compressed_padding_ignored": ("data_compressed_q8_0 with its last block's 24 values past count 40 not 0: "
                                        "a receiver ignores them (a sender writes 0, 9.5.1)",
                                        [frame(Data(17, 0, 0, 0, Q8_CHUNK[:-24] + bytes([5] * 24)), epoch=7,
                                               stream=2, flags=FLAG_LAST | FLAG_COMPRESSED)], {}),
    "data_compressed_bf16": ("a compressed chunk (spec 9.5.1): head (encoding 2 = bf16, count 4), then the 4 bf16 "
                             "values of `data`", [frame(Data(17, 1, 0, 0, BF16_CHUNK), epoch=7, stream=2,
                                                        flags=FLAG_COMPRESSED)], {}),
    "data_empty": ("a chunk of zero bytes (a tensor with a zero dim)", [frame(Data(0, 0, 0, 0, b""), stream=1,
                                                                              flags=FLAG_LAST)], {}),
    "p2p_send": ("a point-to-point send of i32[3] split over two Data frames on stream 9",
                 [frame(P2PSend(0, -7, "i32", (3,), "pipe.py:11"), epoch=1, stream=9),
                  frame(Data(0, 0, 0, 0, struct.pack("<2i", 1, -1)), epoch=1, stream=9, seq=1),
                  frame(Data(0, 1, 0, 8, struct.pack("<i", 2 ** 31 - 1)), epoch=1, stream=9, seq=2,
                        flags=FLAG_LAST)], {}),
    "p2p_send_crc": ("the send of `p2p_send` to a peer that announced CAP_CHECKSUMS: the P2PSend's optional crc "
                     "section (9.1.5) holds the CRC32C of the tensor's 12 bytes, which the receiver checks once "
                     "both Data frames landed (9.4.9)",
                     [frame(P2PSend(0, -7, "i32", (3,), "pipe.py:11", crc32c(struct.pack("<3i", 1, -1, 2 ** 31 - 1))),
                            epoch=1, stream=9),
                      frame(Data(0, 0, 0, 0, struct.pack("<2i", 1, -1)), epoch=1, stream=9, seq=1),
                      frame(Data(0, 1, 0, 8, struct.pack("<i", 2 ** 31 - 1)), epoch=1, stream=9, seq=2,
                            flags=FLAG_LAST)], {}),
    "error": ("an Error naming a code and the reporting rank",
              [frame(Error("E0803", "rank 1 called all_gather #3 at b.py:9; rank 0 called all_reduce #3 at a.py:5", 0),
                     epoch=2)], {}),
    "cancel": ("cancel collective 17", [frame(Cancel(17, "user interrupt"), epoch=7, stream=2)], {}),
    "streams_interleaved": ("frames of two streams interleaved: each stream counts its own seq",
                            [frame(HELLO_C, seq=0), frame(Leave(1, "a"), stream=3, seq=0, epoch=1),
                             frame(Cancel(1, ""), seq=1, epoch=1), frame(Leave(1, "b"), stream=3, seq=1, epoch=1)],
                            {}),
    "newer_epoch": ("a frame of a newer epoch than the receiver's is accepted", [frame(Leave(1, ""), epoch=9)],
                    {"expected_epoch": 8}),
    "exempt_from_epoch": ("Hello, JoinMesh and Error of epoch 0 reach a receiver at epoch 5",
                          [frame(HELLO_C), frame(JoinMesh(1, 2, "h", 1, "n", 1), seq=1),
                           frame(Error("E0909", "bad token"), seq=2)], {"expected_epoch": 5}),
    "resize_rejoin": ("live resize (9.6.7): rank 2 of the mesh of epoch 3 rejoins, sending JoinMesh again on its "
                      "control connection, in a frame of epoch 3: its new data address, its current rank, world "
                      "size 0", [frame(RESIZE_REJOIN, epoch=3, seq=9)], {"expected_epoch": 3, "next_seq": {"0": 9}}),
    "resize_notice_and_view": ("live resize (9.6.7), what rank 1 of a dp=2,tp=2 mesh of epoch 3 hears: the loss "
                               "of rank 3 (E1001), the resize notice (E1009, rank -1, which closes nothing), then, "
                               "once every survivor rejoined, the view of epoch 4 (dp=1, tp=2) in a frame of "
                               "epoch 4, newer than the receiver's",
                               [frame(RESIZE_LOST, epoch=3, seq=20), frame(RESIZE_NOTICE, epoch=3, seq=21),
                                frame(RESIZE_VIEW, epoch=4, seq=22)], {"expected_epoch": 3, "next_seq": {"0": 20}}),
    "resize_spare": ("live resize (9.6.7), what rank 2 of the same mesh hears: the loss, the notice, then E1004 "
                     "(the view of epoch 4 has no place for it), after which the coordinator closes the connection",
                     [frame(RESIZE_LOST, epoch=3, seq=20), frame(RESIZE_NOTICE, epoch=3, seq=21),
                      frame(RESIZE_SPARE, epoch=3, seq=22)], {"expected_epoch": 3, "next_seq": {"0": 20}}),
    "succession_rejoin": ("succession (9.6.7): the coordinator of epoch 3 is lost; rank 2 connects to the "
                          "successor, and after the handshake (its Hello, seq 0) sends JoinMesh on the new "
                          "connection in a frame of epoch 3 (the epoch it leaves; JoinMesh is exempt from the "
                          "epoch check) and seq 1: its new data address, its rank of epoch 3, world size 0",
                          [frame(HELLO_C), frame(RESIZE_REJOIN, epoch=3, seq=1)], {}),
    "empty_stream": ("no bytes: no frames, and no error", [], {}),
    "large_u64": ("u64 fields past 2^53 (seq, epoch, offset), written in the JSON as decimal strings",
                  [frame(Cancel(2 ** 64 - 1, "x"), epoch=2 ** 53 + 1, stream=7, seq=2 ** 60),
                   frame(Data(2 ** 63, 0, 0, 2 ** 62 + 3, b"\x01"), epoch=2 ** 53 + 1, stream=7, seq=2 ** 60 + 1,
                         flags=FLAG_LAST)], {"expected_epoch": 2 ** 53 + 1, "next_seq": {"7": 2 ** 60}}),
    "mesh_view_empty_host": ("a MeshView member's host may be empty (9.1.5)",
                             [frame(MeshView(1, 1, 1, (Member("", 1, "n"), Member("h", 2, "n")), ()), epoch=1)], {}),
    "mesh_view_keeps_the_decoder_epoch": (
        "decoding a MeshView of epoch 6 does not raise the decoder's epoch of 5: a Leave of epoch 5 after it is "
        "decoded (the rank raises its epoch when it accepts the view, 9.1.7)",
        [frame(MeshView(6, 1, 1, (Member("h", 1, "n"),), ()), epoch=6), frame(Leave(0, ""), epoch=5, seq=1)],
        {"expected_epoch": 5}),
    "store_put": ("the mesh store's put of f32[2] under layer0/w, the client's first request after the handshake "
                  "(its Hellos took seq 0 and 1), then the tensor's 8 bytes in one Data frame whose seq is the "
                  "request's id (9.2.11)",
                  [frame(PUT_W, epoch=STORE_EPOCH, seq=2),
                   frame(Data(PUT_W.id, 0, 0, 0, W_BYTES), epoch=STORE_EPOCH, seq=3, version=STORE_V)],
                  {"expected_epoch": STORE_EPOCH, "next_seq": {"0": 2}}),
    "store_put_empty": ("a put of f32[0, 4]: nbytes 0, and no Data frame follows (9.2.11)",
                        [frame(PUT_EMPTY, epoch=STORE_EPOCH, seq=7)],
                        {"expected_epoch": STORE_EPOCH, "next_seq": {"0": 7}}),
    "store_get_expected_shape": ("two gets: layer0/w expected as f32[2] (flags bit 0 with a shape), then step "
                                 "expected as a scalar of any dtype (bit 0 with no dims and no dtype)",
                                 [frame(GET_W, epoch=STORE_EPOCH, seq=4), frame(GET_SCALAR, epoch=STORE_EPOCH, seq=5)],
                                 {"expected_epoch": STORE_EPOCH, "next_seq": {"0": 4}}),
    "store_keys_request": ("a keys request for every key: the empty prefix (only a keys request may name an "
                           "empty key)", [frame(KEYS_ALL, epoch=STORE_EPOCH, seq=6)],
                           {"expected_epoch": STORE_EPOCH, "next_seq": {"0": 6}}),
    "store_key_1024_bytes": ("a get whose key is 1024 UTF-8 bytes, the most a key holds, in segments of at most "
                             "255 bytes (9.2.1): four of 127 two-byte characters and one of 2, joined by /",
                             [frame(StoreRequest(5, "get", KEY_1024, "", (), 0, 0), epoch=STORE_EPOCH, seq=8)],
                             {"expected_epoch": STORE_EPOCH, "next_seq": {"0": 8}}),
    "store_info_with_dtype": ("an info request that names a dtype, which info ignores (9.1.5: only put and get read "
                              "it; it must still name a dtype)",
                              [frame(StoreRequest(6, "info", "layer0/w", "f32", (), 0, 0), epoch=STORE_EPOCH, seq=9)],
                              {"expected_epoch": STORE_EPOCH, "next_seq": {"0": 9}}),
    "store_reply_put": ("the service's reply to the put of store_put: the stored entry, version 1, its checksum "
                        "(the CRC32C of its bytes) and time written", [frame(REPLY_PUT_W, epoch=STORE_EPOCH, seq=1)],
                        {"expected_epoch": STORE_EPOCH, "next_seq": {"0": 1}}),
    "store_reply_get": ("the reply to the get of layer0/w, then the tensor's bytes in one Data frame whose seq is "
                        "the request's id",
                        [frame(REPLY_GET_W, epoch=STORE_EPOCH, seq=2),
                         frame(Data(REPLY_GET_W.id, 0, 0, 0, W_BYTES), epoch=STORE_EPOCH, seq=3, version=STORE_V)],
                        {"expected_epoch": STORE_EPOCH, "next_seq": {"0": 2}}),
    "store_reply_keys": ("the reply to a keys request: two keys with their stored bytes",
                         [frame(REPLY_KEYS, epoch=STORE_EPOCH, seq=5)],
                         {"expected_epoch": STORE_EPOCH, "next_seq": {"0": 5}}),
    "store_reply_error": ("an error reply: the get of step found no key (E0804); no Data frame follows, and the "
                          "connection goes on", [frame(REPLY_MISSING, epoch=STORE_EPOCH, seq=4)],
                          {"expected_epoch": STORE_EPOCH, "next_seq": {"0": 4}}),
    "quantized_dtypes": ("CollectiveStart and P2PSend may name quantized dtypes; the codec does not check 2.2's "
                         "block rule (9.1.5)",
                         [frame(CollectiveStart(0, "all_gather", "", "q8_0", (4, 64), (0, 1), -1, "q.py:1"),
                                epoch=1, stream=3),
                          frame(P2PSend(0, 1, "q4_0", (3,), "q.py:2"), epoch=1, stream=3, seq=1)], {}),
}


# --- invalid streams: name -> (what it shows, bytes, decoder, the code it must raise) -------------------

LEAVE = frame(Leave(2, "done"), epoch=3, seq=5)["bytes"]
HB = frame(Heartbeat(1, 0.0, 0, 0, 0, 0, ""), epoch=2)["bytes"]


def _payload(msg) -> bytes:
    return msg.encode()


# the group count follows seq (8), op (2 + 10), reduce_op (2 + 3), dtype (2 + 3) and the shape (1 + 2 * 8)
GROUP_COUNT_AT = 8 + 12 + 5 + 5 + 17
GROUP_COUNT_TOO_BIG = patch(_payload(ALL_REDUCE), GROUP_COUNT_AT, b"\xff" * 4)
MEMBERS_PAST_THE_END = patch(_payload(VIEW), 16, struct.pack("<I", 1000))  # the count follows 8 + 4 + 4 bytes
# the keys count follows id (8), code, message, dtype (2 each, empty), the shape (1), nbytes
# and version (8 each), checksum (2) and written (8)
KEYS_COUNT_AT = 8 + 2 + 2 + 2 + 1 + 8 + 8 + 2 + 8
# in the put's reply, written follows id (8), code and message (2 each, empty), dtype (2 + 3),
# the shape (1 + 8), nbytes and version (8 each) and checksum (2 + 8)
WRITTEN_AT = 8 + 2 + 2 + 5 + 9 + 8 + 8 + 10
assert struct.unpack_from("<d", _payload(REPLY_PUT_W), WRITTEN_AT)[0] == WRITTEN
assert struct.unpack_from("<I", _payload(REPLY_KEYS), KEYS_COUNT_AT)[0] == 2
KEYS_PAST_THE_END = patch(_payload(REPLY_KEYS), KEYS_COUNT_AT, struct.pack("<I", 1000))
STALE_HB = frame(Heartbeat(1, 0.0, 0, 0, 0, 0, ""), epoch=2, seq=3)["bytes"]


INVALID = {
    "bad_magic": ("magic DTMX instead of DTMW", patch(LEAVE, 3, b"X"), {}, "E0901"),
    "http_request": ("someone speaks HTTP to a DTM port",
                     b"GET / HTTP/1.1\r\nHost: 127.0.0.1:29500\r\nAccept: */*\r\n\r\n", {}, "E0901"),
    "ir_module_magic": ("the canonical encoding of a module (magic DTMIR) instead of a frame",
                        b"DTMIR\x01" + bytes(40), {}, "E0901"),
    "newer_major": ("a frame of protocol 2.0", raw(MsgType.LEAVE, _payload(Leave(2, "done")), version=(2, 0)), {},
                    "E0902"),
    "older_major": ("a frame of protocol 0.9", raw(MsgType.LEAVE, _payload(Leave(2, "done")), version=(0, 9)), {},
                    "E0902"),
    "unknown_type_0": ("message type 0", raw(0, b""), {}, "E0903"),
    "unknown_type_13": ("message type 13, one past StoreReply", raw(13, b""), {}, "E0903"),
    "unknown_type_255": ("message type 255", raw(255, b"\x00" * 4), {}, "E0903"),
    "oversized_length": ("length 2^40, far above the default limit of 2^30; no payload follows",
                         patch(LEAVE[:40], 16, struct.pack("<Q", 1 << 40)), {}, "E0904"),
    "length_max_u64": ("length 2^64 - 1", patch(LEAVE[:40], 16, b"\xff" * 8), {}, "E0904"),
    "over_announced_limit": ("a 65537-byte payload to a receiver that accepts 65536",
                             raw(MsgType.LEAVE, struct.pack("<IH", 1, 65531) + b"x" * 65531), {"max_payload": 65536},
                             "E0904"),
    "truncated_header": ("the stream ends after 20 header bytes", LEAVE[:20], {}, "E0905"),
    "truncated_payload": ("the stream ends 3 bytes before the payload's end", LEAVE[:-3], {}, "E0905"),
    "truncated_second_frame": ("a whole frame, then 39 bytes of the next header",
                               frame(Leave(2, "done"))["bytes"] + HB[:39], {}, "E0905"),
    "crc_payload_byte": ("one payload bit flipped", flip(LEAVE, 45), {}, "E0906"),
    "crc_epoch_byte": ("one bit of the epoch flipped (covered by the crc)", flip(LEAVE, 8), {}, "E0906"),
    "crc_stream_byte": ("one bit of the stream flipped", flip(LEAVE, 24), {}, "E0906"),
    "crc_last_flag": ("the end-to-end LAST flag set in transit", patch(LEAVE, 7, bytes([FLAG_LAST])), {}, "E0906"),
    "crc_field": ("one bit of the crc itself flipped", flip(LEAVE, 28), {}, "E0906"),
    "crc_version_minor": ("minor 1 where the frame was made with 0: the version is covered",
                          patch(LEAVE, 5, b"\x01"), {}, "E0906"),
    "stale_epoch": ("a heartbeat of epoch 2 reaches a receiver at epoch 3", HB, {"expected_epoch": 3}, "E0907"),
    "stale_mesh_view": ("a MeshView of epoch 7 reaches a receiver at epoch 8", frame(VIEW, epoch=7)["bytes"],
                        {"expected_epoch": 8}, "E0907"),
    "first_seq_not_zero": ("the first frame of stream 0 has seq 5", LEAVE, {}, "E0908"),
    "stale_frame_seq_checked": ("a stale heartbeat with seq 3 where 0 is due: its seq is checked (9.1.7)", STALE_HB,
                                {"expected_epoch": 3}, "E0908"),
    "stale_frame_seq_counted": ("a stale heartbeat (seq 0), then a Leave of the current epoch with seq 0 again: the "
                                "stale frame took seq 0 (9.1.7)",
                                frame(Heartbeat(1, 0.0, 0, 0, 0, 0, ""), epoch=2)["bytes"]
                                + frame(Leave(1, ""), epoch=3)["bytes"], {"expected_epoch": 3}, "E0908"),
    "seq_gap": ("seq 0 then seq 2 on stream 0", frame(Leave(1, ""))["bytes"] + frame(Leave(1, ""), seq=2)["bytes"],
                {}, "E0908"),
    "seq_repeated": ("seq 0 twice on stream 4", frame(Cancel(1, ""), stream=4)["bytes"] * 2, {}, "E0908"),
    "payload_truncated": ("a Leave whose string runs past the payload's end",
                          raw(MsgType.LEAVE, struct.pack("<IH", 2, 10) + b"done"), {}, "E0910"),
    "payload_trailing_bytes": ("a Leave of protocol 1.0 with a byte after its last field",
                               raw(MsgType.LEAVE, _payload(Leave(2, "done")) + b"\x00"), {}, "E0910"),
    "hello_trailing_same_minor": ("a Hello of protocol 1.0 with bytes after its last field: only newer minors "
                                  "may add fields", raw(MsgType.HELLO, _payload(HELLO_C) + b"\x00\x00"), {}, "E0910"),
    "payload_invalid_utf8": ("a Leave reason holding the byte ff",
                             raw(MsgType.LEAVE, struct.pack("<IH", 2, 3) + b"a\xffb"), {}, "E0910"),
    "hello_level_without_its_caps": ("a Hello of level L1 whose caps lack CAP_P2P",
                                     raw(MsgType.HELLO, patch(_payload(HELLO_C), 4, struct.pack(
                                         "<Q", L1_CAPS & ~int(Cap.P2P)))), {}, "E0910"),
    "hello_l2_without_quant": ("a Hello of level L2 whose caps lack CAP_QUANT: L2 implies it, so a peer that takes "
                               "no compressed chunks announces L1 with the capabilities it has (8.2)",
                               raw(MsgType.HELLO, patch(_payload(HELLO_C), 3, struct.pack(
                                   "<BQ", 2, int(level_caps(2)) & ~int(Cap.QUANT)))), {}, "E0910"),
    "hello_answer_length": ("a Hello whose answer is 31 bytes",
                            raw(MsgType.HELLO, _payload(HELLO_C)[:-1] + b"\x1f" + b"\x00" * 31), {}, "E0910"),
    "collective_unknown_dtype": ("a CollectiveStart of dtype f33",
                                 raw(MsgType.COLLECTIVE_START, _payload(ALL_REDUCE).replace(b"\x03\x00f32",
                                                                                            b"\x03\x00f33")),
                                 {}, "E0910"),
    "collective_unknown_op": ("a CollectiveStart of op all_reduse",
                              raw(MsgType.COLLECTIVE_START, _payload(ALL_REDUCE).replace(b"all_reduce",
                                                                                         b"all_reduse")), {},
                              "E0910"),
    "collective_group_count_too_big": (f"a group count of 2^32 - 1 in a {len(GROUP_COUNT_TOO_BIG)}-byte payload",
                                       raw(MsgType.COLLECTIVE_START, GROUP_COUNT_TOO_BIG), {}, "E0910"),
    "mesh_view_axes_product": ("axes 2x3 over 4 members",
                               raw(MsgType.MESH_VIEW, _payload(VIEW)[:-4] + struct.pack("<I", 3), epoch=7), {},
                               "E0910"),
    "mesh_view_members_past_the_end": (f"a member count of 1000 in a {len(MEMBERS_PAST_THE_END)}-byte payload, "
                                       "under the limit of 2^20 but more than the bytes left can hold",
                                       raw(MsgType.MESH_VIEW, MEMBERS_PAST_THE_END, epoch=7), {}, "E0910"),
    "mesh_view_epoch_differs": ("a MeshView of epoch 7 in a frame of epoch 6", raw(MsgType.MESH_VIEW, _payload(VIEW),
                                                                                   epoch=6), {}, "E0910"),
    "data_compressed_blocks_disagree": ("a compressed Data frame whose head says 64 q8_0 values (2 blocks, 68 "
                                        "bytes) but which holds one block (34 bytes)",
                                        raw(MsgType.DATA, _payload(Data(1, 0, 0, 0, struct.pack("<BBHI", 1, 0, 0, 64)
                                                                        + Q8_CHUNK[8:42])), flags=FLAG_COMPRESSED),
                                        {}, "E0910"),
    "data_compressed_unknown_encoding": ("a compressed Data frame of encoding 3",
                                         raw(MsgType.DATA, _payload(Data(1, 0, 0, 0, struct.pack("<BBHI", 3, 0, 0, 4)
                                                                         + BF16_BYTES)), flags=FLAG_COMPRESSED),
                                         {}, "E0910"),
    "compressed_flag_on_leave": ("a Leave frame with the COMPRESSED flag: only a Data frame carries a compressed "
                                 "chunk (9.5.1)", raw(MsgType.LEAVE, _payload(Leave(2, "done")), flags=FLAG_COMPRESSED),
                                 {}, "E0910"),
    "data_compressed_short": ("a compressed Data frame of 5 data bytes, shorter than the 8-byte chunk head",
                              raw(MsgType.DATA, _payload(Data(1, 0, 0, 0, b"\x01\x00\x00\x00\x00")),
                                  flags=FLAG_COMPRESSED), {}, "E0910"),
    "data_nbytes_mismatch": ("a Data chunk header saying 9 bytes before 8",
                             raw(MsgType.DATA, patch(_payload(Data(1, 0, 0, 0, BF16_BYTES)), 24,
                                                     struct.pack("<Q", 9))), {}, "E0910"),
    "p2p_send_crc_short": ("a P2PSend whose optional crc section is 3 bytes, not 4",
                           raw(MsgType.P2P_SEND, _payload(P2PSend(0, 0, "f32", (2,), "a.py:1")) + b"\x01\x02\x03"), {},
                           "E0910"),
    "heartbeat_nan_cpu": ("a Heartbeat whose cpu_percent is NaN",
                          raw(MsgType.HEARTBEAT, patch(_payload(Heartbeat(1, 0.0, 0, 0, 0, 0, "")), 4,
                                                       struct.pack("<d", float("nan")))), {}, "E0910"),
    "hello_rank_below_minus_one": ("a Hello of rank -2", raw(MsgType.HELLO, patch(_payload(HELLO_C), 20, struct.pack(
        "<i", -2))), {}, "E0910"),
    "join_mesh_rank_below_minus_one": ("a JoinMesh asking for rank -2", raw(MsgType.JOIN_MESH, patch(_payload(
        JoinMesh(-1, 4, "h", 1, "n", 1)), 0, struct.pack("<i", -2))), {}, "E0910"),
    "join_mesh_empty_host": ("a JoinMesh with an empty host (a MeshView member's host may be empty, not this one)",
                             raw(MsgType.JOIN_MESH, struct.pack("<iIH", -1, 4, 0) + _payload(
                                 JoinMesh(-1, 4, "h", 1, "n", 1))[11:]), {}, "E0910"),
    "error_rank_below_minus_one": ("an Error from rank -2", raw(MsgType.ERROR, _payload(Error("E0001", ""))[:-4]
                                                                 + struct.pack("<i", -2)), {}, "E0910"),
    "store_request_of_1_0": ("a StoreRequest in a frame of protocol 1.0, which has no such message (added in 1.1; "
                             "its type is checked before its CRC, 9.1.3)",
                             patch(raw(MsgType.STORE_REQUEST, store_request_bytes(0, b"get", b"layer0/w", b"", (), 0,
                                                                                  0)), 5, b"\x00"), {}, "E0903"),
    "store_unknown_op": ("a StoreRequest of op move (9.1.5: get, put, info, keys or delete)",
                         raw(MsgType.STORE_REQUEST, store_request_bytes(0, b"move", b"layer0/w", b"", (), 0, 0)), {},
                         "E0910"),
    "store_key_1025_bytes": ("a StoreRequest whose key is a and 512 two-byte characters: 1025 UTF-8 bytes",
                             raw(MsgType.STORE_REQUEST, store_request_bytes(0, b"get", ("a" + "é" * 512).encode(), b"",
                                                                            (), 0, 0)), {}, "E0910"),
    "store_empty_key": ("a get of the empty key (only keys may name one)",
                        raw(MsgType.STORE_REQUEST, store_request_bytes(0, b"get", b"", b"", (), 0, 0)), {}, "E0910"),
    "store_shape_without_flag": ("a get that names the shape [2] without flags bit 0",
                                 raw(MsgType.STORE_REQUEST, store_request_bytes(0, b"get", b"layer0/w", b"f32", (2,),
                                                                                0, 0)), {}, "E0910"),
    "store_unknown_flag_bit": ("a get with flags 0x03: bit 1 is no flag of version 1.0",
                               raw(MsgType.STORE_REQUEST, store_request_bytes(0, b"get", b"layer0/w", b"f32", (2,),
                                                                              0x03, 0)), {}, "E0910"),
    "store_nbytes_on_a_get": ("a get that announces nbytes 8 (only a put carries bytes)",
                              raw(MsgType.STORE_REQUEST, store_request_bytes(0, b"get", b"layer0/w", b"", (), 0, 8)),
                              {}, "E0910"),
    "store_put_without_dtype": ("a put of [2] that names no dtype",
                                raw(MsgType.STORE_REQUEST, store_request_bytes(0, b"put", b"layer0/w", b"", (2,), 0,
                                                                               8)), {}, "E0910"),
    "store_reply_keys_past_the_end": (f"a StoreReply keys count of 1000 in a {len(KEYS_PAST_THE_END)}-byte payload, "
                                      "under the limit of 2^20 but more than the bytes left can hold",
                                      raw(MsgType.STORE_REPLY, KEYS_PAST_THE_END), {}, "E0910"),
    "store_reply_bad_code": ("a StoreReply whose code is E804 (a code is E and four digits, or empty)",
                             raw(MsgType.STORE_REPLY, _payload(REPLY_MISSING).replace(b"\x05\x00E0804",
                                                                                      b"\x04\x00E804")), {}, "E0910"),
    "store_reply_error_with_tensor": ("an error reply (E0804) that also names a dtype and nbytes: an error reply "
                                      "carries no tensor (9.1.5)",
                                      raw(MsgType.STORE_REPLY, _payload(REPLY_PUT_W).replace(
                                          b"\x00\x00\x00\x00\x03\x00f32", b"\x05\x00E0804\x00\x00\x03\x00f32", 1)), {}, "E0910"),
    "store_reply_written_inf": ("a StoreReply whose written time is +inf",
                                raw(MsgType.STORE_REPLY, patch(_payload(REPLY_PUT_W), WRITTEN_AT,
                                                               struct.pack("<d", float("inf")))), {}, "E0910"),
    "error_bad_code": ("an Error whose code is X0001", raw(MsgType.ERROR, _payload(Error("E0001", "")).replace(
        b"E0001", b"X0001")), {}, "E0910"),
}


# --- the handshake ---------------------------------------------------------------------------------------

def _params(h: Hello) -> dict:
    j = h.to_json()
    del j["answer"]
    return j


def _three_hellos(connect_versions=((1, 0),)) -> tuple[Handshake, Handshake, list[bytes]]:
    """Both sides of a whole handshake, and the three Hello frames they send."""
    hs_c = Handshake("connect", TOKEN, level=1, caps=L1_CAPS, rank=-1, name="127.0.0.1:4242", max_payload=1 << 30,
                     challenge=C_CONNECT, versions=connect_versions)
    hs_a = Handshake("accept", TOKEN, level=1, caps=L1_CAPS, rank=0, name="coordinator", max_payload=1 << 26,
                     challenge=C_ACCEPT, versions=(V1_0,))  # (a 1.0 accepting peer: the transcripts of 1.0)
    to_a, to_c = FrameDecoder(check_seq=True), FrameDecoder(check_seq=True)
    f1 = hs_c.start()[0]
    f2 = hs_a.receive(*to_a.feed(f1)[0])[0]
    f3 = hs_c.receive(*to_c.feed(f2)[0])[0]
    hs_a.receive(*to_a.feed(f3)[0])
    assert hs_a.done and hs_c.done
    return hs_c, hs_a, [f1, f2, f3]


def _handshake_doc() -> dict:
    other_token = b"another-token"
    hs_c, hs_a, (f1, f2, f3) = _three_hellos()
    # a connecting peer of 1.3 meets one of 1.0: they negotiate 1.0, yet its third Hello, like
    # its first, is a frame of 1.3, the highest version of its lowest major (9.1.6)
    newer_c, newer_a, newer_frames = _three_hellos(((1, 3),))
    assert FrameDecoder().feed(newer_frames[2])[0][0].version == (1, 3)
    wrong = hmac_answer(other_token, C_ACCEPT, responder_challenge=C_CONNECT, role="connect")
    hello_c_wrong = Hello(HELLO_C.versions, HELLO_C.level, HELLO_C.caps, HELLO_C.max_payload, HELLO_C.rank,
                          HELLO_C.name, C_CONNECT, wrong)
    hello_c_answered_early = Hello(HELLO_C.versions, HELLO_C.level, HELLO_C.caps, HELLO_C.max_payload, HELLO_C.rank,
                                   HELLO_C.name, C_CONNECT, bytes(32))
    accepting = {"role": "accept", "token": TOKEN.hex(), "params": _params(hs_a.hello)}
    right = hmac_answer(TOKEN, C_CONNECT, responder_challenge=C_ACCEPT, role="accept")
    return {
        "hmac": [
            {"name": "accept", "token": TOKEN.hex(), "challenge": C_CONNECT.hex(),
             "responder_challenge": C_ACCEPT.hex(), "role": "accept", "answer": right.hex()},
            {"name": "connect", "token": TOKEN.hex(), "challenge": C_ACCEPT.hex(),
             "responder_challenge": C_CONNECT.hex(), "role": "connect",
             "answer": hmac_answer(TOKEN, C_ACCEPT, responder_challenge=C_CONNECT, role="connect").hex()},
            {"name": "empty_token", "token": "", "challenge": C_CONNECT.hex(), "responder_challenge": C_ACCEPT.hex(),
             "role": "accept", "answer": hmac_answer(b"", C_CONNECT, responder_challenge=C_ACCEPT,
                                                     role="accept").hex()},
            {"name": "wrong_token", "token": other_token.hex(), "challenge": C_CONNECT.hex(),
             "responder_challenge": C_ACCEPT.hex(), "role": "accept", "answer": right.hex(), "code": "E0909"},
            {"name": "reflected_role", "token": TOKEN.hex(), "challenge": C_CONNECT.hex(),
             "responder_challenge": C_ACCEPT.hex(), "role": "connect", "answer": right.hex(), "code": "E0909"},
        ],
        "negotiate": [
            {"name": "same", "ours": [[1, 0]], "theirs": [[1, 0]], "result": [1, 0]},
            {"name": "older_minor_wins", "ours": [[1, 0]], "theirs": [[1, 3]], "result": [1, 0]},
            {"name": "highest_major", "ours": [[1, 4], [2, 1]], "theirs": [[2, 3], [1, 2]], "result": [2, 1]},
            {"name": "only_common_major", "ours": [[1, 2], [3, 0]], "theirs": [[1, 5], [2, 0]], "result": [1, 2]},
            {"name": "none_in_common", "ours": [[1, 0]], "theirs": [[2, 0], [3, 1]], "code": "E0902"},
        ],
        "transcripts": [
            {"name": "three_hellos", "token": TOKEN.hex(), "connect": _params(hs_c.hello),
             "accept": _params(hs_a.hello), "version": [1, 0], "frames": [fmt(f) for f in (f1, f2, f3)]},
            {"name": "third_hello_keeps_the_first_version", "token": TOKEN.hex(), "connect": _params(newer_c.hello),
             "accept": _params(newer_a.hello), "version": [1, 0], "frames": [fmt(f) for f in newer_frames]},
        ],
        "refusals": [
            {**accepting, "name": "wrong_token",
             "receive": [fmt(f1), fmt(encode_message(hello_c_wrong, epoch=0, stream=0, seq=1, version=V1_0))],
             "code": "E0909"},
            {**accepting, "name": "no_answer",
             "receive": [fmt(f1), fmt(encode_message(HELLO_C, epoch=0, stream=0, seq=1, version=V1_0))],
             "code": "E0909"},
            {**accepting, "name": "answer_before_challenge",
             "receive": [fmt(encode_message(hello_c_answered_early, epoch=0, stream=0, seq=0, version=V1_0))],
             "code": "E0911"},
            {**accepting, "name": "data_before_hello",
             "receive": [fmt(encode_message(Heartbeat(1, 0.0, 0, 0, 0, 0, ""), epoch=0, stream=0, seq=0,
                                            version=V1_0))],
             "code": "E0911"},
            {**accepting, "name": "no_common_version", "params": {**_params(hs_a.hello), "versions": [[2, 0]]},
             "receive": [fmt(f1)], "code": "E0902"},
            {"role": "connect", "token": TOKEN.hex(), "params": _params(hs_c.hello), "name": "accepting_peer_refuses",
             "receive": [fmt(encode_message(Error("E0902", "no protocol version in common"), epoch=0, stream=0,
                                            seq=0, version=V1_0))], "code": "E0902"},
        ],
    }


def fmt(data: bytes) -> str:
    """Hex with a space between header fields and before the payload, for people reading it."""
    if len(data) < 40:
        return data.hex()
    cuts = [0, 4, 5, 6, 7, 8, 16, 24, 28, 32, 40, len(data)]
    return " ".join(data[a:b].hex() for a, b in zip(cuts, cuts[1:]) if b > a)


def build() -> dict[str, str]:
    """Every file this script writes: relative path -> text."""
    files: dict[str, str] = {}
    manifest = {"spec_version": ".".join(map(str, SPEC_VERSION)),
                "protocol_version": ".".join(map(str, PROTOCOL_VERSION)),
                "crc32c": [{"name": "check_123456789", "hex": b"123456789".hex(), "crc": "e3069283"},
                           {"name": "empty", "hex": "", "crc": "00000000"},
                           {"name": "32_zero_bytes", "hex": "00" * 32, "crc": "8a9136aa"},
                           {"name": "32_ff_bytes", "hex": "ff" * 32, "crc": "62a8ab43"},
                           {"name": "0_to_31", "hex": bytes(range(32)).hex(), "crc": "46dd794e"}],
                "valid": {}, "invalid": {}}
    for name, (about, frames, decoder) in VALID.items():
        files[f"valid/{name}.json"] = _json({"hex": [fmt(f["bytes"]) for f in frames], "decoder": _decoder(decoder),
                                             "frames": [f["json"] for f in frames]})
        manifest["valid"][name] = {"about": about, "frames": len(frames)}
    for name, (about, data, decoder, code) in INVALID.items():
        files[f"invalid/{name}.json"] = _json({"hex": [fmt(data)] if data[:4] == b"DTMW" else [data.hex()],
                                               "decoder": _decoder(decoder)})
        manifest["invalid"][name] = {"about": about, "code": code}
    files["handshake.json"] = _json(_handshake_doc())
    files["manifest.json"] = _json(manifest)
    return files


def _decoder(decoder: dict) -> dict:
    """A decoder's settings as the vectors hold them: integers past 2^53 as decimal strings."""
    return {k: {s: int_to_json(n) for s, n in v.items()} if k == "next_seq" else int_to_json(v)
            for k, v in decoder.items()}


def _json(obj) -> str:
    """Indented JSON, with lists of numbers (versions, shapes, groups) kept on one line."""
    text = json.dumps(obj, indent=1, ensure_ascii=False)
    return re.sub(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]", lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(","))
                  + "]", text) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if anything would change")
    ap.add_argument("--root", type=pathlib.Path, default=ROOT, help="the conformance/protocol folder")
    args = ap.parse_args(argv)
    files = build()
    drift = [p for p, text in files.items()
             if not (args.root / p).exists() or (args.root / p).read_text(encoding="utf-8") != text]
    stale = [str(p.relative_to(args.root)) for kind in ("valid", "invalid") for p in (args.root / kind).glob("*.json")
             if str(p.relative_to(args.root)) not in files]
    if not args.check:
        for p in drift:
            (args.root / p).parent.mkdir(parents=True, exist_ok=True)
            (args.root / p).write_text(files[p], encoding="utf-8")
        for p in stale:
            (args.root / p).unlink()
    for p in drift + stale:
        print(("differs: " if args.check else "wrote: " if p in files else "removed: ") + p)
    results = run_protocol_vectors(args.root) if not args.check else []
    if results:
        print(summary(results))
    return 1 if (args.check and (drift or stale)) or any(not r.ok for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
