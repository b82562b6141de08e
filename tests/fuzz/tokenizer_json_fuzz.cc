// libFuzzer target: tokenizer.json (common/tokenizer/bpe_tokenizer.h), read from every model
// directory a user points the learner or a worker at. Any input must give a tokenizer or a
// Status, never a crash or undefined behaviour; an accepted tokenizer must encode and decode a
// fixed text (special tokens included) without crashing, and its ids must decode.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/tokenizer/bpe_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto tokenizer = grpo::common::BpeTokenizer::FromJson(text, "<fuzz>");
  if (!tokenizer.ok()) return 0;
  for (std::string_view sample : {"hello world", " <|im_end|>\n\xC3\xA9 12 ab", ""}) {
    auto ids = (*tokenizer)->Encode(sample);
    if (!ids.ok()) continue;
    (void)(*tokenizer)->Decode(*ids, /*skip_special_tokens=*/false);
  }
  return 0;
}
