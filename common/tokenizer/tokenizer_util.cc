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

}  // namespace grpo::common::internal
