/* The floor under an all_reduce over loopback TCP: the same pipelined ring as DTM's (blocks
 * cut into chunks, each chunk reduced and passed on as it arrives), in C, with no frame
 * headers and no Python. What is left is the kernel's work (two copies of every byte
 * moved) and the additions. With `crc` (a CRC32C routine), every chunk also carries the
 * CRC32C of its bytes, computed by the sender and checked by the receiver, as DTM's frames
 * do. `benchmarks/collectives.py --backends floor floor-crc` runs both beside gloo and DTM.
 *
 * left and right are connected, non-blocking TCP sockets to the ranks before and after
 * this one; x holds `count` floats and is reduced in place (sum). Returns 0, or -errno
 * (-EBADMSG: a chunk's CRC did not match). */
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

/* The crc32c package's routine: CRC32C update of `crc` (not inverted) by `len` bytes. */
typedef uint32_t (*crc_fn)(uint32_t crc, const unsigned char *data, unsigned long len);

typedef struct { char *p; long nbytes; int reduce; int forward; } piece;

static long block_lo(long count, int n, int b) {  /* the first count % n blocks are one longer */
    long q = count / n, r = count % n;
    return b * q + (b < r ? b : r);
}

/* Append the chunks of block b (mod n) to `out`; returns the new length. */
static int cut(piece *out, int len, float *x, long count, int n, int b, long chunk, int reduce, int forward) {
    b = ((b % n) + n) % n;
    long lo = block_lo(count, n, b), hi = block_lo(count, n, b + 1);
    for (long a = lo; a < hi; a += chunk) {
        long e = a + chunk < hi ? a + chunk : hi;
        out[len++] = (piece){(char *)(x + a), (e - a) * (long)sizeof(float), reduce, forward};
    }
    return len;
}

static uint32_t checksum(crc_fn crc, const char *p, long n) {
    return crc(0xffffffffu, (const unsigned char *)p, (unsigned long)n) ^ 0xffffffffu;
}

int floor_all_reduce(int left, int right, float *x, long count, int rank, int n, long chunk, crc_fn crc) {
    long per_block = (count / n + 1 + chunk - 1) / chunk;  /* chunks in the longest block */
    long most = per_block * 2 * n;
    piece *sends = malloc(sizeof(piece) * most), *recvs = malloc(sizeof(piece) * most);
    float *tmp = malloc(sizeof(float) * chunk);
    if (!sends || !recvs || !tmp) { free(sends); free(recvs); free(tmp); return -ENOMEM; }
    /* The plan: step t of the reduce-scatter receives block rank-t-2 (reduce, then pass on);
     * step t of the all-gather receives block rank-t-1 (pass on, except at the last step). */
    int ns = cut(sends, 0, x, count, n, rank - 1, chunk, 0, 0), nr = 0;
    for (int t = 0; t < n - 1; t++) nr = cut(recvs, nr, x, count, n, rank - t - 2, chunk, 1, 1);
    for (int t = 0; t < n - 1; t++) nr = cut(recvs, nr, x, count, n, rank - t - 1, chunk, 0, t < n - 2);
    long head = crc ? (long)sizeof(uint32_t) : 0;  /* bytes before each chunk: its CRC, if any */
    uint32_t shead = 0, rhead = 0;
    int sh = 0, rh = 0;      /* the next piece to send, the next to receive */
    long soff = 0, roff = 0; /* bytes of it (head included) done */
    int err = 0;
    while (rh < nr || sh < ns) {
        struct pollfd pf[2] = {{rh < nr ? left : -1, POLLIN, 0}, {sh < ns ? right : -1, POLLOUT, 0}};
        if (poll(pf, 2, -1) < 0) { if (errno == EINTR) continue; err = -errno; break; }
        while (sh < ns && (pf[1].revents & POLLOUT)) {
            piece *s = &sends[sh];
            if (soff == 0 && crc) shead = checksum(crc, s->p, s->nbytes);
            struct iovec iov[2] = {{(char *)&shead + soff, soff < head ? head - soff : 0},
                                   {s->p + (soff > head ? soff - head : 0), s->nbytes - (soff > head ? soff - head : 0)}};
            ssize_t k = writev(right, iov[0].iov_len ? iov : iov + 1, iov[0].iov_len ? 2 : 1);
            if (k < 0) { if (errno == EAGAIN) break; err = -errno; goto done; }
            soff += k;
            if (soff == head + s->nbytes) { sh++; soff = 0; }
        }
        while (rh < nr && (pf[0].revents & (POLLIN | POLLHUP | POLLERR))) {
            piece *d = &recvs[rh];
            char *dst = d->reduce ? (char *)tmp : d->p;
            ssize_t k = roff < head ? recv(left, (char *)&rhead + roff, head - roff, 0)
                                    : recv(left, dst + roff - head, d->nbytes - (roff - head), 0);
            if (k < 0) { if (errno == EAGAIN) break; err = -errno; goto done; }
            if (k == 0) { err = -ECONNRESET; goto done; }
            roff += k;
            if (roff < head + d->nbytes) continue;
            if (crc && checksum(crc, dst, d->nbytes) != rhead) { err = -EBADMSG; goto done; }
            if (d->reduce) {
                float *acc = (float *)d->p;
                for (long j = 0; j < d->nbytes / (long)sizeof(float); j++) acc[j] += tmp[j];
            }
            if (d->forward) sends[ns++] = *d;
            rh++; roff = 0;
        }
    }
done:
    free(sends); free(recvs); free(tmp);
    return err;
}
