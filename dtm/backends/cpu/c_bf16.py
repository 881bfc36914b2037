"""The runtime library for products of two bf16 operands with f32 sums (autocast's products,
and any f32 product whose operands are both widened bf16 values: widen.py, schedule.py).

    C[M, N] = A[M, K] @ B[K, N],  A and B bf16 (their bits, uint16),  C f32

The reference defines a bf16 product as the f32 product of the widened operands, rounded
once to bf16 (dtm.ref.ops): the product of two bf16 values is exact in f32, so the only
roundings are the f32 sums', as here. A bf16 result is the f32 one cast by the kernel after
the product.

The layout follows the f32 library's (c_runtime.py: BLIS's loops, an MR x NR register tile,
panels of B packed NC wide and KC deep, threads one band each, the epilogue on each finished
block with whole rows when N <= WHOLE_ROWS) with one change: the contracted dim goes in
pairs. A 32-bit lane holds elements k and k + 1 (the even one in the low half) of a row of A
or a column of B; B is packed as [KC / 2][NR] such lanes, a packed A as [KC / 2][MR]; a
row-major A is read in place (its pairs are adjacent), a transposed B (a Linear's weight) by
a 16 x 16 transpose of 32-bit lanes. An odd K ends with a pair whose odd half is zero.

The microkernel, chosen once per process (`dtm_rt_bf16_kernel`):
  - avx512bf16: vdpbf16ps (`_mm512_dpbf16_ps`), where -march=native offers AVX512-BF16: each
    lane adds a_odd * b_odd, then a_even * b_even, into its f32 sum (two f32 roundings; the
    instruction treats denormal inputs and results as zero);
  - portable: the same two steps in C (GCC vector extensions), the pair widened by shifts:
    the same sums bit for bit for normal numbers. DTM_BF16_PORTABLE=1 in the environment or
    `dtm_rt_bf16_force(0)` (build.bf16_forced, for tests) selects it where the CPU has the
    instructions.
AMX-BF16 (tdpbf16ps) is detected (`compiler_offers("amx")` in dtm/toolchain) but has no kernel
yet: where a CPU has it, the AVX512-BF16 kernel runs.
"""

from __future__ import annotations

from .c_runtime import _PRELUDE, WHOLE_ROWS

VERSION = 1

HEADER = ("typedef void (*dtm_epilogue_fn)(const void *ctx, int64_t bt, int64_t i0, int64_t i1, int64_t j0, int64_t j1);\n"
          "void dtm_rt_gemm_bf16(int64_t nbatch, const int64_t *offs, int64_t M, int64_t N, int64_t K,\n"
          "                      const uint16_t *A, int64_t rsa, int64_t csa, const uint16_t *B, int64_t rsb,\n"
          "                      int64_t csb, float *C, int64_t ldc, dtm_epilogue_fn epi, const void *ctx);\n"
          "int dtm_rt_version_bf16(void);")

MR, NR, NC, KC = 12, 32, 1024, 512  # KC in elements of K (KC / 2 pairs): a 12 x 512 sliver of A is 12 KB

KERNELS = {0: "portable", 1: "avx512bf16", 2: "amx"}


def _micro(name: str, native: bool, rows: bool) -> str:
    """The MR x NR tile C[m, n] (+)= A @ Bp over kc elements of K: `rows` reads A in place
    (row r at A + r * rsa, rows past m read row 0), else from its packed sliver."""
    r_ = range(MR)
    if native:
        acc = "\n".join(f"  __m512 c{r}0 = _mm512_setzero_ps(), c{r}1 = _mm512_setzero_ps();" for r in r_)
        load_b = ("    __m512bh b0 = (__m512bh)_mm512_loadu_si512((const void *)Bp), "
                  "b1 = (__m512bh)_mm512_loadu_si512((const void *)(Bp + 32));")

        def step(r: int, pair: str) -> str:
            return (f"    {{ __m512bh a = (__m512bh)_mm512_set1_epi32((int)({pair})); c{r}0 = _mm512_dpbf16_ps(c{r}0, a, b0); "
                    f"c{r}1 = _mm512_dpbf16_ps(c{r}1, a, b1); }}")
        vec, store0, store1 = "__m512", "_mm512_storeu_ps", "_mm512_storeu_ps"
    else:
        acc = "\n".join(f"  dtm_bf_f c{r}0 = {{0}}, c{r}1 = {{0}};" for r in r_)
        load_b = ("    dtm_bf_u u0, u1; memcpy(&u0, Bp, 64); memcpy(&u1, Bp + 32, 64);\n"
                  "    dtm_bf_f b0l = dtm_bf_lo(u0), b0h = dtm_bf_hi(u0), b1l = dtm_bf_lo(u1), b1h = dtm_bf_hi(u1);")

        def step(r: int, pair: str) -> str:
            return (f"    {{ uint32_t p = {pair}; float al = dtm_bf_lo1(p), ah = dtm_bf_hi1(p); "
                    f"c{r}0 = c{r}0 + ah * b0h; c{r}0 = c{r}0 + al * b0l; c{r}1 = c{r}1 + ah * b1h; c{r}1 = c{r}1 + al * b1l; }}")
        vec = "dtm_bf_f"
    if rows:
        head = "\n".join(f"  const uint16_t *a{r} = A + (m > {r} ? {r} : 0) * rsa;" for r in r_)
        loop = (f"  int64_t kp = kc / 2;\n#pragma GCC unroll 2\n  for (int64_t kk = 0; kk < kp; kk++) {{\n{load_b}\n"
                + "\n".join(step(r, f"dtm_ld32(a{r} + 2 * kk)") for r in r_) + "\n    Bp += 64;\n  }\n"
                + f"  if (kc & 1) {{\n{load_b}\n" + "\n".join(step(r, f"(uint32_t)a{r}[kc - 1]") for r in r_) + "\n  }")
        sig = (f"static void {name}(int64_t kc, const uint16_t *A, int64_t rsa, const uint16_t *restrict Bp, "
               "float *C, int64_t ldc, int acc, int64_t m, int64_t n)")
    else:
        head = "  const uint32_t *Ap32 = (const uint32_t *)A;\n  (void)rsa;"
        loop = (f"  int64_t kp = (kc + 1) / 2;\n#pragma GCC unroll 2\n  for (int64_t kk = 0; kk < kp; kk++) {{\n{load_b}\n"
                + "\n".join(step(r, f"Ap32[{r}]") for r in r_) + f"\n    Ap32 += {MR}; Bp += 64;\n  }}")
        sig = (f"static void {name}(int64_t kc, const uint16_t *A, int64_t rsa, const uint16_t *restrict Bp, "
               "float *C, int64_t ldc, int acc, int64_t m, int64_t n)")
    if native:
        full = "\n".join(f"    ST({r}, c{r}0, c{r}1)" for r in r_)
        store = f"""  if (m == {MR} && n == {NR}) {{
#define ST(r, x0, x1) {{ float *p = C + r * ldc; if (acc) {{ x0 = _mm512_add_ps(x0, _mm512_loadu_ps(p)); \\
    x1 = _mm512_add_ps(x1, _mm512_loadu_ps(p + 16)); }} {store0}(p, x0); {store1}(p + 16, x1); }}
{full}
#undef ST
  }} else {{
    float t[{MR}][{NR}] __attribute__((aligned(64)));
#define ST(r, x0, x1) {{ _mm512_store_ps(&t[r][0], x0); _mm512_store_ps(&t[r][16], x1); }}
{full}
#undef ST
    for (int64_t r = 0; r < m; r++)
      for (int64_t c = 0; c < n; c++) C[r * ldc + c] = acc ? C[r * ldc + c] + t[r][c] : t[r][c];
  }}"""
    else:
        full = "\n".join(f"    ST({r}, c{r}0, c{r}1)" for r in r_)
        store = f"""  {{
    float t[{MR}][{NR}] __attribute__((aligned(64)));
#define ST(r, x0, x1) {{ memcpy(&t[r][0], &x0, 64); memcpy(&t[r][16], &x1, 64); }}
{full}
#undef ST
    for (int64_t r = 0; r < m; r++)
      for (int64_t c = 0; c < n; c++) C[r * ldc + c] = acc ? C[r * ldc + c] + t[r][c] : t[r][c];
  }}"""
    del vec
    return f"{sig} {{\n{head}\n{acc}\n{loop}\n{store}\n}}\n"


_BODY = r"""
#define WHOLE_ROWS @WHOLE_ROWS@
#define BMR @MR@
#define BNR @NR@
#define BNC @NC@
#define BKC @KC@
int dtm_rt_version_bf16(void) { return @VERSION@; }

typedef uint32_t dtm_bf_u __attribute__((vector_size(64)));
typedef float dtm_bf_f __attribute__((vector_size(64)));
static inline uint32_t dtm_ld32(const uint16_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline dtm_bf_f dtm_bf_lo(dtm_bf_u x) { dtm_bf_u t = x << 16; dtm_bf_f f; memcpy(&f, &t, 64); return f; }
static inline dtm_bf_f dtm_bf_hi(dtm_bf_u x) { dtm_bf_u t = x & 0xffff0000u; dtm_bf_f f; memcpy(&f, &t, 64); return f; }
static inline float dtm_bf_lo1(uint32_t x) { uint32_t t = x << 16; float f; memcpy(&f, &t, 4); return f; }
static inline float dtm_bf_hi1(uint32_t x) { uint32_t t = x & 0xffff0000u; float f; memcpy(&f, &t, 4); return f; }

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define DTM_BF16_NATIVE 1
#else
#define DTM_BF16_NATIVE 0
#endif

typedef void (*dtm_bf_micro)(int64_t kc, const uint16_t *A, int64_t rsa, const uint16_t *restrict Bp, float *C,
                             int64_t ldc, int acc, int64_t m, int64_t n);

@MICRO@

static int forced = -1;  /* dtm_rt_bf16_force: -1 none */

/* The kernel that runs: 1 (avx512bf16) where the library was built with the instructions,
   unless DTM_BF16_PORTABLE=1 (read once) or dtm_rt_bf16_force(0) asks for 0 (portable). */
int dtm_rt_bf16_kernel(void) {
  static int env = -1;
  if (forced >= 0) return forced;
  if (env < 0) {
    const char *e = getenv("DTM_BF16_PORTABLE");
    env = e && *e && strcmp(e, "0") != 0;
  }
  return DTM_BF16_NATIVE && !env ? 1 : 0;
}

/* -1: the default choice again; 0: portable; 1: avx512bf16 where built with it. */
void dtm_rt_bf16_force(int kernel) { forced = kernel == 1 && !DTM_BF16_NATIVE ? 0 : kernel; }

/* kc x nc of B (element (k, j) at B[k * rs + j * cs]) as NR-wide slivers of pairs:
   Bp[sliver][kk][c] = B[2kk, c] | B[2kk + 1, c] << 16 (zero past kc and nc). */
static void pack_b(const uint16_t *B, int64_t rs, int64_t cs, int64_t kc, int64_t nc, uint16_t *restrict Bp) {
  int64_t kp = (kc + 1) / 2;
  for (int64_t j = 0; j < nc; j += BNR, Bp += 2 * BNR * kp) {
    int64_t n = dtm_min(BNR, nc - j);
    const uint16_t *b = B + j * cs;
    uint32_t *p = (uint32_t *)Bp;
    int64_t kk = 0;
#if defined(__AVX512F__)
    if (n == BNR && rs == 1 && (cs & 1) == 0) {  /* columns contiguous (a Linear's weight): 32-bit lanes transposed */
      for (; kk + 16 <= kc / 2; kk += 16)
        for (int c = 0; c < BNR; c += 16)
          dtm_transpose16_f32((const float *)(b + c * cs + 2 * kk), cs / 2, (float *)(p + kk * BNR + c), BNR);
    } else if (n == BNR && cs == 1) {  /* rows contiguous: two rows' 16 elements widened and interleaved */
      for (; kk < kc / 2; kk++) {
        const uint16_t *r0 = b + 2 * kk * rs, *r1 = r0 + rs;
        for (int c = 0; c < BNR; c += 16) {
          __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r0 + c)));
          __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r1 + c)));
          _mm512_storeu_si512((void *)(p + kk * BNR + c), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
      }
    }
#endif
    for (; kk < kp; kk++) {
      int64_t k = 2 * kk;
      for (int64_t c = 0; c < n; c++) {
        uint32_t lo = b[k * rs + c * cs], hi = k + 1 < kc ? b[(k + 1) * rs + c * cs] : 0;
        p[kk * BNR + c] = lo | hi << 16;
      }
      for (int64_t c = n; c < BNR; c++) p[kk * BNR + c] = 0;
    }
  }
}

/* mc x kc of A as MR-high slivers of pairs: Ap[sliver][kk][r] (zero past kc and mc). */
static void pack_a(const uint16_t *A, int64_t rs, int64_t cs, int64_t mc, int64_t kc, uint16_t *restrict Ap) {
  int64_t kp = (kc + 1) / 2;
  for (int64_t i = 0; i < mc; i += BMR, Ap += 2 * BMR * kp) {
    int64_t m = dtm_min(BMR, mc - i);
    uint32_t *p = (uint32_t *)Ap;
    for (int64_t kk = 0; kk < kp; kk++) {
      int64_t k = 2 * kk;
      const uint16_t *a0 = A + i * rs + k * cs, *a1 = a0 + cs;
      int odd = k + 1 < kc;
      for (int64_t r = 0; r < m; r++) p[kk * BMR + r] = (uint32_t)a0[r * rs] | (odd ? (uint32_t)a1[r * rs] << 16 : 0);
      for (int64_t r = m; r < BMR; r++) p[kk * BMR + r] = 0;
    }
  }
}

static __thread void *tl_a, *tl_b;
static __thread size_t tl_na, tl_nb;

static void gemm_serial(int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t rsa, int64_t csa,
                        const uint16_t *B, int64_t rsb, int64_t csb, float *C, int64_t ldc,
                        dtm_epilogue_fn epi, const void *ctx, int64_t bt, int64_t i0, int64_t j0) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t i = 0; i < M; i++) memset(C + i * ldc, 0, (size_t)N * sizeof(float));
    if (epi) epi(ctx, bt, i0, i0 + M, j0, j0 + N);
    return;
  }
  int native = dtm_rt_bf16_kernel() == 1;
  dtm_bf_micro micro = native ? micro_native : micro_portable;
  dtm_bf_micro micro_rows = native ? micro_rows_native : micro_rows_portable;
  int64_t ncap = dtm_min(BNC, (N + BNR - 1) / BNR * BNR), kcap = dtm_min(BKC, K) + 1;
  uint16_t *Bp = (uint16_t *)dtm_scratch(&tl_b, &tl_nb, (size_t)kcap * ncap * sizeof(uint16_t));
  uint16_t *Ap = (uint16_t *)dtm_scratch(&tl_a, &tl_na, (size_t)kcap * (MC + BMR) * sizeof(uint16_t));
  if (!Ap || !Bp) abort();
  for (int64_t jc = 0; jc < N; jc += BNC) {
    int64_t nc = dtm_min(BNC, N - jc);
    for (int64_t pc = 0; pc < K; pc += BKC) {
      int64_t kc = dtm_min(BKC, K - pc), kp = (kc + 1) / 2;
      int last = pc + kc >= K;
      pack_b(B + pc * rsb + jc * csb, rsb, csb, kc, nc, Bp);
      for (int64_t ic = 0; ic < M; ic += MC) {
        int64_t mc = dtm_min(MC, M - ic);
        if (csa != 1) pack_a(A + ic * rsa + pc * csa, rsa, csa, mc, kc, Ap);
        for (int64_t ir = 0; ir < mc; ir += BMR)
          for (int64_t jr = 0; jr < nc; jr += BNR) {
            float *c = C + (ic + ir) * ldc + jc + jr;
            int64_t m = dtm_min(BMR, mc - ir), n = dtm_min(BNR, nc - jr);
            if (csa == 1)
              micro_rows(kc, A + (ic + ir) * rsa + pc, rsa, Bp + 2 * jr * kp, c, ldc, pc > 0, m, n);
            else
              micro(kc, Ap + 2 * ir * kp, 0, Bp + 2 * jr * kp, c, ldc, pc > 0, m, n);
          }
        if (last && epi) epi(ctx, bt, i0 + ic, i0 + ic + mc, j0 + jc, j0 + jc + nc);
      }
    }
  }
}

void dtm_rt_gemm_bf16(int64_t nbatch, const int64_t *offs, int64_t M, int64_t N, int64_t K,
                      const uint16_t *A, int64_t rsa, int64_t csa, const uint16_t *B, int64_t rsb, int64_t csb,
                      float *C, int64_t ldc, dtm_epilogue_fn epi, const void *ctx) {
  double work = (double)M * (double)N * (double)(K > 0 ? K : 1);
  int threads = omp_get_max_threads();
  if (nbatch > 1 && (work < 4e6 || nbatch >= 4 * threads)) {  /* one product per thread */
#pragma omp parallel for schedule(static) if(work * nbatch >= 2e5)
    for (int64_t bt = 0; bt < nbatch; bt++)
      gemm_serial(M, N, K, A + offs[3 * bt], rsa, csa, B + offs[3 * bt + 1], rsb, csb, C + offs[3 * bt + 2], ldc,
                  epi, ctx, bt, 0, 0);
    return;
  }
  for (int64_t bt = 0; bt < nbatch; bt++) {  /* each product split into one band per thread */
    const uint16_t *a = A + offs[3 * bt], *b = B + offs[3 * bt + 1];
    float *c = C + offs[3 * bt + 2];
    int nt = work < 2e5 ? 1 : threads;
#pragma omp parallel num_threads(nt)
    {
      int t = omp_get_thread_num(), n = omp_get_num_threads();
      if (M > N || N <= WHOLE_ROWS) {  /* by rows; by columns only rows too wide for an epilogue to see whole */
        int64_t per = ((M + n - 1) / n + BMR - 1) / BMR * BMR;
        int64_t m0 = dtm_min(M, t * per), m1 = dtm_min(M, m0 + per);
        gemm_serial(m1 - m0, N, K, a + m0 * rsa, rsa, csa, b, rsb, csb, c + m0 * ldc, ldc, epi, ctx, bt, m0, 0);
      } else {
        int64_t per = ((N + n - 1) / n + BNR - 1) / BNR * BNR;
        int64_t n0 = dtm_min(N, t * per), n1 = dtm_min(N, n0 + per);
        gemm_serial(M, n1 - n0, K, a, rsa, csa, b + n0 * csb, rsb, csb, c + n0, ldc, epi, ctx, bt, 0, n0);
      }
    }
  }
}
"""


def _source() -> str:
    micro = (_micro("micro_portable", False, False) + _micro("micro_rows_portable", False, True)
             + "#if DTM_BF16_NATIVE\n" + _micro("micro_native", True, False) + _micro("micro_rows_native", True, True)
             + "#else\n#define micro_native micro_portable\n#define micro_rows_native micro_rows_portable\n#endif\n")
    body = _BODY.replace("@MICRO@", micro)
    for k, v in {"WHOLE_ROWS": WHOLE_ROWS, "MR": MR, "NR": NR, "NC": NC, "KC": KC, "VERSION": VERSION}.items():
        body = body.replace(f"@{k}@", str(v))
    return "/* DTM runtime library: bf16 x bf16 -> f32 products. */\n" + _PRELUDE + "\n" + HEADER + "\n" + body


SOURCE = _source()
