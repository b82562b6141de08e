#include "rollout/retry_policy.h"

namespace grpo::rollout {

bool IsRetryable(StatusCode code) {
  switch (code) {
    // The learner or the path to it may recover.
    case StatusCode::kCancelled:           // the server or transport cancelled the call
    case StatusCode::kUnknown:             // a proxy's unmapped HTTP error, a handler that threw
    case StatusCode::kDeadlineExceeded:    // a busy or restarting learner
    case StatusCode::kResourceExhausted:   // the learner's threads or memory quota
    case StatusCode::kFailedPrecondition:  // not yet: e.g. an ended weight-sync epoch
    case StatusCode::kAborted:             // a stream that broke off
    case StatusCode::kInternal:            // the learner's own transient failure (ledger I/O)
    case StatusCode::kUnavailable:         // the learner is down or shutting down
      return true;
    // The same call would get the same answer.
    case StatusCode::kOk:
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:  // the caller registers again
    case StatusCode::kAlreadyExists:
    case StatusCode::kPermissionDenied:  // e.g. a proxy's 403: configuration, not load
    case StatusCode::kOutOfRange:
    case StatusCode::kUnimplemented:  // a learner of another version, a proxy's 404
    case StatusCode::kDataLoss:
    case StatusCode::kUnauthenticated:  // the token is wrong or missing
      return false;
  }
  return false;  // not a code (a bad cast): nothing to wait for
}

}  // namespace grpo::rollout
