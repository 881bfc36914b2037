"""The canonical binary encoding (spec section "Canonical encoding"): Module -> bytes.
(decoding.py reads it back.)

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
from typing import TYPE_CHECKING, Any

from ..errors import ErrorCode as E
from .diagnostics import IRError
from .registry import REGISTRY, AttrKind, AttrSpec
from .types import Literal, Sharding, TensorType
from .versioning import check_target

if TYPE_CHECKING:  # the writer only reads a module's fields; module.py imports this file for Module.hash
    from .module import Func, Module, Value

MAGIC = b"DTMIR\x01"
MAX_ENCODED_BYTES = 1 << 32
F64 = struct.Struct("<d")  # float attributes: IEEE 754 binary64, little-endian


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
            self.buf += F64.pack(v)
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


__all__ = ["encode", "attr_bytes", "MAGIC", "MAX_ENCODED_BYTES"]
