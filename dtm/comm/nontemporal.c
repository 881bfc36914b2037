/* A copy whose stores bypass the cache (dtm/comm/nontemporal.py).
 *
 * An ordinary store to a line that is not in the cache first reads the line from memory
 * (to own it), then writes it back when it is evicted: two trips for one. A large result
 * copied out of shared memory goes to memory anyway, so streaming stores (MOVNTDQ) write
 * each line once and leave the cache to the segment, which every rank keeps reading. */
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

void dtm_stream_copy(char *dst, const char *src, size_t n) {
#if defined(__x86_64__)
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;  /* ordinary stores up to a line boundary */
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    _mm_sfence();  /* streaming stores are weakly ordered: done before the caller says so */
    memcpy(dst + body, src + body, n - body);
#else
    memcpy(dst, src, n);
#endif
}
