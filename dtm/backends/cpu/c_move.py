"""The runtime library of data-movement steps and of the plan's launch loop (`SOURCE`).

Movement ops whose index is data (`gather`, `dynamic_slice`, `dynamic_update_slice`, spec
3.6) are copies of whole runs of bytes: the elements of every dim after the op's axis are
contiguous, so each op is a loop of memcpy over (the dims before the axis) x (the indices or
the window), whatever the dtype (a quantized table's rows are whole blocks: spec 2.2). They
are steps of their own (`program.MoveStep`), with the kernels' signature
`fn(void **bufs, const int64_t *args)`: the buffers, then the geometry the executor
computes once per set of symbol values (`args`, below). Run-time indices are read in their
own integer dtype (`KIND`) and clamped as the spec says, an unsigned 64-bit value above
2^63 - 1 clamping high (it never wraps to a negative).

`dtm_move_dynamic_update_slice` copies its operand into the result only when the two are
different memory: a result planned over its dead operand (memory.plan_memory), or over a
donated input (the executor), is written in place, the window alone.

`dtm_run_steps` launches n steps one after another, from one call: the executor's loop
over consecutive compiled steps, without a Python round trip per step. `dtm_run_steps_repeat`
launches them again and again, each time's result fed to the next as an input (Plan.repeat:
greedy decoding, a token a time, without Python between tokens).
"""

KIND = {"i8": 0, "i16": 1, "i32": 2, "i64": 3, "u8": 4, "u16": 5, "u32": 6, "u64": 7, "bool": 4}

SOURCE = r"""
#include <stdint.h>
#include <string.h>

typedef void (*dtm_step_fn)(void **bufs, const int64_t *args);

/* element q of an integer index array of kind `kind`, clamped into [0, hi] (hi >= 0) */
static inline int64_t dtm_index(const void *p, int64_t kind, int64_t q, int64_t hi) {
  int64_t v;
  switch (kind) {
    case 0: v = ((const int8_t *)p)[q]; break;
    case 1: v = ((const int16_t *)p)[q]; break;
    case 2: v = ((const int32_t *)p)[q]; break;
    case 3: v = ((const int64_t *)p)[q]; break;
    case 4: v = ((const uint8_t *)p)[q]; break;
    case 5: v = ((const uint16_t *)p)[q]; break;
    case 6: v = ((const uint32_t *)p)[q]; break;
    default: {
      uint64_t u = ((const uint64_t *)p)[q];
      return u > (uint64_t)hi ? hi : (int64_t)u;
    }
  }
  return v < 0 ? 0 : v > hi ? hi : v;
}

/* gather: bufs = out, x, indices; args = outer, n, nidx, width (bytes), kind.
   out[p, q, :] = x[p, clamp(indices[q]), :]; from an empty axis (n = 0) every byte is 0. */
void dtm_move_gather(void **bufs, const int64_t *a) {
  char *out = bufs[0];
  const char *x = bufs[1];
  int64_t outer = a[0], n = a[1], nidx = a[2], width = a[3], kind = a[4];
  if (n <= 0) {
    if (outer * nidx * width > 0) memset(out, 0, (size_t)(outer * nidx * width));
    return;
  }
  for (int64_t p = 0; p < outer; p++)
    for (int64_t q = 0; q < nidx; q++)
      memcpy(out + (p * nidx + q) * width, x + (p * n + dtm_index(bufs[2], kind, q, n - 1)) * width,
             (size_t)width);
}

/* dynamic_slice: bufs = out, x, start; args = outer, d, size, width (bytes), kind.
   The window of `size` along the axis at start clamped into [0, d - size]. */
void dtm_move_dynamic_slice(void **bufs, const int64_t *a) {
  char *out = bufs[0];
  const char *x = bufs[1];
  int64_t outer = a[0], d = a[1], size = a[2], width = a[3];
  int64_t s = dtm_index(bufs[2], a[4], 0, d - size);
  if (size * width <= 0) return;
  for (int64_t p = 0; p < outer; p++)
    memcpy(out + p * size * width, x + (p * d + s) * width, (size_t)(size * width));
}

/* dynamic_update_slice: bufs = out, x, update, start; args = outer, d, u, width (bytes), kind.
   out = x (copied only when out is other memory), then the update at start clamped into
   [0, d - u]. */
void dtm_move_dynamic_update_slice(void **bufs, const int64_t *a) {
  char *out = bufs[0];
  const char *x = bufs[1], *upd = bufs[2];
  int64_t outer = a[0], d = a[1], u = a[2], width = a[3];
  if (out != x && outer * d * width > 0) memcpy(out, x, (size_t)(outer * d * width));
  int64_t s = dtm_index(bufs[3], a[4], 0, d - u);
  if (u * width <= 0) return;
  for (int64_t p = 0; p < outer; p++)
    memcpy(out + (p * d + s) * width, upd + p * u * width, (size_t)(u * width));
}

/* n steps in order: step i is fns[i](bufs[i], args[i]) */
void dtm_run_steps(int64_t n, void **fns, void ***bufs, int64_t **args) {
  for (int64_t i = 0; i < n; i++) ((dtm_step_fn)fns[i])(bufs[i], args[i]);
}

/* The same steps `times` times (a greedy decoding loop): after each time, the `nbytes` of
   `out` are copied into `in` and into the next row of `record`, and the int64 at `count`
   grows by `by`. With `n_eos` > 0, `out` holds int64 ids, one a row, first made as
   transformers makes them: a row no longer `alive` gets `pad`, and a row that produced one
   of the `eos` ids is alive no more; the loop stops after a time that leaves no row alive.
   Returns the times run. */
int64_t dtm_run_steps_repeat(int64_t times, int64_t n, void **fns, void ***bufs, int64_t **args, void *out,
                             void *in, int64_t nbytes, char *record, int64_t *count, int64_t by,
                             const int64_t *eos, int64_t n_eos, int64_t pad, uint8_t *alive) {
  for (int64_t t = 0; t < times; t++) {
    dtm_run_steps(n, fns, bufs, args);
    int any = 1;
    if (n_eos > 0) {
      int64_t *ids = out;
      any = 0;
      for (int64_t r = 0; r < nbytes / 8; r++) {
        if (!alive[r]) {
          ids[r] = pad;
        } else {
          for (int64_t e = 0; e < n_eos; e++)
            if (ids[r] == eos[e]) alive[r] = 0;
        }
        any |= alive[r];
      }
    }
    memcpy(in, out, (size_t)nbytes);
    memcpy(record + t * nbytes, out, (size_t)nbytes);
    *count += by;
    if (!any) return t + 1;
  }
  return times;
}
"""
