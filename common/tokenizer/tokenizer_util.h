// Internal helpers shared by the tokenizers (UTF-8 validation and decoding: common/utf8.h), the
// GPT-2 ByteLevel byte <-> unicode-character mapping used by Hugging Face byte-level BPE, and file
// I/O. Not a public API; everything here is thread-safe (pure functions over constant tables).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"
#include "common/utf8.h"

namespace grpo::common::internal {

// GPT-2 bytes_to_unicode(): printable Latin-1 bytes map to themselves, the other 68 bytes to
// U+0100.. in byte order. ByteLevelChar(b) is the UTF-8 of that character.
char32_t ByteToUnicode(uint8_t byte);
const std::string& ByteLevelChar(uint8_t byte);
// The inverse mapping; nullopt for characters that no byte maps to.
std::optional<uint8_t> UnicodeToByte(char32_t code_point);

// Appends the byte-level string of raw bytes (each byte replaced by ByteLevelChar).
void AppendByteLevel(std::string_view bytes, std::string* out);

// The whole file; NotFound or Internal naming path.
StatusOr<std::string> ReadFileToString(const std::string& path);

}  // namespace grpo::common::internal
