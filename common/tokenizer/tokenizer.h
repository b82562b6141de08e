// Tokenizer: text <-> token ids, shared by the learner and the rollout workers.
// Implementations: ByteTokenizer (byte_tokenizer.h) for tiny test models and BpeTokenizer
// (bpe_tokenizer.h) for Hugging Face byte-level BPE tokenizer.json files (Qwen2/3, Llama-3,
// GPT-2). LoadTokenizer picks one from a file or model directory.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace grpo::common {

// Thread-safety: every const method may be called concurrently from any thread.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Token ids of text (UTF-8), added/special tokens written in the text (e.g. "<|im_end|>")
  // included as their ids. Never adds BOS/EOS or other post-processing tokens.
  // InvalidArgument if text is not valid UTF-8.
  virtual StatusOr<std::vector<int32_t>> Encode(std::string_view text) const = 0;

  // The text of ids; with skip_special_tokens, special tokens are left out. Byte sequences that
  // are not valid UTF-8 (e.g. a cut multi-byte character) become U+FFFD.
  // OutOfRange naming the first id that is not a token.
  StatusOr<std::string> Decode(const std::vector<int32_t>& ids,
                               bool skip_special_tokens = false) const {
    return DecodeImpl(ids, skip_special_tokens);
  }

  // One past the largest token id (the rows an embedding table needs), added tokens included.
  virtual int64_t vocab_size() const = 0;

  // The id of a token spelled as in the vocabulary (byte-level form, e.g. "Ġthe") or of an
  // added token (e.g. "<|im_end|>"); nullopt if there is none.
  virtual std::optional<int32_t> TokenToId(std::string_view token) const = 0;
  // The inverse of TokenToId; nullopt for ids that are not tokens.
  virtual std::optional<std::string> IdToToken(int32_t id) const = 0;

  // End-of-sequence (generation stops there) and padding ids; nullopt if the tokenizer has none.
  virtual std::optional<int32_t> eos_token_id() const = 0;
  virtual std::optional<int32_t> pad_token_id() const = 0;

  // Writes a Hugging Face compatible tokenizer.json to path (replaced atomically).
  // Internal (naming the path) if it cannot be written.
  virtual Status Save(const std::string& path) const = 0;

 protected:
  virtual StatusOr<std::string> DecodeImpl(const std::vector<int32_t>& ids,
                                           bool skip_special_tokens) const = 0;
};

// Loads a tokenizer from a tokenizer.json file or a model directory holding one. The eos and pad
// tokens come from tokenizer_config.json beside it when present, else from defaults
// (<|im_end|>, <|eot_id|>, <|endoftext|>, <|end_of_text|>, </s>: the first in the vocabulary;
// pad falls back to <|endoftext|>, then eos). Errors name the file and the problem: NotFound,
// InvalidArgument (bad JSON, bad merges, unknown tokens), Unimplemented (unsupported types).
StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& path);

}  // namespace grpo::common
