/* A spy between the allocator and the device, shared by the tests that
 * need an oracle for stream safety (test_faults, test_random).
 *
 * The allocator talks to the device through this table, which forwards
 * every call and remembers, per stream, up to which moment its work is
 * known to be complete: an event recorded on it was seen complete (query
 * or sync), or the stream or the device was synchronized. Memory freed at
 * moment T after use on stream X may be handed out again only once X's
 * work is known complete past T; the spy is the oracle for that.
 *
 * It also models what stream waits order on the device: after[Y][X] is
 * the moment up to which X's work comes before Y's work queued from now
 * on (Y waited for an event recorded on X then, or for one recorded on a
 * stream that had itself waited for X). Such memory may go to Y at once
 * (spy_ordered); and work known complete on Y is then known complete on
 * X up to that moment (a synchronization of Y, or an event of Y seen
 * complete).
 *
 * Hooks are optional (NULL: none): on_unmap is called before every unmap
 * is forwarded, on_map after every successful map. Functions are static
 * inline so that a test that uses only part of the header compiles without
 * unused-function warnings. */
#ifndef GPUMEM_TEST_SPY_BACKEND_H
#define GPUMEM_TEST_SPY_BACKEND_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpumem.h"
#include "gpumem_backend.h"

#define SPY_STREAMS 16

typedef struct spy_event {
  gpumem_stream_t stream;
  uint64_t recorded; /* moment of the last record, 0 = never */
  /* what the recording stream's work was ordered after then (see spy_t) */
  uint64_t after[SPY_STREAMS];
} spy_event_t;

typedef struct spy {
  gpumem_backend_t be; /* first: what the allocator is given */
  gpumem_backend_t* dev;
  uint64_t clock; /* one tick per device call */
  gpumem_stream_t streams[SPY_STREAMS];
  uint64_t done_upto[SPY_STREAMS];
  uint64_t after[SPY_STREAMS][SPY_STREAMS]; /* [Y][X], see above */
  size_t num_streams;
  uint64_t device_synced;
  spy_event_t* events; /* by handle */
  size_t events_cap;
  /* called before every unmap: physical pages leave their address */
  void (*on_unmap)(void* arg, uintptr_t addr, size_t size);
  void* on_unmap_arg;
  /* after every successful map (its argument is on_unmap_arg) */
  void (*on_map)(void* arg, uintptr_t addr, size_t size, gpumem_phys_t page);
  /* Set while the test reads the allocator's statistics: the device's
   * memory figures are answered from the last the device gave, so that
   * the test's own readings are not device calls a fault script counts
   * and fails (test_faults). */
  int test_reading;
  size_t last_free, last_total;
} spy_t;

static inline size_t spy_slot(spy_t* s, gpumem_stream_t stream) {
  for (size_t i = 0; i < s->num_streams; i++) {
    if (s->streams[i] == stream) return i;
  }
  if (s->num_streams == SPY_STREAMS) {
    fprintf(stderr, "spy: more than %d streams\n", SPY_STREAMS);
    exit(2);
  }
  size_t i = s->num_streams++;
  s->streams[i] = stream;
  s->done_upto[i] = 0;
  memset(s->after[i], 0, sizeof s->after[i]);
  for (size_t y = 0; y < SPY_STREAMS; y++) s->after[y][i] = 0;
  return i;
}

static inline uint64_t* spy_done(spy_t* s, gpumem_stream_t stream) {
  return &s->done_upto[spy_slot(s, stream)];
}

/* Stream's work up to moment upto is complete; so is the work of every
 * stream it was ordered after then (after: its row at that moment). */
static inline void spy_mark_done_after(spy_t* s, gpumem_stream_t stream, uint64_t upto,
                                       const uint64_t* after) {
  uint64_t* d = spy_done(s, stream);
  if (upto > *d) *d = upto;
  for (size_t x = 0; after && x < s->num_streams; x++) {
    if (after[x] > s->done_upto[x]) s->done_upto[x] = after[x];
  }
}

/* True when stream's work queued up to moment t is known complete. */
static inline int spy_safe(spy_t* s, gpumem_stream_t stream, uint64_t t) {
  return *spy_done(s, stream) > t || s->device_synced > t;
}

/* True when work queued on `user` from now on comes after stream's work
 * up to moment t: the same stream (stream order), work known complete, or
 * a stream wait on the device. */
static inline int spy_ordered(spy_t* s, gpumem_stream_t user, gpumem_stream_t stream, uint64_t t) {
  if (user == stream || spy_safe(s, stream, t)) return 1;
  return s->after[spy_slot(s, user)][spy_slot(s, stream)] > t;
}

static inline spy_event_t* spy_event(spy_t* s, gpumem_event_t h) {
  if (h >= s->events_cap) {
    size_t cap = s->events_cap ? s->events_cap : 64;
    while (cap <= h) cap *= 2;
    spy_event_t* grown = realloc(s->events, cap * sizeof *grown);
    if (!grown) {
      fprintf(stderr, "spy: out of host memory\n");
      exit(2);
    }
    memset(grown + s->events_cap, 0, (cap - s->events_cap) * sizeof *grown);
    s->events = grown;
    s->events_cap = cap;
  }
  return &s->events[h];
}

#define SPY_DEV(ctx) (((spy_t*)(ctx))->clock++, ((spy_t*)(ctx))->dev)

static inline gpumem_status_t spy_reserve(void* ctx, size_t size, uintptr_t* out) {
  gpumem_backend_t* d = SPY_DEV(ctx);
  return d->reserve(d->ctx, size, out);
}
static inline gpumem_status_t spy_release_range(void* ctx, uintptr_t addr, size_t size) {
  gpumem_backend_t* d = SPY_DEV(ctx);
  return d->release_range(d->ctx, addr, size);
}
static inline gpumem_status_t spy_create_page(void* ctx, size_t size, gpumem_phys_t* out) {
  gpumem_backend_t* d = SPY_DEV(ctx);
  return d->create_page(d->ctx, size, out);
}
static inline gpumem_status_t spy_release_page(void* ctx, gpumem_phys_t page, size_t size) {
  gpumem_backend_t* d = SPY_DEV(ctx);
  return d->release_page(d->ctx, page, size);
}
static inline gpumem_status_t spy_map(void* ctx, uintptr_t addr, size_t size, gpumem_phys_t page) {
  spy_t* s = ctx;
  gpumem_backend_t* d = SPY_DEV(ctx);
  gpumem_status_t st = d->map(d->ctx, addr, size, page);
  if (st == GPUMEM_OK && s->on_map) s->on_map(s->on_unmap_arg, addr, size, page);
  return st;
}
static inline gpumem_status_t spy_unmap(void* ctx, uintptr_t addr, size_t size) {
  spy_t* s = ctx;
  if (s->on_unmap) s->on_unmap(s->on_unmap_arg, addr, size);
  gpumem_backend_t* d = SPY_DEV(ctx);
  return d->unmap(d->ctx, addr, size);
}
static inline gpumem_status_t spy_create_host_page(void* ctx, size_t size, gpumem_phys_t* out) {
  gpumem_backend_t* d = SPY_DEV(ctx);
  return d->create_host_page(d->ctx, size, out);
}
static inline gpumem_status_t spy_copy(void* ctx, uintptr_t dst, uintptr_t src, size_t size,
                                       gpumem_stream_t stream) {
  gpumem_backend_t* d = SPY_DEV(ctx);
  return d->copy(d->ctx, dst, src, size, stream);
}
static inline gpumem_status_t spy_alloc(void* ctx, size_t size, uintptr_t* out) {
  gpumem_backend_t* d = SPY_DEV(ctx);
  return d->alloc(d->ctx, size, out);
}
static inline gpumem_status_t spy_free(void* ctx, uintptr_t addr, size_t size) {
  gpumem_backend_t* d = SPY_DEV(ctx);
  return d->free(d->ctx, addr, size);
}
static inline gpumem_status_t spy_mem_info(void* ctx, size_t* free_bytes, size_t* total) {
  spy_t* s = (spy_t*)ctx;
  if (s->test_reading) {
    *free_bytes = s->last_free;
    *total = s->last_total;
    return GPUMEM_OK;
  }
  gpumem_backend_t* d = SPY_DEV(ctx);
  gpumem_status_t st = d->mem_info(d->ctx, free_bytes, total);
  if (st == GPUMEM_OK) {
    s->last_free = *free_bytes;
    s->last_total = *total;
  }
  return st;
}
static inline gpumem_status_t spy_event_create(void* ctx, gpumem_event_t* out) {
  gpumem_backend_t* d = SPY_DEV(ctx);
  return d->event_create(d->ctx, out);
}
static inline gpumem_status_t spy_event_destroy(void* ctx, gpumem_event_t ev) {
  gpumem_backend_t* d = SPY_DEV(ctx);
  return d->event_destroy(d->ctx, ev);
}
static inline gpumem_status_t spy_event_record(void* ctx, gpumem_event_t ev,
                                               gpumem_stream_t stream) {
  spy_t* s = ctx;
  gpumem_backend_t* d = SPY_DEV(ctx);
  gpumem_status_t st = d->event_record(d->ctx, ev, stream);
  if (st == GPUMEM_OK) {
    spy_event_t* e = spy_event(s, ev);
    size_t y = spy_slot(s, stream);
    e->stream = stream;
    e->recorded = s->clock;
    memcpy(e->after, s->after[y], sizeof e->after);
  }
  return st;
}
static inline void spy_event_done(spy_t* s, gpumem_event_t ev) {
  spy_event_t* e = spy_event(s, ev);
  if (e->recorded) spy_mark_done_after(s, e->stream, e->recorded, e->after);
}
/* Stream's later work waits for the event's record: for the recording
 * stream's work up to then, and for what that work was ordered after. */
static inline gpumem_status_t spy_stream_wait(void* ctx, gpumem_stream_t stream,
                                              gpumem_event_t ev) {
  spy_t* s = ctx;
  gpumem_backend_t* d = SPY_DEV(ctx);
  gpumem_status_t st = d->stream_wait(d->ctx, stream, ev);
  spy_event_t* e = spy_event(s, ev);
  if (st == GPUMEM_OK && e->recorded) {
    uint64_t* row = s->after[spy_slot(s, stream)];
    size_t x = spy_slot(s, e->stream);
    if (e->recorded > row[x]) row[x] = e->recorded;
    for (size_t k = 0; k < s->num_streams; k++) {
      if (e->after[k] > row[k]) row[k] = e->after[k];
    }
  }
  return st;
}
static inline gpumem_status_t spy_event_query(void* ctx, gpumem_event_t ev) {
  gpumem_backend_t* d = SPY_DEV(ctx);
  gpumem_status_t st = d->event_query(d->ctx, ev);
  if (st == GPUMEM_OK) spy_event_done(ctx, ev);
  return st;
}
static inline gpumem_status_t spy_event_sync(void* ctx, gpumem_event_t ev) {
  gpumem_backend_t* d = SPY_DEV(ctx);
  gpumem_status_t st = d->event_sync(d->ctx, ev);
  if (st == GPUMEM_OK) spy_event_done(ctx, ev);
  return st;
}
static inline gpumem_status_t spy_stream_sync(void* ctx, gpumem_stream_t stream) {
  spy_t* s = ctx;
  gpumem_backend_t* d = SPY_DEV(ctx);
  gpumem_status_t st = d->stream_sync(d->ctx, stream);
  if (st == GPUMEM_OK) spy_mark_done_after(s, stream, s->clock, s->after[spy_slot(s, stream)]);
  return st;
}
static inline gpumem_status_t spy_device_sync(void* ctx) {
  spy_t* s = ctx;
  gpumem_backend_t* d = SPY_DEV(ctx);
  gpumem_status_t st = d->device_sync(d->ctx);
  if (st == GPUMEM_OK) s->device_synced = s->clock;
  return st;
}

/* Wraps dev (a simulated device with every slot). */
static inline void spy_init(spy_t* s, gpumem_backend_t* dev) {
  memset(s, 0, sizeof *s);
  s->dev = dev;
  s->be.version = dev->version;
  s->be.name = "spy";
  s->be.ctx = s;
  s->be.page_size = dev->page_size;
  if (dev->reserve) {
    s->be.reserve = spy_reserve;
    s->be.release_range = spy_release_range;
    s->be.create_page = spy_create_page;
    s->be.release_page = spy_release_page;
    s->be.map = spy_map;
    s->be.unmap = spy_unmap;
  }
  if (dev->create_host_page) {
    s->be.create_host_page = spy_create_host_page;
    s->be.copy = spy_copy;
  }
  if (dev->alloc) {
    s->be.alloc = spy_alloc;
    s->be.free = spy_free;
  }
  s->be.mem_info = spy_mem_info;
  s->be.event_create = spy_event_create;
  s->be.event_destroy = spy_event_destroy;
  s->be.event_record = spy_event_record;
  s->be.event_query = spy_event_query;
  s->be.event_sync = spy_event_sync;
  s->be.stream_sync = spy_stream_sync;
  s->be.device_sync = spy_device_sync;
  if (dev->stream_wait) s->be.stream_wait = spy_stream_wait;
}

static inline void spy_fini(spy_t* s) {
  free(s->events);
  s->events = NULL;
}

/* The simulated device's counters, by value. */
static inline gpumem_sim_counters_t sim_counters(gpumem_backend_t* sim) {
  gpumem_sim_counters_t c;
  gpumem_sim_get_counters(sim, &c);
  return c;
}

/* Whether the simulated device holds nothing any more (once an allocator
 * that did not own it is destroyed); if it does, msg says what. */
static inline int sim_holds_nothing(gpumem_backend_t* sim, char* msg, size_t cap) {
  gpumem_sim_counters_t c;
  gpumem_sim_get_counters(sim, &c);
  snprintf(msg, cap,
           "leak after destroy: %llu bytes, %llu ranges, %llu pages (%llu mapped), %llu "
           "plain, %llu events",
           (unsigned long long)c.bytes_in_use, (unsigned long long)c.ranges_reserved,
           (unsigned long long)c.pages_live, (unsigned long long)c.pages_mapped,
           (unsigned long long)c.plain_live, (unsigned long long)c.events_live);
  return c.bytes_in_use == 0 && c.ranges_reserved == 0 && c.pages_live == 0 &&
         c.pages_mapped == 0 && c.plain_live == 0 && c.events_live == 0;
}

#endif
