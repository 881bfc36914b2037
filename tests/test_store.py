"""The embedded tensor store (dtm.store, spec 9.2): round trips of every dtype bit for bit,
the index (info, keys, delete, du, quotas), checksums on every read and in verify, the Zarr
v3 format read back by the zarr library itself, atomic puts under kill -9, and every kind of
bad input with its error code."""

from __future__ import annotations

import base64
import errno
import json
import mmap
import os
import pathlib
import random
import re
import select
import signal
import sqlite3
import subprocess
import sys
import time
import uuid

import ml_dtypes

import numpy as np
import pytest
from crc32c import crc32c

import dtm
from dtm.errors import DTMError, ErrorCode
from dtm.ir.dtypes import DTYPES, numpy_dtype
from dtm.ref.quant import dequantize, quantize
from dtm.store import ChecksumError, InvalidKey, KeyMissing, QuotaExceeded, StoreIOError, StoreTypeError
from dtm.store import files as store_files
from dtm.store.files import MAP_BYTES, LocalFiles
from dtm.store.format import INLINE_BYTES, INLINE_CHUNK
from dtm.store.keys import MAX_KEY_BYTES, MAX_SEGMENT_BYTES

PLAIN = [d for d in DTYPES.values() if not d.is_quant]
QUANT = [d for d in DTYPES.values() if d.is_quant]
SHAPES = [(), (0, 3), (7,), (13, 5), (4, 3, 2)]


def _random(dtype, shape, seed=0) -> np.ndarray:
    """Random bit patterns of `dtype` (NaNs and infinities included for floats)."""
    rng = np.random.default_rng(seed)
    if dtype.name == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    nd = numpy_dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    return rng.integers(0, 256, n * nd.itemsize, dtype=np.uint8).view(nd).reshape(shape)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(params=["file", "memory", "file-inline", "memory-inline"])
def st(request, tmp_path):
    # small chunks, so that most tensors here span several chunk files; or every tensor here
    # (all of at most INLINE_BYTES) kept inline, in its index row
    kind, _, inline = request.param.partition("-")
    url = str(tmp_path / "s") if kind == "file" else f"memory://{uuid.uuid4().hex}"
    with dtm.store.open(url, chunk_bytes=64, inline_bytes=INLINE_BYTES if inline else 0) as s:
        yield s


@pytest.fixture
def disk(tmp_path):
    """A directory store whose every tensor is a Zarr array of 64-byte chunks."""
    with dtm.store.open(tmp_path / "s", chunk_bytes=64, inline_bytes=0) as s:
        yield s


# --- round trips ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", PLAIN, ids=str)
def test_every_dtype_round_trips_bit_for_bit(st, dtype, shape):
    x = _random(dtype, shape, seed=len(shape))
    info = st.put("t/x", x)
    assert (info.dtype, info.shape, info.nbytes) == (dtype, shape, x.nbytes)
    y = st.get_array("t/x")
    assert _same_bits(y, x)
    assert not y.flags.writeable
    # the tensor's checksum is the CRC32C of its little-endian bytes, whatever its chunking
    assert info.checksum == f"{crc32c(x.tobytes()):08x}"


@pytest.mark.parametrize("dtype", QUANT, ids=str)
def test_quantized_tensors_round_trip_as_their_blocks(st, dtype):
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    blocks = quantize(x, dtype)  # the reference quantizer: GGML's block layout (spec 2.2)
    info = st.put_array("q", blocks, dtype=dtype.name)
    assert (info.dtype, info.shape, info.nbytes) == (dtype, (5, 64), blocks.nbytes)
    back = st.get_array("q", dtype=dtype, shape=(5, 64))
    assert _same_bits(back, blocks)
    np.testing.assert_array_equal(dequantize(back, dtype, np.float32), dequantize(blocks, dtype, np.float32))
    with pytest.raises(StoreTypeError) as e:
        st.get("q")  # a dtm.Tensor holds no quantized dtype
    assert e.value.code is ErrorCode.QUANTIZED_MISUSE
    with pytest.raises(StoreTypeError) as e:
        st.get("q", dtype="f32")  # the type mismatch is named first
    assert e.value.code is ErrorCode.DTYPE_MISMATCH
    with pytest.raises(StoreTypeError) as e:
        st.put_array("q", blocks[:, :-1], dtype=dtype.name)  # not whole blocks
    assert e.value.code is ErrorCode.QUANTIZED_MISUSE


def test_get_returns_a_dtm_tensor_and_put_takes_one(st):
    x = dtm.randn(6, 4).to(dtm.bfloat16)
    st.put("w", x)
    y = st.get("w", dtype=dtm.bfloat16, shape=(6, 4))
    assert isinstance(y, dtm.Tensor) and y.dtype == dtm.bfloat16
    assert _same_bits(y.numpy(), x.numpy())
    assert st.get_array("w").dtype == np.dtype(ml_dtypes.bfloat16)


def test_put_converts_to_a_given_dtype(st):
    st.put("c", np.array([1.5, -2.25], np.float64), dtype="f16")
    assert _same_bits(st.get_array("c"), np.array([1.5, -2.25], np.float16))


def test_a_one_chunk_tensor_on_disk_is_memory_mapped_unless_small(tmp_path):
    """A one-chunk tensor's get is a map of its chunk file (no copy); a chunk file under
    MAP_BYTES is read instead (cheaper than a map), and both give the bytes put."""
    def buffer_of(a):
        while isinstance(a, (np.ndarray, memoryview)):  # down the views to the buffer
            a = a.base if isinstance(a, np.ndarray) else a.obj
        return a

    with dtm.store.open(tmp_path / "s") as s:
        big, small = np.arange(MAP_BYTES // 4, dtype=np.float32), np.arange(1000, dtype=np.float32)
        s.put("big", big)
        s.put("small", small)
        assert isinstance(buffer_of(s.get_array("big")), mmap.mmap)
        assert isinstance(buffer_of(s.get_array("small")), bytes)
        np.testing.assert_array_equal(s.get_array("big"), big)
        np.testing.assert_array_equal(s.get_array("small"), small)


# --- the index ------------------------------------------------------------------------------

def test_info_keys_delete_and_du(st):
    t0 = time.time()
    st.put("layer0/w", np.zeros((4, 4), np.float32))
    st.put("layer0/b", np.zeros(4, np.float32))
    st.put("layer1/w", np.zeros((2, 2), np.float64))
    info = st.put("layer0/w", np.ones((4, 4), np.float32))
    assert info.version == 2 and info.written >= t0
    assert st.info("layer0/w") == info
    assert st.keys() == ["layer0/b", "layer0/w", "layer1/w"]
    assert st.keys("layer0/") == ["layer0/b", "layer0/w"]
    assert (st.du(), st.du("layer0/"), st.du("nothing/")) == (64 + 16 + 32, 80, 0)
    st.delete("layer0/w")
    assert st.keys("layer0/") == ["layer0/b"] and "layer0/w" not in st
    with pytest.raises(KeyMissing):
        st.delete("layer0/w")
    assert st.put("layer0/w", np.ones(1, np.int8)).version == 1


def test_unicode_keys_and_prefixes(st):
    st.put("模型/层0/权重", np.ones(2, np.float32))
    st.put("模型/x", np.ones(3, np.float32))
    assert st.keys("模型/层") == ["模型/层0/权重"]
    assert st.du("模型/") == 20


def test_a_put_is_visible_to_another_store_object_once_it_returns(tmp_path):
    with dtm.store.open(tmp_path / "s") as a, dtm.store.open(f"file://{tmp_path / 's'}") as b:
        a.put("k", np.arange(3))
        assert _same_bits(b.get_array("k"), np.arange(3))


def test_memory_stores_are_shared_by_name_within_the_process():
    a = dtm.store.open("memory://shared-test")
    a.put("k", np.arange(5, dtype=np.int16))
    assert _same_bits(dtm.store.open("memory://shared-test").get_array("k"), np.arange(5, dtype=np.int16))
    assert dtm.store.open("memory://another-test").keys() == []


def test_use_and_current(tmp_path, monkeypatch):
    monkeypatch.setattr(dtm.store, "_current", None)
    monkeypatch.setenv("DTM_STORE", str(tmp_path / "default"))
    default = dtm.store.current()
    assert default.url == f"file://{tmp_path / 'default'}" and dtm.store.current() is default
    mem = dtm.store.open("memory://use-test")
    assert dtm.store.use(mem) is mem and dtm.store.current() is mem


# --- quotas ---------------------------------------------------------------------------------

def test_a_put_past_a_quota_is_refused_before_anything_is_written(disk, tmp_path):
    disk.set_quota(100, prefix="a/")
    disk.put("a/x", np.zeros(10, np.float32))       # 40 bytes
    disk.put("a/x", np.zeros(20, np.float32))       # replacing: 80, not 120
    disk.put("b/x", np.zeros(100, np.float32))      # another prefix
    before = sorted(os.listdir(tmp_path / "s" / "data" / "a"))
    with pytest.raises(QuotaExceeded) as e:
        disk.put("a/y", np.zeros(6, np.float32))    # 80 + 24 > 100
    assert e.value.code is ErrorCode.STORE_QUOTA_EXCEEDED and e.value.key == "a/y"
    assert sorted(os.listdir(tmp_path / "s" / "data" / "a")) == before
    assert disk.keys("a/") == ["a/x"] and disk.du("a/") == 80
    disk.set_quota(1000)                            # the whole store
    with pytest.raises(QuotaExceeded):
        disk.put("c", np.zeros(300, np.float32))
    assert disk.quotas() == {"a/": 100, "": 1000}
    disk.set_quota(None, prefix="a/")
    disk.put("a/y", np.zeros(6, np.float32))


# --- checksums ------------------------------------------------------------------------------

def _chunk_path(tmp_path, disk, key, chunk):
    return tmp_path / "s" / disk.info(key).dir / chunk


def test_a_corrupted_chunk_raises_checksum_error_naming_key_and_chunk(disk, tmp_path):
    x = np.arange(64, dtype=np.float32)             # 256 bytes: four chunks of 64
    disk.put("w", x)
    disk.put("other", np.ones(3))
    p = _chunk_path(tmp_path, disk, "w", "c/2")
    raw = bytearray(p.read_bytes())
    raw[5] ^= 0x10
    p.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError) as e:
        disk.get_array("w")
    assert e.value.code is ErrorCode.STORE_CHUNK_CORRUPT and (e.value.key, e.value.chunk) == ("w", "c/2")
    assert "'w'" in str(e.value) and "c/2" in str(e.value)
    report = disk.verify()
    assert not report.ok and report.bad_keys == ["w"] and report.keys == 2 and report.chunks == 5
    assert [(k, c) for k, c, _ in report.bad] == [("w", "c/2")]
    assert _same_bits(disk.get_array("other"), np.ones(3))  # nothing else is lost
    assert disk.verify("other").ok


def test_a_truncated_or_missing_chunk_is_a_checksum_error(disk, tmp_path):
    disk.put("w", np.arange(64, dtype=np.float32))
    p = _chunk_path(tmp_path, disk, "w", "c/1")
    p.write_bytes(p.read_bytes()[:-7])
    with pytest.raises(ChecksumError, match="truncated"):
        disk.get_array("w")
    p.unlink()
    with pytest.raises(ChecksumError, match="missing"):
        disk.get_array("w")


def test_damaged_metadata_is_store_corrupt(disk, tmp_path):
    disk.put("w", np.arange(4))
    (tmp_path / "s" / disk.info("w").dir / "zarr.json").write_text("{not json")
    with pytest.raises(DTMError) as e:
        disk.get_array("w")
    assert e.value.code is ErrorCode.STORE_CORRUPT
    assert disk.verify().bad[0][:2] == ("w", "zarr.json")


# --- the format, read by the zarr library itself ----------------------------------------------

@pytest.mark.parametrize("dtype,zarr_view", [("f32", None), ("i64", None), ("bool", None), ("bf16", np.uint16),
                                             ("f8e4m3", np.uint8)])
def test_zarr_reads_a_dtm_store_key(disk, tmp_path, dtype, zarr_view):
    zarr = pytest.importorskip("zarr", minversion="3")
    x = _random(DTYPES[dtype], (9, 5), seed=3)
    disk.put("layer0/w", x)                          # several chunks, the last one padded
    z = zarr.open_array(str(tmp_path / "s" / disk.info("layer0/w").dir), mode="r")
    assert [c.__class__.__name__ for c in z.metadata.codecs] == ["BytesCodec", "Crc32cCodec"]
    assert z.attrs["dtm"]["dtype"] == dtype
    got = z[...]
    assert _same_bits(got, x.view(zarr_view) if zarr_view else x)


# --- atomicity ------------------------------------------------------------------------------

def _version(i: int, mixed: bool = False) -> np.ndarray:
    """Version i of a killed writer's tensor: 16 KiB, 4 chunks; with `mixed`, every even
    version 16 bytes, kept inline, so that puts switch the key between the two forms."""
    n = 4 if mixed and i % 2 == 0 else 4096
    return np.random.default_rng(i).standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("mixed", [False, True], ids=["zarr", "zarr-and-inline"])
def test_a_put_killed_at_any_moment_leaves_the_old_or_the_new_tensor(tmp_path, mixed):
    rng = random.Random(17)
    for trial in range(20):
        path = str(tmp_path / f"s{trial}")
        with dtm.store.open(path, chunk_bytes=4096) as s:
            s.put("k", _version(0, mixed))
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the writer: puts versions 1, 2, ... until it is killed
            os.close(r)
            try:
                s = dtm.store.open(path, chunk_bytes=4096)
                for i in range(1, 1000):
                    os.write(w, i.to_bytes(4, "little"))
                    s.put("k", _version(i, mixed))
            finally:
                os._exit(0)
        os.close(w)
        # the writer is about to start its first put (a loaded machine may take a while to
        # get it there): from then, kill it at a random moment, from inside that first put to
        # a few puts in
        ready, _, _ = select.select([r], [], [], 30.0)
        assert ready, f"trial {trial}: the writer did not start within 30 s"
        started = os.read(r, 4)
        time.sleep(rng.uniform(0.0, 0.05))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        started += os.read(r, 1 << 16)
        os.close(r)
        last = int.from_bytes(started[-4:], "little") if started else 0
        with dtm.store.open(path, chunk_bytes=4096) as s:
            got = s.get_array("k")
            assert any(_same_bits(got, _version(i, mixed)) for i in (last - 1, last) if i >= 0), f"trial {trial}"
            assert s.verify().ok
            s.collect(older_than_s=0)                # what the killed put left
            assert _version_dirs(pathlib.Path(path), "k") == _current_dir(s, "k")
            s.put("k", _version(0))                  # the store is writable again
            assert _same_bits(s.get_array("k"), _version(0))


def test_a_write_error_keeps_the_earlier_tensor(disk, tmp_path, monkeypatch):
    disk.put("k", np.arange(64, dtype=np.float32))
    real, calls = LocalFiles.write, []

    def failing(self, rel, parts):
        calls.append(rel)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, rel, parts)

    monkeypatch.setattr(LocalFiles, "write", failing)
    with pytest.raises(StoreIOError) as e:
        disk.put("k", np.zeros(64, np.float32))
    assert e.value.code is ErrorCode.STORE_IO_ERROR and e.value.key == "k" and "No space left" in str(e.value)
    monkeypatch.undo()
    assert _same_bits(disk.get_array("k"), np.arange(64, dtype=np.float32))
    assert os.listdir(tmp_path / "s" / "data" / "k") == [disk.info("k").dir.rsplit("/", 1)[1]]


# --- small tensors, kept inline in the index ------------------------------------------------

def test_small_tensors_take_little_disk(tmp_path):
    """A 16-byte tensor as a Zarr array took 20 KiB of disk on ext4 (its key's directory, its
    version directory, `c/`, zarr.json and a chunk file, a 4 KiB block each: 2 GB for 100,000
    task outputs); kept inline it takes its index row, and no file."""
    root = tmp_path / "s"
    with dtm.store.open(root) as s:
        for i in range(1000):
            s.put(f"t/{i}", np.full(4, i, np.float32))
    # closed: SQLite has moved its WAL into the database (an open store's WAL is up to ~4 MiB)
    used = sum(os.lstat(os.path.join(d, n)).st_blocks * 512 for d, dirs, files in os.walk(root) for n in dirs + files)
    assert used / 1000 < 1024, f"{used / 1000:.0f} bytes of disk per key"
    assert [f for _, _, files in os.walk(root / "data") for f in files] == []


def test_a_small_tensor_is_kept_inline_through_every_operation(tmp_path):
    root = tmp_path / "s"
    x = np.arange(4, dtype=np.float32)
    with dtm.store.open(root) as s:
        info = s.put("a/k", x)
        assert info.inline and info.dir == "" and (info.nbytes, info.version) == (16, 1)
        assert info.checksum == f"{crc32c(x.tobytes()):08x}"
        assert not (root / "data" / "a").exists()                # no directory, no file
        assert s.info("a/k") == info and s.keys("a/") == ["a/k"] and s.du("a/") == 16
        assert _same_bits(s.get("a/k", dtype="f32", shape=(4,)).numpy(), x)
        report = s.verify()
        assert report.ok and (report.keys, report.chunks) == (1, 1)
        big = np.arange(2048, dtype=np.float32)                  # past INLINE_BYTES: a Zarr array
        assert not s.put("a/k", big).inline and _version_dirs(root, "a/k") == _current_dir(s, "a/k") != []
        assert _same_bits(s.get_array("a/k"), big)
        assert s.put("a/k", x + 1).version == 3                  # back inline: the Zarr array removed
        assert _version_dirs(root, "a/k") == [] and _same_bits(s.get_array("a/k"), x + 1)
        assert s.collect(older_than_s=0) == [] and _same_bits(s.get_array("a/k"), x + 1)
        s.set_quota(20, prefix="a/")
        with pytest.raises(QuotaExceeded):
            s.put("a/j", x)                                      # 16 + 16 > 20
        assert s.keys() == ["a/k"]
        s.delete("a/k")
        assert s.keys() == [] and s.du() == 0
        with pytest.raises(KeyMissing):
            s.get_array("a/k")


def test_a_tensor_kept_inline_damaged_on_the_disk_is_a_checksum_error(tmp_path):
    root = tmp_path / "s"
    x = np.frombuffer(b"sixteen bytes!!!", np.uint8)            # to be found in the index's file
    with dtm.store.open(root) as s:
        s.put("k", x)
        s.put("other", np.ones(3))
    db = root / "index.sqlite"                                   # closed: its WAL moved into it
    raw = bytearray(db.read_bytes())
    assert raw.count(x.tobytes()) == 1
    raw[raw.index(x.tobytes()) + 5] ^= 0x10
    db.write_bytes(bytes(raw))
    with dtm.store.open(root) as s:
        with pytest.raises(ChecksumError) as e:
            s.get_array("k")
        assert e.value.code is ErrorCode.STORE_CHUNK_CORRUPT and (e.value.key, e.value.chunk) == ("k", INLINE_CHUNK)
        assert "CRC32C" in str(e.value)
        report = s.verify()
        assert [(k, c) for k, c, _ in report.bad] == [("k", INLINE_CHUNK)] and report.keys == 2
        assert _same_bits(s.get_array("other"), np.ones(3))     # nothing else is lost
        with sqlite3.connect(db) as other:                       # a row whose bytes are cut short
            other.execute("UPDATE keys SET data = substr(data, 1, 15) WHERE key = 'k'")
        other.close()
        with pytest.raises(ChecksumError, match="15 bytes, expected 16"):
            s.get_array("k")
        s.put("k", x)                                            # a put replaces the damaged tensor
        assert s.verify().ok and _same_bits(s.get_array("k"), x)


def test_a_schema_1_index_is_upgraded_and_an_unknown_schema_refused(tmp_path):
    root = tmp_path / "s"
    with dtm.store.open(root, inline_bytes=0) as s:
        s.put("old", np.arange(3))
    db = sqlite3.connect(root / "index.sqlite", isolation_level=None)
    db.execute("ALTER TABLE keys DROP COLUMN data")              # as the store was before inline tensors
    db.execute("UPDATE meta SET value = '1' WHERE name = 'schema'")
    db.close()
    with dtm.store.open(root) as s:
        assert _same_bits(s.get_array("old"), np.arange(3)) and not s.info("old").inline
        assert s.put("new", np.arange(2)).inline and _same_bits(s.get_array("new"), np.arange(2))
    db = sqlite3.connect(root / "index.sqlite", isolation_level=None)
    assert db.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone() == ("2",)
    db.execute("UPDATE meta SET value = '3' WHERE name = 'schema'")
    db.close()
    with pytest.raises(DTMError) as e:
        dtm.store.open(root)
    assert e.value.code is ErrorCode.STORE_CORRUPT and "schema 3" in str(e.value)


@pytest.mark.parametrize("inline_bytes", [-1, INLINE_BYTES + 1])
def test_inline_bytes_past_the_spec_bound_is_refused(tmp_path, inline_bytes):
    with pytest.raises(DTMError) as e:
        dtm.store.open(tmp_path / "s", inline_bytes=inline_bytes)
    assert e.value.code is ErrorCode.ATTRIBUTE_VALUE


def test_zarr_does_not_see_a_tensor_kept_inline_and_inline_bytes_0_keeps_none(tmp_path):
    zarr = pytest.importorskip("zarr", minversion="3")
    x = np.arange(4, dtype=np.float32)
    with dtm.store.open(tmp_path / "s") as s:
        assert s.put("k", x).inline
    with dtm.store.open(tmp_path / "s", inline_bytes=0) as s:
        info = s.put("k", x)
        assert not info.inline
        np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "s" / info.dir), mode="r")[...], x)


# --- bad input ------------------------------------------------------------------------------

def test_a_missing_key_is_e0804(st):
    with pytest.raises(KeyMissing) as e:
        st.get("nope")
    assert e.value.code is ErrorCode.STORE_KEY_MISSING and e.value.key == "nope"
    assert isinstance(e.value, KeyError)
    with pytest.raises(KeyMissing):
        st.info("nope")


def test_a_type_mismatch_is_e0402_or_e0403(st):
    st.put("w", np.zeros((2, 3), np.float32))
    with pytest.raises(StoreTypeError) as e:
        st.get("w", dtype="f16")
    assert e.value.code is ErrorCode.DTYPE_MISMATCH and e.value.key == "w"
    with pytest.raises(StoreTypeError) as e:
        st.get("w", dtype=np.float32, shape=(3, 2))
    assert e.value.code is ErrorCode.SHAPE_MISMATCH
    with pytest.raises(StoreTypeError) as e:
        st.put("c", np.zeros(2, np.complex64))
    assert e.value.code is ErrorCode.UNKNOWN_DTYPE


@pytest.mark.parametrize("key", [
    "", "/abs", "a/", "a//b", ".", "..", "a/../b", "../../etc/passwd", "a/./b", "@v1", "a/@x", "a\\b", "a\x00b",
    "tab\there", "x" * (MAX_KEY_BYTES + 1), "é" * (MAX_KEY_BYTES // 2 + 1), "a/" + "s" * 256, "\ud800",
    b"\xff\xfe", 42,
])
def test_invalid_keys_are_e1101_and_store_nothing(st, key):
    st.put("keep", np.ones(2))
    with pytest.raises(InvalidKey) as e:
        st.put(key, np.ones(2))
    assert e.value.code is ErrorCode.INVALID_STORE_KEY
    with pytest.raises(InvalidKey):
        st.get(key)
    assert st.keys() == ["keep"]


def test_the_longest_valid_key_works(st):
    key = "/".join(["k" * 254] * 4) + "/" + "k" * (MAX_KEY_BYTES - 4 * 255)
    assert len(key.encode()) == MAX_KEY_BYTES
    st.put(key, np.ones(1))
    assert st.keys() == [key]


def test_a_store_path_that_is_a_file_or_unwritable_is_e1104(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for path in (f, f / "below"):
        with pytest.raises(StoreIOError) as e:
            dtm.store.open(path)
        assert e.value.code is ErrorCode.STORE_IO_ERROR and str(f) in str(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_a_read_only_store_directory_is_e1104(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o500)
    with pytest.raises(StoreIOError):
        dtm.store.open(tmp_path / "ro")


# --- the spec says what the code does -----------------------------------------------------------

SPEC = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "spec" / "dtm-spec.md").read_text(encoding="utf-8")
SPEC_92 = SPEC[SPEC.index("### 9.2 Tensor store"):SPEC.index("### 9.3 Task graph")]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_the_spec_states_the_key_bounds():
    assert f"at most **{MAX_KEY_BYTES} bytes**" in SPEC_92
    assert f"a segment longer than\n  {MAX_SEGMENT_BYTES} UTF-8 bytes" in SPEC_92


def test_the_spec_states_the_inline_bound():
    assert f"is at most **{INLINE_BYTES} bytes** in its index row" in SPEC_92


def test_zarr_json_and_data_types_are_as_the_spec_tables_say(disk, tmp_path):
    members = re.findall(r"^\| `([a-z_]+)` \| ", SPEC_92[SPEC_92.index("| member |"):SPEC_92.index("| dtype | `data_type` |")], re.M)
    rows = re.findall(r"^\| (`[a-z0-9_]+`(?:, `[a-z0-9_]+`)*) \| (`[a-z0-9]+`(?:, `[a-z0-9]+`)*) \| ",
                      SPEC_92[SPEC_92.index("| dtype | `data_type` |"):], re.M)
    spec_types = {d: z for dts, zs in rows for d, z in zip(_ticked(dts), _ticked(zs), strict=True)}
    assert sorted(spec_types) == sorted(DTYPES)
    for d in DTYPES.values():
        x = quantize(np.ones((1, 32), np.float32), d) if d.is_quant else _random(d, (3,))
        info = disk.put_array(d.name, x, dtype=d.name)
        meta = json.loads((tmp_path / "s" / info.dir / "zarr.json").read_text())
        assert list(meta) == members
        assert meta["data_type"] == spec_types[d.name], d
        assert meta["attributes"]["dtm"] == {"format": 1, "dtype": d.name, "shape": list(info.shape),
                                             "checksum": info.checksum}


def test_the_index_is_the_sqlite_schema_the_spec_gives(disk, tmp_path):
    info = disk.put("layer0/w", np.zeros((2, 3), np.float32))
    with dtm.store.open(tmp_path / "s") as inlining:
        small = inlining.put("layer0/b", np.arange(3, dtype=np.int16))
    block = SPEC_92[SPEC_92.index("```text"):]
    spec_cols = re.search(r"keys\((.*?)\)\n", block, re.S).group(1)
    db = sqlite3.connect(tmp_path / "s" / "index.sqlite")
    assert [c[1] for c in db.execute("PRAGMA table_info(keys)")] == \
        re.findall(r"(\w+) (?:TEXT|INTEGER|REAL|BLOB)", spec_cols)
    assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert db.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone() == ("2",)
    rows = db.execute("SELECT * FROM keys ORDER BY key").fetchall()
    assert rows == [("layer0/b", "", "i16", "[3]", 6, small.checksum, 1, small.written, b"\0\0\1\0\2\0"),
                    ("layer0/w", info.dir, "f32", "[2, 3]", 24, info.checksum, 1, info.written, None)]
    assert info.dir.startswith("data/layer0/w/@") and re.fullmatch(r"[0-9a-f]{16}", info.dir.rsplit("@", 1)[1])
    db.close()


def _lose_index(root: pathlib.Path, how: str) -> None:
    """Delete the store's index, or write garbage over it, as a user's mistake or a bad disk does."""
    for suffix in ("", "-wal", "-shm"):
        (root / f"index.sqlite{suffix}").unlink(missing_ok=True)
    if how == "corrupted":
        (root / "index.sqlite").write_bytes(b"not a database" * 100)


@pytest.mark.parametrize("how", ["deleted", "corrupted"])
def test_a_lost_index_is_e1107_on_open_and_recover_rebuilds_it_from_the_versions(tmp_path, how):
    root = tmp_path / "s"
    big = np.arange(2048, dtype=np.float32)  # past INLINE_BYTES: a Zarr array
    with dtm.store.open(root) as s:
        s.put("a/big", big)
        s.put("a/big", big + 1)              # version 2: the one to come back
        s.put("q", _random(DTYPES["bf16"], (70, 40)))
        s.put("small", np.ones(3))           # inline: in the index alone
    _lose_index(root, how)
    with pytest.raises(DTMError) as e:
        dtm.store.open(root)
    assert e.value.code is ErrorCode.STORE_INDEX_LOST
    assert str(root / "index.sqlite") in str(e.value) and "dtm store" in str(e.value) and "recover" in str(e.value)
    report = dtm.store.recover(root)
    assert report.keys == 2 and report.inline_lost is None and report.skipped == []
    with dtm.store.open(root) as s:
        assert s.keys() == ["a/big", "q"] and _same_bits(s.get_array("a/big"), big + 1)
        assert _same_bits(s.get_array("q"), _random(DTYPES["bf16"], (70, 40))) and s.verify().ok
        assert "small" not in s
    assert dtm.store.recover(root).inline_lost == 0  # a readable index: its inline tensors counted


def test_a_store_of_inline_tensors_alone_whose_index_is_deleted_is_e1107_not_empty(tmp_path):
    with dtm.store.open(tmp_path / "s") as s:
        s.put("k", np.ones(2))
    _lose_index(tmp_path / "s", "deleted")
    with pytest.raises(DTMError, match="cannot be recovered") as e:
        dtm.store.open(tmp_path / "s")
    assert e.value.code is ErrorCode.STORE_INDEX_LOST
    assert dtm.store.recover(tmp_path / "s").keys == 0


@pytest.mark.parametrize("n", [3, 2048], ids=["inline", "zarr"])
def test_a_put_through_a_handle_opened_before_the_index_was_lost_fails_and_collect_refuses(tmp_path, n):
    root = tmp_path / "s"
    s = dtm.store.open(root)
    s.put("k", np.ones(2048))
    _lose_index(root, "deleted")
    with pytest.raises(DTMError) as e:
        s.put("j", np.ones(n))
    assert e.value.code is ErrorCode.STORE_INDEX_LOST and "deleted" in str(e.value)
    with pytest.raises(DTMError) as e:
        s.collect(older_than_s=0)            # every version would look like garbage
    assert e.value.code is ErrorCode.STORE_INDEX_LOST
    assert _version_dirs(root, "k") != [] and _version_dirs(root, "j") == []
    dtm.store.recover(root)
    with pytest.raises(DTMError, match="replaced"):
        s.put("j", np.ones(n))               # the old handle never writes to the old index
    s.close()
    with dtm.store.open(root) as s:
        assert s.keys() == ["k"]


def test_a_new_store_directory_opens_as_a_new_store(tmp_path):
    (tmp_path / "s" / "data").mkdir(parents=True)  # as open() leaves it before the index exists
    with dtm.store.open(tmp_path / "s") as s:
        assert s.keys() == []


@pytest.mark.parametrize("inline_bytes", [0, INLINE_BYTES])
def test_an_index_locked_past_the_timeout_is_e1104_and_loses_nothing(tmp_path, monkeypatch, inline_bytes):
    monkeypatch.setattr(dtm.store.index, "BUSY_TIMEOUT_MS", 50)
    with dtm.store.open(tmp_path / "s", inline_bytes=inline_bytes) as s:
        s.put("k", np.arange(3))
        other = sqlite3.connect(tmp_path / "s" / "index.sqlite", isolation_level=None)
        other.execute("BEGIN IMMEDIATE")                 # another process holds the write lock
        with pytest.raises(StoreIOError) as e:
            s.put("k", np.arange(4))
        assert e.value.key == "k" and "index.sqlite" in str(e.value)
        other.execute("ROLLBACK")
        other.close()
        assert _same_bits(s.get_array("k"), np.arange(3)) and s.info("k").version == 1
        assert _version_dirs(tmp_path / "s", "k") == _current_dir(s, "k")
        s.put("k", np.arange(4))


def _version_dirs(root: pathlib.Path, key: str) -> list[str]:
    """The version directories under `key` in the directory store at `root`."""
    d = root / "data" / key
    return sorted(n for n in os.listdir(d) if n.startswith("@")) if d.is_dir() else []


def _current_dir(s, key: str) -> list[str]:
    """The version directory of `key`'s tensor, as _version_dirs names it: none when inline."""
    info = s.info(key)
    return [] if info.inline else [info.dir.rsplit("/", 1)[1]]


def test_a_store_behind_an_fsspec_url_keeps_a_ref_per_key_as_the_spec_says():
    fsspec = pytest.importorskip("fsspec")
    name = uuid.uuid4().hex
    s = dtm.store.open(f"memory://{name}")
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    info, small = s.put("a/b", np.repeat(x, 200, axis=0)), s.put("a/c", x)  # a Zarr array, and a tensor kept inline
    s.set_quota(100_000, prefix="a/")
    fs = fsspec.filesystem("memory")                     # read the objects as another tool would
    ref = json.loads(fs.cat_file(f"/{name}/data/a/b/@ref"))
    members = re.findall(r"`(\w+)`", re.search(r"with the members (.*?) of the row above", SPEC_92, re.S).group(1))
    assert list(ref) == members
    assert ref == {"dir": info.dir, "dtype": "i32", "shape": [400, 3], "nbytes": 4800, "checksum": info.checksum,
                   "version": 1, "written": info.written, "data": None}
    assert json.loads(fs.cat_file(f"/{name}/data/a/c/@ref")) == {
        "dir": "", "dtype": "i32", "shape": [2, 3], "nbytes": 24, "checksum": small.checksum, "version": 1,
        "written": small.written, "data": base64.b64encode(x.astype("<i4").tobytes()).decode("ascii")}
    assert fs.find(f"/{name}/data/a/c") == [f"/{name}/data/a/c/@ref"]  # its ref alone
    assert json.loads(fs.cat_file(f"/{name}/quotas.json")) == {"a/": 100_000}
    assert json.loads(fs.cat_file(f"/{name}/{info.dir}/zarr.json"))["attributes"]["dtm"]["dtype"] == "i32"


def test_a_memory_store_writes_what_fsspec_itself_lists_and_reads():
    """memory:// writes fsspec's dict of files directly (its file API walked every parent
    of a path): fsspec's own find / cat_file / info see exactly the current version's files
    and the ref, after puts that replace, and nothing after a delete."""
    fsspec = pytest.importorskip("fsspec")
    name = uuid.uuid4().hex
    s = dtm.store.open(f"memory://{name}", chunk_bytes=64, inline_bytes=0)
    fs = fsspec.filesystem("memory")
    for x in (np.arange(40, dtype=np.float32).reshape(10, 4), np.arange(3, dtype=np.int64)):
        info = s.put("a/b", x)
        layout = s._layout(info)
        files = ["zarr.json", *(layout.chunk_key(i) for i in layout.chunks())]
        assert len(files) == 1 + (3 if x.ndim == 2 else 1)      # (64-byte chunks: 10 rows of 16 bytes in 3)
        assert sorted(fs.find(f"/{name}")) == sorted([f"/{name}/data/a/b/@ref", *(f"/{name}/{info.dir}/{f}" for f in files)])
        assert fs.info(f"/{name}/{info.dir}/zarr.json")["type"] == "file"
        assert _same_bits(s.get_array("a/b"), x)
    raw = fs.cat_file(f"/{name}/{info.dir}/c/0")               # a chunk as fsspec reads it: bytes, then CRC32C
    assert raw[:-4] == np.arange(3, dtype=np.int64).tobytes() and len(raw) == 3 * 8 + 4
    s.delete("a/b")
    assert fs.find(f"/{name}") == []


def test_a_replaced_version_is_removed_at_once_when_small_else_in_the_background(tmp_path, monkeypatch):
    """A put that replaces a small tensor removes the old version before it returns; one of
    REMOVE_LATER_BYTES or more goes to the reaper thread (unlinking large files is slow), and
    is gone once it drained. The key holds the new tensor either way."""
    with dtm.store.open(tmp_path / "s", inline_bytes=0) as s:
        later, remove_later = [], s._files.remove_later
        monkeypatch.setattr(s._files, "remove_later", lambda rel: (later.append(rel), remove_later(rel)))
        s.put("k", np.arange(10))
        old = s.info("k").dir
        s.put("k", np.arange(11))
        assert not os.path.exists(s._files.path(old)) and later == []
        monkeypatch.setattr(store_files, "REMOVE_LATER_BYTES", 11 * 8)  # the tensor just put is this large
        old = s.info("k").dir
        s.put("k", np.arange(12))
        assert later == [old]
        s._files.drain()
        assert not os.path.exists(s._files.path(old))
        assert _same_bits(s.get_array("k"), np.arange(12))


def test_a_replaced_version_is_removed_whole_by_its_files_or_by_what_is_there(tmp_path):
    """A small replaced version goes file by file, by the names its layout gives, with its
    nested chunk directories; known to the store that wrote it, or read from its zarr.json by
    another; one that holds a file its layout does not name is removed whole all the same."""
    with dtm.store.open(tmp_path / "s", chunk_bytes=64, inline_bytes=0) as s:
        s.put("k", np.ones((9, 5), np.float32))          # chunks c/0/0, c/1/0, c/2/0: nested directories
        old = s._files.path(s.info("k").dir)
        assert sorted(os.listdir(f"{old}/c")) == ["0", "1", "2"]
        s.put("k", np.zeros((9, 5), np.float32))
        assert not os.path.exists(old)
    with dtm.store.open(tmp_path / "s", inline_bytes=0) as other:  # the writer's layout is not known here
        old = other._files.path(other.info("k").dir)
        other.put("k", np.arange(3))
        assert not os.path.exists(old)
        old = other._files.path(other.info("k").dir)
        open(f"{old}/stray", "wb").close()
        other.put("k", np.arange(4))
        assert not os.path.exists(old)
        assert os.listdir(tmp_path / "s" / "data" / "k") == [other.info("k").dir.rsplit("/", 1)[1]]
        assert _same_bits(other.get_array("k"), np.arange(4))


def test_a_get_that_races_a_put_reads_the_new_version_not_an_error(st, monkeypatch):
    # (past INLINE_BYTES: the bytes of a tensor kept inline come with its row, no file to lose)
    st.put("k", np.arange(1024))
    stale = st.info("k")
    st.put("k", np.arange(1025))                        # removes the version `stale` names
    st._files.drain()                                   # (a large one on the reaper thread: wait for it)
    real, calls = st._index.get, []

    def first_stale(key):                               # as if the lookup came just before the put
        calls.append(key)
        return stale if len(calls) == 1 else real(key)

    monkeypatch.setattr(st._index, "get", first_stale)
    assert _same_bits(st.get_array("k"), np.arange(1025))
    calls.clear()
    st.delete("k")
    with pytest.raises(KeyMissing):
        st.get_array("k")


def test_collect_removes_old_unnamed_version_directories_only(st):
    st.put("a/k", np.arange(2048, dtype=np.float32))  # past INLINE_BYTES: a Zarr array
    st.put("b", np.ones(2))
    current = st.info("a/k").dir
    files = st._files
    for vdir in ("data/a/k/@00000000000000aa", "data/b/@00000000000000bb"):  # as a killed put leaves them
        files.write(f"{vdir}/c/0", [files.read_bytes(f"{current}/c/0")])
    assert st.collect(older_than_s=3600) == []          # too young: maybe a put in flight
    time.sleep(0.01)
    assert st.collect(older_than_s=0) == ["data/a/k/@00000000000000aa", "data/b/@00000000000000bb"]
    assert st.collect(older_than_s=0) == []
    assert _same_bits(st.get_array("a/k"), np.arange(2048, dtype=np.float32)) and st.verify().ok


def test_a_closed_store_says_so(tmp_path):
    s = dtm.store.open(tmp_path / "s")
    s.put("k", np.arange(3))
    s.close()
    for use in (lambda: s.get_array("k"), lambda: s.put("k", np.arange(2)), lambda: s.keys()):
        with pytest.raises(StoreIOError) as e:
            use()
        assert e.value.code is ErrorCode.STORE_IO_ERROR and "closed" in str(e.value)
    assert _same_bits(dtm.store.open(tmp_path / "s").get_array("k"), np.arange(3))


def test_replacing_a_key_behind_a_url_removes_its_old_objects_by_name_without_listing(monkeypatch):
    """A replaced version's objects go by the names its metadata gives: listing a prefix on
    fsspec's memory file system scans every object (a put into a store of 10,000 keys took
    43 ms that way)."""
    s = dtm.store.open("memory://replace-by-name", inline_bytes=0)
    for i in range(50):
        s.put(f"other/{i}", np.zeros(2, np.float32))
    s.put("k", np.zeros((4, 3), np.float32))
    fs = s._files.fs
    before = set(fs.store)
    monkeypatch.setattr(fs, "find", lambda *a, **k: pytest.fail("a put listed the store"))
    monkeypatch.setattr(fs, "ls", lambda *a, **k: pytest.fail("a put listed the store"))
    s.put("k", np.ones((4, 3), np.float32))
    s.delete("other/7")
    after = set(fs.store)
    assert len(after) == len(before) - 3  # k: one version's two objects for another's; other/7: all three gone
    np.testing.assert_array_equal(s.get_array("k"), np.ones((4, 3), np.float32))
    assert not [p for p in after if "/other/7/" in p]


def test_a_large_checksum_over_several_threads_is_the_crc32c_of_the_bytes():
    from crc32c import crc32c

    from dtm.protocol.crc import PARALLEL_BYTES, checksum, combine

    rng = np.random.default_rng(5)
    for n in (0, 7, PARALLEL_BYTES - 1, PARALLEL_BYTES + 12345, 3 * PARALLEL_BYTES + 1):
        a = rng.integers(0, 256, n, dtype=np.uint8)
        assert checksum(a) == crc32c(a), n
    x, y = rng.bytes(1000), rng.bytes(333)
    assert combine(crc32c(x), crc32c(y), len(y)) == crc32c(x + y)


def _open_and_close(path: str, barrier, results) -> None:
    barrier.wait(30)
    try:
        dtm.store.open(path).close()
        results.put("ok")
    except Exception as e:  # noqa: BLE001 - reported to the test
        results.put(repr(e))


def test_processes_opening_a_new_store_at_once_all_succeed(tmp_path):
    """Switching a new index to WAL takes a lock SQLite refuses at once instead of waiting
    for: 9 of 120 opens failed with "database is locked" (E1105) before the setup retried."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    for trial in range(10):
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_open_and_close, args=(str(tmp_path / f"s{trial}"), barrier, results))
                 for _ in range(4)]
        for p in procs:
            p.start()
        got = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        assert got == ["ok"] * 4, (trial, got)


_WRITER = """
import sys, numpy as np, dtm
s = dtm.store.open(sys.argv[1], chunk_bytes=1 << 20)
for i in range(1000):
    s.put("k", np.full(32 << 18, i, np.float32))  # 32 MiB in 32 chunk files
"""


def _kill_inside_a_put(root: pathlib.Path, known: set[str]) -> str:
    """Start a writer process, SIGKILL it once a version directory other than `known` has a
    chunk file (inside a put); that directory."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(root)])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            fresh = [d for d in _version_dirs(root, "k") if d not in known and (root / "data/k" / d / "c").is_dir()]
            if fresh and any((root / "data/k" / fresh[0] / "c").iterdir()):
                return fresh[0]
            assert proc.poll() is None, "the writer ended by itself"
            time.sleep(0.002)
        raise AssertionError("the writer wrote no chunk within 60 s")
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_puts_killed_by_sigkill_leave_garbage_du_counts_and_the_next_open_removes(tmp_path):
    root = tmp_path / "s"
    s = dtm.store.open(root)
    s.put("k", np.zeros(8, np.float32))
    leaked = {_kill_inside_a_put(root, set()) for _ in range(3)}
    leaked -= set(_current_dir(s, "k"))  # (a kill may land after a commit)
    assert leaked and leaked <= set(_version_dirs(root, "k"))
    assert s.du(garbage=True) > 0 and s.du() == s.info("k").nbytes
    with dtm.store.open(root) as fresh:      # no collect(): opening is enough
        assert not leaked & set(_version_dirs(root, "k")) and fresh.du(garbage=True) == 0
        assert _version_dirs(root, "k") == _current_dir(fresh, "k") and fresh.verify().ok
    s.close()


def test_garbage_collection_spares_a_version_a_live_writer_holds(tmp_path):
    root = tmp_path / "s"
    with dtm.store.open(root) as s:
        rel = "data/k/@00000000000000aa"
        s._files.make_dirs(rel, ["c/0"])
        with s._files.hold(rel):             # a put in flight, however old its files
            with dtm.store.open(root) as other:
                assert other.collect(older_than_s=0) == [] and (root / rel).is_dir()
                assert other.du(garbage=True) == 0
        assert s.collect(older_than_s=0) == [rel] and not (root / rel).exists()


def test_a_masked_array_is_refused_not_stored_without_its_mask(st):
    x = np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False])
    for put in (st.put, st.put_array, lambda k, v: st.put_many({k: v})):
        with pytest.raises(DTMError, match="mask") as e:
            put("m", x)
        assert e.value.code is ErrorCode.UNKNOWN_DTYPE and "m" not in st


def test_an_over_long_key_is_cut_in_its_error(st):
    with pytest.raises(InvalidKey) as e:
        st.put("x" * 10_000, np.ones(1))
    assert len(str(e.value)) < 300 and "10000" in str(e.value)


def test_put_many_commits_small_tensors_in_one_transaction_and_large_ones_each(st, monkeypatch):
    st.put("a", np.zeros(2))
    items = {"a": np.arange(3), "b/c": np.ones((2, 2), np.float16), "big": np.arange(2048.0)}
    infos = st.put_many(items)
    assert [i.key for i in infos] == list(items) and infos[0].version == 2
    for k, v in items.items():
        assert _same_bits(st.get_array(k), v)
    with pytest.raises(InvalidKey):          # every key checked before anything is written
        st.put_many([("z", np.ones(1)), ("bad//key", np.ones(1))])
    assert "z" not in st


def test_a_writer_registering_is_never_seen_dead(tmp_path, monkeypatch):
    """Another process that opens the store while this one registers its writer file must
    not count it dead (and collect the versions it is writing): the file is in `writers/`
    only once locked. The check runs at the worst moment, just before the lock is taken."""
    from dtm.store import files as files_mod

    writer, other = files_mod.LocalFiles(str(tmp_path)), files_mod.LocalFiles(str(tmp_path))
    seen: list[list[str]] = []
    real_flock = files_mod.fcntl.flock

    def flock_after_a_look(fd, op):
        if not seen:  # the writer's own lock: look first (the look's own flocks pass through)
            seen.append([])
            seen[0] = other.dead_writers()
        return real_flock(fd, op)

    monkeypatch.setattr(files_mod.fcntl, "flock", flock_after_a_look)
    writer._register_writer()
    monkeypatch.setattr(files_mod.fcntl, "flock", real_flock)
    try:
        assert seen and seen[0] == []
        assert other.dead_writers() == []                        # locked, so alive
        assert [n for n in os.listdir(tmp_path / "writers") if not n.startswith(".")]
    finally:
        writer.close()
