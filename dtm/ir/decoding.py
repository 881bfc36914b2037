"""Canonical bytes -> Module: the reader of encoding.py's format (spec section "Canonical
encoding"), strict enough that one module has exactly one encoding: every count is bounded
by the bytes left before anything is allocated, varints must be minimal, declarations must
not repeat and each attribute of a known op must be written as the encoder writes it.
"""

from __future__ import annotations

from typing import Any

from ..errors import ErrorCode as E
from .diagnostics import IRError
from .dtypes import DTYPES
from .encoding import F64, MAGIC, MAX_ENCODED_BYTES, attr_bytes
from .gcpause import gc_paused
from .module import Func, Module, Op, Task, Value
from .registry import REGISTRY
from .symbolic import SymDim, _normalize
from .types import Literal, Mesh, Placement, Sharding, TensorType
from .versioning import check_readable

class _Reader:
    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def fail(self, code: E, message: str):
        raise IRError(code, f"{message} (at byte {self.pos})")

    def byte(self) -> int:
        if self.pos >= len(self.data):
            self.fail(E.TRUNCATED_ENCODING, "input ends early")
        b = self.data[self.pos]
        self.pos += 1
        return b

    def uvar(self) -> int:
        n = shift = 0
        while True:
            b = self.byte()
            n |= (b & 0x7F) << shift
            if not b & 0x80:
                if b == 0 and shift:
                    self.fail(E.BAD_ENCODING, "varint is not minimal (a trailing zero byte)")
                return n
            shift += 7
            if shift >= 70:  # 10 bytes: enough for the zigzag of every i64 and u64 value
                self.fail(E.BAD_ENCODING, "varint longer than 10 bytes")

    def svar(self) -> int:
        n = self.uvar()
        return (n >> 1) if not n & 1 else -((n + 1) >> 1)

    def count(self, min_bytes_each: int = 1) -> int:
        """A count of items that follow; bounded by the bytes left, so nothing huge is allocated."""
        n = self.uvar()
        if n * min_bytes_each > len(self.data) - self.pos:
            self.fail(E.TRUNCATED_ENCODING, f"count {n} exceeds the {len(self.data) - self.pos} bytes left")
        return n

    def raw(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            self.fail(E.TRUNCATED_ENCODING, f"needs {n} bytes, {len(self.data) - self.pos} left")
        b = bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        return b

    def str(self) -> str:
        b = self.raw(self.count())
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(E.BAD_ENCODING, "string is not valid UTF-8")

    def dtype(self):
        name = self.str()
        d = DTYPES.get(name)
        if d is None:
            self.fail(E.BAD_ENCODING, f"unknown dtype {name!r}")
        return d

    def dim(self):
        tag = self.byte()
        if tag == 0:
            return self.svar()
        if tag != 1:
            self.fail(E.BAD_ENCODING, f"bad dim tag {tag}")
        terms = {}
        for _ in range(self.count(2)):
            coef = self.svar()
            mono = tuple(self.str() for _ in range(self.count()))
            if coef == 0 or mono in terms or list(mono) != sorted(mono):
                self.fail(E.BAD_ENCODING, "symbolic dim is not in normal form")
            terms[mono] = coef
        d = _normalize(terms)
        if not isinstance(d, SymDim) or d.terms != tuple(terms.items()):
            self.fail(E.BAD_ENCODING, "symbolic dim is not in normal form")
        return d

    def type(self) -> TensorType:
        dtype = self.dtype()
        return TensorType(dtype, tuple(self.dim() for _ in range(self.count())))

    def sharding(self) -> Sharding | None:
        tag = self.byte()
        if tag == 0:
            return None
        if tag != 1:
            self.fail(E.BAD_ENCODING, f"bad sharding tag {tag}")
        mesh = self.str()
        placements = []
        for _ in range(self.count()):
            k = self.byte()
            if k == 0:
                placements.append(Placement("replicate"))
            elif k == 1:
                placements.append(Placement("shard", self.uvar()))
            elif k == 2:
                placements.append(Placement("partial", self.str()))
            else:
                self.fail(E.BAD_ENCODING, f"bad placement tag {k}")
        return Sharding(mesh, tuple(placements))

    def attr(self, depth: int = 0) -> Any:
        tag = self.byte()
        if tag == 0:
            return self.svar()
        if tag == 1:
            return F64.unpack(self.raw(8))[0]
        if tag == 2:
            b = self.byte()
            if b > 1:
                self.fail(E.BAD_ENCODING, f"bad bool byte {b}")
            return bool(b)
        if tag in (3, 7):
            return self.str()
        if tag == 4:
            return self.dtype()
        if tag == 5:
            if depth > 8:
                self.fail(E.LIMIT_EXCEEDED, "attribute lists nest too deep")
            return tuple(self.attr(depth + 1) for _ in range(self.count()))
        if tag == 6:
            return self.dim()
        if tag == 8:
            dtype = self.dtype()
            if dtype.is_quant:
                self.fail(E.BAD_ENCODING, "a literal cannot be quantized")
            shape = tuple(self.uvar() for _ in range(self.count()))
            if any(d >= 2**31 for d in shape):
                self.fail(E.LIMIT_EXCEEDED, f"literal of shape {list(shape)}: a literal dim must be < 2^31")
            data = self.raw(self.count())
            n = 1
            for d in shape:
                n *= d
            if n * dtype.itemsize != len(data):
                self.fail(E.BAD_ENCODING, f"literal of shape {list(shape)} needs {n * dtype.itemsize} bytes, has {len(data)}")
            return Literal(dtype, shape, data)
        if tag == 9:
            return None
        self.fail(E.BAD_ENCODING, f"bad attribute tag {tag}")


def decode(data: bytes) -> Module:
    """A Module from canonical bytes. Raises IRError on anything malformed; run `verify` on
    the result to check its meaning. Value names are their definition indices."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise IRError(E.BAD_ENCODING, f"decode() takes bytes, not {type(data).__name__}")
    if len(data) > MAX_ENCODED_BYTES:
        raise IRError(E.LIMIT_EXCEEDED, f"encoding is {len(data)} bytes; the limit is {MAX_ENCODED_BYTES}")
    with gc_paused():
        return _decode(bytes(data))


def _decode(data: bytes) -> Module:
    r = _Reader(data)
    r.pos = len(MAGIC)
    if bytes(data[:len(MAGIC)]) != MAGIC:
        raise IRError(E.BAD_ENCODING, "not a DTM IR encoding (bad magic)")
    version = (r.uvar(), r.uvar())
    check_readable(version)
    m = Module(version)
    names: set[str] = set()

    def declare(name: str) -> str:
        if name in names:
            r.fail(E.BAD_ENCODING, f"@{name} is declared twice")
        names.add(name)
        return name

    for _ in range(r.count()):
        name = declare(r.str())
        axes = tuple((r.str(), r.uvar()) for _ in range(r.count()))
        m.meshes[name] = Mesh(name, axes)
    for _ in range(r.count()):
        f = _decode_func(r, declare(r.str()))
        m.funcs[f.name] = f
    for _ in range(r.count()):
        name = declare(r.str())
        func = r.str()
        inputs, outputs, after = (tuple(r.str() for _ in range(r.count())) for _ in range(3))
        m.tasks[name] = Task(name, func, inputs, outputs, after)
    if r.pos != len(r.data):
        r.fail(E.BAD_ENCODING, f"{len(r.data) - r.pos} trailing bytes")
    return m


def _decode_func(r: _Reader, name: str) -> Func:
    values: list[Value] = []

    def new(t: TensorType, sh: Sharding | None) -> Value:
        v = Value(t, str(len(values)), sh)
        values.append(v)
        return v

    def ref() -> Value:
        i = r.uvar()
        if i >= len(values):
            r.fail(E.BAD_ENCODING, f"value index {i} is not defined yet (only {len(values)} are)")
        return values[i]

    params = [new(r.type(), r.sharding()) for _ in range(r.count())]
    result_types = [(r.type(), r.sharding()) for _ in range(r.count())]
    ops = []
    for _ in range(r.count(3)):
        opname = r.str()
        operands = tuple(ref() for _ in range(r.count()))
        attrs = {}
        for _ in range(r.count()):
            k = r.str()
            if k in attrs:
                r.fail(E.BAD_ENCODING, f"{opname}: attribute {k!r} appears twice")
            start = r.pos
            attrs[k] = r.attr()
            _check_canonical_attr(r, opname, k, attrs[k], start)
        results = tuple(new(r.type(), r.sharding()) for _ in range(r.count()))
        ops.append(Op(opname, operands, attrs, results))
    returns = [ref() for _ in range(r.count())]
    return Func(name, params, result_types, ops, returns)


def _check_canonical_attr(r: _Reader, opname: str, name: str, value: Any, start: int) -> None:
    """One module, one encoding: an attribute of a known op must be written exactly as the
    encoder writes a value of its kind (a dim as a dim, a mesh as a symbol reference, ...)."""
    opdef = REGISTRY.get(opname)
    spec = opdef.attr_index.get(name) if opdef is not None else None
    if spec is None:
        return  # the verifier reports unknown ops and attributes
    try:
        canonical = attr_bytes(spec, value)
    except (AttributeError, TypeError, ValueError, IRError):
        canonical = None
    if canonical != r.data[start:r.pos]:
        r.fail(E.BAD_ENCODING, f"{opname}: attribute {name!r} is not in the canonical encoding of a {spec.kind.value}")


__all__ = ["decode"]
