"""How IR errors are shown: `FILE:LINE:COL: CODE: message`, the source line, a caret."""

from __future__ import annotations

import re

import pytest

import dtm.ir as ir
from dtm.errors import DTMError, ErrorCode


def fail(text: str) -> ir.IRError:
    with pytest.raises(ir.IRError) as ei:
        ir.verify(ir.parse(text))
    return ei.value


def caret_target(rendered: str) -> tuple[str, str, str]:
    """(header, source line, the source character above the caret)."""
    head, src, caret = rendered.split("\n")
    assert src.startswith("  ") and caret.startswith("  ")
    assert set(caret[2:-1]) <= {" "} and caret.endswith("^")
    pos = len(caret) - 1
    return head, src[2:], src[pos] if pos < len(src) else ""


CASES = [
    # (text, code, the text the caret must point at)
    ("dtm 1.0\nfunc @f(%x: f32[4]) -> (f32[4]) {\n  %y = frob %x : f32[4]\n  return %y\n}\n", "E0301", "frob"),
    ("dtm 1.0\nfunc @f(%x: f32[4]) -> (f32[4]) {\n  %y = add %x, %q : f32[4]\n  return %y\n}\n", "E0201", "%q"),
    ("dtm 1.0\nfunc @f(%x: f31[4]) -> (f32[4]) {\n  return %x\n}\n", "E0401", "f31"),
    ("dtm 1.0\nfunc @f(%x: f32[4]) -> (f32[4]) {\n  %y = neg %x : f32[4] $\n  return %y\n}\n", "E0101", "$"),
    ("dtm 1.0\nfunc @f(%x: f32[4]) -> (f32[4]) {\n  %y = add %x, %x : f32[5]\n  return %y\n}\n", "E0404", "add"),
    ("dtm 1.0\nfunc @f(%x: f32[4]) -> (f32[4]) {\n  %y = neg %x {bogus = 1} : f32[4]\n  return %y\n}\n", "E0304",
     "bogus"),
    ("dtm 2.0\n", "E0601", "2.0"),
    ("dtm 1.0\nmesh @m[a = 0]\n", "E0505", "0"),
    ('dtm 1.0\nfunc @f() -> () {\n  store_put %x {key = "é"}\n  return\n}\n', "E0201", "%x"),
    ('dtm 1.0\nfunc @f(%x: f32[4]) -> (f32[4]) {\n  store_put %x {key = "日本語"} $\n  return %x\n}\n', "E0101", "$"),
]


@pytest.mark.parametrize("text, code, target", CASES)
def test_render_points_at_the_fault(text, code, target):
    e = fail(text)
    assert e.code.value == code
    out = ir.render(e, text, "model.dtm")
    head, src, above = caret_target(out)
    assert head == f"model.dtm:{e.line}:{e.col}: {code}: {e.message}"
    assert src == text.split("\n")[e.line - 1]
    col = e.col - 1
    assert src[col:col + len(target)] == target
    assert above == target[0]


def test_render_format_exactly():
    text = "dtm 1.0\nfunc @f(%x: f32[4]) -> (f32[4]) {\n  %y = frob %x : f32[4]\n  return %y\n}\n"
    e = fail(text)
    assert "frob" in e.message
    assert ir.render(e, text, "a.dtm") == (
        f"a.dtm:3:8: E0301: {e.message}\n"
        "    %y = frob %x : f32[4]\n"
        "         ^")


def test_render_default_filename_and_no_text():
    text = "dtm 1.0\nfunc @f(%x: f32[4]) -> (f32[4]) {\n  %y = frob %x : f32[4]\n  return %y\n}\n"
    e = fail(text)
    assert ir.render(e, text).startswith("<input>:3:8: E0301: ")
    assert ir.render(e, None, "x.dtm") == f"x.dtm:3:8: E0301: {e.message}"
    assert "\n" not in ir.render(e, None, "x.dtm")


def test_render_without_location():
    e = ir.IRError(ErrorCode.BAD_ENCODING, "bad magic")
    assert ir.render(e, None, "wire") == "wire: E0701: bad magic"
    assert ir.render(e, "dtm 1.0\n", "wire") == "wire: E0701: bad magic"
    with pytest.raises(ir.IRError) as ei:
        ir.decode(b"nope")
    r = ir.render(ei.value, None, "blob.bin")
    assert re.fullmatch(r"blob\.bin: E07\d\d: .+", r)


def test_render_line_out_of_range_shows_header_only():
    e = ir.IRError(ErrorCode.UNEXPECTED_TOKEN, "boom", 99, 3)
    assert ir.render(e, "dtm 1.0\n", "f") == "f:99:3: E0102: boom"


def test_render_crlf_source_line_has_no_cr():
    text = "dtm 1.0\r\nfunc @f(%x: f32[4]) -> (f32[4]) {\r\n  %y = frob %x : f32[4]\r\n  return %y\r\n}\r\n"
    e = fail(text)
    out = ir.render(e, text, "w.dtm")
    assert "\r" not in out
    _, src, above = caret_target(out)
    assert above == "f"


def test_render_error_at_end_of_input():
    text = "dtm 1.0\nfunc @f(%x: f32[4]) -> (f32[4]) {\n  %y = neg %x : f32[4]"
    e = fail(text)
    assert e.code.value == "E0102"
    out = ir.render(e, text, "t.dtm")
    head, src, above = caret_target(out)
    assert e.line == 3 and e.col == len(src) + 1 and above == ""


def test_render_caret_after_tabs_lines_up():
    text = "dtm 1.0\nfunc @f(%x: f32[4]) -> (f32[4]) {\n\t%y = frob %x : f32[4]\n  return %y\n}\n"
    e = fail(text)
    assert e.col == 7
    src_line, caret_line = ir.render(e, text, "t.dtm").split("\n")[1:]
    assert src_line == "  \t%y = frob %x : f32[4]"
    assert len(src_line[: src_line.index("frob")].expandtabs()) == len(caret_line[:-1].expandtabs())


def test_irerror_str_and_type():
    e = ir.IRError(ErrorCode.UNKNOWN_OP, "unknown op 'x'", 3, 8)
    assert str(e) == "3:8: E0301: unknown op 'x'"
    assert isinstance(e, DTMError) and isinstance(e, Exception)
    assert e.code is ErrorCode.UNKNOWN_OP and e.message == "unknown op 'x'"
    e2 = ir.IRError(ErrorCode.UNKNOWN_OP, "m")
    assert str(e2) == "E0301: m" and e2.line is None and e2.col is None


def test_error_codes_are_stable_strings():
    for c in ErrorCode:
        assert re.fullmatch(r"E(0[1-9]|[1-9]\d)\d\d", c.value)  # area (01-99), then the number
        assert str(c) == c.value
    assert len({c.value for c in ErrorCode}) == len(list(ErrorCode))


@pytest.mark.parametrize("text, code, target", CASES)
def test_every_error_has_a_line_and_column_within_the_line(text, code, target):
    e = fail(text)
    lines = text.split("\n")
    assert 1 <= e.line <= len(lines)
    assert 1 <= e.col <= len(lines[e.line - 1]) + 1
