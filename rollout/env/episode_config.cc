#include "rollout/env/episode_config.h"

#include <string>

#include "common/tokenizer/turn_template.h"
#include "rollout/env/builtin_environments.h"

namespace grpo::rollout {

StatusOr<std::unique_ptr<Environment>> MakeEnvironment(const common::GrpoConfig& config) {
  const std::string& spec = config.env;
  if (spec.rfind("builtin:", 0) == 0) {
    return MakeBuiltinEnvironment(spec.substr(8));
  }
  return Status::InvalidArgument("env: '" + spec +
                                 "' needs a service build (grpc: environments are served by "
                                 "`grpo rollout`)");
}

StatusOr<EpisodeOptions> EpisodeOptionsFromConfig(const common::GrpoConfig& config,
                                                  const common::Tokenizer& tokenizer) {
  ASSIGN_OR_RETURN(const common::ChatFormat format, common::ParseChatFormat(config.chat_template));
  RETURN_IF_ERROR(common::CheckPrefixPreserving(format).WithContext("chat_template"));
  const std::optional<int32_t> im_end = tokenizer.TokenToId("<|im_end|>");
  if (!im_end) {
    return Status::FailedPrecondition(
        "multi-turn episodes need the tokenizer's <|im_end|> token to close model turns");
  }
  EpisodeOptions o;
  o.max_turns = config.max_turns;
  o.max_concurrent_sessions = config.env_max_concurrency;
  o.step_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(config.env_step_timeout_seconds * 1000.0));
  o.overlap_env_steps = config.overlap_env_steps;
  o.end_of_turn_id = *im_end;
  o.seed = static_cast<uint64_t>(config.seed);
  // What a chat prompt ends with after its last <|im_end|> (common::ApplyChatTemplate's
  // generation prompt): cut from a group's prompt to show its reset observation.
  ASSIGN_OR_RETURN(o.generation_tail, tokenizer.Encode("\n<|im_start|>assistant\n"));
  const common::Tokenizer* tok = &tokenizer;
  o.render = [format, tok](const std::vector<common::ChatMessage>& messages,
                           bool turn_closed) -> StatusOr<std::vector<int32_t>> {
    ASSIGN_OR_RETURN(const std::string text,
                     common::RenderObservationSuffix(format, messages, turn_closed));
    return tok->Encode(text);
  };
  RETURN_IF_ERROR(o.Validate());
  return o;
}

}  // namespace grpo::rollout
