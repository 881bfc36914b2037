"""The C runtime libraries the kernels call: a tiled matrix product (and, called from the
plan, scatter_add's accumulation), one library for f32 and one for f64 (`SOURCES`).

Each is built once (and cached like any kernel), only for programs whose products use its
type, and loaded with RTLD_GLOBAL before the first kernel that calls it; `HEADER` is pasted
into every kernel that does, so a change of the ABI changes those kernels' sources (and
cache keys) too.

The product follows the BLIS design: for each NC-wide panel of B and each KC-deep slice of
the contracted dim, B is packed into NR-wide column slivers (a row-major B read row by row;
a transposed one, a Linear's weight, 16 x 16 at a time in registers where AVX-512 is
available). A register-blocked MR x NR microkernel (2 * MR vector accumulators, written
with GCC vector extensions so that -march=native picks AVX2/FMA, AVX-512 or NEON) runs each
MR-high sliver of A against every sliver of the panel of B in turn: the A sliver stays in
L1, B streams from L2 (BLIS's order), and the tile of C is fetched as each tile starts. A
row-major A is read in place (`micro_rows`: its MR rows' lines stay in L1 across the k
loop); any other A is packed into slivers, MC rows at a time (a transposed A row by row of
the matrix it transposes). Partial tiles go through a small buffer.

Threads split the output into one band each, each packing its own operands: no barriers.
The split is by rows when M > N or N <= WHOLE_ROWS, else by columns: each thread then reads
the whole of the operand along the other dim, so that one should be the smaller (at M = N
columns win: a band of columns repeats only the reading of a row-major A in place, a band of
rows the packing of B; 2048^2 went 0.91-0.94x -> 0.99-1.04x torch, alternated runs).
Packing B once for both threads, each half of every panel, was slower (0.79x at 256): each
thread then reads half its panel from the other core's L2.

A product whose contracted dim is at least twice its longer side (a weight's gradient,
X^T @ dY) is split along the contracted dim instead: each thread packs only its own rows of
X and dY (those it wrote, in the kernel before), and the partial products are summed by rows
after one barrier. A batch of small products runs one product per thread instead, each
thread a contiguous share of the batch (static: the rows a band split left in its cache;
dynamic scheduling measured 1.2-1.4x slower in a training step).

The epilogue callback runs on each finished block (after the last slice of the contracted
dim; after the sum, for a split one), on the thread that computed it. A product of more than
one row and at most WHOLE_ROWS columns gives its epilogue whole rows (j0 = 0, j1 = N), so
that a reduction along a row (softmax over attention scores) can run there, while the block
is in cache.

A product with one row (decoding one token) is a matrix-vector product without packing, its
columns split between the threads: two dot products at a time when B's columns are
contiguous (a Linear's weight; memory read in two streams at once runs faster than in four),
the columns two pairs on prefetched; rows of B added into an L2-sized block of C when its
rows are. Both are bound by memory. A product of a few rows (a
short prompt, a batch of sequences decoding) goes the same way (`gemv_few`), each vector of
B read once for all the rows: packing B for them cost a batch of two 2.6x one row's time.
The dot products' vectors are summed lane by lane in a tree of shuffles (`lane_sums`), the
same tree for one row and for a few, so a row's result does not depend on its company.
"""

import re

HEADER = r"""typedef void (*dtm_epilogue_fn)(const void *ctx, int64_t bt, int64_t i0, int64_t i1, int64_t j0, int64_t j1);
void dtm_rt_gemm_f32(int64_t nbatch, const int64_t *offs, int64_t M, int64_t N, int64_t K,
                     const float *A, int64_t rsa, int64_t csa, const float *B, int64_t rsb, int64_t csb,
                     float *C, int64_t ldc, dtm_epilogue_fn epi, const void *ctx);
void dtm_rt_gemm_f64(int64_t nbatch, const int64_t *offs, int64_t M, int64_t N, int64_t K,
                     const double *A, int64_t rsa, int64_t csa, const double *B, int64_t rsb, int64_t csb,
                     double *C, int64_t ldc, dtm_epilogue_fn epi, const void *ctx);
int dtm_rt_version_f32(void);
int dtm_rt_version_f64(void);"""

VERSION = 16
# the widest product whose epilogue is always given whole rows (when it has more than one row):
# below every NC, and never split by columns between threads
WHOLE_ROWS = 256

_TEMPLATE = r"""
/* ---- the product for SUF: element T, vector V of VW elements, NR = 2 * VW ---- */
typedef T V __attribute__((vector_size(VW * sizeof(T))));
typedef T V##u __attribute__((vector_size(VW * sizeof(T)), aligned(sizeof(T))));
#define NR_SUF (2 * VW)

#if !DTM_AVX2
static inline V BC_SUF(const T *p) { V v; for (int i = 0; i < VW; i++) v[i] = *p; return v; }
#define FMA_SUF(a, b, c) ((a) * (b) + (c))
#endif

/* mc rows of an A that is not row-major (gemm_serial reads a row-major one in place) as
   MR-high slivers, kc deep. */
static void pack_a_SUF(const T *A, int64_t rs, int64_t cs, int64_t mc, int64_t kc, T *restrict Ap) {
  if (rs == 1) {  /* A transposed (X^T in a weight's gradient): each row of X read once, in order */
    for (int64_t k = 0; k < kc; k++) {
      const T *a = A + k * cs;
      T *p = Ap + k * MR;
      int64_t i = 0;
      for (; i + MR <= mc; i += MR, p += kc * MR) memcpy(p, a + i, MR * sizeof(T));  /* inlined: a constant size */
      if (i < mc) {
        for (int64_t r = 0; r < mc - i; r++) p[r] = a[i + r];
        for (int64_t r = mc - i; r < MR; r++) p[r] = 0;
      }
    }
    return;
  }
  for (int64_t i = 0; i < mc; i += MR) {  /* any other strides (a row-major A is never packed) */
    int64_t m = dtm_min(MR, mc - i);
    const T *a = A + i * rs;
    for (int64_t k = 0; k < kc; k++, Ap += MR) {
      for (int64_t r = 0; r < m; r++) Ap[r] = a[r * rs + k * cs];
      for (int64_t r = m; r < MR; r++) Ap[r] = 0;
    }
  }
}

static void pack_b_SUF(const T *B, int64_t rs, int64_t cs, int64_t kc, int64_t nc, T *restrict Bp) {
  int64_t full = cs == 1 ? nc / NR_SUF * NR_SUF : 0;
  for (int64_t k = 0; k < kc; k++) {  /* rows contiguous: each read once, in order, two vectors per sliver */
    const T *b = B + k * rs;
    T *p = Bp + k * NR_SUF;
    for (int64_t j = 0; j < full; j += NR_SUF, p += kc * NR_SUF) {
      *(V *)p = *(const V##u *)(b + j);
      *(V *)(p + VW) = *(const V##u *)(b + j + VW);
    }
  }
  Bp += full * kc;
  for (int64_t j = full; j < nc; j += NR_SUF) {
    int64_t n = dtm_min(NR_SUF, nc - j);
    const T *b = B + j * cs;
    if (n == NR_SUF && rs == 1) {  /* B transposed (a Linear's weight): columns are contiguous */
      int64_t k0 = 0;
#ifdef TRANSPOSE16_SUF
      for (; k0 + 16 <= kc; k0 += 16)
        for (int c = 0; c < NR_SUF; c += 16) TRANSPOSE16_SUF(b + c * cs + k0, cs, Bp + k0 * NR_SUF + c, NR_SUF);
#endif
      for (; k0 < kc; k0 += 16) {  /* in 16-deep blocks: the tile written stays in L1 */
        int64_t k1 = dtm_min(kc, k0 + 16);
        for (int c = 0; c < NR_SUF; c++)
          for (int64_t k = k0; k < k1; k++) Bp[k * NR_SUF + c] = b[c * cs + k];
      }
      Bp += kc * NR_SUF;
    } else {
      for (int64_t k = 0; k < kc; k++, Bp += NR_SUF) {
        for (int64_t c = 0; c < n; c++) Bp[c] = b[k * rs + c * cs];
        for (int64_t c = n; c < NR_SUF; c++) Bp[c] = 0;
      }
    }
  }
}

MICRO_KERNEL
static __thread void *tl_a_SUF, *tl_b_SUF;
static __thread size_t tl_na_SUF, tl_nb_SUF;

/* C[M, N] = A[M, K] @ B[K, N] on this thread; its block (i, j) is block (i0 + i, j0 + j) of
   the whole product, which is what the epilogue is told. */
static void gemm_serial_SUF(int64_t M, int64_t N, int64_t K, const T *A, int64_t rsa, int64_t csa,
                            const T *B, int64_t rsb, int64_t csb, T *C, int64_t ldc,
                            dtm_epilogue_fn epi, const void *ctx, int64_t bt, int64_t i0, int64_t j0) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int64_t i = 0; i < M; i++) memset(C + i * ldc, 0, (size_t)N * sizeof(T));
    if (epi) epi(ctx, bt, i0, i0 + M, j0, j0 + N);
    return;
  }
  int64_t ncap = dtm_min(NC_SUF, (N + NR_SUF - 1) / NR_SUF * NR_SUF), kcap = dtm_min(KC, K);
  T *Bp = (T *)dtm_scratch(&tl_b_SUF, &tl_nb_SUF, (size_t)kcap * ncap * sizeof(T));
  T *Ap = (T *)dtm_scratch(&tl_a_SUF, &tl_na_SUF, (size_t)kcap * (MC + MR) * sizeof(T));
  if (!Ap || !Bp) abort();
  for (int64_t jc = 0; jc < N; jc += NC_SUF) {
    int64_t nc = dtm_min(NC_SUF, N - jc);
    for (int64_t pc = 0; pc < K; pc += KC) {
      int64_t kc = dtm_min(KC, K - pc);
      int last = pc + kc >= K;
      pack_b_SUF(B + pc * rsb + jc * csb, rsb, csb, kc, nc, Bp);
      for (int64_t ic = 0; ic < M; ic += MC) {
        int64_t mc = dtm_min(MC, M - ic);
        if (csa != 1) pack_a_SUF(A + ic * rsa + pc * csa, rsa, csa, mc, kc, Ap);
        for (int64_t ir = 0; ir < mc; ir += MR)  /* a sliver of A stays in L1, B's stream from L2 */
          for (int64_t jr = 0; jr < nc; jr += NR_SUF) {
            T *c = C + (ic + ir) * ldc + jc + jr;
            int64_t m = dtm_min(MR, mc - ir), n = dtm_min(NR_SUF, nc - jr);
            if (csa == 1)  /* rows of A contiguous: read in place */
              micro_rows_SUF(kc, A + (ic + ir) * rsa + pc, rsa, Bp + jr * kc, c, ldc, pc > 0, m, n);
            else
              micro_SUF(kc, Ap + ir * kc, Bp + jr * kc, c, ldc, pc > 0, m, n);
          }
        if (last && epi) epi(ctx, bt, i0 + ic, i0 + ic + mc, j0 + jc, j0 + jc + nc);
      }
    }
  }
}

/* C[0:M, j0:j1] = A[0:M, :] @ B[:, j0:j1] where the rows of B are contiguous (gemv, gemv_few):
   four rows of B at a time, each vector of them added into the M rows of a block of C. The
   block is 16384 / M columns (64 KiB of f32, in L2) so that each row of B streams 64 KiB / M
   at a time: blocks of 512 read one row's B in 2 KiB pieces, and the 49 products of a GPT-2
   token ran at 19.5 GB/s against 23 (a C harness, 2 MiB pages). */
static void add_rows_SUF(int64_t M, int64_t K, const T *A, int64_t rsa, int64_t csa, const T *B, int64_t rsb,
                         T *C, int64_t ldc, int64_t j0, int64_t j1) {
  int64_t blk = (16384 / M + VW - 1) / VW * VW;  /* M rows of the block: 64 KiB of f32 */
  for (int64_t jb = j0; jb < j1; jb += blk) {
    int64_t je = dtm_min(j1, jb + blk);
    for (int64_t i = 0; i < M; i++) memset(C + i * ldc + jb, 0, (size_t)(je - jb) * sizeof(T));
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
      const T *b0 = B + k * rsb, *b1 = b0 + rsb, *b2 = b1 + rsb, *b3 = b2 + rsb;
      T a[FEW_ROWS][4];
      for (int64_t i = 0; i < M; i++)
        for (int r = 0; r < 4; r++) a[i][r] = A[i * rsa + (k + r) * csa];
      int64_t j = jb;
      for (; j + VW <= je; j += VW) {
        V c0 = *(const V##u *)(b0 + j), c1 = *(const V##u *)(b1 + j), c2 = *(const V##u *)(b2 + j),
          c3 = *(const V##u *)(b3 + j);
        for (int64_t i = 0; i < M; i++) {
          V##u *c = (V##u *)(C + i * ldc + j);
          *c = *c + a[i][0] * c0 + a[i][1] * c1 + a[i][2] * c2 + a[i][3] * c3;
        }
      }
      for (; j < je; j++)
        for (int64_t i = 0; i < M; i++)
          C[i * ldc + j] += a[i][0] * b0[j] + a[i][1] * b1[j] + a[i][2] * b2[j] + a[i][3] * b3[j];
    }
    for (; k < K; k++) {
      const T *restrict b = B + k * rsb;
      for (int64_t i = 0; i < M; i++) {
        const T a = A[i * rsa + k * csa];
        T *restrict c = C + i * ldc;
        for (int64_t j = jb; j < je; j++) c[j] += a * b[j];
      }
    }
  }
}

LANE_SUMS
/* C[0, j0:j1] = A[0, :] @ B[:, j0:j1]: a matrix-vector product, without packing. */
static void gemv_SUF(int64_t K, const T *A, int64_t csa, const T *B, int64_t rsb, int64_t csb, T *C,
                     int64_t j0, int64_t j1, dtm_epilogue_fn epi, const void *ctx, int64_t bt) {
  if (csb == 1) {  /* rows of B are contiguous */
    add_rows_SUF(1, K, A, 0, csa, B, rsb, C, 0, j0, j1);
  } else if (rsb == 1 && csa == 1) {  /* columns of B are contiguous: two dot products at a time */
    int64_t j = j0;
    for (; j + 2 <= j1; j += 2) {
      const T *b0 = B + j * csb, *b1 = b0 + csb;
      V s0 = {0}, s1 = {0};
      int64_t k = 0;
      /* each line of the columns two pairs on is fetched (into L2) as its line here is read:
         the CPU's own prefetcher stops at every 4 KiB page, and a column of GPT-2's is 3 KiB
         (+4-5% decode). Two columns at a time, not four: memory read in fewer streams at
         once runs faster here (a C harness over 496 MB: 28.5 GB/s against 26.5) */
      for (; k + VW <= K; k += VW) {
        V a = *(const V##u *)(A + k);
        __builtin_prefetch(b0 + 4 * csb + k, 0, 1);
        __builtin_prefetch(b1 + 4 * csb + k, 0, 1);
        s0 += a * *(const V##u *)(b0 + k);
        s1 += a * *(const V##u *)(b1 + k);
      }
      V sums[2] = {s0, s1};
      T r[2];
      lane_sums2_SUF(sums, r);
      for (; k < K; k++) { r[0] += A[k] * b0[k]; r[1] += A[k] * b1[k]; }
      memcpy(C + j, r, sizeof(r));
    }
    for (; j < j1; j++) {
      const T *b = B + j * csb;
      T acc = 0;
      for (int64_t k = 0; k < K; k++) acc += A[k] * b[k];
      C[j] = acc;
    }
  } else {
    for (int64_t j = j0; j < j1; j++) {
      T acc = 0;
      for (int64_t k = 0; k < K; k++) acc += A[k * csa] * B[k * rsb + j * csb];
      C[j] = acc;
    }
  }
  if (epi) epi(ctx, bt, 0, 1, j0, j1);
}

/* C[0:M, j0:j1] = A[0:M, :] @ B[:, j0:j1] for a few rows of A (2 <= M <= FEW_ROWS, at most 8
   by rows of B): a short prompt, a batch of sequences decoding. Like gemv, B is read once from
   memory and not packed (packing it cost a batch of two 2.6x one row's time). Rows of B
   contiguous: add_rows. Columns contiguous: four columns against four rows of A at a time,
   16 dot products in registers; the columns stay in L1 for the next four rows. */
static void gemv_few_SUF(int64_t M, int64_t K, const T *A, int64_t rsa, int64_t csa, const T *B, int64_t rsb,
                         int64_t csb, T *C, int64_t ldc, int64_t j0, int64_t j1, dtm_epilogue_fn epi,
                         const void *ctx, int64_t bt) {
  if (csb == 1) {
    add_rows_SUF(M, K, A, rsa, csa, B, rsb, C, ldc, j0, j1);
  } else {  /* rsb == 1 && csa == 1 */
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) {
      const T *b0 = B + j * csb, *b1 = b0 + csb, *b2 = b1 + csb, *b3 = b2 + csb;
      for (int64_t i0 = 0; i0 < M; i0 += 4) {  /* rows past M repeat the last row, unstored */
        const T *a0 = A + i0 * rsa, *a1 = A + dtm_min(i0 + 1, M - 1) * rsa, *a2 = A + dtm_min(i0 + 2, M - 1) * rsa,
                *a3 = A + dtm_min(i0 + 3, M - 1) * rsa;
        V s00 = {0}, s01 = {0}, s02 = {0}, s03 = {0}, s10 = {0}, s11 = {0}, s12 = {0}, s13 = {0};
        V s20 = {0}, s21 = {0}, s22 = {0}, s23 = {0}, s30 = {0}, s31 = {0}, s32 = {0}, s33 = {0};
        /* the next four columns, as gemv does, spread over the passes (a pass per four rows)
           so that memory streams while each pass computes */
        int64_t passes = (M + 3) / 4, pass = i0 / 4;
        int64_t first = 4 + 4 * pass / passes, npf = 4 + 4 * (pass + 1) / passes - first;
        const T *pf = b0 + first * csb;
        int64_t k = 0;
        for (; k + VW <= K; k += VW) {
          __builtin_prefetch(pf + k, 0, 1);
          if (npf > 1) __builtin_prefetch(pf + csb + k, 0, 1);
          if (npf > 2) {
            __builtin_prefetch(pf + 2 * csb + k, 0, 1);
            __builtin_prefetch(pf + 3 * csb + k, 0, 1);
          }
          V c0 = *(const V##u *)(b0 + k), c1 = *(const V##u *)(b1 + k), c2 = *(const V##u *)(b2 + k),
            c3 = *(const V##u *)(b3 + k);
          V r = *(const V##u *)(a0 + k);
          s00 += r * c0; s01 += r * c1; s02 += r * c2; s03 += r * c3;
          r = *(const V##u *)(a1 + k);
          s10 += r * c0; s11 += r * c1; s12 += r * c2; s13 += r * c3;
          r = *(const V##u *)(a2 + k);
          s20 += r * c0; s21 += r * c1; s22 += r * c2; s23 += r * c3;
          r = *(const V##u *)(a3 + k);
          s30 += r * c0; s31 += r * c1; s32 += r * c2; s33 += r * c3;
        }
        V sums[16] = {s00, s01, s02, s03, s10, s11, s12, s13, s20, s21, s22, s23, s30, s31, s32, s33};
        T acc[16];
        lane_sums16_SUF(sums, acc);
        const T *rows[4] = {a0, a1, a2, a3}, *cols[4] = {b0, b1, b2, b3};
        for (int r = 0; r < 4 && i0 + r < M; r++)
          for (int c = 0; c < 4; c++) {
            T a = acc[4 * r + c];
            for (int64_t kk = k; kk < K; kk++) a += rows[r][kk] * cols[c][kk];
            C[(i0 + r) * ldc + j + c] = a;
          }
      }
    }
    for (; j < j1; j++)  /* the last columns, one at a time */
      for (int64_t i = 0; i < M; i++) {
        T acc = 0;
        for (int64_t k = 0; k < K; k++) acc += A[i * rsa + k] * B[j * csb + k];
        C[i * ldc + j] = acc;
      }
  }
  if (epi) epi(ctx, bt, 0, M, j0, j1);
}

/* scatter_add's accumulation in place (spec 3.6): out is [outer, n, width] holding x, upd is
   [outer, nidx, width]; upd[p, q, :] is added to out[p, clamp(idx[q]), :], q in order, so
   every element takes its updates one by one in the order of the indices. (numpy's add.at
   does the same a few ns per element slower: an embedding's gradient.) */
void dtm_rt_scatter_add_SUF(int64_t outer, int64_t n, int64_t width, T *out, int64_t nidx, const int64_t *idx,
                            const T *upd) {
  if (n <= 0) return;
  for (int64_t p = 0; p < outer; p++)
    for (int64_t q = 0; q < nidx; q++) {
      int64_t r = idx[q] < 0 ? 0 : idx[q] >= n ? n - 1 : idx[q];
      T *restrict o = out + (p * n + r) * width;
      const T *restrict u = upd + (p * nidx + q) * width;
      for (int64_t j = 0; j < width; j++) o[j] += u[j];
    }
}

void dtm_rt_gemm_SUF(int64_t nbatch, const int64_t *offs, int64_t M, int64_t N, int64_t K,
                     const T *A, int64_t rsa, int64_t csa, const T *B, int64_t rsb, int64_t csb,
                     T *C, int64_t ldc, dtm_epilogue_fn epi, const void *ctx) {
  if (M <= 0 || N <= 0) return;  /* an empty C (a rank's empty shard of an uneven batch): nothing to
                                    write, and the plans below divide by M */
  double work = (double)M * (double)N * (double)(K > 0 ? K : 1);
  int threads = omp_get_max_threads();
  if (M == 1 && N > 0 && nbatch > 1) {  /* one product per thread (the heads of a decoding step's
                                           attention: each about 8,000 multiply-adds, threads
                                           from 30,000 in all: +1-3% decode) */
#pragma omp parallel for schedule(static) if(work * nbatch >= 3e4)
    for (int64_t bt = 0; bt < nbatch; bt++)
      gemv_SUF(K, A + offs[3 * bt], csa, B + offs[3 * bt + 1], rsb, csb, C + offs[3 * bt + 2], 0, N, epi, ctx, bt);
    return;
  }
  /* one row (decoding one token), or a few: unpacked, the columns split (a few rows: by rows
     of B this beats packing up to 8 rows, by dot products up to 16: GPT-2's
     [M, 768] @ [768, 3072], timed by M) */
  int few = (csb == 1 && M <= FEW_ROWS / 2) || (rsb == 1 && csa == 1 && M <= FEW_ROWS);
  if (nbatch == 1 && N > 0 && (M == 1 || (few && N > WHOLE_ROWS && K > 0))) {
    int nt = work < 1e5 || threads > DTM_MAX_BANDS ? 1 : threads;
    /* chunks of 64 columns read as dot products (each column of B a contiguous stream);
       rows of B contiguous (add_rows) stream best in one band per thread */
    int64_t chunk = csb == 1 ? ((N + nt - 1) / nt + 15) / 16 * 16 : 64;
    dtm_band bands[DTM_MAX_BANDS];
    bands_init(bands, nt, (N + chunk - 1) / chunk);
#pragma omp parallel num_threads(nt)
    {
      int64_t c;
      while (next_chunk(bands, nt, &c)) {
        int64_t j0 = c * chunk, j1 = dtm_min(N, j0 + chunk);
        if (M == 1)
          gemv_SUF(K, A + offs[0], csa, B + offs[1], rsb, csb, C + offs[2], j0, j1, epi, ctx, 0);
        else
          gemv_few_SUF(M, K, A + offs[0], rsa, csa, B + offs[1], rsb, csb, C + offs[2], ldc, j0, j1, epi, ctx, 0);
      }
    }
    return;
  }
  if (nbatch > 1 && (work < 4e6 || nbatch >= 4 * threads)) {  /* one product per thread */
#pragma omp parallel for schedule(static) if(work * nbatch >= 2e5)
    for (int64_t bt = 0; bt < nbatch; bt++)
      gemm_serial_SUF(M, N, K, A + offs[3 * bt], rsa, csa, B + offs[3 * bt + 1], rsb, csb,
                      C + offs[3 * bt + 2], ldc, epi, ctx, bt, 0, 0);
    return;
  }
  /* A contracted dim much longer than the others (a weight's gradient, X^T @ dY): each thread
     takes a slice of it, the rows of X and dY it wrote itself, and packs only that; the
     partial products are then summed by rows, and the epilogue runs on each thread's rows. */
  int split_k = threads > 1 && work >= 2e5 && K >= 2 * (M > N ? M : N);
  T *parts = split_k ? (T *)malloc((size_t)(threads - 1) * (size_t)(M * N) * sizeof(T)) : NULL;
  if (!parts) split_k = 0;
  for (int64_t bt = 0; bt < nbatch; bt++) {  /* each product split into one band per thread */
    const T *a = A + offs[3 * bt], *b = B + offs[3 * bt + 1];
    T *c = C + offs[3 * bt + 2];
    int nt = work < 2e5 ? 1 : threads;
#pragma omp parallel num_threads(nt)
    {
      int t = omp_get_thread_num(), n = omp_get_num_threads();
      if (split_k && n == threads) {
        int64_t per = (K + n - 1) / n, k0 = dtm_min(K, t * per), k1 = dtm_min(K, k0 + per);
        T *part = t == 0 ? c : parts + (size_t)(t - 1) * (size_t)(M * N);
        gemm_serial_SUF(M, N, k1 - k0, a + k0 * csa, rsa, csa, b + k0 * rsb, rsb, csb, part, t == 0 ? ldc : N,
                        NULL, NULL, bt, 0, 0);
#pragma omp barrier
        int64_t rows = (M + n - 1) / n, r0 = dtm_min(M, t * rows), r1 = dtm_min(M, r0 + rows);
        for (int u = 1; u < n; u++)
          for (int64_t i = r0; i < r1; i++) {
            T *restrict ci = c + i * ldc;
            const T *restrict pi = parts + (size_t)(u - 1) * (size_t)(M * N) + i * N;
            for (int64_t j = 0; j < N; j++) ci[j] += pi[j];
          }
        if (epi && r0 < r1) epi(ctx, bt, r0, r1, 0, N);
      } else if (M > N || N <= WHOLE_ROWS) {  /* by rows; by columns only rows too wide for an epilogue to see whole */
        int64_t per = ((M + n - 1) / n + MR - 1) / MR * MR;
        int64_t m0 = dtm_min(M, t * per), m1 = dtm_min(M, m0 + per);
        gemm_serial_SUF(m1 - m0, N, K, a + m0 * rsa, rsa, csa, b, rsb, csb, c + m0 * ldc, ldc,
                        epi, ctx, bt, m0, 0);
      } else {
        int64_t per = ((N + n - 1) / n + NR_SUF - 1) / NR_SUF * NR_SUF;
        int64_t n0 = dtm_min(N, t * per), n1 = dtm_min(N, n0 + per);
        gemm_serial_SUF(M, n1 - n0, K, a, rsa, csa, b + n0 * csb, rsb, csb, c + n0, ldc,
                        epi, ctx, bt, 0, n0);
      }
    }
  }
  free(parts);
}
"""


def _micro(mr: int) -> str:
    """The MR x NR register tile, C[m, n] (+)= A @ Bp over kc: 2 * mr vector accumulators,
    written out row by row (so they stay in registers). Two versions: `micro` reads A from
    its packed sliver, `micro_rows` from A's own rows (a row-major A, unpacked: its 12 rows'
    current lines stay in L1 across the k loop, so packing would only copy them)."""
    rows = range(mr)
    acc = "\n".join(f"  V c{r}0 = {{0}}, c{r}1 = {{0}};" for r in rows)
    full = " ".join(f"ST({r}, c{r}0, c{r}1)" for r in rows)
    prefetch = """  for (int r = 0; r < MR; r++) {  /* the tile of C is read or written after the loop: fetch it now */
    __builtin_prefetch(C + r * ldc, 1, 3);
    __builtin_prefetch(C + r * ldc + NR_SUF - 1, 1, 3);
  }"""
    store = f"""  if (m == MR && n == NR_SUF) {{
#define ST(r, x0, x1) {{ V##u *p0 = (V##u *)(C + r * ldc), *p1 = (V##u *)(C + r * ldc + VW); \\
    if (acc) {{ *p0 += x0; *p1 += x1; }} else {{ *p0 = x0; *p1 = x1; }} }}
    {full}
#undef ST
  }} else {{
    T t[MR][NR_SUF] __attribute__((aligned(64)));
#define ST(r, x0, x1) {{ *(V *)&t[r][0] = x0; *(V *)&t[r][VW] = x1; }}
    {full}
#undef ST
    for (int64_t r = 0; r < m; r++)
      for (int64_t c = 0; c < n; c++)
        C[r * ldc + c] = acc ? C[r * ldc + c] + t[r][c] : t[r][c];
  }}"""

    def fma(a: str) -> str:
        return "\n".join(f"    a = BC_SUF({a.format(r=r)}); c{r}0 = FMA_SUF(a, b0, c{r}0); c{r}1 = FMA_SUF(a, b1, c{r}1);"
                         for r in rows)

    pointers = "\n".join(f"  const T *a{r} = A + (m > {r} ? {r} : 0) * rsa;" for r in rows)
    return f"""/* C[m, n] (+)= Ap @ Bp over kc: the MR x NR register tile, A packed. */
static void micro_SUF(int64_t kc, const T *restrict Ap, const T *restrict Bp, T *C, int64_t ldc,
                      int acc, int64_t m, int64_t n) {{
{prefetch}
{acc}
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; k++) {{
    V b0 = *(const V *)Bp, b1 = *(const V *)(Bp + VW), a;
{fma("Ap + {r}")}
    Ap += MR; Bp += NR_SUF;
  }}
{store}
}}

/* The same with A read in place: row r of the tile at A + r * rsa (rows past m read row 0,
   whose results are not stored). */
static void micro_rows_SUF(int64_t kc, const T *A, int64_t rsa, const T *restrict Bp, T *C, int64_t ldc,
                           int acc, int64_t m, int64_t n) {{
{prefetch}
{pointers}
{acc}
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; k++) {{
    V b0 = *(const V *)Bp, b1 = *(const V *)(Bp + VW), a;
{fma("a{r} + k")}
    Bp += NR_SUF;
  }}
{store}
}}

"""


def _lane_sums(width: int, count: int) -> str:
    """`lane_sums<count>`: the sums of the lanes of each of `count` vectors of `width` lanes,
    in order, by a tree of shuffles and adds (log2(width) levels, where a lane at a time took
    `width` scalar adds a vector): at each level, pairs of adjacent vectors become one (a lone
    vector pairs with itself), each group of partial sums halved by adding its second half to
    its first."""
    lines = [f"static inline void lane_sums{count}_SUF(const V *v, T *out) {{"]
    cur, group, level = [f"v[{i}]" for i in range(count)], width, 0
    while group > 1:
        half = group // 2
        lo = [g * group + i for g in range(width // group) for i in range(half)]
        hi = [g * group + half + i for g in range(width // group) for i in range(half)]
        lo, hi = lo + [width + x for x in lo], hi + [width + x for x in hi]
        pairs = [(cur[p], cur[p + 1] if p + 1 < len(cur) else cur[p]) for p in range(0, len(cur), 2)]
        cur = []
        for p, (a, b) in enumerate(pairs):
            cur.append(f"l{level}_{p}")
            lines.append(f"  V {cur[-1]} = __builtin_shufflevector({a}, {b}, {', '.join(map(str, lo))})"
                         f" + __builtin_shufflevector({a}, {b}, {', '.join(map(str, hi))});")
        group, level = half, level + 1
    for p, name in enumerate(cur):
        lines.append(f"  memcpy(out + {p * width}, &{name}, {min(width, count - p * width)} * sizeof(T));")
    return "\n".join(lines) + "\n}\n"


def _instance(suffix: str, ctype: str, vec: str, width: int, nc: int, mr: int, kc: int = 256) -> str:
    """The product for one element type and vector width: the template with its names filled
    in, an mr x (2 * width) register tile, packed panels of B kc deep and nc wide."""
    text = _TEMPLATE.replace("MICRO_KERNEL", _micro(mr))
    text = text.replace("LANE_SUMS", _lane_sums(width, 2) + _lane_sums(width, 16))
    text = text.replace("V##u", vec + "u").replace("NC_SUF", str(nc))
    text = re.sub(r"\bKC\b", f"KC_{suffix}", text.replace("MR", f"MR_{suffix}"))
    text = text.replace("SUF", suffix).replace("VW", str(width))
    return f"#define MR_{suffix} {mr}\n#define KC_{suffix} {kc}\n" + re.sub(r"\bV\b", vec, re.sub(r"\bT\b", ctype, text))


# AVX-512: 24 of the 32 zmm registers accumulate; a packed panel of B (KC x NC) is 1 MB of f32,
# held in L2 while a 12 x KC sliver of A (12 KB) stays in L1. Measured on a 2-core Sapphire
# Rapids against MR 8/14, NC 512-2048, KC 256-512 (benchmarks/matmul.py, a C harness one thread
# at a time): KC 256 best at 1024 and 2048 by 2-5%, the rest within noise.
AVX512_MR, AVX512_NC, AVX512_KC = 12, 1024, 256

_PRELUDE = r"""/* DTM runtime library: the tiled matrix product for one element type. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

""" + HEADER + r"""

static inline int64_t dtm_min(int64_t a, int64_t b) { return a < b ? a : b; }

/* A thread's scratch buffer (`*p`, `*have` bytes) grown to at least `bytes`, 64-byte aligned;
   NULL when the memory is not there. */
static void *dtm_scratch(void **p, size_t *have, size_t bytes) {
  if (*have < bytes) {
    free(*p);
    *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    *have = *p ? bytes : 0;
  }
  return *p;
}

/* The columns of a matrix-vector product, shared between a team's threads in chunks: each
   thread has a band of whole chunks, takes its own chunks from the front, then the chunks left
   in the other threads' bands from the back. A static split left one thread waiting for the
   other at the end of most of a decoding step's products (libgomp: 7-12% of each thread's
   time); chunks handed out in turn (schedule(dynamic)) were slower, as every chunk then starts
   a new stream of memory. A band's `ends` holds its next chunk from the front (low 32 bits) and
   one past its last chunk from the back (high 32 bits), claimed together by compare-exchange. */
typedef struct { _Alignas(64) uint64_t ends; } dtm_band;
#define DTM_MAX_BANDS 64

static inline void bands_init(dtm_band *bands, int nbands, int64_t nchunks) {
  int64_t per = (nchunks + nbands - 1) / nbands;
  for (int b = 0; b < nbands; b++) {
    uint64_t c0 = (uint64_t)dtm_min(nchunks, b * per), c1 = (uint64_t)dtm_min(nchunks, (int64_t)c0 + per);
    bands[b].ends = (c1 << 32) | c0;
  }
}

/* One chunk of `band`, from its front or its back: 0 when none is left. */
static inline int band_claim(dtm_band *band, int front, int64_t *chunk) {
  uint64_t v = __atomic_load_n(&band->ends, __ATOMIC_RELAXED), next;
  do {
    uint64_t c0 = v & 0xffffffffu, c1 = v >> 32;
    if (c0 >= c1) return 0;
    *chunk = front ? (int64_t)c0 : (int64_t)c1 - 1;
    next = front ? v + 1 : v - ((uint64_t)1 << 32);
  } while (!__atomic_compare_exchange_n(&band->ends, &v, next, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
  return 1;
}

/* This thread's next chunk: its own band's first, then the others' last. */
static inline int next_chunk(dtm_band *bands, int nbands, int64_t *chunk) {
  int t = omp_get_thread_num();
  for (int u = 0; u < nbands; u++)
    if (band_claim(&bands[(t + u) % nbands], u == 0, chunk)) return 1;
  return 0;
}

#define MC 96
#define FEW_ROWS 16  /* products of at most this many rows go through gemv_few (unpacked) */

/* The microkernel's broadcast and multiply-add, and its vectors: 512-bit with AVX-512 intrinsics
   where -march=native offers AVX-512F, 256-bit with AVX2 + FMA intrinsics where it offers
   those, else 256-bit GCC vector extensions (-ffp-contract=fast turns a * b + c into an FMA). */
#if defined(__AVX512F__)
#define DTM_AVX2 1
#include <immintrin.h>
#define BC_f32(p) _mm512_set1_ps(*(p))
#define FMA_f32(a, b, c) _mm512_fmadd_ps(a, b, c)
#define BC_f64(p) _mm512_set1_pd(*(p))
#define FMA_f64(a, b, c) _mm512_fmadd_pd(a, b, c)
#elif defined(__AVX2__) && defined(__FMA__)
#define DTM_AVX2 1
#include <immintrin.h>
#define BC_f32(p) _mm256_broadcast_ss(p)
#define FMA_f32(a, b, c) _mm256_fmadd_ps(a, b, c)
#define BC_f64(p) _mm256_broadcast_sd(p)
#define FMA_f64(a, b, c) _mm256_fmadd_pd(a, b, c)
#else
#define DTM_AVX2 0
#endif
#if defined(__AVX512F__)
/* dst[j][i] = src[i][j]: a 16 x 16 block of f32 transposed in registers (interleave pairs,
   then 4 x 4 blocks within each 128-bit lane, then the lanes), for packing a transposed B
   (a Linear's weight), which the microkernel reads across its contiguous dim. */
static inline void dtm_transpose16_f32(const float *src, int64_t ss, float *dst, int64_t ds) {
  __m512 r[16], t[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * ss);
#pragma GCC unroll 8
  for (int i = 0; i < 8; i++) {  /* lane L of t[2i]: rows 2i, 2i+1 at columns 4L, 4L+1; of t[2i+1]: 4L+2, 4L+3 */
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; i++) {  /* lane L of r[4i + c]: rows 4i..4i+3 at column 4L + c */
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; c++) {  /* column 4L + c gathers lane L of r[c], r[4 + c], r[8 + c], r[12 + c] */
    __m512 v0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), v1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
    __m512 v2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88), v3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
    _mm512_storeu_ps(dst + c * ds, _mm512_shuffle_f32x4(v0, v2, 0x88));
    _mm512_storeu_ps(dst + (4 + c) * ds, _mm512_shuffle_f32x4(v1, v3, 0x88));
    _mm512_storeu_ps(dst + (8 + c) * ds, _mm512_shuffle_f32x4(v0, v2, 0xDD));
    _mm512_storeu_ps(dst + (12 + c) * ds, _mm512_shuffle_f32x4(v1, v3, 0xDD));
  }
}
#define TRANSPOSE16_f32 dtm_transpose16_f32
#endif
"""


def _library(dtype: str) -> str:
    """The runtime library for one element type ("f32" or "f64"): built only for programs
    whose products use that type (its compile is most of a small program's first build)."""
    wide = {"f32": ("float", "dtm_v16f", 16, AVX512_NC, AVX512_KC), "f64": ("double", "dtm_v8d", 8, AVX512_NC // 2,
                                                                         AVX512_KC // 2)}[dtype]
    narrow = {"f32": ("float", "dtm_v8f", 8, 2048), "f64": ("double", "dtm_v4d", 4, 1024)}[dtype]
    return (_PRELUDE + f"#define WHOLE_ROWS {WHOLE_ROWS}\nint dtm_rt_version_{dtype}(void) {{ return {VERSION}; }}\n"
            + "#if defined(__AVX512F__)\n" + _instance(dtype, wide[0], wide[1], wide[2], wide[3], AVX512_MR, wide[4])
            + "#else\n" + _instance(dtype, *narrow, 6) + "#endif\n")


SOURCES = {dtype: _library(dtype) for dtype in ("f32", "f64")}
