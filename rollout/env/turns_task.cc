#include "rollout/env/turns_task.h"

#include <string>

namespace grpo::rollout {

std::unique_ptr<Environment> MakeTurnsEnvironment() {
  auto reset = [](const nlohmann::json& row, uint64_t,
                  nlohmann::json& state) -> StatusOr<EnvObservation> {
    int64_t turns = kDefaultTaskTurns;
    if (row.is_object() && row.contains("turns")) {
      if (!row["turns"].is_number_integer() || row["turns"].get<int64_t>() < 1) {
        return Status::InvalidArgument("turns task: the row's \"turns\" must be an integer >= 1");
      }
      turns = row["turns"].get<int64_t>();
    }
    state = {{"turn", 0}, {"turns", turns}};
    return EnvObservation{};
  };
  auto step = [](const std::string&, nlohmann::json& state) -> StatusOr<EnvObservation> {
    const int64_t turn = state["turn"].get<int64_t>() + 1;
    const int64_t turns = state["turns"].get<int64_t>();
    state["turn"] = turn;
    EnvObservation obs;
    obs.reward = 1.0 / static_cast<double>(turns);
    obs.done = turn >= turns;
    if (!obs.done) obs.messages = {{"user", "ok"}};
    obs.metadata = {{"turn", turn}};
    return obs;
  };
  return std::make_unique<FunctionEnvironment>("turns", std::move(reset), std::move(step));
}

}  // namespace grpo::rollout
