// The process's own series, refreshed from /proc/self when the registry is scraped: the ones
// every Prometheus client library exports under these names (process_cpu_seconds_total,
// process_resident_memory_bytes, process_virtual_memory_bytes, process_open_fds,
// process_max_fds, process_start_time_seconds), so stock dashboards and alerts work, and its
// malloc's (grpo_malloc_allocated_bytes, grpo_malloc_free_bytes): what the program holds and
// what the malloc keeps, which tell a leak from a malloc holding freed blocks (README
// "Metrics"). `grpo learner` and `grpo rollout` add them to the registry they serve.
#pragma once

#include "common/metrics/metrics.h"
#include "common/status.h"

namespace grpo::common {

// Adds the families to `registry` (borrowed; they live as long as it does) and refreshes them
// on every Expose. AlreadyExists when the registry holds them already.
Status AddProcessMetrics(Registry* registry);

}  // namespace grpo::common
