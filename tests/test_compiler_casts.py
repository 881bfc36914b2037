"""`cast` to and from every narrow dtype (f16, bf16, f8e4m3, f8e5m2, q8_0, q4_0) is compiled
(no fallback step in the plan) and gives the reference's bits: every 8- and 16-bit pattern of
the narrow floats, random f32 and f64 bit patterns, the midpoints between neighbours of each
narrow float (ties) and their f32/f64 neighbours, NaN payloads, infinities, subnormals,
overflow, integer edges, and quantized blocks of random bytes and of chosen edge blocks."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from dtm.backends.cpu.passes import compile_func
from dtm.ir import Builder
from dtm.ir.dtypes import DTYPES
from dtm.ir.types import TensorType
from dtm.ref import run as ref_run
from dtm.ref import quant as refquant
from dtm.runtime.backend import get_backend

CPU = get_backend("cpu")
FLOATS8_16 = ("f16", "bf16", "f8e4m3", "f8e5m2")
BLOCKS = ("q8_0", "q4_0")
PLAIN = ("bool", "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64", "f16", "bf16", "f32", "f64", "f8e4m3",
         "f8e5m2")
NP = {"f16": np.float16, "bf16": ml_dtypes.bfloat16, "f8e4m3": ml_dtypes.float8_e4m3fn, "f8e5m2": ml_dtypes.float8_e5m2}
BITS = {"f16": np.uint16, "bf16": np.uint16, "f8e4m3": np.uint8, "f8e5m2": np.uint8}
rng = np.random.default_rng(19)


def _targets(src: str) -> list[str]:
    """Every dtype a cast from `src` may go to, when src or the target is narrow."""
    if src in BLOCKS:
        return [d for d in PLAIN if DTYPES[d].is_float]
    out = [d for d in PLAIN if d != src and (src in FLOATS8_16 or d in FLOATS8_16)]
    if DTYPES[src].is_float:
        out += list(BLOCKS)
    return out


def _all_narrow_values() -> np.ndarray:
    """Every finite value of every narrow float, as f64, with the midpoints between
    neighbours (the ties) and the largest finite values' midpoints to the next step."""
    out = []
    for name, dt in NP.items():
        b = np.arange(1 << (8 * np.dtype(BITS[name]).itemsize), dtype=np.uint64).astype(BITS[name])
        v = np.unique(b.view(dt).astype(np.float64))
        v = v[np.isfinite(v)]
        out += [v, (v[1:] + v[:-1]) / 2, [v[-1] * 1.0625, v[-1] * 1.03125, v[-1] * 1.1]]
    v = np.concatenate(out)
    return np.concatenate([v, -v])


def _float_inputs(dtype: str) -> np.ndarray:
    """f32 or f64 test values: the narrow grid and its ties with their nearest neighbours in
    `dtype`, random bit patterns, NaN payloads, infinities, subnormals."""
    t = np.float32 if dtype == "f32" else np.float64
    grid = _all_narrow_values().astype(t)
    up, down = np.nextafter(grid, t(np.inf)), np.nextafter(grid, t(-np.inf))
    ib = np.uint32 if dtype == "f32" else np.uint64
    rand = rng.integers(0, np.iinfo(ib).max, 20000, dtype=ib, endpoint=True).view(t)
    if dtype == "f32":
        nans = np.array([0x7fc00000, 0xffc00000, 0x7f800001, 0x7fa00000, 0x7fffffff, 0xff800010], np.uint32)
    else:
        nans = np.array([0x7ff8000000000000, 0xfff8000000000000, 0x7ff0000000000001, 0x7ff4000000000000,
                         0x7ff0040000000000, 0xfff0000000001000], np.uint64)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 1e-310, 3e38, -3e38, 1e300, 70000, -65520,
                        65504, 65519.99, 464, 465, -448.5, 61440, 57344, 3.4e38], np.float64).astype(t)
    return np.concatenate([grid, up, down, rand, nans.view(t), special])


def _int_inputs(dtype: str) -> np.ndarray:
    info = np.iinfo(np.dtype(dtype.replace("i", "int").replace("uint", "uint") if dtype[0] == "i" else
                             dtype.replace("u", "uint")))
    edges = [0, 1, -1, 2, 3, 17, 19, 255, 448, 449, 464, 465, 480, 2049, 2051, 57344, 61439, 61440, 65504, 65519,
             65520, 2 ** 24 + 2 ** 16 + 1, 2 ** 24 + 2 ** 16, 2 ** 53 + 1, 2 ** 60 + 2 ** 52 + 1, 2 ** 60 + 2 ** 52,
             2 ** 63 + 2 ** 55 + 1, info.min, info.max, info.min + 1, info.max - 1]
    edges = [e for e in edges if info.min <= e <= info.max]
    rand = rng.integers(info.min, info.max, 3000, dtype=info.dtype, endpoint=True)
    small = rng.integers(max(info.min, -70000), min(info.max, 70000), 3000, dtype=info.dtype, endpoint=True)
    return np.concatenate([np.array([int(e) for e in edges], dtype=info.dtype), rand, small])


def _edge_blocks() -> np.ndarray:
    """f32 blocks that exercise the quantizers: ties at .5 of the scale, the first of equal
    largest |x| (either sign), zeros, NaN and infinities, subnormals, scales that round to
    f16 subnormals or overflow it."""
    blocks = [np.zeros(32), np.full(32, -0.0), np.arange(32) - 15.5, -(np.arange(32) - 16.0),
              np.r_[8.0, -8.0, np.arange(30) * 0.25], np.r_[-8.0, 8.0, np.arange(30) * 0.25],
              np.r_[127.0, (np.arange(31) - 15) + 0.5], np.r_[-7.0, np.arange(31) * 0.5 - 7.5],
              np.r_[np.nan, np.ones(31)], np.r_[np.ones(31), np.inf], np.r_[-np.inf, np.ones(31)],
              np.full(32, 1e-40), np.r_[1e-42, np.zeros(31)], np.r_[1e-6, np.linspace(-1e-6, 1e-6, 31)],
              np.r_[3e38, np.linspace(-1e38, 1e38, 31)], np.r_[65504 * 127, np.ones(31)],
              np.r_[65504 * 8 * 1.01, np.ones(31)], np.r_[1e-9, -1e-9, np.zeros(30)]]
    return np.concatenate([np.asarray(b, np.float64) for b in blocks])


def _inputs(src: str) -> np.ndarray:
    """A 2-d array [rows, 32 * k] of source values (block storage for q8_0 / q4_0)."""
    if src in FLOATS8_16:
        n = 1 << (8 * np.dtype(BITS[src]).itemsize)
        x = np.arange(n, dtype=np.uint64).astype(BITS[src]).view(NP[src])
    elif src in BLOCKS:
        q = refquant.quantize(np.concatenate([_edge_blocks(), rng.standard_normal(32 * 64)]).reshape(-1, 32)
                              .astype(np.float32), DTYPES[src])
        raw = rng.integers(0, 256, (512, q.shape[1]), dtype=np.uint8)  # every scale and value pattern
        return np.concatenate([q, raw])
    elif src in ("f32", "f64"):
        x = _float_inputs(src)
        if src == "f32":  # quantizing: the edge blocks in the first rows
            x = np.concatenate([_edge_blocks().astype(np.float32), x])
        else:
            x = np.concatenate([_edge_blocks(), x])
    elif src == "bool":
        x = np.array([True, False] * 16)
    else:
        x = _int_inputs(src)
    pad = (-x.size) % 32
    x = np.concatenate([x, x[:pad] if pad <= x.size else np.resize(x, pad)])
    return x.reshape(-1, 32)


def _module(src: str, shape: tuple, targets: list[str]):
    b = Builder()
    f = b.func("f")
    p = f.param(TensorType(DTYPES[src], shape))
    outs = [f.op("cast", p, to=DTYPES[d], type=TensorType(DTYPES[d], shape)) for d in targets]
    f.ret(*outs)
    return b.build()


SOURCES = [d for d in PLAIN + BLOCKS if _targets(d)]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN and overflow inputs


@pytest.mark.parametrize("src", SOURCES)
def test_casts_to_and_from_narrow_dtypes_are_compiled_and_bit_exact(src):
    targets = _targets(src)
    x = _inputs(src)
    shape = (x.shape[0], x.shape[1] if src not in BLOCKS else x.shape[1] // DTYPES[src].itemsize * 32)
    m = _module(src, shape, targets)
    prog = compile_func(m, "f")
    assert not prog.fallbacks, [s.op.name for s in prog.fallbacks]
    want = ref_run(m, "f", [x.copy()])
    got = CPU.run(m, "f", [x.copy()])
    for d, w, g in zip(targets, want, got):
        assert w.dtype == g.dtype and w.shape == g.shape, (src, d)
        wb, gb = w.view(np.uint8).reshape(w.shape[0], -1), g.view(np.uint8).reshape(g.shape[0], -1)
        bad = np.nonzero((wb != gb).any(-1))[0]
        assert not bad.size, (src, d, bad[:4], x[bad[:2]], w[bad[:2]], g[bad[:2]])


def test_quantized_casts_of_other_floats_go_through_f32():
    """bf16 -> q4_0 and q8_0 -> f16 compile as two casts through f32 (decompose), no fallback."""
    b = Builder()
    f = b.func("f")
    p = f.param(TensorType(DTYPES["bf16"], (2, 64)))
    q = f.op("cast", p, to=DTYPES["q4_0"], type=TensorType(DTYPES["q4_0"], (2, 64)))
    h = f.op("cast", q, to=DTYPES["f16"], type=TensorType(DTYPES["f16"], (2, 64)))
    f.ret(q, h)
    m = b.build()
    prog = compile_func(m, "f")
    assert not prog.fallbacks and len(prog.kernels) >= 2
    x = rng.standard_normal((2, 64)).astype(ml_dtypes.bfloat16)
    for w, g in zip(ref_run(m, "f", [x.copy()]), CPU.run(m, "f", [x.copy()])):
        assert np.array_equal(w.view(np.uint8), g.view(np.uint8))
