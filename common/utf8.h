// UTF-8 validation and decoding, strict (no overlong forms, surrogates or code points above
// U+10FFFF), shared by the tokenizers (common/tokenizer/) and the config (config values must be
// UTF-8: they go into JSON). Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace grpo::common::internal {

// Decodes one UTF-8 sequence at s[0..n). On success stores the code point and returns its
// length (1-4). On an ill-formed sequence returns -k, where k >= 1 is the length of its maximal
// subpart (the bytes that one U+FFFD replaces, as in Unicode's "best practice" and Rust's
// String::from_utf8_lossy). Requires n >= 1.
int DecodeUtf8(const unsigned char* s, size_t n, char32_t* code_point);

// Appends the UTF-8 encoding of a valid code point.
void AppendUtf8(char32_t code_point, std::string* out);

// The byte offset of the first ill-formed UTF-8 sequence in text, or nullopt if text is valid.
std::optional<size_t> FindInvalidUtf8(std::string_view text);

// text with every ill-formed sequence replaced by U+FFFD (Rust's from_utf8_lossy).
std::string Utf8Lossy(std::string_view text);

}  // namespace grpo::common::internal
