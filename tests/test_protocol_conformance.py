"""The wire protocol vectors (conformance/protocol) pass, reach every E09xx code and message
type, are what their generator writes, and catch a broken copy; the spec's worked example
and header table agree with the codec; `dtm conformance protocol` runs them."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shutil
import struct

import pytest
from click.testing import CliRunner

from dtm.cli import main
from dtm.errors import ErrorCode
from dtm.protocol import HEADER_SIZE, FrameDecoder, Leave, MsgType, decode_message
from dtm.protocol.conformance import DEFAULT_ROOT, load_manifest, run_protocol_vectors, summary

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPEC = (ROOT / "docs" / "spec" / "dtm-spec.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    start = SPEC.index(title)
    end = re.search(r"^#{2,4} ", SPEC[start + len(title):], re.M)
    return SPEC[start:start + len(title) + (end.start() if end else len(SPEC))]


def test_every_vector_passes():
    results = run_protocol_vectors()
    assert all(r.ok for r in results), summary(results)
    kinds = {k: sum(r.kind == k for r in results) for k in ("crc32c", "valid", "invalid", "handshake")}
    assert kinds["valid"] >= 20 and kinds["invalid"] >= 35 and kinds["handshake"] >= 15 and kinds["crc32c"] >= 5


def test_vectors_reach_every_protocol_code_and_message_type():
    manifest = load_manifest()
    handshake = json.loads((DEFAULT_ROOT / "handshake.json").read_text(encoding="utf-8"))
    reached = {v["code"] for v in manifest["invalid"].values()}
    reached |= {c["code"] for part in handshake.values() for c in part if "code" in c}
    assert {c.value for c in ErrorCode if c.value.startswith("E09")} <= reached
    types = set()
    for name in manifest["valid"]:
        vector = json.loads((DEFAULT_ROOT / "valid" / f"{name}.json").read_text(encoding="utf-8"))
        types |= {f["header"]["type"] for f in vector["frames"]}
    assert types == {int(t) for t in MsgType}


def test_the_files_are_what_the_generator_writes():
    spec = importlib.util.spec_from_file_location("make_vectors", DEFAULT_ROOT / "tools" / "make_vectors.py")
    make_vectors = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_vectors)
    assert make_vectors.main(["--check"]) == 0


def _ints(obj) -> list[int]:
    if isinstance(obj, dict):
        return [i for v in obj.values() for i in _ints(v)]
    if isinstance(obj, list):
        return [i for v in obj for i in _ints(v)]
    return [obj] if isinstance(obj, int) and not isinstance(obj, bool) else []


def test_no_json_number_a_double_would_round():
    """Integers past 2^53 are decimal strings in every file, and the reader takes them back."""
    from dtm.protocol.messages import int_from_json, int_to_json

    files = sorted(DEFAULT_ROOT.glob("**/*.json"))
    assert len(files) > 60
    for path in files:
        big = [i for i in _ints(json.loads(path.read_text(encoding="utf-8"))) if abs(i) > 2 ** 53]
        assert not big, f"{path.name}: {big}"
    large = json.loads((DEFAULT_ROOT / "valid" / "large_u64.json").read_text(encoding="utf-8"))
    assert large["frames"][0]["message"]["seq"] == str(2 ** 64 - 1) and large["decoder"]["expected_epoch"] == \
        str(2 ** 53 + 1)
    assert [int_to_json(v) for v in (2 ** 53, -2 ** 53, 2 ** 53 + 1, -2 ** 63)] == \
        [2 ** 53, -2 ** 53, "9007199254740993", "-9223372036854775808"]
    assert [int_from_json(v) for v in (5, "5", "-9223372036854775808")] == [5, 5, -2 ** 63]
    for bad in ("5.0", 5.0, True, "0x10", " 5", None):
        with pytest.raises(ValueError):
            int_from_json(bad)


def test_payload_sizes_named_in_the_manifest_are_the_vectors():
    """An `about` that gives a payload's size gives the size the vector's frame has."""
    manifest = load_manifest()
    named = {n: int(m.group(1)) for n, v in manifest["invalid"].items()
             if (m := re.search(r"(\d+)-byte payload", v["about"]))}
    assert {"collective_group_count_too_big", "mesh_view_members_past_the_end"} <= set(named)
    for name, size in named.items():
        data = bytes.fromhex("".join(json.loads((DEFAULT_ROOT / "invalid" / f"{name}.json").read_text())["hex"]
                                     ).replace(" ", ""))
        assert struct.unpack_from("<Q", data, 16)[0] == len(data) - HEADER_SIZE == size, name


@pytest.mark.parametrize("section, words, vectors", [
    ("#### 9.1.7", "a stale frame's `seq` MUST be checked like any other's",
     ["invalid/stale_frame_seq_checked", "invalid/stale_frame_seq_counted"]),
    ("#### 9.1.7", "Decoding a `MeshView` does not by itself change the epoch",
     ["valid/mesh_view_keeps_the_decoder_epoch"]),
    ("#### 9.1.5", "a value below -1 is E0910", ["invalid/hello_rank_below_minus_one",
                                                "invalid/join_mesh_rank_below_minus_one",
                                                "invalid/error_rank_below_minus_one"]),
    ("#### 9.1.5", "`host` MAY be empty", ["valid/mesh_view_empty_host", "invalid/join_mesh_empty_host"]),
    ("#### 9.1.5", "a receiver MUST NOT refuse it with E0910, whatever its\n  shape", ["valid/quantized_dtypes"]),
    ("#### 9.1.6", "it MUST carry the same `major.minor` as the first", []),
    ("#### 9.1.12", "exceeds 2^53 is written as a string of decimal digits", ["valid/large_u64"]),
    ("#### 9.6.7", "whose `code` is `E1009`, whose `rank` is -1",
     ["valid/resize_rejoin", "valid/resize_notice_and_view", "valid/resize_spare"]),
    ("#### 9.6.7", "stamped with the epoch it leaves", ["valid/succession_rejoin"]),
])
def test_spec_decisions_have_their_vectors(section, words, vectors):
    """Each rule an independent implementation asked about is in the spec's words and has a
    vector (the third Hello's version: a handshake transcript)."""
    assert words in _section(section)
    manifest = load_manifest()
    for v in vectors:
        kind, name = v.split("/")
        assert name in manifest[kind] and (DEFAULT_ROOT / f"{v}.json").exists(), v
    if section == "#### 9.1.6":
        handshake = json.loads((DEFAULT_ROOT / "handshake.json").read_text(encoding="utf-8"))
        t = next(t for t in handshake["transcripts"] if t["name"] == "third_hello_keeps_the_first_version")
        versions = [bytes.fromhex("".join(f.split()))[4:6] for f in t["frames"]]
        assert versions == [b"\x01\x03", b"\x01\x00", b"\x01\x03"] and t["version"] == [1, 0]


@pytest.fixture
def copy(tmp_path):
    shutil.copytree(DEFAULT_ROOT, tmp_path / "protocol", ignore=shutil.ignore_patterns("tools"))
    return tmp_path / "protocol"


def _edit(path: pathlib.Path, change) -> None:
    obj = json.loads(path.read_text(encoding="utf-8"))
    change(obj)
    path.write_text(json.dumps(obj), encoding="utf-8")


def _flip_last(hex_text: str) -> str:
    return hex_text[:-1] + ("1" if hex_text[-1] != "1" else "2")


@pytest.mark.parametrize("breakage, failing", [
    (lambda r: _edit(r / "valid" / "leave.json", lambda v: v["frames"][0]["message"].update(reason="gone")), "leave"),
    (lambda r: _edit(r / "valid" / "data.json", lambda v: v.update(hex=[_flip_last(v["hex"][0])])), "data"),
    (lambda r: _edit(r / "valid" / "heartbeat.json", lambda v: v["frames"][0]["header"].update(crc=1)), "heartbeat"),
    (lambda r: _edit(r / "manifest.json", lambda m: m["invalid"]["bad_magic"].update(code="E0902")), "bad_magic"),
    (lambda r: _edit(r / "valid" / "mesh_view.json", lambda v: v["decoder"].update(expected_epoch=8)), "mesh_view"),
    (lambda r: (r / "invalid" / "crc_field.json").unlink(), "crc_field"),
    (lambda r: (r / "valid" / "stray.json").write_text("{}"), "stray"),
    (lambda r: _edit(r / "handshake.json", lambda h: h["hmac"][0].update(answer="00" * 32)), "hmac accept"),
    (lambda r: _edit(r / "handshake.json", lambda h: h["transcripts"][0]["accept"].update(rank=5)),
     "transcript three_hellos"),
    (lambda r: _edit(r / "manifest.json", lambda m: m["crc32c"][0].update(crc="e3069284")), "check_123456789"),
])
def test_a_broken_copy_fails(copy, breakage, failing):
    assert all(r.ok for r in run_protocol_vectors(copy))
    breakage(copy)
    bad = [r.name for r in run_protocol_vectors(copy) if not r.ok]
    assert bad == [failing]


def test_spec_worked_example_is_the_leave_vector():
    worked = _section("#### 9.1.11 Worked example")
    block = re.search(r"```hex\n(.*?)```", worked, re.S).group(1)
    data = bytes.fromhex(block.replace("\n", " "))
    vector = json.loads((DEFAULT_ROOT / "valid" / "leave.json").read_text(encoding="utf-8"))
    assert data == bytes.fromhex("".join("".join(s.split()) for s in vector["hex"]))
    assert f"The frame is {len(data)} bytes" in worked
    [(h, p)] = FrameDecoder().feed(data)
    assert decode_message(h, p) == Leave(2, "done") and (h.epoch, h.stream, h.seq) == (3, 0, 5)
    assert f"`0x{h.crc:08X}`" in worked
    table = re.findall(r"^\| `([0-9a-f ]+)` \| .+ \|$", worked, re.M)
    assert bytes.fromhex(" ".join(table)) == data, "the byte table does not add up to the frame"


def test_spec_resize_example_is_the_rejoin_vector():
    """The frame of 9.6.7's example is the vector resize_rejoin, byte for byte, and the
    resize vectors hold the notice (E1009, rank -1) and the view of epoch 4 (dp=1, tp=2)."""
    from dtm.protocol import Error, JoinMesh, MeshView

    worked = _section("#### 9.6.7 Live resize")
    block = re.search(r"```hex\n(.*?)```", worked, re.S).group(1)
    data = bytes.fromhex(block.replace("\n", " "))
    vector = json.loads((DEFAULT_ROOT / "valid" / "resize_rejoin.json").read_text(encoding="utf-8"))
    assert data == bytes.fromhex("".join("".join(s.split()) for s in vector["hex"]))
    assert f"The frame is {len(data)} bytes" in worked
    [(h, p)] = FrameDecoder().feed(data)
    assert decode_message(h, p) == JoinMesh(2, 0, "10.0.0.2", 41232, "node-b", 4242) and (h.epoch, h.seq) == (3, 9)
    assert f"`0x{h.crc:08X}`" in worked
    table = re.findall(r"^\| `([0-9a-f ]+)` \| .+ \|$", worked, re.M)
    assert bytes.fromhex(" ".join(table)) == data, "the byte table does not add up to the frame"
    seen = json.loads((DEFAULT_ROOT / "valid" / "resize_notice_and_view.json").read_text(encoding="utf-8"))
    frames = [(decode_message(h, p), h.epoch) for h, p in FrameDecoder(expected_epoch=3).feed(
        bytes.fromhex("".join("".join(s.split()) for s in seen["hex"])))]
    notice, view = frames[1], frames[2]
    assert isinstance(notice[0], Error) and (notice[0].code, notice[0].rank, notice[1]) == ("E1009", -1, 3)
    assert isinstance(view[0], MeshView) and (view[0].epoch, view[1], view[0].axes) == (4, 4, (("dp", 1), ("tp", 2)))


def test_spec_header_table_matches_the_codec():
    rows = re.findall(r"^\| (\d+) \| (\d+) \| `(\w+)` \|", _section("#### 9.1.2 Frame header"), re.M)
    layout = [(int(o), int(n), name) for o, n, name in rows]
    assert [o for o, _, _ in layout] == [sum(n for _, n, _ in layout[:i]) for i in range(len(layout))]
    assert sum(n for _, n, _ in layout) == HEADER_SIZE
    from dtm.protocol import encode_frame
    frame = encode_frame(MsgType.CANCEL, b"xyz", epoch=0x1122334455667788, stream=0xA1B2C3D4, seq=0x99AABBCCDDEEFF00,
                         flags=0x11)
    h = FrameDecoder().feed(frame)[0][0]
    want = {"magic": b"DTMW", "major": h.version[0], "minor": h.version[1], "type": 10, "flags": 0x11,
            "epoch": h.epoch, "length": 3, "stream": h.stream, "crc": h.crc, "seq": h.seq}
    sizes = {1: "<B", 4: "<I", 8: "<Q"}
    for offset, size, name in layout:
        got = frame[offset:offset + size] if name == "magic" else struct.unpack_from(sizes[size], frame, offset)[0]
        assert got == want[name], name


def test_cli_runs_the_vectors(copy):
    ok = CliRunner().invoke(main, ["conformance", "protocol"])
    assert ok.exit_code == 0
    passed, failed = ok.output.strip().splitlines()[-1].split(", ")
    assert failed == "0 failed" and int(passed.split()[0]) == len(run_protocol_vectors())
    (copy / "invalid" / "bad_magic.json").unlink()
    broken = CliRunner().invoke(main, ["conformance", "protocol", "--root", str(copy)])
    assert broken.exit_code == 1 and "bad_magic" in broken.output and "1 failed" in broken.output
