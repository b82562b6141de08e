#include "common/tokenizer/bpe_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>

#include <algorithm>
#include <array>
#include <functional>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <utility>

#include "common/atomic_file.h"
#include "common/tokenizer/added_tokens.h"
#include "common/tokenizer/tokenizer_util.h"

namespace grpo::common {
namespace {

using Json = nlohmann::json;
using internal::AddedToken;
using internal::TextSegment;

// The regex ByteLevel uses when use_regex is true (GPT-2's).
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string Quote(std::string_view s) {
  std::string quoted;
  quoted.reserve(s.size() + 2);
  quoted.push_back('\'');
  quoted.append(s);
  quoted.push_back('\'');
  return quoted;
}

bool IsAscii(std::string_view s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  }
  return true;
}

// A compiled PCRE2 pattern (UTF, UCP, JIT when available). Immutable; matching is thread-safe
// given a per-call match data block.
class Regex {
 public:
  static StatusOr<std::unique_ptr<Regex>> Compile(std::string_view pattern, bool literal) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    const uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     options, &error, &offset, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR buffer[256];
      pcre2_get_error_message(error, buffer, sizeof(buffer));
      return Status::InvalidArgument("bad regex " + Quote(pattern) + " at offset " +
                                     std::to_string(offset) + ": " +
                                     reinterpret_cast<const char*>(buffer));
    }
    const bool jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
    return std::unique_ptr<Regex>(new Regex(code, jit));
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends the [begin, end) offsets of the non-empty, non-overlapping matches in subject
  // (valid UTF-8), leftmost first. match_data needs one ovector pair.
  Status FindAll(std::string_view subject, pcre2_match_data* match_data,
                 std::vector<std::pair<size_t, size_t>>* out) const {
    const auto* s = reinterpret_cast<PCRE2_SPTR>(subject.data());
    const size_t n = subject.size();
    size_t offset = 0;
    while (offset < n) {
      int rc = jit_ ? pcre2_jit_match(code_, s, n, offset, 0, match_data, nullptr)
                    : PCRE2_ERROR_JIT_BADOPTION;
      if (rc == PCRE2_ERROR_JIT_STACKLIMIT || rc == PCRE2_ERROR_JIT_BADOPTION) {
        rc = pcre2_match(code_, s, n, offset, PCRE2_NO_UTF_CHECK | (jit_ ? PCRE2_NO_JIT : 0),
                         match_data, nullptr);
      }
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR buffer[256];
        pcre2_get_error_message(rc, buffer, sizeof(buffer));
        return Status::Internal(std::string("regex match failed: ") +
                                reinterpret_cast<const char*>(buffer));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(match_data);
      const size_t begin = ov[0], end = ov[1];
      if (end > begin) {
        out->emplace_back(begin, end);
        offset = end;
      } else {  // empty match: step over one code point
        offset = end + 1;
        while (offset < n && (static_cast<unsigned char>(subject[offset]) & 0xC0) == 0x80) ++offset;
      }
    }
    return Status::OK();
  }

 private:
  Regex(pcre2_code* code, bool jit) : code_(code), jit_(jit) {}
  pcre2_code* code_;
  bool jit_;
};

struct MatchDataDeleter {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};
using MatchDataPtr = std::unique_ptr<pcre2_match_data, MatchDataDeleter>;

// Hugging Face SplitDelimiterBehavior.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct SplitStage {
  std::unique_ptr<Regex> regex;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
};

// Merge table: (left id, right id) -> (rank, merged id). Open addressing over 64-bit keys.
class PairMap {
 public:
  struct Entry {
    uint64_t key = kEmpty;
    int32_t rank = 0;
    int32_t new_id = 0;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};

  void Reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    table_.assign(cap, Entry{});
    mask_ = cap - 1;
  }
  // Later inserts of the same pair overwrite (last rank wins, as in HF and transformers.js).
  void Insert(int32_t a, int32_t b, int32_t rank, int32_t new_id) {
    const uint64_t key = Key(a, b);
    size_t i = Hash(key);
    while (table_[i].key != kEmpty && table_[i].key != key) i = (i + 1) & mask_;
    table_[i] = {key, rank, new_id};
  }
  const Entry* Find(int32_t a, int32_t b) const {
    const uint64_t key = Key(a, b);
    size_t i = Hash(key);
    while (true) {
      const Entry& e = table_[i];
      if (e.key == key) return &e;
      if (e.key == kEmpty) return nullptr;
      i = (i + 1) & mask_;
    }
  }

 private:
  static uint64_t Key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  size_t Hash(uint64_t key) const {
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> 20) & mask_;
  }
  std::vector<Entry> table_;
  size_t mask_ = 0;
};

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// Per-Encode scratch space, so that Encode needs no shared mutable state.
struct EncodeScratch {
  MatchDataPtr match_data{pcre2_match_data_create(1, nullptr)};
  std::vector<std::pair<size_t, size_t>> matches;
  struct Run {
    size_t begin;
    size_t end;
    bool is_match;
  };
  std::vector<Run> runs;
  std::vector<std::string_view> pieces, next_pieces, words;
  std::vector<int32_t> symbols, prev, next;
  std::vector<uint8_t> alive;
  struct HeapItem {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
  };
  std::vector<HeapItem> heap;
  std::string word;
  std::string prefixed;
};

Status Unsupported(std::string_view what, const Json& node) {
  std::string type = node.is_object() && node.contains("type") && node["type"].is_string()
                         ? node["type"].get<std::string>()
                         : node.dump();
  return Status::Unimplemented("unsupported " + std::string(what) + " type " + Quote(type));
}

std::string TypeOf(const Json& node) {
  if (node.is_object() && node.contains("type") && node["type"].is_string()) {
    return node["type"].get<std::string>();
  }
  return "";
}

bool BoolOr(const Json& node, const char* key, bool fallback) {
  if (!node.is_object() || !node.contains(key) || node[key].is_null()) return fallback;
  return node[key].get<bool>();
}

std::string StringOr(const Json& node, const char* key, std::string fallback) {
  if (!node.is_object() || !node.contains(key) || node[key].is_null()) return fallback;
  return node[key].get<std::string>();
}

}  // namespace

struct BpeTokenizer::Impl {
  // Pass-through sections, kept for Save.
  Json normalizer_json, pre_tokenizer_json, post_processor_json, decoder_json;

  // Model.
  std::vector<std::string> id_to_token;  // model vocabulary; "" marks a hole
  std::vector<uint8_t> has_token;
  TokenMap token_to_id;
  std::vector<std::pair<int32_t, int32_t>> merges;  // by rank
  PairMap merge_map;
  std::optional<std::string> unk_token;
  std::optional<int32_t> unk_id;
  std::string continuing_subword_prefix, end_of_word_suffix;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
  std::array<int32_t, 256> byte_fallback_ids{};  // id of "<0xAB>" or -1

  // Added tokens.
  std::vector<AddedToken> added;
  std::unordered_map<int32_t, size_t> added_by_id;
  TokenMap added_by_content;
  internal::AddedTokenMatcher raw_matcher, normalized_matcher;
  int64_t vocab_size = 0;

  // Pipeline.
  std::vector<const icu::Normalizer2*> normalizers;
  std::vector<SplitStage> splits;
  bool byte_level = false, add_prefix_space = false;
  std::unique_ptr<Regex> byte_level_regex;  // when use_regex
  bool byte_level_decoder = false;
  std::array<int32_t, 256> byte_ids{};  // id of each ByteLevel character
  bool byte_fast_path = false;

  std::optional<int32_t> eos_id, pad_id;

  Status ParseNormalizer(const Json& node);
  Status ParsePreTokenizer(const Json& node);
  Status ParseModel(const Json& node);
  Status ParseAddedTokens(const Json& node);
  Status ParseDecoder(const Json& node);

  std::optional<int32_t> Lookup(std::string_view token) const {
    auto it = token_to_id.find(token);
    if (it == token_to_id.end()) return std::nullopt;
    return it->second;
  }

  StatusOr<std::string_view> Normalize(std::string_view text, std::string* storage) const;
  Status EncodeSection(std::string_view text, EncodeScratch* s, std::vector<int32_t>* ids) const;
  Status PreTokenizeAndEncode(std::string_view text, EncodeScratch* s,
                              std::vector<int32_t>* ids) const;
  void EncodeWord(std::string_view raw, EncodeScratch* s, std::vector<int32_t>* ids) const;
  void EncodeWordGeneral(std::string_view word, EncodeScratch* s, std::vector<int32_t>* ids) const;
  void MergeSymbols(EncodeScratch* s, std::vector<int32_t>* ids) const;
};

// ---- Parsing -----------------------------------------------------------------------------------

Status BpeTokenizer::Impl::ParseNormalizer(const Json& node) {
  if (node.is_null()) return Status::OK();
  const std::string type = TypeOf(node);
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = nullptr;
  if (type == "Sequence") {
    if (!node.contains("normalizers") || !node["normalizers"].is_array()) {
      return Status::InvalidArgument("normalizer Sequence has no 'normalizers' array");
    }
    for (const Json& child : node["normalizers"]) RETURN_IF_ERROR(ParseNormalizer(child));
    return Status::OK();
  } else if (type == "NFC") {
    n = icu::Normalizer2::getNFCInstance(status);
  } else if (type == "NFD") {
    n = icu::Normalizer2::getNFDInstance(status);
  } else if (type == "NFKC") {
    n = icu::Normalizer2::getNFKCInstance(status);
  } else if (type == "NFKD") {
    n = icu::Normalizer2::getNFKDInstance(status);
  } else {
    return Unsupported("normalizer", node);
  }
  if (U_FAILURE(status) || n == nullptr) {
    return Status::Internal("ICU " + type + " normalizer unavailable: " + u_errorName(status));
  }
  normalizers.push_back(n);
  return Status::OK();
}

Status BpeTokenizer::Impl::ParsePreTokenizer(const Json& node) {
  if (node.is_null()) return Status::OK();
  const std::string type = TypeOf(node);
  if (byte_level) {
    return Status::Unimplemented("pre_tokenizer " + Quote(type) +
                                 " after ByteLevel is not supported (ByteLevel must be last)");
  }
  if (type == "Sequence") {
    if (!node.contains("pretokenizers") || !node["pretokenizers"].is_array()) {
      return Status::InvalidArgument("pre_tokenizer Sequence has no 'pretokenizers' array");
    }
    for (const Json& child : node["pretokenizers"]) RETURN_IF_ERROR(ParsePreTokenizer(child));
    return Status::OK();
  }
  if (type == "ByteLevel") {
    byte_level = true;
    add_prefix_space = BoolOr(node, "add_prefix_space", true);
    if (BoolOr(node, "use_regex", true)) {
      ASSIGN_OR_RETURN(byte_level_regex, Regex::Compile(kGpt2Pattern, /*literal=*/false));
    }
    return Status::OK();
  }
  if (type == "Split") {
    SplitStage stage;
    const Json& pattern = node.contains("pattern") ? node["pattern"] : Json();
    if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
      auto regex = Regex::Compile(pattern["Regex"].get<std::string>(), /*literal=*/false);
      if (!regex.ok()) return regex.status().WithContext("pre_tokenizer Split");
      stage.regex = std::move(regex).value();
    } else if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string()) {
      const std::string literal = pattern["String"].get<std::string>();
      if (literal.empty())
        return Status::InvalidArgument("pre_tokenizer Split: empty String pattern");
      ASSIGN_OR_RETURN(stage.regex, Regex::Compile(literal, /*literal=*/true));
    } else {
      return Status::InvalidArgument(
          "pre_tokenizer Split: 'pattern' must be {\"Regex\": ...} or "
          "{\"String\": ...}, got " +
          pattern.dump());
    }
    const std::string behavior = StringOr(node, "behavior", "Isolated");
    if (behavior == "Removed") {
      stage.behavior = SplitBehavior::kRemoved;
    } else if (behavior == "Isolated") {
      stage.behavior = SplitBehavior::kIsolated;
    } else if (behavior == "MergedWithPrevious") {
      stage.behavior = SplitBehavior::kMergedWithPrevious;
    } else if (behavior == "MergedWithNext") {
      stage.behavior = SplitBehavior::kMergedWithNext;
    } else if (behavior == "Contiguous") {
      stage.behavior = SplitBehavior::kContiguous;
    } else {
      return Status::Unimplemented("pre_tokenizer Split: unsupported behavior " + Quote(behavior));
    }
    stage.invert = BoolOr(node, "invert", false);
    splits.push_back(std::move(stage));
    return Status::OK();
  }
  return Unsupported("pre_tokenizer", node);
}

Status BpeTokenizer::Impl::ParseModel(const Json& node) {
  if (!node.is_object()) return Status::InvalidArgument("'model' is missing or not an object");
  const std::string type = TypeOf(node);
  if (!(type == "BPE" || (type.empty() && node.contains("merges")))) {
    return Unsupported("model", node);
  }
  if (node.contains("dropout") && !node["dropout"].is_null() &&
      node["dropout"].get<double>() > 0.0) {
    return Status::Unimplemented("model BPE: dropout is not supported");
  }
  if (!node.contains("vocab") || !node["vocab"].is_object()) {
    return Status::InvalidArgument("model BPE: 'vocab' is missing or not an object");
  }
  const Json& vocab = node["vocab"];
  token_to_id.reserve(vocab.size() * 2);
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
        it.value().get<int64_t>() >= INT32_MAX) {
      return Status::InvalidArgument("model BPE: vocab entry " + Quote(it.key()) +
                                     " has a bad id " + it.value().dump());
    }
    const auto id = static_cast<int32_t>(it.value().get<int64_t>());
    // The id table is dense: one id far past the entry count would allocate gigabytes (found by
    // tests/fuzz/tokenizer_json_fuzz.cc: one id of 66,666,661 in a 45-entry vocabulary).
    if (static_cast<size_t>(id) >= vocab.size() + kMaxVocabIdGap) {
      return Status::InvalidArgument("model BPE: vocab entry " + Quote(it.key()) + " has id " +
                                     std::to_string(id) + ", more than " +
                                     std::to_string(kMaxVocabIdGap) + " past the vocabulary's " +
                                     std::to_string(vocab.size()) + " entries (ids must be dense)");
    }
    if (static_cast<size_t>(id) >= id_to_token.size()) {
      id_to_token.resize(id + 1);
      has_token.resize(id + 1, 0);
    }
    if (has_token[id]) {
      return Status::InvalidArgument("model BPE: vocab id " + std::to_string(id) +
                                     " is used by both " + Quote(id_to_token[id]) + " and " +
                                     Quote(it.key()));
    }
    id_to_token[id] = it.key();
    has_token[id] = 1;
    token_to_id.emplace(it.key(), id);
  }

  continuing_subword_prefix = StringOr(node, "continuing_subword_prefix", "");
  end_of_word_suffix = StringOr(node, "end_of_word_suffix", "");
  fuse_unk = BoolOr(node, "fuse_unk", false);
  byte_fallback = BoolOr(node, "byte_fallback", false);
  ignore_merges = BoolOr(node, "ignore_merges", false);
  if (node.contains("unk_token") && !node["unk_token"].is_null()) {
    unk_token = node["unk_token"].get<std::string>();
    unk_id = Lookup(*unk_token);
    if (!unk_id) {
      return Status::InvalidArgument("model BPE: unk_token " + Quote(*unk_token) +
                                     " is not in the vocabulary");
    }
  }
  static const char kHex[] = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) {
    const std::string name = std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">";
    byte_fallback_ids[b] = Lookup(name).value_or(-1);
  }

  if (!node.contains("merges") || !node["merges"].is_array()) {
    return Status::InvalidArgument("model BPE: 'merges' is missing or not an array");
  }
  const Json& merge_list = node["merges"];
  merges.reserve(merge_list.size());
  merge_map.Reserve(merge_list.size());
  for (size_t rank = 0; rank < merge_list.size(); ++rank) {
    const Json& m = merge_list[rank];
    std::string a, b;
    if (m.is_string()) {  // "a b" (tokenizers < 0.20)
      const std::string line = m.get<std::string>();
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        return Status::InvalidArgument("model BPE: merges[" + std::to_string(rank) + "] " +
                                       Quote(line) + " is not two tokens separated by one space");
      }
      a = line.substr(0, space);
      b = line.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      return Status::InvalidArgument("model BPE: merges[" + std::to_string(rank) + "] " + m.dump() +
                                     " is neither \"a b\" nor [\"a\", \"b\"]");
    }
    const auto a_id = Lookup(a), b_id = Lookup(b);
    for (const auto& [part, id] : {std::pair{&a, a_id}, std::pair{&b, b_id}}) {
      if (!id) {
        return Status::InvalidArgument("model BPE: merges[" + std::to_string(rank) + "] uses " +
                                       Quote(*part) + ", which is not in the vocabulary");
      }
    }
    const size_t prefix = continuing_subword_prefix.size();
    if (b.compare(0, prefix, continuing_subword_prefix) != 0) {
      return Status::InvalidArgument("model BPE: merges[" + std::to_string(rank) +
                                     "]: " + Quote(b) + " lacks the continuing_subword_prefix");
    }
    const std::string merged = a + b.substr(prefix);
    const auto new_id = Lookup(merged);
    if (!new_id) {
      return Status::InvalidArgument("model BPE: merges[" + std::to_string(rank) + "] makes " +
                                     Quote(merged) + ", which is not in the vocabulary");
    }
    merges.emplace_back(*a_id, *b_id);
    merge_map.Insert(*a_id, *b_id, static_cast<int32_t>(rank), *new_id);
  }
  return Status::OK();
}

Status BpeTokenizer::Impl::ParseAddedTokens(const Json& node) {
  if (node.is_null()) return Status::OK();
  if (!node.is_array()) return Status::InvalidArgument("'added_tokens' is not an array");
  std::vector<AddedToken> raw, normalized;
  for (size_t i = 0; i < node.size(); ++i) {
    const Json& t = node[i];
    if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() ||
        !t.contains("content") || !t["content"].is_string() || t["id"].get<int64_t>() < 0 ||
        t["id"].get<int64_t>() >= INT32_MAX) {
      return Status::InvalidArgument("added_tokens[" + std::to_string(i) +
                                     "] needs an integer 'id' >= 0 and a string 'content'");
    }
    AddedToken token;
    token.id = static_cast<int32_t>(t["id"].get<int64_t>());
    token.content = t["content"].get<std::string>();
    token.special = BoolOr(t, "special", false);
    token.single_word = BoolOr(t, "single_word", false);
    token.lstrip = BoolOr(t, "lstrip", false);
    token.rstrip = BoolOr(t, "rstrip", false);
    token.normalized = BoolOr(t, "normalized", !token.special);
    if (added_by_id.count(token.id)) {
      return Status::InvalidArgument("added_tokens[" + std::to_string(i) + "]: id " +
                                     std::to_string(token.id) + " appears twice");
    }
    added_by_id[token.id] = added.size();
    added_by_content.emplace(token.content, token.id);
    added.push_back(token);
  }
  for (const AddedToken& t : added) {
    if (!t.normalized || normalizers.empty()) {
      raw.push_back(t);
      continue;
    }
    AddedToken n = t;  // matched in normalised text by its normalised content
    std::string storage;
    ASSIGN_OR_RETURN(std::string_view content, Normalize(t.content, &storage));
    n.content = std::string(content);
    normalized.push_back(std::move(n));
  }
  raw_matcher = internal::AddedTokenMatcher(std::move(raw));
  normalized_matcher = internal::AddedTokenMatcher(std::move(normalized));
  return Status::OK();
}

Status BpeTokenizer::Impl::ParseDecoder(const Json& node) {
  if (node.is_null()) return Status::OK();
  if (TypeOf(node) == "ByteLevel") {
    byte_level_decoder = true;
    return Status::OK();
  }
  return Unsupported("decoder", node);
}

// ---- Encoding ----------------------------------------------------------------------------------

StatusOr<std::string_view> BpeTokenizer::Impl::Normalize(std::string_view text,
                                                         std::string* storage) const {
  if (normalizers.empty() || IsAscii(text)) return text;  // all four forms keep ASCII as is
  std::string_view current = text;
  for (const icu::Normalizer2* n : normalizers) {
    UErrorCode status = U_ZERO_ERROR;
    const icu::StringPiece piece(current.data(), static_cast<int32_t>(current.size()));
    if (n->isNormalizedUTF8(piece, status) && U_SUCCESS(status)) continue;
    status = U_ZERO_ERROR;
    std::string out;
    icu::StringByteSink<std::string> sink(&out, static_cast<int32_t>(current.size()));
    n->normalizeUTF8(0, piece, sink, nullptr, status);
    if (U_FAILURE(status)) {
      return Status::Internal(std::string("ICU normalisation failed: ") + u_errorName(status));
    }
    *storage = std::move(out);
    current = *storage;
  }
  return current;
}

Status BpeTokenizer::Impl::EncodeSection(std::string_view text, EncodeScratch* s,
                                         std::vector<int32_t>* ids) const {
  std::string storage;
  ASSIGN_OR_RETURN(std::string_view normalized, Normalize(text, &storage));
  if (normalized_matcher.empty()) return PreTokenizeAndEncode(normalized, s, ids);
  std::vector<TextSegment> segments;
  normalized_matcher.Split(normalized, &segments);
  for (const TextSegment& seg : segments) {
    if (seg.token_id >= 0) {
      ids->push_back(seg.token_id);
    } else {
      RETURN_IF_ERROR(
          PreTokenizeAndEncode(normalized.substr(seg.begin, seg.end - seg.begin), s, ids));
    }
  }
  return Status::OK();
}

Status BpeTokenizer::Impl::PreTokenizeAndEncode(std::string_view text, EncodeScratch* s,
                                                std::vector<int32_t>* ids) const {
  if (text.empty()) return Status::OK();
  s->pieces.assign(1, text);
  for (const SplitStage& stage : splits) {
    s->next_pieces.clear();
    for (std::string_view piece : s->pieces) {
      s->matches.clear();
      RETURN_IF_ERROR(stage.regex->FindAll(piece, s->match_data.get(), &s->matches));
      // (range, is_match) runs covering piece, then HF's SplitDelimiterBehavior.
      s->runs.clear();
      size_t last = 0;
      for (const auto& [b, e] : s->matches) {
        if (b > last) s->runs.push_back({last, b, stage.invert});
        s->runs.push_back({b, e, !stage.invert});
        last = e;
      }
      if (last < piece.size()) s->runs.push_back({last, piece.size(), stage.invert});
      const size_t out_begin = s->next_pieces.size();
      auto part = [&](const EncodeScratch::Run& r) {
        return piece.substr(r.begin, r.end - r.begin);
      };
      auto extend_last = [&](const EncodeScratch::Run& r) {
        std::string_view& prev = s->next_pieces.back();
        prev = std::string_view(prev.data(), r.end - (prev.data() - piece.data()));
      };
      bool previous_match = false;
      switch (stage.behavior) {
        case SplitBehavior::kRemoved:
          for (const auto& r : s->runs) {
            if (!r.is_match) s->next_pieces.push_back(part(r));
          }
          break;
        case SplitBehavior::kIsolated:
          for (const auto& r : s->runs) s->next_pieces.push_back(part(r));
          break;
        case SplitBehavior::kMergedWithPrevious:  // a match joins the piece before it
          for (const auto& r : s->runs) {
            if (r.is_match && !previous_match && s->next_pieces.size() > out_begin) {
              extend_last(r);
            } else {
              s->next_pieces.push_back(part(r));
            }
            previous_match = r.is_match;
          }
          break;
        case SplitBehavior::kMergedWithNext:  // a match joins the piece after it
          for (size_t k = s->runs.size(); k-- > 0;) {
            const auto& r = s->runs[k];
            if (r.is_match && !previous_match && s->next_pieces.size() > out_begin) {
              std::string_view& following = s->next_pieces.back();
              following = piece.substr(
                  r.begin, following.data() + following.size() - (piece.data() + r.begin));
            } else {
              s->next_pieces.push_back(part(r));
            }
            previous_match = r.is_match;
          }
          std::reverse(s->next_pieces.begin() + out_begin, s->next_pieces.end());
          break;
        case SplitBehavior::kContiguous:  // runs of matches and of non-matches stay together
          for (const auto& r : s->runs) {
            if (r.is_match == previous_match && s->next_pieces.size() > out_begin) {
              extend_last(r);
            } else {
              s->next_pieces.push_back(part(r));
            }
            previous_match = r.is_match;
          }
          break;
      }
    }
    std::swap(s->pieces, s->next_pieces);
  }

  for (std::string_view piece : s->pieces) {
    if (piece.empty()) continue;
    if (!byte_level) {
      EncodeWordGeneral(piece, s, ids);
      continue;
    }
    if (add_prefix_space && piece.front() != ' ') {
      s->prefixed.assign(" ");
      s->prefixed.append(piece);
      piece = s->prefixed;
    }
    if (byte_level_regex == nullptr) {
      EncodeWord(piece, s, ids);
      continue;
    }
    s->matches.clear();
    RETURN_IF_ERROR(byte_level_regex->FindAll(piece, s->match_data.get(), &s->matches));
    // Text outside the matches is kept too (Isolated), though GPT-2's pattern covers all input.
    size_t last = 0;
    for (const auto& [b, e] : s->matches) {
      if (b > last) EncodeWord(piece.substr(last, b - last), s, ids);
      EncodeWord(piece.substr(b, e - b), s, ids);
      last = e;
    }
    if (last < piece.size()) EncodeWord(piece.substr(last), s, ids);
  }
  return Status::OK();
}

// raw: bytes of one pre-token; the BPE "word" is its ByteLevel form.
void BpeTokenizer::Impl::EncodeWord(std::string_view raw, EncodeScratch* s,
                                    std::vector<int32_t>* ids) const {
  if (!byte_fast_path) {
    s->word.clear();
    internal::AppendByteLevel(raw, &s->word);
    const std::string word = s->word;  // EncodeWordGeneral reuses s->word
    EncodeWordGeneral(word, s, ids);
    return;
  }
  if (raw.size() == 1) {
    ids->push_back(byte_ids[static_cast<unsigned char>(raw[0])]);
    return;
  }
  if (ignore_merges) {
    s->word.clear();
    internal::AppendByteLevel(raw, &s->word);
    if (auto id = Lookup(s->word)) {
      ids->push_back(*id);
      return;
    }
  }
  s->symbols.clear();
  for (unsigned char c : raw) s->symbols.push_back(byte_ids[c]);
  MergeSymbols(s, ids);
}

// HF BPE::merge_word over the code points of word (prefix/suffix, byte_fallback, unk, fuse_unk).
void BpeTokenizer::Impl::EncodeWordGeneral(std::string_view word, EncodeScratch* s,
                                           std::vector<int32_t>* ids) const {
  if (word.empty()) return;
  if (ignore_merges) {
    if (auto id = Lookup(word)) {
      ids->push_back(*id);
      return;
    }
  }
  s->symbols.clear();
  bool last_was_unk = false;
  const auto* p = reinterpret_cast<const unsigned char*>(word.data());
  size_t i = 0;
  while (i < word.size()) {
    char32_t cp;
    int len = internal::DecodeUtf8(p + i, word.size() - i, &cp);
    if (len < 0) len = -len;  // cannot happen for validated input
    const std::string_view ch = word.substr(i, len);
    const bool first = i == 0;
    i += len;
    const bool last = i == word.size();
    s->word.clear();
    if (!first) s->word.append(continuing_subword_prefix);
    s->word.append(ch);
    if (last) s->word.append(end_of_word_suffix);
    if (auto id = Lookup(s->word)) {
      s->symbols.push_back(*id);
      last_was_unk = false;
      continue;
    }
    if (byte_fallback) {
      bool all = true;
      for (unsigned char b : ch) all = all && byte_fallback_ids[b] >= 0;
      if (all) {
        for (unsigned char b : ch) s->symbols.push_back(byte_fallback_ids[b]);
        last_was_unk = false;
        continue;
      }
    }
    if (unk_id) {
      if (!(fuse_unk && last_was_unk)) s->symbols.push_back(*unk_id);
      last_was_unk = true;
    }
  }
  MergeSymbols(s, ids);
}

// Applies merges to s->symbols, lowest rank first and leftmost among equal ranks (the order of
// HF's BPE::merge_word and transformers.js), and appends the result to ids.
void BpeTokenizer::Impl::MergeSymbols(EncodeScratch* s, std::vector<int32_t>* ids) const {
  std::vector<int32_t>& sym = s->symbols;
  const int32_t n = static_cast<int32_t>(sym.size());
  if (n <= 1) {
    ids->insert(ids->end(), sym.begin(), sym.end());
    return;
  }
  if (n == 2) {
    if (const PairMap::Entry* m = merge_map.Find(sym[0], sym[1])) {
      ids->push_back(m->new_id);
    } else {
      ids->insert(ids->end(), sym.begin(), sym.end());
    }
    return;
  }
  s->prev.resize(n);
  s->next.resize(n);
  s->alive.assign(n, 1);
  auto& heap = s->heap;
  heap.clear();
  const auto greater = [](const EncodeScratch::HeapItem& a, const EncodeScratch::HeapItem& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  for (int32_t i = 0; i < n; ++i) {
    s->prev[i] = i - 1;
    s->next[i] = i + 1 < n ? i + 1 : -1;
    if (i + 1 < n) {
      if (const PairMap::Entry* m = merge_map.Find(sym[i], sym[i + 1])) {
        heap.push_back({m->rank, i, m->new_id});
      }
    }
  }
  std::make_heap(heap.begin(), heap.end(), greater);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), greater);
    const EncodeScratch::HeapItem top = heap.back();
    heap.pop_back();
    const int32_t pos = top.pos;
    if (!s->alive[pos]) continue;
    const int32_t right = s->next[pos];
    if (right < 0) continue;
    // Stale entry unless the pair at pos is still the one pushed (ranks identify pairs).
    const PairMap::Entry* current = merge_map.Find(sym[pos], sym[right]);
    if (current == nullptr || current->rank != top.rank) continue;
    sym[pos] = top.new_id;
    s->alive[right] = 0;
    const int32_t after = s->next[right];
    s->next[pos] = after;
    if (after >= 0) s->prev[after] = pos;
    const int32_t before = s->prev[pos];
    if (before >= 0) {
      if (const PairMap::Entry* m = merge_map.Find(sym[before], sym[pos])) {
        heap.push_back({m->rank, before, m->new_id});
        std::push_heap(heap.begin(), heap.end(), greater);
      }
    }
    if (after >= 0) {
      if (const PairMap::Entry* m = merge_map.Find(sym[pos], sym[after])) {
        heap.push_back({m->rank, pos, m->new_id});
        std::push_heap(heap.begin(), heap.end(), greater);
      }
    }
  }
  for (int32_t i = 0; i >= 0; i = s->next[i]) ids->push_back(sym[i]);
}

// ---- BpeTokenizer ------------------------------------------------------------------------------

BpeTokenizer::BpeTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BpeTokenizer::~BpeTokenizer() = default;

StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::FromFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, internal::ReadFileToString(path));
  return FromJson(text, path);
}

StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::FromJson(std::string_view json_text,
                                                               std::string_view source) {
  const std::string where(source);
  auto impl = std::make_unique<Impl>();
  try {
    Json doc;
    try {
      doc = Json::parse(json_text);
    } catch (const Json::parse_error& e) {
      return Status::InvalidArgument(where + ": invalid JSON: " + e.what());
    }
    if (!doc.is_object()) return Status::InvalidArgument(where + ": not a JSON object");
    const Json null_json;
    auto section = [&](const char* key) -> const Json& {
      return doc.contains(key) ? doc[key] : null_json;
    };
    Status status = impl->ParseNormalizer(section("normalizer"));
    if (status.ok()) status = impl->ParsePreTokenizer(section("pre_tokenizer"));
    if (status.ok()) status = impl->ParseModel(section("model"));
    if (status.ok()) status = impl->ParseAddedTokens(section("added_tokens"));
    if (status.ok()) status = impl->ParseDecoder(section("decoder"));
    if (!status.ok()) return status.WithContext(where);
    impl->normalizer_json = section("normalizer");
    impl->pre_tokenizer_json = section("pre_tokenizer");
    impl->post_processor_json = section("post_processor");
    impl->decoder_json = section("decoder");
  } catch (const std::exception& e) {  // nlohmann type errors: a field of the wrong JSON type
    return Status::InvalidArgument(where + ": " + e.what());
  }

  Impl& m = *impl;
  m.byte_fast_path =
      m.byte_level && m.continuing_subword_prefix.empty() && m.end_of_word_suffix.empty();
  for (int b = 0; b < 256 && m.byte_fast_path; ++b) {
    const auto id = m.Lookup(internal::ByteLevelChar(static_cast<uint8_t>(b)));
    if (!id) m.byte_fast_path = false;  // general path handles unk/byte_fallback per character
    m.byte_ids[b] = id.value_or(-1);
  }
  m.vocab_size = static_cast<int64_t>(m.id_to_token.size());
  for (const AddedToken& t : m.added) m.vocab_size = std::max<int64_t>(m.vocab_size, t.id + 1);

  auto tokenizer = std::unique_ptr<BpeTokenizer>(new BpeTokenizer(std::move(impl)));
  for (const char* eos : {"<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>", "</s>"}) {
    if (tokenizer->SetEosToken(eos).ok()) break;
  }
  if (!tokenizer->SetPadToken("<|endoftext|>").ok())
    tokenizer->impl_->pad_id = tokenizer->impl_->eos_id;
  return tokenizer;
}

Status BpeTokenizer::SetEosToken(std::string_view token) {
  auto id = TokenToId(token);
  if (!id) return Status::NotFound("eos token " + Quote(token) + " is not in the vocabulary");
  impl_->eos_id = id;
  return Status::OK();
}

Status BpeTokenizer::SetPadToken(std::string_view token) {
  auto id = TokenToId(token);
  if (!id) return Status::NotFound("pad token " + Quote(token) + " is not in the vocabulary");
  impl_->pad_id = id;
  return Status::OK();
}

StatusOr<std::vector<int32_t>> BpeTokenizer::Encode(std::string_view text) const {
  if (auto bad = internal::FindInvalidUtf8(text)) {
    return Status::InvalidArgument("text is not valid UTF-8 at byte " + std::to_string(*bad));
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  EncodeScratch scratch;
  if (scratch.match_data == nullptr) return Status::ResourceExhausted("pcre2 match data");
  if (impl_->raw_matcher.empty()) {
    RETURN_IF_ERROR(impl_->EncodeSection(text, &scratch, &ids));
    return ids;
  }
  std::vector<TextSegment> segments;
  impl_->raw_matcher.Split(text, &segments);
  for (const TextSegment& seg : segments) {
    if (seg.token_id >= 0) {
      ids.push_back(seg.token_id);
    } else {
      RETURN_IF_ERROR(
          impl_->EncodeSection(text.substr(seg.begin, seg.end - seg.begin), &scratch, &ids));
    }
  }
  return ids;
}

StatusOr<std::string> BpeTokenizer::DecodeImpl(const std::vector<int32_t>& ids,
                                               bool skip_special_tokens) const {
  const Impl& m = *impl_;
  std::string bytes;
  bool first = true;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    std::string_view token;
    auto added = m.added_by_id.find(id);
    if (added != m.added_by_id.end()) {
      const AddedToken& t = m.added[added->second];
      if (skip_special_tokens && t.special) continue;
      token = t.content;
    } else if (id >= 0 && static_cast<size_t>(id) < m.id_to_token.size() && m.has_token[id]) {
      token = m.id_to_token[id];
    } else {
      return Status::OutOfRange("token id " + std::to_string(id) + " at position " +
                                std::to_string(i) + " is not a token (vocab_size " +
                                std::to_string(m.vocab_size) + ")");
    }
    if (!m.byte_level_decoder) {  // HF joins tokens with spaces when there is no decoder
      if (!first) bytes.push_back(' ');
      bytes.append(token);
      first = false;
      continue;
    }
    // ByteLevel: map each character back to its byte; a token with any other character is
    // copied as is (as HF's ByteLevel decoder does for added tokens).
    const size_t mark = bytes.size();
    const auto* p = reinterpret_cast<const unsigned char*>(token.data());
    size_t j = 0;
    bool mapped = true;
    while (j < token.size()) {
      char32_t cp;
      const int len = internal::DecodeUtf8(p + j, token.size() - j, &cp);
      std::optional<uint8_t> b;
      if (len > 0) b = internal::UnicodeToByte(cp);
      if (!b) {
        mapped = false;
        break;
      }
      bytes.push_back(static_cast<char>(*b));
      j += len;
    }
    if (!mapped) {
      bytes.resize(mark);
      bytes.append(token);
    }
  }
  return internal::Utf8Lossy(bytes);
}

int64_t BpeTokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int32_t> BpeTokenizer::TokenToId(std::string_view token) const {
  auto it = impl_->added_by_content.find(token);
  if (it != impl_->added_by_content.end()) return it->second;
  return impl_->Lookup(token);
}

std::optional<std::string> BpeTokenizer::IdToToken(int32_t id) const {
  auto added = impl_->added_by_id.find(id);
  if (added != impl_->added_by_id.end()) return impl_->added[added->second].content;
  if (id >= 0 && static_cast<size_t>(id) < impl_->id_to_token.size() && impl_->has_token[id]) {
    return impl_->id_to_token[id];
  }
  return std::nullopt;
}

std::optional<int32_t> BpeTokenizer::eos_token_id() const { return impl_->eos_id; }
std::optional<int32_t> BpeTokenizer::pad_token_id() const { return impl_->pad_id; }

Status BpeTokenizer::Save(const std::string& path) const {
  const Impl& m = *impl_;
  // Written by hand around the big vocab and merges arrays: building them as nlohmann
  // ordered_json objects is quadratic.
  std::string out;
  try {
    auto str = [](std::string_view s) { return Json(s).dump(); };
    Json added = Json::array();
    for (const AddedToken& t : m.added) {
      added.push_back({{"id", t.id},
                       {"content", t.content},
                       {"single_word", t.single_word},
                       {"lstrip", t.lstrip},
                       {"rstrip", t.rstrip},
                       {"normalized", t.normalized},
                       {"special", t.special}});
    }
    out += "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n";
    out += "  \"added_tokens\": " + added.dump() + ",\n";
    out += "  \"normalizer\": " + m.normalizer_json.dump() + ",\n";
    out += "  \"pre_tokenizer\": " + m.pre_tokenizer_json.dump() + ",\n";
    out += "  \"post_processor\": " + m.post_processor_json.dump() + ",\n";
    out += "  \"decoder\": " + m.decoder_json.dump() + ",\n";
    auto nullable = [&](const std::string& s) { return s.empty() ? std::string("null") : str(s); };
    out += "  \"model\": {\n    \"type\": \"BPE\",\n    \"dropout\": null,\n";
    out += "    \"unk_token\": " + (m.unk_token ? str(*m.unk_token) : std::string("null")) + ",\n";
    out += "    \"continuing_subword_prefix\": " + nullable(m.continuing_subword_prefix) + ",\n";
    out += "    \"end_of_word_suffix\": " + nullable(m.end_of_word_suffix) + ",\n";
    out += std::string("    \"fuse_unk\": ") + (m.fuse_unk ? "true" : "false") + ",\n";
    out += std::string("    \"byte_fallback\": ") + (m.byte_fallback ? "true" : "false") + ",\n";
    out += std::string("    \"ignore_merges\": ") + (m.ignore_merges ? "true" : "false") + ",\n";
    out += "    \"vocab\": {";
    bool first = true;
    for (size_t id = 0; id < m.id_to_token.size(); ++id) {
      if (!m.has_token[id]) continue;
      out += first ? "\n      " : ",\n      ";
      out += str(m.id_to_token[id]) + ": " + std::to_string(id);
      first = false;
    }
    out += "\n    },\n    \"merges\": [";
    // Legacy "a b" strings unless a token contains a space (readable by all tokenizers versions).
    bool pairs = false;
    for (const auto& [a, b] : m.merges) {
      pairs = pairs || m.id_to_token[a].find(' ') != std::string::npos ||
              m.id_to_token[b].find(' ') != std::string::npos;
    }
    for (size_t i = 0; i < m.merges.size(); ++i) {
      const std::string& a = m.id_to_token[m.merges[i].first];
      const std::string& b = m.id_to_token[m.merges[i].second];
      out += i == 0 ? "\n      " : ",\n      ";
      out += pairs ? "[" + str(a) + ", " + str(b) + "]" : str(a + " " + b);
    }
    out += "\n    ]\n  }\n}\n";
  } catch (const std::exception& e) {
    return Status::Internal(path + ": cannot serialise tokenizer: " + e.what());
  }
  return WriteFileAtomically(path, out);
}

}  // namespace grpo::common
