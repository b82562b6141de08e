// Internal: added/special token matching shared by ByteTokenizer and BpeTokenizer, following
// Hugging Face tokenizers' AddedVocabulary::find_matches. Not a public API.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace grpo::common::internal {

// One added token as in tokenizer.json's "added_tokens" array.
struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool single_word = false;  // match only when not inside a word (\w on either side)
  bool lstrip = false;       // the match swallows whitespace on its left
  bool rstrip = false;       // the match swallows whitespace on its right
  bool normalized = false;   // matched against normalised text (else against the raw input)
  bool special = false;      // skipped by Decode(skip_special_tokens=true)
};

// A piece of the input: [begin, end) bytes; token_id is the added token's id, or -1 for text
// that still needs tokenising.
struct TextSegment {
  size_t begin = 0;
  size_t end = 0;
  int32_t token_id = -1;
};

// Finds added tokens in text: non-overlapping leftmost-longest matches, then the single_word,
// lstrip and rstrip rules. Immutable after construction, so safe to share between threads.
class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  // tokens: the tokens this matcher looks for; `content` is what is searched for (callers pass
  // the normalised content for normalized tokens). Empty contents are ignored.
  explicit AddedTokenMatcher(std::vector<AddedToken> tokens);

  bool empty() const { return tokens_.empty(); }

  // Appends segments covering text exactly (text segments are never empty).
  void Split(std::string_view text, std::vector<TextSegment>* out) const;

 private:
  std::vector<AddedToken> tokens_;
  // Indices into tokens_ by first byte, longest content first.
  std::array<std::vector<int32_t>, 256> by_first_byte_;
};

}  // namespace grpo::common::internal
