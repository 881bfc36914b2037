"""Message payloads (spec 9.1.5): one frozen dataclass per `MsgType`, each with `encode()`
and `decode(payload)`, built from the primitives of `payload.py` in the field order the
spec's tables give. Constructing a message checks it, so a decoded message is a valid one
and an invalid one is refused at the sender too (ProtocolError E0910).

    frame = encode_message(Heartbeat(rank=1, ...), epoch=3, stream=0, seq=7)
    header, payload = FrameDecoder().feed(frame)[0]
    msg = decode_message(header, payload)

Data frames carry tensor bytes: `frame_parts(Data(...), ...)` gives the buffers to hand to
`sendmsg` without copying the tensor, and `Data.decode` returns the bytes as a memoryview
of the payload.
"""

from __future__ import annotations

import dataclasses
import math
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from ..errors import DTMError
from ..errors import ErrorCode as E
from ..ir.attrs import MAX_DIM, MAX_RANK
from ..ir.dtypes import DTYPES
from ..ir.registry import COLLECTIVES
from ..ir.types import REDUCE_OPS
from .caps import MAX_LEVEL, level_caps
from .errors import ProtocolError
from .compressed import check_chunk
from .frame import FLAG_COMPRESSED, PROTOCOL_VERSION, Buffer, FrameHeader, MsgType, encode_header
from .payload import MAX_STR_BYTES, Reader, Writer

CHALLENGE_SIZE = 32
ANSWER_SIZE = 32  # HMAC-SHA256
MIN_MAX_PAYLOAD = 1 << 16  # every control message fits; a peer accepting less cannot take part
MAX_VERSIONS = 16
MAX_MEMBERS = 1 << 20  # ranks of a mesh or a group
MAX_AXES = 16
DATA_HEADER_SIZE = 32
_DATA_HEADER = struct.Struct("<QIIQQ")  # seq, chunk, step, offset, nbytes

# What a CollectiveStart may name: the IR's collectives, and `reduce`, which only the wire has.
COLLECTIVE_OPS = (*COLLECTIVES, "reduce")
_REDUCING = ("all_reduce", "reduce_scatter", "reduce")
_ROOTED = ("broadcast", "reduce")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CODE = re.compile(r"E[0-9]{4}")


class Message:
    """Base of the message dataclasses. A subclass sets TYPE, and `_check` for what its
    fields must satisfy. A message of scalar fields lists them in WIRE, in the order of its
    spec table, with their primitive (a `Writer`/`Reader` method name); one with lists or
    nested records writes `_write` and `_read` itself."""

    TYPE: ClassVar[MsgType]
    WIRE: ClassVar[tuple[tuple[str, str], ...]] = ()
    _JSON_IN: ClassVar[dict[str, Callable[[Any], Any]]] = {}

    def __post_init__(self) -> None:
        problem = self._check()
        if problem:
            raise ProtocolError(E.BAD_PAYLOAD, f"{type(self).__name__}: {problem}")

    def _check(self) -> str | None:
        return None

    def _write(self, w: Writer) -> None:
        for name, kind in self.WIRE:
            getattr(w, kind)(getattr(self, name), name)

    @classmethod
    def _read(cls, r: Reader) -> "Message":
        return cls(**{name: getattr(r, kind)(name) for name, kind in cls.WIRE})

    def parts(self) -> list[Buffer]:
        """The payload as buffers to send back to back, written once per message: a
        coordinator sends one MeshView, notice or heartbeat to every member, and a view of
        thousands of members takes milliseconds to write."""
        cached = self.__dict__.get("_payload")
        if cached is None:
            w = Writer()
            self._write(w)
            cached = [bytes(w.out)]
            object.__setattr__(self, "_payload", cached)  # frozen: the fields, not this memo
        return cached

    def encode(self) -> bytes:
        return b"".join(bytes(p) for p in self.parts())

    @classmethod
    def decode(cls, payload: Buffer, *, allow_trailing: bool = False):
        r = Reader(payload, cls.__name__)
        msg = cls._read(r)
        if not allow_trailing:
            r.end()
        return msg

    def to_json(self) -> dict:
        """The fields as JSON values: bytes as lowercase hex, tuples as lists."""
        return {f.name: _to_json(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, obj: dict):
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        if set(obj) != set(fields):
            raise ValueError(f"{cls.__name__} has fields {list(fields)}, the JSON has {sorted(obj)}")
        return cls(**{k: cls._JSON_IN.get(k, _JSON_INTS.get(fields[k], _tuples))(v) for k, v in obj.items()})


# Integers past 2^53 are written as decimal strings: many JSON parsers read every number as
# an f64 and would round them (a u64 of caps, seq, epoch or offset can be that large).
JSON_EXACT = 1 << 53


def int_to_json(v: int) -> int | str:
    """An integer as the vectors' JSON writes it: a number, or a decimal string past 2^53."""
    return str(v) if abs(v) > JSON_EXACT else v


def int_from_json(v: Any) -> int:
    """An integer of the vectors' JSON: a number, or a string of decimal digits."""
    if isinstance(v, str) and re.fullmatch(r"-?[0-9]+", v):
        return int(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise ValueError(f"expected an integer (a JSON number or a decimal string), found {v!r}")


_JSON_INTS: dict[str, Callable[[Any], Any]] = {"int": int_from_json,
                                               "tuple[int, ...]": lambda v: tuple(map(int_from_json, v))}


def _to_json(v: Any) -> Any:
    if isinstance(v, int) and not isinstance(v, bool):
        return int_to_json(v)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).hex()
    if dataclasses.is_dataclass(v):
        return {f.name: _to_json(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, tuple):
        return [_to_json(x) for x in v]
    return v


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _hex(v: str) -> bytes:
    return bytes.fromhex(v)


def _str_ok(name: str, s: str) -> str | None:
    if not isinstance(s, str):
        return f"{name} must be a string, found {type(s).__name__}"
    if s.isascii():  # one byte a character, nothing to encode (a MeshView checks thousands of them)
        n = len(s)
    else:
        try:
            n = len(s.encode("utf-8"))
        except UnicodeEncodeError:
            return f"{name} holds a lone surrogate, which UTF-8 cannot carry"
    return f"{name} is {n} UTF-8 bytes, the limit is {MAX_STR_BYTES}" if n > MAX_STR_BYTES else None


def _first(*problems: str | None) -> str | None:
    return next((p for p in problems if p), None)


def _shape_ok(dtype: str, shape: tuple[int, ...]) -> str | None:
    return f"unknown dtype {dtype!r} (spec 2.1)" if dtype not in DTYPES else _dims_ok(shape)


def _dims_ok(shape: tuple[int, ...]) -> str | None:
    if len(shape) > MAX_RANK:
        return f"rank {len(shape)} exceeds {MAX_RANK}"
    bad = [d for d in shape if not 0 <= d < MAX_DIM]
    return f"dim {bad[0]} is outside [0, 2^62)" if bad else None


def _write_shape(w: Writer, shape: tuple[int, ...]) -> None:
    w.u8(len(shape), "rank")
    for d in shape:
        w.u64(d, "dim")


def _read_shape(r: Reader) -> tuple[int, ...]:
    n = r.count("u8", "rank", item_bytes=8, limit=MAX_RANK)
    return tuple(r.u64("dim") for _ in range(n))


# --- membership ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hello(Message):
    """First message of each side of a connection (spec 9.1.6). `versions` are (major,
    highest minor) pairs: (1, 2) speaks 1.0, 1.1 and 1.2. `answer` is empty in the
    connecting peer's first Hello, else the HMAC answer to the peer's challenge."""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    versions: tuple[tuple[int, int], ...]
    level: int
    caps: int
    max_payload: int
    rank: int
    name: str
    challenge: bytes
    answer: bytes = b""

    _JSON_IN: ClassVar = {"challenge": _hex, "answer": _hex}

    def _check(self) -> str | None:
        majors = [v[0] for v in self.versions]
        need = int(level_caps(self.level)) if 0 <= self.level <= MAX_LEVEL else 0
        return _first(
            not 1 <= len(self.versions) <= MAX_VERSIONS and f"announces {len(self.versions)} versions, "
                                                            f"1 to {MAX_VERSIONS} allowed",
            len(set(majors)) != len(majors) and f"names a major version twice: {list(self.versions)}",
            not 0 <= self.level <= MAX_LEVEL and f"level L{self.level} is not L0 to L{MAX_LEVEL}",
            (self.caps & need) != need and f"level L{self.level} implies caps {need:#x}, "
                                           f"the caps field is {self.caps:#x}",
            self.max_payload < MIN_MAX_PAYLOAD and f"max_payload {self.max_payload} is below {MIN_MAX_PAYLOAD}",
            self.rank < -1 and f"rank {self.rank} is below -1 (none)",
            _str_ok("name", self.name),
            len(self.challenge) != CHALLENGE_SIZE and f"challenge is {len(self.challenge)} bytes, "
                                                      f"not {CHALLENGE_SIZE}",
            len(self.answer) not in (0, ANSWER_SIZE) and f"answer is {len(self.answer)} bytes, "
                                                         f"not 0 or {ANSWER_SIZE}")

    def _write(self, w: Writer) -> None:
        w.u8(len(self.versions), "versions")
        for major, minor in self.versions:
            w.u8(major, "major")
            w.u8(minor, "minor")
        w.u8(self.level, "level")
        w.u64(self.caps, "caps")
        w.u64(self.max_payload, "max_payload")
        w.i32(self.rank, "rank")
        w.str(self.name, "name")
        w.raw(self.challenge, CHALLENGE_SIZE, "challenge")
        w.u8(len(self.answer), "answer")
        w.raw(self.answer, len(self.answer), "answer")

    @classmethod
    def _read(cls, r: Reader) -> "Hello":
        n = r.count("u8", "versions", item_bytes=2, limit=MAX_VERSIONS)
        versions = tuple((r.u8("major"), r.u8("minor")) for _ in range(n))
        level, caps, max_payload, rank, name = r.u8("level"), r.u64("caps"), r.u64("max_payload"), r.i32("rank"), \
            r.str("name")
        challenge = r.raw(CHALLENGE_SIZE, "challenge")
        n = r.u8("answer")
        if n not in (0, ANSWER_SIZE):
            raise r.fail(f"field answer is {n} bytes, not 0 or {ANSWER_SIZE}")
        return cls(versions, level, caps, max_payload, rank, name, challenge, r.raw(n, "answer"))


@dataclass(frozen=True)
class JoinMesh(Message):
    """A rank asks the coordinator to admit it. `rank` -1 lets the coordinator choose;
    `world_size` 0 means unknown; `host`:`port` is where the rank accepts its peers;
    ranks whose `node` is equal share a host (and may use shared memory)."""

    TYPE: ClassVar[MsgType] = MsgType.JOIN_MESH
    WIRE = (("rank", "i32"), ("world_size", "u32"), ("host", "str"), ("port", "u16"), ("node", "str"),
            ("pid", "u32"))
    rank: int
    world_size: int
    host: str
    port: int
    node: str
    pid: int

    def _check(self) -> str | None:
        return _first(self.rank < -1 and f"rank {self.rank} is below -1 (any)",
                      _str_ok("host", self.host), not self.host and "host is empty", _str_ok("node", self.node))


@dataclass(frozen=True)
class Member:
    """One rank of a MeshView; its rank is its index in `members`."""

    host: str
    port: int
    node: str


@dataclass(frozen=True)
class MeshView(Message):
    """The coordinator's word on who is in the mesh: ranks 0..n-1 in order, the mesh axes
    (their sizes multiply to n; none means one flat axis), and the epoch, which is also the
    epoch of the frame that carries it."""

    TYPE: ClassVar[MsgType] = MsgType.MESH_VIEW
    epoch: int
    heartbeat_ms: int
    timeout_ms: int
    members: tuple[Member, ...]
    axes: tuple[tuple[str, int], ...]

    _JSON_IN: ClassVar = {"members": lambda v: tuple(Member(**m) for m in v)}

    def _check(self) -> str | None:
        size = 1
        for _, n in self.axes:
            size *= n
        names = [a for a, _ in self.axes]
        return _first(
            self.epoch < 1 and "epoch 0 means no mesh; a MeshView's epoch is at least 1",
            self.heartbeat_ms < 1 and "heartbeat_ms must be at least 1",
            self.timeout_ms < self.heartbeat_ms and f"timeout_ms {self.timeout_ms} is below heartbeat_ms "
                                                    f"{self.heartbeat_ms}",
            not 1 <= len(self.members) <= MAX_MEMBERS and f"{len(self.members)} members, 1 to {MAX_MEMBERS} allowed",
            *(_first(_str_ok("host", m.host), _str_ok("node", m.node)) for m in self.members),
            len(self.axes) > MAX_AXES and f"{len(self.axes)} axes, at most {MAX_AXES}",
            *(not (isinstance(a, str) and _IDENT.fullmatch(a)) and f"axis name {a!r} is not [A-Za-z_][A-Za-z0-9_]*"
              for a in names),
            len(set(names)) != len(names) and f"axis names repeat: {names}",
            any(n < 1 for _, n in self.axes) and f"axis sizes must be at least 1: {list(self.axes)}",
            self.axes and size != len(self.members) and f"axes {list(self.axes)} hold {size} ranks, "
                                                        f"the view has {len(self.members)} members")

    def _write(self, w: Writer) -> None:
        w.u64(self.epoch, "epoch")
        w.u32(self.heartbeat_ms, "heartbeat_ms")
        w.u32(self.timeout_ms, "timeout_ms")
        w.u32(len(self.members), "members")
        for m in self.members:
            w.str(m.host, "host")
            w.u16(m.port, "port")
            w.str(m.node, "node")
        w.u8(len(self.axes), "axes")
        for name, size in self.axes:
            w.str(name, "axis")
            w.u32(size, "size")

    @classmethod
    def _read(cls, r: Reader) -> "MeshView":
        epoch, hb, timeout = r.u64("epoch"), r.u32("heartbeat_ms"), r.u32("timeout_ms")
        n = r.count("u32", "members", item_bytes=6, limit=MAX_MEMBERS)
        members = tuple(Member(r.str("host"), r.u16("port"), r.str("node")) for _ in range(n))
        n = r.count("u8", "axes", item_bytes=6, limit=MAX_AXES)
        axes = tuple((r.str("axis"), r.u32("size")) for _ in range(n))
        return cls(epoch, hb, timeout, members, axes)


# A Heartbeat's optional worker section (spec 9.1.5): bounded so that a Heartbeat with every
# row at its longest still fits the smallest max_payload a peer may announce (MIN_MAX_PAYLOAD).
MAX_WORKERS = 64
MAX_WORKER_NAME_BYTES = 64
MAX_WORKER_STATE_BYTES = 200
_WORKER_MIN_BYTES = 2 + 8 * 5 + 2  # a row of empty strings: name, five numbers, state


def cut_utf8(s: str, limit: int) -> str:
    """`s` cut to at most `limit` UTF-8 bytes, never inside a character."""
    return s.encode("utf-8", "replace")[:limit].decode("utf-8", "ignore")


@dataclass(frozen=True)
class WorkerRow:
    """One helper process of a rank (an ingest or process-task worker) in its Heartbeat:
    what `dtm top` shows in a row of its own under the rank."""

    name: str
    cpu_percent: float
    rss_bytes: int
    ops: int
    bytes_sent: int
    bytes_received: int
    state: str

    def problem(self) -> str | None:
        """Why this row cannot travel, or None."""
        return _first(
            not self.name and "a worker row's name is empty",
            _str_ok("worker name", self.name) or len(self.name.encode("utf-8")) > MAX_WORKER_NAME_BYTES
            and f"worker name {self.name[:80]!r} is over {MAX_WORKER_NAME_BYTES} UTF-8 bytes",
            not (0 <= self.cpu_percent < float("inf")) and f"worker {self.name!r}: cpu_percent {self.cpu_percent} "
                                                            "is not a finite number >= 0",
            _str_ok("worker state", self.state) or len(self.state.encode("utf-8")) > MAX_WORKER_STATE_BYTES
            and f"worker {self.name!r}: state is over {MAX_WORKER_STATE_BYTES} UTF-8 bytes")

    def write(self, w: Writer) -> None:
        w.str(self.name, "worker name")
        w.f64(self.cpu_percent, "worker cpu_percent")
        for name in ("rss_bytes", "ops", "bytes_sent", "bytes_received"):
            w.u64(getattr(self, name), f"worker {name}")
        w.str(self.state, "worker state")

    @classmethod
    def read(cls, r: Reader) -> "WorkerRow":
        return cls(r.str("worker name"), r.f64("worker cpu_percent"), r.u64("worker rss_bytes"), r.u64("worker ops"),
                   r.u64("worker bytes_sent"), r.u64("worker bytes_received"), r.str("worker state"))

    @classmethod
    def from_json(cls, obj: dict) -> "WorkerRow":
        return cls(obj["name"], float(obj["cpu_percent"]), *(int_from_json(obj[k]) for k in
                   ("rss_bytes", "ops", "bytes_sent", "bytes_received")), obj["state"])


@dataclass(frozen=True)
class Heartbeat(Message):
    """A rank's periodic sign of life, with what a monitor shows: CPU (percent of one core,
    so above 100 on several), resident memory, bytes moved, collectives completed, and a
    description of its last operation (named in PeerLost when the rank goes silent).

    `workers`, the rows of its helper processes, travel in an optional section after
    `last_op`, written only when there are some: a Heartbeat without them has the bytes of
    protocol 1.0, and a rank sends them only to a peer that announced CAP_WORKER_ROWS, so
    a receiver that reads 1.0 layouts never sees one (spec 9.1.5)."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    rank: int
    cpu_percent: float
    rss_bytes: int
    bytes_sent: int
    bytes_received: int
    ops_done: int
    last_op: str
    workers: tuple[WorkerRow, ...] = ()

    _JSON_IN: ClassVar = {"workers": lambda v: tuple(WorkerRow.from_json(w) for w in v)}

    def _check(self) -> str | None:
        names = [w.name for w in self.workers]
        return _first(not (0 <= self.cpu_percent < float("inf")) and f"cpu_percent {self.cpu_percent} is not a "
                                                                    "finite number >= 0",
                      _str_ok("last_op", self.last_op),
                      len(self.workers) > MAX_WORKERS and f"{len(self.workers)} worker rows, at most {MAX_WORKERS}",
                      len(set(names)) != len(names) and "a worker name repeats",
                      *(w.problem() for w in self.workers))

    def _write(self, w: Writer) -> None:
        w.u32(self.rank, "rank")
        w.f64(self.cpu_percent, "cpu_percent")
        for name in ("rss_bytes", "bytes_sent", "bytes_received", "ops_done"):
            w.u64(getattr(self, name), name)
        w.str(self.last_op, "last_op")
        if self.workers:
            w.u8(len(self.workers), "workers")
            for row in self.workers:
                row.write(w)

    @classmethod
    def _read(cls, r: Reader) -> "Heartbeat":
        head = (*r.fields(("u32", "rank"), ("f64", "cpu_percent"), ("u64", "rss_bytes"), ("u64", "bytes_sent"),
                          ("u64", "bytes_received"), ("u64", "ops_done")), r.str("last_op"))
        if not r.left:
            return cls(*head)
        n = r.count("u8", "workers", item_bytes=_WORKER_MIN_BYTES, limit=MAX_WORKERS)
        if n == 0:  # an empty section is not written: one encoding per Heartbeat
            raise r.fail("field workers counts 0 rows; a Heartbeat without workers has no worker section")
        return cls(*head, tuple(WorkerRow.read(r) for _ in range(n)))

    def without_workers(self) -> "Heartbeat":
        """This Heartbeat as protocol 1.0 has it (what a coordinator relays to members)."""
        return dataclasses.replace(self, workers=()) if self.workers else self

    def to_json(self) -> dict:
        obj = super().to_json()
        if not self.workers:  # the vectors' JSON of a 1.0 Heartbeat has no such field
            del obj["workers"]
        return obj

    @classmethod
    def from_json(cls, obj: dict) -> "Heartbeat":
        return super().from_json({"workers": [], **obj})


@dataclass(frozen=True)
class Leave(Message):
    """A rank leaves the mesh on purpose (a rank that vanishes without it has failed)."""

    TYPE: ClassVar[MsgType] = MsgType.LEAVE
    WIRE = (("rank", "u32"), ("reason", "str"))
    rank: int
    reason: str

    def _check(self) -> str | None:
        return _str_ok("reason", self.reason)


# --- collectives and point-to-point ------------------------------------------------------------

@dataclass(frozen=True)
class CollectiveStart(Message):
    """Announces a rank's next collective on a group, so that ranks that called different
    collectives find out at once and name both calls (`describe`), instead of hanging.
    `seq` counts the group's collectives from 0; `where` is the user's "file:line"."""

    TYPE: ClassVar[MsgType] = MsgType.COLLECTIVE_START
    seq: int
    op: str
    reduce_op: str
    dtype: str
    shape: tuple[int, ...]
    group: tuple[int, ...]
    root: int
    where: str

    def _check(self) -> str | None:
        reducing, rooted = self.op in _REDUCING, self.op in _ROOTED
        return _first(
            self.op not in COLLECTIVE_OPS and f"unknown op {self.op!r} (one of {', '.join(COLLECTIVE_OPS)})",
            reducing and self.reduce_op not in REDUCE_OPS and f"{self.op} needs reduce_op one of "
                                                              f"{', '.join(REDUCE_OPS)}, found {self.reduce_op!r}",
            not reducing and self.reduce_op and f"{self.op} takes no reduce_op, found {self.reduce_op!r}",
            _shape_ok(self.dtype, self.shape),
            not 1 <= len(self.group) <= MAX_MEMBERS and f"a group of {len(self.group)} ranks",
            len(set(self.group)) != len(self.group) and f"group {list(self.group)} names a rank twice",
            rooted and self.root not in self.group and f"{self.op} root {self.root} is not in group {list(self.group)}",
            rooted and self.root >= 1 << 31 and f"{self.op} root {self.root} does not fit the i32 root field",
            not rooted and self.root != -1 and f"{self.op} takes no root (-1), found {self.root}",
            _str_ok("where", self.where))

    def describe(self) -> str:
        """E.g. `all_reduce(sum) #3 f32[4, 8] over ranks [0, 1] at train.py:42`."""
        op = f"{self.op}({self.reduce_op})" if self.reduce_op else self.op
        root = f" root {self.root}" if self.root >= 0 else ""
        return f"{op} #{self.seq} {self.dtype}{list(self.shape)} over ranks {list(self.group)}{root} at {self.where}"

    def _write(self, w: Writer) -> None:
        w.u64(self.seq, "seq")
        w.str(self.op, "op")
        w.str(self.reduce_op, "reduce_op")
        w.str(self.dtype, "dtype")
        _write_shape(w, self.shape)
        w.u32(len(self.group), "group")
        for rank in self.group:
            w.u32(rank, "group rank")
        w.i32(self.root, "root")
        w.str(self.where, "where")

    @classmethod
    def _read(cls, r: Reader) -> "CollectiveStart":
        seq, op, reduce_op, dtype, shape = r.u64("seq"), r.str("op"), r.str("reduce_op"), r.str("dtype"), \
            _read_shape(r)
        n = r.count("u32", "group", item_bytes=4, limit=MAX_MEMBERS)
        group = tuple(r.u32("group rank") for _ in range(n))
        return cls(seq, op, reduce_op, dtype, shape, group, r.i32("root"), r.str("where"))


@dataclass(frozen=True)
class Data(Message):
    """A chunk of tensor bytes: those at byte `offset` of collective (or P2P transfer) `seq`,
    in step `step` of its algorithm. The payload is a 32-byte chunk header then the bytes,
    raw, in the layout of spec 2.3."""

    TYPE: ClassVar[MsgType] = MsgType.DATA
    seq: int
    chunk: int
    step: int
    offset: int
    data: Buffer

    _JSON_IN: ClassVar = {"data": _hex}

    # The data plane's hot path: one struct call each way instead of a Writer or Reader.
    def parts(self) -> list[Buffer]:
        try:
            return [_DATA_HEADER.pack(self.seq, self.chunk, self.step, self.offset, _nbytes(self.data)), self.data]
        except struct.error as e:
            raise ValueError(f"Data chunk header field out of range ({e}): {self.seq=}, {self.chunk=}, "
                             f"{self.step=}, {self.offset=}") from None

    @classmethod
    def decode(cls, payload: Buffer, *, allow_trailing: bool = False) -> "Data":
        view = memoryview(payload).cast("B")
        if len(view) < DATA_HEADER_SIZE:
            raise ProtocolError(E.BAD_PAYLOAD, f"Data payload: {len(view)} bytes, the chunk header alone is "
                                               f"{DATA_HEADER_SIZE}")
        seq, chunk, step, offset, nbytes = _DATA_HEADER.unpack_from(view)
        if nbytes != len(view) - DATA_HEADER_SIZE:
            raise ProtocolError(E.BAD_PAYLOAD, f"Data payload: the chunk header says {nbytes} data bytes, the "
                                               f"payload holds {len(view) - DATA_HEADER_SIZE}")
        return cls(seq, chunk, step, offset, view[DATA_HEADER_SIZE:])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Data) and (self.seq, self.chunk, self.step, self.offset) == \
            (other.seq, other.chunk, other.step, other.offset) and bytes(self.data) == bytes(other.data)



def _nbytes(buf: Buffer) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


@dataclass(frozen=True)
class P2PSend(Message):
    """Announces a point-to-point transfer of one tensor; its bytes follow in Data frames
    with the same `seq` (counting this pair's transfers from 0) on the same stream.

    `crc`, the tensor's CRC32C as the sender computed it from its array (spec 9.4.9),
    travels in an optional u32 after `where`, written only when there is one: a P2PSend
    without it has the bytes of protocol 1.0, and a rank sends one only to a peer that
    announced CAP_CHECKSUMS (spec 9.1.5)."""

    TYPE: ClassVar[MsgType] = MsgType.P2P_SEND
    seq: int
    tag: int
    dtype: str
    shape: tuple[int, ...]
    where: str
    crc: int | None = None

    _JSON_IN: ClassVar = {"crc": lambda v: None if v is None else int_from_json(v)}

    def _check(self) -> str | None:
        return _first(_shape_ok(self.dtype, self.shape), _str_ok("where", self.where),
                      self.crc is not None and not 0 <= self.crc < 1 << 32 and f"crc {self.crc} does not fit a u32")

    def _write(self, w: Writer) -> None:
        w.u64(self.seq, "seq")
        w.i64(self.tag, "tag")
        w.str(self.dtype, "dtype")
        _write_shape(w, self.shape)
        w.str(self.where, "where")
        if self.crc is not None:
            w.u32(self.crc, "crc")

    @classmethod
    def _read(cls, r: Reader) -> "P2PSend":
        head = (r.u64("seq"), r.i64("tag"), r.str("dtype"), _read_shape(r), r.str("where"))
        return cls(*head, r.u32("crc") if r.left else None)

    def to_json(self) -> dict:
        obj = super().to_json()
        if self.crc is None:  # the vectors' JSON of a 1.0 P2PSend has no such field
            del obj["crc"]
        return obj

    @classmethod
    def from_json(cls, obj: dict) -> "P2PSend":
        return super().from_json({"crc": None, **obj})


# --- errors and cancel ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Error(Message):
    """An error a peer reports before it closes the connection or abandons an operation:
    a code of the spec's table (kept as text, so a code of a newer minor still travels),
    a message, and the reporting rank (-1 if it has none yet)."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    WIRE = (("code", "str"), ("message", "str"), ("rank", "i32"))
    code: str
    message: str
    rank: int = -1

    def _check(self) -> str | None:
        return _first(not (isinstance(self.code, str) and _CODE.fullmatch(self.code))
                      and f"code {self.code!r} is not E followed by four digits",
                      _str_ok("message", self.message), self.rank < -1 and f"rank {self.rank} is below -1")

    def known_code(self) -> E:
        """The code as this side knows it; one it does not know (a newer minor's) is E0911."""
        return next((c for c in E if c.value == self.code), E.UNEXPECTED_MESSAGE)

    @classmethod
    def from_exception(cls, err: DTMError, rank: int = -1) -> "Error":
        """The Error that reports `err`, its message cut to the string limit."""
        return cls(err.code.value, cut_utf8(str(err.message), MAX_STR_BYTES), rank)


@dataclass(frozen=True)
class Cancel(Message):
    """Abandon collective (or P2P transfer) `seq` of this stream; the peers stop sending its
    Data frames and fail it with `reason`."""

    TYPE: ClassVar[MsgType] = MsgType.CANCEL
    WIRE = (("seq", "u64"), ("reason", "str"))
    seq: int
    reason: str

    def _check(self) -> str | None:
        return _str_ok("reason", self.reason)


# --- the mesh's tensor store (spec 9.2.11) ---------------------------------------------------------

STORE_OPS = ("get", "put", "info", "keys", "delete")
MAX_KEY_BYTES = 1024       # spec 9.2.1; the store checks the rest of a key's syntax
MAX_STORE_KEYS = 1 << 20   # keys in one StoreReply
FLAG_EXPECT_SHAPE = 0x01   # StoreRequest.flags: a get's `shape` is the shape it expects


@dataclass(frozen=True)
class StoreRequest(Message):
    """One operation on the part of the mesh's store a rank serves. A put's tensor bytes
    follow in Data frames with `seq` = `id`, on the same stream, `nbytes` in all."""

    TYPE: ClassVar[MsgType] = MsgType.STORE_REQUEST
    id: int
    op: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    flags: int
    nbytes: int

    def _check(self) -> str | None:
        return _first(self.op not in STORE_OPS and f"op {self.op!r} is not one of {', '.join(STORE_OPS)}",
                      _key_ok(self.key, empty=self.op == "keys"),
                      _shape_ok(self.dtype, self.shape) if self.dtype else _dims_ok(self.shape),
                      self.shape and not (self.op == "put" or self.flags & FLAG_EXPECT_SHAPE)
                      and f"a {self.op} names a shape {list(self.shape)} it does not expect",
                      not 0 <= self.flags < 256 and f"flags {self.flags} do not fit a u8",
                      self.flags & ~FLAG_EXPECT_SHAPE and f"unknown flag bits {self.flags & ~FLAG_EXPECT_SHAPE:#x}",
                      self.op != "put" and self.nbytes and f"a {self.op} carries no bytes, found nbytes {self.nbytes}",
                      self.op == "put" and not self.dtype and "a put names its tensor's dtype")

    def _write(self, w: Writer) -> None:
        w.u64(self.id, "id")
        w.str(self.op, "op")
        w.str(self.key, "key")
        w.str(self.dtype, "dtype")
        _write_shape(w, self.shape)
        w.u8(self.flags, "flags")
        w.u64(self.nbytes, "nbytes")

    @classmethod
    def _read(cls, r: Reader) -> "StoreRequest":
        return cls(r.u64("id"), r.str("op"), r.str("key"), r.str("dtype"), _read_shape(r), r.u8("flags"),
                   r.u64("nbytes"))


@dataclass(frozen=True)
class StoreReply(Message):
    """The answer to StoreRequest `id`: `code` empty for success, else an error code of
    chapter 10 and its message. A get's tensor bytes follow in Data frames with `seq` =
    `id`; `keys` lists a keys request's keys with their stored bytes."""

    TYPE: ClassVar[MsgType] = MsgType.STORE_REPLY
    id: int
    code: str
    message: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    version: int
    checksum: str
    written: float
    keys: tuple[tuple[str, int], ...]

    _JSON_IN: ClassVar = {"keys": lambda v: tuple((k, int_from_json(n)) for k, n in v)}

    def _check(self) -> str | None:
        return _first(self.code and not _CODE.fullmatch(self.code) and f"code {self.code!r} is not E and four digits",
                      self.code and (self.dtype or self.shape or self.nbytes or self.version or self.checksum
                                     or self.written or self.keys)
                      and f"an error reply ({self.code}) carries a tensor's fields; it carries none",
                      _str_ok("message", self.message), _str_ok("checksum", self.checksum),
                      self.dtype and _shape_ok(self.dtype, self.shape),
                      not self.dtype and self.shape and "a shape without a dtype",
                      not math.isfinite(self.written) and f"written {self.written} is not finite",
                      len(self.keys) > MAX_STORE_KEYS and f"{len(self.keys)} keys, at most {MAX_STORE_KEYS}",
                      *(_key_ok(k) for k, _ in self.keys))

    def _write(self, w: Writer) -> None:
        w.u64(self.id, "id")
        w.str(self.code, "code")
        w.str(self.message, "message")
        w.str(self.dtype, "dtype")
        _write_shape(w, self.shape)
        w.u64(self.nbytes, "nbytes")
        w.u64(self.version, "version")
        w.str(self.checksum, "checksum")
        w.f64(self.written, "written")
        w.u32(len(self.keys), "keys")
        for k, n in self.keys:
            w.str(k, "key")
            w.u64(n, "nbytes")

    @classmethod
    def _read(cls, r: Reader) -> "StoreReply":
        head = (r.u64("id"), r.str("code"), r.str("message"), r.str("dtype"), _read_shape(r), r.u64("nbytes"),
                r.u64("version"), r.str("checksum"), r.f64("written"))
        n = r.count("u32", "keys", item_bytes=10, limit=MAX_STORE_KEYS)
        return cls(*head, tuple((r.str("key"), r.u64("nbytes")) for _ in range(n)))


def _key_ok(key: str, empty: bool = False) -> str | None:
    n = len(key.encode("utf-8", "surrogatepass"))
    return (not key and not empty and "the key is empty") or (n > MAX_KEY_BYTES and
                                                              f"the key is {n} bytes, at most {MAX_KEY_BYTES}")


MESSAGES: dict[MsgType, type[Message]] = {
    cls.TYPE: cls for cls in (Hello, JoinMesh, MeshView, Heartbeat, Leave, CollectiveStart, Data, P2PSend, Error,
                              Cancel, StoreRequest, StoreReply)}
assert set(MESSAGES) == set(MsgType), "every message type has its payload class"
assert all(not m.WIRE or [n for n, _ in m.WIRE] == [f.name for f in dataclasses.fields(m)] for m in MESSAGES.values()), \
    "a WIRE table lists every field of its message, in order"


def frame_parts(msg: Message, *, epoch: int, stream: int, seq: int, flags: int = 0,
                version: tuple[int, int] = PROTOCOL_VERSION) -> list[Buffer]:
    """Header and payload buffers of `msg`'s frame, for `socket.sendmsg` (no copy of Data bytes)."""
    parts = msg.parts()
    return [encode_header(msg.TYPE, parts, epoch=epoch, stream=stream, seq=seq, flags=flags, version=version), *parts]


def encode_message(msg: Message, *, epoch: int, stream: int, seq: int, flags: int = 0,
                   version: tuple[int, int] = PROTOCOL_VERSION) -> bytes:
    """`msg`'s whole frame as one bytes object."""
    return b"".join(bytes(p) for p in frame_parts(msg, epoch=epoch, stream=stream, seq=seq, flags=flags,
                                                  version=version))


def decode_message(header: FrameHeader, payload: Buffer) -> Message:
    """The message of a checked frame (decode_header, verify_payload). A Hello of a newer
    minor version may carry fields this version does not know at its end: they are ignored.
    A MeshView's epoch must be its frame's; a Data frame with FLAG_COMPRESSED holds a
    well-formed compressed chunk (spec 9.5.1)."""
    cls = MESSAGES[header.msg_type]
    newer = header.version[0] == PROTOCOL_VERSION[0] and header.version[1] > PROTOCOL_VERSION[1]
    msg = cls.decode(payload, allow_trailing=cls is Hello and newer)
    if header.flags & FLAG_COMPRESSED:
        if not isinstance(msg, Data):  # (only a Data frame's data can be a compressed chunk, spec 9.5.1)
            raise ProtocolError(E.BAD_PAYLOAD, f"{header.msg_type.name} frame with the COMPRESSED flag: only a Data "
                                               "frame carries a compressed chunk")
        check_chunk(msg.data)
    if isinstance(msg, MeshView) and msg.epoch != header.epoch:
        raise ProtocolError(E.BAD_PAYLOAD, f"MeshView payload: epoch {msg.epoch} differs from its frame's "
                                           f"epoch {header.epoch}")
    return msg


__all__ = ["Message", "Hello", "JoinMesh", "Member", "MeshView", "Heartbeat", "WorkerRow", "MAX_WORKERS",
           "MAX_WORKER_NAME_BYTES", "MAX_WORKER_STATE_BYTES", "cut_utf8", "Leave", "CollectiveStart", "Data",
           "P2PSend", "Error", "Cancel", "StoreRequest", "StoreReply", "STORE_OPS", "FLAG_EXPECT_SHAPE", "MESSAGES", "frame_parts", "encode_message", "decode_message",
           "CHALLENGE_SIZE", "ANSWER_SIZE", "MIN_MAX_PAYLOAD", "MAX_MEMBERS", "MAX_AXES", "MAX_VERSIONS",
           "DATA_HEADER_SIZE", "COLLECTIVE_OPS", "REDUCE_OPS", "int_to_json", "int_from_json"]
