#include "common/weight_sync/gloo_rendezvous.h"

#ifdef GRPO_HAVE_GLOO

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/logging.h"

namespace grpo::common {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// A store whose every wait (and get, which waits for its key) ends at one deadline, whatever
// timeout the caller asks for (gloo asks each of its waits for the whole timeout), until
// EndJoin(): the process group keeps its store, and a later use has the caller's timeout.
class DeadlineStore final : public c10d::Store {
 public:
  DeadlineStore(c10::intrusive_ptr<c10d::Store> inner, Clock::time_point deadline,
                std::shared_ptr<std::atomic<bool>> joined = nullptr)
      : c10d::Store(inner->getTimeout()),
        inner_(std::move(inner)),
        deadline_(deadline),
        joined_(joined ? std::move(joined) : std::make_shared<std::atomic<bool>>(false)) {}

  void EndJoin() { *joined_ = true; }

  // Clones share the end of the join.
  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::make_intrusive<DeadlineStore>(inner_->clone(), deadline_, joined_);
  }
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    inner_->set(key, value);
  }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    return inner_->compareSet(key, expected, desired);
  }
  std::vector<uint8_t> get(const std::string& key) override {
    if (!*joined_) wait({key});
    return inner_->get(key);
  }
  int64_t add(const std::string& key, int64_t value) override { return inner_->add(key, value); }
  bool deleteKey(const std::string& key) override { return inner_->deleteKey(key); }
  bool check(const std::vector<std::string>& keys) override { return inner_->check(keys); }
  int64_t getNumKeys() override { return inner_->getNumKeys(); }
  void wait(const std::vector<std::string>& keys) override {
    if (*joined_) return inner_->wait(keys);
    const auto left = std::chrono::duration_cast<milliseconds>(deadline_ - Clock::now());
    TORCH_CHECK(left.count() > 0, "gloo rendezvous timed out waiting for ", keys.size(),
                " key(s), the first '", keys.empty() ? std::string() : keys.front(), "'");
    inner_->wait(keys, left);
  }
  void wait(const std::vector<std::string>& keys, const milliseconds& timeout) override {
    if (*joined_) return inner_->wait(keys, timeout);
    wait(keys);
  }

 private:
  const c10::intrusive_ptr<c10d::Store> inner_;
  const Clock::time_point deadline_;
  const std::shared_ptr<std::atomic<bool>> joined_;
};

}  // namespace

void DisableFlightRecorder() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (const char* name : {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}) {
      if (const char* set = std::getenv(name); set != nullptr) {
        if (std::string(set) != "0") {
          GRPO_LOG_WARN(
              "{}={} keeps c10d's flight recorder on: with several process groups in this "
              "process (weight sync, learner ranks) its records race (torch 2.11) and can crash it",
              name, set);
        }
        return;
      }
    }
    ::setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0);
  });
}

c10::intrusive_ptr<c10d::ProcessGroupGloo> JoinGlooGroup(c10::intrusive_ptr<c10d::Store> store,
                                                         int rank, int world_size,
                                                         milliseconds timeout,
                                                         const std::string& hostname) {
  TORCH_CHECK(timeout.count() > 0, "gloo rendezvous: timeout must be > 0");
  DisableFlightRecorder();
  const Clock::time_point deadline = Clock::now() + timeout;

  // 1. Every rank arrives, within the deadline.
  {
    auto barrier = c10::make_intrusive<DeadlineStore>(store, deadline);
    barrier->set("arrived/" + std::to_string(rank), std::vector<uint8_t>{1});
    std::vector<std::string> everyone;
    for (int r = 0; r < world_size; ++r) everyone.push_back("arrived/" + std::to_string(r));
    barrier->wait(everyone);
  }

  // 2 and 3. Gloo's rendezvous and connections, within what is left.
  const milliseconds left =
      std::max(std::chrono::duration_cast<milliseconds>(deadline - Clock::now()), milliseconds(5));
  auto bounded = c10::make_intrusive<DeadlineStore>(std::move(store), deadline);
  // Gloo waits 5 times its timeout for a pair to connect.
  auto options = c10d::ProcessGroupGloo::Options::create(left / 5);
  options->devices.push_back(hostname.empty()
                                 ? c10d::ProcessGroupGloo::createDefaultDevice()
                                 : c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(bounded, rank, world_size, options);
  bounded->EndJoin();
  pg->setTimeout(timeout);
  return pg;
}

}  // namespace grpo::common

#endif  // GRPO_HAVE_GLOO
