"""Every rule of the verifier (and the parser's own checks) reports its error code at the
right line and column; inferred shapes agree with numpy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtm.ir as ir
from dtm.errors import ErrorCode

QUICK = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def mod(body: str, params: str = "%x: f32[4]", res: str = "f32[4]", pre: str = "", post: str = "") -> str:
    """A module with one function @f; `body` lines are indented by the caller's text."""
    body = "\n".join("  " + ln.strip() for ln in body.strip("\n").split("\n"))
    return f"dtm 1.0\n{pre}func @f({params}) -> ({res}) {{\n{body}\n}}\n{post}"


def ok(text: str) -> ir.Module:
    return ir.verify(ir.parse(text))


def where(text: str, line_has: str, token: str | None = None, nth: int = 0) -> tuple[int, int]:
    """(line, col) of `token` (default: `line_has`) in the first line that contains `line_has`;
    `nth` picks a later occurrence of the token within that line."""
    for i, line in enumerate(text.split("\n")):
        if line_has in line:
            tok = token if token is not None else line_has
            col = -1
            for _ in range(nth + 1):
                col = line.index(tok, col + 1)
            return i + 1, col + 1
    raise AssertionError(f"{line_has!r} not in text")


def err(text: str, code: str, line_has: str | None = None, token: str | None = None, nth: int = 0,
        col: bool = True, msg: str | None = None) -> ir.IRError:
    """parse + verify fails with `code`; when `line_has` is given the error is on that line
    and (when `col`) at the column of `token`; `msg` must appear in the message."""
    with pytest.raises(ir.IRError) as ei:
        ir.verify(ir.parse(text))
    e = ei.value
    assert e.code.value == code, f"expected {code}, got {e}"
    assert isinstance(e.code, ErrorCode)
    if line_has is not None:
        want_line, want_col = where(text, line_has, token, nth)
        assert e.line == want_line, f"line: expected {want_line}, got {e}"
        if col:
            assert e.col == want_col, f"col: expected {want_col}, got {e}\n{text.split(chr(10))[want_line - 1]}"
        else:
            src = text.split("\n")[e.line - 1]
            assert 1 <= e.col <= len(src) + 1
    if msg is not None:
        assert msg in e.message, e.message
    return e


# --- lexical, header, syntax --------------------------------------------------------------

def test_invalid_character():
    err(mod("%y = neg %x : f32[4] $\nreturn %y"), "E0101", "neg", "$")


def test_unterminated_string():
    err(mod('%y = store_get {key = "abc} : f32[4]\nreturn %y'), "E0103", "store_get", '"')


@pytest.mark.parametrize("s", ['"a\\qb"', '"\\ud800"', '"tab\tinside"', '"\\x41"'])
def test_invalid_string(s):
    err(mod(f'%y = store_get {{key = {s}}} : f32[4]\nreturn %y'), "E0109", "store_get", '"')


@pytest.mark.parametrize("attr, tok", [("axes = [1.5]", "1.5"), ("axes = [1e3]", "1e3"),
                                        ("axes = [99999999999999999999]", "99999999999999999999")])
def test_invalid_number(attr, tok):
    err(mod(f"%y = reduce_sum %x {{{attr}}} : f32[]\nreturn %x"), "E0104", "reduce_sum", tok)


@pytest.mark.parametrize("text", [
    "", "\n\n", "// only a comment\n", "func @f() -> () {\n  return\n}\n", "dtm\n", "dtm 1\n", "dtm one.zero\n",
    "DTM 1.0\n", "dtm 1.0 junk\n", "dtm v1.0\n", "dtm 1.0.0.0\n", "dtm -1.0\n", "mesh @m[a = 1]\ndtm 1.0\n",
])
def test_invalid_header(text):
    e = err(text, "E0105")
    assert e.line is not None and e.col is not None


def test_header_may_follow_comments_and_blank_lines():
    m = ok("// c\n\n   \n  dtm 1.0   // hi\nfunc @f() -> () {\n  return\n}\n")
    assert m.version == (1, 0)


def test_invalid_utf8():
    e = None
    with pytest.raises(ir.IRError) as ei:
        ir.parse(b"dtm 1.0\n// caf\xc3\n\xff\n")
    e = ei.value
    assert e.code.value == "E0108"
    assert (e.line, e.col) == (2, 7)


def test_bytes_input_parses_like_text():
    t = mod("%y = neg %x : f32[4]\nreturn %y")
    assert ir.parse(t.encode()) == ir.parse(t)
    assert ir.parse(bytearray(t.encode())) == ir.parse(t)


@pytest.mark.parametrize("line, tok", [
    ("%y = neg %x : f32[4]]", "]"),
    ("%y = neg %x : f32[4", None),
    ("%y = neg %x :", None),
    ("%y = neg %x f32[4]", "f32"),
    ("%y neg %x : f32[4]", "%y"),
    ("%y = neg %x {} {} : f32[4]", "{} :"),
    ("%y = = neg %x : f32[4]", None),
])
def test_unexpected_token(line, tok):
    text = mod(f"{line}\nreturn %x")
    if tok is None:
        err(text, "E0102", line, col=False)
    else:
        err(text, "E0102", line, tok, nth=1 if tok == "]" else 0)


def test_unclosed_function():
    err("dtm 1.0\nfunc @f(%x: f32[4]) -> (f32[4]) {\n  %y = neg %x : f32[4]\n", "E0102")
    err("dtm 1.0\nfunc @f(%x: f32[4]) -> (f32[4]) {\n  %y = neg %x : f32[4]\n}\n", "E0102", "}", col=False)
    err("dtm 1.0\nfunc @f(%x: f32[4]) -> (f32[4]) {\n  return %x\n", "E0102")
    err("dtm 1.0\nfunc @f(%x: f32[4]) -> (f32[4]) {\n  return %x\n  %y = neg %x : f32[4]\n}\n", "E0102",
        "%y = neg", col=False)


def test_garbage_declaration():
    err("dtm 1.0\nfunk @f() -> () {\n}\n", "E0102", "funk")


# --- names and SSA --------------------------------------------------------------------------

def test_undefined_value():
    t = mod("%y = add %x, %q : f32[4]\nreturn %y")
    err(t, "E0201", "add", "%q", msg="%q")


def test_undefined_value_in_return():
    err(mod("%y = neg %x : f32[4]\nreturn %nope"), "E0201", "return", "%nope")


def test_use_before_def():
    t = mod("%y = add %x, %z : f32[4]\n%z = neg %x : f32[4]\nreturn %y")
    err(t, "E0206", "%y = add", "%z", msg="%z")


def test_use_before_def_multi_result():
    t = mod("%y = add %x, %q : f32[4]\n%p, %q = call %x {callee = @g} : f32[4], f32[4]\nreturn %y",
            post="func @g(%a: f32[4]) -> (f32[4], f32[4]) {\n  return %a, %a\n}\n")
    err(t, "E0206", "%y = add", "%q")


def test_self_use_column_points_at_operand():
    t = mod("%a = add %a, %x : f32[4]\nreturn %a")
    err(t, "E0201", "%a = add", "%a", nth=1)


def test_self_use_is_an_error():
    err(mod("%a = add %a, %x : f32[4]\nreturn %a"), "E0201", "%a = add", col=False)


def test_value_used_in_another_function_is_undefined():
    t = mod("%y = neg %x : f32[4]\nreturn %y", post="func @g(%a: f32[4]) -> (f32[4]) {\n  return %y // in g\n}\n")
    err(t, "E0201", "in g", "%y")


def test_redefined_result():
    t = mod("%y = neg %x : f32[4]\n%y = abs %x : f32[4]\nreturn %y")
    err(t, "E0202", "abs", "%y")


def test_result_redefines_parameter():
    err(mod("%x = neg %x : f32[4]\nreturn %x"), "E0202", "= neg", "%x")


def test_duplicate_parameter():
    err(mod("return %x", params="%x: f32[4], %x: f32[4]"), "E0202", "func", "%x", nth=1)


def test_duplicate_multi_result():
    t = mod("%p, %p = call %x {callee = @g} : f32[4], f32[4]\nreturn %x",
            post="func @g(%a: f32[4]) -> (f32[4], f32[4]) {\n  return %a, %a\n}\n")
    err(t, "E0202", "call", "%p", nth=1)


def test_same_names_in_two_functions_are_fine():
    ok(mod("%y = neg %x : f32[4]\nreturn %y", post="func @g(%x: f32[4]) -> (f32[4]) {\n  %y = neg %x : f32[4]\n"
           "  return %y\n}\n"))


@pytest.mark.parametrize("decls, second", [
    ("func @f() -> () {\n  return\n}\nfunc @f() -> () {\n  return\n}\n", "func @f"),
    ("mesh @f[a = 1]\nfunc @f() -> () {\n  return\n}\n", "func @f"),
    ("func @f() -> () {\n  return\n}\ntask @f = @f {inputs = [], outputs = []}\n", "task @f"),
    ("mesh @m[a = 1]\nmesh @m[b = 1]\n", "mesh @m[b"),
])
def test_duplicate_symbol(decls, second):
    t = "dtm 1.0\n" + decls
    lines = t.split("\n")
    n = max(i for i, ln in enumerate(lines) if ln.startswith(second.split("[")[0].split(" =")[0]))
    e = err(t, "E0204")
    assert e.line == n + 1
    assert e.col == lines[n].index("@") + 1


# --- ops and attributes ----------------------------------------------------------------------

def test_unknown_op():
    err(mod("%y = frobnicate %x : f32[4]\nreturn %y"), "E0301", "frobnicate")


@pytest.mark.parametrize("line", ["%y = add %x : f32[4]", "%y = neg %x, %x : f32[4]",
                                  "%y = where %x, %x : f32[4]",
                                  "%y = layer_norm %x, %x, %x, %x : f32[4]", "%y = iota %x {dim = 0} : f32[4]"])
def test_operand_count(line):
    opname = line.split("=", 1)[1].split()[0]
    err(mod(f"{line}\nreturn %x"), "E0302", line, opname)


def test_concat_without_operands():
    err(mod("%y = concat {axis = 0} : f32[4]\nreturn %x"), "E0302", "concat")


def test_concat_without_operands_raises_only_irerror():
    with pytest.raises(ir.IRError):
        ok(mod("%y = concat {axis = 0} : f32[4]\nreturn %x"))


def test_layer_norm_with_weight_but_no_bias():
    err(mod("%y = layer_norm %x, %x : f32[4]\nreturn %x"), "E0302", "layer_norm")


def test_missing_attribute():
    err(mod("%y = reduce_sum %x : f32[]\nreturn %x"), "E0303", "reduce_sum", col=False, msg="axes")
    err(mod("%y = full : f32[4]\nreturn %x"), "E0303", "full", col=False, msg="value")


def test_unknown_attribute():
    err(mod("%y = neg %x {axis = 0} : f32[4]\nreturn %x"), "E0304", "neg", "axis")
    err(mod("%y = reduce_sum %x {axes = [0], keepdim = true} : f32[1]\nreturn %x"), "E0304", "reduce_sum", "keepdim =")


def test_attribute_given_twice():
    err(mod("%y = reduce_sum %x {axes = [0], axes = [0]} : f32[]\nreturn %x"), "E0102", "reduce_sum", "axes", nth=1)


@pytest.mark.parametrize("attrs, tok", [
    ('axes = "x"', '"x"'), ("axes = 0", "0"), ("axes = [0], keepdims = 1", "1"),
    ('axes = [0], keepdims = "true"', '"true"'),
])
def test_attribute_type(attrs, tok):
    err(mod(f"%y = reduce_sum %x {{{attrs}}} : f32[]\nreturn %x"), "E0305", "reduce_sum", tok)


def test_attribute_list_item_of_wrong_kind():
    with pytest.raises(ir.IRError) as ei:
        ok(mod("%y = reduce_sum %x {axes = [true]} : f32[]\nreturn %x"))
    assert ei.value.code.value in ("E0102", "E0305")
    assert (ei.value.line, ei.value.col) == where(mod("%y = reduce_sum %x {axes = [true]} : f32[]\nreturn %x"),
                                                  "reduce_sum", "true")


def test_attribute_type_other_kinds():
    err(mod("%y = cast %x {to = 3} : f32[4]\nreturn %x"), "E0305", "cast", "3")
    err(mod('%y = cast %x {to = "f32"} : f32[4]\nreturn %x'), "E0305", "cast", '"f32"')
    err(mod("%y = gelu %x {approximate = tanh} : f32[4]\nreturn %x"), "E0305", "gelu", "tanh")
    err(mod("%y = layer_norm %x {eps = true} : f32[4]\nreturn %x"), "E0305", "layer_norm", "true")
    err(mod("%y = full {value = true} : f32[4]\nreturn %x"), "E0305", "full", col=False)
    err(mod("%y = full {value = 1.5} : i32[4]\nreturn %x"), "E0305", "full", col=False)
    err(mod("%y = full {value = 2} : bool[4]\nreturn %x"), "E0305", "full", col=False)
    err(mod("%y = full {value = 0.5} : bool[4]\nreturn %x"), "E0305", "full", col=False)
    # 0 and 1 are accepted for bool and mean false and true
    assert ok(mod("%y = full {value = 1} : bool[4]\nreturn %x")) == ok(mod("%y = full {value = true} : bool[4]\nreturn %x"))


def test_unknown_dtype_attribute():
    err(mod("%y = cast %x {to = f31} : f32[4]\nreturn %x"), "E0401", "cast", "f31")


@pytest.mark.parametrize("line", [
    '%y = gelu %x {approximate = "fast"} : f32[4]',
    '%y = random %k {distribution = "cauchy"} : f32[4]',
    "%y = reduce_sum %x {axes = [1]} : f32[4]",
    "%y = reduce_sum %x {axes = [-1]} : f32[4]",
    "%y = argmax %x {axis = 1} : i64[]",
    "%y = softmax %x {axis = 2} : f32[4]",
    "%y = permute %x {perm = [1]} : f32[4]",
    "%y = flip %x {axes = [0, 0]} : f32[4]",
    "%y = slice %x {start = [0], stop = [5], step = [1]} : f32[5]",
    "%y = slice %x {start = [3], stop = [2], step = [1]} : f32[0]",
    "%y = slice %x {start = [0], stop = [4], step = [0]} : f32[4]",
    "%y = slice %x {start = [0, 0], stop = [4, 4], step = [1, 1]} : f32[4]",
    "%y = pad %x {low = [-1], high = [0]} : f32[3]",
    "%y = pad %x {low = [1, 1], high = [0, 0]} : f32[5]",
    "%y = iota {dim = 1} : i32[4]",
    "%y = concat %x {axis = 1} : f32[4]",
    "%y = gather %x, %i {axis = 1} : f32[4]",
])
def test_attribute_value(line):
    opname = line.split("=", 1)[1].split()[0]
    t = mod(f"{line}\nreturn %x", params="%x: f32[4], %k: u32[2], %i: i32[2]")
    e = err(t, "E0306", line, col=False)
    # at the op, or at the offending attribute
    attr = line.split("{", 1)[1].split("=")[0].strip()
    assert e.col in (where(t, line, opname)[1], where(t, line, attr)[1]), e


def test_result_count():
    err(mod("%a, %b = add %x, %x : f32[4]\nreturn %x"), "E0307", "add")
    err(mod("%a, %b = add %x, %x : f32[4], f32[4]\nreturn %x"), "E0307", "add")
    err(mod('store_put %x {key = "k"} : f32[4]\nreturn %x'), "E0307", "store_put")
    err(mod("add %x, %x\nreturn %x"), "E0307", "add")
    err(mod("%y = full {value = 0}\nreturn %x"), "E0307", "full", col=False)
    err(mod("%y = barrier {mesh = @m, axes = [\"a\"]} : f32[4]\nreturn %x", pre="mesh @m[a = 2]\n"), "E0307",
        "barrier")


def test_result_type_mismatch():
    err(mod("%y = add %x, %x : f32[5]\nreturn %x"), "E0404", "add", msg="f32[5]")
    err(mod("%y = add %x, %x : f64[4]\nreturn %x"), "E0404", "add")
    err(mod("%y = eq %x, %x : f32[4]\nreturn %x"), "E0404", "eq")
    err(mod("%y = add %x, %x : f32[4, 1]\nreturn %x"), "E0404", "add")


# --- types and shapes ------------------------------------------------------------------------

@pytest.mark.parametrize("ty, tok", [("f31[4]", "f31"), ("float[4]", "float"), ("F32[4]", "F32"), ("q8[32]", "q8")])
def test_unknown_dtype(ty, tok):
    err(mod("return %x", params=f"%x: {ty}", res="f32[4]"), "E0401", "func", tok)


@pytest.mark.parametrize("dims", ["1.5", "0 - 1", "B - B - 1", "4611686018427387904", "2e3"])
def test_invalid_dim(dims):
    e = err(mod("return %x", params=f"%x: f32[{dims}]"), "E0405", "func", col=False)
    assert e.line == 2


def test_rank_limit():
    ok(mod("return %x", params="%x: f32[" + ", ".join(["1"] * 64) + "]", res="f32[" + ", ".join(["1"] * 64) + "]"))
    err(mod("return %x", params="%x: f32[" + ", ".join(["1"] * 65) + "]"), "E0405", "func", "f32")


def test_dims_may_be_zero_and_scalars_rank_zero():
    ok(mod("%y = neg %x : f32[0, 3]\n%s = reduce_sum %x {axes = [0, 1]} : f32[]\nreturn %s", params="%x: f32[0, 3]",
           res="f32[]"))


@pytest.mark.parametrize("a, b, out", [
    ("f32[B]", "f32[1]", "f32[B]"),
    ("f32[1]", "f32[B]", "f32[B]"),
    ("f32[B, 1]", "f32[1, T]", "f32[B, T]"),
    ("f32[B, T]", "f32[T]", "f32[B, T]"),
    ("f32[2*B]", "f32[B + B]", "f32[2*B]"),
    ("f32[B*T]", "f32[T*B]", "f32[B*T]"),
    ("f32[3, 1, 5]", "f32[4, 1]", "f32[3, 4, 5]"),
    ("f32[]", "f32[2, 3]", "f32[2, 3]"),
    ("f32[0]", "f32[1]", "f32[0]"),
])
def test_broadcasting_ok(a, b, out):
    ok(mod(f"%y = add %a, %b : {out}\nreturn %y", params=f"%a: {a}, %b: {b}", res=out))


@pytest.mark.parametrize("a, b", [
    ("f32[B]", "f32[C]"), ("f32[B]", "f32[4]"), ("f32[3]", "f32[4]"), ("f32[2, 3]", "f32[3, 2]"),
    ("f32[B, 1]", "f32[T, 1]"), ("f32[B + 1]", "f32[B]"), ("f32[0]", "f32[2]"),
])
def test_broadcasting_mismatch(a, b):
    err(mod("%y = add %a, %b : f32[4]\nreturn %y", params=f"%a: {a}, %b: {b}, %z: f32[C]", res="f32[4]"),
        "E0403", "add")


@pytest.mark.parametrize("line, params", [
    ("%y = add %a, %b : f32[4]", "%a: f32[4], %b: f64[4]"),
    ("%y = add %a, %b : f32[4]", "%a: f32[4], %b: i32[4]"),
    ("%y = exp %c : i32[4]", "%c: i32[4]"),
    ("%y = logical_and %a, %a : bool[4]", "%a: f32[4]"),
    ("%y = logical_not %a : f32[4]", "%a: f32[4]"),
    ("%y = where %a, %a, %a : f32[4]", "%a: f32[4]"),
    ("%y = where %c, %a, %b : f32[4]", "%c: bool[4], %a: f32[4], %b: f16[4]"),
    ("%y = matmul %a, %b : f32[2, 2]", "%a: f32[2, 2], %b: f16[2, 2]"),
    ("%y = concat %a, %b {axis = 0} : f32[8]", "%a: f32[4], %b: i32[4]"),
    ("%y = gather %a, %b {axis = 0} : f32[4]", "%a: f32[4], %b: f32[4]"),
    ("%y = reduce_sum %c {axes = [0]} : bool[]", "%c: bool[4]"),
    ("%y = bitcast %a {to = f16} : f16[4]", "%a: f32[4]"),
    ("%y = random %k : f32[4]", "%k: u32[3]"),
    ("%y = random %k : i32[4]", "%k: u32[2]"),
    ("%y = dynamic_update_slice %a, %a, %a {axis = 0} : f32[4]", "%a: f32[4]"),
])
def test_dtype_mismatch(line, params):
    opname = line.split("=", 1)[1].split()[0]
    code = "E0402" if "u32[3]" not in params else "E0403"
    err(mod(f"{line}\nreturn %x", params=params + ", %x: f32[4]"), code, line, opname)


@pytest.mark.parametrize("shape_in, shape_attr, out", [
    ("B, T", "[T*B]", "B*T"),
    ("B, T, 4", "[B*T, 4]", "B*T, 4"),
    ("B, 4", "[2*B, 2]", "2*B, 2"),
    ("B, 4", "[2, B, 2]", "2, B, 2"),
    ("2*B + 2", "[B + 1, 2]", "B + 1, 2"),
    ("6", "[2, 3]", "2, 3"),
    ("0, 5", "[5, 0]", "5, 0"),
])
def test_reshape_ok(shape_in, shape_attr, out):
    ok(mod(f"%y = reshape %x {{shape = {shape_attr}}} : f32[{out}]\nreturn %y", params=f"%x: f32[{shape_in}]",
           res=f"f32[{out}]"))


@pytest.mark.parametrize("shape_in, shape_attr", [
    ("B, T", "[B*T, 2]"), ("B, 4", "[B + 4]"), ("B, T", "[B*B]"), ("6", "[4]"), ("B", "[C]"), ("2*B", "[B, 3]"),
])
def test_reshape_mismatch(shape_in, shape_attr):
    err(mod(f"%y = reshape %x {{shape = {shape_attr}}} : f32[4]\nreturn %x", params=f"%x: f32[{shape_in}], %c: f32[C]"),
        "E0403", "reshape")


def test_concat_symbolic_sum():
    ok(mod("%y = concat %a, %b {axis = 0} : f32[B + T, 4]\nreturn %y", params="%a: f32[B, 4], %b: f32[T, 4]",
           res="f32[T + B, 4]"))
    ok(mod("%y = concat %a, %a, %b {axis = 1} : f32[4, 2*B + 3]\nreturn %y", params="%a: f32[4, B], %b: f32[4, 3]",
           res="f32[4, 3 + B*2]"))
    err(mod("%y = concat %a, %b {axis = 0} : f32[B, 4]\nreturn %y", params="%a: f32[B, 4], %b: f32[T, 4]",
            res="f32[B, 4]"), "E0404", "concat")
    err(mod("%y = concat %a, %b {axis = 0} : f32[B + T, 4]\nreturn %y", params="%a: f32[B, 4], %b: f32[T, 5]",
            res="f32[B + T, 4]"), "E0403", "concat")
    err(mod("%y = concat %a, %b {axis = 0} : f32[B + T, 4]\nreturn %y", params="%a: f32[B, 4], %b: f32[T]",
            res="f32[B + T, 4]"), "E0406", "concat")


def test_matmul_batch_broadcast():
    ok(mod("%y = matmul %a, %b : f32[5, B, 3, 2]\nreturn %y", params="%a: f32[1, B, 3, 4], %b: f32[5, 1, 4, 2]",
           res="f32[5, B, 3, 2]"))
    ok(mod("%y = matmul %a, %b : f32[7, M, N]\nreturn %y", params="%a: f32[7, M, K], %b: f32[K, N]",
           res="f32[7, M, N]"))
    err(mod("%y = matmul %a, %b : f32[3, 2]\nreturn %x", params="%a: f32[3, 4], %b: f32[5, 2], %x: f32[4]"),
        "E0403", "matmul")
    err(mod("%y = matmul %a, %b : f32[3, 2]\nreturn %x", params="%a: f32[3, K], %b: f32[L, 2], %x: f32[4]"),
        "E0403", "matmul")
    err(mod("%y = matmul %a, %b : f32[2, 3, 5]\nreturn %x", params="%a: f32[2, 3, 4], %b: f32[3, 4, 5], %x: f32[4]"),
        "E0403", "matmul")
    err(mod("%y = matmul %a, %b : f32[3]\nreturn %x", params="%a: f32[3, 4], %b: f32[4], %x: f32[4]"),
        "E0406", "matmul")


def test_reduction_axes_rules():
    ok(mod("%y = reduce_max %x {axes = [0, 2], keepdims = true} : f32[1, T, 1]\nreturn %y",
           params="%x: f32[B, T, 4]", res="f32[1, T, 1]"))
    ok(mod("%y = reduce_min %x {axes = []} : f32[B, T, 4]\nreturn %y", params="%x: f32[B, T, 4]",
           res="f32[B, T, 4]"))
    for axes in ["[3]", "[-1]", "[1, 1]", "[2, 0]"]:
        err(mod(f"%y = reduce_sum %x {{axes = {axes}}} : f32[B]\nreturn %x", params="%x: f32[B, T, 4]",
                res="f32[B, T, 4]"), "E0306", "reduce_sum")
    err(mod("%y = argmin %x {axis = 3} : i64[B, T]\nreturn %x", params="%x: f32[B, T, 4]", res="f32[B, T, 4]"),
        "E0306", "argmin")
    err(mod("%y = argmax %x {axis = 0} : f32[T]\nreturn %x", params="%x: f32[B, T]", res="f32[B, T]"),
        "E0404", "argmax")


def test_other_shape_rules():
    p = "%x: f32[4], %m: f32[2, 3], %i: i32[2], %s: i64[], %v: f32[2, 2]"
    cases = [
        ("%y = broadcast_to %m {shape = [3]} : f32[3]", "E0406"),
        ("%y = broadcast_to %m {shape = [2, 4]} : f32[2, 4]", "E0403"),
        ("%y = scatter_add %m, %i, %v {axis = 0} : f32[2, 3]", "E0403"),
        ("%y = dynamic_update_slice %m, %x, %s {axis = 1} : f32[2, 3]", "E0403"),
        ("%y = layer_norm %m, %x, %x : f32[2, 3]", "E0403"),
        ("%y = scaled_dot_product_attention %m, %v, %v : f32[2, 2]", "E0403"),
        ("%y = constant {value = [1.0, 2.0]} : f32[3]", "E0410"),
        ("%y = constant {value = [[1.0], [2.0, 3.0]]} : f32[2, 1]", "E0410"),
        ("%y = constant {value = [1, 300]} : i8[2]", "E0306|E0410"),
        ("%y = constant {value = [-1]} : u8[1]", "E0306|E0410"),
        ("%y = constant {value = [1.0, 2.0]} : f64[2]", None),
    ]
    for line, code in cases:
        text = mod(f"{line}\nreturn %x", params=p)
        if code is None:
            ok(text)
        else:
            with pytest.raises(ir.IRError) as ei:
                ok(text)
            assert ei.value.code.value in code.split("|"), ei.value
            assert ei.value.line == 3


def test_unbound_symbol():
    err(mod("return %x", res="f32[C]"), "E0409", "func", "@f", msg="C")
    err(mod("%y = full {value = 0} : f32[C]\nreturn %x"), "E0409", "full")
    err(mod("%y = store_get {key = \"k\"} : f32[B*C]\nreturn %x", params="%x: f32[B]", res="f32[B]"), "E0409",
        "store_get")
    ok(mod("%y = full {value = 0} : f32[B + 1]\nreturn %y", params="%x: f32[B]", res="f32[B + 1]"))


def test_return_mismatch():
    err(mod("return %x, %x"), "E0407", "return")
    err(mod("return"), "E0407", "return")
    err(mod("%y = cast %x {to = f64} : f64[4]\nreturn %y"), "E0407", "return")
    err(mod("return %x", params="%x: f32[B]", res="f32[B + 0*T, 1]"), "E0407", "return")


# --- meshes and shardings ---------------------------------------------------------------------

MESH = "mesh @m[dp = 2, tp = 4]\n"


@pytest.mark.parametrize("sh, code, tok", [
    ("@q[replicate]", "E0205", None),
    ("@m[replicate]", "E0504", None),
    ("@m[replicate, replicate, replicate]", "E0504", None),
    ("@m[shard(1), replicate]", "E0502", None),
    ("@m[shard(-1), replicate]", "E0502", None),
    ("@m[shard(0), shard(0)]", "E0503", None),
    ("@m[partial(foo), replicate]", "E0507", "foo"),
    ("@m[splat, replicate]", "E0507", "splat"),
    ("@m[partial(sum), partial(max)]", None, None),
    ("@m[shard(0), partial(avg)]", None, None),
    ("@f[replicate]", "E0205", None),
])
def test_sharding_of_parameter(sh, code, tok):
    t = mod("return %x", params=f"%x: f32[4] {sh}", pre=MESH)
    if code is None:
        ok(t)
    elif tok is None:
        err(t, code, "func", "@f")  # verifier errors point at the function
    else:
        err(t, code, "func", tok)


def test_sharding_of_results():
    err(mod("return %x", res="f32[4] @m[replicate, shard(2)]", pre=MESH), "E0502", "func", "@f")
    err(mod("%y = neg %x : f32[4] @m[shard(0), shard(0)]\nreturn %y", pre=MESH), "E0503", "neg")
    err(mod("%y = neg %x : f32[4] @zz[replicate]\nreturn %y", pre=MESH), "E0205", "neg")
    err(mod("%y = neg %x : f32[4] @m[replicate]\nreturn %y", pre=MESH), "E0504", "neg")
    ok(mod("%y = neg %x : f32[4] @m[partial(sum), shard(0)]\nreturn %y", pre=MESH))


@pytest.mark.parametrize("decl, tok", [
    ("mesh @m[a = 0]", "0"), ("mesh @m[a = -2]", "-"), ("mesh @m[a = 2, a = 2]", "a", ), ("mesh @m[]", "@m"),
])
def test_invalid_mesh(decl, tok):
    t = f"dtm 1.0\n{decl}\n"
    e = err(t, "E0505")
    assert e.line == 2
    if decl == "mesh @m[a = 2, a = 2]":
        assert e.col == decl.rindex("a =") + 1
    else:
        assert e.col == decl.index(tok) + 1


def test_mesh_size_limit():
    m = ok("dtm 1.0\nmesh @m[a = 4611686018427387903]\n")
    assert m.meshes["m"].axes == (("a", 2**62 - 1),)
    with pytest.raises(ir.IRError) as ei:
        ok("dtm 1.0\nmesh @m[a = 4611686018427387904]\n")
    assert ei.value.code.value == "E0505" and "2^62" in ei.value.message


@pytest.mark.parametrize("size", [2**62, 2**63 - 1])
def test_mesh_size_too_large_is_located(size):
    decl = f"mesh @m[a = {size}]"
    e = err(f"dtm 1.0\n{decl}\n", "E0505")
    assert e.line == 2 and e.col == decl.index(str(size)) + 1, e


def test_mesh_syntax():
    err("dtm 1.0\nmesh @m[a: 2]\n", "E0102", "mesh", ":")
    err("dtm 1.0\nmesh m[a = 2]\n", "E0102", "mesh", "m[")
    err("dtm 1.0\nmesh @m[a = 2.0]\n", "E0104", "mesh", "2.0")
    err("dtm 1.0\nmesh @m[a = 2] x\n", "E0102", "mesh", "x")


# --- collectives ------------------------------------------------------------------------------

@pytest.mark.parametrize("line, code", [
    ('%y = all_reduce %x {mesh = @m, axes = ["zz"]} : f32[8, 12]', "E0501"),
    ('%y = all_reduce %x {mesh = @m, axes = ["tp", "tp"]} : f32[8, 12]', "E0506"),
    ('%y = all_reduce %x {mesh = @m, axes = []} : f32[8, 12]', "E0506"),
    ('%y = all_reduce %x {mesh = @q, axes = ["tp"]} : f32[8, 12]', "E0205"),
    ('%y = all_reduce %x {mesh = @m, axes = ["tp"], op = "mean"} : f32[8, 12]', "E0306"),
    ('%y = broadcast %x {mesh = @m, axes = ["tp"], src = 4} : f32[8, 12]', "E0506"),
    ('%y = broadcast %x {mesh = @m, axes = ["tp"], src = -1} : f32[8, 12]', "E0506"),
    ('%y = broadcast %x {mesh = @m, axes = ["dp", "tp"], src = 8} : f32[8, 12]', "E0506"),
    ('send %x {mesh = @m, axes = ["dp"], dst = 2}', "E0506"),
    ('%y = recv {mesh = @m, axes = ["tp"], src = 4} : f32[8, 12]', "E0506"),
    ('%y = reduce_scatter %x {mesh = @m, axes = ["tp"], dim = 0} : f32[2, 12]', None),
    ('%y = reduce_scatter %x {mesh = @m, axes = ["dp", "tp"], dim = 0} : f32[1, 12]', None),
    ('%y = reduce_scatter %x {mesh = @m, axes = ["dp", "tp"], dim = 1} : f32[8, 12]', "E0403"),
    ('%y = reduce_scatter %x {mesh = @m, axes = ["tp"], dim = 2} : f32[8, 12]', "E0306"),
    ('%y = all_gather %x {mesh = @m, axes = ["tp"], dim = 1} : f32[8, 48]', None),
    ('%y = all_gather %x {mesh = @m, axes = ["tp"], dim = 1} : f32[8, 12]', "E0404"),
    ('%y = all_to_all %x {mesh = @m, axes = ["tp"], split_dim = 0, concat_dim = 1} : f32[2, 48]', None),
    ('%y = all_to_all %x {mesh = @m, axes = ["tp"], split_dim = 1, concat_dim = 0} : f32[32, 3]', None),
    ('%y = all_to_all %x {mesh = @m, axes = ["dp", "tp"], split_dim = 1, concat_dim = 0} : f32[64, 1]', "E0403"),
    ('barrier {mesh = @m, axes = ["zz"]}', "E0501"),
    ('barrier {mesh = @m, axes = ["dp", "tp"]}', None),
])
def test_collective_groups(line, code):
    t = mod(f"{line}\nreturn %x", params="%x: f32[8, 12]", res="f32[8, 12]", pre=MESH)
    if code is None:
        ok(t)
    else:
        opname = line.split("=", 1)[1].split()[0] if line.startswith("%") else line.split()[0]
        err(t, code, line, opname if code != "E0306" else None, col=code != "E0306")


def test_reduce_scatter_divisibility_symbolic():
    p = "%x: f32[B, 4*T]"
    ok(mod('%y = reduce_scatter %x {mesh = @m, axes = ["tp"], dim = 1} : f32[B, T]\nreturn %x', params=p,
           res="f32[B, 4*T]", pre=MESH))
    ok(mod('%y = all_gather %x {mesh = @m, axes = ["dp"], dim = 0} : f32[2*B, 4*T]\nreturn %x', params=p,
           res="f32[B, 4*T]", pre=MESH))
    err(mod('%y = reduce_scatter %x {mesh = @m, axes = ["tp"], dim = 0} : f32[B, 4*T]\nreturn %x', params=p,
            res="f32[B, 4*T]", pre=MESH), "E0403", "reduce_scatter")
    err(mod('%y = reduce_scatter %x {mesh = @m, axes = ["dp", "tp"], dim = 1} : f32[B, T]\nreturn %x', params=p,
            res="f32[B, 4*T]", pre=MESH), "E0403", "reduce_scatter")


def test_collective_on_bool_is_a_dtype_error():
    err(mod('%y = all_reduce %x {mesh = @m, axes = ["tp"]} : bool[4]\nreturn %x', params="%x: bool[4]",
            res="bool[4]", pre=MESH), "E0402", "all_reduce")


# --- assign -----------------------------------------------------------------------------------

def test_assign():
    p = "%w: f32[4], %g: f32[4]"
    ok(mod("%n = sub %w, %g : f32[4]\nassign %w, %n\nreturn %n", params=p))
    err(mod("%n = sub %w, %g : f32[4]\nassign %n, %g\nreturn %n", params=p), "E0306", "assign", msg="parameter")
    err(mod("%n = sub %w, %g : f32[4]\nassign %w, %n\n%z = add %w, %g : f32[4]\nreturn %z", params=p), "E0207",
        "%z = add", "add")
    err(mod("%n = sub %w, %g : f32[4]\nassign %w, %n\nreturn %w", params=p), "E0207", "return")
    err(mod("assign %w, %g\nassign %w, %g // again\nreturn %g", params=p), "E0207", "again", "assign")
    err(mod("%n = cast %w {to = f64} : f64[4]\nassign %w, %n\nreturn %g", params=p), "E0402", "assign")
    err(mod("%n = reduce_sum %w {axes = [0]} : f32[]\nassign %w, %n\nreturn %g", params=p), "E0403", "assign")
    err(mod("%a = assign %w, %g : f32[4]\nreturn %g", params=p), "E0307", "assign")


def test_use_after_assign_line_is_the_use():
    p = "%w: f32[4], %g: f32[4]"
    t = mod("assign %w, %g\n%a = neg %g : f32[4]\n%b = neg %w : f32[4]\nreturn %a", params=p)
    err(t, "E0207", "%b = neg", "neg")


# --- quantized dtypes -------------------------------------------------------------------------

@pytest.mark.parametrize("ty", ["q8_0[31]", "q8_0[B]", "q4_0[16]", "q8_0[]", "q8_0[32, 33]", "q8_0[B + 32]"])
def test_quantized_last_dim_must_be_whole_blocks(ty):
    err(mod("return %x", params=f"%x: {ty}", res="f32[4]"), "E0408", "func", ty.split("[")[0])


@pytest.mark.parametrize("ty", ["q8_0[32]", "q8_0[7, 64]", "q4_0[32*B]", "q8_0[0]", "q8_0[B, 32]",
                                "q8_0[32*B + 64]"])
def test_quantized_whole_blocks_ok(ty):
    ok(mod("return %x", params=f"%x: {ty}", res=ty))


@pytest.mark.parametrize("line", [
    "%y = add %q, %q : q8_0[4, 64]",
    "%y = neg %q : q8_0[4, 64]",
    "%y = reshape %q {shape = [256]} : q8_0[256]",
    "%y = matmul %q, %q : q8_0[4, 64]",
    "%y = reduce_sum %q {axes = [0]} : q8_0[64]",
    "%y = permute %q {perm = [1, 0]} : q8_0[64, 4]",
    "%y = cast %x {to = q8_0} : q8_0[4, 64]",
    "%y = cast %q {to = i32} : i32[4, 64]",
    "%y = cast %q {to = q4_0} : q4_0[4, 64]",
    "%y = cast %i {to = q8_0} : q8_0[4, 64]",
    "%y = cast %f {to = q8_0} : q8_0[3, 31]",
    '%y = all_reduce %q {mesh = @m, axes = ["tp"]} : q8_0[4, 64]',
    "%y = full {value = 0.0} : q8_0[32]",
    "%y = constant {value = [1.0]} : q8_0[32]",
])
def test_quantized_misuse(line):
    p = "%q: q8_0[4, 64], %x: f32[4, 63], %i: i32[4, 64], %f: f32[3, 31]"
    t = mod(f"{line}\nreturn %q", params=p, res="q8_0[4, 64]", pre=MESH)
    with pytest.raises(ir.IRError) as ei:
        ok(t)
    e = ei.value
    assert e.code.value in ("E0408", "E0305") if "full" in line else e.code.value == "E0408", e
    assert e.line == where(t, line)[0]


@pytest.mark.parametrize("line", [
    "%y = cast %q {to = f32} : f32[4, 64]",
    "%y = cast %q {to = bf16} : bf16[4, 64]",
    "%y = cast %x {to = q8_0} : q8_0[4, 64]",
    "%y = cast %h {to = q4_0} : q4_0[4, 64]",
    '%y = all_gather %q {mesh = @m, axes = ["tp"], dim = 0} : q8_0[16, 64]',
    '%y = broadcast %q {mesh = @m, axes = ["tp"]} : q8_0[4, 64]',
    '%y = all_to_all %q {mesh = @m, axes = ["tp"], split_dim = 0, concat_dim = 1} : q8_0[1, 256]',
    'send %q {mesh = @m, axes = ["tp"], dst = 1}',
    'store_put %q {key = "q"}',
    "%y = store_get {key = \"q\"} : q4_0[2, 32]",
    '%y = recv {mesh = @m, axes = ["tp"], src = 1} : q8_0[4, 64]',
    "assign %q, %q",
])
def test_quantized_ok(line):
    p = "%q: q8_0[4, 64], %x: f32[4, 64], %h: f16[4, 64]"
    ok(mod(f"{line}\nreturn %x", params=p, res="f32[4, 64]", pre=MESH))


def test_quantized_call_ok():
    ok(mod("%y = call %q {callee = @g} : q8_0[4, 64]\nreturn %y", params="%q: q8_0[4, 64]", res="q8_0[4, 64]",
           post="func @g(%a: q8_0[4, 64]) -> (q8_0[4, 64]) {\n  return %a\n}\n"))


# --- tasks ------------------------------------------------------------------------------------

FUNC = "func @g(%a: f32[4], %b: f32[4]) -> (f32[4]) {\n  %c = add %a, %b : f32[4]\n  return %c\n}\n"


def tasks(*lines: str) -> str:
    return "dtm 1.0\n" + FUNC + "mesh @mm[a = 1]\n" + "".join(ln + "\n" for ln in lines)


@pytest.mark.parametrize("lines, code, bad", [
    (['task @t = @nope {inputs = ["a", "b"], outputs = ["c"]}'], "E0203", "task @t"),
    (['task @t = @mm {inputs = ["a", "b"], outputs = ["c"]}'], "E0203", "task @t"),
    (['task @t = @g {inputs = ["a"], outputs = ["c"]}'], "E0302", "task @t"),
    (['task @t = @g {inputs = ["a", "b", "c"], outputs = ["c"]}'], "E0302", "task @t"),
    (['task @t = @g {inputs = ["a", "b"], outputs = []}'], "E0307", "task @t"),
    (['task @t = @g {inputs = ["a", "b"], outputs = ["c"], after = [@u]}'], "E0208", "task @t"),
    (['task @t = @g {inputs = ["a", "b"], outputs = ["c"], after = [@g]}'], "E0208", "task @t"),
    (['task @t = @g {inputs = ["a", "b"], outputs = ["c"], after = [@t]}'], "E0209", "task @t"),
    (['task @t = @g {inputs = ["a", "b"], outputs = ["c"], after = [@u]}',
      'task @u = @g {inputs = ["a", "b"], outputs = ["c"], after = [@t]}'], "E0209", None),
    (['task @t = @g {inputs = ["a", "b"], outputs = ["c"], after = [@v]}',
      'task @u = @g {inputs = ["a", "b"], outputs = ["c"], after = [@t]}',
      'task @v = @g {inputs = ["a", "b"], outputs = ["c"], after = [@u]}'], "E0209", None),
    (['task @t = @g {inputs = ["a", "b"]}'], "E0303", "task @t"),
    (['task @t = @g {inputs = ["a", "b"], outputs = ["c"], before = []}'], "E0304", "task @t"),
    (['task @t = @g {inputs = "a", outputs = ["c"]}'], "E0305", "task @t"),
    (['task @t = @g {inputs = ["a", "b"], outputs = ["c"], after = ["u"]}'], "E0102", "task @t"),
    (['task @t = g {inputs = ["a", "b"], outputs = ["c"]}'], "E0102", "task @t"),
])
def test_tasks(lines, code, bad):
    t = tasks(*lines)
    e = err(t, code, bad, col=False)
    if bad is None:
        cycle_lines = {where(t, ln)[0] for ln in lines}
        assert e.line in cycle_lines
    if code not in ("E0304", "E0305", "E0102"):  # the verifier's task errors point at the task's @name
        src = t.split("\n")[e.line - 1]
        assert src.startswith("task @") and e.col == src.index("@") + 1, e


def test_task_graph_ok():
    ok(tasks('task @t = @g {inputs = ["a", "b"], outputs = ["c"]}',
             'task @u = @g {inputs = ["c", "c"], outputs = ["d"], after = [@t]}',
             'task @v = @g {inputs = ["c", "d"], outputs = ["e"], after = [@t, @u]}',
             'task @w = @g {inputs = ["c", "d"], outputs = ["e"], after = [@v, @t, @u]}'))


def test_task_before_its_function_is_fine():
    ok('dtm 1.0\ntask @t = @g {inputs = ["a", "b"], outputs = ["c"]}\n' + FUNC)


def test_long_task_chain_cycle_is_found_without_recursion():
    n = 3000
    lines = [f'task @t{i} = @g {{inputs = ["a", "b"], outputs = ["c"], after = [@t{(i + 1) % n}]}}' for i in range(n)]
    err(tasks(*lines), "E0209")
    lines[-1] = f'task @t{n - 1} = @g {{inputs = ["a", "b"], outputs = ["c"]}}'
    ok(tasks(*lines))


# --- calls ------------------------------------------------------------------------------------

G = "func @g(%a: f32[4], %b: i32[2]) -> (f32[4], i32[2]) {\n  return %a, %b\n}\n"


@pytest.mark.parametrize("line, code", [
    ("%p, %q = call %x, %i {callee = @nope} : f32[4], i32[2]", "E0203"),
    ("%p, %q = call %x, %i {callee = @m} : f32[4], i32[2]", "E0203"),
    ("%p, %q = call %x {callee = @g} : f32[4], i32[2]", "E0302"),
    ("%p, %q = call %x, %i, %i {callee = @g} : f32[4], i32[2]", "E0302"),
    ("%p, %q = call %i, %i {callee = @g} : f32[4], i32[2]", "E0402"),
    ("%p, %q = call %x, %j {callee = @g} : f32[4], i32[2]", "E0403"),
    ("%p, %q = call %x, %i {callee = @g} : f32[4], i32[3]", "E0404"),
    ("%p = call %x, %i {callee = @g} : f32[4]", "E0307"),
    ("%p, %q = call %x, %i : f32[4], i32[2]", "E0303"),
])
def test_call(line, code):
    t = mod(f"{line}\nreturn %x", params="%x: f32[4], %i: i32[2], %j: i32[3]", post=G, pre="mesh @m[a = 1]\n")
    err(t, code, line, "call")


def test_call_ok():
    ok(mod("%p, %q = call %x, %i {callee = @g} : f32[4], i32[2]\nreturn %p", params="%x: f32[4], %i: i32[2]", post=G))
    ok(mod("call %x {callee = @h}\nreturn %x", post="func @h(%a: f32[4]) -> () {\n  return\n}\n"))


# --- dynamic_slice and scalar constants (bugs) ---------------------------------------------------

def test_dynamic_slice():
    pre = "%p = full {value = 0} : i64[]\n"
    ok(mod(pre + "%y = dynamic_slice %x, %p {axis = 0, size = 2} : f32[2]\nreturn %x"))
    ok(mod(pre + "%y = dynamic_slice %x, %p {axis = 1, size = T} : f32[4, T]\nreturn %x", params="%x: f32[4, S], %t: f32[T]",
           res="f32[4, S]"))
    err(mod(pre + "%y = dynamic_slice %x, %p {axis = 0, size = 5} : f32[5]\nreturn %x"), "E0306", "dynamic_slice")
    err(mod(pre + "%y = dynamic_slice %x, %p {axis = 1, size = 2} : f32[2]\nreturn %x"), "E0306", "dynamic_slice")
    with pytest.raises(ir.IRError) as ei:
        ok(mod(pre + "%y = dynamic_slice %x, %p {axis = 0, size = [2]} : f32[2]\nreturn %x"))
    assert ei.value.code.value in ("E0102", "E0305")
    err(mod("%p = full {value = 0} : f32[]\n%y = dynamic_slice %x, %p {axis = 0, size = 2} : f32[2]\nreturn %x"),
        "E0402", "dynamic_slice")
    err(mod("%p = full {value = 0} : i64[1]\n%y = dynamic_slice %x, %p {axis = 0, size = 2} : f32[2]\nreturn %x"),
        "E0402", "dynamic_slice")


def test_scalar_constant():
    m = ok(mod("%c = constant {value = 2.0} : f32[]\nreturn %c", res="f32[]"))
    assert ir.parse(ir.format(m)) == m and ir.decode(ir.encode(m)) == m
    err(mod("%c = constant {value = [2.0]} : f32[]\nreturn %c", res="f32[]"), "E0410", "constant", col=False)
    err(mod("%c = constant {value = 2.0} : f32[1]\nreturn %c", res="f32[1]"), "E0410", "constant", col=False)


# --- verification is pure -------------------------------------------------------------------

def test_verify_does_not_change_the_module():
    t = mod("%y = reduce_sum %x {axes = [0]} : f32[]\n%z = full {value = 0} : f32[4]\nreturn %z")
    m = ir.parse(t)
    before = ir.encode(m)
    assert ir.verify(m) is m
    assert ir.verify(m) is m
    assert ir.encode(m) == before


# --- inferred shapes agree with numpy -------------------------------------------------------

def build(opname, in_shapes, dtypes=None, **attrs):
    """Infer the result of one op with the Builder; also check the module's text verifies."""
    b = ir.Builder()
    f = b.func("f")
    dtypes = dtypes or ["f32"] * len(in_shapes)
    xs = [f.param(f"{dt}[{', '.join(map(str, s))}]") for s, dt in zip(in_shapes, dtypes)]
    y = f.op(opname, *xs, **attrs)
    f.ret(y)
    m = b.build()
    assert ir.verify(ir.parse(ir.format(m))) == m
    return tuple(y.type.shape)


def expect_like_numpy(fn, opname, in_shapes, dtypes=None, code="E0403", **attrs):
    try:
        want = tuple(fn())
    except (ValueError, IndexError):  # numpy's AxisError is both
        with pytest.raises(ir.IRError) as ei:
            build(opname, in_shapes, dtypes, **attrs)
        assert ei.value.code.value == code
        return
    assert build(opname, in_shapes, dtypes, **attrs) == want


shape = st.lists(st.integers(0, 4), max_size=4).map(tuple)
nonempty_shape = st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple)


@st.composite
def broadcastable_pair(draw):
    base = draw(st.lists(st.integers(0, 4), max_size=4))

    def derive():
        k = draw(st.integers(0, len(base)))
        return tuple(1 if draw(st.booleans()) else d for d in base[k:])

    return derive(), derive()


@QUICK
@given(pair=st.one_of(broadcastable_pair(), st.tuples(shape, shape)),
       op=st.sampled_from(["add", "mul", "max", "lt", "eq"]))
def test_binary_shape_is_numpy_broadcast(pair, op):
    a, b = pair
    expect_like_numpy(lambda: np.broadcast_shapes(a, b), op, [a, b])


@QUICK
@given(pair=broadcastable_pair(), c=shape)
def test_where_shape_is_numpy_broadcast(pair, c):
    a, b = pair
    expect_like_numpy(lambda: np.broadcast_shapes(c, a, b), "where", [c, a, b], ["bool", "f32", "f32"])


@st.composite
def matmul_shapes(draw):
    ra, rb = draw(st.integers(2, 4)), draw(st.integers(2, 4))
    batch = draw(broadcastable_pair()) if draw(st.booleans()) else (draw(shape), draw(shape))
    k = draw(st.integers(0, 3))
    k2 = k if draw(st.integers(0, 4)) else draw(st.integers(0, 3))
    a = tuple(batch[0][: ra - 2]) + (draw(st.integers(0, 3)), k)
    b = tuple(batch[1][: rb - 2]) + (k2, draw(st.integers(0, 3)))
    return a, b


@QUICK
@given(ab=matmul_shapes())
def test_matmul_shape_is_numpy_matmul(ab):
    a, b = ab
    expect_like_numpy(lambda: np.matmul(np.zeros(a), np.zeros(b)).shape, "matmul", [a, b])


@QUICK
@given(x=nonempty_shape, idx=st.lists(st.integers(0, 3), max_size=3).map(tuple), data=st.data())
def test_gather_shape_is_numpy_take(x, idx, data):
    axis = data.draw(st.integers(0, len(x) - 1))
    want = np.take(np.zeros(x), np.zeros(idx, dtype=np.int64), axis=axis).shape
    assert build("gather", [x, idx], ["f32", "i32"], axis=axis) == want


@QUICK
@given(x=shape, data=st.data(), keepdims=st.booleans(), op=st.sampled_from(["reduce_sum", "reduce_max"]))
def test_reduce_shape_is_numpy_sum(x, data, keepdims, op):
    axes = sorted(data.draw(st.sets(st.integers(0, max(len(x) - 1, 0)), max_size=len(x)))) if x else []
    want = np.sum(np.zeros(x), axis=tuple(axes), keepdims=keepdims).shape
    assert build(op, [x], axes=axes, keepdims=keepdims) == want


@QUICK
@given(x=nonempty_shape, data=st.data(), keepdims=st.booleans())
def test_argmax_shape_is_numpy_argmax(x, data, keepdims):
    axis = data.draw(st.integers(0, len(x) - 1))
    want = np.argmax(np.zeros(x), axis=axis, keepdims=keepdims).shape
    assert build("argmax", [x], axis=axis, keepdims=keepdims) == want


@QUICK
@given(x=shape, data=st.data())
def test_pad_shape_is_numpy_pad(x, data):
    low = data.draw(st.lists(st.integers(0, 3), min_size=len(x), max_size=len(x)))
    high = data.draw(st.lists(st.integers(0, 3), min_size=len(x), max_size=len(x)))
    want = np.pad(np.zeros(x), list(zip(low, high))).shape if x else ()
    assert build("pad", [x], low=low, high=high) == want


@QUICK
@given(x=shape, data=st.data())
def test_slice_shape_is_numpy_slice(x, data):
    start, stop, step = [], [], []
    for d in x:
        lo = data.draw(st.integers(0, d))
        hi = data.draw(st.integers(lo, d))
        start.append(lo)
        stop.append(hi)
        step.append(data.draw(st.integers(1, 3)))
    want = np.zeros(x)[tuple(slice(a, b, c) for a, b, c in zip(start, stop, step))].shape
    assert build("slice", [x], start=start, stop=stop, step=step) == want


@QUICK
@given(x=shape, data=st.data())
def test_permute_shape_is_numpy_transpose(x, data):
    perm = data.draw(st.permutations(list(range(len(x)))))
    assert build("permute", [x], perm=perm) == np.transpose(np.zeros(x), perm).shape


@QUICK
@given(x=nonempty_shape, data=st.data())
def test_flip_shape_is_numpy_flip(x, data):
    axes = sorted(data.draw(st.sets(st.integers(0, len(x) - 1))))
    assert build("flip", [x], axes=axes) == np.flip(np.zeros(x), axes).shape


@QUICK
@given(x=nonempty_shape, data=st.data())
def test_concat_shape_is_numpy_concatenate(x, data):
    axis = data.draw(st.integers(0, len(x) - 1))
    n = data.draw(st.integers(1, 3))
    shapes = [x[:axis] + (data.draw(st.integers(0, 4)),) + x[axis + 1:] for _ in range(n)]
    if data.draw(st.booleans()):
        shapes.append(data.draw(shape))  # probably incompatible
    try:
        want = np.concatenate([np.zeros(s) for s in shapes], axis=axis).shape
    except ValueError:
        with pytest.raises(ir.IRError) as ei:
            build("concat", shapes, axis=axis)
        assert ei.value.code.value in ("E0403", "E0406", "E0306")
        return
    assert build("concat", shapes, axis=axis) == want


@QUICK
@given(pair=broadcastable_pair())
def test_broadcast_to_shape_is_numpy_broadcast_to(pair):
    a, b = pair
    target = np.broadcast_shapes(a, b)
    assert build("broadcast_to", [a], shape=list(target)) == np.broadcast_to(np.zeros(a), target).shape


@QUICK
@given(x=shape, y=shape)
def test_reshape_like_numpy(x, y):
    try:
        want = np.reshape(np.zeros(x), y).shape
    except ValueError:
        with pytest.raises(ir.IRError) as ei:
            build("reshape", [x], shape=list(y))
        assert ei.value.code.value == "E0403"
        return
    assert build("reshape", [x], shape=list(y)) == want


@QUICK
@given(a=st.lists(st.sampled_from([1, 2, 3, "B", "T"]), max_size=3),
       b=st.lists(st.sampled_from([1, 2, 3, "B", "T"]), max_size=3),
       env=st.fixed_dictionaries({"B": st.integers(0, 4), "T": st.integers(0, 4)}))
def test_symbolic_broadcast_agrees_with_numpy_after_substitution(a, b, env):
    """When the symbolic rule accepts, substituting any values gives numpy's shape."""
    def txt(s):
        return "f32[" + ", ".join(map(str, s)) + "]"

    b_ = ir.Builder()
    f = b_.func("f")
    x, y = f.param(txt(a)), f.param(txt(b))
    try:
        z = f.add(x, y)
    except ir.IRError as e:
        assert e.code.value == "E0403"
        return
    sub = tuple(env[str(d)] if not isinstance(d, int) else d for d in z.type.shape)
    conc = [tuple(env[d] if isinstance(d, str) else d for d in s) for s in (a, b)]
    assert sub == np.broadcast_shapes(*conc)


# --- scalar attributes against their dtype ------------------------------------------------------------

@pytest.mark.parametrize("line, params", [
    ("%q = full {value = 128} : i8[2]", ""),
    ("%q = full {value = -1} : u8[2]", ""),
    ("%q = full {value = 9223372036854775808} : i64[2]", ""),
    ("%q = full {value = -129} : i8[2]", ""),
    ("%q = full {value = 65536} : u16[2]", ""),
    ("%q = pad %x {low = [1], high = [0], value = 300} : i8[5]", "%x: i8[4]"),
])
def test_integer_scalar_attribute_out_of_dtype_range(line, params):
    t = mod(f"{line}\nreturn", params=params, res="")
    e = err(t, "E0306", "%q", "value =")
    assert "does not fit" in e.message


@pytest.mark.parametrize("line", ["%q = full {value = 18446744073709551616} : u64[2]",
                                  "%q = full {value = -9223372036854775809} : i64[2]"])
def test_integer_scalar_attribute_beyond_any_integer(line):
    with pytest.raises(ir.IRError) as ei:
        ok(mod(f"{line}\nreturn", params="", res=""))
    assert ei.value.code.value in ("E0104", "E0306"), ei.value  # no integer dtype holds it: the lexer may refuse
    assert ei.value.line == 3


@pytest.mark.parametrize("dtype, v", [("u64", 2**64 - 1), ("u64", 0), ("i64", -2**63), ("i64", 2**63 - 1),
                                      ("i8", -128), ("u8", 255)])
def test_integer_scalar_attribute_extremes(dtype, v):
    m = ok(mod(f"%q = full {{value = {v}}} : {dtype}[2]\nreturn %q", params="", res=f"{dtype}[2]"))
    got = m.funcs["f"].ops[0].attrs["value"]
    assert got == v and type(got) is int


@pytest.mark.parametrize("line, params", [
    ("%q = full {value = 1e300} : f32[2]", ""),
    ("%q = full {value = -1e300} : f32[2]", ""),
    ("%q = full {value = 70000.0} : f16[2]", ""),
    ("%q = full {value = 65520.0} : f16[2]", ""),
    ("%q = full {value = 3.40282357e38} : f32[2]", ""),
    ("%q = full {value = 1e39} : bf16[2]", ""),
    ("%q = full {value = 61440.0} : f8e5m2[2]", ""),
    ("%q = pad %x {low = [1], high = [0], value = 1e39} : f32[5]", "%x: f32[4]"),
])
def test_float_scalar_attribute_out_of_dtype_range(line, params):
    t = mod(f"{line}\nreturn", params=params, res="")
    e = err(t, "E0306", "%q", "value =")
    assert "overflows" in e.message




@pytest.mark.parametrize("line", [
    "%q = full {value = 500.0} : f8e4m3[2]",
    "%q = full {value = 470.0} : f8e4m3[2]",
    "%q = full {value = 1e300} : f8e4m3[2]",
    "%q = full {value = -500.0} : f8e4m3[2]",
    "%q = constant {value = [500.0]} : f8e4m3[1]",
])
def test_float_value_beyond_f8e4m3_range_is_refused(line):
    with pytest.raises(ir.IRError) as ei:
        ok(mod(f"{line}\nreturn", params="", res=""))
    assert ei.value.code.value in ("E0306", "E0410"), ei.value
    assert "overflows" in ei.value.message, ei.value


@pytest.mark.parametrize("dtype, v, held", [("f16", "65519.0", 65504.0), ("f16", "65504.0", 65504.0),
                                            ("f32", "3.4028235e38", float(np.finfo(np.float32).max)),
                                            ("f8e4m3", "464.0", 448.0), ("f8e5m2", "61439.0", 57344.0),
                                            ("f32", "1e-50", 0.0), ("f32", "inf", float("inf")),
                                            ("f16", "-inf", float("-inf")), ("f32", "1e999", float("inf"))])
def test_float_scalar_attribute_at_the_edge_of_its_dtype(dtype, v, held):
    m = ok(mod(f"%q = full {{value = {v}}} : {dtype}[2]\nreturn %q", params="", res=f"{dtype}[2]"))
    got = m.funcs["f"].ops[0].attrs["value"]
    assert got == held and type(got) is float
    assert ir.parse(ir.format(m)) == m


def test_literal_elements_out_of_dtype_range():
    for line in ["%q = constant {value = [128]} : i8[1]", "%q = constant {value = [-1]} : u8[1]",
                 "%q = constant {value = [1e300]} : f32[1]", "%q = constant {value = [70000.0]} : f16[1]"]:
        with pytest.raises(ir.IRError) as ei:
            ok(mod(f"{line}\nreturn", params="", res=""))
        assert ei.value.code.value in ("E0306", "E0410"), ei.value


def test_full_value_is_normalised_to_its_dtype():
    def h(v):
        return ok(mod(f"%q = full {{value = {v}}} : f32[2]\nreturn %q", params="", res="f32[2]")).hash()

    assert h("0.1") == h("0.10000000149011612") == h("0.100000001")
    assert h("0.1") != h("0.2")


@pytest.mark.parametrize("dtype, text, printed", [("f32", "0.1", "0.1"), ("f32", "0.10000000149011612", "0.1"),
                                                  ("f16", "0.1", "0.1"), ("bf16", "0.1", None),
                                                  ("f8e4m3", "0.1", None), ("f8e5m2", "0.1", None),
                                                  ("f64", "0.1", "0.1"), ("f32", "1", "1.0"),
                                                  ("f32", "16777217", "16777216.0"), ("f16", "3.14159", "3.14"),
                                                  ("f32", "-0.0", "-0.0")])
def test_float_scalar_is_rounded_to_its_dtype_and_printed_shortest(dtype, text, printed):
    t = mod(f"%q = full {{value = {text}}} : {dtype}[2]\nreturn %q", params="", res=f"{dtype}[2]")
    m = ok(t)
    got = m.funcs["f"].ops[0].attrs["value"]
    from dtm.ir.dtypes import DTYPES, numpy_dtype
    want = float(np.array(float(text)).astype(numpy_dtype(DTYPES[dtype])).astype(np.float64))
    assert type(got) is float and got == want
    if printed is not None:  # bf16 and f8 print the shortest decimal of the f32 that holds them
        assert f"value = {printed}}}" in ir.format(m)
    assert ir.parse(ir.format(m)) == m


def test_pad_value_is_rounded_to_its_dtype():
    m = ok(mod("%q = pad %x {low = [1], high = [0], value = 0.1} : f32[5]\nreturn %q", params="%x: f32[4]",
               res="f32[5]"))
    assert m.funcs["f"].ops[0].attrs["value"] == float(np.float32(0.1))
    assert "value = 0.1}" in ir.format(m)
