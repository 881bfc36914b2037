"""Version negotiation and the three-Hello handshake (spec 9.1.6): HMAC answers against
HMAC-SHA256 written from RFC 2104, negotiation against a brute-force search, and whole
handshakes between two `Handshake`s through real frame decoders."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtm.errors import ErrorCode as E
from dtm.protocol import (FrameDecoder, Handshake, Heartbeat, Hello, MsgType, ProtocolError, check_answer,
                          decode_message, encode_message, hmac_answer, level_caps, negotiate)

L1 = int(level_caps(1))


def hmac_sha256_rfc2104(key: bytes, msg: bytes) -> bytes:
    if len(key) > 64:
        key = hashlib.sha256(key).digest()
    key = key.ljust(64, b"\0")
    inner = hashlib.sha256(bytes(k ^ 0x36 for k in key) + msg).digest()
    return hashlib.sha256(bytes(k ^ 0x5C for k in key) + inner).digest()


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=100), st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32),
       st.sampled_from(["connect", "accept"]))
def test_answer_is_the_spec_s_hmac(token, challenge, own, role):
    want = hmac_sha256_rfc2104(token, b"DTM hello " + role.encode() + challenge + own)
    assert hmac_answer(token, challenge, responder_challenge=own, role=role) == want
    check_answer(token, challenge, want, responder_challenge=own, role=role)
    other = "accept" if role == "connect" else "connect"
    for bad_token, bad_role, bad_answer in ((token + b"x", role, want), (token, other, want),
                                            (token, role, want[:-1] + bytes([want[-1] ^ 1])), (token, role, b"")):
        with pytest.raises(ProtocolError) as e:
            check_answer(bad_token, challenge, bad_answer, responder_challenge=own, role=bad_role)
        assert e.value.code is E.AUTH_FAILED


versions = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=4,
                    unique_by=lambda v: v[0])


@settings(max_examples=200, deadline=None)
@given(versions, versions)
def test_negotiate_picks_the_highest_version_both_speak(ours, theirs):
    def spoken(vs):
        return {(major, m) for major, top in vs for m in range(top + 1)}

    common = spoken(ours) & spoken(theirs)
    if common:
        assert negotiate(ours, theirs) == max(common) == negotiate(theirs, ours)
    else:
        with pytest.raises(ProtocolError) as e:
            negotiate(ours, theirs)
        assert e.value.code is E.UNSUPPORTED_PROTOCOL_VERSION


def test_no_common_version_names_both_sides():
    with pytest.raises(ProtocolError) as e:
        negotiate([(1, 2)], [(2, 0), (3, 1)])
    assert "this side speaks 1.0 to 1.2, the peer speaks 2.0, 3.0 to 3.1" in str(e.value)


class Wire:
    """Two sides of a connection, each with its own frame decoder (seq checked)."""

    def __init__(self, conn: Handshake, acc: Handshake):
        self.sides = {"connect": conn, "accept": acc}
        self.decoders = {"connect": FrameDecoder(check_seq=True), "accept": FrameDecoder(check_seq=True)}
        self.log: list[tuple[str, MsgType]] = []

    def deliver(self, to: str, frames: list[bytes]) -> None:
        """Hand `frames` to side `to`; its replies go back the other way; a side that fails
        sends its Error frame, as a transport does before it closes."""
        other = "accept" if to == "connect" else "connect"
        side = self.sides[to]
        for f in frames:
            for h, p in self.decoders[to].feed(f):
                self.log.append((to, h.msg_type))
                try:
                    replies = side.receive(h, p)
                except ProtocolError as e:
                    side.failure = e
                    if h.msg_type is not MsgType.ERROR:
                        self.deliver(other, [side.error_frame(e)])
                    return
                self.deliver(other, replies)

    def run(self) -> None:
        for side in self.sides.values():
            side.failure = None
        self.deliver("accept", self.sides["connect"].start())


def make(role: str, token: bytes = b"secret", **kw) -> Handshake:
    args = {"level": 1, "caps": L1, "name": role, **kw}
    return Handshake(role, token, **args)


def test_two_peers_with_one_token_agree():
    conn, acc = make("connect", rank=1), make("accept", rank=0, max_payload=1 << 20)
    wire = Wire(conn, acc)
    wire.run()
    assert conn.done and acc.done and conn.failure is None and acc.failure is None
    assert conn.version == acc.version == (1, 1)
    assert wire.log == [("accept", MsgType.HELLO), ("connect", MsgType.HELLO), ("accept", MsgType.HELLO)]
    assert conn.peer.max_payload == 1 << 20 and acc.peer.rank == 1 and acc.peer.name == "connect"
    assert (conn.next_seq, acc.next_seq) == (2, 1)  # later control frames go on from here
    assert conn.hello.challenge != acc.hello.challenge  # fresh random challenges


def test_a_wrong_token_is_refused_on_both_sides():
    conn, acc = make("connect", b"token-a"), make("accept", b"token-b")
    Wire(conn, acc).run()
    assert not conn.done and not acc.done
    assert conn.failure.code is E.AUTH_FAILED  # the accepting peer's answer proves nothing
    assert acc.failure.code is E.AUTH_FAILED and "reported E0909" in str(acc.failure)


def test_no_common_version_ends_with_an_error_naming_both():
    # a 2.x peer sends its Hello in major 2, which a 1.x receiver refuses at the header
    frames = make("connect", versions=[(2, 1)]).start()
    with pytest.raises(ProtocolError) as e:
        FrameDecoder().feed(frames[0])
    assert e.value.code is E.UNSUPPORTED_PROTOCOL_VERSION and "2.1" in str(e.value) and "1.x" in str(e.value)
    # a peer that speaks 1.x and 2.x, against one that speaks 2.x only: refused in negotiation
    conn, acc = make("connect", versions=[(1, 0), (2, 0)]), make("accept", versions=[(3, 0)])
    conn_hello = conn.start()[0]
    with pytest.raises(ProtocolError) as e:
        acc.receive(*FrameDecoder().feed(conn_hello)[0])
    assert e.value.code is E.UNSUPPORTED_PROTOCOL_VERSION
    assert "this side speaks 3.0, the peer speaks 1.0, 2.0" in str(e.value)
    err = FrameDecoder().feed(acc.error_frame(e.value))[0]
    with pytest.raises(ProtocolError) as e2:
        conn.receive(*err)
    assert e2.value.code is E.UNSUPPORTED_PROTOCOL_VERSION and "3.0" in str(e2.value)


def test_only_hellos_open_a_connection():
    acc = make("accept")
    hb = FrameDecoder().feed(encode_message(Heartbeat(0, 0.0, 0, 0, 0, 0, ""), epoch=0, stream=0, seq=0))[0]
    with pytest.raises(ProtocolError) as e:
        acc.receive(*hb)
    assert e.value.code is E.UNEXPECTED_MESSAGE and "HEARTBEAT" in str(e.value)


def test_a_first_hello_that_already_answers_is_refused():
    acc = make("accept")
    early = Hello(((1, 0),), 1, L1, 1 << 20, -1, "", bytes(32), bytes(32))
    with pytest.raises(ProtocolError) as e:
        acc.receive(*FrameDecoder().feed(encode_message(early, epoch=0, stream=0, seq=0))[0])
    assert e.value.code is E.UNEXPECTED_MESSAGE


def test_the_second_hello_must_repeat_the_first():
    conn, acc = make("connect"), make("accept")
    to_acc, to_conn = FrameDecoder(check_seq=True), FrameDecoder(check_seq=True)
    [f1] = conn.start()
    [f2] = acc.receive(*to_acc.feed(f1)[0])
    [f3] = conn.receive(*to_conn.feed(f2)[0])
    hello = decode_message(*FrameDecoder(next_seq={0: 1}).feed(f3)[0])
    changed = Hello(hello.versions, hello.level, hello.caps, hello.max_payload, hello.rank, hello.name, bytes(32),
                    hello.answer)
    with pytest.raises(ProtocolError) as e:
        acc.receive(*to_acc.feed(encode_message(changed, epoch=0, stream=0, seq=1))[0])
    assert e.value.code is E.UNEXPECTED_MESSAGE and not acc.done


def test_a_finished_handshake_takes_no_more_frames():
    conn, acc = make("connect"), make("accept")
    Wire(conn, acc).run()
    assert acc.done
    again = FrameDecoder().feed(make("connect").start()[0])[0]
    with pytest.raises(ProtocolError) as e:
        acc.receive(*again)
    assert e.value.code is E.UNEXPECTED_MESSAGE and "finished handshake" in str(e.value)
