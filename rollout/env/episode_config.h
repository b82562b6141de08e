// Multi-turn episodes from a GrpoConfig (env, max_turns, env_max_concurrency, overlap_env_steps,
// env_step_timeout_seconds, chat_template, seed) and the worker's tokenizer.
#pragma once

#include <functional>
#include <memory>

#include "common/config.h"
#include "common/status.h"
#include "common/tokenizer/tokenizer.h"
#include "rollout/env/environment.h"
#include "rollout/env/episode.h"

namespace grpo::rollout {

// Builds the environment of config.env. Called at every Register of a worker whose config has
// an env.
using EnvironmentFactory =
    std::function<StatusOr<std::unique_ptr<Environment>>(const common::GrpoConfig& config)>;

// "builtin:NAME": MakeBuiltinEnvironment (rollout/env/builtin_environments.h). InvalidArgument for
// an unknown name (listing the known ones) or a spec this library cannot serve (grpc: needs
// services/, whose worker passes its own factory).
StatusOr<std::unique_ptr<Environment>> MakeEnvironment(const common::GrpoConfig& config);

// EpisodeOptions of config with the chat template's observation renderer over `tokenizer`
// (borrowed: it must outlive the options). FailedPrecondition when the template is not
// prefix-preserving (common::CheckPrefixPreserving) or the tokenizer has no <|im_end|> token.
StatusOr<EpisodeOptions> EpisodeOptionsFromConfig(const common::GrpoConfig& config,
                                                  const common::Tokenizer& tokenizer);

}  // namespace grpo::rollout
