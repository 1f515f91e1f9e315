/* An allocator configuration the randomized and the fault-injection tests
 * run under (each test keeps its own list of them), and the options it
 * gives. Static inline so that a test using part of it compiles cleanly. */
#ifndef GPUMEM_TEST_CONFIG_LIST_H
#define GPUMEM_TEST_CONFIG_LIST_H

#include <stddef.h>

#include "gpumem.h"

typedef struct config {
  const char* name;
  gpumem_policy_t policy;
  gpumem_reclaim_t reclaim;
  gpumem_placement_t placement;
  size_t map_pages; /* pages per physical allocation at most (0: one) */
  /* 1: the library's own defaults for everything but the policy (large
   * mappings while uncapped, the move budget, auto placement); 0: every
   * page move the setting allows, whatever it costs (no move budget, the
   * headroom of 0.2%), so that the tests reach every path that moves;
   * 2: the library's defaults with map_pages per mapping and the headroom
   * of 0.2%, so that arenas pass the mark often and fences (fence.c) take
   * pages back. Under 0 and 2 streams lend (lend:ordered), so that blocks
   * pass between streams' arenas while pages move; 3: as 2, lending with
   * lend:on (lent blocks come back behind the borrower's event); 4: the
   * library's defaults with the overflow tier on (overflow:host, a host
   * budget of 96 MiB), so that requests past the device or the limit land
   * on host pages and move back and forth; 5: as 4 with map_pages per
   * mapping, so that arena blocks own their mappings and cold ones' pages
   * move too (a mapping moves only whole). */
  int library_defaults;
} config_t;

/* The options of cfg on a device of page_size bytes per page. */
static inline gpumem_options_t config_options(const config_t* cfg, size_t page_size) {
  gpumem_options_t o;
  gpumem_options_init(&o);
  o.policy = cfg->policy;
  if (cfg->library_defaults >= 4) {
    o.overflow = GPUMEM_OVERFLOW_HOST;
    o.overflow_host_bytes = (size_t)96 << 20;
    if (cfg->library_defaults == 5) o.map_max_bytes = cfg->map_pages * page_size;
    return o;
  }
  if (cfg->library_defaults >= 2) {
    o.headroom = 0.002;
    o.reclaim = cfg->reclaim;
    o.placement = cfg->placement;
    o.map_max_bytes = cfg->map_pages * page_size;
    o.lend = cfg->library_defaults == 3 ? GPUMEM_LEND_ON : GPUMEM_LEND_ORDERED;
    return o;
  }
  if (cfg->library_defaults) return o;
  o.lend = GPUMEM_LEND_ORDERED;
  o.move_budget_us = -1.0;
  o.headroom = 0.002;
  o.reclaim = cfg->reclaim;
  o.placement = cfg->placement;
  o.map_max_bytes = cfg->map_pages * page_size;
  return o;
}

#endif
