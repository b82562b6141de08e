#include "common/utf8.h"

namespace grpo::common::internal {

int DecodeUtf8(const unsigned char* s, size_t n, char32_t* code_point) {
  const unsigned char c = s[0];
  if (c < 0x80) {
    *code_point = c;
    return 1;
  }
  int need;
  char32_t value;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    need = 1;
    value = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    value = c & 0x0F;
    if (c == 0xE0) lo = 0xA0;  // no overlong forms
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    value = c & 0x07;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;  // <= U+10FFFF
  } else {
    return -1;
  }
  for (int k = 1; k <= need; ++k) {
    if (static_cast<size_t>(k) >= n) return -k;
    const unsigned char b = s[k];
    if (b < lo || b > hi) return -k;
    lo = 0x80;
    hi = 0xBF;
    value = (value << 6) | (b & 0x3F);
  }
  *code_point = value;
  return need + 1;
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::optional<size_t> FindInvalidUtf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    if (s[i] < 0x80) {
      ++i;
      continue;
    }
    char32_t cp;
    const int len = DecodeUtf8(s + i, n - i, &cp);
    if (len < 0) return i;
    i += len;
  }
  return std::nullopt;
}

std::string Utf8Lossy(std::string_view text) {
  if (!FindInvalidUtf8(text).has_value()) return std::string(text);
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  std::string out;
  out.reserve(n + 8);
  size_t i = 0;
  while (i < n) {
    char32_t cp;
    const int len = DecodeUtf8(s + i, n - i, &cp);
    if (len > 0) {
      out.append(text.substr(i, len));
      i += len;
    } else {
      out.append("\xEF\xBF\xBD");  // U+FFFD
      i += -len;
    }
  }
  return out;
}

}  // namespace grpo::common::internal
