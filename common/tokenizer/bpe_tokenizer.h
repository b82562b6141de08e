// BpeTokenizer: Hugging Face tokenizer.json byte-level BPE (Qwen2/Qwen3, Llama-3, GPT-2).
// Supported pipeline: normalizer null/NFC/NFD/NFKC/NFKD/Sequence (ICU); pre_tokenizer null/
// Split/ByteLevel/Sequence (PCRE2, ByteLevel last); model BPE (merges as "a b" or ["a","b"],
// ignore_merges, unk_token, fuse_unk, byte_fallback, continuing_subword_prefix,
// end_of_word_suffix); decoder null/ByteLevel; added tokens with lstrip/rstrip/single_word/
// normalized. The post_processor is kept for Save but never applied (Encode adds no BOS/EOS).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/tokenizer/tokenizer.h"

namespace grpo::common {

// The model vocabulary's ids index a dense table: an id more than this past the number of vocab
// entries is refused (InvalidArgument) rather than allocated.
inline constexpr size_t kMaxVocabIdGap = 1 << 16;

// Immutable after construction (apart from SetEosToken/SetPadToken); thread-safe.
class BpeTokenizer final : public Tokenizer {
 public:
  // Parses tokenizer.json contents; `source` (usually the path) prefixes every error message.
  // InvalidArgument for bad JSON or inconsistent contents, Unimplemented for unsupported types.
  static StatusOr<std::unique_ptr<BpeTokenizer>> FromJson(std::string_view json,
                                                          std::string_view source);
  static StatusOr<std::unique_ptr<BpeTokenizer>> FromFile(const std::string& path);
  ~BpeTokenizer() override;

  // Replace the default eos/pad token (see LoadTokenizer); NotFound if token is not in the
  // vocabulary. Not thread-safe: call before sharing the tokenizer.
  Status SetEosToken(std::string_view token);
  Status SetPadToken(std::string_view token);

  StatusOr<std::vector<int32_t>> Encode(std::string_view text) const override;
  int64_t vocab_size() const override;
  std::optional<int32_t> TokenToId(std::string_view token) const override;
  std::optional<std::string> IdToToken(int32_t id) const override;
  std::optional<int32_t> eos_token_id() const override;
  std::optional<int32_t> pad_token_id() const override;
  Status Save(const std::string& path) const override;

 protected:
  StatusOr<std::string> DecodeImpl(const std::vector<int32_t>& ids,
                                   bool skip_special_tokens) const override;

 private:
  struct Impl;
  explicit BpeTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace grpo::common
