/* Transient groups that one recording of a job has and another does not
 * (reconcile.h says what and why). */
#include "reconcile.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NO_SLOT UINT32_MAX

/* An addition planned for the smaller recording: before its event x_pos,
 * the m allocations of the reference from event r_pos on, and their frees. */
typedef struct addition {
  size_t x_pos, r_pos, m;
} addition_t;

typedef struct history {
  size_t i, j;    /* where the unit began in each recording */
  uint32_t xslot; /* the smaller recording's allocation it matched, or NO_SLOT */
} history_t;

typedef struct pairing {
  const trace_t* x; /* the smaller recording */
  const trace_t* r; /* the reference: the largest */
  uint32_t* map;    /* x slot -> r slot matched, NO_SLOT before */
  uint8_t* drop_x;  /* x slots of groups dropped */
  uint8_t* add_r;   /* r slots of groups added */
  uint8_t* short_x; /* per slot: freed in the run of frees right after it (short_lived) */
  uint8_t* short_r;
  uintptr_t xs[TRACE_MAX_STREAMS], rs[TRACE_MAX_STREAMS];
  size_t num_streams;  /* stream pairs, in order of first appearance */
  uint32_t* scratch_x; /* a free run's slots (r slots once mapped) */
  uint32_t* scratch_r;
  uint32_t* log; /* x slots mapped during a trial */
  size_t num_log, cap_log;
  int logging;
  addition_t* adds;
  size_t num_adds, cap_adds;
  history_t hist[RECONCILE_MAX_BACKTRACK + 1];
  size_t num_hist;
} pairing_t;

static int group_at(const trace_t* t, size_t pos, size_t m, const uint8_t* flag);
static int group_from(const trace_t* t, size_t pos, const uint8_t* flag);

static int by_value(const void* a, const void* b) {
  uint32_t x = *(const uint32_t*)a, y = *(const uint32_t*)b;
  return x < y ? -1 : x > y;
}

/* Per slot of t: whether the allocation is freed in the first run of frees
 * after it, with only allocations between (a kernel's workspace, a
 * temporary): an allocation of one recording matches one of another only
 * when both are or both are not, so that a transient group one has is not
 * matched with the lasting allocations that follow in the other. */
static uint8_t* short_lived(const trace_t* t) {
  uint8_t* out = calloc(t->num_allocs + 1, 1);
  if (!out) return NULL;
  size_t run_start = 0; /* the first allocation of the current run of allocations */
  for (size_t e = 0; e < t->num_events; e++) {
    const trace_event_t* ev = &t->events[e];
    if (ev->op == TRACE_ALLOC) {
      if (e == 0 || t->events[e - 1].op != TRACE_ALLOC) run_start = e;
    } else if (ev->op == TRACE_FREE) {
      if (t->slot_event[ev->id] >= run_start && t->slot_event[ev->id] < e) out[ev->id] = 1;
    } else {
      run_start = e + 1;
    }
    /* a free run ends the allocations it may free: the next run starts later */
    if (ev->op == TRACE_FREE && e + 1 < t->num_events && t->events[e + 1].op == TRACE_ALLOC)
      run_start = e + 1;
  }
  return out;
}

static size_t run_end(const trace_t* t, size_t e) {
  while (e < t->num_events && t->events[e].op == TRACE_FREE) e++;
  return e;
}

/* Whether the free run at e frees only allocations flagged in dead. */
static int run_dead(const trace_t* t, size_t e, const uint8_t* dead) {
  size_t end = run_end(t, e);
  for (size_t k = e; k < end; k++)
    if (!dead[t->events[k].id]) return 0;
  return end > e;
}

static void skip_dead(const pairing_t* p, size_t* i, size_t* j) {
  while (*i < p->x->num_events && p->x->events[*i].op == TRACE_FREE &&
         run_dead(p->x, *i, p->drop_x))
    *i = run_end(p->x, *i);
  while (*j < p->r->num_events && p->r->events[*j].op == TRACE_FREE && run_dead(p->r, *j, p->add_r))
    *j = run_end(p->r, *j);
}

static int set_map(pairing_t* p, uint32_t xslot, uint32_t rslot) {
  if (p->logging) {
    if (p->num_log == p->cap_log) {
      size_t cap = p->cap_log ? 2 * p->cap_log : 64;
      uint32_t* log = realloc(p->log, cap * sizeof *log);
      if (!log) return 0;
      p->log = log;
      p->cap_log = cap;
    }
    p->log[p->num_log++] = xslot;
  }
  p->map[xslot] = rslot;
  return 1;
}

/* Streams pair up by first appearance, as the aligner matches them. */
static int same_stream(pairing_t* p, uintptr_t sx, uintptr_t sr) {
  for (size_t k = 0; k < p->num_streams; k++)
    if (p->xs[k] == sx || p->rs[k] == sr) return p->xs[k] == sx && p->rs[k] == sr;
  if (p->num_streams == TRACE_MAX_STREAMS) return 0;
  p->xs[p->num_streams] = sx;
  p->rs[p->num_streams++] = sr;
  return 1;
}

/* Matches one request of each recording at (i, j), or one run of frees of
 * each (as sets), and advances past them: 1; 0 when they differ; -1 out
 * of host memory. */
static int unit_step(pairing_t* p, size_t* i, size_t* j) {
  skip_dead(p, i, j);
  const trace_t *x = p->x, *r = p->r;
  if (*i >= x->num_events || *j >= r->num_events) return *i >= x->num_events && *j >= r->num_events;
  const trace_event_t* a = &x->events[*i];
  const trace_event_t* b = &r->events[*j];
  if (a->op != b->op) return 0;
  if (a->op == TRACE_ALLOC) {
    if (p->drop_x[a->id] || p->add_r[b->id] || !same_stream(p, a->stream, b->stream)) return 0;
    /* a short-lived allocation against a lasting one, where the short one
     * begins a transient group: the group is likelier extra than the two
     * the same request */
    if (p->short_x[a->id] != p->short_r[b->id] &&
        (p->short_x[a->id] ? group_from(x, *i, p->drop_x) : group_from(r, *j, p->add_r)))
      return 0;
    if (!set_map(p, a->id, b->id)) return -1;
    (*i)++, (*j)++;
    return 1;
  }
  if (a->op == TRACE_RECORD_STREAM) {
    if (p->map[a->id] != b->id || !same_stream(p, a->stream, b->stream)) return 0;
    (*i)++, (*j)++;
    return 1;
  }
  size_t ei = run_end(x, *i), ej = run_end(r, *j), nx = 0, nr = 0;
  for (size_t k = *i; k < ei; k++) {
    uint32_t s = x->events[k].id;
    if (p->drop_x[s]) continue;
    if (p->map[s] == NO_SLOT) return 0;
    p->scratch_x[nx++] = p->map[s];
  }
  for (size_t k = *j; k < ej; k++)
    if (!p->add_r[r->events[k].id]) p->scratch_r[nr++] = r->events[k].id;
  if (nx != nr) return 0;
  qsort(p->scratch_x, nx, sizeof *p->scratch_x, by_value);
  qsort(p->scratch_r, nr, sizeof *p->scratch_r, by_value);
  if (memcmp(p->scratch_x, p->scratch_r, nx * sizeof *p->scratch_x) != 0) return 0;
  *i = ei, *j = ej;
  return 1;
}

/* Whether the m allocations of t from event pos on form a transient group:
 * unflagged, all freed in the run of frees right after them. */
static int group_at(const trace_t* t, size_t pos, size_t m, const uint8_t* flag) {
  if (pos + m >= t->num_events) return 0;
  for (size_t k = pos; k < pos + m; k++)
    if (t->events[k].op != TRACE_ALLOC || flag[t->events[k].id]) return 0;
  size_t end = run_end(t, pos + m);
  for (size_t k = pos; k < pos + m; k++) {
    uint32_t s = t->events[k].id;
    size_t f = pos + m;
    while (f < end && t->events[f].id != s) f++;
    if (f == end) return 0;
  }
  return 1;
}

/* Whether a transient group of any size begins at pos. */
static int group_from(const trace_t* t, size_t pos, const uint8_t* flag) {
  for (size_t m = 1; m <= RECONCILE_MAX_GROUP; m++)
    if (group_at(t, pos, m, flag)) return 1;
  return 0;
}

static void flag_group(const trace_t* t, size_t pos, size_t m, uint8_t* flag, uint8_t value) {
  for (size_t k = pos; k < pos + m; k++) flag[t->events[k].id] = value;
}

/* Whether RECONCILE_LOOKAHEAD units match from (i, j), taking on the way
 * the first transient group that explains a difference (jobs make several
 * close together: a layer's kernels one after another): 1 + the groups
 * taken when they do, 0 when not, -1 out of host memory. The mapping and
 * the groups are put back as they were. */
static int trial(pairing_t* p, size_t i, size_t j) {
  size_t streams = p->num_streams;
  struct {
    const trace_t* t;
    uint8_t* flag;
    size_t pos, m;
  } taken[RECONCILE_LOOKAHEAD];
  size_t num_taken = 0;
  p->logging = 1;
  p->num_log = 0;
  int ok = 1;
  for (int matched = 0; matched < RECONCILE_LOOKAHEAD && ok == 1;) {
    skip_dead(p, &i, &j);
    if (i >= p->x->num_events && j >= p->r->num_events) break;
    ok = unit_step(p, &i, &j);
    if (ok) {
      matched++;
      continue;
    }
    if (i >= p->x->num_events || j >= p->r->num_events || num_taken == RECONCILE_LOOKAHEAD) break;
    for (size_t m = 1; m <= RECONCILE_MAX_GROUP && !ok; m++) {
      for (int side = 0; side < 2 && !ok; side++) {
        const trace_t* t = side == 0 ? p->r : p->x;
        uint8_t* flag = side == 0 ? p->add_r : p->drop_x;
        size_t* pos = side == 0 ? &j : &i;
        if (!group_at(t, *pos, m, flag)) continue;
        flag_group(t, *pos, m, flag, 1);
        taken[num_taken].t = t;
        taken[num_taken].flag = flag;
        taken[num_taken].pos = *pos;
        taken[num_taken++].m = m;
        *pos += m;
        ok = 1;
      }
    }
  }
  size_t groups = num_taken;
  while (num_taken--)
    flag_group(taken[num_taken].t, taken[num_taken].pos, taken[num_taken].m, taken[num_taken].flag,
               0);
  for (size_t k = 0; k < p->num_log; k++) p->map[p->log[k]] = NO_SLOT;
  p->logging = 0;
  p->num_streams = streams;
  return ok == 1 ? 1 + (int)groups : ok;
}

/* At a difference at (*i, *j): the transient group that explains it, if
 * any, taken (1); 0 none; -1 out of host memory. Of the groups that do,
 * the one after which the lookahead needs the fewest further groups, then
 * the nearest, then the smallest. */
static int resolve(pairing_t* p, size_t* i, size_t* j) {
  int best_cost = 0;
  size_t best_d = 0, best_m = 0;
  int best_side = 0;
  for (size_t d = 0; d <= p->num_hist; d++) {
    if (d && p->hist[p->num_hist - d].xslot == NO_SLOT) break; /* back over allocations only */
    size_t bi = d ? p->hist[p->num_hist - d].i : *i;
    size_t bj = d ? p->hist[p->num_hist - d].j : *j;
    for (size_t k = 1; k <= d; k++) p->map[p->hist[p->num_hist - k].xslot] = NO_SLOT;
    for (size_t m = 1; m <= RECONCILE_MAX_GROUP; m++) {
      for (int side = 0; side < 2; side++) {
        const trace_t* t = side == 0 ? p->r : p->x;
        uint8_t* flag = side == 0 ? p->add_r : p->drop_x;
        size_t pos = side == 0 ? bj : bi;
        if (!group_at(t, pos, m, flag)) continue;
        flag_group(t, pos, m, flag, 1);
        int cost = trial(p, side == 1 ? bi + m : bi, side == 0 ? bj + m : bj);
        flag_group(t, pos, m, flag, 0);
        if (cost < 0) return -1;
        if (cost && (!best_cost || cost < best_cost)) {
          best_cost = cost;
          best_d = d, best_m = m, best_side = side;
        }
      }
    }
    for (size_t k = 1; k <= d; k++) {
      const history_t* h = &p->hist[p->num_hist - k];
      p->map[h->xslot] = p->r->events[h->j].id;
    }
  }
  if (!best_cost) return 0;
  size_t bi = best_d ? p->hist[p->num_hist - best_d].i : *i;
  size_t bj = best_d ? p->hist[p->num_hist - best_d].j : *j;
  for (size_t k = 1; k <= best_d; k++) p->map[p->hist[p->num_hist - k].xslot] = NO_SLOT;
  const trace_t* t = best_side == 0 ? p->r : p->x;
  flag_group(t, best_side == 0 ? bj : bi, best_m, best_side == 0 ? p->add_r : p->drop_x, 1);
  if (best_side == 0) {
    if (p->num_adds == p->cap_adds) {
      size_t cap = p->cap_adds ? 2 * p->cap_adds : 16;
      addition_t* adds = realloc(p->adds, cap * sizeof *adds);
      if (!adds) return -1;
      p->adds = adds;
      p->cap_adds = cap;
    }
    p->adds[p->num_adds++] = (addition_t){bi, bj, best_m};
  }
  *i = best_side == 1 ? bi + best_m : bi;
  *j = best_side == 0 ? bj + best_m : bj;
  p->num_hist = 0;
  return 1;
}

static void remember(pairing_t* p, size_t i, size_t j, uint32_t xslot) {
  if (p->num_hist == RECONCILE_MAX_BACKTRACK + 1) {
    memmove(p->hist, p->hist + 1, RECONCILE_MAX_BACKTRACK * sizeof *p->hist);
    p->num_hist--;
  }
  p->hist[p->num_hist++] = (history_t){i, j, xslot};
}

/* Walks x beside r: 1 when every difference was explained, 0 when one
 * was not, -1 out of host memory. */
static int walk(pairing_t* p) {
  size_t i = 0, j = 0;
  for (;;) {
    skip_dead(p, &i, &j);
    if (i >= p->x->num_events && j >= p->r->num_events) return 1;
    size_t i0 = i, j0 = j;
    uint32_t xslot =
        i < p->x->num_events && p->x->events[i].op == TRACE_ALLOC ? p->x->events[i].id : NO_SLOT;
    int ok = unit_step(p, &i, &j);
    if (ok < 0) return -1;
    if (ok) {
      remember(p, i0, j0, xslot);
      continue;
    }
    /* recordings stopped at different points: what both have is compared */
    if (i >= p->x->num_events || j >= p->r->num_events) return 1;
    ok = resolve(p, &i, &j);
    if (ok <= 0) return ok;
  }
}

static uintptr_t x_stream_of(const pairing_t* p, uintptr_t rs) {
  for (size_t k = 0; k < p->num_streams; k++)
    if (p->rs[k] == rs) return p->xs[k];
  return rs;
}

/* The smaller recording with the groups dropped and added. */
static gpumem_status_t rebuild(const pairing_t* p, long bx, long br, trace_t** out,
                               reconcile_report_t* report) {
  const trace_t *x = p->x, *r = p->r;
  size_t added = 0;
  for (size_t k = 0; k < p->num_adds; k++) added += 2 * p->adds[k].m;
  trace_event_t* ev = malloc((x->num_events + added + 1) * sizeof *ev);
  size_t* steps = malloc((x->num_steps + 1) * sizeof *steps);
  if (!ev || !steps) {
    free(ev);
    free(steps);
    gpumem_set_last_error("out of host memory reconciling the recordings");
    return GPUMEM_ERR_HOST_MEMORY;
  }
  size_t n = 0, step = 0, a = 0;
  uint32_t next_id = (uint32_t)x->num_allocs;
  for (size_t e = 0; e <= x->num_events; e++) {
    for (; step < x->num_steps && x->step_end[step] == e; step++) steps[step] = n;
    uint32_t line = e < x->num_events ? x->events[e].line : 0;
    for (; a < p->num_adds && p->adds[a].x_pos == e; a++) {
      const addition_t* add = &p->adds[a];
      for (size_t k = 0; k < add->m; k++) {
        trace_event_t ne = r->events[add->r_pos + k];
        uint64_t size = (uint64_t)((double)ne.size * (double)bx / (double)br + 0.5);
        report->added_bytes_at_largest += ne.size;
        ne.size = size ? size : 1;
        ne.stream = x_stream_of(p, ne.stream);
        ne.id = next_id + (uint32_t)k;
        ne.line = line;
        ev[n++] = ne;
      }
      for (size_t k = 0; k < add->m; k++)
        ev[n++] = (trace_event_t){.op = TRACE_FREE, .id = next_id + (uint32_t)k, .line = line};
      next_id += (uint32_t)add->m;
      report->added += add->m;
      report->groups++;
    }
    if (e == x->num_events) break;
    if (p->drop_x[x->events[e].id]) {
      if (x->events[e].op == TRACE_ALLOC) report->dropped++;
      continue;
    }
    ev[n++] = x->events[e];
  }
  gpumem_status_t st = trace_from_events(x->path, ev, n, steps, x->num_steps, out);
  free(ev);
  free(steps);
  return st;
}

static void pairing_free(pairing_t* p) {
  free(p->map);
  free(p->drop_x);
  free(p->add_r);
  free(p->short_x);
  free(p->short_r);
  free(p->scratch_x);
  free(p->scratch_r);
  free(p->log);
  free(p->adds);
}

static size_t dropped_groups(const pairing_t* p) {
  size_t groups = 0;
  for (size_t e = 0; e < p->x->num_events; e++) {
    const trace_event_t* ev = &p->x->events[e];
    /* a group's first allocation: flagged, the event before it is not */
    if (ev->op == TRACE_ALLOC && p->drop_x[ev->id] &&
        !(e && p->x->events[e - 1].op == TRACE_ALLOC && p->drop_x[p->x->events[e - 1].id]))
      groups++;
  }
  return groups;
}

gpumem_status_t reconcile_transients(trace_t** traces, const long* batch, size_t n,
                                     reconcile_report_t* report) {
  memset(report, 0, sizeof *report);
  if (n < 2) return GPUMEM_OK;
  const trace_t* r = traces[n - 1];
  for (size_t k = 0; k + 1 < n; k++) {
    pairing_t p = {.x = traces[k], .r = r};
    size_t nx = p.x->num_allocs + 1, nr = r->num_allocs + 1;
    p.map = malloc(nx * sizeof *p.map);
    p.drop_x = calloc(nx, 1);
    p.add_r = calloc(nr, 1);
    p.scratch_x = malloc((p.x->num_events + 1) * sizeof *p.scratch_x);
    p.scratch_r = malloc((r->num_events + 1) * sizeof *p.scratch_r);
    p.short_x = short_lived(p.x);
    p.short_r = short_lived(r);
    int ok = p.map && p.drop_x && p.add_r && p.short_x && p.short_r && p.scratch_x && p.scratch_r
                 ? 1
                 : -1;
    if (ok == 1) {
      for (size_t s = 0; s < nx; s++) p.map[s] = NO_SLOT;
      ok = walk(&p);
    }
    gpumem_status_t st = GPUMEM_OK;
    size_t dropped = ok == 1 ? dropped_groups(&p) : 0;
    if (ok < 0) {
      gpumem_set_last_error("out of host memory reconciling the recordings");
      st = GPUMEM_ERR_HOST_MEMORY;
    } else if (ok == 1 && (p.num_adds || dropped)) {
      trace_t* edited = NULL;
      report->groups += dropped;
      st = rebuild(&p, batch[k], batch[n - 1], &edited, report);
      if (st == GPUMEM_OK) {
        trace_free(traces[k]);
        traces[k] = edited;
      }
    }
    pairing_free(&p);
    if (st != GPUMEM_OK) return st;
  }
  return GPUMEM_OK;
}
