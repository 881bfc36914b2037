"""Distributed tensors in the store (spec 9.2.10) on meshes of local devices (L0): a put
writes each piece as its own chunk of one stored tensor, and a get with any mesh and
placements reads, for each rank, only the chunks its piece overlaps. Every piece is
compared with numpy slices cut by spec 2.7's chunking (ceil(D/n), the last ones short or
empty), not with the store's own geometry. Two real processes: test_l1_store_sharded.py."""

from __future__ import annotations

import json
import math
import sqlite3
import uuid

import ml_dtypes
import numpy as np
import pytest
from crc32c import crc32c

import dtm
from dtm import Partial, Replicate, Shard
from dtm.errors import DTMError, ErrorCode as E
from dtm.ir.dtypes import DTYPES
from dtm.ref.quant import quantize
from dtm.store import ChecksumError, KeyMissing, StoreIOError
from dtm.store.store import Store


@pytest.fixture(scope="module", autouse=True)
def four_devices():
    dtm.devices(4)


@pytest.fixture(params=["file", "memory"])
def st(request, tmp_path):
    url = str(tmp_path / "s") if request.param == "file" else f"memory://{uuid.uuid4().hex}"
    with dtm.store.open(url) as s:
        yield s


@pytest.fixture
def disk(tmp_path):
    """A directory store whose every tensor, small ones too, is a Zarr array."""
    with dtm.store.open(tmp_path / "s", inline_bytes=0) as s:
        yield s


MESHES = {"2": {"x": 2}, "4": {"x": 4}, "2x2": {"a": 2, "b": 2}}


def expected_pieces(x: np.ndarray, axes: dict[str, int], placements) -> list[np.ndarray]:
    """Each rank's piece of x, cut by hand: ranks row-major over the mesh, and along a dim
    sharded n ways chunk c is [c*k, min((c+1)*k, D)) with k = ceil(D/n)."""
    sizes, out = list(axes.values()), []
    for r in range(math.prod(sizes)):
        at, rest = [], r
        for n in reversed(sizes):
            at.insert(0, rest % n)
            rest //= n
        index = [slice(None)] * x.ndim
        for n, c, p in zip(sizes, at, placements):
            if p.kind == "shard":
                k = -(-x.shape[p.arg] // n)
                index[p.arg] = slice(min(c * k, x.shape[p.arg]), min((c + 1) * k, x.shape[p.arg]))
        out.append(x[tuple(index)])
    return out


def assert_pieces(t: dtm.Tensor, x: np.ndarray, axes: dict[str, int], placements) -> None:
    assert t.placements == tuple(placements) and dict(t.device_mesh.axes) == axes
    got = [s.numpy() for s in t.local_shards()]
    want = expected_pieces(x, axes, placements)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes()


# (put mesh, put placements, get mesh, get placements): other placements, other mesh shapes
CASES = [
    ("2", [Shard(0)], "2", [Shard(1)]),
    ("2", [Shard(1)], "4", [Shard(0)]),
    ("2", [Replicate()], "2x2", [Shard(0), Shard(1)]),
    ("2x2", [Shard(0), Shard(1)], "2", [Replicate()]),
    ("2x2", [Shard(1), Shard(0)], "2x2", [Shard(0), Replicate()]),
    ("2x2", [Replicate(), Shard(0)], "4", [Shard(1)]),
    ("4", [Shard(0)], "2x2", [Replicate(), Shard(0)]),
    ("4", [Shard(1)], "4", [Shard(1)]),
]


@pytest.mark.parametrize("put_mesh,put_pl,get_mesh,get_pl", CASES, ids=lambda v: str(v))
def test_put_with_one_layout_get_with_another(st, put_mesh, put_pl, get_mesh, get_pl):
    x = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)  # uneven over 2 and 4
    info = st.put("w", dtm.distribute(x, dtm.Mesh(MESHES[put_mesh]), put_pl))
    # one stored tensor like any other: its global type, the checksum of its bytes
    assert (info.dtype, info.shape, info.nbytes, info.version) == (dtm.float32, (5, 7), x.nbytes, 1)
    assert info.checksum == f"{crc32c(x.tobytes()):08x}"
    assert st.info("w") == info
    np.testing.assert_array_equal(st.get("w").numpy(), x)
    got = st.get("w", mesh=dtm.Mesh(MESHES[get_mesh]), placements=get_pl)
    assert_pieces(got, x, MESHES[get_mesh], get_pl)
    np.testing.assert_array_equal(got.full_tensor().numpy(), x)
    assert st.verify().ok


def test_bf16_round_trips_bit_for_bit(st):
    bits = np.random.default_rng(1).integers(0, 1 << 16, (6, 5), dtype=np.uint16)
    x = bits.view(ml_dtypes.bfloat16)
    m = dtm.Mesh(MESHES["2x2"])
    info = st.put("b", dtm.distribute(dtm.from_numpy(x), m, [Shard(1), Shard(0)]))
    assert info.dtype == dtm.bfloat16 and info.checksum == f"{crc32c(x.tobytes()):08x}"
    assert st.get_array("b").tobytes() == x.tobytes()
    assert_pieces(st.get("b", mesh=dtm.Mesh(MESHES["4"]), placements=[Shard(0)]), x, MESHES["4"], [Shard(0)])


def test_put_converts_to_a_given_dtype(st):
    x = np.arange(12, dtype=np.float32).reshape(4, 3) / 4
    info = st.put("c", dtm.distribute(x, dtm.Mesh(MESHES["2"]), [Shard(0)]), dtype="f16")
    assert info.dtype == dtm.float16
    np.testing.assert_array_equal(st.get_array("c"), x.astype(np.float16))


def test_same_checksum_and_data_as_a_whole_put(st):
    x = np.random.default_rng(2).integers(-9, 9, (9, 4, 3)).astype(np.int32)
    whole = st.put("whole", x)
    piecewise = st.put("pieces", dtm.distribute(x, dtm.Mesh(MESHES["2x2"]), [Shard(2), Shard(0)]))
    assert piecewise.checksum == whole.checksum and piecewise.nbytes == whole.nbytes
    np.testing.assert_array_equal(st.get_array("pieces"), st.get_array("whole"))


@pytest.mark.parametrize("shape,placements", [((), [Replicate()]), ((0, 3), [Shard(0)]), ((3, 1), [Shard(0)]),
                                              ((5, 2), [Shard(0)])], ids=str)
def test_scalars_empty_and_tiny_tensors(st, shape, placements):
    x = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    info = st.put("e", dtm.distribute(x, dtm.Mesh(MESHES["4"]), placements))
    assert info.shape == shape and info.checksum == f"{crc32c(x.tobytes()):08x}"
    np.testing.assert_array_equal(st.get_array("e"), x)
    assert_pieces(st.get("e", mesh=dtm.Mesh(MESHES["2"])), x, MESHES["2"], [Replicate()])


@pytest.mark.parametrize("shape,placements", [((5, 7), [Shard(1)]), ((), [Replicate()]), ((0, 3), [Shard(0)])],
                         ids=str)
def test_a_tensor_kept_inline_is_got_piece_by_piece(st, shape, placements):
    x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    assert st.put("small", x).inline
    assert_pieces(st.get("small", mesh=dtm.Mesh(MESHES["4"]), placements=placements), x, MESHES["4"], placements)


def test_a_damaged_tensor_kept_inline_is_e1102_on_a_sharded_get(tmp_path):
    with dtm.store.open(tmp_path / "s") as s:
        s.put("w", np.ones((4, 4), np.float32))
        db = sqlite3.connect(tmp_path / "s" / "index.sqlite", isolation_level=None)
        db.execute("UPDATE keys SET data = zeroblob(64) WHERE key = 'w'")
        db.close()
        with pytest.raises(ChecksumError) as e:
            s.get("w", mesh=dtm.Mesh(MESHES["2"]), placements=[Shard(0)])
        assert e.value.code is E.STORE_CHUNK_CORRUPT and e.value.chunk == "inline"


def test_each_piece_is_one_chunk_written_once(disk, tmp_path, monkeypatch):
    """The chunk grid follows the pieces: a short last piece is the padded edge chunk, an
    empty one has no chunk, and replicas are written once."""
    writes = []
    real = Store._write_chunk
    monkeypatch.setattr(Store, "_write_chunk", lambda self, rel, layout, i, block: writes.append(i) or
                        real(self, rel, layout, i, block))
    x = np.arange(5 * 6, dtype=np.float32).reshape(5, 6)
    info = disk.put("w", dtm.distribute(x, dtm.Mesh(MESHES["2x2"]), [Replicate(), Shard(0)]))
    assert sorted(writes) == [(0, 0), (1, 0)]  # 2 distinct pieces of 4 ranks
    meta = json.loads((tmp_path / "s" / info.dir / "zarr.json").read_text())
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [3, 6]
    writes.clear()
    info = disk.put("w", dtm.distribute(x, dtm.Mesh(MESHES["4"]), [Shard(0)]))  # 5 rows over 4: 2, 2, 1, 0
    assert sorted(writes) == [(0, 0), (1, 0), (2, 0)]
    chunk_files = sorted(p.relative_to(tmp_path / "s" / info.dir).as_posix()
                         for p in (tmp_path / "s" / info.dir / "c").rglob("*") if p.is_file())
    assert chunk_files == ["c/0/0", "c/1/0", "c/2/0"]
    assert (tmp_path / "s" / info.dir / "c" / "2" / "0").stat().st_size == 2 * 6 * 4 + 4  # padded to 2 rows


def test_zarr_reads_a_tensor_put_piece_by_piece(disk, tmp_path):
    zarr = pytest.importorskip("zarr", minversion="3")
    x = np.random.default_rng(3).standard_normal((7, 5)).astype(np.float32)
    info = disk.put("w", dtm.distribute(x, dtm.Mesh(MESHES["2x2"]), [Shard(1), Shard(0)]))
    z = zarr.open_array(str(tmp_path / "s" / info.dir), mode="r")
    assert z.chunks == (4, 3) and z.attrs["dtm"]["shape"] == [7, 5]
    np.testing.assert_array_equal(z[...], x)


def spy_reads(monkeypatch) -> list[list[tuple[int, ...]]]:
    """Per piece read (one list per rank, in rank order), the chunk ids read for it."""
    reads: list[list[tuple[int, ...]]] = []
    box, chunk = Store._read_box, Store._chunk

    def read_box(self, entry, layout, b):
        reads.append([])
        return box(self, entry, layout, b)

    def one_chunk(self, entry, layout, i):
        reads[-1].append(i)
        return chunk(self, entry, layout, i)

    monkeypatch.setattr(Store, "_read_box", read_box)
    monkeypatch.setattr(Store, "_chunk", one_chunk)
    return reads


def test_a_rank_reads_only_the_chunks_its_piece_overlaps(disk, monkeypatch):
    x = np.random.default_rng(4).standard_normal((6, 4)).astype(np.float32)
    disk.put("w", dtm.distribute(x, dtm.Mesh(MESHES["2x2"]), [Shard(0), Shard(1)]))  # chunks of 3x2
    reads = spy_reads(monkeypatch)
    got = disk.get("w", mesh=dtm.Mesh(MESHES["2"]), placements=[Shard(0)])  # rank r: rows 3r..3r+2
    assert reads == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    assert_pieces(got, x, MESHES["2"], [Shard(0)])
    reads.clear()
    got = disk.get("w", mesh=dtm.Mesh(MESHES["4"]), placements=[Shard(1)])  # 1 column each: one chunk column
    assert reads == [[(0, 0), (1, 0)], [(0, 0), (1, 0)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]]
    assert_pieces(got, x, MESHES["4"], [Shard(1)])


def test_a_tensor_put_whole_is_read_by_the_row_chunks_a_piece_needs(tmp_path, monkeypatch):
    x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    with dtm.store.open(tmp_path / "s", chunk_bytes=32, inline_bytes=0) as s:  # 2 rows a chunk: 4 chunks
        s.put("w", x)
        reads = spy_reads(monkeypatch)
        got = s.get("w", mesh=dtm.Mesh(MESHES["4"]), placements=[Shard(0)])
        assert reads == [[(0, 0)], [(1, 0)], [(2, 0)], [(3, 0)]]
        assert_pieces(got, x, MESHES["4"], [Shard(0)])


def test_a_damaged_chunk_is_e1102_on_a_sharded_get(disk, tmp_path):
    x = np.ones((4, 4), np.float32)
    info = disk.put("w", dtm.distribute(x, dtm.Mesh(MESHES["2"]), [Shard(0)]))
    chunk = tmp_path / "s" / info.dir / "c" / "1" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[0] ^= 1
    chunk.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError) as e:
        disk.get("w", mesh=dtm.Mesh(MESHES["2"]), placements=[Shard(0)])
    assert e.value.code is E.STORE_CHUNK_CORRUPT and "c/1/0" in e.value.message


def test_a_failed_piecewise_put_keeps_the_old_tensor(disk, tmp_path, monkeypatch):
    old = np.zeros((4, 2), np.float32)
    disk.put("w", old)
    real, calls = Store._write_chunk, []

    def failing(self, rel, layout, i, block):
        calls.append(i)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(self, rel, layout, i, block)

    monkeypatch.setattr(Store, "_write_chunk", failing)
    with pytest.raises(StoreIOError) as e:
        disk.put("w", dtm.distribute(np.ones((4, 2), np.float32), dtm.Mesh(MESHES["2"]), [Shard(0)]))
    assert e.value.code is E.STORE_IO_ERROR and e.value.key == "w"
    np.testing.assert_array_equal(disk.get_array("w"), old)
    assert [p.name for p in (tmp_path / "s" / "data" / "w").iterdir()] == [disk.info("w").dir.rsplit("/", 1)[1]]


# --- bad input ------------------------------------------------------------------------------

def test_a_partial_tensor_is_refused_before_anything_is_written(disk, tmp_path):
    disk.put("w", np.zeros(4, np.float32))
    x = dtm.distribute(np.ones(4, np.float32), dtm.Mesh(MESHES["2"]), [Partial("sum")])
    with pytest.raises(DTMError) as e:
        disk.put("w", x)
    assert e.value.code is E.INVALID_PLACEMENT and "reduce it first" in e.value.message
    np.testing.assert_array_equal(disk.get_array("w"), np.zeros(4, np.float32))
    assert len(list((tmp_path / "s" / "data" / "w").iterdir())) == 1
    with pytest.raises(DTMError) as e:
        disk.get("w", mesh=dtm.Mesh(MESHES["2"]), placements=[Partial("sum")])
    assert e.value.code is E.INVALID_PLACEMENT


@pytest.mark.parametrize("mesh,placements,code", [
    ("2x2", [Shard(0)], E.PLACEMENT_COUNT),             # one placement for a 2-axis mesh
    ("2", [Shard(0), Shard(1)], E.PLACEMENT_COUNT),     # two for a 1-axis mesh
    ("2", [Shard(2)], E.SHARD_DIM_OUT_OF_RANGE),        # the tensor has dims 0 and 1
    ("2x2", [Shard(1), Shard(1)], E.DIM_SHARDED_TWICE),
    ("2", {"y": Shard(0)}, E.UNKNOWN_MESH_AXIS),
    ("2", ["shard(0)"], E.INVALID_PLACEMENT),
    (None, [Shard(0)], E.INVALID_MESH),                 # placements without a mesh
], ids=str)
def test_bad_meshes_and_placements_are_refused_with_their_code(disk, mesh, placements, code):
    disk.put("w", np.zeros((4, 2), np.float32))
    with pytest.raises(DTMError) as e:
        disk.get("w", mesh=dtm.Mesh(MESHES[mesh]) if mesh else None, placements=placements)
    assert e.value.code is code


def test_type_and_key_errors_come_first(disk):
    m = dtm.Mesh(MESHES["2"])
    with pytest.raises(KeyMissing):
        disk.get("nothing", mesh=m, placements=[Shard(0)])
    disk.put("w", np.zeros((4, 2), np.float32))
    with pytest.raises(DTMError) as e:
        disk.get("w", dtype="f16", mesh=m, placements=[Shard(0)])
    assert e.value.code is E.DTYPE_MISMATCH
    with pytest.raises(DTMError) as e:
        disk.get("w", shape=(2, 4), mesh=m, placements=[Shard(0)])
    assert e.value.code is E.SHAPE_MISMATCH
    disk.put_array("q", quantize(np.ones((2, 32), np.float32), DTYPES["q8_0"]), dtype="q8_0")
    with pytest.raises(DTMError) as e:
        disk.get("q", mesh=m, placements=[Shard(0)])
    assert e.value.code is E.QUANTIZED_MISUSE
    with pytest.raises(DTMError) as e:
        disk.put("../w", dtm.distribute(np.zeros(2, np.float32), m, [Shard(0)]))
    assert e.value.code is E.INVALID_STORE_KEY


# --- the pieces of the format ----------------------------------------------------------------

def test_the_checksum_parts_of_any_pieces_combine_to_the_crc32c_of_the_whole():
    from dtm.store import crc

    rng = np.random.default_rng(5)
    for _ in range(100):
        shape = tuple(int(n) for n in rng.integers(1, 7, rng.integers(1, 4)))
        x = rng.integers(0, 1 << 16, shape).astype(np.uint16)
        cuts = [sorted({0, n, *map(int, rng.integers(0, n + 1, 2))}) for n in shape]
        parts = []
        for at in np.ndindex(*(len(c) - 1 for c in cuts)):
            box = tuple((c[i], c[i + 1]) for c, i in zip(cuts, at))
            parts.append(crc.box_crc(x[tuple(slice(a, b) for a, b in box)], box, shape))
        assert crc.tensor_crc(parts, x.nbytes) == crc32c(x.tobytes()), (shape, cuts)
    assert crc.zeros(12345) == crc32c(bytes(12345))


@pytest.mark.parametrize("chunk_shape", [[0, 2], [5, 2], [2], [2, 2, 1], [2.0, 2]], ids=str)
def test_a_chunk_grid_out_of_bounds_is_e1105(disk, tmp_path, chunk_shape):
    info = disk.put("w", dtm.distribute(np.ones((4, 2), np.float32), dtm.Mesh(MESHES["2"]), [Shard(0)]))
    path = tmp_path / "s" / info.dir / "zarr.json"
    meta = json.loads(path.read_text())
    meta["chunk_grid"]["configuration"]["chunk_shape"] = chunk_shape
    path.write_text(json.dumps(meta))
    with pytest.raises(DTMError) as e:
        disk.get_array("w")
    assert e.value.code is E.STORE_CORRUPT
