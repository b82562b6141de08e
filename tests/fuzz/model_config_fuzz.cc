// libFuzzer target: a model's config.json (common/model/model_config.h ModelConfig::FromJson),
// read from every model directory a user points the learner, a worker or `grpo plan` at, and the
// memory plan made from it (learner/distributed/memory_plan.h: arithmetic on the sizes it
// declares). Any input must give a config or a Status, never a crash or undefined behaviour
// (signed overflow included); an accepted config must survive its own JSON round trip, and its
// plan must be a Status or figures that are not negative.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string_view>

#include "common/config.h"
#include "common/model/model_config.h"
#include "learner/distributed/memory_plan.h"

namespace {

void CheckPlan(const grpo::common::ModelConfig& model, int world_size, bool checkpointing) {
  grpo::common::GrpoConfig config;
  config.gradient_checkpointing = checkpointing;
  auto plan = grpo::learner::distributed::PlanMemory(model, config, world_size, "cpu");
  if (!plan.ok()) return;
  if (plan->parameters < 0 || plan->activations() < 0 || plan->Total() < 0) std::abort();
  (void)grpo::learner::distributed::FormatPlan(*plan, 80ll << 30);
  (void)plan->ToJson().dump();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return 0;
  auto model = grpo::common::ModelConfig::FromJson(json, "<fuzz>");
  if (!model.ok()) return 0;
  auto again = grpo::common::ModelConfig::FromJson(model->ToJson(), "<round trip>");
  if (!again.ok() || again->ToJson() != model->ToJson()) std::abort();
  CheckPlan(*model, 1, false);
  CheckPlan(*model, 4, true);
  return 0;
}
