"""C for `cast` to and from the narrow dtypes (spec 2.1, 2.2; cast in spec 4): the static
helpers a kernel's unit holds when it converts (render_c.py emits them once per unit).

Narrow floats (f16, bf16, f8e4m3, f8e5m2) live in memory as their bits (uint16_t, uint8_t)
and only `cast` reads or writes them. The conversions give the reference's bits (numpy for
f16, ml_dtypes for bf16 and the f8 types), which tests/test_compiler_casts.py checks on
every 8- and 16-bit pattern and on random and edge f32, f64 and integer values:

  - to a narrow float: the exact value rounded once to the nearest representable, ties to
    even (from f64 and from 64-bit integers directly, never through f32); a value beyond the
    finite range after rounding becomes an infinity of its sign, or NaN with its sign for
    f8e4m3, which has no infinities (an infinity too). Zero and underflow keep the sign.
  - NaN: f32/f64 -> f16 keeps the payload's top bits as numpy does (a payload that would
    vanish becomes 1, so the result stays NaN, never quieted); every other conversion to or
    from bf16 and the f8 types gives the destination's quiet NaN with the sign, except bf16 ->
    f32 (the bits, shifted) and bf16 -> f64 (those f32 bits widened by the hardware); f16 ->
    f32/f64 shifts the payload in (not quieted), as numpy.
  - from a narrow float: to f32/f64 exactly; to an integer as the f64 value does (truncate,
    saturate, NaN -> 0); to bool, value != 0 (NaN -> true).

Block types (q8_0, q4_0): `dtm_quantize_*` / `dtm_dequantize_*` over whole blocks, bit for bit
dtm.ref.quant (GGML's reference quantizer, the scale's f16 by the f32 -> f16 rule above). The
kernel units compile with -ffp-contract=off, which these rely on (x * id + 8.5 rounds twice).
"""

from __future__ import annotations

NARROW_FLOATS = ("f16", "bf16", "f8e4m3", "f8e5m2")

# (mantissa bits, exponent bits, finite-only (fn), largest finite value as a C literal)
FORMATS = {"f16": (10, 5, 0, "65504.0"), "bf16": (7, 8, 0, "0x1.fep127"),
           "f8e4m3": (3, 4, 1, "448.0"), "f8e5m2": (2, 5, 0, "57344.0")}
BITS_T = {"f16": "uint16_t", "bf16": "uint16_t", "f8e4m3": "uint8_t", "f8e5m2": "uint8_t"}

CORE = r"""/* narrow floats as bits (c_convert.py) */
static inline uint64_t dtm_bits_f64(double x) { uint64_t b; memcpy(&b, &x, 8); return b; }
static inline uint32_t dtm_bits_f32(float x) { uint32_t b; memcpy(&b, &x, 4); return b; }
static inline double dtm_f64_bits(uint64_t b) { double x; memcpy(&x, &b, 8); return x; }
static inline float dtm_f32_bits(uint32_t b) { float x; memcpy(&x, &b, 4); return x; }
/* the value of bits b of a format (exact); NaN: the quiet NaN with b's sign */
static inline double dtm_nf_decode(uint32_t b, int mb, int eb, int fn) {
  int bias = (1 << (eb - 1)) - 1;
  uint32_t e = (b >> mb) & ((1u << eb) - 1), m = b & ((1u << mb) - 1);
  double s = (b >> (mb + eb)) & 1 ? -1.0 : 1.0;
  if (fn ? (e == (1u << eb) - 1 && m == (1u << mb) - 1) : e == (1u << eb) - 1 && m) return copysign(NAN, s);
  if (!fn && e == (1u << eb) - 1) return s * INFINITY;
  if (e == 0) return s * ldexp((double)m, 1 - bias - mb);
  return s * ldexp((double)(m | (1u << mb)), (int)e - bias - mb);
}
/* x (not NaN) rounded to the nearest of the format, ties to even; overflow: inf, or NaN (fn) */
static inline uint32_t dtm_nf_round(double x, int mb, int eb, int fn, double maxf) {
  int bias = (1 << (eb - 1)) - 1, e;
  uint32_t s = signbit(x) ? 1u << (mb + eb) : 0;
  uint32_t ovf = fn ? (1u << (mb + eb)) - 1 : ((1u << eb) - 1) << mb;
  double a = fabs(x);
  if (a == 0) return s;
  if (!(a <= 2 * maxf)) return s | ovf;
  (void)frexp(a, &e); e -= 1;
  if (e < 1 - bias) e = 1 - bias;
  double r = nearbyint(ldexp(a, mb - e));   /* a in units of the quantum 2^(e - mb): exact */
  r = ldexp(r, e - mb);
  if (r > maxf) return s | ovf;
  if (r == 0) return s;
  (void)frexp(r, &e); e -= 1;
  if (e < 1 - bias) return s | (uint32_t)ldexp(r, bias - 1 + mb);
  return s | ((uint32_t)(e + bias) << mb) | ((uint32_t)ldexp(r, mb - e) - (1u << mb));
}
/* a 64-bit integer as a double that rounds to every narrow float as the integer does: above
   2^53 the low 11 bits fold into one sticky bit, far below any narrow float's rounding bit */
static inline double dtm_u64_sticky(uint64_t u) {
  if (u < (UINT64_C(1) << 53)) return (double)u;
  return ldexp((double)((u >> 11) | ((u & 0x7ff) != 0)), 11);
}
static inline double dtm_i64_sticky(int64_t x) {
  double v = dtm_u64_sticky(x < 0 ? (uint64_t)0 - (uint64_t)x : (uint64_t)x);
  return x < 0 ? -v : v;
}
/* f16 <-> f32 / f64 NaN payloads, as numpy */
static inline uint16_t dtm_f16_nan_f32(uint32_t b) {
  uint16_t m = (uint16_t)((b & 0x7fffffu) >> 13);
  return (uint16_t)(((b >> 16) & 0x8000u) | 0x7c00u | (m ? m : 1));
}
static inline uint16_t dtm_f16_nan_f64(uint64_t b) {
  uint16_t m = (uint16_t)((b & UINT64_C(0xfffffffffffff)) >> 42);
  return (uint16_t)(((b >> 48) & 0x8000u) | 0x7c00u | (m ? m : 1));
}
static inline float dtm_f16_f32(uint16_t h) {
  uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0x1f) return dtm_f32_bits(s | 0x7f800000u | (m << 13));
#if defined(__FLT16_MAX__)
  _Float16 v; memcpy(&v, &h, 2); return (float)v;  /* exact, as the decoding below */
#else
  return (float)dtm_nf_decode(h, 10, 5, 0);
#endif
}
static inline double dtm_f16_f64(uint16_t h) {
  uint64_t s = (uint64_t)(h & 0x8000u) << 48, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0x1f) return dtm_f64_bits(s | UINT64_C(0x7ff0000000000000) | (m << 42));
  return dtm_nf_decode(h, 10, 5, 0);
}
static inline float dtm_bf16_f32(uint16_t h) { return dtm_f32_bits((uint32_t)h << 16); }
static inline double dtm_bf16_f64(uint16_t h) { return (double)dtm_bf16_f32(h); }
"""

_PER_TYPE = r"""static inline T dtm_NAME_nan(int neg) { return (T)((neg ? SIGN : 0u) | QNAN); }
static inline T dtm_NAME_of(double x) {  /* from another narrow float's value or an integer */
  return x != x ? dtm_NAME_nan(signbit(x) != 0) : (T)dtm_nf_round(x, MB, EB, FN, MAXF);
}
static inline T dtm_NAME_of_f32(float x) {
  return x != x ? F32NAN : (T)dtm_nf_round((double)x, MB, EB, FN, MAXF);
}
static inline T dtm_NAME_of_f64(double x) {
  return x != x ? F64NAN : (T)dtm_nf_round(x, MB, EB, FN, MAXF);
}
"""

_DECODE = r"""static inline float dtm_NAME_f32(T b) { return (float)dtm_nf_decode(b, MB, EB, FN); }
static inline double dtm_NAME_f64(T b) { return dtm_nf_decode(b, MB, EB, FN); }
"""


# f32 -> bf16 and f32 -> f16 without the generic rounding (a double's frexp, nearbyint and
# ldexp: 40 ns an element, the whole time of an autocast step's elementwise kernels), the
# same bits: bf16 is f32's high half, so rounding its low half to nearest even is an integer
# add (overflow carries into the exponent: inf, as the generic rounding gives); f16 is
# the compiler's own _Float16 conversion (one rounding, to nearest even) where it has one.
_FAST_OF_F32 = {
    "bf16": """static inline uint16_t dtm_bf16_of_f32(float x) {  /* round to nearest even on the bits */
  uint32_t b = dtm_bits_f32(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(((b >> 16) & 0x8000u) | 0x7fc0u);  /* NaN: quiet, its sign
                                                            (not signbit: GCC 12 fails on it vectorized) */
  return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
""",
    "f16": """static inline uint16_t dtm_f16_of_f32(float x) {
#if defined(__FLT16_MAX__)
  if (x != x) return dtm_f16_nan_f32(dtm_bits_f32(x));
  _Float16 h = (_Float16)x;
  uint16_t b; memcpy(&b, &h, sizeof(b)); return b;
#else
  return x != x ? dtm_f16_nan_f32(dtm_bits_f32(x)) : (uint16_t)dtm_nf_round((double)x, 10, 5, 0, 65504.0);
#endif
}
""",
}


def _per_type(name: str) -> str:
    mb, eb, fn, maxf = FORMATS[name]
    total = 1 + mb + eb
    qnan = (1 << (mb + eb)) - 1 if fn else (((1 << eb) - 1) << mb) | (1 << (mb - 1))
    if name == "f16":
        f32nan, f64nan = "dtm_f16_nan_f32(dtm_bits_f32(x))", "dtm_f16_nan_f64(dtm_bits_f64(x))"
    else:
        f32nan = f64nan = "dtm_NAME_nan(signbit(x) != 0)"
    code = _PER_TYPE + ("" if name in ("f16", "bf16") else _DECODE)
    if name in _FAST_OF_F32:
        head, _, rest = code.partition("static inline T dtm_NAME_of_f32(float x) {")
        code = head + "@fast@" + rest.partition("}\n")[2]
    for k, v in (("F32NAN", f32nan), ("F64NAN", f64nan), ("NAME", name), ("T", BITS_T[name]),
                 ("SIGN", f"{1 << (total - 1):#x}u"), ("QNAN", f"{qnan:#x}u"), ("MB", str(mb)),
                 ("EB", str(eb)), ("FN", str(fn)), ("MAXF", maxf)):
        code = code.replace(k, v)
    if name in _FAST_OF_F32:  # (written with its names: the replacements above would change its macros)
        code = code.replace("@fast@", _FAST_OF_F32[name])
    return code


def narrow_float_helpers() -> str:
    """Every narrow-float conversion function (static inline: a unit keeps those it calls)."""
    return CORE + "".join(_per_type(n) for n in NARROW_FLOATS)


def cast_expr(x: str, src: str, dst: str, f2i) -> str:
    """C for cast(x) from dtype name `src` to `dst`, one side (at least) a narrow float.
    `f2i(dst)` names the helper that converts a double to integer dtype dst."""
    if src == dst:
        return x
    if src in NARROW_FLOATS:
        if dst == "f32":
            return f"dtm_{src}_f32({x})"
        value = f"dtm_{src}_f64({x})"
        if dst == "f64":
            return value
        if dst in NARROW_FLOATS:
            return f"dtm_{dst}_of({value})"
        if dst == "bool":
            return f"(uint8_t)({value} != 0)"
        return f"{f2i(dst)}({value})"
    # to a narrow float
    if src == "f32":
        return f"dtm_{dst}_of_f32({x})"
    if src == "f64":
        return f"dtm_{dst}_of_f64({x})"
    if src == "bool":
        return f"dtm_{dst}_of((double){x})"
    if src in ("u64",):
        return f"dtm_{dst}_of(dtm_u64_sticky({x}))"
    if src in ("i64", "index"):
        return f"dtm_{dst}_of(dtm_i64_sticky({x}))"
    return f"dtm_{dst}_of((double){x})"  # 8 to 32-bit integers: exact in double


QUANT_C = r"""/* q8_0 / q4_0 blocks, as dtm.ref.quant (c_convert.py) */
static inline void dtm_put_scale(uint8_t *o, float d) {
  uint16_t h = dtm_f16_of_f32(d);
  o[0] = (uint8_t)(h & 0xff); o[1] = (uint8_t)(h >> 8);
}
static inline float dtm_get_scale(const uint8_t *o) { return dtm_f16_f32((uint16_t)(o[0] | (o[1] << 8))); }
static void dtm_quantize_q8_0(int64_t nb, const float *x, uint8_t *out) {
#pragma omp parallel for schedule(static) if(nb >= 2048)
  for (int64_t b = 0; b < nb; b++) {
    const float *v = x + b * 32;
    uint8_t *o = out + b * 34;
    float amax = 0.0f;
    int nan = -1;
    for (int i = 0; i < 32; i++) {
      float a = fabsf(v[i]);
      if (a != a) { if (nan < 0) nan = i; }
      else if (a > amax) amax = a;
    }
    float d = (nan >= 0 ? NAN : amax) / 127.0f;  /* numpy's max of a slice holding NaN: the quiet NaN */
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    dtm_put_scale(o, d);
    for (int i = 0; i < 32; i++) {
      double p = (double)(v[i] * id);
      double r = trunc(p + copysign(0.5, p));
      o[2 + i] = (uint8_t)(int8_t)(r != r ? 0 : r < -128.0 ? -128 : r > 127.0 ? 127 : (int)r);
    }
  }
}
static void dtm_quantize_q4_0(int64_t nb, const float *x, uint8_t *out) {
#pragma omp parallel for schedule(static) if(nb >= 2048)
  for (int64_t b = 0; b < nb; b++) {
    const float *v = x + b * 32;
    uint8_t *o = out + b * 18;
    int first = 0;
    float amax = -1.0f;
    for (int i = 0; i < 32; i++) {  /* the first of the largest |x|; a NaN counts as largest */
      float a = fabsf(v[i]);
      if (a != a) { first = i; break; }
      if (a > amax) { amax = a; first = i; }
    }
    float d = v[first] / -8.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    dtm_put_scale(o, d);
    uint8_t q[32];
    for (int i = 0; i < 32; i++) {
      float t = v[i] * id + 8.5f;   /* two roundings (-ffp-contract=off), as GGML */
      float r = truncf(t);
      q[i] = (uint8_t)(r != r ? 0 : r < 0.0f ? 0 : r > 15.0f ? 15 : (int)r);
    }
    for (int j = 0; j < 16; j++) o[2 + j] = (uint8_t)(q[j] | (q[j + 16] << 4));
  }
}
static void dtm_dequantize_q8_0(int64_t nb, const uint8_t *x, float *out) {
#pragma omp parallel for schedule(static) if(nb >= 2048)
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t *o = x + b * 34;
    float d = dtm_get_scale(o), *y = out + b * 32;
    for (int i = 0; i < 32; i++) y[i] = d * (float)(int8_t)o[2 + i];
  }
}
static void dtm_dequantize_q4_0(int64_t nb, const uint8_t *x, float *out) {
#pragma omp parallel for schedule(static) if(nb >= 2048)
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t *o = x + b * 18;
    float d = dtm_get_scale(o), *y = out + b * 32;
    for (int j = 0; j < 16; j++) {
      y[j] = d * (float)((o[2 + j] & 15) - 8);
      y[j + 16] = d * (float)((o[2 + j] >> 4) - 8);
    }
  }
}
"""
