#include "rollout/env/steps_in_flight.h"

namespace grpo::rollout {

StepsInFlight::~StepsInFlight() {
  std::map<size_t, std::thread> threads;
  {
    common::MutexLock lock(&mu_);
    threads = std::move(running_);
  }
  for (auto& [episode, t] : threads) t.join();
}

void StepsInFlight::Launch(size_t episode, Step step) {
  common::MutexLock lock(&mu_);
  running_[episode] = std::thread([this, episode, step = std::move(step)] {
    StatusOr<EnvObservation> result = step();
    common::MutexLock done(&mu_);
    finished_.push_back({episode, std::move(result)});
    cv_.NotifyAll();
  });
}

size_t StepsInFlight::pending() const {
  common::MutexLock lock(&mu_);
  return running_.size();
}

void StepsInFlight::WaitAll() {
  common::MutexLock lock(&mu_);
  while (finished_.size() < running_.size()) cv_.Wait(&mu_);
}

void StepsInFlight::WaitAny() {
  common::MutexLock lock(&mu_);
  while (finished_.empty() && !running_.empty()) cv_.Wait(&mu_);
}

std::vector<StepsInFlight::Finished> StepsInFlight::TakeFinished() {
  std::vector<Finished> out;
  std::vector<std::thread> threads;
  {
    common::MutexLock lock(&mu_);
    out = std::move(finished_);
    finished_.clear();
    for (const Finished& f : out) {
      auto it = running_.find(f.episode);
      threads.push_back(std::move(it->second));
      running_.erase(it);
    }
  }
  for (auto& t : threads) t.join();  // each has pushed its result: it is returning
  return out;
}

}  // namespace grpo::rollout
