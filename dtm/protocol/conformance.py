"""The runner for the wire protocol vectors in `conformance/protocol/` (spec 9.1.12).

    results = run_protocol_vectors()     # default root: the repository's conformance/protocol
    print(summary(results))              # one line per failing vector, then "N passed, M failed"

Layout (conformance/protocol/README.md says the same for implementers in other languages):

- `valid/NAME.json`: `hex`, a list of hex strings (whitespace ignored) whose bytes, in order,
  are one byte stream; `decoder`, the receiver's `max_payload`, `expected_epoch` and
  `next_seq` (stream -> the seq it expects next, 0 for streams not named); and
  `frames`, each frame's decoded `header`, `message_type` and `message`. Decoding the stream
  (sequence numbers checked) must give exactly those frames, fed at once and one byte at a
  time; encoding each frame from its JSON must give back the stream.
- `invalid/NAME.json`: `hex` and `decoder` likewise; decoding must fail with the code of
  `manifest.json`'s `invalid[NAME].code` (a stale frame's E0907 is a frame skipped, not a
  stream refused).
- `handshake.json`: HMAC answers, negotiations, whole handshakes byte for byte, and
  handshakes a peer must refuse.
- `manifest.json`: `spec_version`, `crc32c` check values, and an entry for every vector file,
  so that no vector is skipped silently.

Nothing here is a pytest test: `tests/test_protocol_conformance.py` and
`dtm conformance protocol` both call `run_protocol_vectors`.
"""

from __future__ import annotations

import json
import pathlib

from crc32c import crc32c

from ..errors import DTMError, ErrorCode
from ..ir.conformance import VectorResult, manifest_or_failure, summary  # one result type and report for every vector set
from .errors import ProtocolError
from .frame import MAX_PAYLOAD, FrameDecoder, FrameHeader, encode_frame
from .handshake import Handshake, check_answer, hmac_answer, negotiate
from .messages import MESSAGES, decode_message, int_from_json, int_to_json

DEFAULT_ROOT = pathlib.Path(__file__).resolve().parents[2] / "conformance" / "protocol"


# --- JSON forms, shared with conformance/protocol/tools/make_vectors.py --------------------------

def header_to_json(h: FrameHeader) -> dict:
    return {"version": list(h.version), "type": int(h.msg_type), "flags": h.flags, "epoch": int_to_json(h.epoch),
            "stream": h.stream, "seq": int_to_json(h.seq), "length": int_to_json(h.length), "crc": h.crc}


def frame_to_json(h: FrameHeader, payload: bytes) -> dict:
    msg = decode_message(h, payload)
    return {"header": header_to_json(h), "message_type": type(msg).__name__, "message": msg.to_json()}


def encode_from_json(frame: dict) -> bytes:
    """The frame's bytes, encoded from its JSON alone (its `length` and `crc` are not used:
    comparing with the stream checks them). `trailing`, when present, is the hex of bytes
    that a Hello of a newer minor carries after the fields this version knows."""
    h = frame["header"]
    cls = next(c for c in MESSAGES.values() if c.__name__ == frame["message_type"])
    payload = cls.from_json(frame["message"]).encode() + bytes.fromhex(frame.get("trailing", ""))
    return encode_frame(cls.TYPE, payload, epoch=int_from_json(h["epoch"]), stream=h["stream"],
                        seq=int_from_json(h["seq"]), flags=h["flags"], version=tuple(h["version"]))


def stream_bytes(vector: dict) -> bytes:
    return bytes.fromhex("".join("".join(s.split()) for s in vector["hex"]))


def decode_stream(data: bytes, decoder: dict, *, bytewise: bool = False) -> list[dict]:
    """Decode `data` as a receiver configured by `decoder` does; the frames as JSON.
    ProtocolError on the first fault; a stale frame's error too, after the whole stream."""
    epoch = decoder.get("expected_epoch")
    dec = FrameDecoder(max_payload=int_from_json(decoder.get("max_payload", MAX_PAYLOAD)),
                       expected_epoch=None if epoch is None else int_from_json(epoch), check_seq=True,
                       next_seq={int(k): int_from_json(v) for k, v in decoder.get("next_seq", {}).items()})
    frames = []
    chunks = [data[i:i + 1] for i in range(len(data))] if bytewise else [data]
    for chunk in chunks:
        frames += dec.feed(chunk)
    dec.close()
    out = [frame_to_json(h, p) for h, p in frames]
    if dec.discarded:
        raise dec.discarded[0]
    return out


# --- the checks -------------------------------------------------------------------------------------

def _describe(err: BaseException) -> str:
    return str(err) if isinstance(err, DTMError) else f"{type(err).__name__} (not a DTMError): {err}"


def check_valid(vector: dict) -> str | None:
    try:
        data = stream_bytes(vector)
        for bytewise in (False, True):
            got = decode_stream(data, vector.get("decoder", {}), bytewise=bytewise)
            want = [{k: f[k] for k in ("header", "message_type", "message")} for f in vector["frames"]]
            if got != want:
                first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
                how = "one byte at a time" if bytewise else "at once"
                return (f"decoded {how}, frame {first} differs: got {got[first] if first < len(got) else 'nothing'}, "
                        f"expected {want[first] if first < len(want) else 'nothing'}")
        encoded = b"".join(encode_from_json(f) for f in vector["frames"])
        if encoded != data:
            return f"encoding the frames' JSON gives {encoded.hex()}, the vector holds {data.hex()}"
    except Exception as e:  # noqa: BLE001 - a runner reports every failure as a result
        return f"failed: {_describe(e)}"
    return None


def check_invalid(vector: dict, code: str) -> str | None:
    if code not in {c.value for c in ErrorCode}:
        return f"manifest code {code!r} is not an ErrorCode"
    for bytewise in (False, True):
        try:
            decode_stream(stream_bytes(vector), vector.get("decoder", {}), bytewise=bytewise)
        except ProtocolError as e:
            if e.code.value != code:
                return f"want {code}, got {_describe(e)}"
            continue
        except Exception as e:  # noqa: BLE001
            return f"want {code}, got {_describe(e)}"
        return f"want {code}, but the stream decoded"
    return None


def _hs(role: str, token: bytes, params: dict) -> Handshake:
    return Handshake(role, token, level=params["level"], caps=int_from_json(params["caps"]), rank=params["rank"],
                     name=params["name"], max_payload=int_from_json(params["max_payload"]),
                     versions=[tuple(v) for v in params["versions"]],
                     challenge=bytes.fromhex(params["challenge"]))


def check_transcript(t: dict) -> str | None:
    """Both sides of a handshake, from their parameters, send exactly `frames`."""
    token = bytes.fromhex(t["token"])
    conn, acc = _hs("connect", token, t["connect"]), _hs("accept", token, t["accept"])
    to_acc, to_conn = FrameDecoder(check_seq=True), FrameDecoder(check_seq=True)

    def only(frames: list) -> tuple[FrameHeader, bytes]:
        if len(frames) != 1:
            raise ValueError(f"expected one frame, decoded {len(frames)}")
        return frames[0]

    sent = conn.start()                                      # Hello(cC)
    sent += acc.receive(*only(to_acc.feed(sent[0])))         # Hello(cA, answer)
    sent += conn.receive(*only(to_conn.feed(sent[1])))       # Hello(cC, answer)
    acc.receive(*only(to_acc.feed(sent[2])))
    want = [bytes.fromhex("".join(f.split())) for f in t["frames"]]
    if sent != want:
        i = next((i for i, (a, b) in enumerate(zip(sent, want)) if a != b), min(len(sent), len(want)))
        return f"frame {i} differs: sent {sent[i].hex() if i < len(sent) else 'nothing'}"
    if not (conn.done and acc.done) or [list(conn.version), list(acc.version)] != [t["version"]] * 2:
        return f"done {conn.done}/{acc.done}, versions {conn.version}/{acc.version}, expected {t['version']}"
    return None


def check_refusal(t: dict) -> str | None:
    """The `role` side, fed `receive` (after sending what it sends), refuses with `code`."""
    hs = _hs(t["role"], bytes.fromhex(t["token"]), t["params"])
    hs.start()
    dec = FrameDecoder(check_seq=True)
    try:
        for f in t["receive"]:
            for h, p in dec.feed(bytes.fromhex("".join(f.split()))):
                hs.receive(h, p)
    except ProtocolError as e:
        return None if e.code.value == t["code"] else f"want {t['code']}, got {_describe(e)}"
    return f"want {t['code']}, but the handshake accepted every frame"


def check_handshake(doc: dict) -> list[VectorResult]:
    results = []

    def run(name: str, fn, *args) -> None:
        try:
            problem = fn(*args)
        except Exception as e:  # noqa: BLE001
            problem = f"failed: {_describe(e)}"
        results.append(VectorResult(name, "handshake", problem is None, problem or ""))

    def hmac_case(c: dict) -> str | None:
        args = (bytes.fromhex(c["token"]), bytes.fromhex(c["challenge"]))
        kw = {"responder_challenge": bytes.fromhex(c["responder_challenge"]), "role": c["role"]}
        if "code" not in c:
            got = hmac_answer(*args, **kw).hex()
            return None if got == c["answer"] else f"answer {got}, expected {c['answer']}"
        try:
            check_answer(*args, bytes.fromhex(c["answer"]), **kw)
        except ProtocolError as e:
            return None if e.code.value == c["code"] else f"want {c['code']}, got {_describe(e)}"
        return f"want {c['code']}, but the answer was accepted"

    def negotiate_case(c: dict) -> str | None:
        ours, theirs = [tuple(v) for v in c["ours"]], [tuple(v) for v in c["theirs"]]
        try:
            got = negotiate(ours, theirs)
        except ProtocolError as e:
            return None if e.code.value == c.get("code") else f"want {c.get('result')}, got {_describe(e)}"
        return None if list(got) == c.get("result") else f"negotiated {got}, expected {c.get('result') or c['code']}"

    for c in doc.get("hmac", []):
        run(f"hmac {c['name']}", hmac_case, c)
    for c in doc.get("negotiate", []):
        run(f"negotiate {c['name']}", negotiate_case, c)
    for t in doc.get("transcripts", []):
        run(f"transcript {t['name']}", check_transcript, t)
    for t in doc.get("refusals", []):
        run(f"refusal {t['name']}", check_refusal, t)
    return results


def load_manifest(root: pathlib.Path | None = None) -> dict:
    root = pathlib.Path(root) if root is not None else DEFAULT_ROOT
    with open(root / "manifest.json", encoding="utf-8") as f:
        return json.load(f)


def run_protocol_vectors(root: pathlib.Path | None = None) -> list[VectorResult]:
    """Run every vector under `root` (default: the repository's conformance/protocol): the
    CRC32C check values, then valid and invalid streams sorted by name, then the handshake."""
    root = pathlib.Path(root) if root is not None else DEFAULT_ROOT
    manifest = manifest_or_failure(root)
    if isinstance(manifest, VectorResult):
        return [manifest]
    results = []
    for c in manifest.get("crc32c", []):
        got = f"{crc32c(bytes.fromhex(c['hex'])):08x}"
        results.append(VectorResult(c["name"], "crc32c", got == c["crc"], f"CRC32C {got}, expected {c['crc']}"
                                    if got != c["crc"] else ""))
    for kind in ("valid", "invalid"):
        entries = manifest.get(kind, {})
        files = {p.stem: p for p in (root / kind).glob("*.json")}
        for name in sorted(set(entries) | set(files)):
            if name not in files:
                problem = f"in the manifest, but {kind}/{name}.json is missing"
            elif name not in entries:
                problem = f"{kind}/{name}.json has no manifest entry"
            else:
                try:
                    vector = json.loads(files[name].read_text(encoding="utf-8"))
                except (OSError, ValueError) as e:
                    problem = f"cannot read {kind}/{name}.json: {e}"
                else:
                    problem = check_valid(vector) if kind == "valid" else check_invalid(vector, entries[name].get("code"))
            results.append(VectorResult(name, kind, problem is None, problem or ""))
    try:
        doc = json.loads((root / "handshake.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return results + [VectorResult("handshake.json", "handshake", False, f"cannot read it: {e}")]
    return results + check_handshake(doc)


__all__ = ["VectorResult", "run_protocol_vectors", "summary", "load_manifest", "check_valid", "check_invalid",
           "check_handshake", "header_to_json", "frame_to_json", "encode_from_json", "decode_stream", "DEFAULT_ROOT"]
