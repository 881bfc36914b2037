"""The runtime library for matrix products whose B operand is a narrow weight: q8_0, q4_0
or bf16 (spec 2.2.4, "Products with narrow weights").

    C[M, N] = A[M, K] @ B[K, N],  A and C f32,  B[k, j] = W[j, k] of a narrow W[N, K]

B is read as a Linear's weight is: the transpose of a row-major W, so each column of B (a row
of W) is contiguous along the contracted dim and, for the block types, a whole number of
32-element blocks (the scheduler absorbs a cast into a product only then). The weights are
never widened in memory: each block is decoded in registers.

  q8_0, q4_0: each row of A is first quantized to q8_0-like blocks (32 int8 values and an
    f32 scale: amax / 127, q = roundf(x / d), half away from zero, as GGML's reference
    quantizer, but the scale kept in f32 rather than rounded to f16). A block's product is
    then an exact int32 dot product of 32 int8 pairs, times d_w * d_x (both f32), added by a
    fused multiply-add into partial sum b mod 16 of the row's 16; the 16 are added in one
    fixed tree at the row's end (total16). The integer dots run on AVX-512 VNNI or AVX-VNNI
    (vpdpbusd) or AVX2 (vpmaddubsw) where -march=native offers them, else in portable C; the
    integer sums are exact and the float steps the same everywhere, so every path, and every
    row count, gives the same bits.
    Few rows (decode): four rows of W at a time against a row of A, read as they are stored.
    Many rows (prefill, PACK_MIN_ROWS or more, with AVX-512 VNNI): both operands re-laid so
    that a 512-bit lane holds a block (product_packed), tiles of 4 x 4 outputs, each group of
    16 blocks eight vpdpbusd and one fused multiply-add per output.
DTM_NARROW_PORTABLE=1 in the environment (read at the first product) forces the portable
path, for testing it on a machine that has the instructions.

Threads split the rows of W (columns of C) into blocks (NB, NBP rows); each block is read from
memory once and, when A has several rows, reused from cache for all of them. The epilogue runs on
each finished block, on its thread.
"""

VERSION = 4

NARROW = ("q8_0", "q4_0", "bf16")  # weight dtypes the library multiplies by

_SIG = ("void dtm_rt_gemm_f32_{t}(int64_t nbatch, const int64_t *offs, int64_t M, int64_t N, int64_t K,\n"
        "                         const float *A, int64_t rsa, int64_t csa, const uint8_t *B, int64_t rsb,\n"
        "                         int64_t csb, float *C, int64_t ldc, dtm_epilogue_fn epi, const void *ctx)")

HEADER = ("typedef void (*dtm_epilogue_fn)(const void *ctx, int64_t bt, int64_t i0, int64_t i1, int64_t j0, int64_t j1);\n"
          + ";\n".join(_SIG.format(t=t) for t in NARROW) + ";\nint dtm_rt_version_narrow(void);")

_BODY = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define PF 4096  /* bytes ahead a row's stream is prefetched */
#define NB 16  /* rows of W per block of work: 16 q8_0 rows of K = 3072 are 52 KB, kept in L2 */

static int64_t dtm_min(int64_t a, int64_t b) { return a < b ? a : b; }

static int portable_only(void) {
  static int mode = -1;
  if (mode < 0) {
    const char *e = getenv("DTM_NARROW_PORTABLE");
    mode = e && *e && strcmp(e, "0") != 0;
  }
  return mode;
}

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);               /* inf, nan */
  else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);         /* normal */
  else if (!man) bits = sign;                                            /* zero */
  else {                                                                 /* subnormal */
    int e = -1;
    do { man <<= 1; e++; } while (!(man & 0x400));
    bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
  }
  float f; memcpy(&f, &bits, 4); return f;
#endif
}

static inline float scale_of(const uint8_t *block) { uint16_t h; memcpy(&h, block, 2); return f16_to_f32(h); }

/* ---- activations: a row of A as blocks of 32 int8 and an f32 scale ---- */
static void quantize_block(const float *v, int8_t *q, float *d) {
  float amax = 0.0f;
  int nan = 0;
  for (int i = 0; i < 32; i++) {
    amax = fmaxf(amax, fabsf(v[i]));  /* fmaxf drops a NaN: flagged instead */
    nan |= v[i] != v[i];
  }
  float s = nan ? NAN : amax / 127.0f, id = s != 0.0f && s == s ? 1.0f / s : 0.0f;  /* NaN, Inf: outputs NaN */
  for (int i = 0; i < 32; i++) {
    float r = roundf(v[i] * id);   /* |r| <= 127; NaN only when the row holds NaN or Inf */
    q[i] = r == r ? (int8_t)r : 0;
  }
  *d = s;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* quantize_block's steps in two 16-lane vectors, to the bit: the scale from the same amax and
   division, and roundf(x) as trunc(x) plus the sign where the (exact) fraction is >= 1/2 */
static void quantize_block_512(const float *a, int8_t *q, float *d) {
  __m512 v[2] = {_mm512_loadu_ps(a), _mm512_loadu_ps(a + 16)};
  __mmask16 nan = _mm512_cmp_ps_mask(v[0], v[0], _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v[1], v[1], _CMP_UNORD_Q);
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
  float s = nan ? NAN : amax / 127.0f, id = s != 0.0f && s == s ? 1.0f / s : 0.0f;
  const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
  for (int h = 0; h < 2; h++) {
    __m512 x = _mm512_mul_ps(v[h], _mm512_set1_ps(id));
    __m512 t = _mm512_roundscale_ps(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(x, t)), half, _CMP_GE_OQ);
    __m512 r = _mm512_mask_add_ps(t, up, t, _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(one), _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)))));
    __m512i n = _mm512_maskz_cvttps_epi32(_mm512_cmp_ps_mask(r, r, _CMP_ORD_Q), r);
    _mm_storeu_si128((__m128i *)(q + 16 * h), _mm512_cvtepi32_epi8(n));
  }
  *d = s;
}
#endif

static void quantize_row(const float *a, int64_t cs, int64_t K, int8_t *q, float *d) {
  float v[32];
  for (int64_t b = 0; b < K / 32; b++) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (cs == 1 && !portable_only()) { quantize_block_512(a + b * 32, q + b * 32, d + b); continue; }
#endif
    for (int i = 0; i < 32; i++) v[i] = a[(b * 32 + i) * cs];
    quantize_block(v, q + b * 32, d + b);
  }
}

/* ---- the float steps, the same on every path and for every row count (spec 2.2.1) ----
   A block's 32 products are summed exactly (int32), multiplied by its scale d_w * d_x
   (rounded to f32) and added by a fused multiply-add into partial sum b mod 16 of the row's
   16; at the row's end the 16 are added in one fixed tree. 16 partial sums because the
   packed product below holds block b of a group of 16 in lane b of a 512-bit vector. */
static inline float total16(const float *s) {
  float t8[8], t4[4];
  for (int l = 0; l < 8; l++) t8[l] = s[l] + s[l + 8];
  for (int l = 0; l < 4; l++) t4[l] = t8[l] + t8[l + 4];
  return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

static inline int q4_value(const uint8_t *w, int i) { return (i < 16 ? (w[i] & 15) : (w[i - 16] >> 4)) - 8; }

static float row_portable(int q4, const uint8_t *w, const int8_t *qa, const float *da, int64_t nb) {
  float acc[16] = {0};
  int64_t bytes = q4 ? 18 : 34;
  for (int64_t b = 0; b < nb; b++, w += bytes) {
    const int8_t *a = qa + b * 32;
    int32_t s = 0;
    for (int i = 0; i < 32; i++) s += (q4 ? q4_value(w + 2, i) : ((const int8_t *)(w + 2))[i]) * a[i];
    acc[b & 15] = fmaf((float)s, scale_of(w) * da[b], acc[b & 15]);
  }
  return total16(acc);
}

#if defined(__AVX2__) && defined(__FMA__)
#define DTM_SIMD 1
/* the 8 lane sums of 32 products w * a, w and a signed bytes. The unsigned operand is |w|
   (a weight of -128 reads as 128, correctly) and the signed one a * sign(w). */
static inline __m256i lanes_i8(__m256i w, __m256i a) {
  __m256i u = _mm256_sign_epi8(w, w), s = _mm256_sign_epi8(a, w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else  /* pairs of |w| * a fit int16: 2 * 128 * 127 */
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256i lanes_u8(__m256i u, __m256i s) {  /* u unsigned bytes, s signed */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else  /* pairs of u * s fit int16: 2 * 15 * 127 */
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256i q4_nibbles(const uint8_t *w) {  /* element j: low nibble of byte j, j + 16: high */
  __m128i x = _mm_loadu_si128((const __m128i *)w);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(15));
}

static inline __m128 scales4(const uint8_t *w0, const uint8_t *w1, const uint8_t *w2, const uint8_t *w3) {
#if defined(__F16C__)
  uint16_t h[4];
  memcpy(h, w0, 2); memcpy(h + 1, w1, 2); memcpy(h + 2, w2, 2); memcpy(h + 3, w3, 2);
  return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)h));
#else
  return _mm_setr_ps(scale_of(w0), scale_of(w1), scale_of(w2), scale_of(w3));
#endif
}

/* Four rows of W against one row of A (decode's matrix-vector products): each activation
   block is loaded once for the four, and the four rows' exact block sums come out of three
   horizontal adds as one 4-lane vector, so the float steps (row_portable's, lane r for row
   r) run once per block for all four. q4_0 multiplies the unsigned nibbles (0..15) by the
   activations and subtracts 8 x the block's activation sum (bsum): the exact sums of
   (q - 8) * a, with no sign fix-ups. */
static void rows4_simd(int q4, const uint8_t *w, int64_t row_bytes, const int8_t *qa, const float *da,
                       const int32_t *bsum, int64_t nb, float *out) {
  __m128 acc[16];
  for (int l = 0; l < 16; l++) acc[l] = _mm_setzero_ps();
  const uint8_t *w0 = w, *w1 = w + row_bytes, *w2 = w + 2 * row_bytes, *w3 = w + 3 * row_bytes;
  int64_t bytes = q4 ? 18 : 34;
  for (int64_t b = 0; b < nb; b++) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(qa + b * 32));
    __m256i p0, p1, p2, p3;
    int64_t o = b * bytes;
    if (q4) {
      p0 = lanes_u8(q4_nibbles(w0 + o + 2), a); p1 = lanes_u8(q4_nibbles(w1 + o + 2), a);
      p2 = lanes_u8(q4_nibbles(w2 + o + 2), a); p3 = lanes_u8(q4_nibbles(w3 + o + 2), a);
    } else {
      p0 = lanes_i8(_mm256_loadu_si256((const __m256i *)(w0 + o + 2)), a);
      p1 = lanes_i8(_mm256_loadu_si256((const __m256i *)(w1 + o + 2)), a);
      p2 = lanes_i8(_mm256_loadu_si256((const __m256i *)(w2 + o + 2)), a);
      p3 = lanes_i8(_mm256_loadu_si256((const __m256i *)(w3 + o + 2)), a);
    }
    if ((b & 1) == 0) {  /* the rows' bytes PF ahead, once per 2 blocks (36 or 68 bytes) */
      _mm_prefetch((const char *)(w0 + o + PF), _MM_HINT_T0); _mm_prefetch((const char *)(w1 + o + PF), _MM_HINT_T0);
      _mm_prefetch((const char *)(w2 + o + PF), _MM_HINT_T0); _mm_prefetch((const char *)(w3 + o + PF), _MM_HINT_T0);
    }
    /* [p0 lanes 0-3, p1 0-3, p2 0-3, p3 0-3 | the same of lanes 4-7]: halves added, the 4 block sums */
    __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    if (q4) s = _mm_sub_epi32(s, _mm_set1_epi32(8 * bsum[b]));
    __m128 sc = _mm_mul_ps(scales4(w0 + o, w1 + o, w2 + o, w3 + o), _mm_set1_ps(da[b]));
    acc[b & 15] = _mm_fmadd_ps(_mm_cvtepi32_ps(s), sc, acc[b & 15]);
  }
  float lanes[16][4], row[16];
  for (int l = 0; l < 16; l++) _mm_storeu_ps(lanes[l], acc[l]);
  for (int r = 0; r < 4; r++) {
    for (int l = 0; l < 16; l++) row[l] = lanes[l][r];
    out[r] = total16(row);
  }
}
#else
#define DTM_SIMD 0
#endif

#if DTM_SIMD && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define DTM_PACKED 1
/* ---- many rows (prefill): a tiled int8 product on packed operands ----
   Both operands are re-laid per group of 16 blocks (512 elements) so that lane l of a
   512-bit vector holds block 16g + l: vector t (0..7) of a group holds elements 4t..4t+3 of
   each of its 16 blocks. Eight vpdpbusd then leave the 16 blocks' exact sums in the 16 lanes,
   and one multiply and one fused multiply-add per group do the float steps of 16 blocks:
   lane l is partial sum l, as row_portable's block 16g + l adds into acc[l]. The weights go
   unsigned (q8_0: w + 128; q4_0: the nibble, w + 8), and each lane starts from minus that
   offset times the activation block's sum, so the sums are exactly those of w * a.
   Blocks past the row's end hold zero activations and scale 0: fma(0, 0, s) leaves s as it is. */
#define PACK_MIN_ROWS 8  /* fewer rows of A: rows4_simd, which reads W once without re-laying it */
#define NBP 64           /* rows of W packed at a time: 64 rows of K = 3072 are 192 KB, kept in L2 */

static const int64_t GROUP = 512;  /* bytes of a packed group: 16 blocks of 32 */

/* lane l: the 32-bit word at base + l * stride, for the lanes below `blocks` (else 0): the
   weights' f16 scales, 34 or 18 bytes apart */
static inline __m512i gather16(const void *base, int64_t stride, int64_t blocks) {
  __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                   _mm512_set1_epi32((int)stride));
  __mmask16 m = blocks >= 16 ? 0xffff : (__mmask16)((1u << blocks) - 1);
  return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, base, 1);
}

/* Words w..w+3 (16 bytes at base + 4w) of each of 16 blocks `stride` bytes apart, transposed:
   out[t] lane l is word w + t of block l (0 past `blocks`). Lane j of a 128-bit quarter of
   x[k] holds block 4j + k, so two rounds of unpacks within the quarters finish the
   transpose, with no shuffle across them. */
static inline void transpose16x4(const uint8_t *base, int64_t stride, int64_t blocks, __m512i out[4]) {
  __m512i x[4];
  for (int k = 0; k < 4; k++) {
    x[k] = _mm512_setzero_si512();
    for (int j = 0; j < 4 && 4 * j + k < blocks; j++)
      x[k] = _mm512_mask_broadcast_i32x4(x[k], (__mmask16)(0xf << (4 * j)),
                                         _mm_loadu_si128((const __m128i *)(base + (4 * j + k) * stride)));
  }
  __m512i a0 = _mm512_unpacklo_epi32(x[0], x[1]), a1 = _mm512_unpackhi_epi32(x[0], x[1]);
  __m512i a2 = _mm512_unpacklo_epi32(x[2], x[3]), a3 = _mm512_unpackhi_epi32(x[2], x[3]);
  out[0] = _mm512_unpacklo_epi64(a0, a2); out[1] = _mm512_unpackhi_epi64(a0, a2);
  out[2] = _mm512_unpacklo_epi64(a1, a3); out[3] = _mm512_unpackhi_epi64(a1, a3);
}

/* row i of A (quantized: qa, da) as ng groups at ap, each lane's start value at ca and scale at ds */
static void pack_a(int q4, const int8_t *qa, const float *da, int64_t nb, int64_t ng,
                   int8_t *ap, int32_t *ca, float *ds) {
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i offset = _mm512_set1_epi32(q4 ? -8 : -128);
  for (int64_t g = 0; g < ng; g++) {
    int64_t blocks = nb - 16 * g < 16 ? nb - 16 * g : 16;
    __m512i v[8], sum = _mm512_setzero_si512();
    transpose16x4((const uint8_t *)(qa + g * GROUP), 32, blocks, v);
    transpose16x4((const uint8_t *)(qa + g * GROUP + 16), 32, blocks, v + 4);
    for (int t = 0; t < 8; t++) {
      _mm512_store_si512((void *)(ap + g * GROUP + 64 * t), v[t]);
      sum = _mm512_dpbusd_epi32(sum, ones, v[t]);
    }
    _mm512_store_si512((void *)(ca + 16 * g), _mm512_mullo_epi32(sum, offset));
    _mm512_store_ps(ds + 16 * g, _mm512_maskz_loadu_ps(blocks >= 16 ? 0xffff : (__mmask16)((1u << blocks) - 1),
                                                       da + 16 * g));
  }
}

/* row w of W (nb blocks of `bytes`) as ng unsigned groups at wp, its block scales at ds */
static void pack_w(int q4, const uint8_t *w, int64_t nb, int64_t ng, uint8_t *wp, float *ds) {
  int64_t bytes = q4 ? 18 : 34;
  for (int64_t g = 0; g < ng; g++) {
    int64_t blocks = nb - 16 * g < 16 ? nb - 16 * g : 16;
    const uint8_t *blk = w + 16 * g * bytes;
    __m512i h = gather16(blk, bytes, blocks);  /* each scale's f16 in the low half of its lane */
    _mm512_store_ps(ds + 16 * g, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)));
    __m512i v[8];
    if (q4) {  /* word t of a block's 16 bytes: its elements 4t..4t+3 in the low nibbles, 16+4t.. in the high */
      const __m512i low = _mm512_set1_epi8(15);
      transpose16x4(blk + 2, bytes, blocks, v);
      for (int t = 0; t < 4; t++) {
        v[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v[t], 4), low);
        v[t] = _mm512_and_si512(v[t], low);
      }
    } else {
      const __m512i flip = _mm512_set1_epi8((char)0x80);  /* w + 128 as an unsigned byte */
      transpose16x4(blk + 2, bytes, blocks, v);
      transpose16x4(blk + 18, bytes, blocks, v + 4);
      for (int t = 0; t < 8; t++) v[t] = _mm512_xor_si512(v[t], flip);
    }
    for (int t = 0; t < 8; t++) _mm512_store_si512((void *)(wp + g * GROUP + 64 * t), v[t]);
  }
}

/* total16 of a 512-bit vector of partial sums: total16's tree, lane for lane */
static inline float total16_512(__m512 s) {
  __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  float t[4];
  _mm_storeu_ps(t, t4);
  return (t[0] + t[2]) + (t[1] + t[3]);
}

/* C[mr, nr] (at most 4 x 4) of rows of A at ap (rows ng groups apart) and rows of W at wp.
   The 16 block sums of each output stay in registers for a group's eight steps; its float
   partial sums are touched once per group (the compiler keeps them in L1 where registers
   run out: 16 sums, 16 partial sums and the loaded operands are more than 32). A last group
   of 8 blocks or fewer runs on 256-bit vectors (its lanes 8..15 are padding): on K = 768
   (24 blocks) a quarter of the work fewer. */
static inline __attribute__((always_inline)) void tile(int mr, int nr, int64_t nb, int64_t ng, const int8_t *ap,
    const int32_t *ca, const float *dsa, const uint8_t *wp, const float *dsw, float *c, int64_t ldc) {
  __m512 f[4][4];
  for (int r = 0; r < mr; r++)
    for (int j = 0; j < nr; j++) f[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; g++) {
    __m512i p[4][4];
    int half = nb - 16 * g <= 8;
    for (int r = 0; r < mr; r++) {
      __m512i start = _mm512_load_si512((const void *)(ca + (r * ng + g) * 16));
      for (int j = 0; j < nr; j++) p[r][j] = start;
    }
    if (half) {
      __m256i h[4][4];
      for (int r = 0; r < mr; r++)
        for (int j = 0; j < nr; j++) h[r][j] = _mm512_castsi512_si256(p[r][j]);
      for (int t = 0; t < 8; t++) {
        __m256i wv[4];
        for (int j = 0; j < nr; j++) wv[j] = _mm256_load_si256((const __m256i *)(wp + (j * ng + g) * GROUP + 64 * t));
        for (int r = 0; r < mr; r++) {
          __m256i av = _mm256_load_si256((const __m256i *)(ap + (r * ng + g) * GROUP + 64 * t));
          for (int j = 0; j < nr; j++) h[r][j] = _mm256_dpbusd_epi32(h[r][j], wv[j], av);
        }
      }
      for (int r = 0; r < mr; r++)
        for (int j = 0; j < nr; j++) p[r][j] = _mm512_zextsi256_si512(h[r][j]);
    } else {
      for (int t = 0; t < 8; t++) {
        __m512i wv[4];
        for (int j = 0; j < nr; j++) wv[j] = _mm512_load_si512((const void *)(wp + (j * ng + g) * GROUP + 64 * t));
        for (int r = 0; r < mr; r++) {
          __m512i av = _mm512_load_si512((const void *)(ap + (r * ng + g) * GROUP + 64 * t));
          for (int j = 0; j < nr; j++) p[r][j] = _mm512_dpbusd_epi32(p[r][j], wv[j], av);
        }
      }
    }
    for (int r = 0; r < mr; r++) {
      __m512 da = _mm512_load_ps(dsa + (r * ng + g) * 16);
      for (int j = 0; j < nr; j++)
        f[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[r][j]),
                                  _mm512_mul_ps(_mm512_load_ps(dsw + (j * ng + g) * 16), da), f[r][j]);
    }
  }
  for (int r = 0; r < mr; r++)
    for (int j = 0; j < nr; j++) c[r * ldc + j] = total16_512(f[r][j]);
}

static void tile_edge(int mr, int nr, int64_t nb, int64_t ng, const int8_t *ap, const int32_t *ca,
                      const float *dsa, const uint8_t *wp, const float *dsw, float *c, int64_t ldc) {
  tile(mr, nr, nb, ng, ap, ca, dsa, wp, dsw, c, ldc);
}

static void *alloc64(size_t bytes) {
  void *p = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
  if (!p) abort();
  return p;
}

static void product_packed(int q4, int64_t M, int64_t N, int64_t nb, const int8_t *qa, const float *da,
                           const uint8_t *B, int64_t row_bytes, float *C, int64_t ldc,
                           dtm_epilogue_fn epi, const void *ctx, int64_t bt) {
  int64_t ng = (nb + 15) / 16;
  int8_t *ap = alloc64((size_t)(M * ng * GROUP));
  int32_t *ca = alloc64((size_t)(M * ng * 16) * sizeof(int32_t));
  float *dsa = alloc64((size_t)(M * ng * 16) * sizeof(float));
  for (int64_t i = 0; i < M; i++)
    pack_a(q4, qa + i * nb * 32, da + i * nb, nb, ng, ap + i * ng * GROUP, ca + i * ng * 16, dsa + i * ng * 16);
  int64_t blocks = (N + NBP - 1) / NBP;
  double work = (double)M * (double)N * (double)nb * 32.0;
#pragma omp parallel if(work >= 1e5)
  {
    uint8_t *wp = alloc64((size_t)(NBP * ng * GROUP));
    float *dsw = alloc64((size_t)(NBP * ng * 16) * sizeof(float));
#pragma omp for schedule(static)
    for (int64_t jb = 0; jb < blocks; jb++) {
      int64_t j0 = jb * NBP, j1 = dtm_min(N, j0 + NBP);
      for (int64_t j = j0; j < j1; j++)
        pack_w(q4, B + j * row_bytes, nb, ng, wp + (j - j0) * ng * GROUP, dsw + (j - j0) * ng * 16);
      for (int64_t i = 0; i < M; i += 4) {
        int mr = (int)dtm_min(4, M - i);
        for (int64_t j = j0; j < j1; j += 4) {
          int nr = (int)dtm_min(4, j1 - j);
          const int8_t *a = ap + i * ng * GROUP;
          const uint8_t *w = wp + (j - j0) * ng * GROUP;
          const float *sa = dsa + i * ng * 16, *sw = dsw + (j - j0) * ng * 16;
          if (mr == 4 && nr == 4) tile(4, 4, nb, ng, a, ca + i * ng * 16, sa, w, sw, C + i * ldc + j, ldc);
          else tile_edge(mr, nr, nb, ng, a, ca + i * ng * 16, sa, w, sw, C + i * ldc + j, ldc);
        }
      }
      if (epi) epi(ctx, bt, 0, M, j0, j1);
    }
    free(wp); free(dsw);
  }
  free(ap); free(ca); free(dsa);
}
#else
#define DTM_PACKED 0
#endif

static inline float bf16_to_f32(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }

static float row_bf16(const uint16_t *w, const float *a, int64_t K, int simd) {
  int64_t k = 0;
  float acc = 0.0f;
#if defined(__AVX512F__)
  if (simd) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    for (; k + 32 <= K; k += 32) {
      __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + k))), 16));
      __m512 w1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + k + 16))), 16));
      s0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(a + k), s0);
      s1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(a + k + 16), s1);
    }
    acc = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (simd) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
      __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + k))), 16));
      __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + k + 8))), 16));
      s0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(a + k), s0);
      s1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(a + k + 8), s1);
    }
    float t[8];
    _mm256_storeu_ps(t, _mm256_add_ps(s0, s1));
    for (int i = 0; i < 8; i++) acc += t[i];
  }
#endif
  (void)simd;
  for (; k < K; k++) acc += bf16_to_f32(w[k]) * a[k];
  return acc;
}

/* bf16, four rows at once: a 32-bit lane of W holds elements 2t (low half) and 2t + 1
   (high half); shifted left 16 and masked to the high half they are those two elements as
   f32, exactly, with no shuffle. The activations are laid out to match once per row of A
   (`split`: per chunk of CH elements, the even ones, then the odd ones). */
#if defined(__AVX512F__)
#define CH 32
#else
#define CH 16
#endif
static void split_row(const float *a, int64_t K, float *out) {
  int64_t c = 0;
  for (; c + CH <= K; c += CH)
    for (int t = 0; t < CH / 2; t++) { out[c + t] = a[c + 2 * t]; out[c + CH / 2 + t] = a[c + 2 * t + 1]; }
  for (; c < K; c++) out[c] = a[c];
}

#if defined(__AVX512F__)
static void rows4_bf16(const uint16_t *w, int64_t ld, const float *as, const float *a, int64_t K, float *out) {
  __m512 e0 = _mm512_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
  const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512 ae = _mm512_loadu_ps(as + k), ao = _mm512_loadu_ps(as + k + 16);
    for (int r = 0; r < 4; r++) _mm_prefetch((const char *)(w + r * ld + k) + PF, _MM_HINT_T0);
    __m512i x0 = _mm512_loadu_si512((const void *)(w + k)), x1 = _mm512_loadu_si512((const void *)(w + ld + k));
    __m512i x2 = _mm512_loadu_si512((const void *)(w + 2 * ld + k)), x3 = _mm512_loadu_si512((const void *)(w + 3 * ld + k));
    e0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(x0, 16)), ae, e0);
    o0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(x0, hi)), ao, o0);
    e1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(x1, 16)), ae, e1);
    o1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(x1, hi)), ao, o1);
    e2 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(x2, 16)), ae, e2);
    o2 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(x2, hi)), ao, o2);
    e3 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(x3, 16)), ae, e3);
    o3 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(x3, hi)), ao, o3);
  }
  out[0] = _mm512_reduce_add_ps(_mm512_add_ps(e0, o0));
  out[1] = _mm512_reduce_add_ps(_mm512_add_ps(e1, o1));
  out[2] = _mm512_reduce_add_ps(_mm512_add_ps(e2, o2));
  out[3] = _mm512_reduce_add_ps(_mm512_add_ps(e3, o3));
  for (; k < K; k++)
    for (int r = 0; r < 4; r++) out[r] += bf16_to_f32(w[r * ld + k]) * a[k];
}
#define DTM_BF16_ROWS4 1
#elif defined(__AVX2__) && defined(__FMA__)
static void rows4_bf16(const uint16_t *w, int64_t ld, const float *as, const float *a, int64_t K, float *out) {
  __m256 e[4], o[4];
  const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
  for (int r = 0; r < 4; r++) e[r] = o[r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m256 ae = _mm256_loadu_ps(as + k), ao = _mm256_loadu_ps(as + k + 8);
    for (int r = 0; r < 4; r++) {
      __m256i x = _mm256_loadu_si256((const __m256i *)(w + r * ld + k));
      e[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), ae, e[r]);
      o[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(x, hi)), ao, o[r]);
    }
  }
  for (int r = 0; r < 4; r++) {
    float t[8];
    _mm256_storeu_ps(t, _mm256_add_ps(e[r], o[r]));
    out[r] = ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
  }
  for (; k < K; k++)
    for (int r = 0; r < 4; r++) out[r] += bf16_to_f32(w[r * ld + k]) * a[k];
}
#define DTM_BF16_ROWS4 1
#else
#define DTM_BF16_ROWS4 0
#endif

enum { Q8_0, Q4_0, BF16 };

/* one product: A [M, K] (rows rsa apart, elements csa apart), W rows at B + j * row_bytes */
static void product(int kind, int64_t M, int64_t N, int64_t K, const float *A, int64_t rsa, int64_t csa,
                    const uint8_t *B, int64_t row_bytes, float *C, int64_t ldc,
                    dtm_epilogue_fn epi, const void *ctx, int64_t bt) {
  int simd = DTM_SIMD && !portable_only();
  int64_t nb = K / 32;
  int8_t *qa = NULL;
  float *da = NULL, *fa = NULL, *fs = NULL;
  int32_t *bsum = NULL;
  int rows4 = simd && (kind == BF16 ? DTM_BF16_ROWS4 && row_bytes % 64 == 0 : 1);
  if (kind == BF16) {  /* rows of A contiguous, for the vector loads; and split for rows4_bf16 */
    fa = (float *)malloc((size_t)(2 * M * K + 1) * sizeof(float));
    if (!fa) abort();
    fs = fa + M * K;
    for (int64_t i = 0; i < M; i++) {
      for (int64_t k = 0; k < K; k++) fa[i * K + k] = A[i * rsa + k * csa];
      split_row(fa + i * K, K, fs + i * K);
    }
  } else {
    qa = (int8_t *)malloc((size_t)(M * K + 1));
    da = (float *)malloc((size_t)(M * nb + 1) * sizeof(float));
    if (!qa || !da) abort();
    for (int64_t i = 0; i < M; i++) quantize_row(A + i * rsa, csa, K, qa + i * K, da + i * nb);
#if DTM_PACKED
    if (simd && M >= PACK_MIN_ROWS) {
      product_packed(kind == Q4_0, M, N, nb, qa, da, B, row_bytes, C, ldc, epi, ctx, bt);
      free(qa); free(da);
      return;
    }
#endif
    bsum = (int32_t *)malloc((size_t)(M * nb + 1) * sizeof(int32_t));
    if (!bsum) abort();
    for (int64_t t = 0; t < M * nb; t++) {
      int32_t s = 0;
      for (int e = 0; e < 32; e++) s += qa[32 * t + e];
      bsum[t] = s;
    }
  }
  int64_t blocks = (N + NB - 1) / NB;
  double work = (double)M * (double)N * (double)K;
#pragma omp parallel for schedule(static) if(work >= 1e5)
  for (int64_t jb = 0; jb < blocks; jb++) {
    int64_t j0 = jb * NB, j1 = dtm_min(N, j0 + NB);
    for (int64_t i = 0; i < M; i++) {
      int64_t j = j0;
#if DTM_SIMD
      if (rows4 && kind != BF16)
        for (; j + 4 <= j1; j += 4)
          rows4_simd(kind == Q4_0, B + j * row_bytes, row_bytes, qa + i * K, da + i * nb, bsum + i * nb, nb,
                     C + i * ldc + j);
#endif
#if DTM_BF16_ROWS4
      if (rows4 && kind == BF16)
        for (; j + 4 <= j1; j += 4)
          rows4_bf16((const uint16_t *)(B + j * row_bytes), row_bytes / 2, fs + i * K, fa + i * K, K, C + i * ldc + j);
#endif
      for (; j < j1; j++) {  /* a block's last rows one by one (exact sums: rows4_simd's bits) */
        const uint8_t *w = B + j * row_bytes;
        float v = kind == BF16 ? row_bf16((const uint16_t *)w, fa + i * K, K, simd)
                : row_portable(kind == Q4_0, w, qa + i * K, da + i * nb, nb);
        C[i * ldc + j] = v;
      }
    }
    if (epi) epi(ctx, bt, 0, M, j0, j1);
  }
  free(qa); free(da); free(fa); free(bsum);
}

static void gemm(int kind, int64_t nbatch, const int64_t *offs, int64_t M, int64_t N, int64_t K,
                 const float *A, int64_t rsa, int64_t csa, const uint8_t *B, int64_t rsb, int64_t csb,
                 float *C, int64_t ldc, dtm_epilogue_fn epi, const void *ctx) {
  /* B[k, j] = element k of row j of W: rsb is 1, and csb (a whole number of blocks for the
     block types) steps from one row of W to the next; offsets count logical elements */
  (void)rsb;
  int64_t per = kind == Q8_0 ? 34 : kind == Q4_0 ? 18 : 0;
  for (int64_t bt = 0; bt < nbatch; bt++) {
    int64_t ob = offs[3 * bt + 1];
    const uint8_t *b = per ? B + ob / 32 * per : B + ob * 2;
    int64_t row_bytes = per ? csb / 32 * per : csb * 2;
    if (M <= 0 || N <= 0) continue;
    product(kind, M, N, K, A + offs[3 * bt], rsa, csa, b, row_bytes, C + offs[3 * bt + 2], ldc, epi, ctx, bt);
  }
}
"""

_ENTRY = r"""
SIG {
  gemm(KIND, nbatch, offs, M, N, K, A, rsa, csa, B, rsb, csb, C, ldc, epi, ctx);
}
"""

SOURCE = ("/* DTM runtime library: products with narrow weights (q8_0, q4_0, bf16). */\n#include <stdint.h>\n"
          + HEADER + "\n" + _BODY
          + "".join(_ENTRY.replace("SIG", _SIG.format(t=t)).replace("KIND", t.upper()) for t in NARROW)
          + f"int dtm_rt_version_narrow(void) {{ return {VERSION}; }}\n")
