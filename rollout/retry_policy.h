// Which failed learner calls the rollout worker tries again: the one rule behind RolloutLoop's
// retries with backoff (rollout_loop.cc). A pure function of the status code.
#pragma once

#include "common/status.h"

namespace grpo::rollout {

// True when a learner call that failed with `code` may succeed if tried again after a backoff:
// the learner restarts, stops, is busy, or a proxy in between failed (UNKNOWN: gRPC reads an HTTP
// status it cannot map, such as a proxy's 500, as UNKNOWN; doc/http-grpc-status-mapping.md).
// False for OK and for answers the same call would get again: bad input, a method or resource
// that is not there, and a refused credential (UNAUTHENTICATED, PERMISSION_DENIED: the worker
// exits and says so). NOT_FOUND is not retried because the caller acts on it (it registers again).
// The table, code by code, is in retry_policy.cc and retry_policy_test.cc.
bool IsRetryable(StatusCode code);

}  // namespace grpo::rollout
