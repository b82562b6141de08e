#include "common/tokenizer/tokenizer_util.h"

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace grpo::common::internal {
namespace {

struct ByteLevelTables {
  std::array<char32_t, 256> byte_to_unicode{};
  std::array<std::string, 256> byte_to_utf8;
  std::array<int16_t, 0x144> unicode_to_byte{};  // every mapped character is < U+0144

  ByteLevelTables() {
    unicode_to_byte.fill(-1);
    int next_extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      const char32_t cp = printable ? static_cast<char32_t>(b) : 0x100 + next_extra++;
      byte_to_unicode[b] = cp;
      AppendUtf8(cp, &byte_to_utf8[b]);
      unicode_to_byte[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteLevelTables& Tables() {
  static const ByteLevelTables tables;
  return tables;
}

}  // namespace

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

char32_t ByteToUnicode(uint8_t byte) { return Tables().byte_to_unicode[byte]; }

const std::string& ByteLevelChar(uint8_t byte) { return Tables().byte_to_utf8[byte]; }

std::optional<uint8_t> UnicodeToByte(char32_t cp) {
  if (cp >= Tables().unicode_to_byte.size()) return std::nullopt;
  const int16_t b = Tables().unicode_to_byte[cp];
  if (b < 0) return std::nullopt;
  return static_cast<uint8_t>(b);
}

void AppendByteLevel(std::string_view bytes, std::string* out) {
  const ByteLevelTables& t = Tables();
  for (unsigned char b : bytes) out->append(t.byte_to_utf8[b]);
}

StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound(path + ": cannot open: " + std::strerror(errno));
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return Status::Internal(path + ": read failed");
  return std::move(buffer).str();
}

Status WriteFileAtomically(const std::string& path, std::string_view contents) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return Status::Internal(tmp + ": cannot open for writing: " + std::strerror(errno));
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    out.flush();
    if (!out) return Status::Internal(tmp + ": write failed");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = std::strerror(errno);
    std::remove(tmp.c_str());
    return Status::Internal(path + ": cannot rename " + tmp + " over it: " + err);
  }
  return Status::OK();
}

}  // namespace grpo::common::internal
