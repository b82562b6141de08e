// libFuzzer target: the YAML config (common/config.h ParseConfigYaml), what `--config` files and
// the container's mounted config.yaml feed the learner and workers. Any input must give a config
// or a Status, never a crash, a leak or undefined behaviour; a config that parses and validates
// must survive its own JSON round trip (ToJson, then parsed back as YAML: JSON is YAML).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto config = grpo::common::ParseConfigYaml(text, "<fuzz>");
  if (!config.ok()) return 0;
  if (!config->Validate().ok()) return 0;
  const std::string json = config->ToJson().dump();
  auto again = grpo::common::ParseConfigYaml(json, "<round trip>");
  if (!again.ok() || again->ToJson() != config->ToJson()) std::abort();
  return 0;
}
