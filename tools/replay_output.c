/* How one replay's figures are shown (replay_output.h): the human and JSON
 * forms of `gpumem replay`, the pricing of the simulated device's mapping
 * calls at a GPU's measured costs, and the H200 figures quoted beside the
 * replayed ones. */
#include "replay_output.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "show.h"

#define GIB 1073741824.0

/* Keyed by trace name. */
static const anchor_t anchors[] = {
    {"gpt2_train", 1.1245, 1.0698, "exp", 1.1266, 1.0094, "exp"},
    {"resnet50_train", 1.1266, 1.0068, "exp", 1.0211, 1.0070, "exp"},
    {"llama_ckpt_train", 1.3514, 1.0968, "async", 1.1266, 1.0258, "exp"},
    {"t5_varlen_prefetch", 1.3497, 1.0354, "exp", 1.0328, 1.0141, "exp"},
};

const anchor_t* replay_anchor(const char* name) {
  for (size_t i = 0; i < sizeof anchors / sizeof anchors[0]; i++) {
    if (strcmp(anchors[i].trace, name) == 0) return &anchors[i];
  }
  return NULL;
}

static void json_calls(FILE* f, const uint64_t* calls) {
  fputc('{', f);
  for (int k = 0; k < GPUMEM_CALL_COUNT; k++) {
    fprintf(f, "%s\"%s\":%llu", k ? "," : "", gpumem_backend_call_name(k),
            (unsigned long long)calls[k]);
  }
  fputc('}', f);
}

static uint64_t sum_calls(const uint64_t* calls) {
  uint64_t n = 0;
  for (int k = 0; k < GPUMEM_CALL_COUNT; k++) n += calls[k];
  return n;
}

static double per_1k(uint64_t calls, uint64_t ops) {
  return ops ? 1000.0 * (double)calls / (double)ops : 0;
}

/* What the mapping calls of a replay on the simulated device would take on
 * a GPU, per operation: the simulated device prices them at a few hundred
 * instructions, an H100 at tens of microseconds, so a workload that keeps
 * moving pages looks cheap here and is not there. Per-call costs measured
 * on an H100 (bench/gpu/vmm_cost.c, 2026-11-22, docs/design.md): create
 * 12.7 us, map with its access grant 35.1 us, unmap 19.6 us, release 18.4
 * us. Other calls (events, synchronizations) are left out. Measured
 * against replays through CUDA (2026-11-25, on an H100): synth_random's warm
 * pass 16.3 estimated, 16.9 us/op measured. */
/* The pytorch policy's plain segments (PyTorch's cudaMalloc growth) are
 * priced too, so that a cold start can be set beside native's: cuMemAlloc
 * and cuMemFree measured on an H200 (bench/gpu/vmm_cost.c, 2026-11-27; 2 MiB
 * 100.0 / 44.0 us, 20 MiB 42.9 / 38.6, 1 GiB 119.8 / 339.9): the cheapest
 * size's, so native's cost is if anything understated. */
#define EST_ALLOC_US 42.9
#define EST_FREE_US 38.6

double price_map_us(const uint64_t* calls) {
  return 12.7 * (double)calls[GPUMEM_CALL_create_page] + 35.1 * (double)calls[GPUMEM_CALL_map] +
         19.6 * (double)calls[GPUMEM_CALL_unmap] + 18.4 * (double)calls[GPUMEM_CALL_release_page] +
         EST_ALLOC_US * (double)calls[GPUMEM_CALL_alloc] +
         EST_FREE_US * (double)calls[GPUMEM_CALL_free];
}

double price_map_us_per_op(const uint64_t* calls, uint64_t ops) {
  return ops ? price_map_us(calls) / (double)ops : 0.0;
}

/* The expandable-segments model's growth, priced the same way: PyTorch
 * makes every page (2 MiB small pool, 20 MiB large) a physical allocation
 * of its own and maps it on its own, then grants access over the range
 * once; on the H100 a grant costs 29.7 us per mapping it covers even when
 * one call covers 512 (bench/gpu/vmm_cost.c). So a page is a create
 * (12.7), a map (1.5) and its share of the grant (29.7), at the 2 MiB
 * page's prices: a 20 MiB page's, if anything, are higher. The
 * cudaMallocAsync model is not priced: its pool's growth is the driver's,
 * whose calls are not observable. */
#define EST_EXPANDABLE_PAGE_US (12.7 + 1.5 + 29.7)

double price_expandable_us_per_op(uint64_t pages, size_t ops) {
  return ops ? EST_EXPANDABLE_PAGE_US * (double)pages / (double)ops : 0.0;
}

/* The second half of the cold pass as a share of its operations (steps
 * are taken to be spread evenly over the operations). */
double replay_half_share(const replay_result_t* r) {
  return r->ops_cold ? (double)r->cold_half_ops / (double)r->ops_cold : 0.5;
}

/* column: the --compare column the row belongs to (NULL: not compared). */
void replay_print_json(FILE* f, const trace_t* t, const replay_config_t* c,
                       const replay_result_t* r, const anchor_t* anchor, const char* column) {
  fputs("{\"trace\":", f);
  show_json(f, t->path);
  fputs(",\"name\":", f);
  show_json(f, t->name);
  fprintf(f, ",\"policy\":\"%s\",\"device\":\"%s\"", replay_policy_name(r->policy),
          replay_device_name(c->device));
  if (column) fprintf(f, ",\"column\":\"%s\"", column);
  fputs(",\"conf\":", f);
  if (c->conf && c->conf[0]) {
    show_json(f, c->conf);
  } else {
    fputs("null", f);
  }
  fprintf(f, ",\"events\":%zu,\"allocations\":%zu,\"streams\":%zu", t->num_events, t->num_allocs,
          t->num_streams);
  fprintf(f, ",\"peak_live_bytes\":%llu,\"peak_live_event\":%zu",
          (unsigned long long)t->peak_live_bytes, t->peak_event);
  fprintf(f, ",\"peak_reserved_bytes\":%llu,\"reserved_ratio\":%.4f",
          (unsigned long long)r->peak_reserved_bytes, r->reserved_ratio);
  if (t->recorded_peak_reserved)
    fprintf(f, ",\"recorded_peak_reserved_bytes\":%llu",
            (unsigned long long)t->recorded_peak_reserved);
  fprintf(f, ",\"ns_per_op_cold\":%.1f", r->ns_per_op_cold);
  if (r->ns_per_op_warm >= 0) {
    fprintf(f, ",\"ns_per_op_warm\":%.1f", r->ns_per_op_warm);
  } else {
    fputs(",\"ns_per_op_warm\":null", f);
  }
  fprintf(f, ",\"warm_passes\":%d,\"ops_cold\":%llu,\"ops_warm\":%llu", r->warm_passes,
          (unsigned long long)r->ops_cold, (unsigned long long)r->ops_warm);
  if (r->oom) {
    fprintf(f, ",\"oom\":true,\"oom_pass\":%d,\"oom_event\":%zu,\"oom_line\":%u,\"oom_size\":%zu",
            r->oom_pass, r->oom_event, r->oom_line, r->oom_size);
    fprintf(f, ",\"oom_status\":\"%s\",\"oom_message\":", gpumem_strerror(r->oom_status));
    show_json(f, r->oom_message);
  } else {
    fputs(",\"oom\":false,\"oom_event\":null", f);
  }
  uint64_t cap = replay_effective_cap(c, t);
  if (cap) {
    fprintf(f, ",\"limit_bytes\":%llu", (unsigned long long)cap);
  } else {
    fputs(",\"limit_bytes\":null", f);
  }
  fputs(",\"backend_calls\":", f);
  json_calls(f, r->backend_calls_cold);
  fputs(",\"backend_calls_warm\":", f);
  json_calls(f, r->backend_calls_warm);
  if (c->device == REPLAY_DEVICE_SIM) {
    fprintf(f, ",\"est_h100_map_us_per_op_cold\":%.3f",
            price_map_us_per_op(r->backend_calls_cold, r->ops_cold));
    fprintf(f, ",\"est_h100_map_us_per_op_cold_second_half\":%.3f",
            price_map_us_per_op(r->cold_half_calls, r->cold_half_ops));
    if (c->step_ms > 0 && c->steps > 0) {
      double step_us = c->step_ms * 1000.0 * (double)c->steps;
      fprintf(f, ",\"step_ms\":%g,\"steps\":%d,\"est_h100_map_share_of_time_cold\":%.5f",
              c->step_ms, c->steps, price_map_us(r->backend_calls_cold) / step_us);
      fprintf(f, ",\"est_h100_map_share_of_time_cold_second_half\":%.5f",
              price_map_us(r->cold_half_calls) / (step_us * replay_half_share(r)));
    }
    if (r->warm_passes)
      fprintf(f, ",\"est_h100_map_us_per_op_warm\":%.3f",
              price_map_us_per_op(r->backend_calls_warm, r->ops_warm));
  }
  fprintf(f, ",\"num_syncs\":%lld,\"num_syncs_warm\":%lld", (long long)r->num_syncs_cold,
          (long long)r->num_syncs_warm);
  fprintf(f, ",\"num_alloc_retries\":%lld,\"num_alloc_retries_warm\":%lld",
          (long long)r->num_alloc_retries_cold, (long long)r->num_alloc_retries_warm);
  if (r->warm_passes) {
    fprintf(
        f, ",\"warm_peak_reserved_bytes\":%llu,\"warm_reserved_ratio\":%.4f",
        (unsigned long long)r->warm_peak_reserved_bytes,
        t->peak_live_bytes ? (double)r->warm_peak_reserved_bytes / (double)t->peak_live_bytes : 0);
  }
  if (r->steady_ops) {
    fprintf(f, ",\"steady_period\":%zu,\"steady_steps\":%d,\"steady_ops\":%llu", t->steady_period,
            t->steady_reps, (unsigned long long)r->steady_ops);
    fprintf(f, ",\"ns_per_op_steady\":%.1f,\"num_syncs_steady\":%lld,\"backend_calls_steady\":",
            r->steady_ns_per_op, (long long)r->steady_syncs);
    json_calls(f, r->steady_calls);
  }
  fprintf(f,
          ",\"num_plans\":%lld,\"num_plan_drops\":%lld,\"num_planned_allocs\":%lld,"
          "\"num_pages_aliased\":%lld,\"num_move_guard_trips\":%lld,\"num_plans_declined\":%lld,"
          "\"num_plans_shared\":%lld",
          (long long)r->stats_final.num_plans, (long long)r->stats_final.num_plan_drops,
          (long long)r->stats_final.num_planned_allocs, (long long)r->stats_final.num_pages_aliased,
          (long long)r->stats_final.num_move_guard_trips,
          (long long)r->stats_final.num_plans_declined, (long long)r->stats_final.num_plans_shared);
  if (r->min_limit_done) {
    if (r->min_limit_found) {
      fprintf(f, ",\"min_limit_bytes\":%zu,\"min_limit_ratio\":%.4f", r->min_limit_bytes,
              r->min_limit_ratio);
    } else {
      fputs(",\"min_limit_bytes\":null,\"min_limit_ratio\":null,\"min_limit_message\":", f);
      show_json(f, r->min_limit_message);
    }
    fprintf(f, ",\"min_limit_probes\":%d", r->min_limit_probes);
  }
  if (anchor) {
    fprintf(f, ",\"h200_pytorch_reserved_ratio\":%.4f,\"h200_best_peer_reserved_ratio\":%.4f",
            anchor->torch_reserved, anchor->best_reserved);
  }
  fputs("}\n", f);
  fflush(f);
}

static void print_calls_line(FILE* f, const char* label, const uint64_t* calls, uint64_t ops) {
  fprintf(f, "  %-16s", label);
  if (sum_calls(calls) == 0) {
    fputs("none\n", f);
    return;
  }
  /* Wrapped under the label column, to stay readable in 100 columns. */
  int col = 18, first = 1;
  for (int k = 0; k < GPUMEM_CALL_COUNT; k++) {
    if (!calls[k]) continue;
    char item[96];
    int n = snprintf(item, sizeof item, "%s %llu (%.2f/1k ops)", gpumem_backend_call_name(k),
                     (unsigned long long)calls[k], per_1k(calls[k], ops));
    if (!first && col + 2 + n > 100) {
      fprintf(f, ",\n%18s", "");
      col = 18;
    } else if (!first) {
      fputs(", ", f);
      col += 2;
    }
    fputs(item, f);
    col += n;
    first = 0;
  }
  fputc('\n', f);
}

void replay_print_human(FILE* f, const trace_t* t, const replay_config_t* c,
                        const replay_result_t* r) {
  char a[32], b[32], d[32], msg[512];
  char path[512];
  fprintf(f, "%s (%s)\n", t->name, show_text(t->path, path, sizeof path));
  fprintf(f, "  %-16s%s on the %s device, ", "policy", replay_policy_name(r->policy),
          c->device == REPLAY_DEVICE_CUDA ? "CUDA" : "simulated");
  uint64_t cap = replay_effective_cap(c, t);
  if (cap) {
    fprintf(f, "limit %.3f GiB (%llu bytes)\n", (double)cap / GIB, (unsigned long long)cap);
  } else {
    fputs("no limit\n", f);
  }
  fprintf(f, "  %-16s%s (%s allocations, %s frees", "events", show_count(t->num_events, a),
          show_count(t->num_allocs, b), show_count(t->num_frees, d));
  if (t->num_record_streams) fprintf(f, ", %zu record_stream", t->num_record_streams);
  fprintf(f, "), %zu stream%s\n", t->num_streams, t->num_streams == 1 ? "" : "s");
  fprintf(f, "  %-16s%.3f GiB (%llu bytes) at event %zu\n", "peak live",
          (double)t->peak_live_bytes / GIB, (unsigned long long)t->peak_live_bytes, t->peak_event);
  fprintf(f, "  %-16s%.3f GiB (%llu bytes), %.4f x peak live%s\n", "peak reserved",
          (double)r->peak_reserved_bytes / GIB, (unsigned long long)r->peak_reserved_bytes,
          r->reserved_ratio, r->oom && r->oom_pass == 0 ? " (up to the failure)" : "");
  if (t->recorded_peak_reserved) {
    fprintf(f,
            "  %-16s%.3f GiB (%llu bytes) in the snapshot's segment events; replayed / "
            "recorded %.4f\n",
            "recorded peak", (double)t->recorded_peak_reserved / GIB,
            (unsigned long long)t->recorded_peak_reserved,
            (double)r->peak_reserved_bytes / (double)t->recorded_peak_reserved);
  }
  if (r->warm_passes && t->peak_live_bytes) {
    fprintf(f, "  %-16s%.3f GiB, %.4f x peak live\n", "reserved (warm)",
            (double)r->warm_peak_reserved_bytes / GIB,
            (double)r->warm_peak_reserved_bytes / (double)t->peak_live_bytes);
    /* Two peaks of one job that differ read as a contradiction unless
     * each says what it is. */
    double cold = (double)r->peak_reserved_bytes, warm = (double)r->warm_peak_reserved_bytes;
    if (fabs(warm - cold) > 0.001 * cold)
      fprintf(f,
              "  %-16speak reserved is the first pass's, from an empty allocator; reserved (warm)\n"
              "  %-16sis the most the passes after it held, each replaying the trace again on the\n"
              "  %-16scache the one before left (nothing given back in between), whose layout\n"
              "  %-16sfits the new pass %s\n",
              "", "", "", "", warm > cold ? "less well" : "better");
  }
  if (r->stats_final.num_plans) {
    fprintf(f, "  %-16s%lld built, %lld dropped, %lld allocations placed by a plan\n", "plans",
            (long long)r->stats_final.num_plans, (long long)r->stats_final.num_plan_drops,
            (long long)r->stats_final.num_planned_allocs);
  }
  if (r->stats_final.num_plans_shared) {
    fprintf(f,
            "  %-16s%lld with one arena for all their streams: the streams peak apart, and "
            "memory passes between them ordered on the device (stream waits)\n",
            "plans", (long long)r->stats_final.num_plans_shared);
  }
  if (r->stats_final.num_plans_declined) {
    fprintf(f,
            "  %-16s%lld declined: the streams peak apart, and an arena per stream would hold "
            "more than the loop has live\n",
            "plans", (long long)r->stats_final.num_plans_declined);
  }
  if (r->stats_final.num_pages_aliased) {
    fprintf(f, "  %-16s%lld (a partly used page shared by a request that did not fit)\n",
            "pages shared", (long long)r->stats_final.num_pages_aliased);
  }
  if (r->stats_final.num_move_guard_trips) {
    fprintf(f,
            "  %-16spages kept moving with no plan serving: grew instead of moving from then on "
            "(move_guard:off holds memory at the high-water mark)\n",
            "move guard");
  }
  fprintf(f, "  %-16scold %.1f", "ns/op", r->ns_per_op_cold);
  if (r->ns_per_op_warm >= 0) {
    fprintf(f, ", warm %.1f (median of %d pass%s)\n", r->ns_per_op_warm, r->warm_passes,
            r->warm_passes == 1 ? "" : "es");
  } else {
    fputs(", warm -\n", f);
  }
  if (r->oom) {
    fprintf(f, "  %-16syes: %s pass, event %zu (line %u), %zu bytes: %s\n", "oom",
            r->oom_pass ? "warm" : "cold", r->oom_event, r->oom_line, r->oom_size,
            show_first_line(
                r->oom_message[0] ? show_detail(r->oom_message) : gpumem_strerror(r->oom_status),
                msg, sizeof msg));
  } else {
    fprintf(f, "  %-16sno\n", "oom");
  }
  if (r->steady_ops) {
    fprintf(f,
            "  %-16s%d more steps of %zu allocations (in the cold pass): %.1f ns/op, %lld syncs\n",
            "steady state", t->steady_reps, t->steady_period, r->steady_ns_per_op,
            (long long)r->steady_syncs);
    print_calls_line(f, "calls (steady)", r->steady_calls, r->steady_ops);
  }
  print_calls_line(f, "calls (cold)", r->backend_calls_cold, r->ops_cold);
  if (r->warm_passes) print_calls_line(f, "calls (warm)", r->backend_calls_warm, r->ops_warm);
  if (c->device == REPLAY_DEVICE_SIM && sum_calls(r->backend_calls_cold)) {
    fprintf(f, "  %-16s~%.3f us/op over the first pass, ~%.3f over its second half", "on an H100",
            price_map_us_per_op(r->backend_calls_cold, r->ops_cold),
            price_map_us_per_op(r->cold_half_calls, r->cold_half_ops));
    if (r->warm_passes)
      fprintf(f, ", ~%.3f warm", price_map_us_per_op(r->backend_calls_warm, r->ops_warm));
    fputs(" in mapping calls (priced per call)\n", f);
    if (c->step_ms > 0 && c->steps > 0) {
      double step_us = c->step_ms * 1000.0 * (double)c->steps;
      fprintf(
          f, "  %-16s%.3f%% of %d steps of %g ms in the first pass, %.3f%% in its second half\n",
          "share of time", 100.0 * price_map_us(r->backend_calls_cold) / step_us, c->steps,
          c->step_ms, 100.0 * price_map_us(r->cold_half_calls) / (step_us * replay_half_share(r)));
    }
  }
  fprintf(f, "  %-16scold %lld, warm %lld\n", "syncs", (long long)r->num_syncs_cold,
          (long long)r->num_syncs_warm);
  fprintf(f, "  %-16scold %lld, warm %lld\n", "alloc retries", (long long)r->num_alloc_retries_cold,
          (long long)r->num_alloc_retries_warm);
  if (r->min_limit_done) {
    if (r->min_limit_found) {
      fprintf(f, "  %-16s%.3f GiB (%zu bytes), %.4f x peak live (%d probes)\n", "min limit",
              (double)r->min_limit_bytes / GIB, r->min_limit_bytes, r->min_limit_ratio,
              r->min_limit_probes);
    } else {
      fprintf(f, "  %-16snot found: %s\n", "min limit",
              show_first_line(r->min_limit_message, msg, sizeof msg));
    }
  }
  fputc('\n', f);
  fflush(f);
}
