"""`dtm store ls|info|get|put|rm|du|verify|export|import`: what the commands show and write
is what the library (`dtm.store`) holds; exported files read back with safetensors' own
loaders (numpy's, and torch's for f8, which safetensors.numpy cannot load); bad input ends
with exit status 1 and one line naming the error code, never a traceback."""

from __future__ import annotations

import pathlib
import sqlite3

import ml_dtypes
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file
from safetensors.torch import load_file as torch_load_file

import dtm
from dtm.cli import main
from dtm.ir import DTYPES
from dtm.ref import quantize

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 8)).astype(np.float32)
B = RNG.standard_normal(8).astype(ml_dtypes.bfloat16)
F8 = RNG.standard_normal((2, 3)).astype(ml_dtypes.float8_e4m3fn)
IDS = np.arange(5, dtype=np.int64)


@pytest.fixture
def store(tmp_path) -> tuple[str, dtm.store.Store]:
    path = str(tmp_path / "store")
    st = dtm.store.open(path)
    st.put("model/w", W)
    st.put("model/b", B)
    st.put("model/f8", F8)
    st.put("ids", IDS)
    return path, st


def run(path: str, *args: str):
    return CliRunner().invoke(main, ["store", "--store", path, *args])


def assert_fails(result, code: str) -> None:
    """Exit status 1, one line on stderr naming `code`, and no traceback."""
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    line = result.stderr.strip()
    assert "\n" not in line and code in line and "Traceback" not in result.output, result.output


def test_ls_and_info_show_what_the_library_holds(store):
    path, st = store
    out = run(path, "ls", "model/").output
    for key, shown in [("model/w", "f32[4, 8]"), ("model/b", "bf16[8]"), ("model/f8", "f8e4m3[2, 3]")]:
        assert key in out and shown in out
    assert "ids" not in out and "3 key(s)" in out
    info = st.info("model/w")
    out = run(path, "info", "model/w").output
    assert info.checksum in out and str(info.nbytes) in out and "f32" in out and "[4, 8]" in out
    du = run(path, "du", "model/").output
    assert str(st.du("model/")) in du and "3" in du


def test_get_and_put_through_npy(store, tmp_path):
    path, st = store
    out = tmp_path / "w.npy"
    assert run(path, "get", "model/w", "-o", str(out)).exit_code == 0
    np.testing.assert_array_equal(np.load(out), W)
    shown = run(path, "get", "ids")
    assert shown.exit_code == 0 and "i64[5]" in shown.output and "[0 1 2 3 4]" in shown.output
    x = RNG.standard_normal((3, 2))
    np.save(tmp_path / "x.npy", x)
    assert run(path, "put", "new/x", str(tmp_path / "x.npy")).exit_code == 0
    np.testing.assert_array_equal(dtm.store.open(path).get_array("new/x"), x)
    q = quantize(RNG.standard_normal((2, 32)).astype(np.float32), DTYPES["q8_0"])
    np.save(tmp_path / "q.npy", q)
    assert run(path, "put", "new/q", str(tmp_path / "q.npy"), "--dtype", "q8_0").exit_code == 0
    assert str(st.info("new/q").dtype) == "q8_0" and st.info("new/q").shape == (2, 32)
    assert run(path, "rm", "new/x", "new/q").exit_code == 0
    assert st.keys("new/") == []


def test_export_and_import_round_trip_through_safetensors(store, tmp_path):
    path, st = store
    out = tmp_path / "model.safetensors"
    result = run(path, "export", "model/", str(out))
    assert result.exit_code == 0, result.output
    tensors = torch_load_file(out)  # safetensors' numpy loader has no f8
    assert sorted(tensors) == ["model/b", "model/f8", "model/w"]
    np.testing.assert_array_equal(tensors["model/w"].numpy(), W)
    np.testing.assert_array_equal(tensors["model/b"].view(torch.int16).numpy(), B.view(np.int16))
    assert tensors["model/f8"].dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(tensors["model/f8"].view(torch.uint8).numpy(), F8.view(np.uint8))
    # one key (not the keys it prefixes) as the file safetensors.numpy writes and reads
    assert run(path, "export", "model/w", str(tmp_path / "w.safetensors")).exit_code == 0
    assert list(load_file(tmp_path / "w.safetensors")) == ["model/w"]

    hf = tmp_path / "hf.safetensors"
    save_file({"h.0.attn.weight": W, "h.0.ln.bias": np.asarray(B)}, hf)
    result = run(path, "import", str(hf), "--prefix", "hf/")
    assert result.exit_code == 0, result.output
    assert st.keys("hf/") == ["hf/h.0.attn.weight", "hf/h.0.ln.bias"]
    reference = load_file(hf)
    for name, want in reference.items():
        got = st.get_array("hf/" + name)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_verify_names_a_corrupted_chunk(store):
    path, st = store
    st.put("model/big", np.ones((64, 32), np.float32))  # 8 KiB: a Zarr array (model/w is kept inline)
    assert run(path, "verify").exit_code == 0
    chunks = [p for p in (pathlib.Path(path) / "data" / "model" / "big").rglob("*")
              if p.is_file() and p.name != "zarr.json"]
    data = bytearray(chunks[0].read_bytes())
    data[0] ^= 0xFF
    chunks[0].write_bytes(bytes(data))
    result = run(path, "verify")
    assert result.exit_code == 1 and "model/big" in result.output and "1 bad key(s)" in result.output
    assert_fails(run(path, "get", "model/big", "-o", str(pathlib.Path(path).parent / "big.npy")), "E1102")
    with sqlite3.connect(pathlib.Path(path) / "index.sqlite") as db:  # a bit of model/w's row flipped
        db.execute("UPDATE keys SET data = ? WHERE key = 'model/w'", (bytes([W.tobytes()[0] ^ 1]) + W.tobytes()[1:],))
    result = run(path, "verify")
    assert result.exit_code == 1 and "inline" in result.output and "2 bad key(s)" in result.output
    assert_fails(run(path, "get", "model/w"), "E1102")


def test_bad_input_is_one_line_with_its_code(store, tmp_path):
    path, st = store
    assert_fails(run(path, "info", "nope"), "E0804")
    assert_fails(run(path, "get", "nope"), "E0804")
    assert_fails(run(path, "rm", "nope"), "E0804")
    assert_fails(run(path, "export", "nope/", str(tmp_path / "x.safetensors")), "E0804")
    assert_fails(run(path, "info", "a//b"), "E1101")
    assert_fails(run(path, "get", "model/b", "-o", str(tmp_path / "b.npy")), "E0401")  # .npy cannot name bf16
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    assert_fails(run(path, "put", "k", str(tmp_path / "junk.npy")), "E0701")
    assert_fails(run(path, "put", "k", str(tmp_path / "missing.npy")), "E1104")
    assert_fails(run(path, "import", str(tmp_path / "junk.npy")), "E0701")
    assert_fails(run(str(tmp_path / "junk.npy"), "ls"), "E1104")  # a store path that is a file
    st.put_array("q", quantize(np.ones((1, 32), np.float32), DTYPES["q8_0"]), dtype="q8_0")
    assert_fails(run(path, "export", "q", str(tmp_path / "q.safetensors")), "E0401")
    assert not (tmp_path / "q.safetensors").exists()


def test_a_memory_store_is_refused_as_it_would_die_with_the_command(tmp_path):
    np.save(tmp_path / "x.npy", W)
    assert_fails(CliRunner().invoke(main, ["store", "--store", "memory://x", "put", "k", str(tmp_path / "x.npy")]),
                 "E0306")


def test_rm_deletes_nothing_when_a_key_is_missing_and_names_each(store):
    path, st = store
    result = run(path, "rm", "ids", "nope", "model/w", "nope2")
    assert_fails(result, "E0804")
    assert "'nope'" in result.stderr and "'nope2'" in result.stderr
    assert "ids" in st and "model/w" in st
    assert run(path, "rm", "ids", "model/w").exit_code == 0 and st.keys() == ["model/b", "model/f8"]


def test_recover_rebuilds_a_deleted_index_and_gc_and_du_see_unfinished_versions(store):
    path, st = store
    st.put("big", np.arange(2048.0))
    st._files.write("data/big/@00000000000000aa/c/0", [b"x" * 100])  # as a killed put leaves it
    assert "100" in run(path, "du").output
    gc = run(path, "gc")
    assert gc.exit_code == 0 and "1 unfinished" in gc.output
    st.close()
    pathlib.Path(path, "index.sqlite").unlink()
    assert_fails(run(path, "ls"), "E1107")
    result = run(path, "recover")
    assert result.exit_code == 0 and "1 key(s) recovered" in result.output and "cannot be recovered" in result.output
    assert run(path, "ls").exit_code == 0 and dtm.store.open(path).keys() == ["big"]
