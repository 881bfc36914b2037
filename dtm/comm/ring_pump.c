/* The frame loop of a ring pass over TCP (all_reduce, reduce_scatter, all_gather), in C
 * (dtm/comm/pump.py; TcpTransport.ring_pass drives it).
 *
 * Python plans the ring (algorithms.ring_schedule) and hands this loop two sockets: the
 * left neighbour's, whose Data frames it reads, and the right neighbour's, to which it
 * writes. It sends exactly the frames Python's ring would (spec 9.1 headers, the 32-byte
 * chunk header, CRC32C by the crc32c package's own routine), checks every frame it reads
 * the way TcpTransport does, reduces each received chunk into the work buffer and passes
 * it on. It reads exactly the bytes of the frames it takes, never past them, so Python can
 * take a connection back at any frame boundary.
 *
 * One call runs until the ring is done or something needs Python: a frame that is not the
 * next expected Data frame (PUMP_HANDOFF: its header bytes are in rhdr), another socket
 * turning readable, a signal or the end of the time slice (PUMP_YIELD), or an error. The
 * state lives in `pump_t` between calls; pump.py mirrors it field for field.
 *
 * Compressed passes (spec 9.5.1, `codec` 1 q8_0 or 2 bf16): the same loop, but every Data
 * frame carries the COMPRESSED flag and a compressed chunk, and the codec of
 * quant_codec.c (compiled into the same object, pump.py puts the two sources together)
 * runs inside it, exactly as algorithms.compressed_ring does it in Python: the first
 * block's chunks are encoded as they are sent; a reduce-scatter chunk is decoded, added to
 * the f32 work buffer and encoded again (finished: decoded back, so the owner keeps what
 * the others get; RECV_KEEP, reduce_scatter's own block: decoded and added only); an
 * all-gather chunk is decoded into the work buffer and passed on unchanged. */
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

enum { PUMP_DONE, PUMP_YIELD, PUMP_HANDOFF, PUMP_LEFT_CLOSED, PUMP_LEFT_ERROR, PUMP_RIGHT_ERROR, PUMP_BAD_CRC,
       PUMP_BAD_CHUNK };
enum { RECV_REDUCE = 1, RECV_FORWARD = 2, RECV_FINISH = 4, RECV_KEEP = 8 };  /* recv_flags bits */
enum { CODEC_NONE, CODEC_Q8_0, CODEC_BF16 };  /* the chunk head's encoding byte (spec 9.5.1) */
enum { CHUNK_HEAD = 8 };
enum { HEADER = 40, CHUNK_HEADER = 32, FRAMING = HEADER + CHUNK_HEADER, COVERED = 28, TYPE_DATA = 7 };

/* The crc32c package's routine: the CRC32C register (not inverted) after `len` more bytes. */
typedef uint32_t (*crc_fn)(uint32_t crc, const unsigned char *data, unsigned long len);

typedef struct {
    /* Set by Python for the whole collective. */
    int32_t left, right;          /* sockets; the same one in a ring of two */
    int32_t nwatch, slice_ms;     /* other sockets (readable: PUMP_YIELD); the longest call */
    const int32_t *watch;
    crc_fn crc;
    int32_t item, divide_by;      /* element size (4: f32, 8: f64); avg: divide finished chunks by this */
    uint8_t out_version[2], in_version[2];
    uint32_t stream;
    uint64_t epoch, coll_seq;     /* frame epoch; the collective's seq (chunk header) */
    char *base, *tmp;             /* the work buffer; scratch for one chunk */
    char *finished;               /* where finished chunks are copied (reduce_scatter's own block), or 0 */
    int64_t finished_base;        /* the byte offset in base of finished[0] */
    const char *prefix;           /* bytes sent before the first Data frame (the CollectiveStart frame) */
    int64_t prefix_len;
    int64_t nrecv, nsend;         /* receives planned; sends queued (the first block's, then forwards) */
    const int64_t *recv_off, *recv_len, *recv_flags;
    const int64_t *pre;           /* per receive: the address of a payload Python already took, or 0 */
    int64_t *send_off, *send_len; /* room for nrecv + the first block's chunks; send_off: addresses */
    /* Progress, kept between calls. */
    int64_t prefix_sent, sh, soff, rh, rhlen, roff;
    uint64_t seq_out, seq_in;     /* frame seq of this stream on the right and left connections */
    uint8_t shdr[FRAMING], rhdr[FRAMING];
    /* Reported to Python (which adds them up and zeroes them). */
    int64_t bytes_out, bytes_in;
    int32_t err;
    /* Compressed passes: codec (CODEC_*; recv_off is then the address of each receive's
     * room, not an offset in base), the end-to-end flags every Data frame carries. */
    int32_t codec, data_flags;
    const int64_t *recv_elem, *recv_count;   /* per receive: its first f32 element in base, its count */
    const int64_t *recv_enc;                 /* per receive: the address its re-encoded chunk goes to */
    const int64_t *first_elem, *first_count; /* per first send: the f32 elements it encodes */
    int64_t nfirst;                          /* the first block's chunks: sends 0 .. nfirst - 1 */
    int32_t decode_first;                    /* all_gather: each first chunk decoded back into base */
} pump_t;

/* The codec, from quant_codec.c where it is in the same object (the compressed pump);
 * weak, so the plain pump, built from this file alone, loads without it (its codec is 0). */
#define CODEC_FN __attribute__((weak))
CODEC_FN void dtm_q8_encode(const float *x, int64_t n, uint8_t *out);
CODEC_FN void dtm_q8_decode(const uint8_t *in, int64_t n, float *out);
CODEC_FN void dtm_q8_decode_add(const uint8_t *in, int64_t n, float *acc);
CODEC_FN void dtm_q8_add_encode(const uint8_t *in, int64_t n, float *acc, uint8_t *out, int32_t keep);
CODEC_FN void dtm_bf16_encode(const float *x, int64_t n, uint16_t *out);
CODEC_FN void dtm_bf16_decode(const uint16_t *in, int64_t n, float *out);
CODEC_FN void dtm_bf16_decode_add(const uint16_t *in, int64_t n, float *acc);

static void put32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = v >> (8 * i); }
static void put64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = v >> (8 * i); }
static uint32_t get32(const uint8_t *p) { uint32_t v = 0; for (int i = 3; i >= 0; i--) v = v << 8 | p[i]; return v; }
static uint64_t get64(const uint8_t *p) { uint64_t v = 0; for (int i = 7; i >= 0; i--) v = v << 8 | p[i]; return v; }

/* A compressed chunk's head and body: `n` f32 values of x encoded (head included). */
static void encode_chunk(const pump_t *s, const float *x, int64_t n, uint8_t *chunk) {
    chunk[0] = (uint8_t)s->codec; chunk[1] = chunk[2] = chunk[3] = 0; put32(chunk + 4, (uint32_t)n);
    if (!n) return;
    if (s->codec == CODEC_Q8_0) dtm_q8_encode(x, n, chunk + CHUNK_HEAD);
    else dtm_bf16_encode(x, n, (uint16_t *)(chunk + CHUNK_HEAD));
}

static void decode_body(const pump_t *s, const uint8_t *body, int64_t n, float *out, int add) {
    if (!n) return;
    if (s->codec == CODEC_Q8_0) (add ? dtm_q8_decode_add : dtm_q8_decode)(body, n, out);
    else (add ? dtm_bf16_decode_add : dtm_bf16_decode)((const uint16_t *)body, n, out);
}

/* CRC32C of a Data frame: header bytes 0-27 (per-hop flag bits cleared), chunk header, payload. */
static uint32_t frame_crc(const pump_t *s, const uint8_t *framing, const char *payload, int64_t n) {
    uint8_t covered[COVERED];
    memcpy(covered, framing, COVERED);
    covered[7] &= 0x0F;
    uint32_t r = s->crc(0xFFFFFFFFu, covered, COVERED);
    r = s->crc(r, framing + HEADER, CHUNK_HEADER);
    return s->crc(r, (const unsigned char *)payload, (unsigned long)n) ^ 0xFFFFFFFFu;
}

/* The frame header and chunk header of send number sh (its Data frame's chunk number). */
static void start_send(pump_t *s) {
    uint8_t *h = s->shdr;
    int64_t n = s->send_len[s->sh];
    memcpy(h, "DTMW", 4);
    h[4] = s->out_version[0]; h[5] = s->out_version[1]; h[6] = TYPE_DATA; h[7] = (uint8_t)s->data_flags;
    put64(h + 8, s->epoch); put64(h + 16, CHUNK_HEADER + n); put32(h + 24, s->stream);
    put64(h + 32, s->seq_out++);
    put64(h + 40, s->coll_seq); put32(h + 48, (uint32_t)s->sh); put32(h + 52, 0); put64(h + 56, 0); put64(h + 64, n);
    char *payload = (char *)(intptr_t)s->send_off[s->sh];
    if (s->codec && s->sh < s->nfirst) {  /* a chunk of the first block: encoded as it goes */
        float *x = (float *)s->base + s->first_elem[s->sh];
        encode_chunk(s, x, s->first_count[s->sh], (uint8_t *)payload);
        if (s->decode_first) decode_body(s, (uint8_t *)payload + CHUNK_HEAD, s->first_count[s->sh], x, 0);
    }
    put32(h + 28, frame_crc(s, h, payload, n));
    s->bytes_out += FRAMING + n;
}

/* Send what the socket takes. 1: all queued bytes are out; 0: the socket is full; -1: error. */
static int pump_send(pump_t *s) {
    while (s->prefix_sent < s->prefix_len) {
        ssize_t k = send(s->right, s->prefix + s->prefix_sent, s->prefix_len - s->prefix_sent, MSG_NOSIGNAL);
        if (k < 0) return errno == EAGAIN ? 0 : (s->err = errno, -1);
        s->prefix_sent += k;
    }
    while (s->sh < s->nsend) {
        int64_t n = s->send_len[s->sh];
        if (s->soff == 0) start_send(s);
        struct iovec iov[2];
        int k = 0;
        if (s->soff < FRAMING) iov[k++] = (struct iovec){s->shdr + s->soff, FRAMING - s->soff};
        int64_t done = s->soff > FRAMING ? s->soff - FRAMING : 0;
        iov[k++] = (struct iovec){(char *)(intptr_t)s->send_off[s->sh] + done, n - done};
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = k};
        ssize_t sent = sendmsg(s->right, &m, MSG_NOSIGNAL);
        if (sent < 0) return errno == EAGAIN ? 0 : (s->err = errno, -1);
        s->soff += sent;
        if (s->soff < FRAMING + n) return 0;
        s->sh++;
        s->soff = 0;
    }
    return 1;
}

/* Is rhdr[0:40] the next Data frame of this collective's stream (header checks of spec 9.1.3)? */
static int expected_header(const pump_t *s) {
    const uint8_t *h = s->rhdr;
    return memcmp(h, "DTMW", 4) == 0 && h[4] == s->in_version[0] && h[5] == s->in_version[1] && h[6] == TYPE_DATA
        && (h[7] & 0x0F) == s->data_flags && get64(h + 8) == s->epoch && get64(h + 16) == (uint64_t)(CHUNK_HEADER + s->recv_len[s->rh])
        && get32(h + 24) == s->stream && get64(h + 32) == s->seq_in;
}

static int expected_chunk(const pump_t *s) {
    const uint8_t *c = s->rhdr + HEADER;
    return get64(c) == s->coll_seq && get32(c + 8) == (uint32_t)s->rh && get64(c + 24) == (uint64_t)s->recv_len[s->rh];
}

/* The received chunk `got` of receive rh is in: reduce it, finish it, queue it onward. */
static void land(pump_t *s, const char *got) {
    int64_t flags = s->recv_flags[s->rh], off = s->recv_off[s->rh], n = s->recv_len[s->rh];
    char *acc = s->base + off;
    if (flags & RECV_REDUCE) {
        if (s->item == 4) {
            float *a = (float *)acc; const float *b = (const float *)got;
            for (int64_t j = 0; j < n / 4; j++) a[j] = b[j] + a[j];
            if (flags & RECV_FINISH && s->divide_by) for (int64_t j = 0; j < n / 4; j++) a[j] /= (float)s->divide_by;
        } else {
            double *a = (double *)acc; const double *b = (const double *)got;
            for (int64_t j = 0; j < n / 8; j++) a[j] = b[j] + a[j];
            if (flags & RECV_FINISH && s->divide_by) for (int64_t j = 0; j < n / 8; j++) a[j] /= (double)s->divide_by;
        }
        if (flags & RECV_FINISH && s->finished) memcpy(s->finished + (off - s->finished_base), acc, n);
    } else if (got != acc) {
        memcpy(acc, got, n);
    }
    if (flags & RECV_FORWARD) {
        s->send_off[s->nsend] = (int64_t)(intptr_t)acc;
        s->send_len[s->nsend] = n;
        s->nsend++;
    }
    s->rh++;
}

/* The same for a compressed chunk (`got`: head and body). 0, or -1 when its head is not the
 * one expected (encoding, reserved bytes, count: PUMP_BAD_CHUNK, Python says how). */
static int land_compressed(pump_t *s, const uint8_t *got) {
    int64_t flags = s->recv_flags[s->rh], n = s->recv_count[s->rh];
    if (got[0] != s->codec || got[1] || got[2] || got[3] || get32(got + 4) != (uint64_t)n) return -1;
    float *w = (float *)s->base + s->recv_elem[s->rh];
    const uint8_t *sent = got;
    if (!(flags & RECV_REDUCE)) {
        decode_body(s, got + CHUNK_HEAD, n, w, 0);
    } else if (flags & RECV_KEEP) {
        decode_body(s, got + CHUNK_HEAD, n, w, 1);
    } else {
        uint8_t *enc = (uint8_t *)(intptr_t)s->recv_enc[s->rh];
        if (s->codec == CODEC_Q8_0) {  /* one pass: add, encode, and a finished chunk decoded back */
            enc[0] = CODEC_Q8_0; enc[1] = enc[2] = enc[3] = 0; put32(enc + 4, (uint32_t)n);
            if (n) dtm_q8_add_encode(got + CHUNK_HEAD, n, w, enc + CHUNK_HEAD, (flags & RECV_FINISH) != 0);
        } else {
            decode_body(s, got + CHUNK_HEAD, n, w, 1);
            encode_chunk(s, w, n, enc);
            if (flags & RECV_FINISH) decode_body(s, enc + CHUNK_HEAD, n, w, 0);
        }
        sent = enc;
    }
    if (flags & RECV_FORWARD) {
        s->send_off[s->nsend] = (int64_t)(intptr_t)sent;
        s->send_len[s->nsend] = s->recv_len[s->rh];
        s->nsend++;
    }
    s->rh++;
    return 0;
}

static int take(pump_t *s, const char *got) {
    if (s->codec) return land_compressed(s, (const uint8_t *)got);
    land(s, got);
    return 0;
}

/* Read what the left socket has. 1: a frame needs Python; 0: nothing more now; <0: status. */
static int pump_recv(pump_t *s) {
    while (s->rh < s->nrecv) {
        if (s->pre[s->rh]) {
            if (take(s, (const char *)(intptr_t)s->pre[s->rh]) < 0) return -PUMP_BAD_CHUNK;
            continue;
        }
        int64_t n = s->recv_len[s->rh];
        int reduce = s->recv_flags[s->rh] & RECV_REDUCE;
        char *dst = s->codec ? (char *)(intptr_t)s->recv_off[s->rh] : reduce ? s->tmp : s->base + s->recv_off[s->rh];
        ssize_t k;
        if (s->rhlen < FRAMING) {  /* the frame header, then the chunk header */
            int was = s->rhlen;
            k = recv(s->left, s->rhdr + s->rhlen, (was < HEADER ? HEADER : FRAMING) - was, 0);
            if (k < 0) return errno == EAGAIN ? 0 : (s->err = errno, -PUMP_LEFT_ERROR);
            if (k == 0) return -PUMP_LEFT_CLOSED;
            s->rhlen += k;
            if (was < HEADER && s->rhlen == HEADER) {
                if (!expected_header(s)) return 1;
                s->seq_in++;  /* the header is taken: as TcpTransport does once it checked it */
            }
            if (s->rhlen == FRAMING && !expected_chunk(s)) {
                s->seq_in--;  /* Python takes the whole frame back, header included */
                return 1;
            }
            continue;
        }
        if (s->roff < n) {  /* the payload (a chunk may be empty) */
            k = recv(s->left, dst + s->roff, n - s->roff, 0);
            if (k < 0) return errno == EAGAIN ? 0 : (s->err = errno, -PUMP_LEFT_ERROR);
            if (k == 0) return -PUMP_LEFT_CLOSED;
            s->roff += k;
            if (s->roff < n) continue;
        }
        if (frame_crc(s, s->rhdr, dst, n) != get32(s->rhdr + 28)) return -PUMP_BAD_CRC;  /* Python says how */
        s->bytes_in += n;
        if (take(s, dst) < 0) return -PUMP_BAD_CHUNK;  /* (rhlen, roff kept: Python reads the chunk there) */
        s->rhlen = s->roff = 0;
    }
    return 0;
}

static int64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

int dtm_ring_pump(pump_t *s) {
    int64_t end = now_ms() + s->slice_ms;
    struct pollfd pf[2 + 256];
    int nw = s->nwatch < 256 ? s->nwatch : 256;  /* past 256, the rest wait for the slice's end */
    for (;;) {
        int out = pump_send(s);
        if (out < 0) return PUMP_RIGHT_ERROR;
        int in = pump_recv(s);
        if (in < 0) return -in;
        if (in > 0) return PUMP_HANDOFF;
        if (out == 1 && s->sh < s->nsend) continue;  /* what just arrived queued more to send */
        if (s->rh == s->nrecv && out == 1 && s->sh == s->nsend) return PUMP_DONE;
        int64_t left_ms = end - now_ms();
        if (left_ms <= 0) return PUMP_YIELD;
        pf[0] = (struct pollfd){s->rh < s->nrecv ? s->left : -1, POLLIN, 0};
        pf[1] = (struct pollfd){out == 0 ? s->right : -1, POLLOUT, 0};
        for (int i = 0; i < nw; i++) pf[2 + i] = (struct pollfd){s->watch[i], POLLIN, 0};
        int r = poll(pf, 2 + nw, (int)left_ms);
        if (r < 0) return errno == EINTR ? PUMP_YIELD : (s->err = errno, PUMP_LEFT_ERROR);
        for (int i = 0; i < nw; i++) if (pf[2 + i].revents) return PUMP_YIELD;
    }
}
