// The job as the learner reports it: its state machine's states, a snapshot, and the events a
// subscriber receives (learner::Learner). Plain structs, no torch or protobuf:
// services/convert.h maps them to grpo.v1.Job and JobEvent. Header only.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

namespace grpo::learner {

// waiting_for_data -> running <-> waiting_for_data -> done | cancelled | failed (the last three
// are terminal).
enum class JobState { kWaitingForData, kRunning, kDone, kCancelled, kFailed };
// "waiting_for_data", "running", "done", "cancelled", "failed" (Job.state on the wire).
inline std::string_view JobStateName(JobState state) {
  switch (state) {
    case JobState::kWaitingForData:
      return "waiting_for_data";
    case JobState::kRunning:
      return "running";
    case JobState::kDone:
      return "done";
    case JobState::kCancelled:
      return "cancelled";
    case JobState::kFailed:
      return "failed";
  }
  return "unknown";
}

inline bool IsTerminal(JobState state) {
  return state == JobState::kDone || state == JobState::kCancelled || state == JobState::kFailed;
}

struct JobSnapshot {
  JobState state = JobState::kWaitingForData;
  // Why the job is in its state (a failure's error, "max_steps reached" ...), plus a ledger
  // error when the counts could not be read.
  std::string message;
  int64_t global_step = 0;
  int64_t max_steps = 0;
  int64_t policy_version = 0;
  int32_t workers = 0;
  // The ledger's prompts by state and its pass (zeros when the ledger could not be read).
  int64_t queued = 0, leased = 0, trained = 0, rejected = 0, filtered = 0, pass = 0;
  std::map<std::string, double> last_metrics;  // TRL names: loss, reward, kl ...
};

struct JobEvent {
  JobSnapshot job;
  int64_t step = 0;
  // The optimizer step's metrics (TRL names); empty for a state change.
  std::map<std::string, double> metrics;
};

}  // namespace grpo::learner
