#include "common/tokenizer/added_tokens.h"

#include <unicode/uchar.h>

#include <algorithm>

#include "common/tokenizer/tokenizer_util.h"

namespace grpo::common::internal {
namespace {

// Rust regex's Unicode \w: Alphabetic, marks, decimal digits, connector punctuation, joiners.
bool IsWordChar(char32_t c) {
  if (c < 0x80)
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  if (u_hasBinaryProperty(c, UCHAR_ALPHABETIC) || u_hasBinaryProperty(c, UCHAR_JOIN_CONTROL)) {
    return true;
  }
  const int8_t type = u_charType(c);
  return type == U_NON_SPACING_MARK || type == U_ENCLOSING_MARK ||
         type == U_COMBINING_SPACING_MARK || type == U_DECIMAL_DIGIT_NUMBER ||
         type == U_CONNECTOR_PUNCTUATION;
}

bool IsWhiteSpace(char32_t c) { return u_isUWhiteSpace(c); }

// The code point ending at byte `end` of valid UTF-8 text (end > 0).
char32_t CodePointBefore(std::string_view text, size_t end) {
  size_t begin = end - 1;
  while (begin > 0 && (static_cast<unsigned char>(text[begin]) & 0xC0) == 0x80) --begin;
  char32_t cp = 0xFFFD;
  DecodeUtf8(reinterpret_cast<const unsigned char*>(text.data()) + begin, end - begin, &cp);
  return cp;
}

// The code point starting at byte `begin` and its length (begin < text.size()).
char32_t CodePointAt(std::string_view text, size_t begin, int* len) {
  char32_t cp = 0xFFFD;
  const int n = DecodeUtf8(reinterpret_cast<const unsigned char*>(text.data()) + begin,
                           text.size() - begin, &cp);
  *len = n > 0 ? n : 1;
  return cp;
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(std::vector<AddedToken> tokens) {
  for (AddedToken& t : tokens) {
    if (!t.content.empty()) tokens_.push_back(std::move(t));
  }
  for (size_t i = 0; i < tokens_.size(); ++i) {
    by_first_byte_[static_cast<unsigned char>(tokens_[i].content[0])].push_back(
        static_cast<int32_t>(i));
  }
  for (auto& list : by_first_byte_) {
    std::stable_sort(list.begin(), list.end(), [&](int32_t a, int32_t b) {
      return tokens_[a].content.size() > tokens_[b].content.size();
    });
  }
}

void AddedTokenMatcher::Split(std::string_view text, std::vector<TextSegment>* out) const {
  size_t start_offset = 0;  // end of the last emitted segment
  size_t i = 0;
  while (i < text.size()) {
    const auto& candidates = by_first_byte_[static_cast<unsigned char>(text[i])];
    const AddedToken* match = nullptr;
    for (int32_t idx : candidates) {
      const std::string& c = tokens_[idx].content;
      if (text.compare(i, c.size(), c) == 0) {
        match = &tokens_[idx];
        break;  // longest first
      }
    }
    if (match == nullptr) {
      ++i;
      continue;
    }
    size_t start = i;
    size_t stop = i + match->content.size();
    i = stop;                            // matches never overlap, even when one is discarded below
    if (start < start_offset) continue;  // swallowed by a previous token's rstrip
    if (match->single_word) {
      const bool start_ok = start == 0 || !IsWordChar(CodePointBefore(text, start));
      int len;
      const bool stop_ok = stop == text.size() || !IsWordChar(CodePointAt(text, stop, &len));
      if (!start_ok || !stop_ok) continue;
    }
    if (match->lstrip) {
      while (start > start_offset && IsWhiteSpace(CodePointBefore(text, start))) {
        --start;  // back to the first byte of that code point
        while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
      }
    }
    if (match->rstrip) {
      while (stop < text.size()) {
        int len;
        if (!IsWhiteSpace(CodePointAt(text, stop, &len))) break;
        stop += len;
      }
      i = stop;
    }
    if (start_offset < start) out->push_back({start_offset, start, -1});
    out->push_back({start, stop, match->id});
    start_offset = stop;
  }
  if (start_offset < text.size()) out->push_back({start_offset, text.size(), -1});
}

}  // namespace grpo::common::internal
