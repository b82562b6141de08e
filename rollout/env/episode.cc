#include "rollout/env/episode.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

namespace grpo::rollout {
namespace {

using common::Completion;
using common::RolloutGroup;
using Clock = std::chrono::steady_clock;

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Calls fn(i) for i in [0, n) on up to `threads` threads (inline when one is enough).
void ForEachConcurrently(size_t n, int64_t threads, const std::function<void(size_t)>& fn) {
  const size_t k = std::min<size_t>(n, static_cast<size_t>(std::max<int64_t>(1, threads)));
  if (k <= 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  pool.reserve(k);
  for (size_t t = 0; t < k; ++t) {
    pool.emplace_back([&] {
      for (size_t i = next++; i < n; i = next++) fn(i);
    });
  }
  for (auto& t : pool) t.join();
}

struct Episode {
  size_t group = 0;  // index into the valid inputs
  int64_t generation = 0;
  int64_t budget = 0;  // the episode's tokens, model and environment (CompletionBudget)
  std::unique_ptr<EnvSession> session;
  Completion completion;
  std::string last_turn;  // text of the latest model turn
  double reward = 0.0;
  nlohmann::json metadata;
  bool live = true;
  bool uses_tools = false;                          // the environment declared tools at reset
  std::vector<common::ChatMessage> reset_messages;  // shown to the model before its first turn
  ToolCallCounts tools;
  Status error;  // the environment's failure, or one of its observations that cannot be shown
};

// Appends environment tokens (log-prob 0, env_mask 0) to `c`.
void AppendEnvTokens(const std::vector<int32_t>& ids, Completion& c) {
  c.token_ids.insert(c.token_ids.end(), ids.begin(), ids.end());
  c.logprobs.insert(c.logprobs.end(), ids.size(), 0.0f);
  c.env_mask.insert(c.env_mask.end(), ids.size(), 0);
}

// Appends an observation to `e` or ends the episode; `turn` is the model turn just stepped.
void ApplyObservation(const EpisodeOptions& options, int64_t turn, const EnvObservation& obs,
                      Episode& e, EpisodeCounts& counts) {
  if (obs.reward) e.reward += *obs.reward;
  if (!obs.metadata.is_null()) e.metadata = obs.metadata;
  if (obs.done || obs.truncated || turn + 1 >= options.max_turns) {
    (obs.done ? counts.done : obs.truncated ? counts.env_truncated : counts.max_turns) += 1;
    e.live = false;
    return;
  }
  if (obs.messages.empty()) {
    e.error = Status::InvalidArgument(
        "the environment's observation after turn " + std::to_string(turn + 1) +
        " has no messages and does not end the episode (done or truncated)");
    e.live = false;
    return;
  }
  const bool closed =
      !e.completion.token_ids.empty() && e.completion.token_ids.back() == options.end_of_turn_id;
  StatusOr<std::vector<int32_t>> ids = options.render(obs.messages, closed);
  if (!ids.ok()) {
    e.error = ids.status().WithContext("rendering the observation after turn " +
                                       std::to_string(turn + 1));
    e.live = false;
    return;
  }
  // The next turn needs room for at least one token.
  if (static_cast<int64_t>(e.completion.token_ids.size() + ids->size()) >= e.budget) {
    e.completion.truncated = true;
    counts.length_truncated += 1;
    e.live = false;
    return;
  }
  AppendEnvTokens(*ids, e.completion);
  counts.observation_tokens += static_cast<int64_t>(ids->size());
}

// Ends `e` with `error` (its group fails).
void Fail(Episode& e, Status error) {
  e.error = std::move(error);
  e.live = false;
  e.session.reset();
}

// The groups whose environment answered a reset with messages show them to the model: the
// group's prompt (prompt_ids[v]) loses its generation prompt (options.generation_tail), and
// every episode of it starts with environment tokens, its own reset messages rendered as turns
// followed by the generation prompt, or the generation prompt alone when its reset had none. So
// a group's episodes share one prompt while each sees its own reset observation (TRL appends it
// to each rollout's prompt; our group has one). These tokens count in max_completion_length, as
// every observation does; a prompt that does not end with the generation prompt (a "prompt"
// string row), or a reset observation that leaves no room for a model turn, fails the episode.
void ShowResetObservations(const EpisodeOptions& options,
                           std::vector<std::vector<int32_t>>& prompt_ids,
                           std::vector<Episode>& episodes, EpisodeCounts& counts) {
  std::vector<bool> shows(prompt_ids.size(), false);
  for (const Episode& e : episodes) {
    if (e.error.ok() && !e.reset_messages.empty()) shows[e.group] = true;
  }
  const std::vector<int32_t>& tail = options.generation_tail;
  for (size_t v = 0; v < prompt_ids.size(); ++v) {
    if (!shows[v]) continue;
    std::vector<int32_t>& p = prompt_ids[v];
    Status cut;
    if (tail.empty()) {
      cut = Status::InvalidArgument(
          "the reset observation carries messages, and this worker was not given the generation "
          "prompt's ids to show them after the prompt");
    } else if (p.size() <= tail.size() ||
               !std::equal(tail.begin(), tail.end(), p.end() - tail.size())) {
      cut = Status::InvalidArgument(
          "the reset observation carries messages, which are shown to the model as turns after the "
          "prompt, so the prompt must end with the chat template's generation prompt "
          "(<|im_end|>\\n<|im_start|>assistant\\n): give the row as \"messages\", not as a "
          "\"prompt\" string");
    } else {
      p.resize(p.size() - tail.size());
    }
    for (Episode& e : episodes) {
      if (e.group != v || !e.error.ok()) continue;
      if (!cut.ok()) {
        Fail(e, cut);
        continue;
      }
      std::vector<int32_t> ids = tail;
      if (!e.reset_messages.empty()) {
        StatusOr<std::vector<int32_t>> rendered = options.render(e.reset_messages, true);
        if (!rendered.ok()) {
          Fail(e, rendered.status().WithContext("rendering the reset observation"));
          continue;
        }
        ids = std::move(rendered).value();
      }
      if (static_cast<int64_t>(ids.size()) >= e.budget) {
        Fail(e, Status::InvalidArgument(
                    "the reset observation takes " + std::to_string(ids.size()) +
                    " tokens, which leaves no room for a model turn in max_completion_length " +
                    std::to_string(e.budget)));
        continue;
      }
      AppendEnvTokens(ids, e.completion);
      counts.observation_tokens += static_cast<int64_t>(ids.size());
    }
  }
}

}  // namespace

Status EpisodeOptions::Validate() const {
  if (max_turns < 1) {
    return Status::InvalidArgument("max_turns must be >= 1, got " + std::to_string(max_turns));
  }
  if (max_concurrent_sessions < 1) {
    return Status::InvalidArgument("env_max_concurrency must be >= 1, got " +
                                   std::to_string(max_concurrent_sessions));
  }
  if (step_timeout.count() <= 0) {
    return Status::InvalidArgument("env_step_timeout must be > 0");
  }
  if (end_of_turn_id < 0) {
    return Status::InvalidArgument("episodes need the end-of-turn token id (<|im_end|>)");
  }
  if (!render) return Status::InvalidArgument("episodes need an observation renderer");
  return Status::OK();
}

uint64_t EpisodeSeed(uint64_t seed, int64_t seed_index, int64_t generation) {
  uint64_t h = SplitMix64(seed ^ 0x656E76ull);  // "env": not the samplers' stream
  h = SplitMix64(h ^ static_cast<uint64_t>(seed_index));
  return SplitMix64(h ^ static_cast<uint64_t>(generation));
}

StatusOr<ProduceResult> ProduceEpisodes(const Generator& generator, const RewardRunner* rewards,
                                        Environment& environment, const EpisodeOptions& options,
                                        const std::vector<ProduceInput>& inputs,
                                        EpisodeCounts* counts_out) {
  RETURN_IF_ERROR(options.Validate());
  const GeneratorOptions& gen = generator.options();
  EpisodeCounts counts;
  ProduceResult out;
  out.policy_version = generator.policy_version();
  if (inputs.empty()) return out;

  // Prompts: truncated or refused as Generate does.
  std::vector<Status> prompt_errors(inputs.size());
  std::vector<bool> truncated(inputs.size(), false);
  std::vector<size_t> valid;  // input index per valid group
  std::vector<std::vector<int32_t>> prompt_ids;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].prompt == nullptr) {
      return Status::InvalidArgument("ProduceEpisodes: an input has no prompt");
    }
    std::vector<int32_t> p = inputs[i].prompt->ids;
    const std::string where = "prompt " + std::to_string(i) + ": ";
    if (p.empty()) {
      prompt_errors[i] = Status::InvalidArgument(where + "empty prompt");
    } else if (gen.max_prompt_length > 0 &&
               static_cast<int64_t>(p.size()) > gen.max_prompt_length) {
      if (gen.truncate_prompt == "reject") {
        prompt_errors[i] = Status::InvalidArgument(
            where + std::to_string(p.size()) + " tokens > max_prompt_length " +
            std::to_string(gen.max_prompt_length) + " (truncate_prompt: reject)");
      } else {
        p.erase(p.begin(), p.end() - gen.max_prompt_length);
        truncated[i] = true;
        out.num_prompts_truncated += 1;
      }
    }
    if (!prompt_errors[i].ok()) {
      out.num_prompts_failed += 1;
      continue;
    }
    valid.push_back(i);
    prompt_ids.push_back(std::move(p));
  }

  // Sessions, then resets, concurrently.
  std::vector<Episode> episodes;
  for (size_t v = 0; v < valid.size(); ++v) {
    for (int64_t k = 0; k < gen.num_generations; ++k) {
      Episode e;
      e.group = v;
      e.generation = k;
      e.budget = CompletionBudget(*inputs[valid[v]].prompt, gen.max_completion_length);
      episodes.push_back(std::move(e));
    }
  }
  counts.episodes = static_cast<int64_t>(episodes.size());
  ForEachConcurrently(episodes.size(), options.max_concurrent_sessions, [&](size_t i) {
    Episode& e = episodes[i];
    const ProduceInput& in = inputs[valid[e.group]];
    StatusOr<std::unique_ptr<EnvSession>> session = environment.Open();
    if (!session.ok()) {
      e.error = session.status().WithContext("opening a session of " + environment.name());
      e.live = false;
      return;
    }
    e.session = std::move(session).value();
    StatusOr<EnvObservation> obs =
        e.session->Reset(in.prompt->row, EpisodeSeed(options.seed, in.seed_index, e.generation),
                         Clock::now() + options.step_timeout);
    if (!obs.ok()) {
      e.error = obs.status().WithContext("reset");
    } else if (obs->done || obs->truncated) {
      e.error = Status::FailedPrecondition("the environment ended the episode at reset");
    } else {
      if (obs->reward) e.reward += *obs->reward;
      if (!obs->metadata.is_null()) e.metadata = obs->metadata;
      e.uses_tools = !obs->tools.empty();
      e.reset_messages = std::move(obs->messages);
      return;
    }
    e.live = false;
    e.session.reset();
  });
  ShowResetObservations(options, prompt_ids, episodes, counts);
  // A failed episode fails its group: the group's other episodes stop too (nothing of it trains).
  const auto stop_failed_groups = [&] {
    std::vector<bool> failed(valid.size(), false);
    for (const Episode& e : episodes) failed[e.group] = failed[e.group] || !e.error.ok();
    for (Episode& e : episodes) {
      if (failed[e.group] && e.live) {
        e.live = false;
        e.session.reset();
        counts.stopped += 1;
      }
    }
  };
  stop_failed_groups();

  int64_t oldest_version = -1;
  TurnCache turn_cache;  // the live episodes' keys/values between turns
  for (int64_t turn = 0;; ++turn) {
    std::vector<size_t> live;
    std::vector<Continuation> rows;
    for (size_t i = 0; i < episodes.size(); ++i) {
      Episode& e = episodes[i];
      if (!e.live) continue;
      const ProduceInput& in = inputs[valid[e.group]];
      Continuation row;
      row.context = prompt_ids[e.group];
      row.context.insert(row.context.end(), e.completion.token_ids.begin(),
                         e.completion.token_ids.end());
      row.seed_index = in.seed_index;
      row.generation = e.generation;
      row.turn = turn;
      row.max_new_tokens = e.budget - static_cast<int64_t>(e.completion.token_ids.size());
      live.push_back(i);
      rows.push_back(std::move(row));
    }
    if (live.empty()) break;
    const auto t0 = Clock::now();
    ASSIGN_OR_RETURN(ContinueResult next,
                     generator.Continue(rows, options.keep_kv_cache ? &turn_cache : nullptr));
    out.generate_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    out.num_completion_tokens += next.num_completion_tokens;
    oldest_version =
        oldest_version < 0 ? next.policy_version : std::min(oldest_version, next.policy_version);
    for (size_t j = 0; j < live.size(); ++j) {
      Episode& e = episodes[live[j]];
      Completion& t = next.completions[j];
      Completion& c = e.completion;
      c.token_ids.insert(c.token_ids.end(), t.token_ids.begin(), t.token_ids.end());
      c.logprobs.insert(c.logprobs.end(), t.logprobs.begin(), t.logprobs.end());
      c.env_mask.insert(c.env_mask.end(), t.token_ids.size(), 1);
      e.last_turn = std::move(t.text);
      counts.turns += 1;
      if (t.truncated) {  // cut by max_completion_length: never stepped, never continued
        c.truncated = true;
        counts.length_truncated += 1;
        e.live = false;
      }
    }
    std::vector<size_t> stepped;
    for (size_t i : live) {
      if (episodes[i].live) stepped.push_back(i);
    }
    std::vector<std::optional<StatusOr<EnvObservation>>> results(stepped.size());
    ForEachConcurrently(stepped.size(), options.max_concurrent_sessions, [&](size_t j) {
      Episode& e = episodes[stepped[j]];
      const auto deadline = Clock::now() + options.step_timeout;
      results[j] = e.uses_tools ? StepToolTurn(*e.session, e.last_turn, deadline, &e.tools)
                                : e.session->Step(e.last_turn, deadline);
    });
    for (size_t j = 0; j < stepped.size(); ++j) {
      Episode& e = episodes[stepped[j]];
      if (!results[j]->ok()) {
        e.error = results[j]->status().WithContext("step after turn " + std::to_string(turn + 1));
        e.live = false;
      } else {
        ApplyObservation(options, turn, **results[j], e, counts);
      }
      if (!e.live) e.session.reset();  // the episode is over: free the environment's session
    }
    stop_failed_groups();
  }
  if (oldest_version >= 0) out.policy_version = oldest_version;

  // Groups: a failed episode fails its group (the prompt is leased again).
  std::vector<std::vector<Episode*>> by_input(inputs.size());
  for (Episode& e : episodes) {
    by_input[valid[e.group]].push_back(&e);
    counts.tools.Add(e.tools);
  }
  out.groups.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    Status failed = prompt_errors[i];
    for (Episode* e : by_input[i]) {
      if (e->error.ok()) continue;
      counts.errors[std::string(EnvErrorKind(e->error))] += 1;
      if (failed.ok()) {
        failed = e->error.WithContext("episode " + std::to_string(e->generation) + " of " +
                                      environment.name());
      }
    }
    if (!failed.ok()) {
      out.groups.push_back({failed, truncated[i], {}});
      continue;
    }
    RolloutGroup group;
    group.policy_version = out.policy_version;
    group.prompt_ids = prompt_ids[by_input[i].front()->group];
    std::vector<EnvFeedback> feedback;
    for (Episode* e : by_input[i]) {
      e->completion.text = e->last_turn;
      if (e->uses_tools) {
        e->completion.uses_tools = true;
        e->completion.tool_calls = static_cast<int32_t>(e->tools.calls);
        int64_t failures = 0;
        for (const auto& [reason, n] : e->tools.failures) failures += n;
        e->completion.tool_call_failures = static_cast<int32_t>(failures);
      }
      group.completions.push_back(std::move(e->completion));
      feedback.push_back(
          {e->reward, std::move(e->metadata)});  // the sum; 0 when the environment gave none
    }
    RewardCallReport report;
    if (rewards != nullptr) {
      report = rewards->ScoreGroup(group, inputs[i].prompt->text, inputs[i].prompt->row, feedback);
    }
    out.groups.push_back({std::move(group), truncated[i], std::move(report)});
  }
  if (counts_out != nullptr) *counts_out = std::move(counts);
  return out;
}

}  // namespace grpo::rollout
