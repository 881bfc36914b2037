"""A corpus of valid DTM IR modules, shared as seeds by the other tests/test_ir_*.py files
(round-trip, fuzzing), and the checks that every entry is valid and canonicalises.

Import it as `from test_ir_corpus import CORPUS, T1, seeds` after putting this directory
on sys.path (the other files do that), so it works in every pytest import mode.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import dtm.ir as ir

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# The example module /tmp/t1.dtm, copied.
T1 = """\
// An MLP, sharded over a 2x2 mesh.
dtm 1.0
mesh @m[dp = 2, tp = 2]

func @mlp(%x: f32[B, 784] @m[shard(0), replicate], %w1: f32[784, 256] @m[replicate, shard(1)], %b1: f32[256], %w2: f32[256, 10] @m[replicate, shard(0)]) -> (f32[B, 10]) {
  %h = matmul %x, %w1 : f32[B, 256]
  %hb = add %h, %b1 : f32[B, 256]
  %a = gelu %hb {approximate = "tanh"} : f32[B, 256]
  %y = matmul %a, %w2 : f32[B, 10] @m[shard(0), partial(sum)]
  %r = all_reduce %y {mesh = @m, axes = ["tp"], op = "sum"} : f32[B, 10]
  %s = reduce_sum %r {axes = [1], keepdims = true} : f32[B, 1]
  %c = constant {value = [[1.0, 2.5]]} : f32[1, 2]
  %z = full {value = 0} : f32[B, 10]
  return %r
}
task @t = @mlp {inputs = ["x", "w1", "b1", "w2"], outputs = ["y"]}
"""

# Every op of the registry appears in at least one entry (checked below).
CORPUS: dict[str, str] = {
    "t1": T1,
    "unary": """\
dtm 1.0
func @unary(%x: f32[2, 3], %i: i32[4], %b: bool[5]) -> (f32[2, 3]) {
  %0 = neg %x : f32[2, 3]
  %1 = abs %0 : f32[2, 3]
  %2 = sign %1 : f32[2, 3]
  %3 = exp %2 : f32[2, 3]
  %4 = exp2 %3 : f32[2, 3]
  %5 = log %4 : f32[2, 3]
  %6 = log2 %5 : f32[2, 3]
  %7 = sqrt %6 : f32[2, 3]
  %8 = rsqrt %7 : f32[2, 3]
  %9 = reciprocal %8 : f32[2, 3]
  %10 = sin %9 : f32[2, 3]
  %11 = cos %10 : f32[2, 3]
  %12 = tanh %11 : f32[2, 3]
  %13 = erf %12 : f32[2, 3]
  %14 = sigmoid %13 : f32[2, 3]
  %15 = floor %14 : f32[2, 3]
  %16 = ceil %15 : f32[2, 3]
  %17 = round %16 : f32[2, 3]
  %18 = gelu %17 : f32[2, 3]
  %19 = silu %18 : f32[2, 3]
  %20 = neg %i : i32[4]
  %21 = abs %20 : i32[4]
  %22 = logical_not %b : bool[5]
  %23 = cast %i {to = f16} : f16[4]
  %24 = bitcast %i {to = f32} : f32[4]
  %25 = bitcast %24 {to = u32} : u32[4]
  return %19
}
""",
    "binary": """\
dtm 1.0
func @binary(%x: f32[2, 1, 3], %y: f32[4, 1], %i: i64[3], %j: i64[2, 3], %p: bool[3], %q: bool[1]) -> (f32[2, 4, 3], bool[2, 3]) {
  %a = add %x, %y : f32[2, 4, 3]
  %b = sub %a, %y : f32[2, 4, 3]
  %c = mul %b, %x : f32[2, 4, 3]
  %d = div %c, %c : f32[2, 4, 3]
  %e = pow %d, %y : f32[2, 4, 3]
  %f = max %e, %x : f32[2, 4, 3]
  %g = min %f, %y : f32[2, 4, 3]
  %h = mod %i, %j : i64[2, 3]
  %k = logical_and %p, %q : bool[3]
  %l = logical_or %k, %p : bool[3]
  %m = logical_xor %l, %q : bool[3]
  %n = eq %h, %i : bool[2, 3]
  %o = ne %n, %m : bool[2, 3]
  %r = lt %x, %y : bool[2, 4, 3]
  %s = le %i, %j : bool[2, 3]
  %t = gt %g, %x : bool[2, 4, 3]
  %u = ge %j, %i : bool[2, 3]
  %v = where %r, %g, %x : f32[2, 4, 3]
  return %v, %o
}
""",
    "reduce": """\
dtm 1.1
func @reduce(%x: f32[B, 3, 4], %i: i32[5, 6]) -> (f32[B], i64[B, 1, 4]) {
  %a = reduce_sum %x {axes = [1, 2]} : f32[B]
  %b = reduce_prod %x {axes = [0], keepdims = true} : f32[1, 3, 4]
  %c = reduce_max %i {axes = []} : i32[5, 6]
  %d = reduce_min %i {axes = [0, 1]} : i32[]
  %e = argmax %x {axis = 1, keepdims = true} : i64[B, 1, 4]
  %f = argmin %i {axis = 0} : i64[6]
  %g = argsort %x {axis = 2, descending = true} : i64[B, 3, 4]
  %h = cumsum %i {axis = 1} : i32[5, 6]
  return %a, %e
}
""",
    "movement": """\
dtm 1.0
func @movement(%x: f32[B, T, 4], %idx: i32[7], %upd: f32[B, 7, 4], %pos: i64[]) -> (f32[B*T, 4]) {
  %r = reshape %x {shape = [T*B, 4]} : f32[B*T, 4]
  %r2 = reshape %x {shape = [B*T*4]} : f32[4*B*T]
  %p = permute %x {perm = [2, 0, 1]} : f32[4, B, T]
  %bt = broadcast_to %x {shape = [3, B, T, 4]} : f32[3, B, T, 4]
  %s = slice %x {start = [0, 1, 0], stop = [B, T, 4], step = [1, 1, 2]} : f32[B, T - 1, 2]
  %pd = pad %x {low = [0, 1, 2], high = [1, 0, 3], value = -1.5} : f32[B + 1, T + 1, 9]
  %cc = concat %x, %x, %upd {axis = 1} : f32[B, 2*T + 7, 4]
  %g = gather %x, %idx {axis = 1} : f32[B, 7, 4]
  %sa = scatter_add %x, %idx, %upd {axis = 1} : f32[B, T, 4]
  %fl = flip %x {axes = [0, 2]} : f32[B, T, 4]
  %ds = dynamic_slice %x, %pos {axis = 2, size = 2} : f32[B, T, 2]
  %dt = dynamic_slice %x, %pos {axis = 0, size = T} : f32[T, T, 4]
  %du = dynamic_update_slice %x, %ds, %pos {axis = 2} : f32[B, T, 4]
  return %r
}
""",
    "linalg_creation": """\
dtm 1.0
func @lin(%a: f32[5, 1, 3, 4], %b: f32[2, 4, 6], %key: u32[2]) -> (f32[5, 2, 3, 6]) {
  %m = matmul %a, %b : f32[5, 2, 3, 6]
  %c = constant {value = [[1.0, -2.0, 0.5], [3.0, 1e-07, 100000.0]]} : f32[2, 3]
  %ci = constant {value = [1, -2, 3]} : i32[3]
  %cb = constant {value = [true, false]} : bool[2]
  %cs = constant {value = [2.0]} : f64[1]
  %ce = constant {value = []} : f32[0]
  %f = full {value = 1.5} : f32[3, 3]
  %fi = full {value = 7} : i64[2]
  %fb = full {value = true} : bool[2]
  %io = iota {dim = 1} : i32[3, 4]
  %ru = random %key : f32[8]
  %rn = random %key {distribution = "normal"} : bf16[4, 4]
  return %m
}
""",
    "composite": """\
dtm 1.0
func @comp(%x: f32[B, S, 8], %w: f32[8], %bias: f32[8], %q: f32[B, 2, S, 8], %k: f32[B, 2, T, 8], %v: f32[B, 2, T, 16]) -> (f32[B, 2, S, 16]) {
  %s = softmax %x {axis = 2} : f32[B, S, 8]
  %l = log_softmax %x {axis = 0} : f32[B, S, 8]
  %n = layer_norm %x, %w, %bias {eps = 1e-06} : f32[B, S, 8]
  %n2 = layer_norm %x : f32[B, S, 8]
  %a = scaled_dot_product_attention %q, %k, %v {causal = true, scale = 0.125} : f32[B, 2, S, 16]
  %a2 = scaled_dot_product_attention %q, %k, %v : f32[B, 2, S, 16]
  return %a
}
""",
    "state_store": """\
dtm 1.1
func @sgd(%w: f32[4, 4], %g: f32[4, 4], %lr: f32[]) -> (f32[4, 4]) {
  %s = mul %g, %lr : f32[4, 4]
  %n = sub %w, %s : f32[4, 4]
  assign %w, %n
  %k = store_get {key = "weights/w\\"1\\"\\n"} : f32[4, 4]
  store_put %n {key = "weights/w"}
  %bad = ne %n, %n : bool[4, 4]
  %c = check %n, %bad {code = "E0808", message = "a NaN: {value}", where = "sgd.py:3"} : f32[4, 4]
  return %n
}
""",
    "collectives": """\
dtm 1.0
mesh @grid[dp = 2, tp = 4]
mesh @solo[x = 1]
func @coll(%x: f32[8, 16] @grid[shard(0), shard(1)], %q: q8_0[4, 64]) -> (f32[8, 16]) {
  %a = all_reduce %x {mesh = @grid, axes = ["tp"], op = "max"} : f32[8, 16]
  %b = all_gather %a {mesh = @grid, axes = ["dp", "tp"], dim = 1} : f32[8, 128]
  %c = reduce_scatter %b {mesh = @grid, axes = ["tp"], dim = 1, op = "avg"} : f32[8, 32]
  %d = broadcast %c {mesh = @grid, axes = ["dp"], src = 1} : f32[8, 32]
  %e = all_to_all %d {mesh = @grid, axes = ["tp"], split_dim = 0, concat_dim = 1} : f32[2, 128]
  barrier {mesh = @grid, axes = ["dp", "tp"]}
  send %e {mesh = @grid, axes = ["tp"], dst = 3}
  %r = recv {mesh = @grid, axes = ["tp"], src = 2} : f32[8, 16] @grid[replicate, partial(min)]
  %g = all_gather %q {mesh = @grid, axes = ["dp"], dim = 0} : q8_0[8, 64]
  %u = all_reduce %r {mesh = @solo, axes = ["x"]} : f32[8, 16]
  return %u
}
""",
    "quant": """\
dtm 1.0
func @quant(%w: q8_0[16, 64], %x: f32[3, 32*K], %h: f16[2, 32]) -> (q4_0[3, 32*K]) {
  %d = cast %w {to = f32} : f32[16, 64]
  %q = cast %x {to = q4_0} : q4_0[3, 32*K]
  %q2 = cast %h {to = q8_0} : q8_0[2, 32]
  store_put %w {key = "w"}
  return %q
}
""",
    "calls_tasks": """\
dtm 1.0
func @inner(%a: f32[N], %b: f32[N]) -> (f32[N], f32[N]) {
  %s = add %a, %b : f32[N]
  %d = sub %a, %b : f32[N]
  return %s, %d
}
func @outer(%x: f32[N]) -> (f32[N]) {
  %p, %q = call %x, %x {callee = @inner} : f32[N], f32[N]
  return %x
}
func @noop() -> () {
  return
}
task @load = @noop {inputs = [], outputs = []}
task @prep = @outer {inputs = ["raw"], outputs = ["x"], after = [@load]}
task @train = @inner {inputs = ["x", "y"], outputs = ["s", "d"], after = [@prep, @load]}
""",
    "symbolic": """\
dtm 1.0
func @sym(%x: f32[B, T*B], %y: f32[1, B*T], %z: f32[2*(S + 1)]) -> (f32[B, B*T], f32[2*S + 2]) {
  %a = add %x, %y : f32[B, B*T]
  %b = neg %z : f32[2 + 2*S]
  %c = reshape %a {shape = [B*B*T]} : f32[B*B*T]
  %d = slice %z {start = [1], stop = [2*S + 2]} {step = [1]} : f32[2*S + 1]
  return %a, %b
}
""",
}
# The entry "symbolic" above is deliberately broken on one line (two attribute dicts);
# fix it here so the corpus holds only valid text, and keep the broken text as a negative.
BROKEN_TWO_ATTR_DICTS = CORPUS["symbolic"]
CORPUS["symbolic"] = CORPUS["symbolic"].replace("{start = [1], stop = [2*S + 2]} {step = [1]}",
                                                "{start = [1], stop = [2*S + 2], step = [1]}")


def conformance_valid() -> dict[str, str]:
    """Every conformance/ir/valid/*.dtm present now (none is fine)."""
    d = REPO / "conformance" / "ir" / "valid"
    if not d.is_dir():
        return {}
    return {f"conformance/{p.name}": p.read_text(encoding="utf-8") for p in sorted(d.glob("*.dtm"))}


def seeds() -> dict[str, str]:
    out = dict(CORPUS)
    out.update(conformance_valid())
    return out


def check_roundtrip(text: str) -> ir.Module:
    """Everything a valid module promises: it verifies; canonical text is a fixed point and
    parses back to an equal module; the encoding decodes to an equal module whose text
    parses back again; equal modules have equal hashes."""
    m = ir.verify(ir.parse(text))
    canon = ir.format(m)
    m2 = ir.verify(ir.parse(canon))
    assert m2 == m
    assert ir.format(m2) == canon
    assert m2.hash() == m.hash()
    enc = ir.encode(m)
    d = ir.decode(enc)
    ir.verify(d)
    assert d == m
    assert ir.encode(d) == enc
    assert ir.verify(ir.parse(ir.format(d))) == m
    assert ir.format(ir.parse(ir.format(d))) == ir.format(d)
    return m


# --- tests of the corpus itself ------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus_entry_is_valid_and_round_trips(name):
    check_roundtrip(CORPUS[name])


@pytest.mark.parametrize("name", sorted(conformance_valid()) or ["<none>"])
def test_conformance_valid_round_trips(name):
    files = conformance_valid()
    if not files:
        pytest.skip("no conformance/ir/valid/*.dtm yet")
    check_roundtrip(files[name])


def test_corpus_covers_every_registry_op():
    used = set()
    for text in CORPUS.values():
        m = ir.parse(text)
        for f in m.funcs.values():
            used.update(op.name for op in f.ops)
    missing = sorted(set(ir.REGISTRY) - used)
    assert not missing, f"add these ops to the corpus: {missing}"


def test_two_attribute_dicts_on_one_line_is_a_syntax_error():
    with pytest.raises(ir.IRError) as ei:
        ir.parse(BROKEN_TWO_ATTR_DICTS)
    assert ei.value.code.value == "E0102"
    line = BROKEN_TWO_ATTR_DICTS.split("\n")[ei.value.line - 1]
    assert "{step" in line
    assert line[ei.value.col - 1] == "{"
