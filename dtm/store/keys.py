"""Store keys (spec 9.2.1): validation, the bound on their size, and the names of the
version directories under them (9.2.3).

A key is a `/`-separated path of segments. The rules keep every key a safe relative path on
any file system the store lands on (no `..` escapes, no absolute paths, no control bytes),
and keep `@`-prefixed names free for the store's own version directories."""

from __future__ import annotations

from .errors import InvalidKey

MAX_KEY_BYTES = 1024      # UTF-8 bytes in a whole key
MAX_SEGMENT_BYTES = 255   # UTF-8 bytes in one segment: the file-name limit of common file systems

_FORBIDDEN = {chr(c) for c in range(0x20)} | {"\x7f", "\\"}


def check_key(key: object) -> str:
    """`key` as a valid store key (bytes are decoded as UTF-8), or InvalidKey (E1101)."""
    if isinstance(key, bytes):
        try:
            key = key.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidKey(key, "not valid UTF-8") from None
    if not isinstance(key, str):
        raise InvalidKey(key, f"a key is a string, not {type(key).__name__}")
    if not key:
        raise InvalidKey(key, "empty")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidKey(key, "not valid UTF-8 (a lone surrogate)") from None
    if size > MAX_KEY_BYTES:
        raise InvalidKey(key, f"{size} UTF-8 bytes, the bound is {MAX_KEY_BYTES}")
    bad = _FORBIDDEN.intersection(key)
    if bad:
        raise InvalidKey(key, f"holds the forbidden character {min(bad)!r}")
    for seg in key.split("/"):
        _check_segment(key, seg)
    return key


def _check_segment(key: str, seg: str) -> None:
    if not seg:
        raise InvalidKey(key, "an empty segment (a leading, trailing or doubled '/')")
    if seg in (".", ".."):
        raise InvalidKey(key, f"the segment {seg!r} would leave the key's directory")
    if seg.startswith("@"):
        raise InvalidKey(key, f"the segment {seg!r} starts with '@', which the store reserves")
    if len(seg.encode("utf-8")) > MAX_SEGMENT_BYTES:
        raise InvalidKey(key, f"a segment longer than {MAX_SEGMENT_BYTES} UTF-8 bytes")


def version_dir(key: str, vid: int) -> str:
    """The directory of version `vid` (random bits, below 2**64) of `key`: `data/KEY/@` and
    16 lowercase hex digits."""
    return f"data/{key}/@{vid:016x}"
