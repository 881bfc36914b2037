"""Canonical text, canonical encoding and the module hash.

- format(parse(t)) is a fixed point, parse(format(m)) == m, decode(encode(m)) == m;
- the hash ignores everything that does not change meaning (layout, comments, value names,
  declaration and attribute order, defaults written out, 0 vs 0.0 for a float);
- the hash changes with every change of meaning;
- symbolic dims are polynomials in a normal form.
"""

from __future__ import annotations

import itertools
import math
import random
import re
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtm.ir as ir
from dtm.ir.attrs import format_value
from dtm.ir.registry import REGISTRY, REQUIRED
from dtm.ir.symbolic import SymDim, dim_add, dim_mul, dim_sub, format_dim, sym

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_ir_corpus import CORPUS, T1, check_roundtrip, seeds  # noqa: E402

SEEDS = seeds()
SEED_NAMES = sorted(SEEDS)


def h(text: str) -> str:
    return ir.verify(ir.parse(text)).hash()


def canon(text: str) -> str:
    return ir.format(ir.verify(ir.parse(text)))


# --- text transformations that keep the meaning -------------------------------------------

_TOK = re.compile(r"""\s+|//.*|%[A-Za-z0-9_.]+|@[A-Za-z_][A-Za-z0-9_.]*|[0-9]+\.?[0-9]*(?:[eE][-+]?[0-9]+)?"""
                  r"""|"(?:[^"\\]|\\.)*"|[A-Za-z_][A-Za-z0-9_]*|->|[\[\](){}:,=*+\-]|.""")


def tokens(line: str) -> list[str]:
    return [t for t in _TOK.findall(line) if not t.isspace() and not t.startswith("//")]


def respace(text: str, rng: random.Random) -> str:
    """Every token kept, separated by 1-3 random spaces or tabs; random indentation; random
    trailing whitespace; the header too."""
    out = []
    for line in text.split("\n"):
        toks = tokens(line)
        if not toks:
            out.append(line)
            continue
        ws = lambda: "".join(rng.choice(" \t") for _ in range(rng.randint(1, 3)))  # noqa: E731
        if toks[0] == "dtm":
            out.append(ws() + "dtm" + ws() + "".join(toks[1:]) + ws())
            continue
        out.append(ws() + ws().join(toks) + ws())
    return "\n".join(out)


def comment(text: str, rng: random.Random) -> str:
    """A `//` comment after every line and comment lines (with IR-looking text) between."""
    junk = ["// %x = add %y, %z : f32[4]", "//", "// } func @g() -> () {", '// "unterminated', "//// ///"]
    out = []
    for line in text.split("\n"):
        if rng.random() < 0.5:
            out.append(rng.choice(["", "  ", "\t"]) + rng.choice(junk))
        out.append(line + (" // trailing { [ ( %v" if line.strip() else ""))
    return "\n".join(out)


def blank_lines(text: str, rng: random.Random) -> str:
    out = []
    for line in text.split("\n"):
        for _ in range(rng.randint(0, 2)):
            out.append(rng.choice(["", " ", "\t \t"]))
        out.append(line)
    return "\n".join(out)


def crlf(text: str) -> str:
    return text.replace("\n", "\r\n")


def rename_values(text: str, rng: random.Random) -> str:
    """A random bijection of all %names onto fresh names (some numeric, some dotted)."""
    names = sorted(set(re.findall(r"%[A-Za-z0-9_.]+", text)))
    fresh = [f"%{p}{i}" for i, p in enumerate(rng.choice(["v", "_", "n.", "", "Q"]) for _ in names)]
    rng.shuffle(fresh)
    mapping = dict(zip(names, fresh))
    return re.sub(r"%[A-Za-z0-9_.]+", lambda m: mapping[m.group()], text)


def permute_names(text: str, rng: random.Random) -> str:
    """Swap existing %names among themselves (x <-> h, ...)."""
    names = sorted(set(re.findall(r"%[A-Za-z0-9_.]+", text)))
    perm = names[:]
    rng.shuffle(perm)
    mapping = dict(zip(names, perm))
    return re.sub(r"%[A-Za-z0-9_.]+", lambda m: mapping[m.group()], text)


def split_decls(text: str) -> tuple[list[str], list[str]]:
    """(prefix lines up to and including the header, [declaration blocks])."""
    lines = text.split("\n")
    i = 0
    while not lines[i].strip().startswith("dtm"):
        i += 1
    prefix, rest = lines[: i + 1], lines[i + 1:]
    blocks, cur, in_func = [], [], False
    for line in rest:
        s = re.sub(r"//.*", "", line).strip()
        if not s:
            continue
        cur.append(line)
        if s.startswith("func"):
            in_func = True
        if not in_func or s == "}":
            blocks.append("\n".join(cur))
            cur, in_func = [], False
    assert not cur
    return prefix, blocks


def reorder_decls(text: str, rng: random.Random) -> str:
    prefix, blocks = split_decls(text)
    rng.shuffle(blocks)
    return "\n".join(prefix + blocks) + "\n"


def _split_items(body: str) -> list[str]:
    """Split an attribute dict body at top-level commas (outside brackets and strings)."""
    items, depth, cur, i = [], 0, "", 0
    while i < len(body):
        c = body[i]
        if c == '"':
            j = i + 1
            while body[j] != '"':
                j += 2 if body[j] == "\\" else 1
            cur += body[i: j + 1]
            i = j + 1
            continue
        if c in "[(":
            depth += 1
        elif c in "])":
            depth -= 1
        if c == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
        else:
            cur += c
        i += 1
    if cur.strip():
        items.append(cur.strip())
    return items


_ATTR_DICT = re.compile(r"\{((?:[^{}\"]|\"(?:[^\"\\]|\\.)*\")*)\}")


def reorder_attrs(text: str, rng: random.Random) -> str:
    def shuffle(m):
        items = _split_items(m.group(1))
        rng.shuffle(items)
        return "{" + ", ".join(items) + "}"

    out = []
    for full_line in text.split("\n"):
        line, cmt = _split_comment(full_line)
        out.append((_ATTR_DICT.sub(shuffle, line) if not line.rstrip().endswith("{") else line) + cmt)
    return "\n".join(out)


_OP_LINE = re.compile(r"^(\s*(?:%[A-Za-z0-9_.]+\s*(?:,\s*%[A-Za-z0-9_.]+\s*)*=\s*)?)([a-z_][a-z0-9_]*)\b(.*)$")


def _split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of one line: the comment starts at the first // outside a string."""
    in_str = False
    i = 0
    while i < len(line):
        c = line[i]
        if in_str and c == "\\":
            i += 2
            continue
        if c == '"':
            in_str = not in_str
        elif not in_str and line.startswith("//", i):
            return line[:i], line[i:]
        i += 1
    return line, ""


def _colon_outside_strings(line: str) -> int:
    in_str, i = False, 0
    while i < len(line):
        c = line[i]
        if in_str and c == "\\":
            i += 2
            continue
        if c == '"':
            in_str = not in_str
        elif c == ":" and not in_str:
            return i
        i += 1
    return -1


def explicit_defaults(text: str) -> str:
    """Write every defaulted attribute explicitly, with its default value."""
    out = []
    for full_line in text.split("\n"):
        line, cmt = _split_comment(full_line)
        if cmt:
            out.append(explicit_defaults(line) + cmt)
            continue
        m = _OP_LINE.match(line)
        opdef = REGISTRY.get(m.group(2)) if m else None
        if opdef is None or line.strip().startswith(("func", "return", "mesh", "task", "dtm")):
            out.append(line)
            continue
        given = set(re.findall(r"([a-z_]+)\s*=", _ATTR_DICT.search(line).group(1))) if "{" in line else set()
        extra = [f"{a.name} = {format_value(a, a.default) if a.default is not None else ''}"
                 for a in opdef.attrs if a.default is not REQUIRED and a.name not in given and a.default is not None]
        if not extra:
            out.append(line)
        elif "{" in line:
            out.append(line.replace("{", "{" + ", ".join(extra) + ", ", 1).replace(", }", "}"))
        else:
            colon = _colon_outside_strings(line)
            head, tail = (line, "") if colon < 0 else (line[:colon], line[colon:])
            out.append(head + " {" + ", ".join(extra) + "} " + tail)
    return "\n".join(out)


LAYOUT_ONLY = {
    "respace": respace,
    "comment": comment,
    "blank_lines": blank_lines,
    "crlf": lambda t, rng: crlf(t),
    "reorder_decls": reorder_decls,
    "reorder_attrs": reorder_attrs,
    "explicit_defaults": lambda t, rng: explicit_defaults(t),
}
RENAMING = {"rename_values": rename_values, "permute_names": permute_names}


# --- the round trip -----------------------------------------------------------------------

@pytest.mark.parametrize("name", SEED_NAMES)
def test_seed_round_trips(name):
    check_roundtrip(SEEDS[name])


def test_t1_canonical_text_exactly():
    assert canon(T1) == """\
dtm 1.0

mesh @m[dp = 2, tp = 2]

func @mlp(%x: f32[B, 784] @m[shard(0), replicate], %w1: f32[784, 256] @m[replicate, shard(1)], %b1: f32[256], %w2: f32[256, 10] @m[replicate, shard(0)]) -> (f32[B, 10]) {
  %h = matmul %x, %w1 : f32[B, 256]
  %hb = add %h, %b1 : f32[B, 256]
  %a = gelu %hb {approximate = "tanh"} : f32[B, 256]
  %y = matmul %a, %w2 : f32[B, 10] @m[shard(0), partial(sum)]
  %r = all_reduce %y {axes = ["tp"], mesh = @m} : f32[B, 10]
  %s = reduce_sum %r {axes = [1], keepdims = true} : f32[B, 1]
  %c = constant {value = [[1.0, 2.5]]} : f32[1, 2]
  %z = full {value = 0.0} : f32[B, 10]
  return %r
}

task @t = @mlp {inputs = ["x", "w1", "b1", "w2"], outputs = ["y"]}
"""


@pytest.mark.parametrize("name", SEED_NAMES)
def test_canonical_text_is_a_fixed_point(name):
    c = canon(SEEDS[name])
    assert canon(c) == c
    assert c.endswith("\n") and not c.endswith("\n\n")
    assert "//" not in c
    assert "\t" not in c


@pytest.mark.parametrize("name", SEED_NAMES)
def test_encode_is_deterministic_and_decodes_to_equal_module(name):
    m = ir.verify(ir.parse(SEEDS[name]))
    enc = ir.encode(m)
    assert enc == ir.encode(ir.parse(SEEDS[name]))
    assert enc.startswith(b"DTMIR\x01")
    d = ir.decode(enc)
    assert d == m and ir.encode(d) == enc
    # decoded values are named by index; their text still parses to the same module
    assert ir.parse(ir.format(d)) == m
    assert m.hash() == d.hash() == ir.parse(ir.format(d)).hash()
    assert re.fullmatch(r"[0-9a-f]{64}", m.hash())


def test_unnamed_values_take_the_smallest_number_no_earlier_value_has():
    """Spec 4.5 rule 13: names go in order of definition; only earlier values count."""
    m = ir.parse("dtm 1.0\n\nfunc @f(%a: f32[4]) -> (f32[4]) {\n  %x = neg %a : f32[4]\n"
                 "  %0 = neg %x : f32[4]\n  return %0\n}\n")
    object.__setattr__(m.funcs["f"].ops[0].results[0], "name", None)  # (as a module built in code may have it)
    assert ir.format(m).splitlines()[3:5] == ["  %0 = neg %a : f32[4]", "  %1 = neg %0 : f32[4]"]
    decoded = ir.decode(ir.encode(m))  # no names at all: numbers in order, the parameter first
    assert ir.format(decoded).splitlines()[2:5] == ["func @f(%0: f32[4]) -> (f32[4]) {", "  %1 = neg %0 : f32[4]",
                                                     "  %2 = neg %1 : f32[4]"]


def test_module_equality_is_encoding_equality():
    a, b = ir.parse(T1), ir.parse(T1)
    assert a == b and a is not b
    assert a != ir.parse(T1.replace("dp = 2", "dp = 4"))
    assert a != "not a module" and a != None  # noqa: E711
    with pytest.raises(TypeError):
        hash(a)  # mutable: unhashable


def test_str_of_module_is_canonical_text():
    m = ir.parse(T1)
    assert str(m) == ir.format(m)


def test_format_and_hash_do_not_mutate():
    m = ir.verify(ir.parse(T1))
    before = ir.format(m)
    for _ in range(3):
        m.hash()
        ir.encode(m)
        ir.verify(m)
        ir.decode(ir.encode(m))
    assert ir.format(m) == before


# --- hash invariance ----------------------------------------------------------------------

def _bases() -> dict[str, str]:
    """Texts the transformations apply to: every seed in canonical form, and T1 as written."""
    out = {"t1-as-written": T1}
    for name, text in SEEDS.items():
        out[name] = canon(text)
    return out


BASES = _bases()
BASE_NAMES = sorted(BASES)


@pytest.mark.parametrize("transform", sorted(LAYOUT_ONLY))
@pytest.mark.parametrize("name", BASE_NAMES)
def test_layout_changes_keep_text_and_hash(name, transform):
    text = BASES[name]
    rng = random.Random(f"{name}/{transform}")
    t2 = LAYOUT_ONLY[transform](text, rng)
    assert canon(t2) == canon(text), t2
    assert h(t2) == h(text)


@pytest.mark.parametrize("transform", sorted(RENAMING))
@pytest.mark.parametrize("name", BASE_NAMES)
def test_renaming_values_keeps_hash(name, transform):
    text = BASES[name]
    t2 = RENAMING[transform](text, random.Random(f"{name}/{transform}"))
    assert h(t2) == h(text)
    if transform == "rename_values":
        assert canon(t2) != canon(text)  # the canonical text keeps the new names


@pytest.mark.parametrize("name", BASE_NAMES)
def test_all_layout_changes_at_once(name):
    text = BASES[name]
    rng = random.Random(name)
    t2 = text
    for key in ["explicit_defaults", "reorder_attrs", "reorder_decls", "rename_values", "respace", "comment",
                "blank_lines"]:
        t2 = {**LAYOUT_ONLY, **RENAMING}[key](t2, rng)
    assert h(t2) == h(text)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(BASE_NAMES), seed=st.integers(0, 2**32 - 1),
       keys=st.lists(st.sampled_from(sorted({**LAYOUT_ONLY, **RENAMING})), min_size=1, max_size=6))
def test_random_layout_changes_keep_hash(name, seed, keys):
    text = BASES[name]
    rng = random.Random(seed)
    t2 = text
    for key in keys:
        if key != "crlf":
            t2 = {**LAYOUT_ONLY, **RENAMING}[key](t2, rng)
    if "crlf" in keys:
        t2 = crlf(t2)
    assert h(t2) == h(text)


def test_t1_variants_by_hand():
    base = h(T1)
    same = [
        T1.replace("%z = full {value = 0}", "%z = full {value = 0.0}"),
        T1.replace("%z = full {value = 0}", "%z = full {value = 0.00e0}"),
        T1.replace("%z = full {value = 0}", "%z = full {value = -0}"),
        T1.replace('{mesh = @m, axes = ["tp"], op = "sum"}', '{axes = ["tp"], mesh = @m}'),
        T1.replace('{mesh = @m, axes = ["tp"], op = "sum"}', '{op = "sum", mesh = @m, axes = ["tp"]}'),
        T1.replace('{approximate = "tanh"}', '{approximate = "\\u0074anh"}'),
        T1.replace("[[1.0, 2.5]]", "[[1, 2.50]]"),
        T1.replace("[[1.0, 2.5]]", "[[1e0, 25e-1]]"),
        T1.replace("[[1.0, 2.5]]", "[[1., 0.25e1]]"),
        T1.replace("f32[B, 784]", "f32[(B), 784]"),
        T1.replace("f32[784, 256]", "f32[(700 + 84), 2*128]"),
        T1.replace("f32[B, 256]", "f32[B + 0, 256]").replace("f32[B, 10]", "f32[B*1, 10]"),
        T1.replace("dtm 1.0", "dtm 1.0 // header comment"),
        T1.replace("dtm 1.0", "\n\n  dtm\t1.0  \n\n"),
        T1.replace('"x", "w1"', '"\\u0078", "w1"'),
        T1.replace("// An MLP, sharded over a 2x2 mesh.\n", ""),
    ]
    for t in same:
        assert h(t) == base, t


def test_full_zero_int_and_float_hash_equal_per_dtype():
    def full(dtype, v):
        return h(f"dtm 1.0\nfunc @f() -> ({dtype}[2]) {{\n  %z = full {{value = {v}}} : {dtype}[2]\n  return %z\n}}\n")

    for dt in ["f32", "f64", "f16", "bf16"]:
        assert full(dt, "0") == full(dt, "0.0") == full(dt, "0e5")
        assert full(dt, "3") == full(dt, "3.0")
        assert full(dt, "0") != full(dt, "-0.0")  # a negative zero is a different value
    for dt in ["i32", "i64", "u8"]:
        assert full(dt, "3") == full(dt, "3.0")
    assert full("f32", "0") != full("f64", "0")
    assert full("i32", "0") != full("f32", "0")


def test_default_attributes_explicit_keep_hash():
    base = """dtm 1.0
mesh @m[a = 2]
func @f(%x: f32[4, 6], %q: f32[2, 4, 8], %k: u32[2]) -> (f32[4]) {
  %s = reduce_sum %x {axes = [1]} : f32[4]
  %g = gelu %x : f32[4, 6]
  %l = layer_norm %x : f32[4, 6]
  %r = all_reduce %x {mesh = @m, axes = ["a"]} : f32[4, 6]
  %b = broadcast %x {mesh = @m, axes = ["a"]} : f32[4, 6]
  %p = pad %x {low = [1, 0], high = [0, 0]} : f32[5, 6]
  %a = scaled_dot_product_attention %q, %q, %q : f32[2, 4, 8]
  %n = random %k : f32[3]
  %am = argmax %x {axis = 0} : i64[6]
  return %s
}
task @t = @f {inputs = ["x", "q", "k"], outputs = ["s"]}
"""
    explicit = (base.replace("{axes = [1]}", "{axes = [1], keepdims = false}")
                .replace("gelu %x :", 'gelu %x {approximate = "none"} :')
                .replace("layer_norm %x :", "layer_norm %x {eps = 1e-05} :")
                .replace('all_reduce %x {mesh = @m, axes = ["a"]}', 'all_reduce %x {mesh = @m, axes = ["a"], op = "sum"}')
                .replace('broadcast %x {mesh = @m, axes = ["a"]}', 'broadcast %x {mesh = @m, axes = ["a"], src = 0}')
                .replace("high = [0, 0]}", "high = [0, 0], value = 0.0}")
                .replace("%q, %q, %q :", "%q, %q, %q {causal = false} :")
                .replace("random %k :", 'random %k {distribution = "uniform"} :')
                .replace("{axis = 0}", "{keepdims = false, axis = 0}")
                .replace('outputs = ["s"]}', 'outputs = ["s"], after = []}'))
    assert explicit != base
    assert h(explicit) == h(base)
    assert canon(explicit) == canon(base)
    assert "keepdims" not in canon(explicit) and "after" not in canon(explicit)
    assert h(explicit.replace("{eps = 1e-05}", "{eps = 0.00001}")) == h(base)
    assert h(explicit.replace("{eps = 1e-05}", "{eps = 1e-5}")) == h(base)
    assert h(explicit.replace("value = 0.0}", "value = 0}")) == h(base)


def test_reordered_declarations_keep_hash_exhaustively():
    text = CORPUS["calls_tasks"]
    prefix, blocks = split_decls(text)
    hashes = {h("\n".join(prefix + list(p)) + "\n") for p in itertools.permutations(blocks)}
    assert hashes == {h(text)}


# --- hash changes with every change of meaning ---------------------------------------------

MEANING_CHANGES = {
    "op name": ("%hb = add %h, %b1", "%hb = sub %h, %b1"),
    "op name 2": ("%h = matmul %x, %w1 : f32[B, 256]\n  %hb = add", "%h = matmul %x, %w1 : f32[B, 256]\n  %hb = max"),
    "enum attribute": ('{approximate = "tanh"}', ""),
    "reduce op": ('op = "sum"}', 'op = "max"}'),
    "axes attribute": ("{axes = [1], keepdims = true} : f32[B, 1]", "{axes = [0], keepdims = true} : f32[1, 10]"),
    "keepdims": ("{axes = [1], keepdims = true} : f32[B, 1]", "{axes = [1]} : f32[B]"),
    "dim": ("784", "785"),
    "symbol name": ("B", "N"),
    "symbolic dim": ("[B,", "[2*B,"),
    "dtype": ("%c = constant {value = [[1.0, 2.5]]} : f32[1, 2]", "%c = constant {value = [[1.0, 2.5]]} : f64[1, 2]"),
    "constant element": ("[[1.0, 2.5]]", "[[1.0, 2.25]]"),
    "constant element sign of zero": ("[[1.0, 2.5]]", "[[-0.0, 2.5]]"),
    "constant element zero": ("[[1.0, 2.5]]", "[[0.0, 2.5]]"),
    "full value": ("{value = 0}", "{value = 1}"),
    "placement shard->replicate": ("f32[B, 784] @m[shard(0), replicate]", "f32[B, 784] @m[replicate, replicate]"),
    "placement shard dim": ("f32[784, 256] @m[replicate, shard(1)]", "f32[784, 256] @m[replicate, shard(0)]"),
    "placement partial op": ("partial(sum)", "partial(max)"),
    "placement partial->replicate": ("@m[shard(0), partial(sum)]", "@m[shard(0), replicate]"),
    "sharding removed": (" @m[shard(0), partial(sum)]", ""),
    "sharding added": ("%b1: f32[256],", "%b1: f32[256] @m[replicate, replicate],"),
    "operand order": ("add %h, %b1", "add %b1, %h"),
    "mesh axis size": ("dp = 2", "dp = 4"),
    "mesh axis order": ("[dp = 2, tp = 2]", "[tp = 2, dp = 2]"),
    "mesh axis name": ('dp = 2', 'dq = 2'),
    "mesh name": ("@m", "@mm"),
    "collective axes": ('axes = ["tp"]', 'axes = ["dp"]'),
    "task input": ('inputs = ["x",', 'inputs = ["x0",'),
    "task input order": ('inputs = ["x", "w1"', 'inputs = ["w1", "x"'),
    "task output": ('outputs = ["y"]', 'outputs = ["out"]'),
    "task after": ('outputs = ["y"]}', 'outputs = ["y"]}\ntask @t0 = @mlp {inputs = ["a", "b", "c", "d"], outputs = ["e"]}'),
    "task name": ("task @t =", "task @u ="),
    "func name": ("@mlp", "@mlp2"),
    "returned value": ("return %r", "return %z"),
    "extra op": ("  return %r", "  %e = exp %r : f32[B, 10]\n  return %r"),
    "removed op": ("  %s = reduce_sum %r {axes = [1], keepdims = true} : f32[B, 1]\n", ""),
    "op order": ("  %c = constant {value = [[1.0, 2.5]]} : f32[1, 2]\n  %z = full {value = 0} : f32[B, 10]\n",
                 "  %z = full {value = 0} : f32[B, 10]\n  %c = constant {value = [[1.0, 2.5]]} : f32[1, 2]\n"),
    "operand of op": ("%s = reduce_sum %r", "%s = reduce_sum %y"),
    "result type of func": ("-> (f32[B, 10]) {", "-> (f32[B, 10] @m[replicate, replicate]) {"),
}


def _t1_with(old: str, new: str) -> str:
    assert old in T1, old
    return T1.replace(old, new)


def test_meaning_changes_change_the_hash():
    hashes = {"base": h(T1)}
    for what, (old, new) in MEANING_CHANGES.items():
        t = _t1_with(old, new)
        if what == "task after":
            t = t.replace('outputs = ["y"]}\ntask @t0', 'outputs = ["y"], after = [@t0]}\ntask @t0')
        hashes[what] = h(t)
    by_hash: dict[str, list[str]] = {}
    for what, hv in hashes.items():
        by_hash.setdefault(hv, []).append(what)
    clashes = [v for v in by_hash.values() if len(v) > 1]
    assert not clashes, f"these changes of meaning hash equal: {clashes}"


def test_task_after_changes_hash():
    two = T1 + 'task @u = @mlp {inputs = ["a", "b", "c", "d"], outputs = ["e"]}\n'
    after = two.replace('outputs = ["e"]}', 'outputs = ["e"], after = [@t]}')
    assert h(two) != h(after)


def test_literal_dtype_element_changes_change_hash():
    def const(dtype, v, shape):
        return h(f"dtm 1.0\nfunc @f() -> ({dtype}{shape}) {{\n  %c = constant {{value = {v}}} : {dtype}{shape}\n"
                 f"  return %c\n}}\n")

    hs = [const("f32", "[1.0, 2.0]", "[2]"), const("f32", "[2.0, 1.0]", "[2]"), const("f64", "[1.0, 2.0]", "[2]"),
          const("i32", "[1, 2]", "[2]"), const("i64", "[1, 2]", "[2]"), const("f32", "[[1.0, 2.0]]", "[1, 2]"),
          const("f32", "[[1.0], [2.0]]", "[2, 1]"), const("u8", "[1, 2]", "[2]"), const("bool", "[true, false]", "[2]"),
          const("bool", "[false, true]", "[2]")]
    assert len(set(hs)) == len(hs)


# --- symbolic dims ------------------------------------------------------------------------

B, T, S = sym("B"), sym("T"), sym("S")


def test_symbolic_products_commute_and_normalise():
    assert dim_mul(B, T) == dim_mul(T, B)
    assert hash(dim_mul(B, T)) == hash(dim_mul(T, B))
    assert dim_mul(dim_add(B, 1), 2) == dim_add(dim_mul(2, B), 2)
    assert format_dim(dim_mul(dim_add(B, 1), 2)) == "2*B + 2"
    assert format_dim(dim_mul(T, B)) == "B*T"
    assert format_dim(dim_add(dim_add(dim_mul(2, dim_mul(B, T)), S), -1)) == "2*B*T + S - 1"
    assert format_dim(dim_sub(T, 1)) == "T - 1"
    assert format_dim(dim_mul(B, B)) == "B*B"
    assert dim_sub(dim_add(B, 1), B) == 1 and type(dim_sub(dim_add(B, 1), B)) is int
    assert dim_sub(B, B) == 0 and type(dim_sub(B, B)) is int
    assert dim_mul(B, 0) == 0 and type(dim_mul(B, 0)) is int
    assert dim_mul(B, 1) == B
    assert isinstance(B, SymDim) and B != "B" and B != 1


@pytest.mark.parametrize("a, b", [
    ("B*T", "T*B"),
    ("(B+1)*2", "2*B + 2"),
    ("(B + 1)*2", "2 + B*2"),
    ("B*(T + S)", "S*B + B*T"),
    ("(B + T)*(B - T) + T*T", "B*B"),
    ("B - 1 + 1", "B"),
    ("2*B - B", "B"),
    ("B*T*S", "S*T*B"),
    ("(((B)))", "B"),
    ("4*(B*T)", "B*4*T"),
    ("B + B + B", "3*B"),
])
def test_equal_symbolic_dims_in_text_hash_equal(a, b):
    def mod(d):
        return f"dtm 1.0\nfunc @f(%x: f32[{d}], %y: f32[B, T, S]) -> (f32[{d}]) {{\n  return %x\n}}\n"

    assert h(mod(a)) == h(mod(b))
    assert canon(mod(a)) == canon(mod(b))


@pytest.mark.parametrize("written, printed", [
    ("T*B", "B*T"),
    ("(B+1)*2", "2*B + 2"),
    ("1 + T", "T + 1"),
    ("S + B*T*2 - 1", "2*B*T + S - 1"),
    ("B*B*T + B", "B*B*T + B"),
    ("T - 1", "T - 1"),
    ("(T - 1)*(T + 1)", "T*T - 1"),
    ("B - 3 + 3", "B"),
    ("0 + 7", "7"),
    ("B*T - T*B + 5", "5"),
])
def test_symbolic_dims_print_in_normal_form(written, printed):
    t = ir.tensor_type(f"f32[{written}, B, T]")
    assert format_dim(t.shape[0]) == printed
    assert str(t) == f"f32[{printed}, B, T]"
    text = f"dtm 1.0\nfunc @f(%x: f32[B, T], %y: f32[{written}]) -> (f32[{written}]) {{\n  return %y\n}}\n"
    assert f"f32[{printed}]" in canon(text)


def _eval(d, env) -> int:
    if isinstance(d, int):
        return d
    total = 0
    for mono, coef in d.terms:
        p = coef
        for s in mono:
            p *= env[s]
        total += p
    return total


@st.composite
def dim_exprs(draw, depth=0):
    """(text, python-evaluable function of env) for a random dim expression."""
    choice = draw(st.integers(0, 5 if depth < 3 else 1))
    if choice == 0:
        n = draw(st.integers(0, 9))
        return str(n), (lambda env, n=n: n)
    if choice == 1:
        s = draw(st.sampled_from("BTS"))
        return s, (lambda env, s=s: env[s])
    a, fa = draw(dim_exprs(depth + 1))
    b, fb = draw(dim_exprs(depth + 1))
    if choice == 2:
        return f"{a} + {b}", (lambda env: fa(env) + fb(env))
    if choice == 3:
        return f"({a}) - ({b})", (lambda env: fa(env) - fb(env))
    if choice == 4:
        return f"({a})*({b})", (lambda env: fa(env) * fb(env))
    k = draw(st.integers(0, 3))
    return f"({a} + {b})*{k}", (lambda env: (fa(env) + fb(env)) * k)


@settings(max_examples=150, deadline=None)
@given(expr=dim_exprs(), envs=st.lists(st.fixed_dictionaries({k: st.integers(-5, 9) for k in "BTS"}),
                                       min_size=1, max_size=4))
def test_symbolic_normal_form_evaluates_like_the_expression(expr, envs):
    text, fn = expr
    try:
        t = ir.tensor_type(f"f32[{text}]")
    except ir.IRError as e:
        # only a negative constant dim may be refused
        assert e.code.value == "E0405", e
        return
    d = t.shape[0]
    for env in envs:
        assert _eval(d, env) == fn(env)
    # the normal form is unique: printing and reading it back gives the same dim
    printed = format_dim(d)
    assert ir.tensor_type(f"f32[{printed}]").shape[0] == d


# --- edge cases that were bugs once ---------------------------------------------------------

def test_leading_negative_dim_round_trips():
    text = "dtm 1.0\nfunc @f(%x: f32[2 - B]) -> (f32[2 - B]) {\n  return %x\n}\n"
    check_roundtrip(text)


def test_pad_bool_default_value():
    text = ("dtm 1.0\nfunc @f(%x: bool[4]) -> (bool[5]) {\n  %p = pad %x {low = [1], high = [0]} : bool[5]\n"
            "  return %p\n}\n")
    check_roundtrip(text)


def test_pad_bool_value_false_round_trips():
    text = ("dtm 1.0\nfunc @f(%x: bool[4]) -> (bool[5]) {\n"
            "  %p = pad %x {low = [1], high = [0], value = false} : bool[5]\n  return %p\n}\n")
    check_roundtrip(text)


@pytest.mark.parametrize("line", [
    "  %y = layer_norm %x {eps = -nan} : f32[4]",
    "  %y = constant {value = [-nan, 1.0, 2.0, 3.0]} : f32[4]",
    "  %y = full {value = -nan} : f32[4]",
])
def test_negative_nan_round_trips(line):
    text = f"dtm 1.0\nfunc @f(%x: f32[4]) -> (f32[4]) {{\n{line}\n  return %x\n}}\n"
    check_roundtrip(text)
    # a NaN is a NaN: the sign is not part of the meaning (the IR canonicalises it)
    assert h(text) == h(text.replace("-nan", "nan"))


def test_positive_nan_and_infinities_round_trip():
    for line in ["  %y = layer_norm %x {eps = nan} : f32[4]",
                 "  %y = constant {value = [nan, inf, -inf, -0.0]} : f32[4]",
                 "  %y = full {value = -inf} : f32[4]",
                 "  %y = full {value = 1e999} : f64[4]",
                 "  %y = constant {value = [1e-45, 3.4028235e+38, 1e-50, 0.1]} : f32[4]"]:
        check_roundtrip(f"dtm 1.0\nfunc @f(%x: f32[4]) -> (f32[4]) {{\n{line}\n  return %x\n}}\n")


def test_u64_max_constant_round_trips():
    b = ir.Builder()
    f = b.func("f")
    c = f.constant(type="u64[1]", value=[2**64 - 1])
    f.ret(c)
    m = b.build()
    assert ir.parse(ir.format(m)) == m


def test_rank_64_constant_round_trips():
    b = ir.Builder()
    f = b.func("f")
    v = 1.0
    for _ in range(64):
        v = [v]
    c = f.constant(type="f32[" + ", ".join(["1"] * 64) + "]", value=v)
    f.ret(c)
    m = b.build()
    assert ir.parse(ir.format(m)) == m
    assert ir.decode(ir.encode(m)) == m


def test_rank_65_constant_is_refused():
    v = "1.0"
    for _ in range(65):
        v = f"[{v}]"
    text = (f"dtm 1.0\nfunc @f() -> () {{\n  %c = constant {{value = {v}}} : f32[{', '.join(['1'] * 65)}]\n"
            "  return\n}\n")
    with pytest.raises(ir.IRError) as ei:
        ir.verify(ir.parse(text))
    assert ei.value.code.value == "E0405" and "rank 65" in ei.value.message


def test_rank_63_constant_round_trips():
    b = ir.Builder()
    f = b.func("f")
    v = 1.0
    for _ in range(63):
        v = [v]
    c = f.constant(type="f32[" + ", ".join(["1"] * 63) + "]", value=v)
    f.ret(c)
    m = b.build()
    assert ir.parse(ir.format(m)) == m


def test_lone_surrogate_in_string():
    text = 'dtm 1.0\nfunc @f() -> (f32[4]) {\n  %y = store_get {key = "\\ud800"} : f32[4]\n  return %y\n}\n'
    try:
        m = ir.verify(ir.parse(text))
    except ir.IRError:
        return  # refusing it at parse time is fine
    m.hash()
    check_roundtrip(text)


def test_dim_product_beyond_limit_is_refused():
    d = "4611686018427387903*4611686018427387903"
    text = f"dtm 1.0\nfunc @f(%x: f32[{d}]) -> (f32[{d}]) {{\n  return %x\n}}\n"
    with pytest.raises(ir.IRError) as ei:
        ir.verify(ir.parse(text))
    assert ei.value.code.value == "E0405"


# --- values of every kind survive text and bytes ----------------------------------------------

@settings(max_examples=150, deadline=None)
@given(s=st.text(max_size=20),
       names=st.lists(st.from_regex(r"[A-Za-z0-9_.]+", fullmatch=True), min_size=2, max_size=2, unique=True),
       g=st.from_regex(r"[A-Za-z_][A-Za-z0-9_.]*", fullmatch=True))
def test_strings_and_names_round_trip(s, names, g):
    import json

    key = json.dumps(s)
    a, b = names
    text = (f"dtm 1.0\nfunc @{g}(%{a}: f32[4]) -> (f32[4]) {{\n  %{b} = store_get {{key = {key}}} : f32[4]\n"
            f"  store_put %{b} {{key = {key}}}\n  return %{a}\n}}\n"
            f"task @t{g} = @{g} {{inputs = [{key}], outputs = [{key}]}}\n")
    m = check_roundtrip(text)
    assert m.funcs[g].ops[0].attrs["key"] == s
    assert m.tasks["t" + g].inputs == (s,)


@settings(max_examples=150, deadline=None)
@given(eps=st.floats(allow_nan=False), scale=st.one_of(st.none(), st.floats(allow_nan=False)))
def test_float_attributes_round_trip_exactly(eps, scale):
    attrs = f"eps = {eps!r}"
    sc = "" if scale is None else f" {{scale = {scale!r}}}"
    text = (f"dtm 1.0\nfunc @f(%x: f32[2, 4]) -> (f32[2, 4]) {{\n  %y = layer_norm %x {{{attrs}}} : f32[2, 4]\n"
            f"  %a = scaled_dot_product_attention %x, %x, %x{sc} : f32[2, 4]\n  return %y\n}}\n")
    m = check_roundtrip(text)
    got = m.funcs["f"].ops[0].attrs["eps"]
    assert got == eps and math.copysign(1, got) == math.copysign(1, eps)


@settings(max_examples=100, deadline=None)
@given(xs=st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=8),
       ys=st.lists(st.floats(allow_nan=False), min_size=1, max_size=8))
def test_float_literals_round_trip_bit_exactly(xs, ys):
    import numpy as np

    f32 = "[" + ", ".join(repr(x) for x in xs) + "]"
    f64 = "[" + ", ".join(repr(y) for y in ys) + "]"
    text = (f"dtm 1.0\nfunc @f() -> (f32[{len(xs)}], f64[{len(ys)}]) {{\n"
            f"  %a = constant {{value = {f32}}} : f32[{len(xs)}]\n  %b = constant {{value = {f64}}} : f64[{len(ys)}]\n"
            f"  return %a, %b\n}}\n")
    m = check_roundtrip(text)
    a, b = (op.attrs["value"].to_numpy() for op in m.funcs["f"].ops)
    assert a.tobytes() == np.array(xs, dtype=np.float32).tobytes()
    assert b.tobytes() == np.array(ys, dtype=np.float64).tobytes()


@pytest.mark.parametrize("dtype, bits", [("f16", 16), ("bf16", 16), ("f8e4m3", 8), ("f8e5m2", 8)])
def test_every_narrow_float_value_round_trips_through_text(dtype, bits):
    import numpy as np

    from dtm.ir.attrs import format_element
    from dtm.ir.dtypes import DTYPES, numpy_dtype

    dt = DTYPES[dtype]
    utype = np.uint16 if bits == 16 else np.uint8
    vals = np.arange(2**bits, dtype=np.uint32).astype(utype).view(numpy_dtype(dt))
    finite = vals[~np.isnan(vals.astype(np.float32))]
    text = (f"dtm 1.0\nfunc @f() -> ({dtype}[{len(finite)}]) {{\n  %c = constant {{value = ["
            + ", ".join(format_element(v, dt) for v in finite)
            + f"]}} : {dtype}[{len(finite)}]\n  return %c\n}}\n")
    m = ir.verify(ir.parse(text))
    assert m.funcs["f"].ops[0].attrs["value"].data == finite.tobytes()
    assert ir.parse(ir.format(m)) == m


@pytest.mark.parametrize("dtype", ["i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64"])
def test_integer_extremes_round_trip(dtype):
    import numpy as np

    from dtm.ir.dtypes import DTYPES, numpy_dtype

    info = np.iinfo(numpy_dtype(DTYPES[dtype]))
    text = (f"dtm 1.0\nfunc @f() -> ({dtype}[3]) {{\n  %c = constant {{value = [{info.min}, {info.max}, 0]}} : {dtype}[3]\n"
            f"  %d = full {{value = {info.max}}} : {dtype}[2]\n  %e = full {{value = {info.min}}} : {dtype}[2]\n"
            f"  return %c\n}}\n")
    m = check_roundtrip(text)
    assert m.funcs["f"].ops[0].attrs["value"].to_numpy().tolist() == [info.min, info.max, 0]


def test_minimal_modules_round_trip():
    for text in ["dtm 1.0\n", "dtm 1.0\nmesh @m[a = 1]\n", "dtm 1.0\nfunc @f() -> () {\n  return\n}\n",
                 "dtm 1.0\nfunc @f() -> () {\n  return\n}\ntask @t = @f {inputs = [], outputs = []}\n",
                 "dtm 1.0\nfunc @a.b() -> () {\n  return\n}\n"]:
        check_roundtrip(text)


def test_f64_literal_beyond_f32_range_parses_without_warnings():
    import warnings

    text = "dtm 1.0\nfunc @f() -> (f64[2]) {\n  %c = constant {value = [1e300, -1e300]} : f64[2]\n  return %c\n}\n"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_roundtrip(text)


def test_narrow_float_dtypes_load_ml_dtypes_only_when_used():
    """`import dtm` does not import ml_dtypes (half a second); the first bf16 / f8 dtype asked
    for does, and an ml_dtypes array made elsewhere is recognised (from_numpy)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        import numpy as np
        import dtm
        from dtm.ir.dtypes import DTYPES, NARROW_FLOATS, from_numpy, numpy_dtype
        assert "ml_dtypes" not in sys.modules
        assert np.dtype(np.float16) in NARROW_FLOATS and np.dtype(np.float32) not in NARROW_FLOATS
        x = dtm.tensor(np.array([1.0, 2.5, 3.0078125], np.float32)).to(dtm.bfloat16).numpy()
        assert "ml_dtypes" in sys.modules
        import ml_dtypes
        assert x.dtype == np.dtype(ml_dtypes.bfloat16) and x.dtype in NARROW_FLOATS
        x = dtm.tensor(x)
        assert x.float().numpy().tolist() == [1.0, 2.5, 3.0]  # bf16 keeps 8 significant bits
        assert from_numpy(np.dtype(ml_dtypes.float8_e5m2)) is DTYPES["f8e5m2"]
        assert numpy_dtype(DTYPES["f8e4m3"]) == np.dtype(ml_dtypes.float8_e4m3fn)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
