"""The normative spec (docs/spec/dtm-spec.md) and the code agree.

- every op of the registry has its subsection, in registry order, with its attributes;
- the error table lists exactly the codes and names of `ErrorCode`, in order;
- every ```dtm block is a module that parses, verifies and is in canonical text; an op's
  example uses that op; a composite's decomposition has the example's signature and uses
  only other ops;
- the spec states the version of dtm/ir/version.py, the limits of the parser, every dtype,
  the worked encoding example's bytes and hash, and working internal links.
"""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass

import pytest

import dtm.ir as ir
from dtm.errors import ErrorCode
from dtm.ir import REGISTRY, Category
from dtm.ir import encoding as ir_encoding
from dtm.ir import parser as ir_parser
from dtm.ir.dtypes import DTYPES

SPEC_PATH = pathlib.Path(__file__).resolve().parents[1] / "docs" / "spec" / "dtm-spec.md"
SPEC = SPEC_PATH.read_text(encoding="utf-8")
LINES = SPEC.split("\n")

OP_HEADING = re.compile(r"^#### `([a-z_0-9]+)`$")

# Examples that a known bug in dtm/ir keeps from verifying: op name -> the bug. The test is a
# strict xfail, so it fails once the bug is fixed, as a reminder to delete the entry.
KNOWN_BROKEN: dict[str, str] = {}


# --- the document's structure -------------------------------------------------------------

@dataclass
class Block:
    line: int           # 1-based line of the opening fence
    lang: str
    text: str
    op: str | None      # the op subsection it is in, if any
    decomposition: bool  # after the "**Decomposition**" marker of that subsection


def _blocks() -> list[Block]:
    out: list[Block] = []
    op, decomp, i = None, False, 0
    while i < len(LINES):
        line = LINES[i]
        m = OP_HEADING.match(line)
        if m:
            op, decomp = m.group(1), False
        elif re.match(r"^#{1,3} ", line):
            op, decomp = None, False
        elif line.strip() == "**Decomposition**":
            decomp = True
        elif line.startswith("```"):
            lang, start, body = line[3:].strip(), i, []
            i += 1
            while i < len(LINES) and not LINES[i].startswith("```"):
                body.append(LINES[i])
                i += 1
            out.append(Block(start + 1, lang, "\n".join(body) + "\n", op, decomp))
        i += 1
    return out


BLOCKS = _blocks()
DTM_BLOCKS = [b for b in BLOCKS if b.lang == "dtm"]


def _section(title_prefix: str) -> str:
    """The text of the `## ` chapter whose title starts with `title_prefix`."""
    start = next(i for i, l in enumerate(LINES) if l.startswith("## " + title_prefix))
    end = next((i for i in range(start + 1, len(LINES)) if LINES[i].startswith("## ")), len(LINES))
    return "\n".join(LINES[start:end])


def _op_section(name: str) -> str:
    start = LINES.index(f"#### `{name}`")
    end = next(i for i in range(start + 1, len(LINES)) if re.match(r"^#{1,4} ", LINES[i]))
    return "\n".join(LINES[start:end])


# --- ops ----------------------------------------------------------------------------------

def test_every_op_has_a_subsection_in_registry_order():
    headed = [m.group(1) for l in LINES if (m := OP_HEADING.match(l))]
    assert headed == list(REGISTRY), "op subsections must be exactly the registry's ops, in its order"


def test_op_subsections_sit_under_their_category():
    category = None
    titles = {c: None for c in Category}
    for line in LINES:
        if line.startswith("### 3."):
            category = line
        m = OP_HEADING.match(line)
        if m:
            cat = REGISTRY[m.group(1)].category
            if titles[cat] is None:
                titles[cat] = category
            assert titles[cat] == category, f"{m.group(1)}: ops of category {cat.value} are split across sections"
    assert len({t for t in titles.values()}) == len(Category)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_op_entry_matches_the_registry(name):
    opdef = REGISTRY[name]
    text = _op_section(name)
    flags = text.split("\n")[2]
    assert f"since {opdef.since[0]}.{opdef.since[1]}" in flags
    assert f"effect: {'yes' if opdef.effect else 'no'}" in flags
    assert f"quantized operands: {'yes' if opdef.quant_ok else 'no'}" in flags
    assert f"*{opdef.category.value}*" in flags
    rows = re.findall(r"^\| `([a-z_]+)` \| `([a-z?]+)` \|", text, re.M)
    assert rows == [(a.name, a.kind.value) for a in opdef.attrs], "attribute table differs from the registry"
    for marker in ("**Signature**", "**Semantics**", "**Example**", "**Type rule**"):
        assert marker in text, f"{name}: no {marker}"
    cited = re.findall(r"^\* \(C(\d+)\) .*\((E\d{4})\)$", text, re.M)
    assert [int(n) for n, _ in cited] == list(range(1, len(cited) + 1)), "constraints must be numbered C1, C2, ..."


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_op_has_one_example_and_composites_a_decomposition(name):
    mine = [b for b in DTM_BLOCKS if b.op == name]
    examples = [b for b in mine if not b.decomposition]
    decomps = [b for b in mine if b.decomposition]
    # send and recv: the halves of a pipeline, then a whole program (their execution vector)
    assert len(examples) == (2 if name in ("send", "recv") else 1), f"{name}: {len(examples)} examples"
    if REGISTRY[name].category is Category.COMPOSITE:
        assert len(decomps) == 1, f"composite {name} needs exactly one normative decomposition"
    else:
        assert not decomps


# --- every ```dtm block --------------------------------------------------------------------

def _statement_ops(text: str) -> set[str]:
    names = set()
    for line in text.split("\n"):
        m = re.match(r"^  (?:%[\w.]+(?:, %[\w.]+)* = )?([a-z_0-9]+)\b", line)
        if m and m.group(1) != "return":
            names.add(m.group(1))
    return names


def _signature(module: ir.Module, func: str) -> tuple:
    f = module.funcs[func]
    return tuple(p.type for p in f.params), tuple(t for t, _ in f.result_types)


@pytest.mark.parametrize("block", DTM_BLOCKS, ids=[f"L{b.line}-{b.op or 'text'}" for b in DTM_BLOCKS])
def test_dtm_block_parses_verifies_and_is_canonical(block):
    if block.op in KNOWN_BROKEN and not block.decomposition:
        pytest.xfail(KNOWN_BROKEN[block.op])
    module = ir.verify(ir.parse(block.text))
    assert ir.format(module) == block.text, f"line {block.line}: the example is not in canonical text"
    assert ir.decode(ir.encode(module)) == module
    if block.op is None:
        return
    used = _statement_ops(block.text)
    if block.decomposition:
        assert block.op not in used, f"the decomposition of {block.op} uses {block.op} itself"
        assert all(REGISTRY[u].category is not Category.COMPOSITE for u in used), \
            f"the decomposition of {block.op} must use primitive ops only, found {sorted(used)}"
        example = next(b for b in DTM_BLOCKS if b.op == block.op and not b.decomposition)
        ex = ir.parse(example.text)
        assert _signature(module, f"{block.op}_decomposed") == _signature(ex, f"{block.op}_example"), \
            f"the decomposition of {block.op} must have the example's signature"
    else:
        assert block.op in used, f"the example of {block.op} does not use it"


def test_there_are_examples():
    assert len(DTM_BLOCKS) >= len(REGISTRY)


# --- errors, versions, limits, dtypes -------------------------------------------------------

def test_error_table_lists_exactly_the_error_codes():
    chapter = _section("10. Error codes")
    rows = re.findall(r"^\| (E\d{4}) \| `([A-Z0-9_]+)` \| (.+) \|$", chapter, re.M)
    assert [(c, n) for c, n, _ in rows] == [(e.value, e.name) for e in ErrorCode]
    assert all(meaning.strip() for _, _, meaning in rows)


def test_every_cited_error_code_exists():
    known = {e.value for e in ErrorCode}
    cited = set(re.findall(r"\bE\d{4}\b", SPEC))
    assert cited <= known, f"the spec cites unknown codes {sorted(cited - known)}"
    every_code_but_the_table = SPEC.replace(_section("10. Error codes"), "")
    uncited = known - set(re.findall(r"\bE\d{4}\b", every_code_but_the_table))
    assert not uncited, f"codes only in the error table, never explained in the text: {sorted(uncited)}"


def test_spec_states_its_version():
    version = ".".join(map(str, ir.SPEC_VERSION))
    assert f"**Version {version}**" in LINES[:5]
    assert f"version {version}" in _section("6. Versioning")
    assert f"dtm {ir.SPEC_VERSION[0]}.{ir.SPEC_VERSION[1]}" in SPEC


def test_spec_states_the_parser_limits():
    limits = _section("4. Text format")
    assert str(ir_parser.MAX_TEXT_CHARS) in limits
    assert re.search(rf"\| nesting .* \| {ir_parser.MAX_DEPTH} levels \|", limits)
    assert re.search(rf"\| rank of a tensor type \| {ir_parser.MAX_RANK} \|", limits)
    assert f"2^{ir_encoding.MAX_ENCODED_BYTES.bit_length() - 1}" in limits


def test_dtype_table_lists_every_dtype():
    rows = dict((m.group(1), (m.group(2), m.group(3))) for m in
                re.finditer(r"^\| `([a-z0-9_]+)` \| ([a-z]+) \| (\d+)[^|]* \|", _section("2. Types"), re.M))
    assert set(rows) == set(DTYPES)
    for name, d in DTYPES.items():
        assert rows[name] == (d.kind.value, str(d.bits)), name


# --- the worked encoding example ------------------------------------------------------------

def test_worked_example_bytes_and_hash():
    chapter = _section("5. Canonical encoding")
    start = chapter.index("### 5.6")
    worked = [b for b in BLOCKS if b.line > LINES.index("### 5.6 Worked example")]
    module_block = next(b for b in worked if b.lang == "dtm")
    hex_block = next(b for b in worked if b.lang == "hex")
    module = ir.verify(ir.parse(module_block.text))
    encoded = ir.encode(module)
    assert bytes.fromhex(hex_block.text.replace("\n", " ")) == encoded
    assert f"({len(encoded)} bytes)" in chapter[start:]
    assert module.hash() in chapter[start:]
    table = re.findall(r"^\| `([0-9a-f ]+)` \| .+ \|$", chapter[start:], re.M)
    assert bytes.fromhex(" ".join(table)) == encoded, "the byte-by-byte table does not add up to the encoding"


def test_a_float_scalar_encodes_rounded_to_its_dtype():
    """5.2: a `scalar` attribute's f64 is the value rounded to the result dtype (as 4.4 and
    5.4 say), so 0.1 in an f32 `full` encodes as the f32 nearest 0.1."""
    import struct

    import numpy as np

    assert "The `f64` is the value rounded to the\n  result dtype (4.4)" in _section("5. Canonical encoding")
    texts = [f"dtm 1.0\nfunc @f() -> (f32[]) {{\n  %y = full {{value = {v}}} : f32[]\n  return %y\n}}\n"
             for v in ("0.1", "0.10000000149011612")]
    encoded = [ir.encode(ir.verify(ir.parse(t))) for t in texts]
    assert encoded[0] == encoded[1]
    assert b"\x01" + struct.pack("<d", float(np.float32(0.1))) in encoded[0]
    assert struct.pack("<d", 0.1) not in encoded[0]


@pytest.mark.parametrize("line, ok", [("dtm 1.0", True), ("dtm 1.0.0", True), (" \tdtm\t1.0 // v1", True),
                                      ("dtm 1.0//c\r", True), ("dtm 000001.000000.999999", True),
                                      ("dtm 1 .0", False), ("dtm 1. 0", False), ("dtm 1.0x", False),
                                      ("dtm v1.0", False), ("dtm1.0", False), ("dtm 1", False),
                                      ("dtm 1234567.0", False), ("dtm 1.0.0.0", False)])
def test_header_line_is_read_as_4_3_says(line, ok):
    """4.3: the header line is matched whole (4.2's tokens cannot read `1.0.0`)."""
    assert "header_line = " in _section("4. Text format")
    text = line + "\nfunc @f() -> () {\n  return\n}\n"
    if ok:
        assert ir.parse(text).version == (1, 0)
    else:
        with pytest.raises(ir.IRError) as e:
            ir.parse(text)
        assert e.value.code is ErrorCode.INVALID_HEADER


# --- random: the Philox test vectors the spec gives -----------------------------------------

def test_philox_vectors_match_the_reference():
    philox = pytest.importorskip("dtm.ref.philox")
    text = _op_section("random")
    vectors = re.findall(r"counter `([^`]+)`(?: four times)? and key `([^`]+)` give `([^`]+)`", text)
    assert len(vectors) == 3
    for counter, key, want in vectors:
        c = [int(w, 16) for w in re.split(r"[ ,]+", counter.strip())]
        c = c * 4 if len(c) == 1 else c
        k = [int(w, 16) for w in re.split(r"[ ,]+", key.strip())]
        got = philox.philox4x32(tuple([w] for w in c), (k[0], k[1]))
        assert " ".join(f"{int(w[0]):08x}" for w in got) == want


# --- links --------------------------------------------------------------------------------

def _slug(heading: str) -> str:
    text = heading.lstrip("#").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def test_internal_links_resolve():
    anchors = {_slug(l) for l in LINES if re.match(r"^#{1,6} ", l)}
    links = set(re.findall(r"\]\(#([^)]+)\)", SPEC))
    assert links, "the spec has no internal links"
    assert links <= anchors, f"links to missing headings: {sorted(links - anchors)}"


def _spec_philox(c: list[int], k: list[int]) -> list[int]:
    """Philox-4x32-10 exactly as the spec's pseudo-code writes it."""
    m0, m1, w0, w1, mask = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85, 0xFFFFFFFF
    c0, c1, c2, c3 = c
    k0, k1 = k
    for r in range(10):
        if r:
            k0, k1 = (k0 + w0) & mask, (k1 + w1) & mask
        p0, p1 = m0 * c0, m1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & mask, (p0 >> 32) ^ c3 ^ k1, p0 & mask
    return [c0, c1, c2, c3]


def test_random_as_the_spec_defines_it_matches_the_reference():
    np = pytest.importorskip("numpy")
    philox = pytest.importorskip("dtm.ref.philox")
    import math

    key = np.array([0x12345678, 0x9ABCDEF0], np.uint32)
    n = 37
    words = [_spec_philox([i & 0xFFFFFFFF, i >> 32, 0, 0], [int(key[0]), int(key[1])])[:2] for i in range(n)]
    for dt, p in ((np.float32, 24), (np.float16, 11)):
        want = np.array([(x0 >> (32 - p)) * 2.0**-p for x0, _ in words]).astype(dt)
        assert np.array_equal(philox.uniform(key, (n,), np.dtype(dt)), want), dt
    u53 = np.array([(((x0 << 21) ^ (x1 >> 11)) & (2**53 - 1)) * 2.0**-53 for x0, x1 in words])
    assert np.array_equal(philox.uniform(key, (n,), np.dtype(np.float64)), u53)
    normal = np.array([math.sqrt(-2 * math.log(((x0 >> 8) + 1) * 2.0**-24)) * math.cos(2 * math.pi * (x1 >> 8) * 2.0**-24)
                       for x0, x1 in words])
    assert np.allclose(philox.normal(key, (n,), np.dtype(np.float64)), normal, rtol=1e-12, atol=1e-12)


def test_quantization_as_the_spec_defines_it_matches_the_reference():
    """Section 2.2, block layout and quantizer, written out from the spec's text."""
    np = pytest.importorskip("numpy")
    quant = pytest.importorskip("dtm.ref.quant")
    f32 = np.float32
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 64)) * 3).astype(f32)
    x[1, :32] = np.arange(32, dtype=f32) - 16  # exact ties for both quantizers
    x[2, 32:] = 0                              # a block whose scale is 0

    def roundaway(v):
        return np.trunc(v + np.copysign(f32(0.5), v))

    def spec_q8(block):
        d = f32(np.max(np.abs(block)) / f32(127))
        inv = f32(1) / d if d != 0 else f32(0)
        q = np.clip(roundaway((block * inv).astype(f32)), -128, 127).astype(np.int8)
        return np.float16(d).tobytes() + q.tobytes()

    def spec_q4(block):
        m = block[int(np.argmax(np.abs(block)))]
        d = f32(m / f32(-8))
        inv = f32(1) / d if d != 0 else f32(0)
        q = np.clip(np.trunc(((block * inv).astype(f32) + f32(8.5)).astype(f32)), 0, 15).astype(np.uint8)
        packed = q[:16] | (q[16:] << 4)  # byte j: q_j low nibble, q_(j+16) high nibble
        return np.float16(d).tobytes() + packed.tobytes()

    for name, spec in (("q8_0", spec_q8), ("q4_0", spec_q4)):
        want = b"".join(spec(x[r, b:b + 32]) for r in range(3) for b in (0, 32))
        assert quant.quantize(x, DTYPES[name]).tobytes() == want, name
