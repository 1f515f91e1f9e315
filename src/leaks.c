/* Leak detection: which live allocations were made after a mark.
 *
 * Every allocation carries a serial (1 + the allocations made before it,
 * never reset) and the tag current when it was made (gpumem_set_history_tag),
 * stored in the treap links an allocated block does not use, so marking
 * costs the hot path two stores and no memory. A mark is a serial; the
 * allocations made after it that are still live are what a piece of work
 * that should give back what it takes (a training step, a request) kept.
 * They are reported in groups of one requested size on one stream, largest
 * first: a step that keeps one tensor each time shows up as one group whose
 * count grows by one a step.
 *
 * With the option leak_check:on an allocator reports the allocations still
 * live when it is destroyed (and the per-device instances at exit), on
 * stderr, as LeakSanitizer does for host memory. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

enum { SAMPLE_ADDRS = 4, TEXT_GROUPS = 20 };

typedef struct leak_rec {
  uint64_t serial, tag, addr, size, requested, stream;
} leak_rec;

typedef struct leak_group {
  uint64_t requested; /* the caller's size, shared by the group */
  uint64_t stream;
  uint64_t count, bytes, requested_bytes;
  uint64_t first_serial, last_serial, first_tag, last_tag;
  uint64_t addrs[SAMPLE_ADDRS]; /* the oldest ones */
} leak_group;

typedef struct leak_set {
  gpumem_leaks_t sum;
  leak_group* groups;
} leak_set;

uint64_t gpumem_leak_mark(gpumem_t* gm) {
  if (!gm) return 0;
  gm_lock_acquire(&gm->lock);
  uint64_t mark = gm->num_mallocs;
  gm_lock_release(&gm->lock);
  return mark;
}

static int by_group_then_serial(const void* pa, const void* pb) {
  const leak_rec *a = pa, *b = pb;
  if (a->requested != b->requested) return a->requested < b->requested ? -1 : 1;
  if (a->stream != b->stream) return a->stream < b->stream ? -1 : 1;
  return a->serial < b->serial ? -1 : a->serial > b->serial;
}

static int by_bytes_then_age(const void* pa, const void* pb) {
  const leak_group *a = pa, *b = pb;
  if (a->bytes != b->bytes) return a->bytes > b->bytes ? -1 : 1;
  return a->first_serial < b->first_serial ? -1 : a->first_serial > b->first_serial;
}

/* The live allocations made after since, copied out (gm's lock held). */
static gpumem_status_t collect_locked(gpumem_t* gm, uint64_t since, leak_rec** out, size_t* n_out,
                                      uint64_t* made) {
  size_t n = 0;
  for (gm_segment* seg = gm->segments; seg; seg = seg->next_seg)
    for (const gm_block* b = seg->first; b; b = b->next)
      n += b->state == GM_ALLOCATED && b->serial > since;
  /* blocks of the overflow tier: in no segment list (overflow.c) */
  for (const gm_tier_block* t = gm->tier; t; t = t->next) n += t->seg.first->serial > since;
  leak_rec* recs = malloc((n ? n : 1) * sizeof *recs);
  if (!recs) {
    return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem leaks: out of host memory for %zu records", n);
  }
  size_t k = 0;
  for (gm_segment* seg = gm->segments; seg; seg = seg->next_seg) {
    for (const gm_block* b = seg->first; b; b = b->next) {
      if (b->state != GM_ALLOCATED || b->serial <= since) continue;
      recs[k++] = (leak_rec){b->serial, b->tag,       b->addr,
                             b->size,   b->requested, (uint64_t)gm_block_stream(b)};
    }
  }
  for (const gm_tier_block* t = gm->tier; t; t = t->next) {
    const gm_block* b = t->seg.first;
    if (b->serial <= since) continue;
    recs[k++] =
        (leak_rec){b->serial, b->tag, b->addr, b->size, b->requested, (uint64_t)gm_block_stream(b)};
  }
  *made = gm->num_mallocs;
  *out = recs;
  *n_out = n;
  return GPUMEM_OK;
}

/* The groups of the live allocations made after since; locked: whether
 * the caller holds gm's lock already. */
static gpumem_status_t find(gpumem_t* gm, uint64_t since, bool locked, leak_set* set) {
  memset(set, 0, sizeof *set);
  set->sum.struct_size = sizeof set->sum;
  set->sum.since = since;
  leak_rec* recs = NULL;
  size_t n = 0;
  if (!locked) gm_lock_acquire(&gm->lock);
  gpumem_status_t st = collect_locked(gm, since, &recs, &n, &set->sum.made);
  if (!locked) gm_lock_release(&gm->lock);
  if (st != GPUMEM_OK) return st;
  qsort(recs, n, sizeof *recs, by_group_then_serial);
  set->groups = calloc(n ? n : 1, sizeof *set->groups);
  if (!set->groups) {
    free(recs);
    return gm_fail(GPUMEM_ERR_HOST_MEMORY, "gpumem leaks: out of host memory for %zu groups", n);
  }
  size_t g = 0;
  for (size_t i = 0; i < n; i++) {
    const leak_rec* r = &recs[i];
    leak_group* grp = &set->groups[g];
    if (grp->count && (grp->requested != r->requested || grp->stream != r->stream))
      grp = &set->groups[++g];
    if (!grp->count) {
      grp->requested = r->requested;
      grp->stream = r->stream;
      grp->first_serial = r->serial;
      grp->first_tag = r->tag;
    }
    if (grp->count < SAMPLE_ADDRS) grp->addrs[grp->count] = r->addr;
    grp->count++;
    grp->bytes += r->size;
    grp->requested_bytes += r->requested;
    grp->last_serial = r->serial;
    grp->last_tag = r->tag;
    set->sum.count++;
    set->sum.bytes += r->size;
    set->sum.requested_bytes += r->requested;
    if (!set->sum.oldest || r->serial < set->sum.oldest) set->sum.oldest = r->serial;
    if (r->serial > set->sum.newest) set->sum.newest = r->serial;
  }
  set->sum.groups = n ? g + 1 : 0;
  qsort(set->groups, (size_t)set->sum.groups, sizeof *set->groups, by_bytes_then_age);
  free(recs);
  return GPUMEM_OK;
}

gpumem_status_t gpumem_find_leaks(gpumem_t* gm, uint64_t since, gpumem_leaks_t* out) {
  if (!gm || !out) return gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_find_leaks: NULL argument");
  leak_set set;
  gpumem_status_t st = find(gm, since, false, &set);
  if (st != GPUMEM_OK) return st;
  *out = set.sum;
  free(set.groups);
  return GPUMEM_OK;
}

/* A group's serials ("#5" or "#5..#21") and tags ("tag 3", "tags 1..5" or
 * ""), as the reports write them. */
static const char* serials_text(const leak_group* g, char* buf, size_t cap) {
  if (g->count > 1)
    snprintf(buf, cap, "#%" PRIu64 "..#%" PRIu64, g->first_serial, g->last_serial);
  else
    snprintf(buf, cap, "#%" PRIu64, g->first_serial);
  return buf;
}

static const char* tags_text(const leak_group* g, char* buf, size_t cap) {
  if (!g->first_tag && !g->last_tag)
    buf[0] = '\0';
  else if (g->first_tag == g->last_tag)
    snprintf(buf, cap, "tag %" PRIu64, g->first_tag);
  else
    snprintf(buf, cap, "tags %" PRIu64 "..%" PRIu64, g->first_tag, g->last_tag);
  return buf;
}

/* The table of groups, the first max_groups of them, then one line for
 * the rest. */
static void print_table(gm_emitter* e, const leak_set* set, uint64_t max_groups) {
  const gpumem_leaks_t* s = &set->sum;
  char b1[32], b2[32], serials[48], tags[64];
  gm_emitf(e, "  %12s %7s  %-12s %-18s %s\n", "bytes", "count", "each", "stream", "allocations");
  uint64_t shown = s->groups < max_groups ? s->groups : max_groups;
  for (uint64_t i = 0; i < shown; i++) {
    const leak_group* g = &set->groups[i];
    tags_text(g, tags, sizeof tags);
    gm_emitf(e, "  %12s %7" PRIu64 "  %-12s 0x%-16" PRIx64 " %s%s%s  first at 0x%" PRIx64 "\n",
             gm_format_bytes(g->bytes, b1, sizeof b1), g->count,
             gm_format_bytes(g->requested, b2, sizeof b2), g->stream,
             serials_text(g, serials, sizeof serials), tags[0] ? "  " : "", tags, g->addrs[0]);
  }
  if (shown < s->groups) {
    uint64_t rest = 0, rest_n = 0;
    for (uint64_t i = shown; i < s->groups; i++) {
      rest += set->groups[i].bytes;
      rest_n += set->groups[i].count;
    }
    gm_emitf(e, "  ... and %" PRIu64 " more groups: %" PRIu64 " allocations, %s\n",
             s->groups - shown, rest_n, gm_format_bytes(rest, b1, sizeof b1));
  }
}

static void print_text(gm_emitter* e, const leak_set* set, const char* title) {
  const gpumem_leaks_t* s = &set->sum;
  char b1[32], b2[32];
  if (!s->count) {
    gm_emitf(e, "%s: no allocation made after #%" PRIu64 " is live (%" PRIu64 " made so far)\n",
             title, s->since, s->made);
    return;
  }
  gm_emitf(
      e,
      "%s: %" PRIu64 " allocation%s made after #%" PRIu64
      " still live: %s allocated (%s "
      "requested) in %" PRIu64 " group%s of one size and stream; ",
      title, s->count, s->count == 1 ? "" : "s", s->since, gm_format_bytes(s->bytes, b1, sizeof b1),
      gm_format_bytes(s->requested_bytes, b2, sizeof b2), s->groups, s->groups == 1 ? "" : "s");
  if (s->oldest == s->newest)
    gm_emitf(e, "allocation #%" PRIu64 " of %" PRIu64 " made\n", s->oldest, s->made);
  else
    gm_emitf(e, "allocations #%" PRIu64 "..#%" PRIu64 " of %" PRIu64 " made\n", s->oldest,
             s->newest, s->made);
  print_table(e, set, TEXT_GROUPS);
}

static void print_json(gm_emitter* e, const leak_set* set) {
  const gpumem_leaks_t* s = &set->sum;
  gm_emitf(e,
           "{\"since\":%" PRIu64 ",\"made\":%" PRIu64 ",\"count\":%" PRIu64 ",\"bytes\":%" PRIu64
           ",\"requested_bytes\":%" PRIu64 ",\"oldest\":%" PRIu64 ",\"newest\":%" PRIu64
           ",\"groups\":[",
           s->since, s->made, s->count, s->bytes, s->requested_bytes, s->oldest, s->newest);
  for (uint64_t i = 0; i < s->groups; i++) {
    const leak_group* g = &set->groups[i];
    gm_emitf(e,
             "%s\n {\"requested\":%" PRIu64 ",\"stream\":%" PRIu64 ",\"count\":%" PRIu64
             ",\"bytes\":%" PRIu64 ",\"requested_bytes\":%" PRIu64 ",\"first\":%" PRIu64
             ",\"last\":%" PRIu64 ",\"first_tag\":%" PRIu64 ",\"last_tag\":%" PRIu64
             ",\"addresses\":[",
             i ? "," : "", g->requested, g->stream, g->count, g->bytes, g->requested_bytes,
             g->first_serial, g->last_serial, g->first_tag, g->last_tag);
    for (uint64_t k = 0; k < g->count && k < SAMPLE_ADDRS; k++)
      gm_emitf(e, "%s%" PRIu64, k ? "," : "", g->addrs[k]);
    gm_emit(e, "]}", 2);
  }
  gm_emit(e, "]}\n", 3);
}

static int print(gpumem_t* gm, uint64_t since, bool json, const char* title, gpumem_write_fn write,
                 void* arg) {
  leak_set set;
  gpumem_status_t st = find(gm, since, false, &set);
  if (st != GPUMEM_OK) return (int)st;
  gm_emitter e = {write, arg, 0};
  if (json)
    print_json(&e, &set);
  else
    print_text(&e, &set, title);
  free(set.groups);
  return e.rc;
}

int gpumem_print_leaks(gpumem_t* gm, uint64_t since, gpumem_write_fn write, void* arg) {
  if (!gm || !write)
    return (int)gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_print_leaks: NULL argument");
  return print(gm, since, false, "gpumem leaks", write, arg);
}

int gpumem_print_leaks_json(gpumem_t* gm, uint64_t since, gpumem_write_fn write, void* arg) {
  if (!gm || !write) {
    return (int)gm_fail(GPUMEM_ERR_INVALID_ARGUMENT, "gpumem_print_leaks_json: NULL argument");
  }
  return print(gm, since, true, NULL, write, arg);
}

void gpumem_leak_check_now(gpumem_t* gm, const char* when) {
  if (!gm || !gm->opts.leak_check) return;
  gm_lock_acquire(&gm->lock);
  gm->leak_checked = true;
  gm_lock_release(&gm->lock);
  gm_leak_check_report(gm, when ? when : "now");
}

void gm_leak_check_report(gpumem_t* gm, const char* when) {
  leak_set set;
  if (find(gm, 0, false, &set) != GPUMEM_OK) return;
  if (set.sum.count) {
    char title[96];
    snprintf(title, sizeof title, "gpumem leak check (%s)", when);
    gm_emitter e = {gpumem_write_to_file, stderr, 0};
    print_text(&e, &set, title);
  }
  free(set.groups);
}

int gm_print_leak_table(gpumem_t* gm, uint64_t since, uint64_t max_groups, gpumem_leaks_t* sum,
                        gpumem_write_fn write, void* arg) {
  leak_set set;
  gpumem_status_t st = find(gm, since, false, &set);
  if (st != GPUMEM_OK) return (int)st;
  gm_emitter e = {write, arg, 0};
  print_table(&e, &set, max_groups);
  *sum = set.sum;
  free(set.groups);
  return e.rc;
}

void gm_live_groups_locked(gpumem_t* gm, char* out, size_t cap) {
  out[0] = '\0';
  leak_set set;
  if (find(gm, 0, true, &set) != GPUMEM_OK) return; /* no host memory: the report goes without */
  size_t n = 0;
  if (set.sum.count) {
    n = (size_t)snprintf(out, cap,
                         " Live: %" PRIu64 " allocation%s in %" PRIu64
                         " group%s of one size and stream; the largest:",
                         set.sum.count, set.sum.count == 1 ? "" : "s", set.sum.groups,
                         set.sum.groups == 1 ? "" : "s");
  }
  for (uint64_t i = 0; i < set.sum.groups && i < 3 && n < cap; i++) {
    const leak_group* g = &set.groups[i];
    char each[32], serials[48], tags[64];
    tags_text(g, tags, sizeof tags);
    n += (size_t)snprintf(out + n, cap - n, "%s %" PRIu64 " x %s (%s%s%s)", i ? "," : "", g->count,
                          gm_format_bytes(g->requested, each, sizeof each),
                          serials_text(g, serials, sizeof serials), tags[0] ? ", " : "", tags);
  }
  if (set.sum.count && n < cap) snprintf(out + n, cap - n, ".");
  free(set.groups);
}
