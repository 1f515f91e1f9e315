/* Prediction over the batch size (scale.h): alignment of recordings, the
 * size model of each allocation, the trace at any batch, and the search
 * for the largest batch that fits.
 *
 * Sizes are requested bytes, so a tensor whose shape has the batch in one
 * dimension requests an exact multiple of it plus a constant: the models
 * are exact, in integers. A size is P(b) / den with P a polynomial of
 * degree 0 to 2 with 128-bit integer coefficients, reduced, so that a
 * prediction is exact to the byte whenever the recordings are. */
#include "scale.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

__extension__ typedef __int128 i128;
__extension__ typedef unsigned __int128 u128;

struct scale_slot {
  i128 p[3]; /* P(b) = p[0] + p[1] b + p[2] b^2 */
  i128 den;  /* > 0 */
  uint8_t kind;
  uint8_t zero; /* every recording asked for 0 bytes: 0 is what it asks */
  uint8_t held; /* a small allocation held at its largest recorded size (fit_sizes) */
};

const char* scale_kind_name(scale_kind_t kind) {
  switch (kind) {
    case SCALE_CONSTANT:
      return "constant";
    case SCALE_AFFINE:
      return "affine";
    case SCALE_QUADRATIC:
      return "quadratic";
    default:
      return "?";
  }
}

/* ---- exact arithmetic -------------------------------------------------- */

static u128 abs128(i128 v) {
  return v < 0 ? (u128)0 - (u128)v : (u128)v;
}

static u128 gcd128(u128 a, u128 b) {
  while (b) {
    u128 r = a % b;
    a = b;
    b = r;
  }
  return a;
}

/* Divides P and den by their common factor, so that equal models compare
 * equal and evaluation meets smaller numbers. */
static void reduce(scale_slot_t* s) {
  u128 g = abs128(s->den);
  for (int i = 0; i < 3; i++) g = gcd128(abs128(s->p[i]), g);
  if (g <= 1) return;
  for (int i = 0; i < 3; i++) s->p[i] /= (i128)g;
  s->den /= (i128)g;
}

/* P(b) exactly into *out; 0 when a step overflows 128 bits. */
static int eval_exact(const scale_slot_t* s, long b, i128* out) {
  i128 x = b, v = s->p[2], t;
  /* Horner: (p2 b + p1) b + p0 */
  if (__builtin_mul_overflow(v, x, &t) || __builtin_add_overflow(t, s->p[1], &v)) return 0;
  if (__builtin_mul_overflow(v, x, &t) || __builtin_add_overflow(t, s->p[0], &v)) return 0;
  *out = v;
  return 1;
}

static double eval_approx(const scale_slot_t* s, long b) {
  double x = (double)b;
  return (((double)s->p[2] * x + (double)s->p[1]) * x + (double)s->p[0]) / (double)s->den;
}

/* The size the model gives at b: SCALE_AT_OK with *bytes rounded to the
 * nearest byte (*rounded set when that changed it), or why there is none.
 * *approx is the size as a real number, for messages. */
static scale_at_status_t size_at(const scale_slot_t* s, long b, uint64_t* bytes, int* rounded,
                                 double* approx) {
  *rounded = 0;
  i128 p;
  if (!eval_exact(s, b, &p)) {
    /* past 2^127 / den: far outside any device, one way or the other */
    *approx = eval_approx(s, b);
    return *approx < 1 ? SCALE_AT_BELOW_ONE : SCALE_AT_TOO_LARGE;
  }
  *approx = (double)p / (double)s->den;
  if (p < 0) return SCALE_AT_BELOW_ONE;
  i128 q = p / s->den, rem = p % s->den;
  if (rem >= s->den - rem) q++; /* to the nearest byte, halves up */
  *rounded = rem != 0;
  if (q > (i128)TRACE_MAX_SIZE) return SCALE_AT_TOO_LARGE;
  if (q < 1 && !s->zero) return SCALE_AT_BELOW_ONE;
  *bytes = (uint64_t)q;
  return SCALE_AT_OK;
}

/* Whether the model gives exactly size s at batch b (integers, no rounding). */
static int passes(const scale_slot_t* m, long b, uint64_t s) {
  i128 p;
  return eval_exact(m, b, &p) && p == (i128)s * m->den;
}

/* The simplest model exact at every point (b[i], s[i]), i < n: constant,
 * then affine through the first two, then quadratic through the first
 * three. 0 when none is. */
static int fit_points(const long* b, const uint64_t* s, size_t n, scale_slot_t* out) {
  memset(out, 0, sizeof *out);
  out->den = 1;
  out->kind = SCALE_CONSTANT;
  out->p[0] = (i128)s[0];
  size_t same = 1;
  while (same < n && s[same] == s[0]) same++;
  if (same == n) {
    out->zero = s[0] == 0;
    return 1;
  }
  /* P(b) = s0 (b1 - b0) + A (b - b0), den = b1 - b0 */
  i128 b0 = b[0], b1 = b[1], s0 = (i128)s[0], s1 = (i128)s[1];
  i128 da = b1 - b0, a = s1 - s0;
  out->kind = SCALE_AFFINE;
  out->den = da;
  out->p[1] = a;
  out->p[0] = s0 * da - a * b0;
  size_t ok = 2;
  while (ok < n && passes(out, b[ok], s[ok])) ok++;
  if (ok == n) {
    reduce(out);
    return 1;
  }
  if (n < 3) return 0;
  /* Newton's form through three points over one denominator:
   * P(b) = s0 Q + A R (b - b0) + B (b - b0)(b - b1), den = Q, with
   * Q = (b1 - b0)(b2 - b1)(b2 - b0), R = Q / (b1 - b0) and
   * B = (s2 - s1)(b1 - b0) - (s1 - s0)(b2 - b1). */
  i128 b2 = b[2], s2 = (i128)s[2];
  i128 r = (b2 - b1) * (b2 - b0), q = da * r;
  i128 bq = (s2 - s1) * da - a * (b2 - b1);
  out->kind = SCALE_QUADRATIC;
  out->den = q;
  out->p[2] = bq;
  out->p[1] = a * r - bq * (b0 + b1);
  out->p[0] = s0 * q - a * r * b0 + bq * b0 * b1;
  ok = 3;
  while (ok < n && passes(out, b[ok], s[ok])) ok++;
  if (ok < n) return 0;
  reduce(out);
  return 1;
}

/* Decimal text of v (at most 40 digits and a sign). */
static const char* i128_text(i128 v, char* buf, size_t cap) {
  char digits[48];
  size_t n = 0;
  u128 u = abs128(v);
  do {
    digits[n++] = (char)('0' + (int)(u % 10));
    u /= 10;
  } while (u && n < sizeof digits);
  size_t k = 0;
  if (v < 0 && k + 1 < cap) buf[k++] = '-';
  while (n && k + 1 < cap) buf[k++] = digits[--n];
  buf[k] = '\0';
  return buf;
}

/* "(300 + 100*b) / 2" or "4096" or "(128*b^2 + 64*b) bytes": the model as
 * a formula in b, for messages. */
static void describe(const scale_slot_t* s, char* out, size_t cap) {
  char num[200] = "", t[48];
  size_t len = 0;
  static const char* const power[] = {"", "*b", "*b^2"};
  for (int i = 2; i >= 0; i--) {
    if (s->p[i] == 0) continue;
    i128_text(len && s->p[i] < 0 ? -s->p[i] : s->p[i], t, sizeof t);
    int n = snprintf(num + len, sizeof num - len, "%s%s%s",
                     len ? (s->p[i] < 0 ? " - " : " + ") : "", t, power[i]);
    if (n > 0 && (size_t)n < sizeof num - len) len += (size_t)n;
  }
  if (!len) snprintf(num, sizeof num, "0");
  if (s->den == 1) {
    snprintf(out, cap, "%s", num);
  } else {
    snprintf(out, cap, "(%s) / %s", num, i128_text(s->den, t, sizeof t));
  }
}

/* ---- alignment ---------------------------------------------------------- */

/* The streams of one recording in order of first appearance: recordings
 * made by different processes name the same stream by different handles. */
typedef struct stream_order {
  uintptr_t seen[TRACE_MAX_STREAMS];
  size_t count;
} stream_order_t;

static size_t stream_index(stream_order_t* o, uintptr_t stream) {
  for (size_t i = 0; i < o->count; i++)
    if (o->seen[i] == stream) return i;
  if (o->count < TRACE_MAX_STREAMS) o->seen[o->count] = stream;
  return o->count++;
}

static const char* ordinal(size_t n, char* buf, size_t cap) {
  const char* suffix = (n % 100 >= 11 && n % 100 <= 13) ? "th"
                       : n % 10 == 1                    ? "st"
                       : n % 10 == 2                    ? "nd"
                       : n % 10 == 3                    ? "rd"
                                                        : "th";
  snprintf(buf, cap, "%zu%s", n, suffix);
  return buf;
}

/* "line 12: alloc of 4096 bytes on stream 0x0 (its 1st stream)" */
static void describe_event(const trace_t* t, size_t i, size_t stream_idx, char* out, size_t cap) {
  const trace_event_t* e = &t->events[i];
  char nth[16];
  unsigned alloc_line = t->events[t->slot_event[e->id]].line;
  switch (e->op) {
    case TRACE_ALLOC:
      snprintf(out, cap, "line %u: alloc of %llu bytes on stream 0x%llx (its %s stream)", e->line,
               (unsigned long long)e->size, (unsigned long long)e->stream,
               ordinal(stream_idx + 1, nth, sizeof nth));
      break;
    case TRACE_FREE:
      snprintf(out, cap, "line %u: free of the allocation of line %u", e->line, alloc_line);
      break;
    default:
      snprintf(
          out, cap,
          "line %u: record_stream of the allocation of line %u on stream 0x%llx (its %s stream)",
          e->line, alloc_line, (unsigned long long)e->stream,
          ordinal(stream_idx + 1, nth, sizeof nth));
      break;
  }
}

static const char alignment_hint[] =
    "the recordings must be the same job making the same requests in the same order, only "
    "their sizes changing with the batch";

/* Event counts to align: whole traces when they are as long as each other
 * (or some have no step markers), else the whole steps they have in common:
 * recordings stopped after different numbers of steps, or in the middle of
 * one, still describe the same steps. */
static void choose_events(scale_model_t* m, size_t* use) {
  size_t n = m->num_recordings, fewest = SIZE_MAX, most = 0;
  int same_length = 1;
  for (size_t i = 0; i < n; i++) {
    size_t steps = m->traces[i]->num_steps;
    if (steps < fewest) fewest = steps;
    if (steps > most) most = steps;
    use[i] = m->traces[i]->num_events;
    if (use[i] != use[0]) same_length = 0;
  }
  if (fewest == 0) return; /* a recording without step markers: as wholes */
  m->steps_used = fewest;
  if (fewest == most && same_length) return;
  for (size_t i = 0; i < n; i++) {
    const trace_t* t = m->traces[i];
    use[i] = t->step_end[fewest - 1];
    if (use[i] < t->num_events) m->truncated = 1;
  }
}

static int by_freed_slot(const void* a, const void* b) {
  uint32_t x = ((const trace_event_t*)a)->id, y = ((const trace_event_t*)b)->id;
  return x < y ? -1 : x > y;
}

void scale_canonical_frees(trace_t* trace) {
  size_t i = 0;
  while (i < trace->num_events) {
    size_t j = i;
    while (j < trace->num_events && trace->events[j].op == TRACE_FREE) j++;
    if (j - i > 1) qsort(trace->events + i, j - i, sizeof *trace->events, by_freed_slot);
    i = j > i ? j : i + 1;
  }
}

/* Compares recording k with the first, event by event. */
static gpumem_status_t align_one(const scale_model_t* m, size_t k, const size_t* use) {
  const trace_t* a = m->traces[0];
  const trace_t* t = m->traces[k];
  stream_order_t* oa = calloc(2, sizeof *oa);
  if (!oa) {
    gpumem_set_last_error("out of host memory aligning the recordings");
    return GPUMEM_ERR_HOST_MEMORY;
  }
  stream_order_t* ot = oa + 1;
  size_t n = use[0] < use[k] ? use[0] : use[k];
  gpumem_status_t st = GPUMEM_OK;
  for (size_t i = 0; i < n; i++) {
    const trace_event_t* x = &a->events[i];
    const trace_event_t* y = &t->events[i];
    size_t sx = x->op == TRACE_FREE ? 0 : stream_index(oa, x->stream);
    size_t sy = y->op == TRACE_FREE ? 0 : stream_index(ot, y->stream);
    if (x->op == y->op && (x->op == TRACE_ALLOC || x->id == y->id) && sx == sy) continue;
    char dx[200], dy[200];
    describe_event(a, i, sx, dx, sizeof dx);
    describe_event(t, i, sy, dy, sizeof dy);
    gpumem_set_last_error(
        "the recordings differ at event %zu: %s (batch %ld) has %s; %s (batch %ld) has %s: %s",
        i + 1, a->path, m->batch[0], dx, t->path, m->batch[k], dy, alignment_hint);
    st = GPUMEM_ERR_INVALID_ARGUMENT;
    break;
  }
  if (st == GPUMEM_OK && use[0] != use[k]) {
    const trace_t* longer = use[0] > use[k] ? a : t;
    const trace_t* shorter = longer == a ? t : a;
    char d[200];
    stream_order_t* o = longer == a ? oa : ot;
    const trace_event_t* e = &longer->events[n];
    describe_event(longer, n, e->op == TRACE_FREE ? 0 : stream_index(o, e->stream), d, sizeof d);
    gpumem_set_last_error(
        "the recordings differ at event %zu: %s ends there (%zu events%s) where %s has %s: %s",
        n + 1, shorter->path, n, m->steps_used ? " in the steps in common" : "", longer->path, d,
        alignment_hint);
    st = GPUMEM_ERR_INVALID_ARGUMENT;
  }
  free(oa);
  return st;
}

/* "a.trace line 12, b.trace line 12" for slot s: where each recording made
 * the allocation. */
static void slot_lines(const scale_model_t* m, size_t slot, char* out, size_t cap) {
  size_t len = 0;
  out[0] = '\0';
  for (size_t i = 0; i < m->num_recordings && len < cap; i++) {
    const trace_t* t = m->traces[i];
    int n = snprintf(out + len, cap - len, "%s%s line %u", i ? ", " : "", t->path,
                     t->events[t->slot_event[slot]].line);
    if (n < 0) break;
    len += (size_t)n;
  }
}

/* "100 at batch 2, 200 at batch 4" */
static void slot_sizes_text(const scale_model_t* m, size_t slot, char* out, size_t cap) {
  size_t len = 0;
  out[0] = '\0';
  for (size_t i = 0; i < m->num_recordings && len < cap; i++) {
    const trace_t* t = m->traces[i];
    int n = snprintf(out + len, cap - len, "%s%llu at batch %ld", i ? ", " : "",
                     (unsigned long long)t->events[t->slot_event[slot]].size, m->batch[i]);
    if (n < 0) break;
    len += (size_t)n;
  }
}

/* Peak of the live bytes over the first model->num_events events of the
 * first recording, with the sizes given per slot. */
static uint64_t peak_live(const scale_model_t* m, const uint64_t* size) {
  const trace_t* t = m->traces[0];
  uint64_t live = 0, peak = 0;
  for (size_t i = 0; i < m->num_events; i++) {
    const trace_event_t* e = &t->events[i];
    if (e->op == TRACE_ALLOC) live += size[e->id];
    if (e->op == TRACE_FREE) live -= size[e->id];
    if (live > peak) peak = live;
  }
  return peak;
}

/* fit_points, except for allocations of at most SCALE_BLOCK bytes in every
 * recording whose sizes fall with the batch or need a curve: PyTorch's
 * allocator, gpumem's and both peer models give any request up to 512
 * bytes a block of 512, so such an allocation takes the same memory
 * whatever it asks. Small tensors whose size follows no trend in the batch
 * (an index list, a library's scratch: 6, 96 and 24 bytes at three sizes)
 * would be extrapolated through their zigzag, below one byte or far above
 * a block; they are held at the largest size recorded instead. */
static int fit_sizes(const long* b, const uint64_t* s, size_t n, scale_slot_t* out) {
  int fitted = fit_points(b, s, n, out);
  uint64_t largest = 0;
  for (size_t i = 0; i < n; i++)
    if (s[i] > largest) largest = s[i];
  if (largest > SCALE_BLOCK) return fitted;
  /* (a curve whose every term grows, 4, 16 and 64 bytes at 1, 2 and 4, is
   * a trend: a batch-by-batch matrix, which is no small allocation at a
   * large batch) */
  if (fitted &&
      (out->kind == SCALE_CONSTANT || (out->kind == SCALE_AFFINE && out->p[1] >= 0) ||
       (out->kind == SCALE_QUADRATIC && out->p[2] > 0 && out->p[1] >= 0 && out->p[0] >= 0)))
    return 1;
  memset(out, 0, sizeof *out);
  out->den = 1;
  out->kind = SCALE_CONSTANT;
  out->p[0] = (i128)largest;
  out->held = 1;
  return 1;
}

/* Whether sizes s[0] at batch b[0] and s[1] at b[1] grow nearer a square
 * of the batch than a line through 0: s1 / s0 above the midpoint of r and
 * r^2, r = b1 / b0 (4 and 16 bytes at 1 and 2: a 1x1 and a 2x2 matrix of
 * floats). An affine size so fitted has a negative constant, which a
 * tensor's shape seldom has. */
static int faster_than_batch(const long* b, const uint64_t* s) {
  if (s[0] == 0 || s[1] <= s[0]) return 0;
  u128 b0 = (u128)b[0], b1 = (u128)b[1];
  return (u128)2 * s[1] * b0 * b0 > (u128)s[0] * (b1 * b0 + b1 * b1);
}

/* The held-out check: the largest recording predicted from the others. */
static void check_last(scale_model_t* m, uint64_t* sizes, uint64_t* predicted) {
  size_t k = m->num_recordings, n = k - 1;
  scale_check_t* c = &m->check;
  c->done = 1;
  c->batch = m->batch[n];
  c->allocations = m->num_allocs;
  for (size_t slot = 0; slot < m->num_allocs; slot++) {
    for (size_t i = 0; i < k; i++) {
      const trace_t* t = m->traces[i];
      sizes[i] = t->events[t->slot_event[slot]].size;
    }
    scale_slot_t s;
    uint64_t got = 0;
    int rounded;
    double approx;
    predicted[slot] = sizes[n];
    if (!fit_sizes(m->batch, sizes, n, &s) ||
        size_at(&s, m->batch[n], &got, &rounded, &approx) != SCALE_AT_OK) {
      c->unpredicted++;
      continue;
    }
    predicted[slot] = got;
    uint64_t miss = got > sizes[n] ? got - sizes[n] : sizes[n] - got;
    if (miss == 0) c->exact++;
    if (miss > c->max_error_bytes) c->max_error_bytes = miss;
  }
  c->predicted_peak_live = peak_live(m, predicted);
  for (size_t slot = 0; slot < m->num_allocs; slot++) {
    const trace_t* t = m->traces[n];
    predicted[slot] = t->events[t->slot_event[slot]].size;
  }
  c->recorded_peak_live = peak_live(m, predicted);
}

static gpumem_status_t fit_slots(scale_model_t* m) {
  size_t k = m->num_recordings;
  uint64_t* sizes = malloc(k * sizeof *sizes);
  uint64_t* scratch = malloc((m->num_allocs ? m->num_allocs : 1) * sizeof *scratch);
  m->slots = calloc(m->num_allocs ? m->num_allocs : 1, sizeof *m->slots);
  gpumem_status_t st = GPUMEM_OK;
  if (!sizes || !scratch || !m->slots) {
    gpumem_set_last_error("out of host memory fitting the sizes");
    st = GPUMEM_ERR_HOST_MEMORY;
    goto done;
  }
  for (size_t slot = 0; slot < m->num_allocs; slot++) {
    for (size_t i = 0; i < k; i++) {
      const trace_t* t = m->traces[i];
      sizes[i] = t->events[t->slot_event[slot]].size;
    }
    if (!fit_sizes(m->batch, sizes, k, &m->slots[slot])) {
      char lines[512], text[512];
      slot_lines(m, slot, lines, sizeof lines);
      slot_sizes_text(m, slot, text, sizeof text);
      gpumem_set_last_error(
          "the allocation at %s requests %s: no constant, affine (a + c*b) or quadratic "
          "(a + c*b + d*b^2) size in the batch b gives all of them",
          lines, text);
      st = GPUMEM_ERR_INVALID_ARGUMENT;
      goto done;
    }
    m->kind_count[m->slots[slot].kind]++;
    m->num_held += m->slots[slot].held;
    if (k == 2 && m->slots[slot].kind == SCALE_AFFINE && !m->slots[slot].held &&
        faster_than_batch(m->batch, sizes)) {
      const trace_t* t = m->traces[1];
      if (!m->num_faster || sizes[1] > t->events[t->slot_event[m->faster_example]].size)
        m->faster_example = slot;
      m->num_faster++;
      m->faster_bytes += sizes[1];
    }
  }
  /* Runs at different batches differ in their activations at least: the
   * same recording twice would predict that nothing grows, and every
   * batch would fit. */
  if (m->kind_count[SCALE_CONSTANT] == m->num_allocs) {
    gpumem_set_last_error(
        "no allocation's size differs between %s (batch %ld) and %s (batch %ld): the same "
        "run twice, or a job whose memory does not follow the batch; recordings at different "
        "batch sizes are needed",
        m->traces[0]->path, m->batch[0], m->traces[k - 1]->path, m->batch[k - 1]);
    st = GPUMEM_ERR_INVALID_ARGUMENT;
    goto done;
  }
  if (k >= 3) check_last(m, sizes, scratch);
done:
  free(sizes);
  free(scratch);
  return st;
}

gpumem_status_t scale_fit(const trace_t* const* traces, const long* batch, size_t n,
                          scale_model_t** out) {
  *out = NULL;
  if (n < 2 || n > SCALE_MAX_RECORDINGS) {
    gpumem_set_last_error("%zu recordings: the model needs 2 to %d, at different batch sizes", n,
                          SCALE_MAX_RECORDINGS);
    return GPUMEM_ERR_INVALID_ARGUMENT;
  }
  for (size_t i = 0; i < n; i++) {
    if (batch[i] < 1 || batch[i] > SCALE_MAX_RECORDED_BATCH) {
      gpumem_set_last_error("batch size %ld of %s: recordings are taken at 1 to %ld", batch[i],
                            traces[i]->path, SCALE_MAX_RECORDED_BATCH);
      return GPUMEM_ERR_INVALID_ARGUMENT;
    }
    if (i && batch[i] <= batch[i - 1]) {
      gpumem_set_last_error(
          "batch sizes %ld then %ld: they must increase, one different size per recording",
          batch[i - 1], batch[i]);
      return GPUMEM_ERR_INVALID_ARGUMENT;
    }
  }
  scale_model_t* m = calloc(1, sizeof *m);
  size_t* use = calloc(n, sizeof *use);
  gpumem_status_t st = GPUMEM_OK;
  if (!m || !use) {
    gpumem_set_last_error("out of host memory aligning the recordings");
    st = GPUMEM_ERR_HOST_MEMORY;
    goto done;
  }
  m->num_recordings = n;
  for (size_t i = 0; i < n; i++) {
    m->traces[i] = traces[i];
    m->batch[i] = batch[i];
  }
  choose_events(m, use);
  for (size_t i = 1; i < n && st == GPUMEM_OK; i++) st = align_one(m, i, use);
  if (st != GPUMEM_OK) goto done;
  m->num_events = use[0];
  /* slots are dense in allocation order: those of the events used */
  const trace_t* first = traces[0];
  while (m->num_allocs < first->num_allocs && first->slot_event[m->num_allocs] < m->num_events)
    m->num_allocs++;
  st = fit_slots(m);
done:
  free(use);
  if (st != GPUMEM_OK) {
    scale_free(m);
    return st;
  }
  *out = m;
  return GPUMEM_OK;
}

void scale_free(scale_model_t* m) {
  if (!m) return;
  free(m->slots);
  free(m);
}

/* ---- the trace at a batch ------------------------------------------------ */

gpumem_status_t scale_trace_at(const scale_model_t* m, long batch, trace_t** out,
                               scale_at_t* info) {
  scale_at_t local;
  if (!info) info = &local;
  memset(info, 0, sizeof *info);
  *out = NULL;
  if (batch < 1 || batch > SCALE_MAX_BATCH) {
    gpumem_set_last_error("batch %ld: predictions are made for batches 1 to %ld", batch,
                          SCALE_MAX_BATCH);
    return GPUMEM_ERR_INVALID_ARGUMENT;
  }
  uint64_t* size = malloc((m->num_allocs ? m->num_allocs : 1) * sizeof *size);
  if (!size) {
    gpumem_set_last_error("out of host memory predicting batch %ld", batch);
    return GPUMEM_ERR_HOST_MEMORY;
  }
  for (size_t slot = 0; slot < m->num_allocs; slot++) {
    int rounded;
    scale_at_status_t why = size_at(&m->slots[slot], batch, &size[slot], &rounded, &info->bytes);
    info->rounded += (size_t)rounded;
    if (why == SCALE_AT_OK) continue;
    info->status = why;
    info->slot = slot;
    char lines[512], text[512], formula[256];
    slot_lines(m, slot, lines, sizeof lines);
    slot_sizes_text(m, slot, text, sizeof text);
    describe(&m->slots[slot], formula, sizeof formula);
    gpumem_set_last_error(
        "at batch %ld the allocation at %s would request %.0f bytes (%s from %s, %s in the "
        "batch b): %s",
        batch, lines, info->bytes, formula, text, scale_kind_name(m->slots[slot].kind),
        why == SCALE_AT_BELOW_ONE
            ? "the model holds only where every size is at least 1 byte"
            : "more than the readers' limit of 2^48 bytes, more than any device has");
    free(size);
    return GPUMEM_ERR_INVALID_ARGUMENT;
  }
  uint64_t total = 0;
  for (size_t slot = 0; slot < m->num_allocs && total <= TRACE_MAX_TOTAL; slot++)
    total += size[slot];
  if (total > TRACE_MAX_TOTAL) {
    info->status = SCALE_AT_TOO_LARGE;
    gpumem_set_last_error(
        "at batch %ld the allocations would request more than 2^62 bytes in all (the readers' "
        "limit), more than any device has",
        batch);
    free(size);
    return GPUMEM_ERR_INVALID_ARGUMENT;
  }
  char path[512];
  snprintf(path, sizeof path, "%s@%ld", m->traces[0]->name, batch);
  gpumem_status_t st = trace_resized(m->traces[0], m->num_events, size, path, out);
  free(size);
  return st;
}

/* ---- the largest batch that fits ------------------------------------------ */

typedef enum probe_result { PROBE_FITS, PROBE_NO_FIT, PROBE_NO_MODEL } probe_result_t;

static gpumem_status_t probe(const scale_model_t* m, const fit_row_t* row, size_t memory,
                             const replay_config_t* base, long batch, scale_largest_t* out,
                             probe_result_t* result) {
  trace_t* t = NULL;
  scale_at_t info;
  gpumem_status_t st = scale_trace_at(m, batch, &t, &info);
  if (st != GPUMEM_OK) {
    if (info.status == SCALE_AT_OK) return st; /* host memory, or a trace that did not parse */
    *result = info.status == SCALE_AT_TOO_LARGE ? PROBE_NO_FIT : PROBE_NO_MODEL;
    return GPUMEM_OK;
  }
  int fits = 0;
  out->probes++;
  st = fit_fits(t, row, memory, base, &fits);
  trace_free(t);
  *result = fits ? PROBE_FITS : PROBE_NO_FIT;
  return st;
}

gpumem_status_t scale_largest_batch(const scale_model_t* m, const fit_row_t* row, size_t memory,
                                    long max_batch, const replay_config_t* base,
                                    scale_largest_t* out) {
  memset(out, 0, sizeof *out);
  if (max_batch <= 0 || max_batch > SCALE_MAX_BATCH) max_batch = SCALE_MAX_BATCH;
  /* lo: the largest batch known to fit (0: none yet); hi: the smallest
   * known not to (0: none yet). A batch without a model counts as not
   * fitting on the side it was met, and is remembered. */
  long lo = 0, hi = 0;
  long start = m->batch[0] < max_batch ? m->batch[0] : max_batch;
  probe_result_t r;
  gpumem_status_t st = probe(m, row, memory, base, start, out, &r);
  if (st != GPUMEM_OK) return st;
  if (r == PROBE_FITS) {
    lo = start;
    while (!hi && lo < max_batch) {
      long next = lo > max_batch / 2 ? max_batch : lo * 2;
      if ((st = probe(m, row, memory, base, next, out, &r)) != GPUMEM_OK) return st;
      if (r == PROBE_FITS) {
        lo = next;
      } else {
        hi = next;
        if (r == PROBE_NO_MODEL) out->model_edge = next;
      }
    }
  } else {
    hi = start;
    if (r == PROBE_NO_MODEL) out->model_edge = start;
  }
  long floor = 0; /* below it the model gives no sizes: nothing is tried there */
  while (hi && hi - lo > 1 && hi - floor > 1) {
    long mid = (lo > floor ? lo : floor) + (hi - (lo > floor ? lo : floor)) / 2;
    if ((st = probe(m, row, memory, base, mid, out, &r)) != GPUMEM_OK) return st;
    if (r == PROBE_FITS) {
      lo = mid;
    } else if (r == PROBE_NO_MODEL && mid < m->batch[0]) {
      /* sizes that shrink to nothing below the recordings: no answer below */
      floor = mid;
      out->model_edge = mid;
    } else {
      hi = mid;
      if (r == PROBE_NO_MODEL) out->model_edge = mid;
    }
  }
  out->batch = lo;
  out->first_not_fitting = hi;
  out->below_recorded = lo < m->batch[0];
  if (!hi) {
    out->limited_by = SCALE_BY_MAX_BATCH;
  } else if (out->model_edge && out->model_edge == hi) {
    out->limited_by = SCALE_BY_MODEL;
  } else {
    out->limited_by = SCALE_BY_MEMORY;
  }
  return GPUMEM_OK;
}
