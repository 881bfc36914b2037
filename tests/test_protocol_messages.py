"""Message payloads (spec 9.1.5): every message round-trips through bytes and JSON, a few are
read field by field with `struct` exactly as the spec's tables lay them out, and no prefix,
extension or random corruption of a payload gets past the decoder as anything but E0910."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtm.errors import ErrorCode as E
from dtm.ir.dtypes import DTYPES
from dtm.protocol import (PROTOCOL_VERSION, Cancel, Cap, CollectiveStart, Data, Error, FrameDecoder, Heartbeat, Hello,
                          JoinMesh, Leave, Member, MeshView, MsgType, P2PSend, ProtocolError, decode_message,
                          encode_message, frame_parts, level_caps)
from dtm.protocol.caps import cap_names
from dtm.protocol.conformance import frame_to_json, encode_from_json
from dtm.protocol.frame import encode_frame
from dtm.protocol.messages import (COLLECTIVE_OPS, FLAG_EXPECT_SHAPE, MESSAGES, REDUCE_OPS, STORE_OPS, StoreReply,
                                   StoreRequest)

u8, u16, u32, u64 = (st.integers(0, 2**n - 1) for n in (8, 16, 32, 64))
i32, i64 = st.integers(-2**31, 2**31 - 1), st.integers(-2**63, 2**63 - 1)
text = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)
shapes = st.lists(st.integers(0, 2**62 - 1), max_size=5).map(tuple)
dtypes = st.sampled_from(sorted(DTYPES))


@st.composite
def hellos(draw):
    level = draw(st.integers(0, 3))
    majors = draw(st.lists(st.integers(0, 255), min_size=1, max_size=16, unique=True))
    return Hello(tuple((m, draw(u8)) for m in majors), level, draw(u64) | int(level_caps(level)),
                 draw(st.integers(1 << 16, 2**64 - 1)), draw(st.integers(-1, 2**31 - 1)), draw(text),
                 draw(st.binary(min_size=32, max_size=32)), draw(st.sampled_from([b"", bytes(range(32))])))


@st.composite
def mesh_views(draw):
    sizes = draw(st.lists(st.integers(1, 3), max_size=3))
    n = int(np.prod(sizes)) if sizes else draw(st.integers(1, 5))
    members = tuple(Member(draw(text.filter(bool)), draw(u16), draw(text)) for _ in range(n))
    hb = draw(st.integers(1, 2**31))
    return MeshView(draw(st.integers(1, 2**64 - 1)), hb, draw(st.integers(hb, 2**32 - 1)), members,
                    tuple((f"ax{i}", s) for i, s in enumerate(sizes)))


@st.composite
def collective_starts(draw):
    op = draw(st.sampled_from(COLLECTIVE_OPS))
    group = tuple(draw(st.lists(u32, min_size=1, max_size=6, unique=True)))
    reduce_op = draw(st.sampled_from(REDUCE_OPS)) if op in ("all_reduce", "reduce_scatter", "reduce") else ""
    root = -1
    if op in ("broadcast", "reduce"):  # a member of the group, in its i32 field
        root = draw(st.integers(0, 2**31 - 1))
        others = [r for r in group if r != root]
        at = draw(st.integers(0, len(others)))
        group = tuple(others[:at] + [root] + others[at:])
    return CollectiveStart(draw(u64), op, reduce_op, draw(dtypes), draw(shapes), group, root, draw(text))


# keys of at most 1024 UTF-8 bytes (spec 9.1.5); the codec leaves 9.2.1's syntax to the store
store_keys = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40)


@st.composite
def store_requests(draw):
    op = draw(st.sampled_from(STORE_OPS))
    key = draw(st.one_of(st.just(""), store_keys) if op == "keys" else store_keys)
    if op == "put":
        return StoreRequest(draw(u64), op, key, draw(dtypes), draw(shapes), draw(st.sampled_from([0, 1])), draw(u64))
    if op == "get":
        flags = draw(st.sampled_from([0, FLAG_EXPECT_SHAPE]))
        return StoreRequest(draw(u64), op, key, draw(st.one_of(st.just(""), dtypes)),
                            draw(shapes) if flags else (), flags, 0)
    return StoreRequest(draw(u64), op, key, "", (), 0, 0)


@st.composite
def store_replies(draw):
    code = draw(st.one_of(st.just(""), st.from_regex(r"E[0-9]{4}", fullmatch=True)))
    if code:  # an error reply carries no tensor (spec 9.1.5)
        return StoreReply(draw(u64), code, draw(text), "", (), 0, 0, "", 0.0, ())
    dtype = draw(st.one_of(st.just(""), dtypes))
    return StoreReply(draw(u64), code, draw(text), dtype, draw(shapes) if dtype else (), draw(u64), draw(u64),
                      draw(text), draw(st.floats(allow_nan=False, allow_infinity=False)),
                      tuple(draw(st.lists(st.tuples(store_keys, u64), max_size=4))))


messages = st.one_of(
    hellos(),
    st.builds(JoinMesh, st.integers(-1, 2**31 - 1), u32, text.filter(bool), u16, text, u32),
    mesh_views(),
    st.builds(Heartbeat, u32, st.floats(0, 1e6), u64, u64, u64, u64, text),
    st.builds(Leave, u32, text),
    collective_starts(),
    st.builds(Data, u64, u32, u32, u64, st.binary(max_size=64)),
    st.builds(P2PSend, u64, i64, dtypes, shapes, text, st.none() | u32),
    st.builds(Error, st.from_regex(r"E[0-9]{4}", fullmatch=True), text, st.integers(-1, 2**31 - 1)),
    st.builds(Cancel, u64, text),
    store_requests(),
    store_replies(),
)


@settings(max_examples=300, deadline=None)
@given(messages, u64, u32)
def test_every_message_round_trips_through_a_frame_and_json(msg, epoch, stream):
    if isinstance(msg, MeshView):
        epoch = msg.epoch
    frame = encode_message(msg, epoch=epoch, stream=stream, seq=0)
    [(header, payload)] = FrameDecoder(check_seq=True).feed(frame)
    assert header.msg_type is msg.TYPE and header.epoch == epoch and header.stream == stream
    assert decode_message(header, payload) == msg
    as_json = json.loads(json.dumps(frame_to_json(header, payload)))
    assert type(msg).from_json(as_json["message"]) == msg
    assert encode_from_json(as_json) == frame


@settings(max_examples=200, deadline=None)
@given(messages, st.data())
def test_no_prefix_and_no_extension_of_a_payload_decodes(msg, data):
    payload = msg.encode()
    cut = data.draw(st.integers(0, len(payload) - 1)) if payload else None
    tail = data.draw(st.binary(min_size=1, max_size=9))
    if isinstance(msg, P2PSend) and msg.crc is None and len(tail) == 4:
        tail += b"\0"  # 4 bytes more are P2PSend's optional crc section (spec 9.1.5): one more is not
    cuts = [payload[:cut]] if cut is not None and not (isinstance(msg, P2PSend) and msg.crc is not None and
                                                       cut == len(payload) - 4) else []  # (without its crc)
    for bad in cuts + [payload + tail]:
        with pytest.raises(ProtocolError) as e:
            type(msg).decode(bad)
        assert e.value.code is E.BAD_PAYLOAD


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(MESSAGES.values())), st.binary(max_size=200))
def test_random_bytes_decode_or_fail_with_e0910_only(cls, payload):
    try:
        msg = cls.decode(payload)
    except ProtocolError as e:
        assert e.code is E.BAD_PAYLOAD
    else:
        assert msg.encode() == payload  # anything accepted is in the one encoding of its fields


def test_hello_bytes_as_the_spec_table_lays_them_out():
    answer = bytes(range(100, 132))
    hello = Hello(((1, 3), (2, 0)), 1, int(level_caps(1)) | 1 << 40, 1 << 20, 7, "h:1", bytes(range(32)), answer)
    p = hello.encode()
    want = (bytes([2, 1, 3, 2, 0, 1]) + struct.pack("<QQi", 0x3F | 1 << 40, 1 << 20, 7) + struct.pack("<H", 3)
            + b"h:1" + bytes(range(32)) + bytes([32]) + answer)
    assert p == want
    assert Hello.decode(want) == hello


def test_collective_start_and_data_bytes_as_the_spec_tables_lay_them_out():
    cs = CollectiveStart(9, "reduce", "max", "bf16", (2, 3), (4, 1), 1, "a.py:3")
    want = (struct.pack("<Q", 9) + b"\x06\x00reduce" + b"\x03\x00max" + b"\x04\x00bf16" + b"\x02"
            + struct.pack("<QQ", 2, 3) + struct.pack("<III", 2, 4, 1) + struct.pack("<i", 1) + b"\x06\x00a.py:3")
    assert cs.encode() == want
    data = Data(5, 2, 1, 64, b"\x01\x02\x03")
    assert data.encode() == struct.pack("<QIIQQ", 5, 2, 1, 64, 3) + b"\x01\x02\x03"
    hb = Heartbeat(2, 50.5, 10, 20, 30, 40, "x")
    assert hb.encode() == struct.pack("<IdQQQQH", 2, 50.5, 10, 20, 30, 40, 1) + b"x"
    view = MeshView(4, 100, 300, (Member("a", 1, "n"), Member("b", 2, "n")), (("dp", 2),))
    assert view.encode() == (struct.pack("<QIII", 4, 100, 300, 2) + b"\x01\x00a" + struct.pack("<H", 1) + b"\x01\x00n"
                             + b"\x01\x00b" + struct.pack("<H", 2) + b"\x01\x00n" + b"\x01" + b"\x02\x00dp"
                             + struct.pack("<I", 2))


def test_data_travels_without_a_copy():
    tensor = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = memoryview(tensor)
    parts = frame_parts(Data(1, 0, 0, 0, view), epoch=1, stream=1, seq=0)
    assert parts[-1] is view  # the tensor's own buffer goes to sendmsg
    [(h, p)] = FrameDecoder().feed(b"".join(bytes(x) for x in parts))
    got = decode_message(h, p)
    assert isinstance(got.data, memoryview) and got.data.obj is p  # a view of the payload, not a copy
    np.testing.assert_array_equal(np.frombuffer(got.data, np.float32).reshape(3, 4), tensor)


@pytest.mark.parametrize("make, fragment", [
    (lambda: Hello((), 0, 0, 1 << 16, -1, "", bytes(32)), "announces 0 versions"),
    (lambda: Hello(((1, 0), (1, 2)), 0, 7, 1 << 16, -1, "", bytes(32)), "major version twice"),
    (lambda: Hello(((1, 0),), 4, 0, 1 << 16, -1, "", bytes(32)), "level L4"),
    (lambda: Hello(((1, 0),), 2, int(level_caps(1)), 1 << 16, -1, "", bytes(32)), "level L2 implies"),
    (lambda: Hello(((1, 0),), 0, 7, 1000, -1, "", bytes(32)), "max_payload 1000"),
    (lambda: Hello(((1, 0),), 0, 7, 1 << 16, -1, "", bytes(31)), "challenge is 31"),
    (lambda: Hello(((1, 0),), 0, 7, 1 << 16, -1, "", bytes(32), b"x"), "answer is 1"),
    (lambda: JoinMesh(-2, 0, "h", 1, "", 1), "rank -2"),
    (lambda: JoinMesh(0, 0, "", 1, "", 1), "host is empty"),
    (lambda: MeshView(0, 1, 1, (Member("h", 1, ""),), ()), "epoch 0"),
    (lambda: MeshView(1, 10, 5, (Member("h", 1, ""),), ()), "timeout_ms 5"),
    (lambda: MeshView(1, 1, 1, (), ()), "0 members"),
    (lambda: MeshView(1, 1, 1, (Member("h", 1, ""),) * 2, (("a", 1), ("a", 2))), "axis names repeat"),
    (lambda: MeshView(1, 1, 1, (Member("h", 1, ""),) * 2, (("1a", 2),)), "axis name '1a'"),
    (lambda: MeshView(1, 1, 1, (Member("h", 1, ""),) * 2, (("a", 3),)), "hold 3 ranks"),
    (lambda: Heartbeat(0, -1.0, 0, 0, 0, 0, ""), "cpu_percent -1.0"),
    (lambda: Leave(0, "x" * 65536), "65536 UTF-8 bytes"),
    (lambda: Leave(0, "\ud800"), "lone surrogate"),
    (lambda: CollectiveStart(0, "all_reduce", "", "f32", (), (0,), -1, ""), "needs reduce_op"),
    (lambda: CollectiveStart(0, "all_gather", "sum", "f32", (), (0,), -1, ""), "takes no reduce_op"),
    (lambda: CollectiveStart(0, "broadcast", "", "f32", (), (0, 1), 2, ""), "root 2 is not in group"),
    (lambda: CollectiveStart(0, "barrier", "", "f32", (), (0, 1), 0, ""), "takes no root"),
    (lambda: CollectiveStart(0, "reduce", "sum", "f32", (), (0, 2**31), 2**31, ""), "does not fit the i32 root"),
    (lambda: CollectiveStart(0, "barrier", "", "f32", (), (0, 0), -1, ""), "names a rank twice"),
    (lambda: CollectiveStart(0, "scan", "", "f32", (), (0,), -1, ""), "unknown op 'scan'"),
    (lambda: P2PSend(0, 0, "f32", (1,) * 65, ""), "rank 65"),
    (lambda: P2PSend(0, 0, "f32", (2**62,), ""), "outside [0, 2^62)"),
    (lambda: P2PSend(0, 0, "float", (), ""), "unknown dtype 'float'"),
    (lambda: Error("E12", "", -1), "not E followed by four digits"),
    (lambda: StoreRequest(0, "move", "k", "", (), 0, 0), "op 'move' is not one of"),
    (lambda: StoreRequest(0, "get", "", "", (), 0, 0), "the key is empty"),
    (lambda: StoreRequest(0, "get", "a" * 1025, "", (), 0, 0), "the key is 1025 bytes, at most 1024"),
    (lambda: StoreRequest(0, "get", "k", "f33", (), 0, 0), "unknown dtype 'f33'"),
    (lambda: StoreRequest(0, "get", "k", "f32", (2,), 0, 0), "names a shape [2] it does not expect"),
    (lambda: StoreRequest(0, "info", "k", "", (2,), 0, 0), "names a shape [2] it does not expect"),
    (lambda: StoreRequest(0, "get", "k", "", (), 2, 0), "unknown flag bits 0x2"),
    (lambda: StoreRequest(0, "delete", "k", "", (), 0, 4), "carries no bytes"),
    (lambda: StoreRequest(0, "put", "k", "", (2,), 0, 8), "a put names its tensor's dtype"),
    (lambda: StoreReply(0, "E12", "", "", (), 0, 0, "", 0.0, ()), "not E and four digits"),
    (lambda: StoreReply(0, "", "", "", (2,), 0, 0, "", 0.0, ()), "a shape without a dtype"),
    (lambda: StoreReply(0, "", "", "", (), 0, 0, "", float("nan"), ()), "not finite"),
    (lambda: StoreReply(0, "", "", "", (), 0, 0, "", 0.0, (("", 1),)), "the key is empty"),
])
def test_invalid_messages_are_refused_at_the_sender_too(make, fragment):
    with pytest.raises(ProtocolError) as e:
        make()
    assert e.value.code is E.BAD_PAYLOAD and fragment in str(e.value)


def test_hello_may_grow_only_in_a_newer_minor():
    hello = Hello(((1, 0),), 0, 7, 1 << 16, -1, "", bytes(32))
    longer = hello.encode() + b"\x05\x06"
    newer = FrameDecoder().feed(encode_frame(MsgType.HELLO, longer, epoch=0, stream=0, seq=0,
                                             version=(PROTOCOL_VERSION[0], PROTOCOL_VERSION[1] + 1)))[0]
    assert decode_message(*newer) == hello
    same = FrameDecoder().feed(encode_frame(MsgType.HELLO, longer, epoch=0, stream=0, seq=0))[0]
    with pytest.raises(ProtocolError, match="2 byte"):
        decode_message(*same)
    leave = FrameDecoder().feed(encode_frame(MsgType.LEAVE, Leave(0, "").encode() + b"\x00", epoch=0, stream=0, seq=0,
                                             version=(PROTOCOL_VERSION[0], PROTOCOL_VERSION[1] + 1)))[0]
    with pytest.raises(ProtocolError):  # only Hello grows
        decode_message(*leave)


def test_mesh_view_epoch_is_its_frame_s():
    view = MeshView(3, 1, 1, (Member("h", 1, ""),), ())
    [(h, p)] = FrameDecoder().feed(encode_message(view, epoch=2, stream=0, seq=0))
    with pytest.raises(ProtocolError, match="differs from its frame's epoch 2"):
        decode_message(h, p)


def test_error_from_an_exception_is_cut_to_the_string_limit():
    err = ProtocolError(E.CHECKSUM_MISMATCH, "é" * 40000)
    msg = Error.from_exception(err, rank=3)
    assert msg.code == "E0906" and msg.rank == 3 and len(msg.message.encode()) <= 65535
    assert Error.decode(msg.encode()) == msg


def test_describe_names_the_call():
    cs = CollectiveStart(3, "all_reduce", "sum", "f32", (4, 8), (0, 1), -1, "train.py:42")
    assert cs.describe() == "all_reduce(sum) #3 f32[4, 8] over ranks [0, 1] at train.py:42"
    b = CollectiveStart(0, "broadcast", "", "i64", (), (2, 5), 5, "x.py:1")
    assert b.describe() == "broadcast #0 i64[] over ranks [2, 5] root 5 at x.py:1"


def test_store_messages_bytes_as_the_spec_tables_lay_them_out():
    req = StoreRequest(7, "get", "layer0/w", "f32", (2, 3), FLAG_EXPECT_SHAPE, 0)
    want = struct.pack("<QH3sH8sH3sBQQBQ", 7, 3, b"get", 8, b"layer0/w", 3, b"f32", 2, 2, 3, 1, 0)
    assert req.encode() == want
    reply = StoreReply(7, "", "", "f32", (2,), 8, 1, "0a1b2c3d", 1.5, (("a", 4),))
    want = struct.pack("<QHHH3sBQQQH8sdIH1sQ", 7, 0, 0, 3, b"f32", 1, 2, 8, 1, 8, b"0a1b2c3d", 1.5, 1, 1, b"a", 4)
    assert reply.encode() == want
    # a key's bound counts UTF-8 bytes, not characters
    assert StoreRequest.decode(StoreRequest(0, "get", "é" * 512, "", (), 0, 0).encode()).key == "é" * 512
    with pytest.raises(ProtocolError, match="1026 bytes"):
        StoreRequest(0, "get", "é" * 513, "", (), 0, 0)


def test_levels_imply_the_capabilities_of_spec_8_2():
    spec_order = ["CAP_IR", "CAP_EXEC", "CAP_LOCAL_COLLECTIVES", "CAP_MEMBERSHIP", "CAP_WIRE_COLLECTIVES", "CAP_P2P",
                  "CAP_STORE", "CAP_TASKS", "CAP_QUANT", "CAP_CKPT", "CAP_CANCEL", "CAP_CHECKSUMS", "CAP_QUOTAS",
                  "CAP_RESIZE", "CAP_WORKER_ROWS"]
    assert cap_names(2**64 - 1) == spec_order and [int(c) for c in Cap] == [1 << i for i in range(15)]
    assert [len(cap_names(level_caps(n))) for n in range(4)] == [3, 6, 9, 14]
    with pytest.raises(ValueError):
        level_caps(4)


# --- a Heartbeat's optional worker rows (spec 9.1.5, issue 29) --------------------------------------

from dtm.cluster.activity import Row  # noqa: E402
from dtm.cluster.heartbeat import worker_rows  # noqa: E402
from dtm.protocol.messages import MAX_WORKERS, WorkerRow  # noqa: E402

ROWS = (WorkerRow("ingest 1", 97.5, 3 << 20, 12, 4096, 8192, "file 12/50"),
        WorkerRow("task 2", 0.0, 1 << 20, 0, 0, 0, ""))
HB_WORKERS = Heartbeat(3, 187.5, 512 << 20, 1 << 33, 12345, 99, "ingest", ROWS)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.builds(WorkerRow, text.filter(bool), st.floats(0, 1e6), u64, u64, u64, u64, text),
                min_size=0, max_size=4, unique_by=lambda w: w.name), u64)
def test_heartbeat_round_trips_with_and_without_worker_rows(rows, epoch):
    msg = Heartbeat(1, 5.0, 1, 2, 3, 4, "op", tuple(rows))
    frame = encode_message(msg, epoch=epoch, stream=0, seq=0)
    [(header, payload)] = FrameDecoder(check_seq=True).feed(frame)
    assert decode_message(header, payload) == msg
    as_json = json.loads(json.dumps(frame_to_json(header, payload)))
    assert ("workers" in as_json["message"]) == bool(rows)  # a 1.0 Heartbeat's JSON is unchanged
    assert Heartbeat.from_json(as_json["message"]) == msg and encode_from_json(as_json) == frame


def test_a_heartbeat_without_workers_has_the_1_0_bytes_and_a_1_0_reader_reads_it():
    plain = Heartbeat(3, 187.5, 512 << 20, 1 << 33, 12345, 99, "ingest")
    fixed = struct.pack("<Id4Q", 3, 187.5, 512 << 20, 1 << 33, 12345, 99) + struct.pack("<H", 6) + b"ingest"
    assert plain.encode() == fixed                                  # no section: byte for byte 1.0
    assert HB_WORKERS.encode().startswith(fixed)                    # the rows come after every 1.0 field
    assert HB_WORKERS.without_workers() == plain                    # what a coordinator relays
    # A reader of 1.0 layouts refuses the section as trailing bytes: why a rank sends it only to
    # a peer that announced CAP_WORKER_ROWS, a bit no level implies.
    with pytest.raises(ProtocolError) as e:
        Leave.decode(Leave(1, "x").encode() + HB_WORKERS.encode()[len(fixed):])
    assert e.value.code is E.BAD_PAYLOAD
    assert not any(level_caps(n) & Cap.WORKER_ROWS for n in range(4))


@pytest.mark.parametrize("make, fragment", [
    (lambda: Heartbeat(1, 0.0, 0, 0, 0, 0, "", tuple(WorkerRow(f"w{i}", 0.0, 0, 0, 0, 0, "")
                                                     for i in range(MAX_WORKERS + 1))), "65 worker rows, at most 64"),
    (lambda: Heartbeat(1, 0.0, 0, 0, 0, 0, "", (WorkerRow("w" * 65, 0.0, 0, 0, 0, 0, ""),)), "over 64 UTF-8 bytes"),
    (lambda: Heartbeat(1, 0.0, 0, 0, 0, 0, "", (WorkerRow("w", 0.0, 0, 0, 0, 0, "s" * 201),)), "over 200 UTF-8"),
    (lambda: Heartbeat(1, 0.0, 0, 0, 0, 0, "", (ROWS[0], ROWS[0])), "a worker name repeats"),
    (lambda: Heartbeat(1, 0.0, 0, 0, 0, 0, "", (WorkerRow("", 0.0, 0, 0, 0, 0, ""),)), "name is empty"),
])
def test_oversized_worker_rows_are_refused(make, fragment):
    with pytest.raises(ProtocolError) as e:
        make()
    assert e.value.code is E.BAD_PAYLOAD and fragment in str(e.value)


@pytest.mark.parametrize("count", [0, MAX_WORKERS + 1])
def test_a_worker_count_of_0_or_past_the_limit_is_e0910(count):
    head = Heartbeat(1, 0.0, 0, 0, 0, 0, "").encode()
    with pytest.raises(ProtocolError) as e:
        Heartbeat.decode(head + bytes([count]) + bytes(44 * count))
    assert e.value.code is E.BAD_PAYLOAD


def test_a_rank_cuts_its_rows_to_the_bounds():
    rows = worker_rows([Row(f"w{i:03d}", 1.0) for i in range(MAX_WORKERS + 5)] + [Row("a" * 100, state="s" * 300)])
    assert len(rows) == MAX_WORKERS and rows[0].name == "a" * 64 and len(rows[0].state) == 200
    Heartbeat(0, 0.0, 0, 0, 0, 0, "", rows)  # what it cut is valid
