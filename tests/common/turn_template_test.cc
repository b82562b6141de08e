// common/tokenizer/turn_template: token in, token out on the real Qwen3 tokenizer
// (tests/data/qwen3-tokenizer) against Hugging Face transformers' apply_chat_template with the
// shipped Qwen3 Jinja template, TRL's qwen3_training variant and a plain ChatML template
// (tests/reference/qwen3_chat_ref.py, run once for the suite).
#include "common/tokenizer/turn_template.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/tokenizer/tokenizer.h"
#include "tests/test_util.h"

namespace grpo::common {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Ids = std::vector<int32_t>;
using Messages = std::vector<ChatMessage>;

// ---- conversations -------------------------------------------------------------------------
// Assistant contents are what the model generated, verbatim (the Qwen3 formats' canonical think
// block included); everything between two assistant messages is one observation.

// A tool loop: two tool results in a row (non-ASCII), a user follow-up, another tool round.
Messages ToolLoop() {
  return {
      {"system", "Du bist ein hilfreicher Assistent."},
      {"user", "Wie ist das Wetter in Zürich und in 東京? 🌦"},
      {"assistant",
       "<think>\nIch frage beide Städte ab.\n</think>\n\n<tool_call>\n{\"name\": \"weather\", "
       "\"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>\n<tool_call>\n{\"name\": "
       "\"weather\", \"arguments\": {\"city\": \"東京\"}}\n</tool_call>"},
      {"tool", "{\"city\": \"Zürich\", \"temp_c\": 12, \"sky\": \"bewölkt\"}"},
      {"tool", "{\"city\": \"東京\", \"temp_c\": 21, \"sky\": \"晴れ ☀\"}"},
      {"assistant",
       "<think>\nBeide Antworten sind da.\n</think>\n\nZürich: 12 °C, bewölkt. 東京: 21 °C, "
       "sonnig."},
      {"user", "Und morgen in Zürich?"},
      {"assistant",
       "<think>\n\n</think>\n\n<tool_call>\n{\"name\": \"forecast\", \"arguments\": {\"city\": "
       "\"Zürich\", \"days\": 1}}\n</tool_call>"},
      {"tool", "{\"temp_c\": 9, \"sky\": \"Regen\"}"},
  };
}

// An observation mixing tool results and a user message, then a second model turn.
Messages ToolThenUser() {
  return {
      {"user", "Compute 2 * 3 and 4 + 5."},
      {"assistant",
       "<think>\nTwo calls.\n</think>\n\n<tool_call>\n{\"name\": \"multiply\", \"arguments\": "
       "{\"a\": 2, \"b\": 3}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": "
       "{\"a\": 4, \"b\": 5}}\n</tool_call>"},
      {"tool", "6"},
      {"tool", "9"},
      {"user", "Now answer in one line."},
      {"assistant", "<think>\nDone.\n</think>\n\n6 and 9."},
      {"user", "Thanks! Один ещё: 7 - 1?"},
  };
}

struct Case {
  std::string name;
  ChatFormat format;
  Messages messages;
  bool add_generation_prompt;
};

// Renderings compared as text with transformers; the first ones are also episodes (they end with
// an observation) for the token-stream tests.
std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (ChatFormat f : {ChatFormat::kChatML, ChatFormat::kQwen3Training, ChatFormat::kQwen3}) {
    cases.push_back({"tool_loop", f, ToolLoop(), true});
    cases.push_back({"tool_then_user", f, ToolThenUser(), true});
  }
  // Rendering-only cases for the real Qwen3 template's position rules.
  Messages ends_with_assistant = ToolThenUser();
  ends_with_assistant.push_back({"assistant", "<think>\nSubtract.\n</think>\n\n6"});
  Messages wrapped_response = {
      {"user", "q"},
      {"assistant", "<think>\nr\n</think>\n\nlook up"},
      {"user", "<tool_response>\nfound\n</tool_response>"},
      {"assistant", "no reasoning here"},
      {"system", "late system message"},
      {"assistant", "\n\n<think>\n\nlast\n\n</think>\n\n\nanswer"},
  };
  for (ChatFormat f : {ChatFormat::kQwen3, ChatFormat::kQwen3Training, ChatFormat::kChatML}) {
    cases.push_back({"ends_with_assistant", f, ends_with_assistant, false});
    cases.push_back({"wrapped_tool_response", f, wrapped_response, false});
  }
  return cases;
}

// ---- the suite's shared state --------------------------------------------------------------

json MessagesJson(const Messages& messages) {
  json out = json::array();
  for (const ChatMessage& m : messages) out.push_back({{"role", m.role}, {"content", m.content}});
  return out;
}

class QwenChat : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new grpo::testing::TempDir("grpo_turn_template_test");
    if (std::string unpacked = grpo::testing::UnpackQwen3Tokenizer(dir_->path());
        !unpacked.empty()) {
      error_ = new std::string(unpacked);
      return;
    }
    auto t = LoadTokenizer(dir_->path().string());
    if (!t.ok()) {
      error_ = new std::string(t.status().ToString());
      return;
    }
    tokenizer_ = std::move(t).value().release();
    json request = {{"tokenizer_dir", dir_->path().string()}, {"conversations", json::array()}};
    for (const Case& c : Cases()) {
      request["conversations"].push_back({{"format", std::string(ChatFormatName(c.format))},
                                          {"messages", MessagesJson(c.messages)},
                                          {"add_generation_prompt", c.add_generation_prompt}});
    }
    reference_ = new json(grpo::testing::RunReference("qwen3_chat_ref.py", request));
    if (reference_->is_null()) error_ = new std::string("tests/reference/qwen3_chat_ref.py failed");
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    delete reference_;
    delete dir_;
    delete error_;
    tokenizer_ = nullptr;
    reference_ = nullptr;
    dir_ = nullptr;
    error_ = nullptr;
  }
  void SetUp() override { ASSERT_EQ(error_, nullptr) << *error_; }

  static const json& Render(const std::string& name, ChatFormat format) {
    const std::vector<Case> cases = Cases();
    for (size_t i = 0; i < cases.size(); ++i) {
      if (cases[i].name == name && cases[i].format == format) return (*reference_)["renders"][i];
    }
    ADD_FAILURE() << "no case " << name;
    static const json kNull;
    return kNull;
  }
  static Case FindCase(const std::string& name, ChatFormat format) {
    for (const Case& c : Cases()) {
      if (c.name == name && c.format == format) return c;
    }
    ADD_FAILURE() << "no case " << name;
    return {};
  }
  static int32_t NewlineId() { return (*reference_)["newline_id"].get<int32_t>(); }
  static int32_t ImEndId() { return (*reference_)["im_end_id"].get<int32_t>(); }

  static Ids Encode(std::string_view text) {
    auto ids = tokenizer_->Encode(text);
    EXPECT_TRUE(ids.ok()) << ids.status().ToString();
    return ids.ok() ? *ids : Ids{};
  }
  static void Append(Ids* out, const Ids& more) {
    out->insert(out->end(), more.begin(), more.end());
  }

  // The rollout worker's token stream for an episode: the prompt (messages before the first
  // assistant) rendered with the generation prompt and encoded once; then per assistant message
  // its content's ids (standing in for the generated ids), "<|im_end|>" when the turn is closed,
  // and the encoded observation suffix of the messages up to the next assistant message.
  // `open_turns`: the indices of assistant messages cut before "<|im_end|>".
  static Ids EpisodeIds(ChatFormat format, const Messages& messages,
                        const std::vector<size_t>& open_turns = {}) {
    size_t i = 0;
    while (i < messages.size() && messages[i].role != "assistant") ++i;
    auto prompt = RenderChat(format, Messages(messages.begin(), messages.begin() + i), true);
    EXPECT_TRUE(prompt.ok()) << prompt.status().ToString();
    Ids ids = Encode(*prompt);
    while (i < messages.size()) {
      const bool closed = std::find(open_turns.begin(), open_turns.end(), i) == open_turns.end();
      Append(&ids, Encode(messages[i].content));
      if (closed) ids.push_back(*tokenizer_->TokenToId("<|im_end|>"));
      Messages observation;
      for (++i; i < messages.size() && messages[i].role != "assistant"; ++i) {
        observation.push_back(messages[i]);
      }
      if (observation.empty()) break;
      auto suffix = RenderObservationSuffix(format, observation, closed);
      EXPECT_TRUE(suffix.ok()) << suffix.status().ToString();
      Append(&ids, Encode(*suffix));
    }
    return ids;
  }

  static inline grpo::testing::TempDir* dir_ = nullptr;
  static inline Tokenizer* tokenizer_ = nullptr;
  static inline json* reference_ = nullptr;
  static inline std::string* error_ = nullptr;
};

// ---- rendering -----------------------------------------------------------------------------

TEST_F(QwenChat, RenderChatMatchesTransformersForEveryFormatAndCase) {
  const std::vector<Case> cases = Cases();
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    auto text = RenderChat(c.format, c.messages, c.add_generation_prompt);
    ASSERT_TRUE(text.ok()) << text.status().ToString();
    EXPECT_EQ(*text, (*reference_)["renders"][i]["text"].get<std::string>())
        << c.name << " in " << ChatFormatName(c.format);
  }
}

TEST_F(QwenChat, RealQwen3DropsThinkBlocksBeforeTheLastQuery) {
  // What makes it unusable for multi-turn training: the first turns' reasoning vanishes from the
  // rendering once a later user query exists (checked against transformers above).
  auto text = RenderChat(ChatFormat::kQwen3, ToolThenUser(), true);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(text->find("Two calls."), std::string::npos);
  EXPECT_EQ(text->find("Done."), std::string::npos);
  EXPECT_NE(Render("tool_then_user", ChatFormat::kQwen3Training)["text"].get<std::string>().find(
                "Two calls."),
            std::string::npos);
}

// ---- token in, token out -------------------------------------------------------------------

TEST_F(QwenChat, TokenStreamEqualsTransformersIdsForPrefixPreservingFormats) {
  for (ChatFormat f : {ChatFormat::kChatML, ChatFormat::kQwen3Training}) {
    for (const std::string name : {"tool_loop", "tool_then_user"}) {
      const Ids expected = Render(name, f)["ids"].get<Ids>();
      EXPECT_EQ(EpisodeIds(f, FindCase(name, f).messages), expected)
          << name << " in " << ChatFormatName(f);
    }
  }
}

TEST_F(QwenChat, TokenAfterImEndIsTheNewlineOfTheReference) {
  // veRL issue 6501: the "\n" after <|im_end|> lost on every turn. Every <|im_end|> in HF's ids is
  // followed by the newline token, and so is every one in our stream.
  ASSERT_EQ(tokenizer_->TokenToId("<|im_end|>"), ImEndId());
  ASSERT_EQ(Encode("\n"), Ids{NewlineId()});
  for (ChatFormat f : {ChatFormat::kChatML, ChatFormat::kQwen3Training}) {
    const Ids expected = Render("tool_loop", f)["ids"].get<Ids>();
    const Ids ours = EpisodeIds(f, ToolLoop());
    int ends = 0;
    for (size_t k = 0; k + 1 < expected.size(); ++k) {
      if (expected[k] != ImEndId()) continue;
      ++ends;
      EXPECT_EQ(expected[k + 1], NewlineId()) << "reference, position " << k;
      ASSERT_LT(k + 1, ours.size());
      EXPECT_EQ(ours[k], ImEndId()) << ChatFormatName(f) << ", position " << k;
      EXPECT_EQ(ours[k + 1], NewlineId()) << ChatFormatName(f) << ", position " << k;
    }
    // system, user, 3 model turns, user, and the tool messages: 3 ChatML turns, 2 Qwen3 turns.
    EXPECT_EQ(ends, f == ChatFormat::kChatML ? 9 : 8) << ChatFormatName(f);
    // The suffix of a closed turn starts with exactly that token.
    auto suffix = RenderObservationSuffix(f, {{"tool", "x"}}, true);
    ASSERT_TRUE(suffix.ok());
    EXPECT_EQ(Encode(*suffix).front(), NewlineId());
  }
}

TEST_F(QwenChat, SuffixOfACutTurnStartsWithImEnd) {
  // A turn cut by the length budget has no <|im_end|>; the suffix supplies it, and the stream is
  // again the template's ids.
  for (ChatFormat f : {ChatFormat::kChatML, ChatFormat::kQwen3Training}) {
    const Ids expected = Render("tool_loop", f)["ids"].get<Ids>();
    EXPECT_EQ(EpisodeIds(f, ToolLoop(), /*open_turns=*/{2, 7}), expected) << ChatFormatName(f);
    auto suffix = RenderObservationSuffix(f, {{"user", "x"}}, false);
    ASSERT_TRUE(suffix.ok());
    EXPECT_EQ(Encode(*suffix).front(), ImEndId());
  }
}

TEST_F(QwenChat, RealQwen3TokenStreamIsNotWhatTheTemplateRendersLater) {
  // Token in, token out keeps what the model saw; the real template re-renders earlier turns
  // without their think blocks, so a re-tokenised history would differ from the ids generated.
  const Ids expected = Render("tool_then_user", ChatFormat::kQwen3)["ids"].get<Ids>();
  EXPECT_NE(EpisodeIds(ChatFormat::kQwen3, ToolThenUser()), expected);
}

// ---- the prefix check ----------------------------------------------------------------------

TEST_F(QwenChat, PrefixCheckAgreesWithTrlAndTransformers) {
  for (ChatFormat f : {ChatFormat::kChatML, ChatFormat::kQwen3, ChatFormat::kQwen3Training}) {
    const json& ref = (*reference_)["prefix_preserving"][std::string(ChatFormatName(f))];
    const bool ours = CheckPrefixPreserving(f).ok();
    EXPECT_EQ(ours, ref["trl"].get<bool>()) << ChatFormatName(f);
    EXPECT_EQ(ours, ref["text"].get<bool>()) << ChatFormatName(f);
  }
}

TEST_F(QwenChat, TrlDoesNotRecogniseTheShippedQwen3TemplateRevision) {
  // TRL maps a template to its training variant by exact text; the revision in
  // tests/data/qwen3-tokenizer predates TRL's qwen3.jinja, so TRL would refuse it outright. We
  // name the format instead, so "qwen3_training" serves either revision.
  EXPECT_FALSE((*reference_)["trl_recognises_qwen3"].get<bool>());
}

TEST(TurnTemplate, PrefixCheckRefusesRealQwen3NamingIt) {
  const Status s = CheckPrefixPreserving(ChatFormat::kQwen3);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("'qwen3'"), std::string::npos) << s.message();
  // The first difference: the assistant turn lost its empty think block. 55 characters of
  // "<|im_start|>user\ndummy<|im_end|>\n<|im_start|>assistant\n", then "<t" of "<think>" and of
  // "<tool_call>" alike.
  EXPECT_NE(s.message().find("character 57"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("hink>\\n\\n</think>"), std::string::npos) << s.message();
}

TEST(TurnTemplate, PrefixCheckAcceptsChatMLAndTheTrainingVariant) {
  EXPECT_TRUE(CheckPrefixPreserving(ChatFormat::kChatML).ok());
  EXPECT_TRUE(CheckPrefixPreserving(ChatFormat::kQwen3Training).ok());
}

// ---- hand-checked suffixes and errors ------------------------------------------------------

TEST(TurnTemplate, Qwen3SuffixGroupsToolMessagesInOneUserTurn) {
  auto s = RenderObservationSuffix(ChatFormat::kQwen3Training,
                                   {{"tool", "a"}, {"tool", "b"}, {"user", "c"}}, true);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s,
            "\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
            "</tool_response><|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n");
}

TEST(TurnTemplate, ChatMLSuffixKeepsTheToolRole) {
  auto s = RenderObservationSuffix(ChatFormat::kChatML, {{"tool", "a"}}, false);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, "<|im_end|>\n<|im_start|>tool\na<|im_end|>\n<|im_start|>assistant\n");
}

TEST(TurnTemplate, SuffixRefusesEmptyObservationsAndOtherRoles) {
  EXPECT_EQ(RenderObservationSuffix(ChatFormat::kChatML, {}, true).status().code(),
            StatusCode::kInvalidArgument);
  auto bad = RenderObservationSuffix(ChatFormat::kQwen3, {{"tool", "a"}, {"assistant", "b"}}, true);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("message 1"), std::string::npos);
  EXPECT_NE(bad.status().message().find("'assistant'"), std::string::npos);
  EXPECT_EQ(RenderChat(ChatFormat::kQwen3, {{"robot", "x"}}, false).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(TurnTemplate, FormatNamesRoundTripAndUnknownNamesListTheKnownOnes) {
  for (ChatFormat f : {ChatFormat::kChatML, ChatFormat::kQwen3, ChatFormat::kQwen3Training}) {
    auto parsed = ParseChatFormat(ChatFormatName(f));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, f);
  }
  EXPECT_EQ(ChatFormatName(ChatFormat::kQwen3Training), "qwen3_training");
  auto bad = ParseChatFormat("llama3");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("chatml, qwen3, qwen3_training"), std::string::npos)
      << bad.status().message();
}

}  // namespace
}  // namespace grpo::common
