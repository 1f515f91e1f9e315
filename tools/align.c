/* Recordings aligned by role, not position (align.h). */
#include "align.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The block every allocator modelled gives a request of up to this many
 * bytes: two such requests take the same memory, whatever they ask. */
#define ALIGN_BLOCK 512
/* Gaps between exact matches at most this many cells (allocations of one
 * times the other's) are matched by a full table, which picks the closest
 * sizes among matchings of equal length; larger ones by the greedy one. */
#define ALIGN_TABLE_CELLS ((size_t)1 << 22)

__extension__ typedef unsigned __int128 u128;

/* One recording's allocations in the aligner's terms. */
typedef struct seq {
  const trace_t* t;
  size_t n;         /* allocations among the events used */
  size_t events;    /* events used */
  uint32_t* stream; /* its stream, by order of first appearance */
  uint64_t* role;   /* hash of its role's text, 0 for none */
  uint64_t* size;
  uint8_t* optimizer; /* 1: made in an optimizer's step (TRACE_OPTIMIZER_ROLE) */
} seq_t;

typedef struct pair_list {
  size_t *r, *o; /* allocation r of the largest recording is allocation o of the other */
  size_t n, cap;
} pair_list_t;

typedef struct ctx {
  const seq_t* R; /* the largest recording */
  const seq_t* O; /* a smaller one */
  long bR, bO;
  int roles; /* both recordings name roles */
} ctx_t;

static uint64_t text_hash(const char* s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
  return h ? h : 1;
}

static void seq_free(seq_t* s) {
  free(s->stream);
  free(s->role);
  free(s->size);
  free(s->optimizer);
  memset(s, 0, sizeof *s);
}

static int seq_init(seq_t* s, const trace_t* t, size_t events) {
  memset(s, 0, sizeof *s);
  s->t = t;
  s->events = events;
  size_t n = 0;
  while (n < t->num_allocs && t->slot_event[n] < events) n++;
  s->n = n;
  s->stream = malloc((n ? n : 1) * sizeof *s->stream);
  s->role = calloc(n ? n : 1, sizeof *s->role);
  s->size = malloc((n ? n : 1) * sizeof *s->size);
  s->optimizer = calloc(n ? n : 1, 1);
  if (!s->stream || !s->role || !s->size || !s->optimizer) return -1;
  uintptr_t seen[TRACE_MAX_STREAMS];
  uint32_t count = 0;
  uint64_t* role_hash = NULL;
  uint8_t* role_optimizer = NULL; /* per role, as role_hash: tested once, not per allocation */
  if (t->slot_role && t->num_roles > 1) {
    role_hash = calloc(t->num_roles, sizeof *role_hash);
    role_optimizer = calloc(t->num_roles, 1);
    if (!role_hash || !role_optimizer) {
      free(role_hash);
      free(role_optimizer);
      return -1;
    }
    const size_t len = strlen(TRACE_OPTIMIZER_ROLE);
    for (size_t r = 1; r < t->num_roles; r++) {
      role_hash[r] = text_hash(t->roles[r]);
      role_optimizer[r] = t->roles[r] && strncmp(t->roles[r], TRACE_OPTIMIZER_ROLE, len) == 0;
    }
  }
  for (size_t i = 0; i < n; i++) {
    const trace_event_t* e = &t->events[t->slot_event[i]];
    uint32_t k = 0;
    while (k < count && seen[k] != e->stream) k++;
    if (k == count && count < TRACE_MAX_STREAMS) seen[count++] = e->stream;
    s->stream[i] = k;
    s->size[i] = e->size;
    if (role_hash) {
      s->role[i] = role_hash[t->slot_role[i]];
      s->optimizer[i] = role_optimizer[t->slot_role[i]];
    }
  }
  free(role_hash);
  free(role_optimizer);
  return 0;
}

static int has_roles(const seq_t* s) {
  for (size_t i = 0; i < s->n; i++)
    if (s->role[i]) return 1;
  return 0;
}

static int same_maker(const ctx_t* c, size_t i, size_t j) {
  if (c->R->stream[i] != c->O->stream[j]) return 0;
  uint64_t a = c->R->role[i], b = c->O->role[j];
  return !c->roles || !a || !b || a == b;
}

/* The same request: equal sizes, or sizes in exact proportion to the
 * batch; within one block, in exact proportion to its square too. Two
 * sizes within a block need not be one request: at batch 1, 2 and 4 a
 * loss's logits are 2, 8 and 32 bytes and the scalars beside them 4 at
 * each, and taking any two small sizes for the same request matched a
 * batch-by-batch matrix with a scalar (grown_pair still pairs them where
 * nothing better is found). */
static int exact_pair(const ctx_t* c, size_t i, size_t j) {
  if (!same_maker(c, i, j)) return 0;
  uint64_t r = c->R->size[i], o = c->O->size[j];
  if (r == o || (u128)r * (u128)c->bO == (u128)o * (u128)c->bR) return 1;
  return r <= ALIGN_BLOCK && o <= ALIGN_BLOCK &&
         (u128)r * (u128)c->bO * (u128)c->bO == (u128)o * (u128)c->bR * (u128)c->bR;
}

/* A request that can have grown into the larger one: no smaller, and at
 * most the square of the batches' ratio larger (a size quadratic in the
 * batch, or in a sequence length), a block of slack. */
static int grown_pair(const ctx_t* c, size_t i, size_t j) {
  if (!same_maker(c, i, j)) return 0;
  uint64_t r = c->R->size[i], o = c->O->size[j];
  if (r <= ALIGN_BLOCK && o <= ALIGN_BLOCK) return 1;
  if (o > r) return 0;
  u128 bound = (u128)(o + ALIGN_BLOCK) * (u128)c->bR * (u128)c->bR;
  return (u128)r * (u128)c->bO * (u128)c->bO <= bound;
}

typedef int (*pair_fn)(const ctx_t*, size_t, size_t);

static int pairs_push(pair_list_t* p, size_t r, size_t o) {
  if (p->n == p->cap) {
    size_t cap = p->cap ? p->cap * 2 : 1024;
    size_t* nr = realloc(p->r, cap * sizeof *nr);
    if (!nr) return -1;
    p->r = nr;
    size_t* no = realloc(p->o, cap * sizeof *no);
    if (!no) return -1;
    p->o = no;
    p->cap = cap;
  }
  p->r[p->n] = r;
  p->o[p->n] = o;
  p->n++;
  return 0;
}

/* The longest common subsequence of R[r0, r1) and O[o0, o1) under `pair`,
 * by Myers' O((N+M)D) algorithm: a match at the front of both is always
 * part of some longest one, whatever the relation, so the greedy walk
 * along each diagonal is exact. The pairs are appended to out in order.
 * 0 done, 1 more than ALIGN_MAX_DIFFERENCES edits, -1 out of memory. */
static int myers(const ctx_t* c, pair_fn pair, size_t r0, size_t r1, size_t o0, size_t o1,
                 pair_list_t* out) {
  long N = (long)(r1 - r0), M = (long)(o1 - o0);
  if (N == 0 || M == 0) return 0;
  long maxd = N + M < ALIGN_MAX_DIFFERENCES ? N + M : ALIGN_MAX_DIFFERENCES;
  long off = maxd + 1;
  long* V = calloc((size_t)(2 * maxd + 3), sizeof *V);
  /* V after each round d, its diagonals -d..d, from (d*d) on: the way back */
  int32_t* hist = NULL; /* (x < N, and N is below 2^31: slots are 32-bit) */
  size_t hist_cap = 0;
  size_t* back_r = NULL;
  size_t* back_o = NULL;
  int rc = -1;
  if (!V) goto done;
  long found = -1;
  for (long d = 0; d <= maxd && found < 0; d++) {
    for (long k = -d; k <= d; k += 2) {
      long x = (k == -d || (k != d && V[off + k - 1] < V[off + k + 1])) ? V[off + k + 1]
                                                                        : V[off + k - 1] + 1;
      long y = x - k;
      while (x < N && y < M && pair(c, r0 + (size_t)x, o0 + (size_t)y)) {
        x++;
        y++;
      }
      V[off + k] = x;
      if (x >= N && y >= M) found = d;
    }
    size_t need = (size_t)(d + 1) * (size_t)(d + 1);
    if (need > hist_cap) {
      size_t cap = hist_cap ? hist_cap * 2 : 4096;
      while (cap < need) cap *= 2;
      int32_t* h = realloc(hist, cap * sizeof *h);
      if (!h) goto done;
      hist = h;
      hist_cap = cap;
    }
    for (long k = -d; k <= d; k++)
      hist[(size_t)d * (size_t)d + (size_t)(k + d)] = (int32_t)V[off + k];
  }
  if (found < 0) {
    rc = 1;
    goto done;
  }
  /* Back from (N, M): each round's snake, then the edit before it. */
  size_t cap = (size_t)(N < M ? N : M) + 1, nb = 0;
  back_r = malloc(cap * sizeof *back_r);
  back_o = malloc(cap * sizeof *back_o);
  if (!back_r || !back_o) goto done;
  long x = N, y = M;
  for (long d = found; d >= 0; d--) {
    long k = x - y, start, px = 0, py = 0;
    if (d == 0) {
      start = 0;
    } else {
      const int32_t* prev = hist + (size_t)(d - 1) * (size_t)(d - 1) + (d - 1); /* prev[k'] */
      long pk = (k == -d || (k != d && prev[k - 1] < prev[k + 1])) ? k + 1 : k - 1;
      px = prev[pk];
      py = px - pk;
      start = pk == k + 1 ? px : px + 1; /* down (one of O unmatched) or right (one of R) */
    }
    for (long xx = x - 1; xx >= start && nb < cap; xx--) {
      back_r[nb] = r0 + (size_t)xx;
      back_o[nb] = o0 + (size_t)(xx - k);
      nb++;
    }
    x = px;
    y = py;
  }
  rc = 0;
  while (nb > 0 && rc == 0) {
    nb--;
    if (pairs_push(out, back_r[nb], back_o[nb]) != 0) rc = -1;
  }
done:
  free(V);
  free(hist);
  free(back_r);
  free(back_o);
  return rc;
}

/* How far a pair's sizes are from equal or from in proportion to the
 * batch or its square, in millionths of a natural log. */
static long long misfit(const ctx_t* c, size_t i, size_t j) {
  double r = (double)(c->R->size[i] > 0 ? c->R->size[i] : 1);
  double o = (double)(c->O->size[j] > 0 ? c->O->size[j] : 1);
  double lr = log(r / o), lb = log((double)c->bR / (double)c->bO);
  double m = fmin(fabs(lr), fmin(fabs(lr - lb), fabs(lr - 2 * lb)));
  return (long long)(m * 1e6);
}

/* The longest matching of R[r0, r1) and O[o0, o1) under grown_pair, and of
 * those the one whose sizes are nearest equal or in proportion: a table
 * of (r1 - r0 + 1) x (o1 - o0 + 1) cells. */
static int table(const ctx_t* c, size_t r0, size_t r1, size_t o0, size_t o1, pair_list_t* out) {
  size_t N = r1 - r0, M = o1 - o0, W = M + 1;
  /* score: matches in the high bits, minus misfit */
  long long* score = malloc((N + 1) * W * sizeof *score);
  unsigned char* how = malloc((N + 1) * W);
  size_t *br = NULL, *bo = NULL;
  int rc = -1;
  if (!score || !how) goto done;
  const long long MATCH = 1LL << 40;
  for (size_t i = 0; i <= N; i++) {
    for (size_t j = 0; j <= M; j++) {
      size_t at = i * W + j;
      if (i == 0 || j == 0) {
        score[at] = 0;
        how[at] = i == 0 ? 2 : 1;
        continue;
      }
      long long best = score[(i - 1) * W + j];
      unsigned char h = 1; /* R[i-1] unmatched */
      if (score[i * W + j - 1] > best) {
        best = score[i * W + j - 1];
        h = 2; /* O[j-1] unmatched */
      }
      if (grown_pair(c, r0 + i - 1, o0 + j - 1)) {
        long long s = score[(i - 1) * W + j - 1] + MATCH - misfit(c, r0 + i - 1, o0 + j - 1);
        if (s > best) {
          best = s;
          h = 3;
        }
      }
      score[at] = best;
      how[at] = h;
    }
  }
  size_t cap = (N < M ? N : M) + 1, nb = 0;
  br = malloc(cap * sizeof *br);
  bo = malloc(cap * sizeof *bo);
  if (!br || !bo) goto done;
  size_t i = N, j = M;
  while (i > 0 && j > 0) {
    unsigned char h = how[i * W + j];
    if (h == 3) {
      br[nb] = r0 + i - 1;
      bo[nb] = o0 + j - 1;
      nb++;
      i--;
      j--;
    } else if (h == 1) {
      i--;
    } else {
      j--;
    }
  }
  rc = 0;
  while (nb > 0 && rc == 0) {
    nb--;
    if (pairs_push(out, br[nb], bo[nb]) != 0) rc = -1;
  }
done:
  free(score);
  free(how);
  free(br);
  free(bo);
  return rc;
}

/* Matches R[r0, r1) and O[o0, o1), between two exact matches or the ends. */
static int fill_gap(const ctx_t* c, size_t r0, size_t r1, size_t o0, size_t o1, pair_list_t* out) {
  if (r1 == r0 || o1 == o0) return 0;
  if ((r1 - r0) * (o1 - o0) <= ALIGN_TABLE_CELLS) return table(c, r0, r1, o0, o1, out);
  return myers(c, grown_pair, r0, r1, o0, o1, out);
}

/* The matching of R and O: the exact pairs first (the common start and end
 * taken as they are), then the gaps between them. match_of[r] = its
 * partner in O + 1, 0 for none. 0 done, 1 too many differences, -1 out of
 * memory. */
static int match(const ctx_t* c, size_t* match_of) {
  size_t nR = c->R->n, nO = c->O->n;
  size_t head = 0, tail = 0;
  while (head < nR && head < nO && exact_pair(c, head, head)) head++;
  while (tail < nR - head && tail < nO - head && exact_pair(c, nR - 1 - tail, nO - 1 - tail))
    tail++;
  pair_list_t exact = {0}, all = {0};
  int rc = 0;
  for (size_t i = 0; i < head && rc == 0; i++) rc = pairs_push(&exact, i, i);
  if (rc == 0) rc = myers(c, exact_pair, head, nR - tail, head, nO - tail, &exact);
  if (rc == 1) {
    /* too many sizes out of proportion to find the exact ones first */
    exact.n = head;
    rc = myers(c, grown_pair, head, nR - tail, head, nO - tail, &exact);
  }
  for (size_t i = 0; i < tail && rc == 0; i++)
    rc = pairs_push(&exact, nR - tail + i, nO - tail + i);
  /* the gaps between exact matches */
  size_t pr = 0, po = 0;
  for (size_t k = 0; k <= exact.n && rc == 0; k++) {
    size_t er = k < exact.n ? exact.r[k] : nR, eo = k < exact.n ? exact.o[k] : nO;
    rc = fill_gap(c, pr, er, po, eo, &all);
    if (rc == 0 && k < exact.n) rc = pairs_push(&all, er, eo);
    pr = er + 1;
    po = eo + 1;
  }
  if (rc == 0) {
    memset(match_of, 0, nR * sizeof *match_of);
    for (size_t k = 0; k < all.n; k++) match_of[all.r[k]] = all.o[k] + 1;
  }
  free(exact.r);
  free(exact.o);
  free(all.r);
  free(all.o);
  return rc;
}

/* Where the two first part, for the message when they cannot be aligned. */
static void first_difference(const ctx_t* c, char* out, size_t cap) {
  size_t i = 0;
  while (i < c->R->n && i < c->O->n && grown_pair(c, i, i)) i++;
  const trace_t *r = c->R->t, *o = c->O->t;
  if (i < c->R->n && i < c->O->n)
    snprintf(out, cap, "from %s line %u (%llu bytes) and %s line %u (%llu bytes) on", r->path,
             r->events[r->slot_event[i]].line, (unsigned long long)c->R->size[i], o->path,
             o->events[o->slot_event[i]].line, (unsigned long long)c->O->size[i]);
  else
    snprintf(out, cap, "after their first %zu allocations", i);
}

/* Unmatched allocations by role, for the report. */
typedef struct tally {
  align_role_bytes_t* rows;
  size_t n, cap;
  int failed;
} tally_t;

static void tally_role(tally_t* t, const trace_t* tr, size_t slot, int inserted, uint64_t bytes) {
  const char* name = tr->slot_role && tr->slot_role[slot] ? tr->roles[tr->slot_role[slot]] : "";
  for (size_t k = 0; k < t->n; k++) {
    if (t->rows[k].inserted == inserted && strcmp(t->rows[k].role, name) == 0) {
      t->rows[k].count++;
      t->rows[k].bytes += bytes;
      return;
    }
  }
  if (t->n == t->cap) {
    size_t cap = t->cap ? t->cap * 2 : 16;
    align_role_bytes_t* rows = realloc(t->rows, cap * sizeof *rows);
    if (!rows) {
      t->failed = 1; /* (the report names fewer roles; nothing else depends on it) */
      return;
    }
    t->rows = rows;
    t->cap = cap;
  }
  align_role_bytes_t* r = &t->rows[t->n++];
  memset(r, 0, sizeof *r);
  snprintf(r->role, sizeof r->role, "%s", name);
  r->inserted = inserted;
  r->count = 1;
  r->bytes = bytes;
}

static int by_bytes(const void* a, const void* b) {
  uint64_t x = ((const align_role_bytes_t*)a)->bytes, y = ((const align_role_bytes_t*)b)->bytes;
  return x < y ? 1 : x > y ? -1 : 0;
}

/* size, made at batch bR, in proportion to batch bO (sizes within a block
 * as they are): an upper bound where sizes grow at most linearly. */
static uint64_t in_proportion(uint64_t size, long bR, long bO) {
  if (size <= ALIGN_BLOCK) return size;
  return (uint64_t)(((u128)size * (u128)bO + (u128)bR - 1) / (u128)bR);
}

/* The size at batch bO of allocation `slot` of the largest recording R
 * (batch bR), which the recording at bO does not make. Where another
 * smaller recording makes it (others[k'] matched it: a copy of a matrix
 * that batch 1's 1 x 1 needs no copy of, a workspace a kernel takes past a
 * size), on the power law through its size there and the largest's, the
 * exponent between 0 and 2 (as grown_pair allows): a line from the largest
 * alone would put a size that grows with the square of the batch far too
 * low at the batch predicted, the fit through every recording being one
 * line. Otherwise in proportion to the batch (sizes within a block as
 * they are); but one an optimizer's step made (a step the smaller run
 * skipped: TRACE_OPTIMIZER_ROLE) at its size, as the parameters it is
 * shaped like are. *sized: whether another recording said. */
static uint64_t inserted_size(const seq_t* R, size_t slot, long bR, long bO, const seq_t* others,
                              size_t* const* matches, const long* batch, size_t n_others,
                              int* sized) {
  uint64_t r = R->size[slot];
  *sized = 0;
  if (R->optimizer[slot]) return r;
  size_t best = n_others;
  size_t best_at = 0; /* the allocation of others[best] it is, + 1 */
  for (size_t j = 0; j < n_others; j++) {
    /* (no match: that one was aligned as it was, allocation for allocation) */
    size_t at = matches[j] ? matches[j][slot] : slot < others[j].n ? slot + 1 : 0;
    if (!at || batch[j] == bO) continue;
    if (best == n_others || labs(batch[j] - bO) < labs(batch[best] - bO)) {
      best = j;
      best_at = at;
    }
  }
  *sized = best < n_others;
  if (!*sized) return in_proportion(r, bR, bO);
  uint64_t o = others[best].size[best_at - 1];
  double e = o && r > o ? log((double)r / (double)o) / log((double)bR / (double)batch[best]) : 0.0;
  if (e > 2.0) e = 2.0;
  double at = (double)r * pow((double)bO / (double)bR, e);
  return at < 1.0 ? 1 : (uint64_t)llround(at);
}

/* traces[k] in the order of the largest, R (batch bR; see align.h):
 * others[k], batch[k], matches[k] are the recording rewritten; the others
 * size what it does not make (matches[j] NULL: aligned as it was). */
static gpumem_status_t rewrite(trace_t** traces, size_t k, const seq_t* R, long bR,
                               const seq_t* others, size_t* const* matches, const long* batch,
                               size_t n_others, uint8_t* inserted_any, align_report_t* rep,
                               tally_t* tally) {
  const seq_t* O = &others[k];
  const size_t* match_of = matches[k];
  const long bO = batch[k];
  const trace_t* r = R->t;
  const trace_t* o = O->t;
  trace_event_t* ev = malloc((R->events ? R->events : 1) * sizeof *ev);
  uint8_t* used = calloc(O->n ? O->n : 1, 1);
  size_t* o_free_rank = NULL;
  if (!ev || !used) {
    free(ev);
    free(used);
    gpumem_set_last_error("out of host memory aligning the recordings");
    return GPUMEM_ERR_HOST_MEMORY;
  }
  for (size_t i = 0; i < R->events; i++) {
    ev[i] = r->events[i];
    size_t slot = ev[i].id;
    size_t m = slot < R->n ? match_of[slot] : 0;
    if (m) {
      ev[i].size = O->size[m - 1];
      if (ev[i].op == TRACE_ALLOC) {
        ev[i].line = o->events[o->slot_event[m - 1]].line;
        used[m - 1] = 1;
      }
    } else if (slot < R->n) {
      /* made only at larger batches: through the others that make it, or in proportion */
      int sized = 0;
      ev[i].size = inserted_size(R, slot, bR, bO, others, matches, batch, n_others, &sized);
      if (sized && ev[i].op == TRACE_ALLOC && !(inserted_any[slot] & 2)) {
        inserted_any[slot] |= 2;
        rep->inserted_sized++;
      }
    } else {
      ev[i].size = in_proportion(ev[i].size, bR, bO);
    }
    if (!m && ev[i].op == TRACE_ALLOC && slot < R->n && !(inserted_any[slot] & 1)) {
      inserted_any[slot] |= 1;
      rep->inserted++;
      rep->inserted_optimizer += R->optimizer[slot];
      rep->inserted_bytes += R->size[slot];
      tally_role(tally, r, slot, 1, R->size[slot]);
    }
  }
  for (size_t j = 0; j < O->n; j++) {
    if (used[j]) continue;
    rep->dropped++;
    rep->dropped_bytes += O->size[j];
    tally_role(tally, o, j, 0, O->size[j]);
  }
  /* frees of matched allocations that the other makes between other
   * matched allocations than the largest does: placed as there (frees
   * made together in another order change nothing an allocator decides,
   * and are not counted) */
  o_free_rank = calloc(O->n ? O->n : 1, sizeof *o_free_rank);
  if (o_free_rank) {
    size_t before = 0; /* matched allocations made so far */
    for (size_t e = 0; e < O->events; e++) {
      const trace_event_t* x = &o->events[e];
      if (x->op == TRACE_ALLOC && x->id < O->n && used[x->id]) before++;
      if (x->op == TRACE_FREE && x->id < O->n) o_free_rank[x->id] = before + 1;
    }
    before = 0;
    for (size_t e = 0; e < R->events; e++) {
      const trace_event_t* x = &r->events[e];
      if (x->op == TRACE_ALLOC && x->id < R->n && match_of[x->id]) before++;
      if (x->op != TRACE_FREE || x->id >= R->n || !match_of[x->id]) continue;
      size_t seen = o_free_rank[match_of[x->id] - 1];
      if (seen && seen != before + 1) rep->frees_moved++;
    }
  }
  free(o_free_rank);
  free(used);
  trace_t* out = NULL;
  size_t steps = rep->steps;
  gpumem_status_t st = trace_from_events(o->path, ev, R->events, r->step_end, steps, &out);
  free(ev);
  if (st != GPUMEM_OK) return st;
  trace_free(traces[k]);
  traces[k] = out;
  return GPUMEM_OK;
}

/* A sentence for a refusal where both recordings mark their optimizer
 * steps (`# step N`) and the counts differ: a step the job skipped in one
 * run (a GradScaler skips the step whose scaled gradients overflow, at
 * steps that depend on the data) leaves a whole step's requests in one
 * recording only, which no alignment of one job at two batches bridges.
 * "" where the counts agree or either has no marks. */
static const char* skipped_steps_note(const ctx_t* c, char* buf, size_t len) {
  const trace_t *r = c->R->t, *o = c->O->t;
  if (!r->num_steps || !o->num_steps || r->num_steps == o->num_steps) return "";
  snprintf(buf, len,
           "; %s marks %zu optimizer steps and %s %zu: runs of different lengths (record each "
           "for the same steps) or a step skipped in one run (a GradScaler skips a step whose "
           "gradients overflow; on fake tensors, python -m gpumem.predict --cpu, none do)",
           o->path, o->num_steps, r->path, r->num_steps);
  return buf;
}

/* Allocations of s from `from` on, those an optimizer's step made left
 * out (a step one run skipped is not a difference in the job). */
static size_t job_allocs(const seq_t* s, size_t from) {
  size_t n = 0;
  for (size_t i = from; i < s->n; i++) n += !s->optimizer[i];
  return n;
}

/* Whether the matching says the two are not recordings of one job, or
 * not of one whose requests only change in size, with the error set: one
 * that ends early (a run cut short: what one has after its last match is
 * more than a tenth of it); one that has less than half of its
 * allocations matched; or more than ALIGN_MAX_UNMATCHED_SHARE of the
 * largest's allocations unmatched in either (a loop over the items of a
 * batch makes more requests at a larger one: no size model holds, and
 * the ones added in proportion to the batch would be no bound). What an
 * optimizer's step made (TRACE_OPTIMIZER_ROLE) counts in none of these:
 * a GradScaler skips a step at one batch and not the other. But where the
 * largest made no optimizer step and a smaller one did, the largest,
 * which every recording is rewritten after, has no optimizer state to
 * carry: refused, saying so. */
static int not_one_job(const ctx_t* c, const size_t* match_of, long bO, long bR) {
  const seq_t *R = c->R, *O = c->O;
  char note_buf[1024];
  const char* note = skipped_steps_note(c, note_buf, sizeof note_buf);
  const size_t r_job = job_allocs(R, 0), o_job = job_allocs(O, 0);
  if (r_job == R->n && o_job < O->n) {
    gpumem_set_last_error(
        "the recordings differ: %s (batch %ld) makes no allocation in an optimizer's step, where "
        "%s (batch %ld) makes %zu: the larger run skipped its steps (a GradScaler skips a step "
        "whose gradients overflow, often the first few) and shows no optimizer state to predict "
        "from; record more steps, so that it takes one",
        R->t->path, bR, O->t->path, bO, O->n - o_job);
    return 1;
  }
  size_t matched = 0, last_r = 0, last_o = 0, r_matched_job = 0, o_matched_job = 0;
  for (size_t i = 0; i < R->n; i++) {
    if (!match_of[i]) continue;
    matched++;
    r_matched_job += !R->optimizer[i];
    o_matched_job += !O->optimizer[match_of[i] - 1];
    last_r = i + 1;
    last_o = match_of[i];
  }
  const size_t r_tail = job_allocs(R, last_r), o_tail = job_allocs(O, last_o);
  const seq_t* shorter = NULL;
  const seq_t* longer = NULL;
  size_t at = 0;
  if (r_tail > r_job / 10 && r_tail >= 4) {
    shorter = O;
    longer = R;
    at = last_r;
  } else if (o_tail > o_job / 10 && o_tail >= 4) {
    shorter = R;
    longer = O;
    at = last_o;
  }
  if (shorter) {
    const trace_t* l = longer->t;
    gpumem_set_last_error(
        "the recordings differ: %s ends there (its allocations match those of %s up to line %u) "
        "where %s goes on with %zu more allocations: a recording cut short (record each batch for "
        "the same steps), or requests that grow in number with the batch%s",
        shorter->t->path, l->path, at ? l->events[l->slot_event[at - 1]].line : 0, l->path,
        job_allocs(longer, at), note);
    return 1;
  }
  if (matched * 2 < R->n || matched * 2 < O->n) {
    gpumem_set_last_error(
        "the recordings differ: %zu of the %zu allocations of %s (batch %ld) and of the %zu of "
        "%s (batch %ld) match: they must be one job, its requests changing with the batch%s",
        matched, O->n, O->t->path, bO, R->n, R->t->path, bR, note);
    return 1;
  }
  size_t unmatched = (r_job - r_matched_job) + (o_job - o_matched_job);
  if (unmatched > 16 && unmatched * ALIGN_MAX_UNMATCHED_SHARE_DEN > R->n) {
    gpumem_set_last_error(
        "the recordings differ in %zu of their %zu and %zu allocations (%s at batch %ld, %s at "
        "batch %ld): the number of requests changes with the batch (a loop over the items of a "
        "batch?), which no size model captures%s",
        unmatched, O->n, R->n, O->t->path, bO, R->t->path, bR, note);
    return 1;
  }
  return 0;
}

/* Whether O already is R event by event (frees and streams in place, each
 * size as the grown relation allows): nothing to rewrite. */
static int already_aligned(const ctx_t* c) {
  const seq_t *R = c->R, *O = c->O;
  if (R->events != O->events || R->n != O->n) return 0;
  for (size_t i = 0; i < R->n; i++)
    if (!grown_pair(c, i, i)) return 0;
  for (size_t e = 0; e < R->events; e++) {
    const trace_event_t *x = &R->t->events[e], *y = &O->t->events[e];
    if (x->op != y->op || (x->op != TRACE_ALLOC && x->id != y->id)) return 0;
  }
  return 1;
}

gpumem_status_t align_recordings(trace_t** traces, const long* batch, size_t n,
                                 align_report_t* rep) {
  memset(rep, 0, sizeof *rep);
  if (n < 2) return GPUMEM_OK;
  for (size_t i = 0; i < n; i++)
    if (batch[i] < 1 || (i && batch[i] <= batch[i - 1])) return GPUMEM_OK; /* scale_fit says */
  /* the whole steps every recording has; whole recordings when they have
   * as many (what follows the last step too) */
  size_t fewest = SIZE_MAX, most = 0;
  for (size_t i = 0; i < n; i++) {
    if (traces[i]->num_steps < fewest) fewest = traces[i]->num_steps;
    if (traces[i]->num_steps > most) most = traces[i]->num_steps;
  }
  rep->steps = fewest;
  int cut = fewest > 0 && fewest < most;
  const trace_t* ref = traces[n - 1];
  size_t ref_events = cut ? ref->step_end[fewest - 1] : ref->num_events;
  const size_t smaller = n - 1;
  seq_t R;
  memset(&R, 0, sizeof R);
  seq_t* O = calloc(smaller, sizeof *O);
  /* each smaller recording's match (NULL: aligned as it was) */
  size_t** matches = calloc(smaller, sizeof *matches);
  uint8_t* inserted_any = NULL; /* 1: counted inserted; 2: counted sized through another */
  uint8_t* matched_all = NULL;
  gpumem_status_t st = GPUMEM_OK;
  tally_t tally = {0};
  if (!O || !matches || seq_init(&R, ref, ref_events) != 0) goto no_memory;
  inserted_any = calloc(R.n ? R.n : 1, 1);
  matched_all = malloc(R.n ? R.n : 1);
  if (!inserted_any || !matched_all) goto no_memory;
  memset(matched_all, 1, R.n ? R.n : 1);
  rep->by_role = has_roles(&R);
  /* Every recording matched before any is rewritten: what one does not
   * make is sized through the others that do (inserted_size). */
  for (size_t k = 0; k < smaller && st == GPUMEM_OK; k++) {
    const trace_t* t = traces[k];
    if (seq_init(&O[k], t, cut ? t->step_end[fewest - 1] : t->num_events) != 0) goto no_memory;
    ctx_t c = {&R, &O[k], batch[n - 1], batch[k], has_roles(&R) && has_roles(&O[k])};
    if (!c.roles) rep->by_role = 0;
    if (already_aligned(&c)) continue;
    matches[k] = malloc((R.n ? R.n : 1) * sizeof **matches);
    if (!matches[k]) goto no_memory;
    int rc = match(&c, matches[k]);
    if (rc < 0) goto no_memory;
    if (rc > 0) {
      char where[400];
      first_difference(&c, where, sizeof where);
      gpumem_set_last_error(
          "the recordings differ in more than %d allocations, %s (batch %ld against %s at batch "
          "%ld): they must be one job, its requests changing with the batch",
          ALIGN_MAX_DIFFERENCES, where, batch[k], ref->path, batch[n - 1]);
      st = GPUMEM_ERR_INVALID_ARGUMENT;
    } else if (not_one_job(&c, matches[k], batch[k], batch[n - 1])) {
      st = GPUMEM_ERR_INVALID_ARGUMENT;
    } else {
      for (size_t i = 0; i < R.n; i++)
        if (!matches[k][i]) matched_all[i] = 0;
    }
  }
  for (size_t k = 0; k < smaller && st == GPUMEM_OK; k++) {
    if (!matches[k]) continue;
    /* (replaces traces[k]: O[k].t is not read after, its sizes are its own) */
    st =
        rewrite(traces, k, &R, batch[n - 1], O, matches, batch, smaller, inserted_any, rep, &tally);
    rep->edited = 1;
  }
  for (size_t i = 0; i < R.n; i++) rep->matched += matched_all[i];
  if (st == GPUMEM_OK && rep->edited && ref_events < ref->num_events) {
    /* the largest cut as the others now are: what follows its last whole
     * step would otherwise run on past theirs (a run of frees across the
     * cut is put in order as a whole) */
    trace_t* shorter = NULL;
    st = trace_from_events(ref->path, ref->events, ref_events, ref->step_end, fewest, &shorter);
    if (st == GPUMEM_OK) {
      trace_free(traces[n - 1]);
      traces[n - 1] = shorter;
    }
  }
  if (tally.n) qsort(tally.rows, tally.n, sizeof *tally.rows, by_bytes);
  for (size_t k = 0; k < ALIGN_TOP_ROLES && k < tally.n; k++) rep->top[k] = tally.rows[k];
  goto done;
no_memory:
  gpumem_set_last_error("out of host memory aligning the recordings");
  st = GPUMEM_ERR_HOST_MEMORY;
done:
  free(tally.rows);
  seq_free(&R);
  for (size_t k = 0; O && k < smaller; k++) seq_free(&O[k]);
  for (size_t k = 0; matches && k < smaller; k++) free(matches[k]);
  free(O);
  free(matches);
  free(inserted_any);
  free(matched_all);
  return st;
}
