// common/tokenizer: ByteTokenizer and BpeTokenizer against hand-derived ids on tiny hand-written
// tokenizer.json files, and the real Qwen3 tokenizer (tests/data/qwen3-tokenizer/) against Hugging
// Face's own `tokenizers` library (tests/reference/qwen3_ids.py).
#include "common/tokenizer/tokenizer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/tokenizer/bpe_tokenizer.h"
#include "common/tokenizer/byte_tokenizer.h"
#include "common/tokenizer/chat_template.h"
#include "tests/test_util.h"

namespace grpo::common {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Ids = std::vector<int32_t>;

// ---- helpers -------------------------------------------------------------------------------

using grpo::testing::TempDir;

void WriteText(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::string ReadText(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// GPT-2's bytes_to_unicode(), written out as in openai/gpt-2 encoder.py: byte -> UTF-8 character.
std::map<int, std::string> Gpt2ByteChars() {
  std::vector<int> bs;
  for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
  std::vector<int> cs = bs;
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    if (std::find(bs.begin(), bs.end(), b) == bs.end()) {
      bs.push_back(b);
      cs.push_back(256 + n++);
    }
  }
  std::map<int, std::string> out;
  for (size_t i = 0; i < bs.size(); ++i) {
    const int c = cs[i];
    std::string utf8;
    if (c < 0x80) {
      utf8 = std::string(1, static_cast<char>(c));
    } else {  // all mapped characters are < U+0800
      utf8 += static_cast<char>(0xC0 | (c >> 6));
      utf8 += static_cast<char>(0x80 | (c & 0x3F));
    }
    out[bs[i]] = utf8;
  }
  return out;
}

Ids MustEncode(const Tokenizer& t, std::string_view text) {
  auto ids = t.Encode(text);
  EXPECT_TRUE(ids.ok()) << ids.status().ToString();
  return ids.ok() ? *ids : Ids{};
}

std::string MustDecode(const Tokenizer& t, const Ids& ids, bool skip_special = false) {
  auto text = t.Decode(ids, skip_special);
  EXPECT_TRUE(text.ok()) << text.status().ToString();
  return text.ok() ? *text : "";
}

// ---- a tiny byte-level BPE tokenizer.json --------------------------------------------------

// Vocabulary: byte b has id b (GPT-2 characters); then the merged tokens below. Merges by rank:
//   0 "h e"  1 "l l"  2 "he ll"  3 "hell o"  4 "Ġ w"  5 "o r"  6 "Ġw or"  7 "l d"  8 "Ġwor ld"
constexpr int32_t kHe = 256, kLl = 257, kHell = 258, kHello = 259, kGw = 260, kOr = 261,
                  kGwor = 262, kLd = 263, kGworld = 264, kHelp = 265;
constexpr int32_t kEot = 300, kImEnd = 301, kMask = 302, kAb = 303;

json TinyBpeJson(bool merges_as_pairs) {
  json vocab = json::object();
  for (const auto& [byte, ch] : Gpt2ByteChars()) vocab[ch] = byte;
  const std::string g = Gpt2ByteChars()[' '];  // "Ġ"
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"h", "e"}, {"l", "l"},      {"he", "ll"}, {"hell", "o"},    {g, "w"},
      {"o", "r"}, {g + "w", "or"}, {"l", "d"},   {g + "wor", "ld"}};
  int32_t id = 256;
  for (const auto& [a, b] : merges) vocab[a + b] = id++;
  vocab["help"] = kHelp;  // reachable only with ignore_merges
  json merge_list = json::array();
  for (const auto& [a, b] : merges) {
    merge_list.push_back(merges_as_pairs ? json::array({a, b}) : json(a + " " + b));
  }
  auto added = [](int32_t id, const char* content, bool special) {
    return json{{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
                {"rstrip", false}, {"normalized", false}, {"special", special}};
  };
  json added_tokens =
      json::array({added(kEot, "<|endoftext|>", true), added(kImEnd, "<|im_end|>", true),
                   added(kMask, "<mask>", false), added(kAb, "ab", false)});
  added_tokens[2]["lstrip"] = true;
  added_tokens[3]["single_word"] = true;
  const json byte_level = {{"type", "ByteLevel"},
                           {"add_prefix_space", false},
                           {"trim_offsets", true},
                           {"use_regex", true}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added_tokens},
          {"normalizer", nullptr},
          {"pre_tokenizer", byte_level},
          {"post_processor", nullptr},
          {"decoder", byte_level},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"vocab", vocab},
            {"merges", merge_list}}}};
}

std::unique_ptr<BpeTokenizer> MustParse(const json& doc) {
  auto t = BpeTokenizer::FromJson(doc.dump(), "tiny.json");
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

// ---- ByteTokenizer ---------------------------------------------------------------------------

TEST(ByteTokenizer, EncodesUtf8BytesAsIds) {
  ByteTokenizer t;
  EXPECT_EQ(MustEncode(t, "a\xC3\xA9 \n"), (Ids{97, 0xC3, 0xA9, 32, 10}));
  EXPECT_EQ(MustEncode(t, ""), Ids{});
}

TEST(ByteTokenizer, MatchesSpecialTokensInsideText) {
  ByteTokenizer t;
  EXPECT_EQ(MustEncode(t, "<|im_start|>hi<|im_end|><|endoftext|>"), (Ids{257, 104, 105, 258, 256}));
  EXPECT_EQ(MustEncode(t, "<|im_end"), (Ids{60, 124, 105, 109, 95, 101, 110, 100}));
}

TEST(ByteTokenizer, SpecialIdsAndSizes) {
  ByteTokenizer t;
  EXPECT_EQ(t.vocab_size(), 259);
  EXPECT_EQ(t.eos_token_id(), 258);
  EXPECT_EQ(t.pad_token_id(), 256);
  EXPECT_EQ(t.TokenToId("<|im_start|>"), 257);
  EXPECT_EQ(t.TokenToId("\xC4\xA0"), 32);  // "Ġ" is byte 0x20 in ByteLevel form
  EXPECT_EQ(t.TokenToId("nope"), std::nullopt);
  EXPECT_EQ(t.IdToToken(10), "\xC4\x8A");  // "Ċ"
}

TEST(ByteTokenizer, DecodeRoundTripsAndSkipsSpecials) {
  ByteTokenizer t;
  const std::string text = "<|im_start|>user\n\xE4\xBD\xA0\xE5\xA5\xBD<|im_end|>\n";
  const Ids ids = MustEncode(t, text);
  EXPECT_EQ(MustDecode(t, ids), text);
  EXPECT_EQ(MustDecode(t, ids, /*skip_special=*/true), "user\n\xE4\xBD\xA0\xE5\xA5\xBD\n");
}

TEST(ByteTokenizer, DecodeReplacesCutCharacterWithReplacementChar) {
  ByteTokenizer t;
  EXPECT_EQ(MustDecode(t, {0x61, 0xE4, 0xBD}), "a\xEF\xBF\xBD");  // 'a' + truncated "你"
}

TEST(ByteTokenizer, DecodeRejectsOutOfRangeIdNamingIt) {
  ByteTokenizer t;
  auto text = t.Decode({97, 259});
  ASSERT_FALSE(text.ok());
  EXPECT_EQ(text.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(text.status().message().find("259"), std::string::npos);
  EXPECT_FALSE(t.Decode({-1}).ok());
}

TEST(ByteTokenizer, EncodeRejectsInvalidUtf8) {
  ByteTokenizer t;
  auto ids = t.Encode("ab\xFF");
  ASSERT_FALSE(ids.ok());
  EXPECT_EQ(ids.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(ids.status().message().find("byte 2"), std::string::npos);
}

TEST(ByteTokenizer, SavedJsonIsByteLevelBpeWithoutMerges) {
  TempDir dir;
  const fs::path file = dir.path() / "tokenizer.json";
  ASSERT_TRUE(ByteTokenizer().Save(file.string()).ok());
  const json doc = json::parse(ReadText(file));
  EXPECT_EQ(doc["model"]["type"], "BPE");
  EXPECT_EQ(doc["model"]["merges"], json::array());
  EXPECT_EQ(doc["model"]["vocab"].size(), 256u);
  EXPECT_EQ(doc["model"]["vocab"]["\xC4\x80"], 0);   // "Ā"
  EXPECT_EQ(doc["model"]["vocab"]["\xC4\xA0"], 32);  // "Ġ"
  EXPECT_EQ(doc["model"]["vocab"]["!"], 33);
  for (const auto& [byte, ch] : Gpt2ByteChars()) EXPECT_EQ(doc["model"]["vocab"][ch], byte);
  EXPECT_EQ(doc["pre_tokenizer"]["type"], "ByteLevel");
  EXPECT_EQ(doc["decoder"]["type"], "ByteLevel");
  ASSERT_EQ(doc["added_tokens"].size(), 3u);
  EXPECT_EQ(doc["added_tokens"][2]["content"], "<|im_end|>");
  EXPECT_EQ(doc["added_tokens"][2]["id"], 258);
  EXPECT_EQ(doc["added_tokens"][2]["special"], true);
}

TEST(ByteTokenizer, SavedJsonLoadsAsBpeGivingTheSameIds) {
  TempDir dir;
  ByteTokenizer byte;
  ASSERT_TRUE(byte.Save((dir.path() / "tokenizer.json").string()).ok());
  auto loaded = LoadTokenizer(dir.path().string());
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const Tokenizer& bpe = **loaded;
  EXPECT_EQ(bpe.vocab_size(), byte.vocab_size());
  EXPECT_EQ(bpe.eos_token_id(), byte.eos_token_id());
  EXPECT_EQ(bpe.pad_token_id(), byte.pad_token_id());
  for (const std::string& text : std::vector<std::string>{
           "", "Hello, world!", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
           "tabs\tand  spaces \r\n", "\xE4\xBD\xA0\xE5\xA5\xBD \xF0\x9F\x98\x80 caf\xC3\xA9",
           std::string("nul\0byte", 8)}) {
    SCOPED_TRACE(text);
    const Ids ids = MustEncode(byte, text);
    EXPECT_EQ(MustEncode(bpe, text), ids);
    EXPECT_EQ(MustDecode(bpe, ids), text);
  }
}

// ---- BpeTokenizer on a tiny hand-written tokenizer.json ---------------------------------------

TEST(BpeTokenizer, AppliesMergesByRank) {
  auto t = MustParse(TinyBpeJson(/*merges_as_pairs=*/false));
  ASSERT_NE(t, nullptr);
  // "hello": he(0) -> ll(1) -> hell(2) -> hello(3); " world": Ġw, or, Ġwor, ld, Ġworld.
  EXPECT_EQ(MustEncode(*t, "hello world"), (Ids{kHello, kGworld}));
  // "help": he, then no merge for (he, l) or (l, p).
  EXPECT_EQ(MustEncode(*t, "help"), (Ids{kHe, 'l', 'p'}));
  // "hellhole": pre-token is the whole word; hell + h + o + l + e.
  EXPECT_EQ(MustEncode(*t, "hellhole"), (Ids{kHell, 'h', 'o', 'l', 'e'}));
}

TEST(BpeTokenizer, PairMergesEqualStringMerges) {
  auto strings = MustParse(TinyBpeJson(false));
  auto pairs = MustParse(TinyBpeJson(true));
  ASSERT_NE(strings, nullptr);
  ASSERT_NE(pairs, nullptr);
  for (const char* text : {"hello world", "help", "world hello  hell"}) {
    EXPECT_EQ(MustEncode(*pairs, text), MustEncode(*strings, text)) << text;
  }
}

TEST(BpeTokenizer, LowerRankWinsOverLeftmost) {
  // "abc" with merges [b c, a b]: (b, c) has rank 0, so a + bc; reversed order gives ab + c.
  json doc = TinyBpeJson(false);
  doc["added_tokens"] = json::array();
  doc["model"]["vocab"]["bc"] = 400;
  doc["model"]["vocab"]["ab"] = 401;
  doc["model"]["merges"] = json::array({"b c", "a b"});
  EXPECT_EQ(MustEncode(*MustParse(doc), "abc"), (Ids{'a', 400}));
  doc["model"]["merges"] = json::array({"a b", "b c"});
  EXPECT_EQ(MustEncode(*MustParse(doc), "abc"), (Ids{401, 'c'}));
}

TEST(BpeTokenizer, IgnoreMergesTakesWholeWordFromVocab) {
  json doc = TinyBpeJson(false);
  doc["model"]["ignore_merges"] = true;
  EXPECT_EQ(MustEncode(*MustParse(doc), "help"), Ids{kHelp});
}

TEST(BpeTokenizer, AddPrefixSpace) {
  json doc = TinyBpeJson(false);
  doc["pre_tokenizer"]["add_prefix_space"] = true;
  EXPECT_EQ(MustEncode(*MustParse(doc), "hello"), (Ids{' ', kHello}));
}

TEST(BpeTokenizer, ByteLevelRegexSplitsContractionsAndDigits) {
  auto t = MustParse(TinyBpeJson(false));
  // GPT-2 pattern: "it" "'s" " 42" "!!" -> each byte, no merges apply.
  EXPECT_EQ(MustEncode(*t, "it's 42!!"), (Ids{'i', 't', '\'', 's', ' ', '4', '2', '!', '!'}));
}

TEST(BpeTokenizer, AddedTokensMatchedBeforePreTokenizing) {
  auto t = MustParse(TinyBpeJson(false));
  EXPECT_EQ(MustEncode(*t, "hello<|im_end|><|endoftext|>"), (Ids{kHello, kImEnd, kEot}));
  // <mask> has lstrip: it swallows the spaces before it, not those after.
  EXPECT_EQ(MustEncode(*t, "he  <mask> he"), (Ids{kHe, kMask, ' ', kHe}));
  EXPECT_EQ(MustEncode(*t, "he\xE3\x80\x80<mask>"), (Ids{kHe, kMask}));  // U+3000 is whitespace
  // "ab" is single_word: matched alone, not inside "cab" or "abc".
  EXPECT_EQ(MustEncode(*t, "ab cab abc"), (Ids{kAb, ' ', 'c', 'a', 'b', ' ', 'a', 'b', 'c'}));
}

TEST(BpeTokenizer, RstripAddedTokenSwallowsWhitespaceAfterIt) {
  json doc = TinyBpeJson(false);
  doc["added_tokens"][1]["rstrip"] = true;  // <|im_end|>
  EXPECT_EQ(MustEncode(*MustParse(doc), "he <|im_end|> \n he"), (Ids{kHe, ' ', kImEnd, kHe}));
}

TEST(BpeTokenizer, NormalizedAddedTokenMatchesNormalizedText) {
  json doc = TinyBpeJson(false);
  doc["normalizer"] = {{"type", "NFC"}};
  doc["added_tokens"] = json::array({{{"id", 310},
                                      {"content", "\xC3\xA9"},  // "é" (NFC)
                                      {"single_word", false},
                                      {"lstrip", false},
                                      {"rstrip", false},
                                      {"normalized", true},
                                      {"special", false}}});
  // NFD input "e\u0301" normalises to "é" and then matches.
  EXPECT_EQ(MustEncode(*MustParse(doc), "he\xCC\x81h"), (Ids{'h', 310, 'h'}));
}

TEST(BpeTokenizer, DecodeMapsByteLevelCharactersBack) {
  auto t = MustParse(TinyBpeJson(false));
  EXPECT_EQ(MustDecode(*t, {kHello, kGworld, kImEnd}), "hello world<|im_end|>");
  EXPECT_EQ(MustDecode(*t, {kHello, kGworld, kImEnd}, /*skip_special=*/true), "hello world");
  EXPECT_EQ(MustDecode(*t, {kMask}, /*skip_special=*/true), "<mask>");  // not special
}

TEST(BpeTokenizer, DecodeRejectsIdsThatAreNotTokens) {
  auto t = MustParse(TinyBpeJson(false));
  EXPECT_EQ(t->vocab_size(), kAb + 1);
  for (int32_t id : {270, 304, -3}) {
    auto text = t->Decode({kHello, id});
    ASSERT_FALSE(text.ok()) << id;
    EXPECT_EQ(text.status().code(), StatusCode::kOutOfRange);
    EXPECT_NE(text.status().message().find(std::to_string(id)), std::string::npos);
  }
}

TEST(BpeTokenizer, TokenToIdCoversVocabAndAddedTokens) {
  auto t = MustParse(TinyBpeJson(false));
  EXPECT_EQ(t->TokenToId("\xC4\xA0world"), kGworld);  // "Ġworld"
  EXPECT_EQ(t->TokenToId("<mask>"), kMask);
  EXPECT_EQ(t->TokenToId("world"), std::nullopt);
  EXPECT_EQ(t->IdToToken(kHello), "hello");
  EXPECT_EQ(t->IdToToken(kEot), "<|endoftext|>");
  EXPECT_EQ(t->eos_token_id(), kImEnd);  // default: <|im_end|> before <|endoftext|>
  EXPECT_EQ(t->pad_token_id(), kEot);
}

TEST(BpeTokenizer, SplitWithStringPatternAndUnknownToken) {
  // No ByteLevel: characters are looked up as they are; "-" is removed; "z" becomes <unk>.
  const json doc = {{"added_tokens", json::array()},
                    {"normalizer", nullptr},
                    {"pre_tokenizer",
                     {{"type", "Split"},
                      {"pattern", {{"String", "-"}}},
                      {"behavior", "Removed"},
                      {"invert", false}}},
                    {"decoder", nullptr},
                    {"model",
                     {{"type", "BPE"},
                      {"unk_token", "<unk>"},
                      {"fuse_unk", true},
                      {"vocab", {{"a", 0}, {"b", 1}, {"c", 2}, {"ab", 3}, {"<unk>", 4}}},
                      {"merges", json::array({json::array({"a", "b"})})}}}};
  auto t = MustParse(doc);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(MustEncode(*t, "ab-c--a"), (Ids{3, 2, 0}));
  EXPECT_EQ(MustEncode(*t, "abzzc"), (Ids{3, 4, 2}));  // fuse_unk: one <unk> for "zz"
  EXPECT_EQ(MustDecode(*t, {3, 2}), "ab c");  // no decoder: tokens joined by spaces, as in HF
}

TEST(BpeTokenizer, SplitMergedWithPreviousKeepsDelimiterOnTheLeft) {
  const json doc = {
      {"pre_tokenizer",
       {{"type", "Split"}, {"pattern", {{"Regex", "-"}}}, {"behavior", "MergedWithPrevious"}}},
      {"model",
       {{"type", "BPE"},
        {"vocab", {{"a", 0}, {"b", 1}, {"-", 2}, {"a-", 3}, {"-b", 4}}},
        {"merges", json::array({"a -", "- b"})}}}};
  // Pieces "a-" and "b" (not "a", "-b"): the "- b" merge cannot apply.
  EXPECT_EQ(MustEncode(*MustParse(doc), "a-b"), (Ids{3, 1}));
}

TEST(BpeTokenizer, SavedJsonReloadsWithSameIds) {
  auto t = MustParse(TinyBpeJson(true));
  ASSERT_NE(t, nullptr);
  TempDir dir;
  const fs::path file = dir.path() / "tokenizer.json";
  ASSERT_TRUE(t->Save(file.string()).ok());
  const json doc = json::parse(ReadText(file));
  EXPECT_EQ(doc["model"]["merges"][0], "h e");  // legacy form: no token contains a space
  auto reloaded = LoadTokenizer(file.string());
  ASSERT_TRUE(reloaded.ok()) << reloaded.status().ToString();
  for (const char* text : {"hello world<|endoftext|>", "he  <mask> he", "ab cab"}) {
    EXPECT_EQ(MustEncode(**reloaded, text), MustEncode(*t, text)) << text;
  }
}

// ---- errors --------------------------------------------------------------------------------

TEST(BpeTokenizerErrors, UnsupportedTypesAreNamed) {
  struct Case {
    const char* section;
    json value;
    const char* name;
  };
  const std::vector<Case> cases = {
      {"normalizer", {{"type", "Lowercase"}}, "Lowercase"},
      {"pre_tokenizer", {{"type", "Metaspace"}, {"replacement", "_"}}, "Metaspace"},
      {"decoder", {{"type", "WordPiece"}}, "WordPiece"},
  };
  for (const Case& c : cases) {
    json doc = TinyBpeJson(false);
    doc[c.section] = c.value;
    auto t = BpeTokenizer::FromJson(doc.dump(), "x/tokenizer.json");
    ASSERT_FALSE(t.ok()) << c.name;
    EXPECT_EQ(t.status().code(), StatusCode::kUnimplemented);
    EXPECT_NE(t.status().message().find(c.name), std::string::npos) << t.status().ToString();
    EXPECT_NE(t.status().message().find("x/tokenizer.json"), std::string::npos);
  }
  json doc = TinyBpeJson(false);
  doc["model"] = {{"type", "Unigram"}, {"vocab", json::array()}};
  auto t = BpeTokenizer::FromJson(doc.dump(), "m.json");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("Unigram"), std::string::npos);
}

TEST(BpeTokenizerErrors, BadJsonNamesTheFile) {
  TempDir dir;
  const fs::path file = dir.path() / "tokenizer.json";
  WriteText(file, "{\"model\": ");
  auto t = LoadTokenizer(file.string());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find(file.string()), std::string::npos);
  EXPECT_NE(t.status().message().find("invalid JSON"), std::string::npos);
}

// Found by tests/fuzz/tokenizer_json_fuzz.cc: one huge id in a small vocabulary allocated a dense
// table of that size (66,666,661 entries: gigabytes, then out of memory).
TEST(BpeTokenizerErrors, AnIdFarPastTheVocabularyIsRefusedNotAllocated) {
  json doc = TinyBpeJson(false);
  const size_t entries = doc["model"]["vocab"].size();
  doc["model"]["vocab"]["far"] = 66666661;
  auto t = BpeTokenizer::FromJson(doc.dump(), "t.json");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("'far' has id 66666661, more than 65536 past the "
                                      "vocabulary's " +
                                      std::to_string(entries + 1) + " entries"),
            std::string::npos)
      << t.status().ToString();
  // A gap within the limit is a hole in the table, as before.
  doc["model"]["vocab"]["far"] = static_cast<int64_t>(entries + 1000);
  EXPECT_TRUE(BpeTokenizer::FromJson(doc.dump(), "t.json").ok());
}

TEST(BpeTokenizerErrors, MergeOfUnknownTokenIsNamed) {
  json doc = TinyBpeJson(false);
  doc["model"]["merges"].push_back("x q9");
  auto t = BpeTokenizer::FromJson(doc.dump(), "t.json");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("merges[9]"), std::string::npos) << t.status().ToString();
  EXPECT_NE(t.status().message().find("'q9'"), std::string::npos);

  doc = TinyBpeJson(false);
  doc["model"]["merges"].push_back("one-token-only");
  t = BpeTokenizer::FromJson(doc.dump(), "t.json");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("merges[9]"), std::string::npos);
}

TEST(BpeTokenizerErrors, BadRegexIsReported) {
  json doc = TinyBpeJson(false);
  doc["pre_tokenizer"] = {
      {"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  auto t = BpeTokenizer::FromJson(doc.dump(), "t.json");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("(unclosed"), std::string::npos) << t.status().ToString();
}

TEST(LoadTokenizer, MissingPathsAreNotFound) {
  TempDir dir;
  auto t = LoadTokenizer((dir.path() / "absent").string());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  t = LoadTokenizer(dir.path().string());  // a directory without tokenizer.json
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  EXPECT_NE(t.status().message().find("tokenizer.json"), std::string::npos);
}

TEST(LoadTokenizer, ReadsEosAndPadFromTokenizerConfig) {
  TempDir dir;
  WriteText(dir.path() / "tokenizer.json", TinyBpeJson(false).dump());
  WriteText(
      dir.path() / "tokenizer_config.json",
      R"({"eos_token": {"content": "<|endoftext|>", "special": true}, "pad_token": "<mask>"})");
  auto t = LoadTokenizer(dir.path().string());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->eos_token_id(), kEot);
  EXPECT_EQ((*t)->pad_token_id(), kMask);

  WriteText(dir.path() / "tokenizer_config.json", R"({"eos_token": "<nope>"})");
  t = LoadTokenizer(dir.path().string());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("tokenizer_config.json"), std::string::npos);
  EXPECT_NE(t.status().message().find("<nope>"), std::string::npos);
}

// A number past double's range is nlohmann's out_of_range, not its parse_error: it escaped the
// catch and ended the process (found by tests/fuzz/tokenizer_config_fuzz.cc). Now a clear error.
TEST(LoadTokenizer, ANumberPastDoublesRangeInTokenizerConfigIsAnError) {
  TempDir dir;
  WriteText(dir.path() / "tokenizer.json", TinyBpeJson(false).dump());
  WriteText(dir.path() / "tokenizer_config.json", R"({"model_max_length": 1e999})");
  auto t = LoadTokenizer(dir.path().string());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("tokenizer_config.json"), std::string::npos)
      << t.status().ToString();
}

// ---- chat template ---------------------------------------------------------------------------

TEST(ChatTemplate, FormatsChatMlWithGenerationPrompt) {
  auto text = ApplyChatTemplate({{"system", "Be brief."}, {"user", "2+2?"}}, true);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text,
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\n2+2?<|im_end|>\n"
            "<|im_start|>assistant\n");
}

TEST(ChatTemplate, WithoutGenerationPromptEndsAfterLastMessage) {
  auto text = ApplyChatTemplate(
      {{"user", "hi"}, {"assistant", "hello\nthere"}, {"tool", "{\"x\": 1}"}}, false);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text,
            "<|im_start|>user\nhi<|im_end|>\n"
            "<|im_start|>assistant\nhello\nthere<|im_end|>\n"
            "<|im_start|>tool\n{\"x\": 1}<|im_end|>\n");
  auto empty = ApplyChatTemplate({}, true);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, "<|im_start|>assistant\n");
}

TEST(ChatTemplate, RejectsUnknownRole) {
  auto text = ApplyChatTemplate({{"user", "a"}, {"robot", "b"}}, true);
  ASSERT_FALSE(text.ok());
  EXPECT_EQ(text.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(text.status().message().find("robot"), std::string::npos);
  EXPECT_NE(text.status().message().find("message 1"), std::string::npos);
}

// ---- Qwen3: parity with Hugging Face tokenizers ---------------------------------------------

fs::path SourceDir() { return grpo::testing::SourceDir(); }

using grpo::testing::ShellQuote;

struct CorpusEntry {
  std::string text;
  std::string nfc;  // what Decode(Encode(text)) gives: text in NFC
};

std::vector<CorpusEntry> QwenCorpus() {
  std::vector<CorpusEntry> corpus;
  auto add = [&](std::string text) { corpus.push_back({text, text}); };
  add("Hello world");
  add("The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see what they've done!");
  add("I'M SHOUTING, DON'T YOU THINK? I'll, you're, we've, she'd, they'RE");
  add("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\n"
      "class Foo:\n\tdef bar(self):\n\t\treturn {'a': [1, 2, 3]}  # comment\n");
  add("for (int i = 0; i < 10; ++i) {\n  x += i * 2;  // sum\n}\n");
  add("3.14159265358979323846 and 1234567890123456789012345678901234567890, 1,000,000 + 0x1F = 42");
  add("Call 555-0100 in 2024-06-30T12:34:56Z; version v1.2.3-rc4; ½ ¾ ² ⅷ");
  add("我爱自然语言处理。東京は日本の首都です。안녕하세요 세계! 中文，标点；符号：“引号”");
  add("مرحبا بالعالم، كيف حالك اليوم؟ ١٢٣٤ والأرقام 5678");
  // clang-format counts these clusters' width differently on each pass (it never settles).
  // clang-format off
  add("Family: 👨‍👩‍👧‍👦, flags 🇯🇵🇺🇸, skin 👍🏽, heart ❤️, keycap 1️⃣ and 🏳️‍🌈 done");
  // clang-format on
  add("Café résumé naïve façade coöperate Ünïcödé — “quotes” ‘single’ … «guillemets»");
  corpus.push_back({"Cafe\xCC\x81 re\xCC\x81sume\xCC\x81 n\xCC\x83o", "Café résumé ño"});  // NFD
  corpus.push_back({"q\xCC\x87\xCC\xA3", "q\xCC\xA3\xCC\x87"});  // NFC reorders the two marks
  add("a  b   c    d\r\nline2\r\n\r\ntrailing   ");
  add("tab\tseparated\t\tvalues\t\n   leading spaces\n\n\nnewlines\n\n");
  add("nbsp\u00a0here, ideographic\u3000space, thin\u2009space and  \u00a0 mixed \u3000\u3000");
  add("x \n y \t\n\tz   ");
  add("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  add("text<|endoftext|>more<|endoftext|><|endoftext|>");
  add("<think>\nLet me reason.\n</think>\n\nThe answer is 4.<|im_end|>");
  add("<|im_start|><|im_end|> <|im_start <<|im_end|>> <tool_call>{\"name\": \"f\"}</tool_call>");
  add("Привет, мир! Καλημέρα κόσμε. नमस्ते दुनिया. สวัสดีชาวโลก. שלום עולם.");
  add("$\\frac{a}{b} = \\sum_{i=1}^{n} x_i^2$ and {\"key\": \"value\", \"list\": [1, 2.5, null]}");
  add("https://example.com/path/to?query=1&x=y#frag user@example.org ~/dir/*.txt");
  add("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!!!!!!!!!!????......-----");
  add("");
  add(" ");
  add("\n");
  return corpus;
}

// Runs Hugging Face tokenizers over texts; the ids per text, or a failure message.
StatusOr<std::vector<Ids>> ReferenceIds(const fs::path& tokenizer_json,
                                        const std::vector<CorpusEntry>& corpus) {
  TempDir dir;
  const fs::path in = dir.path() / "texts.jsonl", out = dir.path() / "ids.jsonl";
  {
    std::ofstream f(in, std::ios::binary);
    for (const CorpusEntry& e : corpus) f << json(e.text).dump() << "\n";
  }
  const std::string cmd = ShellQuote(grpo::testing::ReferencePython()) + " " +
                          ShellQuote((SourceDir() / "tests/reference/qwen3_ids.py").string()) +
                          " " + ShellQuote(tokenizer_json.string()) + " < " +
                          ShellQuote(in.string()) + " > " + ShellQuote(out.string());
  if (std::system(cmd.c_str()) != 0) return Status::Internal("failed: " + cmd);
  std::vector<Ids> ids;
  std::istringstream lines(ReadText(out));
  for (std::string line; std::getline(lines, line);) ids.push_back(json::parse(line).get<Ids>());
  if (ids.size() != corpus.size()) {
    return Status::Internal("reference printed " + std::to_string(ids.size()) + " lines for " +
                            std::to_string(corpus.size()) + " texts");
  }
  return ids;
}

// The committed tokenizer unpacked into a directory of the suite's own (tokenizer.json +
// tokenizer_config.json), loaded once for the suite.
class QwenTokenizer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir("grpo_tokenizer_test");
    if (std::string unpacked = grpo::testing::UnpackQwen3Tokenizer(dir_->path());
        !unpacked.empty()) {
      setup_error_ = new std::string(unpacked);
      return;
    }
    auto t = LoadTokenizer(dir_->path().string());
    if (!t.ok()) {
      setup_error_ = new std::string(t.status().ToString());
      return;
    }
    tokenizer_ = std::move(t).value().release();
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    tokenizer_ = nullptr;
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override { ASSERT_EQ(setup_error_, nullptr) << *setup_error_; }

  static fs::path TokenizerJson() { return dir_->path() / "tokenizer.json"; }

  static inline Tokenizer* tokenizer_ = nullptr;
  static inline TempDir* dir_ = nullptr;
  static inline std::string* setup_error_ = nullptr;
};

TEST_F(QwenTokenizer, MatchesHuggingFaceTokenizersIds) {
  const std::vector<CorpusEntry> corpus = QwenCorpus();
  auto expected = ReferenceIds(TokenizerJson(), corpus);
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  for (size_t i = 0; i < corpus.size(); ++i) {
    EXPECT_EQ(MustEncode(*tokenizer_, corpus[i].text), (*expected)[i])
        << "text " << i << ": " << json(corpus[i].text).dump();
  }
}

TEST_F(QwenTokenizer, KnownIds) {
  // Published Qwen2/Qwen3 ids (same vocabulary): "Hello world" and the ChatML specials.
  EXPECT_EQ(MustEncode(*tokenizer_, "Hello world"), (Ids{9707, 1879}));
  EXPECT_EQ(tokenizer_->TokenToId("<|endoftext|>"), 151643);
  EXPECT_EQ(tokenizer_->TokenToId("<|im_start|>"), 151644);
  EXPECT_EQ(tokenizer_->eos_token_id(), 151645);  // tokenizer_config.json: <|im_end|>
  EXPECT_EQ(tokenizer_->pad_token_id(), 151643);  // <|endoftext|>
  EXPECT_EQ(tokenizer_->vocab_size(), 151669);
  // Digits are split one by one.
  EXPECT_EQ(MustEncode(*tokenizer_, "2024"), (Ids{17, 15, 17, 19}));
}

TEST_F(QwenTokenizer, DecodeRoundTripsToNfcText) {
  for (const CorpusEntry& e : QwenCorpus()) {
    EXPECT_EQ(MustDecode(*tokenizer_, MustEncode(*tokenizer_, e.text)), e.nfc)
        << json(e.text).dump();
  }
  const Ids chat = MustEncode(*tokenizer_, "<|im_start|>user\nhi<|im_end|>");
  EXPECT_EQ(MustDecode(*tokenizer_, chat, /*skip_special=*/true), "user\nhi");
}

TEST_F(QwenTokenizer, SavedJsonReloadsWithSameIds) {
  TempDir dir;
  const fs::path file = dir.path() / "tokenizer.json";
  ASSERT_TRUE(tokenizer_->Save(file.string()).ok());
  auto reloaded = LoadTokenizer(file.string());
  ASSERT_TRUE(reloaded.ok()) << reloaded.status().ToString();
  for (const CorpusEntry& e : QwenCorpus()) {
    EXPECT_EQ(MustEncode(**reloaded, e.text), MustEncode(*tokenizer_, e.text))
        << json(e.text).dump();
  }
}

TEST_F(QwenTokenizer, EncodeIsThreadSafe) {
  const std::vector<CorpusEntry> corpus = QwenCorpus();
  std::vector<Ids> expected;
  for (const CorpusEntry& e : corpus) expected.push_back(MustEncode(*tokenizer_, e.text));
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round) {
        for (size_t i = 0; i < corpus.size(); ++i) {
          const size_t k = (i + t * 7 + round) % corpus.size();
          auto ids = tokenizer_->Encode(corpus[k].text);
          if (!ids.ok() || *ids != expected[k]) ++mismatches;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

// Long inputs stay linear: a 1 MB run of one letter, of spaces and of digits.
TEST_F(QwenTokenizer, LongRunsEncode) {
  for (const char c : {'a', ' ', '7', '\n'}) {
    const std::string text(1 << 20, c);
    auto ids = tokenizer_->Encode(text);
    ASSERT_TRUE(ids.ok()) << ids.status().ToString();
    EXPECT_EQ(MustDecode(*tokenizer_, *ids), text);
  }
}

// Throughput on English prose; run with --gtest_also_run_disabled_tests
// --gtest_filter=*EncodeSpeed*. Prints MB/s (single thread).
TEST_F(QwenTokenizer, DISABLED_EncodeSpeed) {
  const char* words[] = {
      "the",     "model",     "learns",   "from",      "rewards",       "and",
      "a",       "policy",    "gradient", "update",    "which",         "is",
      "clipped", "by",        "ratio",    "of",        "probabilities", "between",
      "old",     "new",       "tokens,",  "while",     "group",         "advantages.",
      "Each",    "prompt",    "gets",     "eight",     "samples",       "scored",
      "by",      "verifier;", "we",       "normalise", "them."};
  std::string text;
  uint32_t state = 12345;
  while (text.size() < (4u << 20)) {
    state = state * 1664525u + 1013904223u;
    text += words[(state >> 8) % (sizeof(words) / sizeof(words[0]))];
    text += ((state >> 4) % 23 == 0) ? "\n" : " ";
  }
  const auto start = std::chrono::steady_clock::now();
  auto ids = tokenizer_->Encode(text);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(ids.ok());
  const double mb = text.size() / 1e6;
  std::printf("EncodeSpeed: %.1f MB in %.3f s = %.2f MB/s, %zu tokens\n", mb, seconds, mb / seconds,
              ids->size());
}

}  // namespace
}  // namespace grpo::common
