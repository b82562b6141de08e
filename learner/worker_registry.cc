#include "learner/worker_registry.h"

#include <algorithm>
#include <utility>

namespace grpo::learner {

WorkerRegistry::Registered WorkerRegistry::Register(const std::string& worker_id,
                                                    const std::string& hostname, int32_t pid,
                                                    const std::string& requested_backend,
                                                    const std::string& assigned_backend,
                                                    std::chrono::steady_clock::time_point now) {
  Registered out;
  out.worker_id = worker_id;
  if (out.worker_id.empty()) {
    do {
      out.worker_id = "worker-" + std::to_string(next_number_++);
    } while (workers_.count(out.worker_id) > 0);
  }
  auto it = workers_.find(out.worker_id);
  if (it == workers_.end()) {
    WorkerEntry w;
    w.rank = size() + 1;
    it = workers_.emplace(out.worker_id, w).first;
    out.is_new = true;
  } else {
    out.backend_changed = it->second.assigned_backend != assigned_backend;
  }
  WorkerEntry& w = it->second;
  w.hostname = hostname;
  w.pid = pid;
  w.requested_backend = requested_backend;
  w.assigned_backend = assigned_backend;
  w.last_seen = now;
  w.suspended = false;
  out.rank = w.rank;
  return out;
}

bool WorkerRegistry::Heartbeat(const std::string& worker_id, int64_t weight_version,
                               std::chrono::steady_clock::time_point now) {
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return false;
  it->second.last_seen = now;
  it->second.weight_version = weight_version;
  it->second.suspended = false;
  return true;
}

std::vector<std::string> WorkerRegistry::SuspendSilentSince(
    const std::vector<std::string>& members, std::chrono::steady_clock::time_point cutoff) {
  std::vector<std::string> suspended;
  for (const std::string& id : members) {
    auto it = workers_.find(id);
    if (it == workers_.end() || it->second.suspended || it->second.last_seen >= cutoff) continue;
    it->second.suspended = true;
    suspended.push_back(id);
  }
  return suspended;
}

std::vector<std::string> WorkerRegistry::DropSilentSince(
    std::chrono::steady_clock::time_point cutoff) {
  std::vector<std::string> dropped;
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (it->second.last_seen < cutoff) {
      dropped.push_back(it->first);
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
  if (dropped.empty()) return dropped;
  // Ranks stay 1..N in their old order.
  std::vector<std::pair<int32_t, WorkerEntry*>> by_rank;
  for (auto& [id, w] : workers_) by_rank.emplace_back(w.rank, &w);
  std::sort(by_rank.begin(), by_rank.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 0; i < by_rank.size(); ++i) by_rank[i].second->rank = static_cast<int32_t>(i + 1);
  return dropped;
}

std::vector<std::string> WorkerRegistry::Members(std::string_view backend) const {
  std::vector<std::pair<int32_t, std::string>> by_rank;
  for (const auto& [id, w] : workers_) {
    if (w.assigned_backend == backend && !w.suspended) by_rank.emplace_back(w.rank, id);
  }
  std::sort(by_rank.begin(), by_rank.end());
  std::vector<std::string> ids;
  for (auto& [rank, id] : by_rank) ids.push_back(std::move(id));
  return ids;
}

bool WorkerRegistry::AnyAssigned(const std::vector<std::string_view>& backends) const {
  for (const auto& [id, w] : workers_) {
    if (std::find(backends.begin(), backends.end(), w.assigned_backend) != backends.end()) {
      return true;
    }
  }
  return false;
}

const WorkerEntry* WorkerRegistry::Find(const std::string& worker_id) const {
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? nullptr : &it->second;
}

}  // namespace grpo::learner
