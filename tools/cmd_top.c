/* gpumem top: every published allocator on this machine (src/publish.c),
 * read from outside the processes that hold the memory: what each has
 * allocated and reserved, its peak and limit, its out-of-memory failures,
 * with a total per device. Refreshes every second until interrupted;
 * --once prints one table, --json one JSON array.
 *
 * What it reads was written by other processes and may be hostile (the
 * scan in src/publish.c already skips links, FIFOs, other users' files and
 * broken pages): names are printed with control bytes replaced, figures
 * are summed without overflow, and records beyond what it holds are
 * counted and said, live processes kept before exited ones. */
#include "commands.h"
#include "show.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gpumem.h"
#include "internal.h" /* gm_format_bytes */

static const char usage_top[] =
    "usage: gpumem top [options]\n"
    "\n"
    "Shows the memory of every process whose gpumem allocator publishes its\n"
    "figures (option publish: on over CUDA by default): allocated and reserved\n"
    "bytes, peak reserved, limit, out-of-memory failures, with a total per\n"
    "device. A process that ended without destroying its allocator shows as\n"
    "exited. Refreshes every second until interrupted.\n"
    "\n"
    "options:\n"
    "  --once                one table, then exit\n"
    "  --json                one JSON array of the allocators, then exit\n"
    "  --interval SECONDS    between refreshes (default 1)\n"
    "  --dir DIR             where the figures are published (default\n"
    "                        $GPUMEM_PUBLISH_DIR or /dev/shm)\n"
    "  --clean               remove what exited processes left, then show the rest\n"
    "  --max-rows N          allocators held per refresh (default 65536); more are\n"
    "                        counted and said, live processes kept first\n"
    "  -h, --help            this text\n";

/* The most records one refresh holds by default (about 30 MiB of them). */
#define MAX_ROWS 65536

typedef struct rows {
  gpumem_published_t* items;
  size_t count, cap;
  size_t dropped;     /* records past MAX_ROWS, not shown */
  size_t next_exited; /* where to look for an exited record a live one may replace */
  size_t max;         /* --max-rows */
} rows_t;

static int collect(const gpumem_published_t* p, void* arg) {
  rows_t* r = arg;
  if (r->count == r->cap && r->cap < r->max) {
    size_t cap = r->cap ? r->cap * 2 : 256;
    if (cap > r->max) cap = r->max;
    gpumem_published_t* grown = realloc(r->items, cap * sizeof *grown);
    if (grown) {
      r->items = grown;
      r->cap = cap;
    }
  }
  if (r->count < r->cap) {
    r->items[r->count++] = *p;
    return 0;
  }
  /* full: a live process takes the place of an exited one */
  while (p->alive && r->next_exited < r->count && r->items[r->next_exited].alive) r->next_exited++;
  if (p->alive && r->next_exited < r->count) r->items[r->next_exited++] = *p;
  r->dropped++;
  return 0;
}

/* Sums of published figures, which another process wrote: negative ones
 * count as 0, and the sum stops at INT64_MAX rather than overflow. */
static int64_t add_figure(int64_t sum, int64_t figure) {
  if (figure <= 0) return sum;
  return sum > INT64_MAX - figure ? INT64_MAX : sum + figure;
}

static int by_device_then_pid(const void* a, const void* b) {
  const gpumem_published_t* x = a;
  const gpumem_published_t* y = b;
  if (x->device != y->device) return x->device < y->device ? -1 : 1;
  if (x->pid != y->pid) return x->pid < y->pid ? -1 : 1;
  return x->instance < y->instance ? -1 : x->instance > y->instance;
}

static uint64_t now_unix_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void json_text(const char* s) {
  gm_emitter e = {gpumem_write_to_file, stdout, 0};
  gm_emit_json_string(&e, s);
}

static void print_json(const rows_t* r) {
  putchar('[');
  for (size_t i = 0; i < r->count; i++) {
    const gpumem_published_t* p = &r->items[i];
    printf("%s\n  {\"pid\":%d,\"device\":%d,\"instance\":%u,\"alive\":%s,\"process\":",
           i ? "," : "", p->pid, p->device, p->instance, p->alive ? "true" : "false");
    json_text(p->process);
    printf(",\"policy\":");
    json_text(p->policy);
    printf(
        ",\"allocated_bytes\":%lld,\"allocated_peak\":%lld,\"reserved_bytes\":%lld,"
        "\"reserved_peak\":%lld,\"active_bytes\":%lld,\"requested_bytes\":%lld,"
        "\"limit_bytes\":%lld,\"device_total\":%lld,\"num_allocations\":%lld,\"num_ooms\":%lld,"
        "\"num_alloc_retries\":%lld,\"host_bytes\":%lld,\"num_moves_to_host\":%lld,"
        "\"num_moves_to_device\":%lld,\"updated_unix_ms\":%llu,\"uid\":%u,\"path\":",
        (long long)p->allocated_bytes, (long long)p->allocated_peak, (long long)p->reserved_bytes,
        (long long)p->reserved_peak, (long long)p->active_bytes, (long long)p->requested_bytes,
        (long long)p->limit_bytes, (long long)p->device_total, (long long)p->num_allocations,
        (long long)p->num_ooms, (long long)p->num_alloc_retries, (long long)p->host_bytes,
        (long long)p->num_moves_to_host, (long long)p->num_moves_to_device,
        (unsigned long long)p->updated_unix_ms, p->uid);
    json_text(p->path);
    putchar('}');
  }
  printf("%s]\n", r->count ? "\n" : "");
}

static void print_table(const rows_t* r, const char* dir) {
  char b1[32], b2[32], b3[32], b4[32];
  time_t t = time(NULL);
  struct tm tm;
  localtime_r(&t, &tm);
  char shown_dir[512];
  printf("gpumem top: %zu allocator%s published in %s, %02d:%02d:%02d\n\n", r->count,
         r->count == 1 ? "" : "s", show_text(dir, shown_dir, sizeof shown_dir), tm.tm_hour,
         tm.tm_min, tm.tm_sec);
  printf("%8s  %-16s %4s  %-8s %12s %12s %14s %12s %5s  %s\n", "PID", "PROCESS", "DEV", "POLICY",
         "ALLOCATED", "RESERVED", "PEAK RESERVED", "LIMIT", "OOMS", "UPDATED");
  uint64_t now = now_unix_ms();
  for (size_t i = 0; i < r->count; i++) {
    const gpumem_published_t* p = &r->items[i];
    char updated[32], name[sizeof p->process], policy[sizeof p->policy];
    if (!p->alive)
      snprintf(updated, sizeof updated, "exited");
    else if (!p->updated_unix_ms)
      snprintf(updated, sizeof updated, "-");
    else
      snprintf(updated, sizeof updated, "%.1f s ago",
               now > p->updated_unix_ms ? (double)(now - p->updated_unix_ms) / 1000.0 : 0.0);
    char dev[16];
    if (p->device >= 0)
      snprintf(dev, sizeof dev, "%d", p->device);
    else
      snprintf(dev, sizeof dev, "-");
    printf("%8d  %-16.16s %4s  %-8s %12s %12s %14s %12s %5lld  %s\n", p->pid,
           show_text(p->process, name, sizeof name), dev,
           show_text(p->policy, policy, sizeof policy),
           gm_format_bytes((uint64_t)p->allocated_bytes, b1, sizeof b1),
           gm_format_bytes((uint64_t)p->reserved_bytes, b2, sizeof b2),
           gm_format_bytes((uint64_t)p->reserved_peak, b3, sizeof b3),
           p->limit_bytes ? gm_format_bytes((uint64_t)p->limit_bytes, b4, sizeof b4) : "none",
           (long long)p->num_ooms, updated);
  }
  /* The overflow tier, for the processes that use it: a line each, so
   * that the table keeps its columns for everyone else. */
  for (size_t i = 0; i < r->count; i++) {
    const gpumem_published_t* p = &r->items[i];
    if (!p->host_bytes && !p->num_moves_to_host && !p->num_moves_to_device) continue;
    printf("%8d  overflow tier: %s on host pages; %lld blocks moved to host, %lld back\n", p->pid,
           gm_format_bytes((uint64_t)p->host_bytes, b1, sizeof b1), (long long)p->num_moves_to_host,
           (long long)p->num_moves_to_device);
  }
  /* Totals per device, of the processes still running. */
  for (size_t i = 0; i < r->count;) {
    int device = r->items[i].device;
    int64_t allocated = 0, reserved = 0, total = 0;
    int procs = 0;
    for (; i < r->count && r->items[i].device == device; i++) {
      if (!r->items[i].alive) continue;
      allocated = add_figure(allocated, r->items[i].allocated_bytes);
      reserved = add_figure(reserved, r->items[i].reserved_bytes);
      if (r->items[i].device_total > total) total = r->items[i].device_total;
      procs++;
    }
    if (!procs) continue;
    char dev[32];
    if (device >= 0)
      snprintf(dev, sizeof dev, "device %d", device);
    else
      snprintf(dev, sizeof dev, "no device");
    printf("\n%s: %d running, allocated %s, reserved %s of %s", dev, procs,
           gm_format_bytes((uint64_t)allocated, b1, sizeof b1),
           gm_format_bytes((uint64_t)reserved, b2, sizeof b2),
           gm_format_bytes((uint64_t)total, b3, sizeof b3));
  }
  printf("\n");
  if (r->dropped) {
    printf("\n%zu more allocator record%s not shown (more than %zu; live processes shown first)\n",
           r->dropped, r->dropped == 1 ? "" : "s", r->max);
  }
}

static int remove_exited(const rows_t* r) {
  int removed = 0;
  for (size_t i = 0; i < r->count; i++) {
    if (r->items[i].alive) continue;
    if (unlink(r->items[i].path) == 0) {
      removed++;
    } else {
      char path[sizeof r->items[i].path];
      fprintf(stderr, "gpumem top: cannot remove %s: %s\n",
              show_text(r->items[i].path, path, sizeof path), strerror(errno));
    }
  }
  return removed;
}

int cmd_top(int argc, char** argv) {
  int once = 0, json = 0, clean = 0;
  double interval = 1.0;
  long max_rows = MAX_ROWS;
  const char* dir = NULL;
  for (int i = 0; i < argc; i++) {
    const char* a = argv[i];
    if (strcmp(a, "--once") == 0) {
      once = 1;
    } else if (strcmp(a, "--json") == 0) {
      json = 1;
    } else if (strcmp(a, "--clean") == 0) {
      clean = 1;
    } else if (strcmp(a, "--dir") == 0 && i + 1 < argc) {
      dir = argv[++i];
    } else if (strcmp(a, "--interval") == 0 && i + 1 < argc) {
      char* end;
      interval = strtod(argv[++i], &end);
      if (*end || !(interval >= 0.1 && interval <= 3600)) {
        cli_usage_error(usage_top, "bad --interval '%s' (seconds, 0.1 to 3600)", argv[i]);
        return 2;
      }
    } else if (strcmp(a, "--max-rows") == 0 && i + 1 < argc) {
      char* end;
      max_rows = strtol(argv[++i], &end, 10);
      if (*end || max_rows < 1 || max_rows > 1000000) {
        cli_usage_error(usage_top, "bad --max-rows '%s' (1 to 1000000)", argv[i]);
        return 2;
      }
    } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      fputs(usage_top, stdout);
      return 0;
    } else {
      /* the reason and where the usage is, as every command says it */
      if (strncmp(a, "--", 2) == 0 && i + 1 >= argc &&
          (!strcmp(a, "--dir") || !strcmp(a, "--interval") || !strcmp(a, "--max-rows")))
        cli_usage_error(usage_top, "option '%s' needs a value", a);
      else
        cli_usage_error(usage_top, "unknown option '%s'", a);
      return 2;
    }
  }
  const char* shown_dir = dir ? dir : getenv("GPUMEM_PUBLISH_DIR");
  if (!shown_dir || !shown_dir[0]) shown_dir = "/dev/shm";
  rows_t r = {NULL, 0, 0, 0, 0, (size_t)max_rows};
  int rc = 0;
  for (;;) {
    r.count = r.dropped = r.next_exited = 0;
    if (gpumem_published_scan(shown_dir, collect, &r) < 0) {
      cli_error("%s", show_detail(gpumem_last_error()));
      rc = 1;
      break;
    }
    if (clean) {
      int removed = remove_exited(&r);
      if (!json)
        printf("removed %d file%s of exited processes\n", removed, removed == 1 ? "" : "s");
      clean = 0;
      continue; /* show what is left */
    }
    /* (qsort's array may not be NULL, even for no elements) */
    if (r.count > 1) qsort(r.items, r.count, sizeof *r.items, by_device_then_pid);
    if (json) {
      print_json(&r);
      if (r.dropped) {
        fprintf(stderr, "gpumem top: %zu more allocator records not shown (more than %zu)\n",
                r.dropped, r.max);
      }
      break;
    }
    if (!once) fputs("\033[H\033[2J", stdout);
    print_table(&r, shown_dir);
    fflush(stdout);
    if (once) break;
    struct timespec ts = {(time_t)interval, (long)((interval - (double)(time_t)interval) * 1e9)};
    nanosleep(&ts, NULL);
  }
  free(r.items);
  return rc;
}
