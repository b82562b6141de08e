// WorkerRegistry: the learner's roster of rollout workers (learner::Learner holds one under its
// lock): ids, ranks in the weight-sync groups (1..N in order of registration, the learner is 0),
// the backend each asked for and was assigned, heartbeats. Ranks stay dense: a dropped worker's
// successors move down one, keeping their order. Not thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace grpo::learner {

struct WorkerEntry {
  std::string hostname;
  int32_t pid = 0;
  std::string requested_backend;  // asked for at Register
  std::string assigned_backend;   // common::AssignBackend's answer
  int32_t rank = 0;
  int64_t weight_version = -1;
  std::chrono::steady_clock::time_point last_seen;
  // Left out of the weight-sync groups (Members) since it stalled one; its next Register or
  // Heartbeat ends that.
  bool suspended = false;
};

class WorkerRegistry {
 public:
  struct Registered {
    std::string worker_id;
    int32_t rank = 0;
    bool is_new = false;           // the group gains a rank
    bool backend_changed = false;  // a known worker moves to another backend's group
  };

  // Records a Register at `now`: an empty id gets the next free "worker-<n>"; a new id gets rank
  // size() + 1; a known one keeps its rank.
  Registered Register(const std::string& worker_id, const std::string& hostname, int32_t pid,
                      const std::string& requested_backend, const std::string& assigned_backend,
                      std::chrono::steady_clock::time_point now);
  // A heartbeat at `now`: false for an unknown worker.
  bool Heartbeat(const std::string& worker_id, int64_t weight_version,
                 std::chrono::steady_clock::time_point now);
  bool Contains(const std::string& worker_id) const { return workers_.count(worker_id) > 0; }
  // Drops the workers last seen before `cutoff` and closes the ranks' gaps; their ids.
  std::vector<std::string> DropSilentSince(std::chrono::steady_clock::time_point cutoff);
  // Of `members`, the workers last seen before `cutoff` (none of whose heartbeats arrived while
  // a failed collective waited for them) are suspended: left out of Members until their next
  // Register or Heartbeat. Their ids.
  std::vector<std::string> SuspendSilentSince(const std::vector<std::string>& members,
                                              std::chrono::steady_clock::time_point cutoff);
  // The workers assigned `backend` and not suspended, in rank order (a group's roster).
  std::vector<std::string> Members(std::string_view backend) const;
  // True when some worker is assigned one of `backends`.
  bool AnyAssigned(const std::vector<std::string_view>& backends) const;
  int32_t size() const { return static_cast<int32_t>(workers_.size()); }
  const WorkerEntry* Find(const std::string& worker_id) const;

 private:
  std::map<std::string, WorkerEntry> workers_;  // by id
  int64_t next_number_ = 1;                     // of generated ids
};

}  // namespace grpo::learner
