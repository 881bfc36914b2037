"""The canonical binary encoding (spec section "Canonical encoding"), and its decoder.

Equal meaning gives equal bytes: value names are replaced by their definition index,
declarations are sorted by name, attributes by name with every default filled in. The
module hash is sha256 of these bytes. Everything is little-endian; integers are LEB128
varints (signed ones zigzag-mapped first), strings are a varint byte length then UTF-8.

    module   := "DTMIR" 0x01 uvar(major) uvar(minor)
                uvar(#meshes) mesh*  uvar(#funcs) func*  uvar(#tasks) task*
    mesh     := str(name) uvar(#axes) (str(axis) uvar(size))*
    func     := str(name) uvar(#params) vtype*  uvar(#results) vtype*
                uvar(#ops) op*  uvar(#returns) uvar(value index)*
    op       := str(opname) uvar(#operands) uvar(value index)*
                uvar(#attrs) (str(name) attr)*  uvar(#results) vtype*
    task     := str(name) str(func) strs(inputs) strs(outputs) strs(after)
    vtype    := type sharding
    type     := str(dtype) uvar(rank) dim*
    dim      := 0x00 svar(n) | 0x01 uvar(#terms) (svar(coef) uvar(#syms) str(sym)*)*
    sharding := 0x00 | 0x01 str(mesh) uvar(#placements) placement*
    placement:= 0x00 (replicate) | 0x01 uvar(dim) (shard) | 0x02 str(op) (partial)
    attr     := 0x00 svar (int) | 0x01 f64 (float) | 0x02 u8 (bool) | 0x03 str (string)
              | 0x04 str (dtype) | 0x05 uvar(n) attr* (list) | 0x06 dim (dim)
              | 0x07 str (symbol ref) | 0x08 str(dtype) uvar(rank) uvar* uvar(n) bytes (literal)
              | 0x09 (none)

Values are numbered in definition order: parameters first, then each op's results.
"""

from __future__ import annotations

import struct
from typing import Any

from ..errors import ErrorCode as E
from .diagnostics import IRError
from .gcpause import gc_paused
from .dtypes import DTYPES
from .module import Func, Module, Op, Task, Value
from .registry import REGISTRY, AttrKind, AttrSpec
from .symbolic import SymDim, _normalize
from .types import Literal, Mesh, Placement, Sharding, TensorType
from .versioning import check_readable, check_target

MAGIC = b"DTMIR\x01"
MAX_ENCODED_BYTES = 1 << 32
_F64 = struct.Struct("<d")


class _Writer:
    def __init__(self):
        self.buf = bytearray()

    def uvar(self, n: int) -> None:
        if n < 0:
            raise IRError(E.BAD_ENCODING, f"cannot encode {n} as an unsigned varint (is the module verified?)")
        buf = self.buf
        while n >= 0x80:
            buf.append((n & 0x7F) | 0x80)
            n >>= 7
        buf.append(n)

    def svar(self, n: int) -> None:
        self.uvar((n << 1) if n >= 0 else ((-n << 1) - 1))

    def str(self, s: str) -> None:
        b = s.encode("utf-8")
        self.uvar(len(b))
        self.buf += b

    def dim(self, d) -> None:
        if isinstance(d, int):
            self.buf.append(0)
            self.svar(d)
            return
        self.buf.append(1)
        self.uvar(len(d.terms))
        for mono, coef in d.terms:
            self.svar(coef)
            self.uvar(len(mono))
            for s in mono:
                self.str(s)

    def type(self, t: TensorType) -> None:
        self.str(t.dtype.name)
        self.uvar(len(t.shape))
        for d in t.shape:
            self.dim(d)

    def sharding(self, sh: Sharding | None) -> None:
        if sh is None:
            self.buf.append(0)
            return
        self.buf.append(1)
        self.str(sh.mesh)
        self.uvar(len(sh.placements))
        for p in sh.placements:
            if p.kind == "replicate":
                self.buf.append(0)
            elif p.kind == "shard":
                self.buf.append(1)
                self.uvar(p.arg)
            else:
                self.buf.append(2)
                self.str(p.arg)

    def attr(self, spec: AttrSpec, v: Any) -> None:
        k = spec.kind
        if v is None:
            self.buf.append(9)
        elif k is AttrKind.DIM:  # static or symbolic: always the dim form
            self.buf.append(6)
            self.dim(v)
        elif isinstance(v, bool):
            self.buf.append(2)
            self.buf.append(1 if v else 0)
        elif isinstance(v, int):
            self.buf.append(0)
            self.svar(v)
        elif isinstance(v, float):
            self.buf.append(1)
            self.buf += _F64.pack(v)
        elif k in (AttrKind.MESH, AttrKind.FUNC):
            self.buf.append(7)
            self.str(v)
        elif k is AttrKind.DTYPE:
            self.buf.append(4)
            self.str(v.name)
        elif isinstance(v, str):
            self.buf.append(3)
            self.str(v)
        elif isinstance(v, Literal):
            self.buf.append(8)
            self.str(v.dtype.name)
            self.uvar(len(v.shape))
            for d in v.shape:
                self.uvar(d)
            self.uvar(len(v.data))
            self.buf += v.data
        elif isinstance(v, tuple):
            self.buf.append(5)
            self.uvar(len(v))
            for x in v:
                if k is AttrKind.DIMS:
                    self.buf.append(6)
                    self.dim(x)
                elif k is AttrKind.REFS:
                    self.buf.append(7)
                    self.str(x)
                else:
                    self.attr(spec, x)
        else:
            raise IRError(E.ATTRIBUTE_TYPE, f"attribute {spec.name}: cannot encode {v!r}")


def attr_bytes(spec: AttrSpec, value: Any) -> bytes:
    """The canonical bytes of one attribute value."""
    w = _Writer()
    w.attr(spec, value)
    return bytes(w.buf)


def encode(module: Module, target: tuple[int, int] | None = None) -> bytes:
    """The canonical bytes of `module` (written for spec version `target`, default the
    module's own)."""
    version = check_target(module, target)
    w = _Writer()
    w.buf += MAGIC
    w.uvar(version[0])
    w.uvar(version[1])
    w.uvar(len(module.meshes))
    for name in sorted(module.meshes):
        mesh = module.meshes[name]
        w.str(name)
        w.uvar(len(mesh.axes))
        for a, s in mesh.axes:
            w.str(a)
            w.uvar(s)
    w.uvar(len(module.funcs))
    for name in sorted(module.funcs):
        _encode_func(w, module.funcs[name])
    w.uvar(len(module.tasks))
    for name in sorted(module.tasks):
        t = module.tasks[name]
        w.str(name)
        w.str(t.func)
        for strs in (t.inputs, t.outputs, t.after):
            w.uvar(len(strs))
            for s in strs:
                w.str(s)
    return bytes(w.buf)


def _encode_func(w: _Writer, f: Func) -> None:
    index: dict[int, int] = {}
    w.str(f.name)
    w.uvar(len(f.params))
    for p in f.params:
        index[id(p)] = len(index)
        w.type(p.type)
        w.sharding(p.sharding)
    w.uvar(len(f.result_types))
    for t, sh in f.result_types:
        w.type(t)
        w.sharding(sh)
    w.uvar(len(f.ops))
    for op in f.ops:
        w.str(op.name)
        w.uvar(len(op.operands))
        for v in op.operands:
            w.uvar(_index_of(index, v, f, op.name))
        specs = REGISTRY[op.name].attr_index if op.name in REGISTRY else {}
        w.uvar(len(op.attrs))
        for name in sorted(op.attrs):
            w.str(name)
            w.attr(specs.get(name, AttrSpec(name, AttrKind.STRING)), op.attrs[name])
        w.uvar(len(op.results))
        for r in op.results:
            index[id(r)] = len(index)
            w.type(r.type)
            w.sharding(r.sharding)
    w.uvar(len(f.returns))
    for v in f.returns:
        w.uvar(_index_of(index, v, f, "return"))


def _index_of(index: dict[int, int], v: Value, f: Func, where: str) -> int:
    i = index.get(id(v))
    if i is None:
        raise IRError(E.UNDEFINED_VALUE, f"@{f.name}: {where} uses %{v.name}, which is not defined before it")
    return i


# --- decoding ---------------------------------------------------------------------------

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
            return _F64.unpack(self.raw(8))[0]
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


__all__ = ["encode", "decode", "attr_bytes", "MAGIC"]
