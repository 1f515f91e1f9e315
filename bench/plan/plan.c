/* Offline placement study for gpumem traces (bench/plan/README.md).
 *
 * Reads a gpumem trace (gzip text: 'a ID SIZE STREAM' / 'f ID'), gives each
 * allocation its lifetime [alloc event, free event) (never freed: to the end),
 * and places allocations per arena (stream, pool: rounded size <= 1 MiB is
 * small) at 512 B granularity by:
 *   online best fit (gpumem's default policy), online first fit,
 *   offline greedy: by size (largest first), by duration, by area
 *   (size x duration), in allocation order; each at the lowest offset free
 *   over its lifetime ("first gap") or in the smallest gap that fits
 *   ("best gap", as TFLite's arena does).
 * Footprint = sum over arenas of max extent rounded up to 2 MiB pages;
 * reported / peak live (requested bytes, all streams).
 * Then detects the step period of the allocation sequence ((size, stream)
 * of successive requests) and plans one step in isolation (lifetimes taken
 * modulo the period; allocations alive across steps placed first).
 *
 * Build: cc -O2 -std=c11 -o plan plan.c     Run: ./plan traces/NAME.trace.gz ... */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define GRAN 512ull
#define SMALL (1ull << 20)
#define PAGE (2ull << 20)
#define GIB (1024.0 * 1024.0 * 1024.0)

typedef struct {
  uint64_t req, size;
  int stream, arena;
  int64_t s, e; /* lifetime in event indices */
} Item;

static Item* items;
static int nitems;
static int64_t nevents;
static int nstreams;
static int narenas;      /* 2 per stream */
static int64_t* ev_item; /* per event: item index, ~index for a free */

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void* xrealloc(void* p, size_t n) {
  void* q = realloc(p, n ? n : 1);
  if (!q) {
    perror("realloc");
    exit(1);
  }
  return q;
}

static uint64_t round_page(uint64_t x) {
  return (x + PAGE - 1) / PAGE * PAGE;
}

static void load(const char* path) {
  char cmd[4096];
  snprintf(cmd, sizeof cmd, "gzip -dc '%s'", path);
  FILE* f = popen(cmd, "r");
  if (!f) {
    perror("popen");
    exit(1);
  }
  static uint64_t streams[64];
  int* id_map = NULL; /* id -> item index */
  size_t id_cap = 0;
  int cap = 0;
  int64_t ev_cap = 0;
  nitems = 0;
  nevents = 0;
  nstreams = 0;
  free(items);
  items = NULL;
  free(ev_item);
  ev_item = NULL;
  char line[256];
  while (fgets(line, sizeof line, f)) {
    if (line[0] == 'a') {
      unsigned long long id, size, st;
      if (sscanf(line + 1, "%llu %llu %llu", &id, &size, &st) != 3) {
        fprintf(stderr, "bad line %s", line);
        exit(1);
      }
      if (size == 0) continue; /* gpumem_malloc(0) allocates nothing */
      int si = 0;
      while (si < nstreams && streams[si] != st) si++;
      if (si == nstreams) streams[nstreams++] = st;
      if (nitems == cap) {
        cap = cap ? cap * 2 : 4096;
        items = xrealloc(items, cap * sizeof *items);
      }
      if (id >= id_cap) {
        size_t nc = id_cap ? id_cap : 4096;
        while (nc <= id) nc *= 2;
        id_map = xrealloc(id_map, nc * sizeof *id_map);
        for (size_t i = id_cap; i < nc; i++) id_map[i] = -1;
        id_cap = nc;
      }
      Item* it = &items[nitems];
      it->req = size;
      it->size = (size + GRAN - 1) / GRAN * GRAN;
      it->stream = si;
      it->arena = si * 2 + (it->size <= SMALL ? 0 : 1);
      it->s = nevents;
      it->e = -1;
      id_map[id] = nitems;
      if (nevents == ev_cap) {
        ev_cap = ev_cap ? ev_cap * 2 : 8192;
        ev_item = xrealloc(ev_item, ev_cap * sizeof *ev_item);
      }
      ev_item[nevents++] = nitems++;
    } else if (line[0] == 'f') {
      unsigned long long id;
      if (sscanf(line + 1, "%llu", &id) != 1) {
        fprintf(stderr, "bad line %s", line);
        exit(1);
      }
      if (id >= id_cap || id_map[id] < 0) continue;
      int i = id_map[id];
      id_map[id] = -1;
      items[i].e = nevents;
      if (nevents == ev_cap) {
        ev_cap = ev_cap ? ev_cap * 2 : 8192;
        ev_item = xrealloc(ev_item, ev_cap * sizeof *ev_item);
      }
      ev_item[nevents++] = ~(int64_t)i;
    }
  }
  pclose(f);
  free(id_map);
  for (int i = 0; i < nitems; i++)
    if (items[i].e < 0) items[i].e = nevents; /* never freed: lives to the end */
  narenas = nstreams * 2;
}

/* ---------------------------------------------------------------- online */

typedef struct {
  uint64_t addr, size;
} Hole;
typedef struct {
  Hole* h;
  int n, cap;
  uint64_t top, max_top;
  unsigned char* touched;
  size_t tcap;
  uint64_t ntouched;
} Arena;

static void touch(Arena* a, uint64_t addr, uint64_t size) {
  size_t first = addr / PAGE, last = (addr + size - 1) / PAGE;
  if (last >= a->tcap) {
    size_t nc = a->tcap ? a->tcap : 1024;
    while (nc <= last) nc *= 2;
    a->touched = xrealloc(a->touched, nc);
    memset(a->touched + a->tcap, 0, nc - a->tcap);
    a->tcap = nc;
  }
  for (size_t p = first; p <= last; p++)
    if (!a->touched[p]) {
      a->touched[p] = 1;
      a->ntouched++;
    }
}

static uint64_t arena_alloc(Arena* a, uint64_t r, int best) {
  int pick = -1;
  for (int i = 0; i < a->n; i++) {
    if (a->h[i].size < r) continue;
    if (!best) {
      pick = i;
      break;
    }
    if (pick < 0 || a->h[i].size < a->h[pick].size)
      pick = i; /* ties: lowest address (scan order) */
  }
  uint64_t off;
  if (pick < 0) {
    off = a->top;
    a->top += r;
    if (a->top > a->max_top) a->max_top = a->top;
  } else {
    off = a->h[pick].addr;
    if (a->h[pick].size > r) {
      a->h[pick].addr += r;
      a->h[pick].size -= r;
    } else {
      memmove(&a->h[pick], &a->h[pick + 1], (a->n - pick - 1) * sizeof(Hole));
      a->n--;
    }
  }
  touch(a, off, r);
  return off;
}

static void arena_free(Arena* a, uint64_t off, uint64_t r) {
  int lo = 0, hi = a->n; /* first hole with addr > off */
  while (lo < hi) {
    int m = (lo + hi) / 2;
    if (a->h[m].addr > off)
      hi = m;
    else
      lo = m + 1;
  }
  int i = lo;
  int merged_prev = i > 0 && a->h[i - 1].addr + a->h[i - 1].size == off;
  int merged_next = i < a->n && off + r == a->h[i].addr;
  if (merged_prev && merged_next) {
    a->h[i - 1].size += r + a->h[i].size;
    memmove(&a->h[i], &a->h[i + 1], (a->n - i - 1) * sizeof(Hole));
    a->n--;
    i = i - 1;
  } else if (merged_prev) {
    a->h[i - 1].size += r;
    i = i - 1;
  } else if (merged_next) {
    a->h[i].addr = off;
    a->h[i].size += r;
  } else {
    if (a->n == a->cap) {
      a->cap = a->cap ? a->cap * 2 : 64;
      a->h = xrealloc(a->h, a->cap * sizeof(Hole));
    }
    memmove(&a->h[i + 1], &a->h[i], (a->n - i) * sizeof(Hole));
    a->h[i].addr = off;
    a->h[i].size = r;
    a->n++;
  }
  if (i == a->n - 1 && a->h[i].addr + a->h[i].size == a->top) {
    a->top = a->h[i].addr;
    a->n--;
  }
}

/* Online simulation over all events; returns footprint as sum of rounded max
 * extents, and *touched = pages ever mapped under a live block (what gpumem's
 * reclaim:pressure reserves). */
static uint64_t online(int best, uint64_t* touched, uint64_t* offs) {
  Arena* ar = calloc(narenas, sizeof *ar);
  for (int64_t t = 0; t < nevents; t++) {
    int64_t x = ev_item[t];
    if (x >= 0) {
      Item* it = &items[x];
      offs[x] = arena_alloc(&ar[it->arena], it->size, best);
    } else {
      Item* it = &items[~x];
      arena_free(&ar[it->arena], offs[~x], it->size);
    }
  }
  uint64_t fp = 0, tp = 0;
  for (int a = 0; a < narenas; a++) {
    fp += round_page(ar[a].max_top);
    tp += ar[a].ntouched * PAGE;
    free(ar[a].h);
    free(ar[a].touched);
  }
  free(ar);
  *touched = tp;
  return fp;
}

/* ---------------------------------------------------------------- offline greedy */

/* A planning item: size and one or two time segments (two when a lifetime
 * wraps around the end of a periodic step). */
typedef struct {
  uint64_t size;
  int64_t s[2], e[2];
  int nseg;
  int64_t key1, key2; /* sort keys */
  int id;
  uint64_t off;
} PItem;

/* The lifetime of it within one step of W events starting at T0, as one
 * segment, or two when it wraps into the next step (freed there, before
 * its own start time comes round again): the number of segments set in p,
 * 0 when it outlives that (long-lived: not planned). */
static int step_lifetime(const Item* it, int64_t T0, int64_t W, int64_t nevents, PItem* p) {
  int64_t s = it->s - T0, e = it->e - T0;
  if (e <= W) {
    p->nseg = 1;
    p->s[0] = s;
    p->e[0] = e;
  } else if (e - W <= s && it->e < nevents) {
    p->nseg = 2;
    p->s[0] = s;
    p->e[0] = W;
    p->s[1] = 0;
    p->e[1] = e - W;
  } else {
    p->nseg = 0;
  }
  return p->nseg;
}

enum { ORD_SIZE, ORD_DUR, ORD_AREA, ORD_ALLOC, NORD };
static const char* ord_name[NORD] = {"size", "duration", "area", "alloc-order"};

static int cmp_pitem(const void* a, const void* b) {
  const PItem* x = a;
  const PItem* y = b;
  if (x->key1 != y->key1) return x->key1 > y->key1 ? -1 : 1;
  if (x->key2 != y->key2) return x->key2 > y->key2 ? -1 : 1;
  return x->id - y->id;
}

static int64_t dur(const PItem* p) {
  int64_t d = 0;
  for (int k = 0; k < p->nseg; k++) d += p->e[k] - p->s[k];
  return d;
}

static void set_order(PItem* v, int n, int ord) {
  for (int i = 0; i < n; i++) {
    PItem* p = &v[i];
    int64_t d = dur(p);
    switch (ord) {
      case ORD_SIZE:
        p->key1 = (int64_t)p->size;
        p->key2 = d;
        break;
      case ORD_DUR:
        p->key1 = d;
        p->key2 = (int64_t)p->size;
        break;
      case ORD_AREA:
        p->key1 = (int64_t)(p->size / GRAN) * d;
        p->key2 = (int64_t)p->size;
        break;
      case ORD_ALLOC:
        p->key1 = -p->s[0];
        p->key2 = 0;
        break;
    }
  }
  qsort(v, n, sizeof *v, cmp_pitem);
}

static int overlap(const PItem* a, const PItem* b) {
  for (int i = 0; i < a->nseg; i++)
    for (int j = 0; j < b->nseg; j++)
      if (a->s[i] < b->e[j] && b->s[j] < a->e[i]) return 1;
  return 0;
}

typedef struct {
  int* v;
  int n, cap;
} IVec;
static void ivec_push(IVec* x, int v) {
  if (x->n == x->cap) {
    x->cap = x->cap ? x->cap * 2 : 16;
    x->v = xrealloc(x->v, x->cap * sizeof(int));
  }
  x->v[x->n++] = v;
}

static PItem* g_sort_base;
static int cmp_by_off(const void* a, const void* b) {
  uint64_t x = g_sort_base[*(const int*)a].off, y = g_sort_base[*(const int*)b].off;
  return x < y ? -1 : x > y;
}

/* Where p goes among the placed items idx[0..n), sorted by offset: the
 * lowest offset it fits below the next one in time with it (first fit), or
 * with best_gap the smallest such gap; past them all when none. Items not
 * overlapping p in time are skipped when check is set (callers that pass
 * only overlapping ones clear it). */
static uint64_t choose_offset(const PItem* p, const PItem* v, const int* idx, int n, int check,
                              int best_gap) {
  uint64_t cand = 0, best = UINT64_MAX, bestgap = UINT64_MAX;
  for (int c = 0; c < n; c++) {
    const PItem* q = &v[idx[c]];
    if (check && !overlap(p, q)) continue;
    if (q->off >= cand + p->size) {
      if (!best_gap) break;
      uint64_t gap = q->off - cand;
      if (gap < bestgap) {
        bestgap = gap;
        best = cand;
      }
    }
    if (q->off + q->size > cand) cand = q->off + q->size;
  }
  return (best_gap && best != UINT64_MAX) ? best : cand;
}

/* Small inputs (one step): placed items kept in an array sorted by offset and
 * scanned in that order, skipping those disjoint in time: O(n^2) overlap
 * tests, no sorting, what an in-allocator planner would do. */
static uint64_t greedy_small(PItem* v, int n, int best_gap) {
  int* ord = malloc((n ? n : 1) * sizeof *ord);
  int placed = 0;
  uint64_t extent = 0;
  for (int i = 0; i < n; i++) {
    PItem* p = &v[i];
    p->off = choose_offset(p, v, ord, placed, 1, best_gap);
    if (p->off + p->size > extent) extent = p->off + p->size;
    int lo = 0, hi = placed;
    while (lo < hi) {
      int m = (lo + hi) / 2;
      if (v[ord[m]].off <= p->off)
        lo = m + 1;
      else
        hi = m;
    }
    memmove(&ord[lo + 1], &ord[lo], (placed - lo) * sizeof *ord);
    ord[lo] = i;
    placed++;
  }
  free(ord);
  return extent;
}

/* Places v[0..n) in their order; time range [0, T). Returns max extent. */
static uint64_t greedy(PItem* v, int n, int64_t T, int best_gap) {
  if (n <= 4096) return greedy_small(v, n, best_gap);
  static int64_t div = -1;
  if (div < 0) div = getenv("PLAN_BUCKETS") ? atoll(getenv("PLAN_BUCKETS")) : 64;
  int64_t B = T / div + 1;
  int64_t nb = T / B + 1;
  IVec* buckets = calloc(nb, sizeof *buckets);
  int* stamp = malloc(n * sizeof *stamp);
  int* conf = malloc(n * sizeof *conf);
  for (int i = 0; i < n; i++) stamp[i] = -1;
  uint64_t extent = 0;
  for (int i = 0; i < n; i++) {
    PItem* p = &v[i];
    int nc = 0;
    for (int k = 0; k < p->nseg; k++) {
      if (p->e[k] <= p->s[k]) continue;
      for (int64_t b = p->s[k] / B; b <= (p->e[k] - 1) / B; b++)
        for (int q = 0; q < buckets[b].n; q++) {
          int j = buckets[b].v[q];
          if (stamp[j] == i) continue;
          stamp[j] = i;
          if (overlap(p, &v[j])) conf[nc++] = j;
        }
    }
    g_sort_base = v;
    qsort(conf, nc, sizeof *conf, cmp_by_off);
    p->off = choose_offset(p, v, conf, nc, 0, best_gap);
    if (p->off + p->size > extent) extent = p->off + p->size;
    for (int k = 0; k < p->nseg; k++) {
      if (p->e[k] <= p->s[k]) continue;
      for (int64_t b = p->s[k] / B; b <= (p->e[k] - 1) / B; b++) ivec_push(&buckets[b], i);
    }
  }
  for (int64_t b = 0; b < nb; b++) free(buckets[b].v);
  free(buckets);
  free(stamp);
  free(conf);
  return extent;
}

/* Max over time of the live bytes of v (lower bound on any extent). */
static int cmp_i64(const void* a, const void* b) {
  int64_t x = *(const int64_t*)a, y = *(const int64_t*)b;
  return x < y ? -1 : x > y;
}
static uint64_t max_live(const PItem* v, int n) {
  /* events encoded as time*2+kind (free=0 before alloc=1 at equal times), size separately */
  int64_t* ev = malloc(4 * (size_t)n * sizeof *ev * 2);
  int m = 0;
  for (int i = 0; i < n; i++)
    for (int k = 0; k < v[i].nseg; k++) {
      if (v[i].e[k] <= v[i].s[k]) continue;
      ev[2 * m] = v[i].s[k] * 2 + 1;
      ev[2 * m + 1] = (int64_t)v[i].size;
      m++;
      ev[2 * m] = v[i].e[k] * 2;
      ev[2 * m + 1] = -(int64_t)v[i].size;
      m++;
    }
  qsort(ev, m, 2 * sizeof *ev, cmp_i64);
  int64_t live = 0, peak = 0;
  for (int i = 0; i < m; i++) {
    live += ev[2 * i + 1];
    if (live > peak) peak = live;
  }
  free(ev);
  return (uint64_t)peak;
}

/* ---------------------------------------------------------------- step period */

static int64_t g_period_L;
/* Smallest-period search on the (size, stream) sequence of allocations:
 * L(P) = length of the suffix where seq[i] == seq[i-P]. Returns P with the
 * largest L(P) >= P (at least two identical periods at the end), 0 if none. */
static int find_period(void) {
  int n = nitems, bestP = 0;
  int64_t bestL = -1;
  for (int P = 16; P <= n / 2; P++) { /* a step has more than a few requests */
    int i = n - 1;
    while (i - P >= 0 && items[i].req == items[i - P].req && items[i].stream == items[i - P].stream)
      i--;
    int64_t L = n - 1 - i;
    if (L >= P && L > bestL) {
      bestL = L;
      bestP = P;
    }
  }
  g_period_L = bestL;
  return bestP;
}

/* ---------------------------------------------------------------- planned mode, online */

/* Pages under live blocks: per arena refcounts. */
typedef struct {
  int* ref;
  size_t cap;
} PageRef;
static int64_t live_pages;
static void pages_add(PageRef* r, uint64_t addr, uint64_t size, int d) {
  size_t first = addr / PAGE, last = (addr + size - 1) / PAGE;
  if (last >= r->cap) {
    size_t nc = r->cap ? r->cap : 1024;
    while (nc <= last) nc *= 2;
    r->ref = xrealloc(r->ref, nc * sizeof(int));
    memset(r->ref + r->cap, 0, (nc - r->cap) * sizeof(int));
    r->cap = nc;
  }
  for (size_t p = first; p <= last; p++) {
    if (d > 0 && r->ref[p]++ == 0) live_pages++;
    if (d < 0 && --r->ref[p] == 0) live_pages--;
  }
}

/* Online "planned placement" as proposed: best fit until the (size, stream)
 * sequence has shown two identical periods; then, from the next step boundary
 * (the phase of least live bytes), a plan computed from the last period
 * (greedy by size, first gap, one plan arena per stream, pools merged) serves
 * every request that matches the plan's next expected (size, stream) and whose
 * planned range is free; anything else falls back to best fit. */
static void simulate_planned(int rs, int per, int kmin) {
  int act = kmin;
  while (act < rs + 2 * per) act += per;
  while (act - per > rs + 2 * per) act -= per; /* earliest aligned boundary after detection */
  if (act + per > nitems) {
    printf("  planned mode: no full period left after detection\n");
    return;
  }
  int kp = act - per;
  int64_t T0 = items[kp].s, W = items[act].s - T0;
  /* plan: items of period [kp, act) with wrap; long-lived ones are not planned */
  PItem* v = malloc(per * sizeof *v);
  int* gs = malloc(per * sizeof *gs);
  int m = 0;
  for (int j = 0; j < per; j++) {
    Item* it = &items[kp + j];
    PItem p = {.size = it->size, .id = j};
    if (!step_lifetime(it, T0, W, nevents, &p)) continue;
    gs[m] = it->stream;
    v[m++] = p;
  }
  uint64_t* plan_off = malloc(per * sizeof *plan_off);
  char* planned = calloc(per, 1);
  uint64_t* plan_ext = calloc(nstreams, sizeof *plan_ext);
  double best_ms = 1e30;
  for (int rep = 0; rep < 5; rep++) {
    double t0 = now_ms();
    PItem* u = malloc((m ? m : 1) * sizeof *u);
    for (int g = 0; g < nstreams; g++) {
      int mm = 0;
      for (int i = 0; i < m; i++)
        if (gs[i] == g) u[mm++] = v[i];
      set_order(u, mm, ORD_SIZE);
      plan_ext[g] = round_page(greedy(u, mm, W, 0));
      for (int i = 0; i < mm; i++) {
        plan_off[u[i].id] = u[i].off;
        planned[u[i].id] = 1;
      }
    }
    free(u);
    double ms = now_ms() - t0;
    if (ms < best_ms) best_ms = ms;
  }
  uint64_t plan_pages = 0;
  for (int g = 0; g < nstreams; g++) plan_pages += plan_ext[g];
  /* replay */
  Arena* ar = calloc(narenas, sizeof *ar);
  PageRef* pr = calloc(narenas, sizeof *pr);
  uint64_t* offs = malloc(nitems * sizeof *offs);
  int* where = malloc(nitems * sizeof *where); /* -1 regular, else plan stream */
  /* live planned ranges per stream, for the busy check */
  typedef struct {
    uint64_t off, size;
    int item;
  } Live;
  Live** lv = calloc(nstreams, sizeof *lv);
  int* nlv = calloc(nstreams, sizeof *nlv);
  for (int g = 0; g < nstreams; g++) lv[g] = malloc(nitems * sizeof(Live));
  int hits = 0, mism = 0, busy = 0, after = 0;
  live_pages = 0;
  int64_t peak_before = 0, peak_after = 0;
  uint64_t touched_at_act = 0;
  int active = 0;
  for (int64_t t = 0; t < nevents; t++) {
    int64_t x = ev_item[t];
    if (x >= 0) {
      Item* it = &items[x];
      if (x == act) {
        active = 1;
        for (int a = 0; a < narenas; a++) touched_at_act += ar[a].ntouched;
      }
      where[x] = -1;
      if (active) {
        after++;
        int j = (int)((x - act) % per);
        Item* ex = &items[kp + j];
        if (ex->req == it->req && ex->stream == it->stream && planned[j]) {
          uint64_t o = plan_off[j];
          int g = it->stream, ok = 1;
          for (int q = 0; q < nlv[g]; q++)
            if (lv[g][q].off < o + it->size && o < lv[g][q].off + lv[g][q].size) {
              ok = 0;
              break;
            }
          if (ok) {
            hits++;
            where[x] = g;
            offs[x] = o;
            lv[g][nlv[g]++] = (Live){o, it->size, (int)x};
          } else
            busy++;
        } else if (!(ex->req == it->req && ex->stream == it->stream))
          mism++;
      }
      if (where[x] < 0) {
        offs[x] = arena_alloc(&ar[it->arena], it->size, 1);
        pages_add(&pr[it->arena], offs[x], it->size, +1);
      }
    } else {
      int64_t i = ~x;
      Item* it = &items[i];
      if (where[i] < 0) {
        arena_free(&ar[it->arena], offs[i], it->size);
        pages_add(&pr[it->arena], offs[i], it->size, -1);
      } else {
        int g = where[i];
        for (int q = 0; q < nlv[g]; q++)
          if (lv[g][q].item == i) {
            lv[g][q] = lv[g][--nlv[g]];
            break;
          }
      }
    }
    int64_t phys = live_pages * (int64_t)PAGE + (active ? (int64_t)plan_pages : 0);
    if (!active && phys > peak_before) peak_before = phys;
    if (active && phys > peak_after) peak_after = phys;
  }
  uint64_t touched = 0, extent = 0;
  for (int a = 0; a < narenas; a++) {
    touched += ar[a].ntouched;
    extent += round_page(ar[a].max_top);
  }
  double P = 0;
  {
    uint64_t l = 0, pk = 0;
    for (int64_t t = 0; t < nevents; t++) {
      int64_t y = ev_item[t];
      if (y >= 0) {
        l += items[y].req;
        if (l > pk) pk = l;
      } else
        l -= items[~y].req;
    }
    P = (double)pk;
  }
  printf(
      "  planned mode: active from alloc %d of %d (%.2f periods replayed under the plan), plan of "
      "%d items, %.2f ms (min of 5)\n",
      act, nitems, (double)(nitems - act) / per, m, best_ms);
  printf(
      "    requests after activation: %d, served from plan %d (%.1f%%), mismatched %d, planned "
      "range busy %d\n",
      after, hits, 100.0 * hits / (after ? after : 1), mism, busy);
  printf(
      "    plan arenas %.4f x peak live; regular arenas: pages touched %.4f (at activation %.4f), "
      "extent %.4f\n",
      plan_pages / P, touched * (double)PAGE / P, touched_at_act * (double)PAGE / P, extent / P);
  printf(
      "    peak of (pages under live regular blocks + plan arenas): before activation %.4f, after "
      "%.4f\n",
      peak_before / P, peak_after / P);
  for (int g = 0; g < nstreams; g++) free(lv[g]);
  free(lv);
  free(nlv);
  free(where);
  free(offs);
  for (int a = 0; a < narenas; a++) {
    free(ar[a].h);
    free(ar[a].touched);
    free(pr[a].ref);
  }
  free(ar);
  free(pr);
  free(v);
  free(gs);
  free(plan_off);
  free(planned);
  free(plan_ext);
}

/* ---------------------------------------------------------------- main */

static const char* heur_label(int ord, int bg) {
  static char buf[64];
  snprintf(buf, sizeof buf, "%s/%s", ord_name[ord], bg ? "best-gap" : "first-gap");
  return buf;
}

/* Plans the items of each arena group (group_of(item)) and returns the summed
 * page-rounded extent; prints nothing. mode 0: per (stream, pool); 1: per stream. */
static uint64_t plan_groups(PItem* all, const int* grp, int n, int ngroups, int64_t T, int ord,
                            int bg, const uint64_t* base, double* ms) {
  uint64_t total = 0;
  PItem* v = malloc((n ? n : 1) * sizeof *v);
  double t0 = now_ms();
  for (int g = 0; g < ngroups; g++) {
    int m = 0;
    for (int i = 0; i < n; i++)
      if (grp[i] == g) v[m++] = all[i];
    if (!m && !base[g]) continue;
    set_order(v, m, ord);
    uint64_t ext = greedy(v, m, T, bg);
    total += round_page(base[g] + ext);
  }
  *ms = now_ms() - t0;
  free(v);
  return total;
}

int main(int argc, char** argv) {
  for (int a = 1; a < argc; a++) {
    const char* path = argv[a];
    load(path);
    const char* name = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    /* peak live, requested bytes */
    uint64_t live = 0, peak = 0;
    for (int64_t t = 0; t < nevents; t++) {
      int64_t x = ev_item[t];
      if (x >= 0) {
        live += items[x].req;
        if (live > peak) peak = live;
      } else
        live -= items[~x].req;
    }
    double P = (double)peak;
    printf("== %s: %d allocations, %lld events, %d streams, peak live %.3f GiB\n", name, nitems,
           (long long)nevents, nstreams, P / GIB);

    uint64_t* offs = malloc(nitems * sizeof *offs);
    uint64_t touched;
    double t0 = now_ms();
    uint64_t fp = online(1, &touched, offs);
    double ms = now_ms() - t0;
    printf("  %-28s %.4f  (pages touched %.4f)  %.1f ms\n", "online best fit", fp / P, touched / P,
           ms);
    t0 = now_ms();
    fp = online(0, &touched, offs);
    ms = now_ms() - t0;
    printf("  %-28s %.4f  (pages touched %.4f)  %.1f ms\n", "online first fit", fp / P, touched / P,
           ms);

    /* whole-trace offline plans */
    PItem* all = malloc(nitems * sizeof *all);
    int* grp = malloc(nitems * sizeof *grp);
    int* grp_stream = malloc(nitems * sizeof *grp_stream);
    for (int i = 0; i < nitems; i++) {
      all[i] = (PItem){
          .size = items[i].size, .s = {items[i].s, 0}, .e = {items[i].e, 0}, .nseg = 1, .id = i};
      grp[i] = items[i].arena;
      grp_stream[i] = items[i].stream;
    }
    uint64_t* zero = calloc(narenas, sizeof *zero);
    uint64_t lb = 0, lb_stream = 0;
    {
      PItem* v = malloc(nitems * sizeof *v);
      for (int g = 0; g < narenas; g++) {
        int m = 0;
        for (int i = 0; i < nitems; i++)
          if (grp[i] == g) v[m++] = all[i];
        if (m) lb += round_page(max_live(v, m));
      }
      for (int g = 0; g < nstreams; g++) {
        int m = 0;
        for (int i = 0; i < nitems; i++)
          if (grp_stream[i] == g) v[m++] = all[i];
        if (m) lb_stream += round_page(max_live(v, m));
      }
      free(v);
    }
    printf("  %-28s %.4f  (per stream: %.4f)\n", "lower bound (max live/arena)", lb / P,
           lb_stream / P);
    printf("  whole trace, offline        per (stream,pool)   per stream (pools merged)\n");
    for (int ord = 0; ord < NORD && !getenv("PLAN_SKIP_WHOLE"); ord++)
      for (int bg = 0; bg < 2; bg++) {
        double ms1, ms2;
        uint64_t f1 = plan_groups(all, grp, nitems, narenas, nevents, ord, bg, zero, &ms1);
        uint64_t f2 = plan_groups(all, grp_stream, nitems, nstreams, nevents, ord, bg, zero, &ms2);
        printf("  %-28s %.4f  %7.1f ms     %.4f  %7.1f ms\n", heur_label(ord, bg), f1 / P, ms1,
               f2 / P, ms2);
      }

    /* ---- step period and one-step plan */
    double tp0 = now_ms();
    int per = find_period();
    double tp_ms = now_ms() - tp0;
    if (!per) {
      printf(
          "  step period: none found (no two identical trailing periods of the (size, stream) "
          "sequence) [%.1f ms]\n",
          tp_ms);
    } else {
      int64_t region = g_period_L + per; /* periodic allocations at the end */
      int rs = nitems - (int)region;
      printf(
          "  step period: %d allocations, periodic region = last %lld allocations (%.2f periods, "
          "from alloc %d) [%.1f ms]\n",
          per, (long long)region, (double)region / per, rs, tp_ms);
      /* live bytes just before each allocation */
      int64_t* live_at = malloc(nitems * sizeof *live_at);
      int64_t l = 0;
      for (int64_t t = 0; t < nevents; t++) {
        int64_t x = ev_item[t];
        if (x >= 0) {
          live_at[x] = l;
          l += items[x].req;
        } else
          l -= items[~x].req;
      }
      int lo = rs + per, hi = nitems - 2 * per;
      if (lo > hi) {
        lo = rs;
        hi = nitems - per;
      }
      int k = lo;
      for (int c = lo; c <= hi; c++)
        if (live_at[c] < live_at[k]) k = c;
      int64_t T0 = items[k].s, W = (k + per < nitems ? items[k + per].s : nevents) - T0;
      /* periodicity of lifetimes */
      int same = 0, cmpd = 0;
      for (int j = 0; j < per && k + j + per < nitems; j++) {
        Item* a = &items[k + j];
        Item* b = &items[k + j + per];
        cmpd++;
        if (b->s - a->s == W && (b->e - a->e == W || (a->e == nevents && b->e == nevents))) same++;
      }
      printf(
          "  window: allocs [%d, %d), events [%lld, %lld) (W=%lld), live at start %.3f GiB; "
          "lifetimes periodic for %d/%d\n",
          k, k + per, (long long)T0, (long long)(T0 + W), (long long)W, live_at[k] / GIB, same,
          cmpd);
      /* items: window items, persistent items */
      PItem* v = malloc(nitems * sizeof *v);
      int* g1 = malloc(nitems * sizeof *g1);
      int* g2 = malloc(nitems * sizeof *g2);
      uint64_t* base1 = calloc(narenas, sizeof *base1);
      uint64_t* base2 = calloc(nstreams, sizeof *base2);
      char* wraps = calloc(nitems, 1);
      int m = 0, nwrap = 0, npers = 0;
      uint64_t pers_bytes = 0;
      for (int j = 0; j < per; j++) {
        int i = k + j;
        Item* it = &items[i];
        PItem p = {.size = it->size, .id = i};
        int nseg = step_lifetime(it, T0, W, nevents, &p);
        if (nseg == 2) {
          wraps[i] = 1;
          nwrap++;
        } else if (!nseg) {
          base1[it->arena] += it->size;
          base2[it->stream] += it->size;
          npers++;
          pers_bytes += it->size;
          continue;
        }
        g1[m] = it->arena;
        g2[m] = it->stream;
        v[m++] = p;
      }
      for (int i = 0; i < k; i++) {
        Item* it = &items[i];
        if (it->e <= T0) continue;
        if (i >= k - per && wraps[i + per]) continue; /* represented by its wrapped counterpart */
        base1[it->arena] += it->size;
        base2[it->stream] += it->size;
        npers++;
        pers_bytes += it->size;
      }
      /* lower bound: persistent + max live of window items over the step */
      uint64_t lbw = 0;
      {
        PItem* u = malloc((m ? m : 1) * sizeof *u);
        for (int g = 0; g < narenas; g++) {
          int mm = 0;
          for (int i = 0; i < m; i++)
            if (g1[i] == g) u[mm++] = v[i];
          if (mm || base1[g]) lbw += round_page(base1[g] + max_live(u, mm));
        }
        free(u);
      }
      printf(
          "  one-step plan: %d step items (%d wrap across the boundary), %d persistent (%.3f GiB); "
          "lower bound %.4f\n",
          m, nwrap, npers, pers_bytes / GIB, lbw / P);
      printf("  one step, offline           per (stream,pool)   per stream (pools merged)\n");
      for (int ord = 0; ord < NORD; ord++)
        for (int bg = 0; bg < 2; bg++) {
          double ms1, ms2;
          uint64_t f1 = plan_groups(v, g1, m, narenas, W, ord, bg, base1, &ms1);
          uint64_t f2 = plan_groups(v, g2, m, nstreams, W, ord, bg, base2, &ms2);
          printf("  %-28s %.4f  %7.2f ms     %.4f  %7.2f ms\n", heur_label(ord, bg), f1 / P, ms1,
                 f2 / P, ms2);
        }
      simulate_planned(rs, per, k);
      free(v);
      free(g1);
      free(g2);
      free(base1);
      free(base2);
      free(wraps);
      free(live_at);
    }
    free(all);
    free(grp);
    free(grp_stream);
    free(zero);
    free(offs);
    fflush(stdout);
  }
  return 0;
}
