/* The compressed collectives' codecs (spec 9.5.1): f32 chunks to q8_0 blocks or bf16 and back.
 *
 * q8_0 is GGML's reference quantizer (quantize_row_q8_0_ref) bit for bit, exactly as
 * dtm/ref/quant.py computes it: amax = max |x| over 32 elements (NaN if one is NaN),
 * d = amax / 127, id = 1/d (0 when d = 0), q = roundf(x * id) with the product in f32 and
 * the rounding half away from zero, clamped to [-128, 127] (NaN -> 0); the block stores
 * f16(d) (round to nearest even), then the 32 int8 q. A chunk's last block is padded with
 * zeros. Decoding gives f32(f16 d * q); `add` variants add that to an f32 accumulator
 * (decoded value + accumulator, in f32: the ring's combine).
 *
 * bf16 rounds each f32 to nearest even (a NaN stays a quiet NaN of the same sign).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* f32 -> f16, round to nearest even (F. Giesen's float_to_half_fast3_rtne). */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x = bits_of(f);
    uint32_t sign = x & 0x80000000u;
    uint16_t o;
    x ^= sign;
    if (x >= 0x47800000u) {                       /* Inf or NaN, or too large: Inf */
        o = x > 0x7f800000u ? (uint16_t)(0x7e00 | ((x >> 13) & 0x3ff)) : 0x7c00;
    } else if (x < 0x38800000u) {                 /* subnormal or zero in f16 */
        float g = float_of(x) + float_of(126u << 23);
        o = (uint16_t)(bits_of(g) - (126u << 23));
    } else {
        uint32_t odd = (x >> 13) & 1;
        x += ((uint32_t)(15 - 127) << 23) + 0xfff;
        x += odd;
        o = (uint16_t)(x >> 13);
    }
    return (uint16_t)((sign >> 16) | o);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t em = h & 0x7fff;
    if (em >= 0x7c00) return float_of(sign | 0x7f800000u | ((em & 0x3ff) << 13));
    if (em < 0x400) {
        float f = (float)em * 5.9604644775390625e-08f; /* em * 2^-24, exact */
        return sign ? -f : f;
    }
    return float_of(sign | ((em + ((127 - 15) << 10)) << 13));
}

#if defined(__AVX2__)
#include <immintrin.h>
/* The same block, 8 lanes at a time: exactly the scalar code's arithmetic. */
static void q8_block(const float *restrict v, uint8_t *restrict out) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 x[4], m = _mm256_setzero_ps(), nanm = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        x[k] = _mm256_loadu_ps(v + 8 * k);
        m = _mm256_max_ps(m, _mm256_and_ps(x[k], absmask));
        nanm = _mm256_or_ps(nanm, _mm256_cmp_ps(x[k], x[k], _CMP_UNORD_Q));
    }
    /* the largest lane (max is exact, so any order gives the scalar loop's value; a NaN
     * lane does not matter, d is NaN then) */
    __m128 h4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h4 = _mm_max_ps(h4, _mm_movehl_ps(h4, h4));
    h4 = _mm_max_ss(h4, _mm_movehdup_ps(h4));
    float amax = _mm_cvtss_f32(h4);
    int nan = _mm256_movemask_ps(nanm) != 0;
    float d = nan ? NAN : amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    uint16_t h = f32_to_f16(d);
    out[0] = (uint8_t)(h & 0xff);
    out[1] = (uint8_t)(h >> 8);
    const __m256 vid = _mm256_set1_ps(id), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    const __m256 signmask = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256 lo = _mm256_set1_ps(-128.0f), hi = _mm256_set1_ps(127.0f);
    __m256i qi[4];
    for (int k = 0; k < 4; k++) {
        __m256 p = _mm256_mul_ps(x[k], vid);
        __m256 t = _mm256_round_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        __m256 frac = _mm256_and_ps(_mm256_sub_ps(p, t), absmask);
        __m256 step = _mm256_or_ps(one, _mm256_and_ps(p, signmask));
        t = _mm256_add_ps(t, _mm256_and_ps(_mm256_cmp_ps(frac, half, _CMP_GE_OQ), step));
        t = _mm256_and_ps(t, _mm256_cmp_ps(p, p, _CMP_ORD_Q));          /* NaN -> 0 */
        t = _mm256_min_ps(_mm256_max_ps(t, lo), hi);
        qi[k] = _mm256_cvttps_epi32(t);
    }
    /* to int8 in order: the values are in [-128, 127] already, so the saturating packs
     * only narrow; they interleave 128-bit lanes, which the permute undoes */
    __m256i q16 = _mm256_packs_epi32(qi[0], qi[1]), r16 = _mm256_packs_epi32(qi[2], qi[3]);
    __m256i q8 = _mm256_packs_epi16(q16, r16);
    q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)(out + 2), q8);
}
#else
static void q8_block(const float *restrict v, uint8_t *restrict out) {
    float amax = 0.0f;
    int nan = 0;
    for (int i = 0; i < 32; i++) {
        float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
        nan |= v[i] != v[i];
    }
    float d = nan ? NAN : amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    uint16_t h = f32_to_f16(d);
    out[0] = (uint8_t)(h & 0xff);
    out[1] = (uint8_t)(h >> 8);
    int8_t *q = (int8_t *)(out + 2);
    for (int i = 0; i < 32; i++) {
        /* roundf(p): |p - trunc(p)| is exact in f32, so this rounds half away from zero exactly */
        float p = v[i] * id;
        float t = truncf(p);
        t = fabsf(p - t) >= 0.5f ? t + copysignf(1.0f, p) : t;
        t = t != t ? 0.0f : t;
        t = t < -128.0f ? -128.0f : t > 127.0f ? 127.0f : t;
        q[i] = (int8_t)(int)t;
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define Q8_GROUP 16
/* max(permute of x and y at ia, at ib): one step of reducing 16 vectors to one */
static inline __m512 max_pair(__m512 x, __m512 y, __m512i ia, __m512i ib) {
    return _mm512_max_ps(_mm512_permutex2var_ps(x, ia, y), _mm512_permutex2var_ps(x, ib, y));
}

/* q = roundf(x * id), half away from zero (|p - trunc(p)| is exact in f32), as int32; with
 * `checked`, NaN -> 0 and clamped to [-128, 127] as q8_block does. */
static inline __attribute__((always_inline)) __m512i q8_round16(__m512 x, __m512 vid, int checked) {
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    const __m512i signbit = _mm512_set1_epi32((int)0x80000000u);
    __m512 p = _mm512_mul_ps(x, vid);
    __m512 t = _mm512_roundscale_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __mmask16 up = _mm512_cmp_ps_mask(_mm512_and_ps(_mm512_sub_ps(p, t), absmask), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    __m512 step = _mm512_or_ps(_mm512_set1_ps(1.0f), _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(p), signbit)));
    t = _mm512_mask_add_ps(t, up, t, step);
    if (checked) {
        t = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(p, p, _CMP_ORD_Q), t);  /* NaN -> 0 */
        t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-128.0f)), _mm512_set1_ps(127.0f));
    }
    return _mm512_cvttps_epi32(t);
}

/* The 16 blocks' bytes: each scale's f16, then its 32 values rounded (q8_round16). */
static inline __attribute__((always_inline)) void q8_store16(const float *restrict v, uint8_t *restrict out,
                                                             const uint16_t *hs, const float *ids, int checked) {
    for (int l = 0; l < 16; l++) {
        uint8_t *o = out + 34 * l;
        memcpy(o, hs + l, 2);
        __m512 vid = _mm512_set1_ps(ids[l]);
        for (int k = 0; k < 2; k++)
            _mm_storeu_si128((__m128i *)(o + 2 + 16 * k),
                             _mm512_cvtepi32_epi8(q8_round16(_mm512_loadu_ps(v + 32 * l + 16 * k), vid, checked)));
    }
}

/* Sixteen blocks (512 values) at once, q8_block's arithmetic to the bit. The blocks' maxima
 * are reduced together, halving the lanes each block holds four times (lane l of the last
 * vector: block l), so the scale's division, its reciprocal and its f16 rounding (vcvtps2ph,
 * round to nearest even as f32_to_f16) run once for the 16; then each block's values go 16
 * lanes at a time. One pass over the values: they are read again from L1. */
static void q8_blocks16(const float *restrict v, uint8_t *restrict out) {
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 m[16];
    __mmask16 nan = 0;
    for (int l = 0; l < 16; l++) {
        __m512 x0 = _mm512_loadu_ps(v + 32 * l), x1 = _mm512_loadu_ps(v + 32 * l + 16);
        m[l] = _mm512_max_ps(_mm512_and_ps(x0, absmask), _mm512_and_ps(x1, absmask));
        nan |= (__mmask16)((_mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q)) != 0) << l;
    }
    /* groups of 8 lanes per block, then 4, 2, 1 (index bit 4 picks the second vector) */
    const __m512i a8 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i b8 = _mm512_add_epi32(a8, _mm512_set1_epi32(8));
    const __m512i a4 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i b4 = _mm512_add_epi32(a4, _mm512_set1_epi32(4));
    const __m512i a2 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
    const __m512i b2 = _mm512_add_epi32(a2, _mm512_set1_epi32(2));
    const __m512i a1 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i b1 = _mm512_add_epi32(a1, _mm512_set1_epi32(1));
    for (int k = 0; k < 8; k++) m[k] = max_pair(m[2 * k], m[2 * k + 1], a8, b8);
    for (int k = 0; k < 4; k++) m[k] = max_pair(m[2 * k], m[2 * k + 1], a4, b4);
    for (int k = 0; k < 2; k++) m[k] = max_pair(m[2 * k], m[2 * k + 1], a2, b2);
    __m512 amax = max_pair(m[0], m[1], a1, b1);
    /* (a NaN lane of amax does not matter: d is NaN there, as the scalar code sets it) */
    __m512 d = _mm512_mask_mov_ps(_mm512_div_ps(amax, _mm512_set1_ps(127.0f)), nan, _mm512_set1_ps(NAN));
    __m512 id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_UQ), _mm512_set1_ps(1.0f), d);
    float ids[16];
    uint16_t hs[16];
    _mm512_storeu_ps(ids, id);
    _mm256_storeu_si256((__m256i *)hs, _mm512_cvtps_ph(d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    /* Blocks whose scale and its reciprocal are finite and that hold no NaN (all but
     * blocks with a NaN, an infinity or a subnormal scale) give finite products within
     * +-127.00002, so neither the NaN -> 0 step nor the clamp can change them: skipped. */
    int plain = !nan && _mm512_cmp_ps_mask(d, _mm512_set1_ps(3.402823466e38f), _CMP_LE_OQ) == 0xffff
                && _mm512_cmp_ps_mask(id, _mm512_set1_ps(3.402823466e38f), _CMP_LE_OQ) == 0xffff;
    if (plain) q8_store16(v, out, hs, ids, 0);
    else q8_store16(v, out, hs, ids, 1);
}
#endif

/* n f32 values -> ceil(n/32) blocks of 34 bytes. */
void dtm_q8_encode(const float *x, int64_t n, uint8_t *out) {
    int64_t full = n / 32, b = 0;
#if defined(Q8_GROUP)
    for (; b + Q8_GROUP <= full; b += Q8_GROUP) q8_blocks16(x + 32 * b, out + 34 * b);
#endif
    for (; b < full; b++) q8_block(x + 32 * b, out + 34 * b);
    if (n % 32) {
        float v[32] = {0};
        memcpy(v, x + 32 * full, sizeof(float) * (size_t)(n % 32));
        q8_block(v, out + 34 * full);
    }
}

/* acc[i] = (add ? acc[i] : 0) + f32(d * q[i]) for the n values of the blocks at `in`. */
static void q8_decode(const uint8_t *in, int64_t n, float *acc, int add) {
    int64_t b = 0;
#if defined(__AVX2__)
    for (; 32 * b + 32 <= n; b++) {  /* whole blocks, 8 lanes at a time: the same product and sum */
        const uint8_t *blk = in + 34 * b;
        __m256 d = _mm256_set1_ps(f16_to_f32((uint16_t)(blk[0] | (blk[1] << 8))));
        float *a = acc + 32 * b;
        for (int k = 0; k < 4; k++) {
            __m128i q = _mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * k));
            __m256 v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
            if (add) v = _mm256_add_ps(v, _mm256_loadu_ps(a + 8 * k));
            _mm256_storeu_ps(a + 8 * k, v);
        }
    }
#endif
    for (; b * 32 < n; b++) {
        const uint8_t *blk = in + 34 * b;
        float d = f16_to_f32((uint16_t)(blk[0] | (blk[1] << 8)));
        const int8_t *q = (const int8_t *)(blk + 2);
        int64_t k = n - 32 * b < 32 ? n - 32 * b : 32;
        float *a = acc + 32 * b;
        if (add) {
            for (int64_t i = 0; i < k; i++) a[i] = d * (float)q[i] + a[i];
        } else {
            for (int64_t i = 0; i < k; i++) a[i] = d * (float)q[i];
        }
    }
}

void dtm_q8_decode(const uint8_t *in, int64_t n, float *out) { q8_decode(in, n, out, 0); }
void dtm_q8_decode_add(const uint8_t *in, int64_t n, float *acc) { q8_decode(in, n, acc, 1); }

/* acc[i] += f32(d * q[i]), then the n values are encoded again into `out` (one ring hop),
 * and with `keep` decoded back into acc (a finished chunk: its owner keeps the values the
 * others get); 16 blocks at a time where the group encoder is, so that the sums are encoded
 * (and read back) while they are in L1 rather than in passes of their own over memory. */
void dtm_q8_add_encode(const uint8_t *in, int64_t n, float *acc, uint8_t *out, int32_t keep) {
    int64_t b = 0;
#if defined(Q8_GROUP)
    for (; 32 * (b + Q8_GROUP) <= n; b += Q8_GROUP) {
        q8_decode(in + 34 * b, 32 * Q8_GROUP, acc + 32 * b, 1);
        q8_blocks16(acc + 32 * b, out + 34 * b);
        if (keep) q8_decode(out + 34 * b, 32 * Q8_GROUP, acc + 32 * b, 0);
    }
#endif
    q8_decode(in + 34 * b, n - 32 * b, acc + 32 * b, 1);
    dtm_q8_encode(acc + 32 * b, n - 32 * b, out + 34 * b);
    if (keep) q8_decode(out + 34 * b, n - 32 * b, acc + 32 * b, 0);
}

void dtm_bf16_encode(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = bits_of(x[i]);
        if ((u & 0x7fffffffu) > 0x7f800000u) out[i] = (uint16_t)((u >> 16) | 0x40);
        else out[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
    }
}

void dtm_bf16_decode(const uint16_t *in, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = float_of((uint32_t)in[i] << 16);
}

void dtm_bf16_decode_add(const uint16_t *in, int64_t n, float *acc) {
    for (int64_t i = 0; i < n; i++) acc[i] = float_of((uint32_t)in[i] << 16) + acc[i];
}
