"""The field primitives every message payload is built from (spec 9.1.5): fixed-width
little-endian integers and floats, strings with a u16 byte count, lists with a count that
is bounded by the bytes that remain before anything is allocated. No field describes its
own type: the message type and the frame's protocol version fix the layout, so a payload is
read without pickle, eval or any schema sent by the peer.
"""

from __future__ import annotations

import math
import struct

from ..errors import ErrorCode as E
from .errors import ProtocolError

_FMT = {"u8": "<B", "u16": "<H", "u32": "<I", "u64": "<Q", "i32": "<i", "i64": "<q", "f64": "<d"}
_STRUCTS = {k: struct.Struct(v) for k, v in _FMT.items()}
_GROUPS: dict[tuple[str, ...], struct.Struct] = {}  # Reader.fields' layouts, by their kinds
MAX_STR_BYTES = 0xFFFF  # a string's byte count is a u16


class Writer:
    """Appends fields to a bytearray. Out-of-range values are a bug of the sender: ValueError."""

    def __init__(self) -> None:
        self.out = bytearray()

    def _put(self, kind: str, value, name: str) -> None:
        try:
            self.out += _STRUCTS[kind].pack(value)
        except struct.error as e:
            raise ValueError(f"field {name}: {value!r} does not fit a {kind} ({e})") from None

    def u8(self, v: int, name: str) -> None: self._put("u8", v, name)
    def u16(self, v: int, name: str) -> None: self._put("u16", v, name)
    def u32(self, v: int, name: str) -> None: self._put("u32", v, name)
    def u64(self, v: int, name: str) -> None: self._put("u64", v, name)
    def i32(self, v: int, name: str) -> None: self._put("i32", v, name)
    def i64(self, v: int, name: str) -> None: self._put("i64", v, name)
    def f64(self, v: float, name: str) -> None: self._put("f64", v, name)

    def raw(self, b: bytes, size: int, name: str) -> None:
        if len(b) != size:
            raise ValueError(f"field {name}: needs exactly {size} bytes, found {len(b)}")
        self.out += b

    def str(self, s: str, name: str) -> None:
        data = s.encode("utf-8")  # raises on a lone surrogate: such a string cannot travel
        if len(data) > MAX_STR_BYTES:
            raise ValueError(f"field {name}: {len(data)} UTF-8 bytes, the limit is {MAX_STR_BYTES}")
        self.u16(len(data), name)
        self.out += data


class Reader:
    """Reads fields from one payload; every fault is ProtocolError E0910 naming the
    message, the field and the offset."""

    def __init__(self, payload, what: str):
        view = memoryview(payload)
        self.buf = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        self.pos = 0
        self.what = what

    def fail(self, message: str) -> ProtocolError:
        return ProtocolError(E.BAD_PAYLOAD, f"{self.what} payload: {message}")

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos

    def _need(self, n: int, name: str) -> None:
        if n > self.left:
            raise self._short(n, name)

    def _short(self, n: int, name: str) -> ProtocolError:
        return self.fail(f"field {name} needs {n} bytes at offset {self.pos}, {self.left} left")

    # The readers below are inlined (no _need, no property): a coordinator reads thousands of
    # heartbeats a second and a member a MeshView of thousands of members.

    def _get(self, kind: str, name: str):
        s = _STRUCTS[kind]
        end = self.pos + s.size
        if end > len(self.buf):
            raise self._short(s.size, name)
        (v,) = s.unpack_from(self.buf, self.pos)
        self.pos = end
        return v

    def fields(self, *spec: tuple[str, str]) -> tuple:
        """Several fixed-width fields, (kind, name) each, read at once: the values and
        faults of reading them one by one."""
        kinds = tuple(kind for kind, _ in spec)
        group = _GROUPS.get(kinds)
        if group is None:
            group = _GROUPS[kinds] = struct.Struct("<" + "".join(_FMT[k][1:] for k in kinds))
        if self.pos + group.size > len(self.buf):
            for kind, name in spec:  # raises at the first field that does not fit
                self._get(kind, name)
        values = group.unpack_from(self.buf, self.pos)
        for (kind, name), v in zip(spec, values):
            if kind == "f64":
                self._finite(v, name)
        self.pos += group.size
        return values

    def u8(self, name: str) -> int: return self._get("u8", name)
    def u16(self, name: str) -> int: return self._get("u16", name)
    def u32(self, name: str) -> int: return self._get("u32", name)
    def u64(self, name: str) -> int: return self._get("u64", name)
    def i32(self, name: str) -> int: return self._get("i32", name)
    def i64(self, name: str) -> int: return self._get("i64", name)

    def f64(self, name: str) -> float:
        return self._finite(self._get("f64", name), name)

    def _finite(self, v: float, name: str) -> float:
        if not math.isfinite(v):
            raise self.fail(f"field {name} is {v}, not a finite number")
        return v

    def raw(self, size: int, name: str) -> bytes:
        self._need(size, name)
        b = bytes(self.buf[self.pos:self.pos + size])
        self.pos += size
        return b

    def view(self, size: int, name: str) -> memoryview:
        """`size` bytes without a copy (tensor data)."""
        self._need(size, name)
        v = self.buf[self.pos:self.pos + size]
        self.pos += size
        return v

    def str(self, name: str) -> str:
        buf, pos = self.buf, self.pos
        if pos + 2 > len(buf):
            raise self._short(2, name)
        n = buf[pos] | buf[pos + 1] << 8
        self.pos = pos = pos + 2
        if pos + n > len(buf):
            raise self._short(n, name)
        try:
            s = str(buf[pos:pos + n], "utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"field {name} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        self.pos = pos + n
        return s

    def count(self, kind: str, name: str, *, item_bytes: int, limit: int) -> int:
        """A list's count, refused when it exceeds `limit` or when `item_bytes` (the least
        size of one item) times it exceeds what remains: so no list outgrows its payload."""
        n = self._get(kind, name)
        if n > limit:
            raise self.fail(f"field {name} counts {n} items, the limit is {limit}")
        if n * item_bytes > self.left:
            raise self.fail(f"field {name} counts {n} items of at least {item_bytes} bytes, {self.left} bytes left")
        return n

    def end(self) -> None:
        if self.left:
            raise self.fail(f"{self.left} byte(s) after the last field (offset {self.pos})")
