// Environment calls (a session's open and reset, or a step) that run while the episode loop
// decodes other episodes' turns (EpisodeOptions::overlap_env_steps; docs/ARCHITECTURE.md
// "Multi-turn episodes"). Each runs on a thread of its own (at most env_max_concurrency at once:
// one per session held); the loop takes the finished ones between its turns.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "rollout/env/environment.h"

namespace grpo::rollout {

class StepsInFlight {
 public:
  using Clock = std::chrono::steady_clock;
  using Step = std::function<StatusOr<EnvObservation>()>;
  struct Finished {
    size_t episode = 0;
    StatusOr<EnvObservation> result = Status::Unknown("not run");
  };

  StepsInFlight() = default;
  StepsInFlight(const StepsInFlight&) = delete;
  StepsInFlight& operator=(const StepsInFlight&) = delete;
  ~StepsInFlight();  // waits for the steps still running

  // Runs `step` of `episode` on a new thread. One call per episode at a time.
  void Launch(size_t episode, Step step) GRPO_EXCLUDES(mu_);
  // Launched and not taken yet (running or finished).
  size_t pending() const GRPO_EXCLUDES(mu_);
  // Blocks until every pending step has finished.
  void WaitAll() GRPO_EXCLUDES(mu_);
  // Blocks until one pending step has finished (at once when none is pending).
  void WaitAny() GRPO_EXCLUDES(mu_);
  // The finished steps, in the order they finished; they are no longer pending.
  std::vector<Finished> TakeFinished() GRPO_EXCLUDES(mu_);

 private:
  mutable common::Mutex mu_;
  common::CondVar cv_;
  std::map<size_t, std::thread> running_ GRPO_GUARDED_BY(mu_);  // by episode, finished included
  std::vector<Finished> finished_ GRPO_GUARDED_BY(mu_);
};

}  // namespace grpo::rollout
