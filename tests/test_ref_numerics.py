"""The numerical kernels of the reference: Philox4x32-10 against its published known-answer
vectors and the `random` bit recipes, erf against torch and math.erf in f64, and the
quantized block types against a line-by-line port of GGML's reference quantizers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dtm.ir import Builder, parse
from dtm.ir.dtypes import DTYPES
from dtm.ref import dequantize, quantize, run
from dtm.ref.mathfn import erf
from dtm.ref.philox import philox4x32

rng = np.random.default_rng(7)


# --- Philox4x32-10 -------------------------------------------------------------------------

# Random123's kat_vectors for philox4x32_10: (counter, key, expected output).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    out = philox4x32(tuple(np.array([c], np.uint64) for c in counter), key)
    assert tuple(int(w[0]) for w in out) == expected


def test_philox_is_vectorised_per_counter():
    counters = [np.array([c[i] for c, _, _ in KAT[:1]] * 3, np.uint64) for i in range(4)]
    out = philox4x32(tuple(counters), (0, 0))
    assert all(int(out[i][j]) == KAT[0][2][i] for i in range(4) for j in range(3))


def random_module(dist: str, type_: str) -> object:
    return parse(f"""dtm 1.0
func @f(%key: u32[2]) -> ({type_}) {{
  %r = random %key {{distribution = "{dist}"}} : {type_}
  return %r
}}
""")


def draw(dist: str, type_: str, key=(0, 0)) -> np.ndarray:
    return run(random_module(dist, type_), "f", [np.array(key, np.uint32)])[0]


def test_random_bit_recipes():
    k = (0xA4093822, 0x299F31D0)
    n = 6
    words = philox4x32((np.arange(n, dtype=np.uint64), np.zeros(n, np.uint64), np.zeros(n, np.uint64),
                        np.zeros(n, np.uint64)), k)
    x0, x1 = (w.astype(np.uint64) for w in words[:2])
    np.testing.assert_array_equal(draw("uniform", "f32[2, 3]", k).reshape(-1),
                                  ((x0 >> np.uint64(8)).astype(np.float64) * 2.0**-24).astype(np.float32))
    bits = ((x0 << np.uint64(21)) ^ (x1 >> np.uint64(11))) & np.uint64(2**53 - 1)
    np.testing.assert_array_equal(draw("uniform", "f64[6]", k), bits.astype(np.float64) * 2.0**-53)
    u1 = ((x0 >> np.uint64(8)) + np.uint64(1)).astype(np.float64) * 2.0**-24
    u2 = (x1 >> np.uint64(8)).astype(np.float64) * 2.0**-24
    z = np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)
    np.testing.assert_array_equal(draw("normal", "f64[6]", k), z)
    bf16 = draw("normal", "bf16[3, 2]", k)
    np.testing.assert_array_equal(bf16.reshape(-1), z.astype(bf16.dtype))


def test_random_counter_is_the_row_major_index():
    a = draw("uniform", "f32[20]", (1, 2))
    np.testing.assert_array_equal(draw("uniform", "f32[4, 5]", (1, 2)).reshape(-1), a)
    np.testing.assert_array_equal(draw("uniform", "f32[10]", (1, 2)), a[:10])
    assert not np.array_equal(draw("uniform", "f32[20]", (2, 1)), a)
    assert draw("uniform", "f32[0, 3]").shape == (0, 3)


def test_random_distributions():
    u = draw("uniform", "f32[200000]", (3, 4))
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    z = draw("normal", "f32[200000]", (3, 4))
    assert np.isfinite(z).all() and abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    from dtm.ir.dtypes import numpy_dtype

    for t in ("f16", "bf16", "f64", "f8e4m3"):
        u = draw("uniform", f"{t}[64]")
        assert u.dtype == numpy_dtype(DTYPES[t]) and (u.astype(np.float64) >= 0).all()


# --- erf -----------------------------------------------------------------------------------

def test_erf_f64_against_torch_and_libm():
    torch = pytest.importorskip("torch")
    x = np.concatenate([rng.standard_normal(20000) * 3, rng.uniform(-7, 7, 20000), np.geomspace(1e-300, 30, 2000),
                        -np.geomspace(1e-300, 30, 2000), [0.0, -0.0, 0.84375, 1.25, 1 / 0.35, 6.0, -6.0, 2.0**-28]])
    ours = erf(x)
    ref = torch.erf(torch.from_numpy(x)).numpy()
    libm = np.array([math.erf(v) for v in x])
    ulps = np.abs(ours - libm) / np.spacing(np.abs(libm))
    assert ulps.max() <= 1.0
    np.testing.assert_allclose(ours, ref, rtol=3e-16, atol=0)
    special = erf(np.array([np.inf, -np.inf, np.nan, -0.0]))
    assert special[0] == 1 and special[1] == -1 and np.isnan(special[2]) and math.copysign(1, special[3]) == -1


# --- quantized block types -----------------------------------------------------------------

def ggml_q8_0(x: np.ndarray) -> bytes:
    """quantize_row_q8_0_ref, statement by statement, in f32."""
    out = bytearray()
    for blk in x.astype(np.float32).reshape(-1, 32):
        amax = np.float32(0)
        for v in blk:
            amax = max(amax, np.float32(abs(v)))
        d = np.float32(amax / np.float32(127))
        inv = np.float32(np.float32(1) / d) if d else np.float32(0)
        out += np.float16(d).astype("<f2").tobytes()
        for v in blk:
            x0 = float(np.float32(v * inv))
            out += int(math.copysign(math.floor(abs(x0) + 0.5), x0)).to_bytes(1, "little", signed=True)  # roundf
    return bytes(out)


def ggml_q4_0(x: np.ndarray) -> bytes:
    """quantize_row_q4_0_ref, statement by statement, in f32."""
    out = bytearray()
    for blk in x.astype(np.float32).reshape(-1, 32):
        amax, mx = np.float32(0), np.float32(0)
        for v in blk:
            if amax < abs(v):
                amax, mx = np.float32(abs(v)), v
        d = np.float32(mx / np.float32(-8))
        inv = np.float32(np.float32(1) / d) if d else np.float32(0)
        out += np.float16(d).astype("<f2").tobytes()
        for j in range(16):
            x0, x1 = np.float32(blk[j] * inv), np.float32(blk[j + 16] * inv)
            xi0 = min(15, int(np.float32(x0 + np.float32(8.5))))  # (int8_t) truncates
            xi1 = min(15, int(np.float32(x1 + np.float32(8.5))))
            out.append(xi0 | (xi1 << 4))
    return bytes(out)


def quant_data() -> np.ndarray:
    x = rng.standard_normal((6, 64)).astype(np.float32)
    x[1, :32] = 0                                     # an all-zero block: scale 0
    x[2, :32] = np.round(x[2, :32] * 4) / 4           # many exact halves after scaling
    x[3, 5] = -9.0                                    # a negative extreme: q4_0 keeps its sign
    x[4, 32:] = np.linspace(-1, 1, 32)
    x[5, :32] = 1.0                                   # ties in |x|: the first one sets q4_0's scale
    x[5, 7] = -1.0
    return x


@pytest.mark.parametrize("name,port,bytes_per_block", [("q8_0", ggml_q8_0, 34), ("q4_0", ggml_q4_0, 18)])
def test_quantize_matches_ggml_reference(name, port, bytes_per_block):
    x = quant_data()
    q = quantize(x, DTYPES[name])
    assert q.dtype == np.uint8 and q.shape == (6, 2 * bytes_per_block)
    for row in range(6):
        assert q[row].tobytes() == port(x[row]), f"row {row}"


def test_quant_layout_by_hand():
    x = np.arange(32, dtype=np.float32) - 8  # -8 .. 23
    q8 = quantize(x[None], DTYPES["q8_0"])[0]
    d = np.float32(23) / np.float32(127)
    assert q8[:2].view("<f2")[0] == np.float16(d)
    assert q8[2:].view(np.int8).tolist() == [int(math.copysign(math.floor(abs(v / d) + 0.5), v)) for v in x.tolist()]
    q4 = quantize(x[None], DTYPES["q4_0"])[0]
    assert q4[:2].view("<f2")[0] == np.float16(23 / -8)
    lo, hi = q4[2:] & 0x0F, q4[2:] >> 4  # element j in the low nibble of byte j, j + 16 in the high one
    deq = dequantize(q4[None], DTYPES["q4_0"], np.float32)[0]
    np.testing.assert_array_equal(deq[:16], np.float32(np.float16(23 / -8)) * (lo.astype(np.float32) - 8))
    np.testing.assert_array_equal(deq[16:], np.float32(np.float16(23 / -8)) * (hi.astype(np.float32) - 8))


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
@pytest.mark.parametrize("src", ["f32", "f16", "bf16", "f64"])
def test_cast_round_trip_through_the_interpreter(name, src):
    from dtm.ir.dtypes import numpy_dtype

    b = Builder()
    f = b.func("f")
    x = f.param(f"{src}[2, 3, 64]")
    q = f.cast(x, to=name)
    f.ret(q, f.cast(q, to=src), f.cast(q, to="f32"))
    xs = rng.standard_normal((2, 3, 64)).astype(numpy_dtype(DTYPES[src]))
    qs, back, back32 = run(b.build(), "f", [xs])
    block = 34 if name == "q8_0" else 18
    assert qs.shape == (2, 3, 2 * block) and back.dtype == xs.dtype and back.shape == xs.shape
    np.testing.assert_array_equal(qs, quantize(xs.astype(np.float32), DTYPES[name]))
    np.testing.assert_array_equal(back32, dequantize(qs, DTYPES[name], np.float32))
    amax = np.abs(xs.astype(np.float32).reshape(2, 3, 2, 32)).max(-1, keepdims=True)
    err = np.abs(back32 - xs.astype(np.float32)).reshape(2, 3, 2, 32)
    assert (err <= amax * (0.5 / 127 + 1e-3 if name == "q8_0" else 1 / 8 + 1e-3)).all()


def test_quantized_param_and_store():
    m = parse("""dtm 1.0
func @f(%w: q4_0[N, 32], %x: f32[N, 32]) -> (f32[N, 32]) {
  %d = cast %w {to = f32} : f32[N, 32]
  %y = add %d, %x : f32[N, 32]
  store_put %w {key = "w"}
  return %y
}
""")
    w = quantize(rng.standard_normal((3, 32)).astype(np.float32), DTYPES["q4_0"])
    x = np.ones((3, 32), np.float32)
    from dtm.ref import RefContext
    from test_store_programs import fresh

    ctx = RefContext(store=fresh())
    (y,) = run(m, "f", [w, x], ctx)
    np.testing.assert_array_equal(y, dequantize(w, DTYPES["q4_0"], np.float32) + 1)
    np.testing.assert_array_equal(ctx.store.get_array("w", dtype="q4_0", shape=(3, 32)), w)  # stored as q4_0
