"""The mesh's store on the wire: the spec's tables (9.1.4, 9.1.5, 9.1.9), its worked placement
example (9.2.11) and the store's conformance vectors agree with the code, and a store
connection sends exactly the vectors' bytes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re
import socket
import threading
from types import SimpleNamespace

import pytest

from dtm.protocol import FrameDecoder, MsgType, decode_message, encode_message
from dtm.protocol.conformance import DEFAULT_ROOT, load_manifest
from dtm.protocol.frame import EPOCH_EXEMPT
from dtm.protocol.messages import (FLAG_EXPECT_SHAPE, MAX_KEY_BYTES, MAX_STORE_KEYS, MESSAGES, STORE_OPS, Data,
                                   StoreReply, StoreRequest)
from dtm.store.mesh_store import placement
from dtm.store.wire import StoreConnection

SPEC = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "spec" / "dtm-spec.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    start = SPEC.index(title)
    end = re.search(r"^#{2,4} ", SPEC[start + len(title):], re.M)
    return SPEC[start:start + len(title) + (end.start() if end else len(SPEC))]


def _vector(kind: str, name: str) -> dict:
    return json.loads((DEFAULT_ROOT / kind / f"{name}.json").read_text(encoding="utf-8"))


def _bytes(vector: dict) -> bytes:
    return bytes.fromhex("".join("".join(h.split()) for h in vector["hex"]))


# --- the spec's tables --------------------------------------------------------------------------

def test_message_type_table_is_the_codec_s():
    text = _section("#### 9.1.4 Message types")
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| .+ \| (yes|no) \|$", text, re.M)
    assert [(int(t), name) for t, name, _ in rows] == [(int(t), MESSAGES[t].__name__) for t in MsgType]
    assert {int(t) for t, _, checked in rows if checked == "no"} == {int(t) for t in EPOCH_EXEMPT}
    first_unknown = max(MsgType) + 1
    assert f"Value 0 and values {first_unknown} to 255 are not message types" in text


@pytest.mark.parametrize("cls", [StoreRequest, StoreReply])
def test_store_payload_tables_list_the_fields_in_order(cls):
    text = _section("#### 9.1.5 Payloads")
    table = text[text.index(f"**`{cls.__name__}`**"):]
    table = table[:table.index("\n\n", table.index("| field |"))]
    fields = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert fields == [f.name for f in dataclasses.fields(cls)]


def test_store_limits_and_constants_are_the_spec_s():
    limits = _section("#### 9.1.9 Limits")
    assert "| keys of a `StoreReply` | 2^20 |" in limits and MAX_STORE_KEYS == 2 ** 20
    assert "| a store key in `StoreRequest` and `StoreReply` | 1024 bytes of UTF-8" in limits and MAX_KEY_BYTES == 1024
    payloads = _section("#### 9.1.5 Payloads")
    assert "`get`, `put`, `info`, `keys` or `delete`" in payloads and STORE_OPS == ("get", "put", "info", "keys",
                                                                                     "delete")
    assert "bit 0 (`0x01`, `EXPECT_SHAPE`)" in payloads and FLAG_EXPECT_SHAPE == 0x01


def test_placement_worked_example_is_the_code_s():
    text = _section("#### 9.2.11 The mesh's store")
    key = "layer0/w"
    assert f"`{key}` (bytes `{' '.join(f'{b:02x}' for b in key.encode())}`)" in text
    rows = re.findall(r"^\| (\d) \| `([0-9a-f]+) ([0-9a-f]{8})` \| `([0-9a-f]{16})` \| (\d+) \(`0x([0-9a-f]{16})`\) \|$",
                      text, re.M)
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    for rank, key_hex, rank_hex, out_hex, score, score_hex in rows:
        assert bytes.fromhex(key_hex) == key.encode() and bytes.fromhex(rank_hex) == int(rank).to_bytes(4, "little")
        out = hashlib.blake2b(key.encode() + int(rank).to_bytes(4, "little"), digest_size=8).digest()
        assert out.hex() == out_hex and int.from_bytes(out, "little") == int(score) == int(score_hex, 16)
    order = placement(key, 4)
    assert f"Its order is {', '.join(map(str, order))}:" in text
    assert f"its homes are ranks {order[0]} and {order[1]}" in text
    assert f"gone they are ranks {order[1]} and {order[2]}" in text


# --- the store's vectors ------------------------------------------------------------------------

STORE_VALID = sorted(n for n in load_manifest()["valid"] if n.startswith("store_"))


def test_every_key_a_valid_vector_names_is_a_valid_store_key():
    from dtm.store.keys import check_key

    keys = [f["message"]["key"] for n in STORE_VALID for f in _vector("valid", n)["frames"]
            if f["message_type"] == "StoreRequest" and f["message"]["op"] != "keys"]
    assert len(keys) >= 5 and max(len(k.encode()) for k in keys) == 1024  # (the longest a key may be, 9.2.1)
    for k in keys:
        check_key(k)  # 9.2.1's rules, segments of at most 255 bytes included: no vector contradicts them


def test_every_store_message_has_vectors_both_ways():
    manifest = load_manifest()
    invalid = {n: v["code"] for n, v in manifest["invalid"].items() if n.startswith("store_")}
    assert invalid.pop("store_request_of_1_0") == "E0903"  # (a frame of 1.0, which has no StoreRequest)
    assert len(STORE_VALID) >= 5 and len(invalid) >= 5 and set(invalid.values()) == {"E0910"}
    types = {f["message_type"] for n in STORE_VALID for f in _vector("valid", n)["frames"]}
    assert types == {"StoreRequest", "StoreReply", "Data"}
    ops = {f["message"]["op"] for n in STORE_VALID for f in _vector("valid", n)["frames"]
           if f["message_type"] == "StoreRequest"}
    assert {"get", "put", "keys"} <= ops
    assert "unknown_type_13" in manifest["invalid"] and "unknown_type_11" not in manifest["invalid"]


@pytest.mark.parametrize("name", STORE_VALID)
def test_store_vector_round_trips_and_its_data_frames_follow_the_rules(name):
    """Each frame decodes to its JSON and encodes back to its bytes; a put's (request) or a
    get's (reply) bytes follow in Data frames with seq = id, chunks 0, 1, ... at consecutive
    offsets, nbytes in all; every other store message has none (spec 9.2.11)."""
    vector = _vector("valid", name)
    decoded = FrameDecoder(check_seq=True, next_seq={int(k): int(v) for k, v in vector["decoder"].get(
        "next_seq", {}).items()}, expected_epoch=vector["decoder"].get("expected_epoch")).feed(_bytes(vector))
    assert len(decoded) == len(vector["frames"])
    out, msgs = b"", []
    for (h, payload), want in zip(decoded, vector["frames"]):
        msg = decode_message(h, payload)
        assert type(msg).__name__ == want["message_type"] and msg == type(msg).from_json(want["message"])
        assert h.stream == 0 and h.epoch >= 1
        out += encode_message(msg, epoch=h.epoch, stream=h.stream, seq=h.seq, flags=h.flags, version=h.version)
        msgs.append(msg)
    assert out == _bytes(vector)
    i = 0
    while i < len(msgs):
        head, start = msgs[i], i
        assert isinstance(head, (StoreRequest, StoreReply))
        i += 1
        got = 0
        while i < len(msgs) and isinstance(msgs[i], Data):
            d = msgs[i]
            assert (d.seq, d.chunk, d.step, d.offset) == (head.id, i - start - 1, 0, got)
            got += len(bytes(d.data))
            i += 1
        if isinstance(head, StoreRequest):  # only a put carries bytes, all of them
            assert got == (head.nbytes if head.op == "put" else 0)
        elif head.code:  # an error reply: no tensor
            assert got == 0 and not head.dtype and head.nbytes == 0
        else:  # a get's reply is followed by its nbytes; a put's or info's by nothing
            assert got in (0, head.nbytes) and (got or i - start == 1)


# --- what a store connection sends ----------------------------------------------------------------

def _sent(role: str, next_seq: int, msg, data: bytes | None, max_payload: int = 1 << 30) -> bytes:
    """The bytes a StoreConnection of `role` sends for `msg` (and `data`) as its first frame
    after the handshake, read from the other end of a socket pair."""
    a, b = socket.socketpair()
    try:
        hs = SimpleNamespace(version=(1, 1), peer=SimpleNamespace(max_payload=max_payload), role=role,
                             next_seq=next_seq)
        StoreConnection(a, hs, "test peer", epoch=1).send(msg, memoryview(data) if data is not None else None)
        a.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := b.recv(1 << 16):
            out += chunk
        return out
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("name, role, first_seq, with_data", [
    ("store_put", "connect", 2, True),
    ("store_reply_get", "accept", 2, True),
    ("store_reply_put", "accept", 1, False),
    ("store_reply_error", "accept", 4, False),
])
def test_a_store_connection_sends_the_vectors_bytes(name, role, first_seq, with_data):
    vector = _vector("valid", name)
    first = vector["frames"][0]
    msg = MESSAGES[MsgType(first["header"]["type"])].from_json(first["message"])
    data = bytes.fromhex(vector["frames"][1]["message"]["data"]) if with_data else None
    assert first["header"]["seq"] == first_seq
    assert _sent(role, first_seq, msg, data) == _bytes(vector)


def test_a_tensor_larger_than_the_peer_s_max_payload_is_cut_into_chunks_in_order():
    data = bytes(range(10))
    msg = StoreRequest(4, "put", "k", "u8", (10,), 0, len(data))
    frames = FrameDecoder(check_seq=True, next_seq={0: 2}).feed(_sent("connect", 2, msg, data, max_payload=32 + 4))
    chunks = [decode_message(h, p) for h, p in frames[1:]]
    assert [(c.seq, c.chunk, c.step, c.offset, bytes(c.data)) for c in chunks] == [
        (4, 0, 0, 0, data[0:4]), (4, 1, 0, 4, data[4:8]), (4, 2, 0, 8, data[8:10])]
    assert all(h.length <= 36 for h, _ in frames[1:])
    empty = StoreRequest(5, "put", "e", "f32", (0, 4), 0, 0)
    assert len(FrameDecoder().feed(_sent("connect", 2, empty, b""))) == 1  # a tensor of 0 bytes: no Data frame


def test_after_the_handshake_the_client_s_frames_go_on_from_seq_2_and_the_service_s_from_1():
    """Spec 9.2.11: sequence numbers go on from the three Hellos' (two of the client's, one of
    the service's), which is where the vectors store_put and store_reply_put start."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: dict = {}

    def accept() -> None:
        sock, _ = listener.accept()
        accepted["conn"] = StoreConnection.accept(sock, b"t", rank=1, epoch=1, timeout=10)

    t = threading.Thread(target=accept)
    t.start()
    client = StoreConnection.connect(listener.getsockname(), b"t", rank=0, epoch=1, timeout=10, peer="rank 1")
    t.join(10)
    service = accepted["conn"]
    try:
        assert (client.hs.next_seq, client.next_in) == (2, 1) and (service.hs.next_seq, service.next_in) == (1, 2)
        assert client.version == service.version == (1, 1)  # (the store's messages are 1.1's)
    finally:
        client.close()
        service.close()
        listener.close()
