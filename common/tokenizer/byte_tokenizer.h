// ByteTokenizer: ids 0..255 are the UTF-8 bytes of the text, then the special tokens
// <|endoftext|> (256, also pad), <|im_start|> (257) and <|im_end|> (258, eos). For tiny models
// and tests: no vocabulary file, and any text round-trips exactly.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/tokenizer/added_tokens.h"
#include "common/tokenizer/tokenizer.h"

namespace grpo::common {

// Immutable; thread-safe.
class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int32_t kEndOfTextId = 256;
  static constexpr int32_t kImStartId = 257;
  static constexpr int32_t kImEndId = 258;
  static constexpr int64_t kVocabSize = 259;

  ByteTokenizer();

  StatusOr<std::vector<int32_t>> Encode(std::string_view text) const override;
  int64_t vocab_size() const override { return kVocabSize; }
  std::optional<int32_t> TokenToId(std::string_view token) const override;
  std::optional<std::string> IdToToken(int32_t id) const override;
  std::optional<int32_t> eos_token_id() const override { return kImEndId; }
  std::optional<int32_t> pad_token_id() const override { return kEndOfTextId; }
  // A BPE tokenizer.json (byte-level vocabulary, no merges, the specials as added tokens) that
  // LoadTokenizer turns into a BpeTokenizer giving the same ids.
  Status Save(const std::string& path) const override;

 protected:
  StatusOr<std::string> DecodeImpl(const std::vector<int32_t>& ids,
                                   bool skip_special_tokens) const override;

 private:
  std::vector<internal::AddedToken> specials_;  // index = id - 256
  internal::AddedTokenMatcher matcher_;
};

}  // namespace grpo::common
