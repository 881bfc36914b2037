"""Versions: a 1.N reader reads 1.0..1.N and refuses anything else naming both versions
(E0601); a writer refuses a target older than an op it must write (E0602).

This code implements 1.1. A newer spec is simulated by patching SPEC_VERSION to (1, 2, 0)
everywhere it was imported and registering a temporary op with since = (1, 2); monkeypatch
undoes both. A module built in code has no version of its own and is written as the lowest
version its ops need.
"""

from __future__ import annotations

import sys

import pytest

import dtm.ir as ir
from dtm.ir import registry, typerules
from dtm.ir.encoding import MAGIC
from dtm.ir.registry import REGISTRY, Category, OpDef

BODY = """\
func @f(%x: f32[4]) -> (f32[4]) {
  %y = neg %x : f32[4]
  return %y
}
"""
NEW_BODY = """\
func @f(%x: f32[4]) -> (f32[4]) {
  %y = neg %x : f32[4]
  %z = future_op %y : f32[4]
  return %z
}
"""


def _patch_spec(monkeypatch, version):
    for name, module in list(sys.modules.items()):
        if (name == "dtm" or name.startswith("dtm.")) and module is not None and hasattr(module, "SPEC_VERSION"):
            monkeypatch.setattr(module, "SPEC_VERSION", version)


@pytest.fixture
def spec_1_2(monkeypatch):
    _patch_spec(monkeypatch, (1, 2, 0))
    monkeypatch.setitem(REGISTRY, "future_op", OpDef("future_op", Category.UNARY, ("x",), (), typerules.unary("float"),
                                                     since=(1, 2), summary="an op added in 1.2 (test only)"))
    yield


def code_msg(fn) -> ir.IRError:
    with pytest.raises(ir.IRError) as ei:
        fn()
    return ei.value


# --- reading ----------------------------------------------------------------------------------

def test_header_1_0_accepted():
    m = ir.verify(ir.parse("dtm 1.0\n" + BODY))
    assert m.version == (1, 0)
    assert ir.format(m).startswith("dtm 1.0\n")
    assert ir.SPEC_VERSION[:2] == (1, 1)
    assert ir.verify(ir.parse("dtm 1.1\n" + BODY)).version == (1, 1)


def test_a_built_module_is_written_as_the_lowest_version_its_ops_need():
    def built(op: str) -> ir.Module:
        b = ir.Builder()
        f = b.func("f")
        x = f.param("f32[4]")
        f.ret(getattr(f, op)(x, axis=0) if op == "cumsum" else getattr(f, op)(x))
        return b.build()
    plain = built("neg")
    assert plain.version is None and ir.format(plain).startswith("dtm 1.0\n")
    assert plain.hash() == ir.parse(ir.format(plain)).hash()  # hashed as the 1.0 module it reads back as
    assert ir.decode(ir.encode(plain)).version == (1, 0)  # (every 1.x reader reads it)
    newer = built("cumsum")  # (an op of 1.1)
    assert ir.format(newer).startswith("dtm 1.1\n")
    assert code_msg(lambda: ir.encode(newer, target=(1, 0))).code.value == "E0602"


@pytest.mark.parametrize("v", ["1.2", "1.10", "2.0", "0.9", "0.0", "3.7", "999999.0"])
def test_other_versions_refused_naming_both(v):
    e = code_msg(lambda: ir.parse(f"dtm {v}\n" + BODY))
    assert e.code.value == "E0601"
    assert v in e.message and "1.1" in e.message
    assert (e.line, e.col) == (1, 5)


def test_version_error_location_after_comments():
    e = code_msg(lambda: ir.parse("// hi\n\n   dtm 2.0\n" + BODY))
    assert e.code.value == "E0601"
    assert (e.line, e.col) == (3, 8)


@pytest.mark.parametrize("major, minor", [(1, 2), (2, 0), (0, 9), (1, 200)])
def test_decode_refuses_other_versions(major, minor):
    m = ir.parse("dtm 1.0\n" + BODY)
    enc = bytearray(ir.encode(m))
    assert enc[len(MAGIC):len(MAGIC) + 2] == b"\x01\x00"
    w = bytearray()
    for n in (major, minor):
        while n >= 0x80:
            w.append((n & 0x7F) | 0x80)
            n >>= 7
        w.append(n)
    bad = bytes(enc[:len(MAGIC)] + w + enc[len(MAGIC) + 2:])
    e = code_msg(lambda: ir.decode(bad))
    assert e.code.value == "E0601"
    assert f"{major}.{minor}" in e.message and "1.1" in e.message


def test_writer_target_equal_to_own_version_ok():
    m = ir.verify(ir.parse("dtm 1.0\n" + BODY))
    assert ir.format(m, target=(1, 0)) == ir.format(m)
    assert ir.encode(m, target=(1, 0)) == ir.encode(m)
    assert ir.format(m, target=(1, 0, 0)) == ir.format(m)


@pytest.mark.parametrize("target", [(1, 2), (2, 0), (0, 9)])
def test_writer_refuses_targets_it_cannot_write(target):
    m = ir.verify(ir.parse("dtm 1.0\n" + BODY))
    for fn in (lambda: ir.format(m, target=target), lambda: ir.encode(m, target=target)):
        e = code_msg(fn)
        assert e.code.value == "E0601"
        assert f"{target[0]}.{target[1]}" in e.message


# --- a simulated newer spec -----------------------------------------------------------------------

def test_newer_reader_reads_older_and_own_minor(spec_1_2):
    assert ir.parse("dtm 1.0\n" + BODY).version == (1, 0)
    m = ir.verify(ir.parse("dtm 1.2\n" + NEW_BODY))
    assert m.version == (1, 2)
    assert ir.format(m).startswith("dtm 1.2\n")
    assert ir.parse(ir.format(m)) == m
    assert ir.decode(ir.encode(m)) == m


@pytest.mark.parametrize("v", ["1.3", "2.0", "0.1"])
def test_newer_reader_refuses_newer_minor_and_other_major(spec_1_2, v):
    e = code_msg(lambda: ir.parse(f"dtm {v}\n" + BODY))
    assert e.code.value == "E0601"
    assert v in e.message and "1.2" in e.message


def test_target_older_than_op_refused(spec_1_2):
    text = "dtm 1.2\n" + NEW_BODY
    m = ir.verify(ir.parse(text))
    for fn in (lambda: ir.format(m, target=(1, 1)), lambda: ir.encode(m, target=(1, 1))):
        e = code_msg(fn)
        assert e.code.value == "E0602"
        assert "future_op" in e.message and "1.2" in e.message and "1.1" in e.message
        # located at the op
        line = text.split("\n").index("  %z = future_op %y : f32[4]") + 1
        assert (e.line, e.col) == (line, 8)
    # the own version and an equal explicit target are fine
    assert ir.format(m, target=(1, 2)) == ir.format(m)
    assert ir.encode(m, target=(1, 2)) == ir.encode(m)


def test_target_older_without_new_ops_writes_old_header(spec_1_2):
    m = ir.verify(ir.parse("dtm 1.2\n" + BODY))
    old = ir.format(m, target=(1, 0))
    assert old.startswith("dtm 1.0\n")
    assert ir.parse(old).version == (1, 0)
    d = ir.decode(ir.encode(m, target=(1, 0)))
    assert d.version == (1, 0)
    assert d == ir.parse(old)


def test_builder_module_with_new_op(spec_1_2):
    b = ir.Builder()
    f = b.func("f")
    x = f.param("f32[4]")
    y = f.future_op(x)
    f.ret(y)
    m = b.build()
    assert m.version is None and ir.format(m).startswith("dtm 1.2\n")  # the lowest version its ops need
    assert ir.format(ir.parse(ir.format(m))) == ir.format(m)
    assert code_msg(lambda: ir.encode(m, target=(1, 1))).code.value == "E0602"


def test_module_older_than_its_ops_refused_by_verify(spec_1_2):
    text = "dtm 1.1\n" + NEW_BODY
    with pytest.raises(ir.IRError) as ei:
        ir.verify(ir.parse(text))
    assert ei.value.code.value == "E0602"
    assert ei.value.line == text.split("\n").index("  %z = future_op %y : f32[4]") + 1


def test_cleanup_after_simulation():
    assert "future_op" not in REGISTRY
    assert ir.SPEC_VERSION == (1, 1, 3)
    from dtm.ir import version, versioning

    assert version.SPEC_VERSION == versioning.SPEC_VERSION == (1, 1, 3)
    assert ir.Module().version is None
    assert code_msg(lambda: ir.parse("dtm 1.2\n" + BODY)).code.value == "E0601"


def test_every_registry_op_is_in_this_spec():
    for name, d in registry.REGISTRY.items():
        assert d.since <= ir.SPEC_VERSION[:2], name
