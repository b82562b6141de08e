// Multi-turn episodes: the model's turns alternate with an environment's observations, token in,
// token out (docs/ARCHITECTURE.md "Multi-turn episodes"). A group is num_generations episodes of
// one prompt; each completion holds the episode's tokens after the prompt, model turns (env_mask
// 1, behaviour log-probs) and the observations' rendered turns (env_mask 0, log-prob 0), which
// are appended as ids and never re-tokenised with the history.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "rollout/env/environment.h"
#include "rollout/env/tool_turn.h"
#include "rollout/generator.h"
#include "rollout/produce.h"
#include "rollout/reward.h"

namespace grpo::rollout {

// The token ids to append after a model turn for an observation's messages: the rest of the
// closed turn (when `turn_closed`, the turn ended with the end-of-turn token), the tool/user
// turn, then the assistant header the next turn starts after. InvalidArgument for messages the
// template cannot render.
using ObservationRenderer = std::function<StatusOr<std::vector<int32_t>>(
    const std::vector<common::ChatMessage>& messages, bool turn_closed)>;

struct EpisodeOptions {
  int64_t max_turns = 4;  // model turns per episode (>= 1); the last one is stepped, then it ends
  // Environment sessions one call holds at once (>= 1; env_max_concurrency): an episode's
  // session is opened when it starts and closed when it ends, and episodes past the bound wait
  // for one to end (a whole group at a time when num_generations fits in it). Opens, resets and
  // steps run concurrently up to it.
  int64_t max_concurrent_sessions = 16;
  std::chrono::milliseconds step_timeout = kDefaultEnvStepTimeout;  // per Reset and per Step
  int32_t end_of_turn_id = -1;  // the token that closes a model turn (<|im_end|>)
  ObservationRenderer render;   // not null
  // The ids of "\n<|im_start|>assistant\n", what a chat prompt ends with after its last
  // <|im_end|>: a group whose environment answers a reset with messages loses them from its
  // prompt, and each episode starts with its reset messages rendered as turns (render(messages,
  // true), which ends with the generation prompt again) as environment tokens. Empty: a reset
  // observation with messages fails the episode.
  std::vector<int32_t> generation_tail;
  uint64_t seed = 42;  // with (seed index, generation) seeds each episode's Reset
  // Keep each episode's KV cache between its turns within one policy snapshot (Generator's
  // TurnCache; freed when the call returns): a turn prefills only the tokens appended since the
  // last. false: every turn prefills the whole episode again (the benchmark's baseline).
  bool keep_kv_cache = true;
  // Overlap the environment's steps and resets with generation: the episodes join and leave
  // one running decode (Generator::ContinueStream), an episode starting its next turn at the
  // decode step after its step or its group's resets come back and stepping as soon as its
  // turn stops, so a slow step holds up its own episode only, a slow reset its own group, and
  // no episode waits for a longer turn. Each episode's tokens are the same (its own sampler
  // streams); which episodes share a batch then depends on the environment's timing, so a run
  // repeats up to float rounding. false: every turn waits for every live episode's step and
  // every reset (one batch per turn, bit for bit repeatable).
  bool overlap_env_steps = false;

  // InvalidArgument naming the field.
  Status Validate() const;
};

// How the episodes of one call ended, for metrics and logs.
struct EpisodeCounts {
  int64_t episodes = 0;
  int64_t turns = 0;               // model turns generated
  int64_t done = 0;                // the environment said done
  int64_t env_truncated = 0;       // the environment said truncated
  int64_t max_turns = 0;           // ended by max_turns
  int64_t length_truncated = 0;    // a turn or an observation hit max_completion_length
  int64_t stopped = 0;             // another episode of its group failed: stopped unfinished
  int64_t observation_tokens = 0;  // environment tokens appended
  // Time the loop was blocked on the environment (resets, steps), decoding no turn.
  double env_wait_seconds = 0.0;
  std::map<std::string, int64_t> errors;  // by EnvErrorKind
  ToolCallCounts tools;                   // of episodes whose environment declared tools
};

// The seed of episode `generation` of the prompt with seed index `seed_index`.
uint64_t EpisodeSeed(uint64_t seed, int64_t seed_index, int64_t generation);

// Runs num_generations episodes of every input: Reset(row, EpisodeSeed(...)) (a reset
// observation with messages is shown to the model: EpisodeOptions::generation_tail), then turns
// until each ends (done or truncated by the environment, max_turns, max_completion_length over the
// whole episode, model and environment tokens together: a turn cut by it, or an observation that
// would overflow it (not appended), ends the episode as truncated). An environment that declared
// tools at reset is stepped through StepToolTurn (rollout/env/tool_turn.h). Then the group is
// scored by `rewards` (null: not scored) with each episode's summed environment reward and last
// metadata in RewardInput. An episode whose environment fails (EnvErrorKind) fails its group with
// that error, so its prompt is leased again, not trained on cut short. Whole-call errors: the
// Generator's (InvalidArgument, Internal). The group's policy_version is the oldest snapshot any
// of its turns used; when its turns used more than one, every row records each token's
// (Completion::token_versions: an environment token the next model turn's, or the last one's
// when none follows). Thread-safe as Produce.
StatusOr<ProduceResult> ProduceEpisodes(const Generator& generator, const RewardRunner* rewards,
                                        Environment& environment, const EpisodeOptions& options,
                                        const std::vector<ProduceInput>& inputs,
                                        EpisodeCounts* counts = nullptr);

// A group of episodes finished by StreamEpisodes, not scored yet (ScoreEpisodeGroup).
struct EpisodeGroup {
  int64_t tag = 0;  // the FedPrompt's
  // As ProduceEpisodes' groups (policy_version: the oldest snapshot any of its turns used), with
  // rewards empty.
  ProducedGroup produced{Status::Unknown("not finished"), false, {}};
  bool prompt_refused = false;        // the prompt itself failed (empty, too long with reject)
  std::vector<EnvFeedback> feedback;  // per episode: its summed reward and last metadata
  EpisodeCounts counts;               // the stream's since the group handed back before it
};

struct FedPrompt {
  ProduceInput input;  // its prompt borrowed until its group goes to EpisodeFeed::done
  int64_t tag = 0;     // the caller's
};

// Where StreamEpisodes takes its prompts and hands back its groups; both run on its thread.
struct EpisodeFeed {
  // Up to `room` (>= 1) prompts to start. `idle`: no episode decodes, is ready to, steps,
  // resets or waits for a session (every group taken was handed back), so the call may wait for
  // prompts, and an empty answer ends the stream. Not idle: it should return at once (rows
  // decode meanwhile); it is asked again at every decode step while sessions are free.
  std::function<std::vector<FedPrompt>(int64_t room, bool idle)> take;
  // Each group as soon as its episodes ended (in any order).
  std::function<void(EpisodeGroup)> done;
};

struct EpisodeStreamStats {
  int64_t num_completion_tokens = 0;  // model tokens
  double generate_seconds = 0;        // decoding, not waiting for the environment or the feed
  EpisodeCounts counts;               // those after the last group handed back
};

// ProduceEpisodes' episodes in one stream (continuous batching; overlap_env_steps's stream
// whatever its value): groups are taken from `feed` while environment sessions are free, their
// episodes join one running decode (Generator::ContinueStream) as their resets and steps come
// back, and each group goes to `feed.done` as soon as it is finished, unscored. Returns when
// the feed answers an idle call with nothing and every group is handed back. InvalidArgument
// for bad options or a feed without both functions; the Generator's errors (the groups in
// flight are lost).
StatusOr<EpisodeStreamStats> StreamEpisodes(const Generator& generator, Environment& environment,
                                            const EpisodeOptions& options, EpisodeFeed& feed);

// Scores a finished group with `rewards` (null: not scored), each episode's environment feedback
// in RewardInput; a failed group is left as it is.
void ScoreEpisodeGroup(const RewardRunner* rewards, const Prompt& prompt, EpisodeGroup& group);

}  // namespace grpo::rollout
