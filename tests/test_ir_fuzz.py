"""Fuzzing the IR readers: whatever the input, parse() and decode() raise IRError and nothing
else; whatever they accept, verify() raises IRError and nothing else; whatever verifies can be
written (format, encode) and read back to an equal module.

Seeds: the example module T1, the corpus of test_ir_corpus.py and every
conformance/ir/valid/*.dtm present at test time.

The fuzzers are strict: a decoded module that verifies must also be expressible in text and
hold its attributes in canonical form.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtm.ir as ir
from dtm.ir import parser as ir_parser
from dtm.ir import symbolic as ir_symbolic
from dtm.ir.attrs import normalize_attrs
from dtm.ir.encoding import MAGIC
from dtm.ir.module import Func, Module, Op, Value
from dtm.ir.registry import REGISTRY, AttrKind
from dtm.ir.symbolic import SymDim
from dtm.ir.types import Literal, Mesh, TensorType

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ir_corpus import T1, seeds  # noqa: E402

SEEDS = seeds()
SEED_NAMES = sorted(SEEDS)
ENCODED = {name: ir.encode(ir.verify(ir.parse(t))) for name, t in SEEDS.items()}
FUZZ = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=False)

I64_MAX = 2**63 - 1
U64_MAX = 2**64 - 1
MAX_DIM = 2**62
_GLOBAL = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


# --- an independent encoder, written from the grammar in encoding.py's docstring ----------------

class Enc:
    def __init__(self):
        self.b = bytearray()

    def u(self, n: int) -> "Enc":
        while n >= 0x80:
            self.b.append((n & 0x7F) | 0x80)
            n >>= 7
        self.b.append(n)
        return self

    def s(self, n: int) -> "Enc":
        return self.u(2 * n if n >= 0 else -2 * n - 1)

    def str(self, s: str | bytes) -> "Enc":
        b = s.encode() if isinstance(s, str) else s
        self.u(len(b))
        self.b += b
        return self

    def byte(self, *bs: int) -> "Enc":
        self.b += bytes(bs)
        return self

    def dim(self, d) -> "Enc":
        if isinstance(d, int):
            return self.byte(0).s(d)
        self.byte(1).u(len(d.terms))
        for mono, coef in d.terms:
            self.s(coef).u(len(mono))
            for sname in mono:
                self.str(sname)
        return self

    def type(self, t: TensorType) -> "Enc":
        self.str(t.dtype.name).u(len(t.shape))
        for d in t.shape:
            self.dim(d)
        return self

    def sharding(self, sh) -> "Enc":
        if sh is None:
            return self.byte(0)
        self.byte(1).str(sh.mesh).u(len(sh.placements))
        for p in sh.placements:
            if p.kind == "replicate":
                self.byte(0)
            elif p.kind == "shard":
                self.byte(1).u(p.arg)
            else:
                self.byte(2).str(p.arg)
        return self

    def attr(self, kind: AttrKind | None, v) -> "Enc":
        if v is None:
            return self.byte(9)
        if kind is AttrKind.DIM:
            return self.byte(6).dim(v)
        if isinstance(v, bool):
            return self.byte(2, int(v))
        if isinstance(v, int):
            return self.byte(0).s(v)
        if isinstance(v, float):
            self.byte(1)
            self.b += struct.pack("<d", v)
            return self
        if kind in (AttrKind.MESH, AttrKind.FUNC):
            return self.byte(7).str(v)
        if isinstance(v, ir.DType):
            return self.byte(4).str(v.name)
        if isinstance(v, str):
            return self.byte(3).str(v)
        if isinstance(v, Literal):
            self.byte(8).str(v.dtype.name).u(len(v.shape))
            for d in v.shape:
                self.u(d)
            return self.str(v.data)
        if isinstance(v, tuple):
            self.byte(5).u(len(v))
            for x in v:
                if kind is AttrKind.DIMS:
                    self.byte(6).dim(x)
                elif kind is AttrKind.REFS:
                    self.byte(7).str(x)
                else:
                    self.attr(kind, x)
            return self
        raise AssertionError(v)


def spec_encode(m: Module, version=None) -> bytes:
    e = Enc()
    e.b += b"DTMIR\x01"
    # a module built in code (no version) is written as the lowest version its ops need (spec 6)
    v = version or m.version or max([(1, 0)] + [REGISTRY[op.name].since for f in m.funcs.values() for op in f.ops])
    e.u(v[0]).u(v[1])
    e.u(len(m.meshes))
    for name in sorted(m.meshes):
        e.str(name).u(len(m.meshes[name].axes))
        for a, size in m.meshes[name].axes:
            e.str(a).u(size)
    e.u(len(m.funcs))
    for name in sorted(m.funcs):
        f = m.funcs[name]
        index = {}
        e.str(name).u(len(f.params))
        for p in f.params:
            index[id(p)] = len(index)
            e.type(p.type).sharding(p.sharding)
        e.u(len(f.result_types))
        for t, sh in f.result_types:
            e.type(t).sharding(sh)
        e.u(len(f.ops))
        for op in f.ops:
            e.str(op.name).u(len(op.operands))
            for v in op.operands:
                e.u(index[id(v)])
            specs = REGISTRY[op.name].attr_index if op.name in REGISTRY else {}
            e.u(len(op.attrs))
            for k in sorted(op.attrs):
                e.str(k).attr(specs[k].kind if k in specs else None, op.attrs[k])
            e.u(len(op.results))
            for r in op.results:
                index[id(r)] = len(index)
                e.type(r.type).sharding(r.sharding)
        e.u(len(f.returns))
        for v in f.returns:
            e.u(index[id(v)])
    e.u(len(m.tasks))
    for name in sorted(m.tasks):
        t = m.tasks[name]
        e.str(name).str(t.func)
        for strs in (t.inputs, t.outputs, t.after):
            e.u(len(strs))
            for x in strs:
                e.str(x)
    return bytes(e.b)


@pytest.mark.parametrize("name", SEED_NAMES)
def test_encoding_follows_the_documented_grammar(name):
    m = ir.verify(ir.parse(SEEDS[name]))
    assert spec_encode(m) == ir.encode(m)


def one_op_module(opname, attrs, operand_types=(), result_types=(), meshes=(), fname="f", extra=None) -> bytes:
    """Raw bytes of a module whose @f has parameters `operand_types`, one op `opname` with
    exactly `attrs` (no defaults filled in), and returns its parameters."""
    m = Module()
    for mesh in meshes:
        m.meshes[mesh.name] = mesh
    params = [Value(t, str(i)) for i, t in enumerate(operand_types)]
    results = tuple(Value(t) for t in result_types)
    f = Func(fname, params, [(p.type, None) for p in params], [Op(opname, tuple(params), attrs, results)], params)
    m.funcs[fname] = f
    if extra:
        extra(m)
    return spec_encode(m)


F32 = ir.DTYPES["f32"]


def t(shape, dtype="f32") -> TensorType:
    return TensorType(ir.DTYPES[dtype], tuple(shape))


# --- what a module promises -------------------------------------------------------------------------

def _dims_expressible(tt: TensorType) -> bool:
    if tt.rank > ir_parser.MAX_RANK:
        return False
    for d in tt.shape:
        if isinstance(d, int):
            if not 0 <= d < MAX_DIM:
                return False
        else:
            for mono, coef in d.terms:
                if not abs(coef) < MAX_DIM or not all(_IDENT.match(s) for s in mono):
                    return False
                if len(mono) > ir_symbolic.MAX_DEGREE:
                    return False
    return True


def expressible(m: Module) -> bool:
    """Can canonical text express `m` at all (names, dims, sizes in the ranges text allows)?"""
    for name, mesh in m.meshes.items():
        if not _GLOBAL.match(name) or not all(_IDENT.match(a) and 1 <= s < MAX_DIM for a, s in mesh.axes):
            return False
    for name, task in m.tasks.items():
        if not _GLOBAL.match(name) or not _GLOBAL.match(task.func) or not all(_GLOBAL.match(a) for a in task.after):
            return False
    for name, f in m.funcs.items():
        if not _GLOBAL.match(name):
            return False
        values = list(f.params) + [r for op in f.ops for r in op.results]
        types = [v.type for v in values] + [tt for tt, _ in f.result_types]
        if not all(_dims_expressible(tt) for tt in types):
            return False
        shardings = [v.sharding for v in values] + [sh for _, sh in f.result_types]
        if any(sh is not None and not _GLOBAL.match(sh.mesh) for sh in shardings):
            return False
        for op in f.ops:
            for k, v in op.attrs.items():
                if isinstance(v, str) and REGISTRY[op.name].attr_index[k].kind in (AttrKind.MESH, AttrKind.FUNC) \
                        and not _GLOBAL.match(v):
                    return False
                # spec 4.6: integers in text are i64, but a `scalar` attribute may reach 2^64 - 1 (a u64's)
                top = U64_MAX if REGISTRY[op.name].attr_index[k].kind is AttrKind.SCALAR else I64_MAX
                if isinstance(v, int) and not isinstance(v, bool) and not -I64_MAX - 1 <= v <= top:
                    return False
                if isinstance(v, tuple):
                    for x in v:
                        if isinstance(x, int) and not -I64_MAX - 1 <= x <= I64_MAX:
                            return False
                        if isinstance(x, SymDim) and not _dims_expressible(TensorType(F32, (x,))):
                            return False
                        if isinstance(x, int) and REGISTRY[op.name].attr_index[k].kind is AttrKind.DIMS \
                                and not 0 <= x < MAX_DIM:
                            return False
                if isinstance(v, Literal) and (len(v.shape) > ir_parser.MAX_RANK or
                                               any(d >= MAX_DIM for d in v.shape)):
                    return False
    return True


def attrs_canonical(m: Module) -> bool:
    """Are all op attributes exactly what normalize_attrs makes of them (defaults present,
    kinds exact)?"""
    for f in m.funcs.values():
        for op in f.ops:
            opdef = REGISTRY.get(op.name)
            if opdef is None:
                continue
            try:
                norm = normalize_attrs(op.name, opdef.attr_index, op.attrs,
                                       op.results[0].type.dtype if op.results else None)
            except Exception:  # noqa: BLE001
                return False
            if set(norm) != set(op.attrs):
                return False
            for k, v in norm.items():
                w = op.attrs[k]
                kind = opdef.attr_index[k].kind
                if type(v) is not type(w) or spec_encode_attr(kind, v) != spec_encode_attr(kind, w):
                    return False
    return True


def spec_encode_attr(kind, v) -> bytes:
    try:
        return bytes(Enc().attr(kind, v).b)
    except Exception:  # noqa: BLE001 - a value of the wrong kind
        return repr(v).encode()


def check_module(m: Module, decoded: bool) -> None:
    """m is a parsed or decoded module. verify() raises IRError or accepts; what it accepts
    writes and reads back equal."""
    try:
        ir.verify(m)
    except ir.IRError as e:
        assert e.code.value[:1] == "E" and len(e.code.value) == 5
        return
    enc = ir.encode(m)
    assert ir.encode(m) == enc
    d = ir.decode(enc)
    assert d == m
    ir.verify(d)
    if decoded:
        assert expressible(m), "verify accepted a module text cannot express:\n" + repr(enc)
        assert attrs_canonical(m), "verify accepted attributes that are not in canonical form:\n" + repr(enc)
    text = ir.format(m)
    m2 = ir.verify(ir.parse(text))
    assert m2 == m, f"parse(format(m)) != m\n{text}"
    assert ir.format(m2) == text


def check_text(text: str | bytes) -> None:
    try:
        m = ir.parse(text)
    except ir.IRError as e:
        assert isinstance(e.code, ir_parser.E)
        assert e.line is None or e.line >= 1
        assert e.col is None or e.col >= 1
        return
    check_module(m, decoded=False)


def check_bytes(data: bytes) -> None:
    try:
        m = ir.decode(data)
    except ir.IRError:
        return
    check_module(m, decoded=True)


# --- parse: random input -------------------------------------------------------------------------

GRAMMAR_CHARS = "%@[](){}:,=*+-.\"\\/0123456789abcdefglmnprstuxyzBT_ \t\n\r"
TOKENS = ["dtm 1.0\n", "dtm", "1.0", "func", "mesh", "task", "return", "@f", "@m", "@t", "%x", "%y", "%0", "f32",
          "i64", "bool", "q8_0", "[", "]", "(", ")", "{", "}", ":", ",", "=", "->", "*", "+", "-", "B", "T", "0", "1",
          "32", "2.5", "1e-5", "nan", "inf", "true", "false", '"sum"', '"a\\"b"', '"', "add", "neg", "matmul",
          "reduce_sum", "axes", "keepdims", "value", "full", "constant", "all_reduce", "shard", "replicate",
          "partial", "sum", "inputs", "outputs", "after", "\n", "\n  ", "//", " ", "é", "\x00", "\ufeff"]


@settings(max_examples=300, **FUZZ)
@given(data=st.binary(max_size=300), header=st.booleans())
def test_parse_random_bytes(data, header):
    check_text((b"dtm 1.0\n" if header else b"") + data)


@settings(max_examples=300, **FUZZ)
@given(text=st.text(alphabet=st.one_of(st.sampled_from(GRAMMAR_CHARS), st.characters()), max_size=300),
       header=st.booleans())
def test_parse_random_text(text, header):
    check_text(("dtm 1.0\n" if header else "") + text)


@settings(max_examples=250, **FUZZ)
@given(toks=st.lists(st.sampled_from(TOKENS), max_size=80), seps=st.lists(st.sampled_from([" ", "", "\n"]),
                                                                         min_size=80, max_size=80))
def test_parse_token_soup(toks, seps):
    check_text("dtm 1.0\n" + "".join(tok + sep for tok, sep in zip(toks, seps)))


# --- parse: mutations of valid modules -------------------------------------------------------------

@st.composite
def mutated(draw):
    text = SEEDS[draw(st.sampled_from(SEED_NAMES))]
    for _ in range(draw(st.integers(1, 4))):
        lines = text.split("\n")
        kind = draw(st.sampled_from(["delete", "insert", "replace", "swap", "dup", "truncate", "del_line",
                                     "token", "digit"]))
        n = len(text)
        if kind == "delete" and n:
            i = draw(st.integers(0, n - 1))
            text = text[:i] + text[i + draw(st.integers(1, 8)):]
        elif kind == "insert":
            i = draw(st.integers(0, n))
            ins = draw(st.text(alphabet=GRAMMAR_CHARS, min_size=1, max_size=6))
            text = text[:i] + ins + text[i:]
        elif kind == "replace" and n:
            i = draw(st.integers(0, n - 1))
            text = text[:i] + draw(st.sampled_from(GRAMMAR_CHARS)) + text[i + 1:]
        elif kind == "swap" and len(lines) > 1:
            i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
            text = "\n".join(lines)
        elif kind == "dup":
            i = draw(st.integers(0, len(lines) - 1))
            lines.insert(i, lines[i])
            text = "\n".join(lines)
        elif kind == "truncate":
            text = text[: draw(st.integers(0, n))]
        elif kind == "del_line":
            del lines[draw(st.integers(0, len(lines) - 1))]
            text = "\n".join(lines)
        elif kind == "token":
            words = re.findall(r"%[\w.]+|@[\w.]+|[A-Za-z_]\w*|\d+(?:\.\d*)?", text)
            if words:
                w = draw(st.sampled_from(words))
                text = text.replace(w, draw(st.sampled_from(TOKENS + words)).strip(), draw(st.integers(1, 3)))
        elif kind == "digit":
            digits = [m.start() for m in re.finditer(r"\d", text)]
            if digits:
                i = draw(st.sampled_from(digits))
                text = text[:i] + draw(st.sampled_from("0123456789")) + text[i + 1:]
    return text


@settings(max_examples=500, **FUZZ)
@given(text=mutated())
def test_parse_mutated_modules(text):
    check_text(text)


@pytest.mark.parametrize("name", SEED_NAMES[:40])
def test_every_line_deleted_or_duplicated(name):
    lines = SEEDS[name].split("\n")
    for i in range(len(lines)):
        check_text("\n".join(lines[:i] + lines[i + 1:]))
        check_text("\n".join(lines[:i + 1] + lines[i:]))


def test_every_truncation_of_t1():
    for i in range(len(T1)):
        check_text(T1[:i])
        check_text(T1[:i].encode())


# --- decode: random and mutated bytes ------------------------------------------------------------------

@settings(max_examples=300, **FUZZ)
@given(data=st.binary(max_size=200), prefix=st.sampled_from([b"", MAGIC, MAGIC + b"\x01\x00"]))
def test_decode_random_bytes(data, prefix):
    check_bytes(prefix + data)


@st.composite
def mutated_encoding(draw):
    data = bytearray(ENCODED[draw(st.sampled_from(SEED_NAMES))])
    for _ in range(draw(st.integers(1, 3))):
        n = len(data)
        kind = draw(st.sampled_from(["flip", "set", "delete", "insert", "truncate", "dup", "inc"]))
        i = draw(st.integers(0, max(n - 1, 0)))
        if kind == "flip" and n:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and n:
            data[i] = draw(st.sampled_from([0, 1, 2, 0x7F, 0x80, 0xFF, draw(st.integers(0, 255))]))
        elif kind == "inc" and n:
            data[i] = (data[i] + draw(st.sampled_from([1, -1]))) % 256
        elif kind == "delete":
            del data[i:i + draw(st.integers(1, 4))]
        elif kind == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif kind == "truncate":
            del data[i:]
        elif kind == "dup":
            k = draw(st.integers(1, 8))
            data[i:i] = data[i:i + k]
    return bytes(data)


@settings(max_examples=500, **FUZZ)
@given(data=mutated_encoding())
def test_decode_mutated_encodings(data):
    check_bytes(data)


def test_every_truncation_of_t1_encoding_fails():
    enc = ENCODED["t1"]
    for i in range(len(enc)):
        with pytest.raises(ir.IRError) as ei:
            ir.decode(enc[:i])
        assert ei.value.code.value in ("E0701", "E0702"), ei.value
    with pytest.raises(ir.IRError) as ei:
        ir.decode(enc + b"\x00")
    assert ei.value.code.value == "E0701"


@pytest.mark.parametrize("name, values", [("t1", (0x00, 0x7F, 0x80, 0xFF)), ("calls_tasks", (0x00,)),
                                           ("linalg_creation", (0x00,))])
def test_every_byte_of_an_encoding_changed(name, values):
    enc = ENCODED[name]
    for i in range(len(enc)):
        for v in {*values, enc[i] ^ 1, (enc[i] + 1) % 256}:
            check_bytes(enc[:i] + bytes([v]) + enc[i + 1:])


def test_decode_rejects_wrong_types_and_magic():
    for bad in ["text", None, 12, [1, 2]]:
        with pytest.raises(ir.IRError):
            ir.decode(bad)
    for data in [b"", b"DTMIR", b"DTMIR\x02\x01\x00\x00\x00\x00", b"XTMIR\x01\x01\x00\x00\x00\x00"]:
        with pytest.raises(ir.IRError):
            ir.decode(data)
    m = ir.decode(b"DTMIR\x01\x01\x00\x00\x00\x00")
    assert m.version == (1, 0) and not m.funcs and ir.format(ir.verify(m)) == "dtm 1.0\n"
    assert ir.decode(memoryview(ENCODED["t1"])) == ir.decode(bytearray(ENCODED["t1"]))


# --- resource limits -------------------------------------------------------------------------------------

def _bounded(fn, seconds=1.0, megabytes=None):
    """fn() raises IRError quickly (and, when `megabytes` is given, without allocating more
    than that); returns the error."""
    t0 = time.perf_counter()
    with pytest.raises(ir.IRError) as ei:
        fn()
    assert time.perf_counter() - t0 < seconds
    if megabytes is not None:
        tracemalloc.start()
        try:
            with pytest.raises(ir.IRError):
                fn()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < megabytes * 2**20, peak
    return ei.value


def mod(body, params="%x: f32[4]", res="f32[4]"):
    return f"dtm 1.0\nfunc @f({params}) -> ({res}) {{\n{body}\n}}\n"


@pytest.mark.parametrize("text", [
    mod("  %c = constant {value = " + "[" * 100000 + "} : f32[1]\n  return %x"),
    mod("  %c = constant {value = " + "[" * 100000 + "1.0" + "]" * 100000 + "} : f32[1]\n  return %x"),
    mod("  return %x", params="%x: f32[" + "(" * 100000 + "B" + ")" * 100000 + "]"),
    mod("  %y = reshape %x {shape = [" + "(" * 100000 + "4" + ")" * 100000 + "]} : f32[4]\n  return %y"),
    mod("  %y = reshape %x {shape = [" + "(" * 130 + "4" + ")" * 130 + "]} : f32[4]\n  return %y"),
    mod("  return %x", params="%x: f32[" + "(" * 130 + "B" + ")" * 130 + "]"),
    mod("  %y = reshape %x {shape = [" + "(" * 126 + "4" + ")" * 126 + "]} : f32[4]\n  return %y"),
])
def test_deep_nesting_is_e0107(text):
    e = _bounded(lambda: ir.parse(text), seconds=5.0)
    assert e.code.value == "E0107"
    assert e.line == 3 or e.line == 2


def test_nesting_limit_is_128_and_counts_the_attribute_braces():
    assert ir_parser.MAX_DEPTH == 128
    # '{', '[' and 126 parentheses: 128 levels, the most there may be
    ir.parse(mod("  %y = reshape %x {shape = [" + "(" * 125 + "4" + ")" * 125 + "]} : f32[4]\n  return %y"))
    ir.parse(mod("  return %x", params="%x: f32[" + "(" * 100 + "B" + ")" * 100 + "]", res="f32[B]"))


@pytest.mark.parametrize("text", [
    mod("  return %x", params="%x: f32[" + "[" * 100000 + "]"),
    mod("  return %x", params="%x: f32[4] @m" + "[" * 100000),
    mod("  %y = reduce_sum %x {axes = " + "[" * 100000 + "} : f32[]\n  return %x"),
    "dtm 1.0\n" + "func @f(" + "(" * 100000 + ") -> () {\n  return\n}\n",
    "dtm 1.0\ntask @t = @f {inputs = " + "[" * 100000 + "}\n",
    "dtm 1.0\nmesh @m" + "[" * 100000 + "\n",
])
def test_deep_brackets_where_no_nesting_is_allowed(text):
    e = _bounded(lambda: ir.parse(text), seconds=5.0)
    assert e.code.value in ("E0102", "E0107")


def test_moderate_literal_nesting_is_fine():
    v, shape = "1.0", []
    for _ in range(20):
        v, shape = f"[{v}]", shape + ["1"]
    ir.verify(ir.parse(mod(f"  %c = constant {{value = {v}}} : f32[{', '.join(shape)}]\n  return %x")))


@pytest.mark.parametrize("as_bytes", [False, True])
def test_input_too_large(monkeypatch, as_bytes):
    monkeypatch.setattr(ir_parser, "MAX_TEXT_CHARS", 100)
    small = "dtm 1.0\nfunc @f() -> () {\n  return\n}\n"
    assert len(small) < 100
    ir.parse(small.encode() if as_bytes else small)
    big = small + "// " + "x" * 200 + "\n"
    e = _bounded(lambda: ir.parse(big.encode() if as_bytes else big), megabytes=1)
    assert e.code.value == "E0106"
    assert "100" in e.message


def test_input_limit_counts_characters_or_bytes_consistently(monkeypatch):
    monkeypatch.setattr(ir_parser, "MAX_TEXT_CHARS", 100)
    text = "dtm 1.0\n// " + "é" * 60 + "\n"  # 71 characters, 131 bytes
    ir.parse(text)
    with pytest.raises(ir.IRError) as ei:
        ir.parse(text.encode())
    assert ei.value.code.value == "E0106"


def _uvar(n: int) -> bytes:
    return bytes(Enc().u(n).b)


HEAD = MAGIC + b"\x01\x00"


@pytest.mark.parametrize("data", [
    HEAD + _uvar(2**60),                                         # 2^60 meshes
    HEAD + b"\x00" + _uvar(2**60),                               # 2^60 funcs
    HEAD + b"\x00\x00" + _uvar(2**60),                           # 2^60 tasks
    HEAD + b"\x01" + _uvar(2**60),                               # a name of 2^60 bytes
    HEAD + b"\x01\x01m" + _uvar(2**60),                          # 2^60 mesh axes
    HEAD + b"\x00\x01\x01f" + _uvar(2**60),                      # 2^60 params
    HEAD + b"\x00\x01\x01f\x01\x03f32" + _uvar(2**60),            # a param of rank 2^60
    HEAD + b"\x00\x01\x01f\x00\x00" + _uvar(2**60),               # 2^60 ops
    HEAD + b"\x00\x01\x01f\x00\x00\x01\x08constant\x00\x01\x05value\x05" + _uvar(2**60),  # a list of 2^60
    HEAD + b"\x00\x01\x01f\x00\x00\x01\x08constant\x00\x01\x05value\x08\x03f32\x02"
    + _uvar(2**30) + _uvar(2**30) + _uvar(2**60),                # a literal of 2^60 elements, 2^60 bytes claimed
    HEAD + b"\x00\x01\x01f\x00\x00\x01\x08constant\x00\x01\x05value\x08\x03f32\x02"
    + _uvar(2**30) + _uvar(2**30) + b"\x04\x00\x00\x80\x3f",      # 2^60 elements claimed, 4 bytes given
    HEAD + b"\x00\x01\x01f\x01\x03f32\x01\x01" + _uvar(2**60),    # a symbolic dim of 2^60 terms
    HEAD + b"\x80" * 20,                                          # an endless varint
])
def test_decode_huge_counts_fail_fast(data):
    e = _bounded(lambda: ir.decode(data + b"\x00" * 16), seconds=0.5, megabytes=16)
    assert e.code.value in ("E0701", "E0702", "E0703")


def test_decode_deeply_nested_attribute_lists():
    inner = b"\x00\x02"
    for _ in range(10000):
        inner = b"\x05\x01" + inner
    data = HEAD + b"\x00\x01\x01f\x00\x00\x01\x03neg\x00\x01\x01a" + inner + b"\x00\x00\x00"
    e = _bounded(lambda: ir.decode(data), seconds=1.0, megabytes=64)
    assert e.code.value in ("E0701", "E0702", "E0703")


def _numeral_text(where: str, big: str) -> str:
    return {"dim": mod("  return %x", params=f"%x: f32[{big}]"),
            "attr": mod(f"  %y = reduce_sum %x {{axes = [{big}]}} : f32[]\n  return %x"),
            "scalar": mod(f"  %y = full {{value = {big}}} : f32[4]\n  return %x"),
            "float": mod(f"  %y = full {{value = 0.{big}}} : f32[4]\n  return %x"),
            "literal": mod(f"  %y = constant {{value = [{big}]}} : f32[1]\n  return %x"),
            "mesh": f"dtm 1.0\nmesh @m[a = {big}]\n"}[where]


@pytest.mark.parametrize("n", [41, 5000])
@pytest.mark.parametrize("where", ["dim", "attr", "scalar", "float", "literal", "mesh"])
def test_very_long_numeral_is_e0104(where, n):
    e = _bounded(lambda: ir.parse(_numeral_text(where, "9" * n)))
    assert e.code.value == "E0104"
    assert "40" in e.message


def test_numeral_of_40_characters_is_read():
    ir.verify(ir.parse(mod(f"  %y = constant {{value = [0.{'1' * 38}]}} : f32[1]\n  return %x")))
    for where in ("dim", "attr", "scalar", "mesh"):  # read, then refused as out of range
        with pytest.raises(ir.IRError) as ei:
            ir.verify(ir.parse(_numeral_text(where, "9" * 40)))
        assert ei.value.code.value in ("E0104", "E0405"), ei.value
        assert "characters" not in ei.value.message, ei.value  # refused for its value, not its length


@pytest.mark.parametrize("d", ["*".join(["(A+B+C+D+E+F)"] * 15), "*".join(["(A+B+C+D+E+F)"] * 3),
                               "*".join(["A"] * 17), "*".join(["(A+1)"] * 17)])
def test_symbolic_dim_expansion_is_bounded(d):
    e = _bounded(lambda: ir.parse(mod("  return %x", params=f"%x: f32[{d}]", res=f"f32[{d}]")), seconds=0.2)
    assert e.code.value == "E0405"
    assert "64 terms, degree 16" in e.message


@pytest.mark.parametrize("d", ["*".join(["A"] * 16), "(A+B+C+D+E+F+G+H)*(A+B+C+D+E+F+G+H)"])
def test_symbolic_dim_at_the_bounds_round_trips(d):
    m = ir.verify(ir.parse(mod("  return %x", params=f"%x: f32[{d}]", res=f"f32[{d}]")))
    assert ir.parse(ir.format(m)) == m
    assert ir.decode(ir.encode(m)) == m


def test_long_flat_lines_parse_in_linear_time():
    n = 20000
    body = "  %y = concat " + ", ".join(["%x"] * n) + " {axis = 0} : f32[" + str(4 * n) + "]\n  return %x"
    t0 = time.perf_counter()
    ir.verify(ir.parse(mod(body)))
    junk = "  %y = add " + ", ".join(["%x"] * n) + ",\n  return %x"
    with pytest.raises(ir.IRError):
        ir.parse(mod(junk))
    with pytest.raises(ir.IRError):
        ir.parse(mod("  %y = " + "%x, " * n + "\n  return %x"))
    assert time.perf_counter() - t0 < 5


# --- decoded modules outside the canonical form ------------------------------------------------------

def _decoded_round_trip(data: bytes) -> None:
    """decode, then verify raises IRError, or the module round-trips through text and bytes."""
    m = ir.decode(data)
    try:
        ir.verify(m)
    except ir.IRError:
        return
    assert ir.decode(ir.encode(m)) == m
    assert ir.parse(ir.format(m)) == m


def _verify_code(data: bytes) -> str:
    """The code decode() or verify() refuses `data` with."""
    with pytest.raises(ir.IRError) as ei:
        ir.verify(ir.decode(data))
    return ei.value.code.value


def test_decoded_op_without_defaulted_attribute():
    data = one_op_module("reduce_sum", {"axes": (0,)}, [t([4])], [t([])])
    assert _verify_code(data) == "E0303"


_CAST = one_op_module("cast", {"to": F32}, [t([4])], [t([4])])
_RESHAPE = one_op_module("reshape", {"shape": (4,)}, [t([4])], [t([4])])
_DSLICE = one_op_module("dynamic_slice", {"axis": 0, "size": 2}, [t([4]), t([], "i64")], [t([2])])


@pytest.mark.parametrize("data", [
    pytest.param(_CAST.replace(b"\x02to\x04\x03f32", b"\x02to\x03\x03f32"), id="cast_to"),
    pytest.param(_RESHAPE.replace(b"\x05shape\x05\x01\x06\x00\x08", b"\x05shape\x05\x01\x03\x01B"), id="reshape_shape"),
    pytest.param(_DSLICE.replace(b"\x04size\x06\x00\x04", b"\x04size\x03\x01B"), id="dynamic_slice_size"),
])
def test_decoded_dtype_or_dim_attribute_as_string(data):
    """An attribute written with another kind's tag is not the canonical encoding: decode refuses it."""
    assert data not in (_CAST, _RESHAPE, _DSLICE)
    assert _verify_code(data) == "E0701"


def test_decoded_literal_as_list():
    data = one_op_module("constant", {"value": (1.0, 2.0)}, [], [t([2])])
    assert _verify_code(data) == "E0306"


@pytest.mark.parametrize("case, code", [("eps_int", "E0306"), ("all_reduce_no_op", "E0303"),
                                        ("keepdims_as_int", "E0305")])
def test_decoded_noncanonical_attributes_are_refused(case, code):
    if case == "eps_int":
        data = one_op_module("layer_norm", {"eps": 1}, [t([4])], [t([4])])
    elif case == "keepdims_as_int":
        data = one_op_module("reduce_sum", {"axes": (0,), "keepdims": 0}, [t([4])], [t([])])
    else:
        data = one_op_module("all_reduce", {"mesh": "m", "axes": ("a",)}, [t([4])], [t([4])],
                             meshes=[Mesh("m", (("a", 2),))])
    assert _verify_code(data) == code


def test_decoded_ints_attribute_sent_as_dims_is_refused():
    data = one_op_module("reduce_sum", {"axes": (0,), "keepdims": False}, [t([4])], [t([])])
    assert _verify_code(data.replace(b"\x04axes\x05\x01\x00\x00", b"\x04axes\x05\x01\x06\x00\x00")) == "E0701"


@pytest.mark.parametrize("case", ["ints_as_dims", "mesh_as_string"])
def test_decoded_module_that_verifies_reencodes_to_the_same_bytes(case):
    if case == "ints_as_dims":
        data = one_op_module("reduce_sum", {"axes": (0,), "keepdims": False}, [t([4])], [t([])])
        bad = data.replace(b"\x04axes\x05\x01\x00\x00", b"\x04axes\x05\x01\x06\x00\x00")
    else:
        data = one_op_module("all_reduce", {"mesh": "m", "axes": ("a",), "op": "sum"}, [t([4])], [t([4])],
                             meshes=[Mesh("m", (("a", 2),))])
        bad = data.replace(b"\x04mesh\x07\x01m", b"\x04mesh\x03\x01m")
    assert bad != data and ir.encode(ir.verify(ir.decode(data))) == data
    try:
        m = ir.verify(ir.decode(bad))
    except ir.IRError:
        return  # the other tag is refused: one module, one encoding
    assert ir.encode(m) == bad


def _monomial(degree: int) -> SymDim:
    """A^degree, as one monomial in normal form."""
    d = ir_symbolic._normalize({("A",) * degree: 1})
    assert isinstance(d, SymDim) and d.terms == ((("A",) * degree, 1),)
    return d


@pytest.mark.parametrize("case, code", [("func_name", "E0211"), ("axis_name", "E0211"), ("symbol", "E0211"),
                                        ("mesh_size", "E0505"), ("mesh_size_2_62", "E0505"), ("dim_2_62", "E0405"),
                                        ("rank_65", "E0405"),
                                        ("degree_17", "E0405")])
def test_decoded_unexpressible_module_is_refused(case, code):
    sym = ir.sym("1x")
    data = {
        "func_name": lambda: one_op_module("neg", {}, [t([4])], [t([4])], fname="a b"),
        "axis_name": lambda: one_op_module("all_reduce", {"mesh": "m", "axes": ("a b",), "op": "sum"}, [t([4])],
                                           [t([4])], meshes=[Mesh("m", (("a b", 2),))]),
        "symbol": lambda: one_op_module("neg", {}, [t([sym])], [t([sym])]),
        "dim_2_62": lambda: one_op_module("neg", {}, [t([2**62])], [t([2**62])]),
        "rank_65": lambda: one_op_module("neg", {}, [t([1] * 65)], [t([1] * 65)]),
        "mesh_size": lambda: one_op_module("neg", {}, [t([4])], [t([4])], meshes=[Mesh("m", (("a", 2**64),))]),
        "mesh_size_2_62": lambda: one_op_module("neg", {}, [t([4])], [t([4])], meshes=[Mesh("m", (("a", 2**62),))]),
        "degree_17": lambda: one_op_module("neg", {}, [t([_monomial(17)])], [t([_monomial(17)])]),
    }[case]()
    assert _verify_code(data) == code


def test_decoded_degree_16_dim_round_trips():
    _decoded_round_trip(one_op_module("neg", {}, [t([_monomial(16)])], [t([_monomial(16)])]))
    m = ir.verify(ir.decode(one_op_module("neg", {}, [t([_monomial(16)])], [t([_monomial(16)])])))
    assert ir.parse(ir.format(m)) == m


@pytest.mark.parametrize("shape", [(0, 2**61), (2**31,), (1, 2**31, 0)])
def test_decoded_literal_with_huge_dim_is_refused(shape):
    lit = Literal(F32, shape, b"")
    data = one_op_module("constant", {"value": lit}, [], [TensorType(F32, shape)])
    with pytest.raises(ir.IRError) as ei:
        ir.decode(data)
    assert ei.value.code.value == "E0703"


@pytest.mark.parametrize("lit", [Literal(ir.DTYPES["bool"], (1,), b"\x02"),
                                 Literal(F32, (1,), struct.pack("<I", 0x7FC00001)),
                                 Literal(F32, (1,), struct.pack("<I", 0xFFC00000))])
def test_decoded_noncanonical_literal_bytes_are_refused(lit):
    assert _verify_code(one_op_module("constant", {"value": lit}, [], [TensorType(lit.dtype, lit.shape)])) == "E0306"


@pytest.mark.parametrize("bits, op", [(0xFFF0000000000001, "full"), (0xFFF8000000000000, "full"),
                                      (0x7FF0000000000001, "layer_norm")], ids=["full-neg-payload", "full-neg-nan",
                                                                               "eps-payload"])
def test_decoded_noncanonical_float_attribute_nan_is_refused(bits, op):
    nan = struct.unpack("<d", struct.pack("<Q", bits))[0]
    if op == "full":
        data = one_op_module("full", {"value": nan}, [], [t([2])])
    else:
        data = one_op_module("layer_norm", {"eps": nan}, [t([4])], [t([4])])
    assert _verify_code(data) == "E0306"


def test_decoded_canonical_nan_round_trips():
    _decoded_round_trip(one_op_module("full", {"value": math.nan}, [], [t([2])]))
    m = ir.verify(ir.decode(one_op_module("layer_norm", {"eps": math.nan}, [t([4])], [t([4])])))
    assert ir.parse(ir.format(m)) == m


def test_decode_refuses_non_minimal_varint():
    enc = ENCODED["t1"]
    assert enc[6:8] == b"\x01\x00"
    with pytest.raises(ir.IRError) as ei:
        ir.decode(enc[:7] + b"\x80\x00" + enc[8:])
    assert ei.value.code.value == "E0701"
    with pytest.raises(ir.IRError) as ei:  # a longer one, in a count
        ir.decode(enc[:7] + b"\x00" + b"\x81\x80\x00" + enc[9:])
    assert ei.value.code.value == "E0701"


def test_a_long_sum_in_a_dim_is_e0405_at_the_term_past_the_limit():
    """Spec 4.6 bounds a dim's normal form at 64 terms for sums as for products: an
    8,000-term sum is refused at its 65th term (so reading stops there, instead of copying
    the terms once per addition: 22 s), at that term's sign."""
    terms = [f"A{i}" for i in range(8000)]
    line = "func @f(%x: f32[" + " + ".join(terms) + "]) -> () {"
    with pytest.raises(ir.IRError) as ei:
        ir.parse(f"dtm 1.0\n{line}\n  return\n}}\n")
    e = ei.value
    assert (e.code.value, e.line, e.col) == ("E0405", 2, line.index(" + A64") + 2), e
    assert "64 terms" in e.message
    ir.parse("dtm 1.0\nfunc @f(%x: f32[" + " + ".join(terms[:64]) + "]) -> () {\n  return\n}\n")
    # terms that cancel or merge stay within the limit however many are written
    same = "func @f(%x: f32[" + " + ".join(["A"] * 8000) + "]) -> (f32[8000*A]) {\n  return %x\n}\n"
    assert ir.verify(ir.parse("dtm 1.0\n" + same)).funcs


@pytest.mark.parametrize("body", ["x" * (1 << 20), "\\\\" * (1 << 19), "\\u00e9a" * (1 << 17)])
def test_a_one_megabyte_string_attribute_parses_in_memory_linear_in_its_size(body):
    """Strings are scanned without backtracking state per character (a 1 MB string cost
    354 MB): the peak stays a small multiple of the text."""
    text = f'dtm 1.0\nfunc @f(%x: f32[4]) -> () {{\n  store_put %x {{key = "{body}"}}\n  return\n}}\n'
    tracemalloc.start()
    try:
        m = ir.parse(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert m.funcs["f"].ops[0].attrs["key"] == json.loads(f'"{body}"')
    assert peak < 16 * len(text), peak
