#include "common/tokenizer/byte_tokenizer.h"

#include <nlohmann/json.hpp>

#include "common/atomic_file.h"
#include "common/tokenizer/tokenizer_util.h"

namespace grpo::common {

using internal::AddedToken;

ByteTokenizer::ByteTokenizer() {
  for (const auto& [id, content] : {std::pair<int32_t, const char*>{kEndOfTextId, "<|endoftext|>"},
                                    {kImStartId, "<|im_start|>"},
                                    {kImEndId, "<|im_end|>"}}) {
    AddedToken t;
    t.id = id;
    t.content = content;
    t.special = true;
    specials_.push_back(t);
  }
  matcher_ = internal::AddedTokenMatcher(specials_);
}

StatusOr<std::vector<int32_t>> ByteTokenizer::Encode(std::string_view text) const {
  if (auto bad = internal::FindInvalidUtf8(text)) {
    return Status::InvalidArgument("text is not valid UTF-8 at byte " + std::to_string(*bad));
  }
  std::vector<internal::TextSegment> segments;
  matcher_.Split(text, &segments);
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  for (const internal::TextSegment& seg : segments) {
    if (seg.token_id >= 0) {
      ids.push_back(seg.token_id);
      continue;
    }
    for (size_t i = seg.begin; i < seg.end; ++i) ids.push_back(static_cast<unsigned char>(text[i]));
  }
  return ids;
}

StatusOr<std::string> ByteTokenizer::DecodeImpl(const std::vector<int32_t>& ids,
                                                bool skip_special_tokens) const {
  std::string bytes;
  bytes.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= kVocabSize) {
      return Status::OutOfRange("token id " + std::to_string(id) + " at position " +
                                std::to_string(i) + " is out of range [0, " +
                                std::to_string(kVocabSize) + ")");
    }
    if (id < 256) {
      bytes.push_back(static_cast<char>(id));
    } else if (!skip_special_tokens) {
      bytes.append(specials_[id - 256].content);
    }
  }
  return internal::Utf8Lossy(bytes);
}

std::optional<int32_t> ByteTokenizer::TokenToId(std::string_view token) const {
  for (const AddedToken& t : specials_) {
    if (t.content == token) return t.id;
  }
  char32_t cp;
  const auto* s = reinterpret_cast<const unsigned char*>(token.data());
  if (token.empty() ||
      internal::DecodeUtf8(s, token.size(), &cp) != static_cast<int>(token.size())) {
    return std::nullopt;
  }
  if (auto b = internal::UnicodeToByte(cp)) return static_cast<int32_t>(*b);
  return std::nullopt;
}

std::optional<std::string> ByteTokenizer::IdToToken(int32_t id) const {
  if (id < 0 || id >= kVocabSize) return std::nullopt;
  if (id < 256) return internal::ByteLevelChar(static_cast<uint8_t>(id));
  return specials_[id - 256].content;
}

Status ByteTokenizer::Save(const std::string& path) const {
  using Json = nlohmann::ordered_json;
  const Json byte_level = {{"type", "ByteLevel"},
                           {"add_prefix_space", false},
                           {"trim_offsets", false},
                           {"use_regex", false}};
  Json added = Json::array();
  for (const AddedToken& t : specials_) {
    added.push_back({{"id", t.id},
                     {"content", t.content},
                     {"single_word", t.single_word},
                     {"lstrip", t.lstrip},
                     {"rstrip", t.rstrip},
                     {"normalized", t.normalized},
                     {"special", t.special}});
  }
  Json vocab = Json::object();
  for (int b = 0; b < 256; ++b) vocab[internal::ByteLevelChar(static_cast<uint8_t>(b))] = b;
  Json model = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", false},
                {"vocab", std::move(vocab)},
                {"merges", Json::array()}};
  Json doc = {{"version", "1.0"},          {"truncation", nullptr},
              {"padding", nullptr},        {"added_tokens", std::move(added)},
              {"normalizer", nullptr},     {"pre_tokenizer", byte_level},
              {"post_processor", nullptr}, {"decoder", byte_level},
              {"model", std::move(model)}};
  return WriteFileAtomically(path, doc.dump(2) + "\n");
}

}  // namespace grpo::common
