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
    then an exact int32 dot product of 32 int8 pairs, scaled by d_w * d_a (both f32) and
    added to an f32 sum, block after block in order. The integer dot runs on AVX-512 VNNI
    or AVX-VNNI (vpdpbusd) or AVX2 (vpmaddubsw) where -march=native offers them, else in
    portable C; all paths give the same bits (the integer sums are exact and the float
    steps are one shared function).
  bf16: each weight is widened exactly (a 16-bit shift) and multiplied into f32 sums
    (16 lanes with AVX-512, then added across lanes): the only rounding is f32's.

DTM_NARROW_PORTABLE=1 in the environment (read at the first product) forces the portable
path, for testing it on a machine that has the instructions.

Threads split the rows of W (columns of C) into blocks of NB; each block is read from memory
once and, when A has several rows, reused from cache for all of them. The epilogue runs on
each finished block, on its thread.
"""

VERSION = 3

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
static void quantize_row(const float *a, int64_t cs, int64_t K, int8_t *q, float *d) {
  for (int64_t b = 0; b < K / 32; b++) {
    float v[32], amax = 0.0f;
    int nan = 0;
    for (int i = 0; i < 32; i++) {
      v[i] = a[(b * 32 + i) * cs];
      amax = fmaxf(amax, fabsf(v[i]));  /* fmaxf drops a NaN: flagged instead */
      nan |= v[i] != v[i];
    }
    float s = nan ? NAN : amax / 127.0f, id = s != 0.0f && s == s ? 1.0f / s : 0.0f;  /* NaN, Inf: outputs NaN */
    for (int i = 0; i < 32; i++) {
      float r = roundf(v[i] * id);   /* |r| <= 127; NaN only when the row holds NaN or Inf */
      q[b * 32 + i] = r == r ? (int8_t)r : 0;
    }
    d[b] = s;
  }
}

/* The float steps, shared by all paths so they agree to the bit: a block's 32 products are
   summed exactly in 8 int32 lanes (lane l: elements 4l .. 4l+3, as vpdpbusd and
   vpmaddubsw + vpmaddwd both leave them), each lane multiplied by the block's scale
   d_w * d_x into its own f32 sum (a fused multiply-add), and the 8 sums added at the end of
   the row in one fixed order. */
static inline float lanes_total(const float *s) {
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

static inline int q4_value(const uint8_t *w, int i) { return (i < 16 ? (w[i] & 15) : (w[i - 16] >> 4)) - 8; }

static float row_portable(int q4, const uint8_t *w, const int8_t *qa, const float *da, int64_t nb) {
  float acc[8] = {0};
  int64_t bytes = q4 ? 18 : 34;
  for (int64_t b = 0; b < nb; b++, w += bytes) {
    float sc = scale_of(w) * da[b];
    const int8_t *a = qa + b * 32;
    for (int l = 0; l < 8; l++) {
      int32_t s = 0;
      for (int i = 4 * l; i < 4 * l + 4; i++) s += (q4 ? q4_value(w + 2, i) : ((const int8_t *)(w + 2))[i]) * a[i];
      acc[l] = fmaf((float)s, sc, acc[l]);
    }
  }
  return lanes_total(acc);
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

static inline __m256i q4_bytes(const uint8_t *w) {  /* element j: low nibble of byte j, j + 16: high */
  __m128i x = _mm_loadu_si128((const __m128i *)w);
  __m256i n = _mm256_set_m128i(_mm_srli_epi16(x, 4), x);
  return _mm256_sub_epi8(_mm256_and_si256(n, _mm256_set1_epi8(15)), _mm256_set1_epi8(8));
}

static float row_simd(int q4, const uint8_t *w, const int8_t *qa, const float *da, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  int64_t bytes = q4 ? 18 : 34;
  for (int64_t b = 0; b < nb; b++, w += bytes) {
    __m256i wv = q4 ? q4_bytes(w + 2) : _mm256_loadu_si256((const __m256i *)(w + 2));
    __m256i p = lanes_i8(wv, _mm256_loadu_si256((const __m256i *)(qa + b * 32)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(scale_of(w) * da[b]), acc);
  }
  float s[8];
  _mm256_storeu_ps(s, acc);
  return lanes_total(s);
}

/* Four rows of W at once (decode's matrix-vector products): four independent chains of
   fused multiply-adds hide their latency, and each activation block is loaded once for the
   four. Every row's lanes, scales and order are row_simd's: the same bits. q4_0 multiplies
   the unsigned nibbles (0..15) by the activations and subtracts 8 x the activations' lane
   sums (asum, per block of A): the exact integer lane sums of (q - 8) * a, with no sign
   fix-ups. */
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

static void rows4_simd(int q4, const uint8_t *w, int64_t row_bytes, const int8_t *qa, const float *da,
                       const int32_t *asum, int64_t nb, float *out) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  const uint8_t *w0 = w, *w1 = w + row_bytes, *w2 = w + 2 * row_bytes, *w3 = w + 3 * row_bytes;
  int64_t bytes = q4 ? 18 : 34;
  for (int64_t b = 0; b < nb; b++) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(qa + b * 32));
    __m256i p0, p1, p2, p3;
    int64_t o = b * bytes;
    if (q4) {
      __m256i s8 = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(asum + b * 8)), 3);
      p0 = _mm256_sub_epi32(lanes_u8(q4_nibbles(w0 + o + 2), a), s8);
      p1 = _mm256_sub_epi32(lanes_u8(q4_nibbles(w1 + o + 2), a), s8);
      p2 = _mm256_sub_epi32(lanes_u8(q4_nibbles(w2 + o + 2), a), s8);
      p3 = _mm256_sub_epi32(lanes_u8(q4_nibbles(w3 + o + 2), a), s8);
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
    float d = da[b];
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(scale_of(w0 + o) * d), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(scale_of(w1 + o) * d), acc1);
    acc2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p2), _mm256_set1_ps(scale_of(w2 + o) * d), acc2);
    acc3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p3), _mm256_set1_ps(scale_of(w3 + o) * d), acc3);
  }
  float s[8];
  _mm256_storeu_ps(s, acc0); out[0] = lanes_total(s);
  _mm256_storeu_ps(s, acc1); out[1] = lanes_total(s);
  _mm256_storeu_ps(s, acc2); out[2] = lanes_total(s);
  _mm256_storeu_ps(s, acc3); out[3] = lanes_total(s);
}
#else
#define DTM_SIMD 0
#endif

static float row_q(int q4, const uint8_t *w, const int8_t *qa, const float *da, int64_t nb, int simd) {
#if DTM_SIMD
  if (simd) return row_simd(q4, w, qa, da, nb);
#endif
  (void)simd;
  return row_portable(q4, w, qa, da, nb);
}

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
  int32_t *asum = NULL;
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
    asum = (int32_t *)malloc((size_t)(M * nb * 8 + 1) * sizeof(int32_t));
    if (!qa || !da || !asum) abort();
    for (int64_t i = 0; i < M; i++) quantize_row(A + i * rsa, csa, K, qa + i * K, da + i * nb);
    for (int64_t t = 0; t < M * nb * 8; t++)
      asum[t] = qa[4 * t] + qa[4 * t + 1] + qa[4 * t + 2] + qa[4 * t + 3];
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
          rows4_simd(kind == Q4_0, B + j * row_bytes, row_bytes, qa + i * K, da + i * nb, asum + i * nb * 8, nb,
                     C + i * ldc + j);
#endif
#if DTM_BF16_ROWS4
      if (rows4 && kind == BF16)
        for (; j + 4 <= j1; j += 4)
          rows4_bf16((const uint16_t *)(B + j * row_bytes), row_bytes / 2, fs + i * K, fa + i * K, K, C + i * ldc + j);
#endif
      for (; j < j1; j++) {
        const uint8_t *w = B + j * row_bytes;
        float v = kind == BF16 ? row_bf16((const uint16_t *)w, fa + i * K, K, simd)
                : row_q(kind == Q4_0, w, qa + i * K, da + i * nb, nb, simd);
        C[i * ldc + j] = v;
      }
    }
    if (epi) epi(ctx, bt, 0, M, j0, j1);
  }
  free(qa); free(da); free(fa); free(asum);
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
