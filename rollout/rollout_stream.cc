// RolloutLoop::RunStream and RunEpisodeStream: the worker's loops with continuous batching
// (config continuous_batching; rollout/rollout_loop.h). The decoding thread (this one) runs one
// Generator::GenerateStream call (StreamEpisodes with a config `env`) whose `take` leases
// prompts as groups leave and whose `done` hands each finished group to a pusher thread, which
// scores and pushes it; a fetcher thread takes newer weights meanwhile (GenerateStream switches
// in flight with partial_rollouts, or drains first; episodes take them between turns with
// partial_rollouts, else the stream stops leasing and ends).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/logging.h"
#include "rollout/rollout_loop.h"

namespace grpo::rollout {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// A leased prompt in flight, from `take` to the push of its group.
struct InFlight {
  PromptLease lease;
  Prompt prompt;
  Clock::time_point started;
};

// Finished groups (StreamedGroup or EpisodeGroup) from the decoding thread to the pusher.
// Thread-safe.
template <typename Finished>
class FinishedQueue {
 public:
  void Put(InFlight item, Finished group) GRPO_EXCLUDES(mu_) {
    common::MutexLock lock(&mu_);
    items_.emplace_back(std::move(item), std::move(group));
    cv_.NotifyOne();
  }
  void Close() GRPO_EXCLUDES(mu_) {
    common::MutexLock lock(&mu_);
    closed_ = true;
    cv_.NotifyAll();
  }
  // Everything queued, waiting for at least one item; empty once closed and drained.
  std::vector<std::pair<InFlight, Finished>> TakeAll() GRPO_EXCLUDES(mu_) {
    common::MutexLock lock(&mu_);
    while (items_.empty() && !closed_) cv_.Wait(&mu_);
    std::vector<std::pair<InFlight, Finished>> out(std::make_move_iterator(items_.begin()),
                                                   std::make_move_iterator(items_.end()));
    items_.clear();
    return out;
  }

 private:
  common::Mutex mu_;
  common::CondVar cv_;
  std::deque<std::pair<InFlight, Finished>> items_ GRPO_GUARDED_BY(mu_);
  bool closed_ GRPO_GUARDED_BY(mu_) = false;
};

// A stream's pusher thread: each batch of the finished groups Put since the last, made pushable
// by `to_pushed`, goes to `push` with the latest of its leases' deadlines. Finish (or the
// destructor) closes the queue and returns once everything Put was pushed.
template <typename Finished>
class Pusher {
 public:
  using ToPushed = std::function<common::RolloutGroup(InFlight&, Finished&)>;
  using Push = std::function<void(const std::vector<common::RolloutGroup>&, int64_t)>;

  Pusher(ToPushed to_pushed, Push push)
      : to_pushed_(std::move(to_pushed)), push_(std::move(push)), thread_([this] { Run(); }) {}
  ~Pusher() { Finish(); }
  Pusher(const Pusher&) = delete;
  Pusher& operator=(const Pusher&) = delete;

  void Put(InFlight item, Finished group) { queue_.Put(std::move(item), std::move(group)); }
  void Finish() {
    queue_.Close();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Run() {
    while (true) {
      std::vector<std::pair<InFlight, Finished>> batch = queue_.TakeAll();
      if (batch.empty()) return;
      std::vector<common::RolloutGroup> groups;
      int64_t last_deadline_ms = 0;
      for (auto& [item, finished] : batch) {
        last_deadline_ms = std::max(last_deadline_ms, item.lease.deadline_unix_ms);
        groups.push_back(to_pushed_(item, finished));
      }
      push_(groups, last_deadline_ms);
    }
  }

  FinishedQueue<Finished> queue_;
  const ToPushed to_pushed_;
  const Push push_;
  std::thread thread_;  // last: it starts once the members above exist
};

}  // namespace

std::function<void(const std::vector<common::RolloutGroup>&, int64_t)>
RolloutLoop::PushWithBackoff() {
  auto backoff = std::make_shared<Backoff>(options_.backoff);
  return [this, backoff](const std::vector<common::RolloutGroup>& groups, int64_t deadline_ms) {
    (void)PushGroups(groups, deadline_ms, backoff.get());
  };
}

void RolloutLoop::CountStreamedGroup(int64_t tokens, Clock::time_point started) {
  counters_.completion_tokens += tokens;
  if (metrics_) {
    metrics_->tokens_generated->Increment(static_cast<double>(tokens));
    metrics_->generation_duration->Observe(
        std::chrono::duration<double>(Clock::now() - started).count());
  }
}

std::vector<std::pair<PromptLease, Prompt>> RolloutLoop::LeaseForStream(
    int64_t room, bool idle, int64_t version, int64_t rounds_limit,
    const std::function<bool()>& behind, const std::atomic<bool>& fetch_stopped,
    Clock::time_point* next_at, Status* error) {
  std::vector<std::pair<PromptLease, Prompt>> out;
  while (out.empty()) {
    const bool over = rounds_limit > 0 && counters_.rounds.load() >= rounds_limit;
    if (Stopping() || done_ || over || learner_shutdown_.load() || needs_register_.load() ||
        fetch_stopped.load() || !error->ok()) {
      break;
    }
    // Nothing decodes and the stream is behind: it ends, and the next one starts with the
    // newer weights (the stream syncs first). A prompt leased here would start with `version`,
    // which only ages while this call waits for leases.
    if (idle && behind()) break;
    // Rows decode while a busy call leases: one attempt, and not again before the learner's
    // retry_after when it had nothing.
    if (!idle && Clock::now() < *next_at) break;
    milliseconds wait{0};
    StatusOr<std::optional<LeaseReply>> reply = Lease(room, /*retry=*/idle, version, &wait);
    if (!reply.ok()) {
      if (idle) *error = reply.status();
      *next_at = Clock::now() + kDefaultEmptyLeaseWait;
      break;
    }
    if (!*reply) {
      *next_at = Clock::now() + wait;
      // Idle and behind the learner (its answer may say so): the stream ends at once (above).
      if (idle && behind()) continue;
      if (!idle || wait.count() == 0 || !SleepUnlessStopping(wait)) break;
      continue;
    }
    for (PromptLease& lease : (*reply)->leases) {
      std::optional<Prompt> prompt = PrepareLeased(lease);
      if (!prompt) continue;
      out.emplace_back(std::move(lease), std::move(*prompt));
    }
    if (!idle) break;
  }
  return out;
}

Status RolloutLoop::RunStream(int64_t rounds_limit) {
  if (NeedsWeights()) {
    RETURN_IF_ERROR(SyncWeights(std::max<int64_t>(0, learner_version_.load())));
  }
  // Weights are installed in flight only when they are of this same incarnation (FetchInFlight),
  // so every group of this stream is of it.
  const std::string incarnation = PolicyIncarnation();

  std::atomic<bool> generating{true}, fetch_stopped{false};
  std::thread fetcher([&] {
    FetchInFlight(incarnation, &generating);
    fetch_stopped = true;
  });
  Pusher<StreamedGroup> pusher(
      [&](InFlight& item, StreamedGroup& streamed) {
        ProducedGroup produced{std::move(streamed.group), streamed.prompt_truncated, {}};
        // GenerateStream fails a group for its prompt only, as Generate does (Produce).
        produced.prompt_failed = !produced.group.ok();
        if (produced.group.ok() && rewards_ != nullptr) {
          produced.rewards =
              rewards_->ScoreGroup(*produced.group, item.prompt.text, item.prompt.row);
        }
        return ToPushed(produced, item.lease, incarnation);
      },
      PushWithBackoff());

  std::map<int64_t, InFlight> in_flight;  // by tag; the decoding thread's
  int64_t next_tag = 0;
  Status lease_error;
  Clock::time_point next_lease_at = Clock::now();
  GroupStream stream;
  stream.max_prompts = PromptsPerLease();
  stream.take = [&](int64_t room, bool idle, int64_t version) -> std::vector<StreamPrompt> {
    // The learner has newer weights than the stream's, installed or not.
    const auto behind = [&] { return NeedsWeights() || policy_version_.load() != version; };
    std::vector<StreamPrompt> out;
    for (auto& [lease, prompt] : LeaseForStream(room, idle, version, rounds_limit, behind,
                                                fetch_stopped, &next_lease_at, &lease_error)) {
      const int64_t tag = next_tag++;
      out.push_back({prompt.ids, SeedIndex(lease.lease_id), tag,
                     CompletionBudget(prompt, generator_->options().max_completion_length)});
      in_flight.emplace(tag, InFlight{std::move(lease), std::move(prompt), Clock::now()});
    }
    SetLeasesHeld(static_cast<int32_t>(in_flight.size()));
    return out;
  };
  stream.done = [&](StreamedGroup group) {
    auto node = in_flight.extract(group.tag);
    if (node.empty()) return;
    int64_t tokens = 0;
    if (group.group.ok()) {
      for (const auto& c : group.group->completions) {
        tokens += static_cast<int64_t>(c.token_ids.size());
      }
    }
    CountStreamedGroup(tokens, node.mapped().started);
    pusher.Put(std::move(node.mapped()), std::move(group));
    SetLeasesHeld(static_cast<int32_t>(in_flight.size()));
  };

  StatusOr<StreamStats> stats = generator_->GenerateStream(stream);
  generating = false;
  WakeFetcher();
  fetcher.join();
  pusher.Finish();
  SetLeasesHeld(0);
  if (!stats.ok()) return stats.status().WithContext("GenerateStream");
  GRPO_LOG_DEBUG(
      "stream ended: {} groups, {} tokens, {} policy switches, {} drains, at most {} rows",
      stats->num_groups, stats->num_completion_tokens, stats->num_switches, stats->num_drains,
      stats->max_rows);
  return lease_error;
}

Status RolloutLoop::RunEpisodeStream(int64_t rounds_limit) {
  if (NeedsWeights()) {
    RETURN_IF_ERROR(SyncWeights(std::max<int64_t>(0, learner_version_.load())));
  }
  const std::string incarnation = PolicyIncarnation();
  const bool in_flight_updates = config().partial_rollouts;

  // With partial_rollouts newer weights are installed while the episodes play (ContinueStream
  // takes them between turns, when nothing decodes).
  std::atomic<bool> generating{true}, fetch_stopped{false};
  std::thread fetcher;
  if (in_flight_updates) {
    fetcher = std::thread([&] {
      FetchInFlight(incarnation, &generating);
      fetch_stopped = true;
    });
  }
  Pusher<EpisodeGroup> pusher(
      [&](InFlight& item, EpisodeGroup& episodes) {
        ScoreEpisodeGroup(rewards_.get(), item.prompt, episodes);
        return ToPushed(episodes.produced, item.lease, incarnation);
      },
      PushWithBackoff());

  std::map<int64_t, InFlight> in_flight;  // by tag; the decoding thread's (nodes stay put)
  int64_t next_tag = 0;
  Status lease_error;
  Clock::time_point next_lease_at = Clock::now();
  Clock::time_point after_failure = Clock::now();  // no lease before (AfterGroup)
  EpisodeFeed feed;
  feed.take = [&](int64_t room, bool idle) {
    std::vector<FedPrompt> out;
    // Without in-flight updates a group never mixes versions: once the learner has newer
    // weights no group starts, and the stream ends when its groups are done (then syncs).
    if (!in_flight_updates && !idle && NeedsWeights()) return out;
    // After a failed group (an environment that may be down) the next lease waits.
    if (const auto now = Clock::now(); now < after_failure) {
      if (!idle) return out;
      if (!SleepUnlessStopping(std::chrono::ceil<milliseconds>(after_failure - now))) return out;
    }
    const auto behind = [&] { return NeedsWeights(); };
    for (auto& [lease, prompt] :
         LeaseForStream(room, idle, policy_version_.load(), rounds_limit, behind, fetch_stopped,
                        &next_lease_at, &lease_error)) {
      const int64_t tag = next_tag++;
      const int64_t seed_index = SeedIndex(lease.lease_id);
      auto [it, added] =
          in_flight.emplace(tag, InFlight{std::move(lease), std::move(prompt), Clock::now()});
      out.push_back({{&it->second.prompt, seed_index}, tag});
    }
    SetLeasesHeld(static_cast<int32_t>(in_flight.size()));
    return out;
  };
  feed.done = [&](EpisodeGroup group) {
    auto node = in_flight.extract(group.tag);
    if (node.empty()) return;
    CountEpisodes(group.counts);
    int64_t tokens = 0;  // the model's
    if (group.produced.group.ok()) {
      for (const auto& c : group.produced.group->completions) {
        for (uint8_t m : c.env_mask) tokens += m;
      }
    }
    CountStreamedGroup(tokens, node.mapped().started);
    const bool env_failed = !group.produced.group.ok() && !group.produced.prompt_failed;
    after_failure = std::max(after_failure, Clock::now() + AfterGroup(env_failed));
    pusher.Put(std::move(node.mapped()), std::move(group));
    SetLeasesHeld(static_cast<int32_t>(in_flight.size()));
  };

  StatusOr<EpisodeStreamStats> stats =
      StreamEpisodes(*generator_, *environment_, *episode_options_, feed);
  generating = false;
  WakeFetcher();
  if (fetcher.joinable()) fetcher.join();
  pusher.Finish();
  SetLeasesHeld(0);
  if (!stats.ok()) return stats.status().WithContext("StreamEpisodes");
  CountEpisodes(stats->counts);
  GRPO_LOG_DEBUG("episode stream ended: {} groups, {} model tokens", next_tag,
                 stats->num_completion_tokens);
  return lease_error;
}

}  // namespace grpo::rollout
