"""The spec's own versioning (chapter 6, chapter 11, docs/spec/versions.json): every IR op,
wire message type, error code and capability bit the code knows is listed under the minor
version that added it, the newest listed version is the one the code implements, and the
code's `since` of each op and message type is the version that lists it. A name added
without a new minor version fails here. Then the negotiation a 1.0 peer meets: a 1.1 peer
agrees on 1.0 with it and never sends it a message 1.0 lacks."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from dtm.errors import ErrorCode
from dtm.ir.registry import REGISTRY
from dtm.ir.version import SPEC_VERSION
from dtm.protocol import ProtocolError
from dtm.protocol.caps import Cap, level_caps
from dtm.protocol.frame import MESSAGE_SINCE, FrameDecoder, MsgType, decode_header, encode_frame
from dtm.protocol.handshake import Handshake
from dtm.protocol.messages import StoreRequest, encode_message

ROOT = pathlib.Path(__file__).resolve().parent.parent
VERSIONS = json.loads((ROOT / "docs" / "spec" / "versions.json").read_text())["versions"]
SPEC = (ROOT / "docs" / "spec" / "dtm-spec.md").read_text()


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def _code_names() -> dict[str, set[str]]:
    return {"ops": set(REGISTRY), "messages": {t.name for t in MsgType}, "errors": {e.value for e in ErrorCode},
            "caps": {c.name for c in Cap}}


def test_the_newest_listed_version_is_the_one_implemented_and_they_follow_each_other():
    listed = sorted(map(_version, VERSIONS))
    assert listed == [(SPEC_VERSION[0], m) for m in range(len(listed))], listed
    assert listed[-1] == SPEC_VERSION[:2], (listed[-1], SPEC_VERSION)
    assert f"**Version {'.'.join(map(str, SPEC_VERSION))}**" in SPEC


@pytest.mark.parametrize("kind", ["ops", "messages", "errors", "caps"])
def test_every_name_the_code_knows_is_in_exactly_one_version(kind):
    seen: dict[str, str] = {}
    for version, names in VERSIONS.items():
        for n in names[kind]:
            assert n not in seen, f"{kind} {n} is listed under {seen[n]} and {version}"
            seen[n] = version
    unlisted = sorted(_code_names()[kind] - set(seen))
    assert not unlisted, (f"{kind} {unlisted} are in the code but in no version of docs/spec/versions.json: an "
                          f"addition needs a new minor version there, in spec chapter 11 and in dtm/ir/version.py")
    gone = sorted(set(seen) - _code_names()[kind])
    assert not gone, f"{kind} {gone} are listed but gone from the code: nothing is removed within a major version"


def test_since_in_the_code_is_the_version_that_lists_the_name():
    for version, names in VERSIONS.items():
        for op in names["ops"]:
            assert REGISTRY[op].since == _version(version), op
        for m in names["messages"]:
            assert MESSAGE_SINCE.get(MsgType[m], (1, 0)) == _version(version), m


def test_the_changelog_names_each_addition_after_1_0():
    for version, names in VERSIONS.items():
        if version == "1.0":
            continue
        section = re.search(rf"### 11\.\d+ Version {re.escape(version)}\.0\n(.*?)(?=\n### |\Z)", SPEC, re.S)
        assert section, f"spec chapter 11 has no section for {version}"
        text = section.group(1)
        for n in names["ops"] + names["errors"]:
            assert n in text, (version, n)
        for m in names["messages"]:
            assert "".join(w.title() for w in m.split("_")) in text, (version, m)
        for c in names["caps"]:
            assert f"CAP_{c}" in text, (version, c)


# --- a 1.0 peer -------------------------------------------------------------------------

def _handshake(connect_versions, accept_versions) -> tuple[Handshake, Handshake]:
    """The three Hellos between a connecting and an accepting peer announcing these versions."""
    token = b"t" * 32
    caps = int(level_caps(1))
    conn = Handshake("connect", token, level=1, caps=caps, versions=connect_versions)
    acc = Handshake("accept", token, level=1, caps=caps, versions=accept_versions)
    decoder_a, decoder_c = FrameDecoder(), FrameDecoder()
    to_acc = conn.start()
    while to_acc or not (conn.done and acc.done):
        to_conn = [f for frame in to_acc for h, p in decoder_a.feed(frame) for f in acc.receive(h, p)]
        to_acc = [f for frame in to_conn for h, p in decoder_c.feed(frame) for f in conn.receive(h, p)]
        if not to_conn and not to_acc:
            break
    return conn, acc


@pytest.mark.parametrize("old_side", ["connect", "accept"])
def test_a_1_1_peer_agrees_on_1_0_with_a_1_0_peer(old_side):
    ours, old = ((1, 1),), ((1, 0),)
    conn, acc = _handshake(old if old_side == "connect" else ours, ours if old_side == "connect" else old)
    assert conn.done and acc.done
    assert conn.version == acc.version == (1, 0)
    both = _handshake(ours, ours)
    assert both[0].version == both[1].version == (1, 1)


def test_no_message_newer_than_the_connection_is_sent_or_read():
    req = StoreRequest(id=1, op="get", key="k", dtype="", shape=(), flags=0, nbytes=0)
    with pytest.raises(ProtocolError) as e:  # the sender refuses before a byte is written
        encode_message(req, epoch=0, stream=0, seq=0, version=(1, 0))
    assert e.value.code is ErrorCode.UNKNOWN_MESSAGE and "1.1" in e.value.message
    encode_message(req, epoch=0, stream=0, seq=0, version=(1, 1))
    # what a 1.1 peer's frame would be if it did send one as 1.0: the receiver refuses it
    frame = bytearray(encode_frame(MsgType.LEAVE, b"", epoch=0, stream=0, seq=0, version=(1, 0)))
    frame[6] = MsgType.STORE_REQUEST  # (the type byte: after the magic and the version's two)
    with pytest.raises(ProtocolError) as e:
        decode_header(bytes(frame))
    assert e.value.code is ErrorCode.UNKNOWN_MESSAGE and "STORE_REQUEST" in e.value.message
