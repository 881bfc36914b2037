"""The `random` op's uniform draws in C: the spec's Philox4x32-10 (dtm/ref/philox.py), so a
compiled dropout mask is generated where it is read, fused with its consumers, and holds the
reference's bits (integer arithmetic and an exact scaling: no libm involved).

Element i of a draw under key (k0, k1) is Philox of counter (i mod 2^32, i >> 32, 0, 0); its
first two words x0, x1 make the value:

    f32: (x0 >> 8) * 2^-24                                  (24 bits: exact, below 1)
    f64: (((x0 << 21) ^ (x1 >> 11)) & (2^53 - 1)) * 2^-53

Normal draws (Box-Muller: log and cos) stay reference steps: libm's last bits are not
numpy's everywhere. Their Philox words come from C all the same (`WORDS`, in the runtime
library of movement steps, which the executor calls for them): integer arithmetic, the
reference's bits, 20x numpy's ten rounds of array passes; numpy then does the Box-Muller.
"""

from __future__ import annotations

def _philox() -> str:
    """dtm_philox: the ten rounds written out, with no loop and no branch, so that a kernel's
    `omp simd` loop over elements vectorises. The four 32-bit words are held in 64-bit
    variables (each below 2^32): vectorised, every step stays in 64-bit lanes, where words of
    32 bits multiplied into 64 made GCC pack and unpack lanes around each product (1.84 ns a
    draw on one AVX-512 core against 1.33, the same bits)."""
    rounds = []
    for r in range(10):
        k0, k1 = f"k0 + {hex(r * 0x9E3779B9 % 2**32)}u", f"k1 + {hex(r * 0xBB67AE85 % 2**32)}u"
        rounds.append("  p0 = UINT64_C(0xD2511F53) * c0; p1 = UINT64_C(0xCD9E8D57) * c2;\n"
                      f"  n0 = (p1 >> 32) ^ c1 ^ (uint32_t)({k0}); n2 = (p0 >> 32) ^ c3 ^ (uint32_t)({k1});\n"
                      "  c1 = p1 & 0xFFFFFFFFu; c3 = p0 & 0xFFFFFFFFu; c0 = n0; c2 = n2;")
    return ("/* Philox4x32-10 (Salmon et al. 2011) of counter (i mod 2^32, i >> 32, 0, 0) under (k0, k1):\n"
            "   the first two output words; round r's key is (k0 + r W0, k1 + r W1) mod 2^32. Each word\n"
            "   is held in 64 bits (below 2^32), so vectorised it stays in 64-bit lanes */\n"
            "static inline void dtm_philox(uint32_t k0, uint32_t k1, uint64_t i, uint32_t *x0, uint32_t *x1) {\n"
            "  uint64_t c0 = (uint32_t)i, c1 = i >> 32, c2 = 0, c3 = 0, n0, n2, p0, p1;\n"
            + "\n".join(rounds) + "\n  *x0 = (uint32_t)c0;\n  *x1 = (uint32_t)c1;\n}")


PHILOX = _philox()


def uniform(fn: str, dtype: str) -> str:
    """C for `fn(k0, k1, i)`: element i's uniform draw in [0, 1) as an f32 or f64."""
    if dtype == "f32":
        return (f"static inline float {fn}(uint32_t k0, uint32_t k1, uint64_t i) {{\n"
                "  uint32_t x0, x1;\n  dtm_philox(k0, k1, i, &x0, &x1);\n"
                "  return (float)(x0 >> 8) * 0x1p-24f;\n}")
    assert dtype == "f64", dtype
    return (f"static inline double {fn}(uint32_t k0, uint32_t k1, uint64_t i) {{\n"
            "  uint32_t x0, x1;\n  dtm_philox(k0, k1, i, &x0, &x1);\n"
            "  uint64_t m = (((uint64_t)x0 << 21) ^ ((uint64_t)x1 >> 11)) & ((UINT64_C(1) << 53) - 1);\n"
            "  return (double)m * 0x1p-53;\n}")


# dtm_rt_philox_words: the words x0, x1 of elements start .. start + n - 1, as u64 (what
# dtm.ref.philox's words give), for a draw computed outside the kernels (a normal one).
WORDS = PHILOX + r"""

void dtm_rt_philox_words(uint32_t k0, uint32_t k1, uint64_t start, int64_t n, uint64_t *x0, uint64_t *x1) {
  #pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t j = 0; j < n; j++) {
    uint32_t a, b;
    dtm_philox(k0, k1, start + (uint64_t)j, &a, &b);
    x0[j] = a;
    x1[j] = b;
  }
}
"""
