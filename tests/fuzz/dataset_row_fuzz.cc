// libFuzzer target: one dataset line (common/tokenizer/dataset_row.h), what `SubmitDataset` takes
// from any client: JSON parsing, the row schema and the ChatML template. Any input must give a
// prompt text or an error, never a crash or undefined behaviour; the verdicts must agree
// (ValidateDatasetRow is OK exactly when PromptText is) and an accepted row's text is not empty.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string_view>

#include "common/tokenizer/dataset_row.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const nlohmann::json row = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (row.is_discarded()) return 0;
  auto prompt = grpo::common::PromptText(row);
  if (prompt.ok() != grpo::common::ValidateDatasetRow(row).ok()) std::abort();
  if (prompt.ok() && prompt->empty()) std::abort();
  return 0;
}
