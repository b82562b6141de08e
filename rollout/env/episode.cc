#include "rollout/env/episode.h"

#include <algorithm>
#include <memory>
#include <thread>
#include <utility>

#include "rollout/env/steps_in_flight.h"

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

struct Episode {
  size_t group = 0;  // index into the valid inputs
  int64_t generation = 0;
  int64_t budget = 0;  // the episode's tokens, model and environment (CompletionBudget)
  std::unique_ptr<EnvSession> session;
  Completion completion;
  std::string last_turn;  // text of the latest model turn
  double reward = 0.0;
  nlohmann::json metadata;
  bool live = true;         // not ended (an episode not admitted yet is live, without a session)
  int64_t turns = 0;        // model turns generated
  bool uses_tools = false;  // the environment declared tools at reset
  std::vector<common::ChatMessage> reset_messages;  // shown to the model before its first turn
  ToolCallCounts tools;
  Status error;       // the environment's failure, or one of its observations that cannot be shown
  int64_t wave = -1;  // the admission wave it reset with (index into ProduceEpisodes' waves)
  bool resetting = false;  // its session's open and reset are in flight (StepsInFlight)
  bool shown = false;      // its wave is back and ShowResetObservations ran: it may take turns
  bool stepping = false;   // its environment step is in flight (StepsInFlight)
  bool decoding = false;   // its model turn decodes (ContinueStream)
};

// Opens a session for `e` and resets it with the input's row and the episode's seed (a thread of
// StepsInFlight: it has the episode's session to itself until the loop takes its result). A
// reset refused at capacity (ResourceExhausted: an OpenEnv server past its max_concurrent_envs)
// while the call holds fewer sessions than its bound is a session closed here that the server
// has not released yet, or another worker's: tried again, in a new session, until the reset's
// deadline. Errors carry their context (opening, reset, ended at reset).
StatusOr<EnvObservation> OpenAndReset(Environment& environment, const EpisodeOptions& options,
                                      const ProduceInput& in, Episode& e) {
  const auto deadline = Clock::now() + options.step_timeout;
  std::chrono::milliseconds backoff(10);
  for (;;) {
    StatusOr<std::unique_ptr<EnvSession>> session = environment.Open();
    if (!session.ok()) {
      return session.status().WithContext("opening a session of " + environment.name());
    }
    e.session = std::move(session).value();
    StatusOr<EnvObservation> obs = e.session->Reset(
        in.prompt->row, EpisodeSeed(options.seed, in.seed_index, e.generation), deadline);
    if (obs.ok()) {
      if (obs->done || obs->truncated) {
        return Status::FailedPrecondition("the environment ended the episode at reset");
      }
      return obs;
    }
    if (obs.status().code() != StatusCode::kResourceExhausted ||
        Clock::now() + backoff >= deadline) {
      return obs.status().WithContext("reset");
    }
    e.session.reset();
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
}

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

// Whether a group shows its reset observations (below), decided by the first of its episodes
// to be admitted.
struct GroupShow {
  enum { kUndecided, kNo, kYes } decision = kUndecided;
  Status cut;  // with kYes: why the prompt cannot lose its generation prompt (fails the episodes)
};

// The groups whose environment answered a reset with messages show them to the model: the
// group's prompt (prompt_ids[v]) loses its generation prompt (options.generation_tail), and
// every episode of it starts with environment tokens, its own reset messages rendered as turns
// followed by the generation prompt, or the generation prompt alone when its reset had none. So
// a group's episodes share one prompt while each sees its own reset observation (TRL appends it
// to each rollout's prompt; our group has one). These tokens count in max_completion_length, as
// every observation does; a prompt that does not end with the generation prompt (a "prompt"
// string row), or a reset observation that leaves no room for a model turn, fails the episode.
// Runs on the episodes just reset (`wave`); a group decides with its first wave (all of it
// when num_generations fits in env_max_concurrency), and an episode of a later wave whose reset
// carries messages when its group's earlier episodes showed none fails (their prompt is fixed).
void ShowResetObservations(const EpisodeOptions& options,
                           std::vector<std::vector<int32_t>>& prompt_ids,
                           std::vector<Episode>& episodes, const std::vector<size_t>& wave,
                           std::vector<GroupShow>& groups, EpisodeCounts& counts) {
  for (size_t i : wave) {
    const Episode& e = episodes[i];
    GroupShow& g = groups[e.group];
    if (g.decision != GroupShow::kUndecided) continue;
    bool shows = false;
    for (size_t j : wave) {
      const Episode& o = episodes[j];
      shows = shows || (o.group == e.group && o.error.ok() && !o.reset_messages.empty());
    }
    g.decision = shows ? GroupShow::kYes : GroupShow::kNo;
    if (!shows) continue;
    const std::vector<int32_t>& tail = options.generation_tail;
    std::vector<int32_t>& p = prompt_ids[e.group];
    if (tail.empty()) {
      g.cut = Status::InvalidArgument(
          "the reset observation carries messages, and this worker was not given the generation "
          "prompt's ids to show them after the prompt");
    } else if (p.size() <= tail.size() ||
               !std::equal(tail.begin(), tail.end(), p.end() - tail.size())) {
      g.cut = Status::InvalidArgument(
          "the reset observation carries messages, which are shown to the model as turns after the "
          "prompt, so the prompt must end with the chat template's generation prompt "
          "(<|im_end|>\\n<|im_start|>assistant\\n): give the row as \"messages\", not as a "
          "\"prompt\" string");
    } else {
      p.resize(p.size() - tail.size());
    }
  }
  for (size_t i : wave) {
    Episode& e = episodes[i];
    if (!e.error.ok()) continue;
    const GroupShow& g = groups[e.group];
    if (g.decision == GroupShow::kNo) {
      if (!e.reset_messages.empty()) {
        Fail(e, Status::InvalidArgument(
                    "the reset observation carries messages, and the episodes of its group that "
                    "started before it (env_max_concurrency below num_generations) had none, so "
                    "the group's prompt was shown without them"));
      }
      continue;
    }
    if (!g.cut.ok()) {
      Fail(e, g.cut);
      continue;
    }
    std::vector<int32_t> ids = options.generation_tail;
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
  // A failed episode fails its group: the group's other episodes stop too (nothing of it trains),
  // those not admitted yet included.
  const auto stop_failed_groups = [&] {
    std::vector<bool> failed(valid.size(), false);
    for (const Episode& e : episodes) failed[e.group] = failed[e.group] || !e.error.ok();
    for (Episode& e : episodes) {
      if (failed[e.group] && e.live) {
        e.live = false;
        if (!e.stepping && !e.resetting) e.session.reset();  // else once its thread is back
        counts.stopped += 1;
      }
    }
  };

  // Opens, resets and environment steps run on threads of their own, one per episode at a time.
  // Declared after `episodes`, which its threads use: it joins them first.
  StepsInFlight steps;

  // Takes the finished resets and steps. A wave's episodes are shown (ShowResetObservations:
  // a group decides with its first wave) once all of its resets are back.
  std::vector<std::vector<size_t>> waves;  // the episodes of one group admitted together
  std::vector<size_t> wave_left;           // per wave, resets not back yet
  std::vector<GroupShow> shows(valid.size());
  const auto take_finished = [&] {
    for (StepsInFlight::Finished& f : steps.TakeFinished()) {
      Episode& e = episodes[f.episode];
      if (e.resetting) {
        e.resetting = false;
        if (!e.live) {  // its group failed while it reset
          e.session.reset();
        } else if (!f.result.ok()) {
          e.error = f.result.status();
          e.live = false;
          e.session.reset();
        } else {
          EnvObservation& obs = *f.result;
          if (obs.reward) e.reward += *obs.reward;
          if (!obs.metadata.is_null()) e.metadata = obs.metadata;
          e.uses_tools = !obs.tools.empty();
          e.reset_messages = std::move(obs.messages);
        }
        if (--wave_left[e.wave] == 0) {
          ShowResetObservations(options, prompt_ids, episodes, waves[e.wave], shows, counts);
          for (size_t i : waves[e.wave]) episodes[i].shown = true;
        }
        continue;
      }
      e.stepping = false;
      if (!e.live) {  // its group failed while it stepped
        e.session.reset();
        continue;
      }
      if (!f.result.ok()) {
        e.error = f.result.status().WithContext("step after turn " + std::to_string(e.turns));
        e.live = false;
      } else {
        ApplyObservation(options, e.turns - 1, *f.result, e, counts);
      }
      if (!e.live) e.session.reset();  // the episode is over: free the environment's session
    }
  };

  // At most max_concurrent_sessions sessions are held at once (an environment server allows so
  // many): episodes are admitted in order, a session opened and reset for each, as sessions free
  // up; a whole group at a time when num_generations fits (its first turn prefills the prompt
  // once for all of it), else as many of its episodes as fit. Opens and resets run concurrently.
  // Without overlap_env_steps the loop waits for a wave's resets, which then join this turn;
  // with it, the wave joins the first turn after its resets are back.
  const int64_t cap = options.max_concurrent_sessions;
  size_t next = 0;  // the first episode not admitted
  const auto admit = [&] {
    int64_t held = 0;  // a resetting episode's session is its thread's until the reset is back
    for (const Episode& e : episodes) held += e.resetting || e.session != nullptr ? 1 : 0;
    std::vector<size_t> wave;
    while (next < episodes.size() && held + static_cast<int64_t>(wave.size()) < cap) {
      if (!episodes[next].live) {  // its group failed before it started
        ++next;
        continue;
      }
      const size_t group = episodes[next].group;
      int64_t rest = 0;  // of the group, from `next` on
      for (size_t i = next; i < episodes.size() && episodes[i].group == group; ++i) ++rest;
      const int64_t free = cap - held - static_cast<int64_t>(wave.size());
      if (rest > free && gen.num_generations <= cap) break;  // the whole group when it fits
      for (int64_t k = 0; k < std::min(rest, free); ++k) {
        wave.push_back(next++);
      }
    }
    if (wave.empty()) return;
    // One wave per group: a group's episodes are shown (and start) together, whatever the
    // other groups' resets do.
    const size_t first = waves.size();
    for (size_t i : wave) {
      Episode& e = episodes[i];
      if (waves.size() == first || episodes[waves.back().front()].group != e.group) {
        waves.emplace_back();
        wave_left.push_back(0);
      }
      e.wave = static_cast<int64_t>(waves.size()) - 1;
      e.resetting = true;
      waves.back().push_back(i);
      wave_left.back() += 1;
      steps.Launch(i, [&environment, &options, &in = inputs[valid[e.group]], &e] {
        return OpenAndReset(environment, options, in, e);
      });
    }
    if (!options.overlap_env_steps) {
      const auto waits = Clock::now();
      steps.WaitAll();
      counts.env_wait_seconds += std::chrono::duration<double>(Clock::now() - waits).count();
      take_finished();
      stop_failed_groups();
    }
  };

  int64_t oldest_version = -1;
  TurnCache turn_cache;  // the live episodes' keys/values between turns
  TurnCache* const kv = options.keep_kv_cache ? &turn_cache : nullptr;
  // An episode may take its next model turn once it is admitted, its group's resets are back
  // and shown, and neither its step nor its last turn is in flight.
  const auto ready = [](const Episode& e) {
    return e.live && e.shown && !e.stepping && !e.decoding;
  };
  const auto row_of = [&](size_t i) {
    const Episode& e = episodes[i];
    const ProduceInput& in = inputs[valid[e.group]];
    Continuation row;
    row.context = prompt_ids[e.group];
    row.context.insert(row.context.end(), e.completion.token_ids.begin(),
                       e.completion.token_ids.end());
    row.seed_index = in.seed_index;
    row.generation = e.generation;
    row.turn = e.turns;
    row.max_new_tokens = e.budget - static_cast<int64_t>(e.completion.token_ids.size());
    row.tag = static_cast<int64_t>(i);
    return row;
  };
  // Before each turn: the resets and steps back, failed groups stopped, ended episodes' keys and
  // values freed, sessions freed up given to the next episodes.
  const auto between_turns = [&] {
    take_finished();
    stop_failed_groups();
    for (const Episode& e : episodes) {
      if (!e.live) turn_cache.Release(inputs[valid[e.group]].seed_index, e.generation);
    }
    admit();
  };
  // A model turn of episode i: appended to it, then its environment step runs on a thread of
  // its own (which has the episode's session, last turn and tool counts to itself until
  // TakeFinished hands its result back), unless the turn hit the episode's budget.
  const auto apply_turn = [&](size_t i, Completion& t, int64_t version) {
    Episode& e = episodes[i];
    oldest_version = oldest_version < 0 ? version : std::min(oldest_version, version);
    Completion& c = e.completion;
    c.token_ids.insert(c.token_ids.end(), t.token_ids.begin(), t.token_ids.end());
    c.logprobs.insert(c.logprobs.end(), t.logprobs.begin(), t.logprobs.end());
    c.env_mask.insert(c.env_mask.end(), t.token_ids.size(), 1);
    e.last_turn = std::move(t.text);
    e.turns += 1;
    counts.turns += 1;
    if (t.truncated) {  // cut by max_completion_length: never stepped, never continued
      c.truncated = true;
      counts.length_truncated += 1;
      e.live = false;
      e.session.reset();  // the episode is over: free the environment's session
      return;
    }
    e.stepping = true;
    steps.Launch(i, [&e, &options]() -> StatusOr<EnvObservation> {
      const auto deadline = Clock::now() + options.step_timeout;
      return e.uses_tools ? StepToolTurn(*e.session, e.last_turn, deadline, &e.tools)
                          : e.session->Step(e.last_turn, deadline);
    });
  };

  if (options.overlap_env_steps) {
    // Episodes join and leave one running decode (ContinueStream): an episode whose step or
    // reset comes back starts its next turn at the next decode step, and one whose turn stops
    // steps at once, so a slow step or reset holds up its own episode only, and no episode
    // waits for a longer turn. The batches follow the environment's timing.
    double stream_waits = 0.0;  // inside `take`, nothing decoding
    TurnStream stream;
    stream.take = [&](bool idle) {
      std::vector<Continuation> rows;
      for (;;) {
        between_turns();
        for (size_t i = 0; i < episodes.size(); ++i) {
          if (!ready(episodes[i])) continue;
          episodes[i].decoding = true;
          rows.push_back(row_of(i));
        }
        if (!rows.empty() || !idle) return rows;
        if (steps.pending() == 0) {
          if (next < episodes.size()) continue;  // every admitted one failed at reset: admit more
          return rows;                           // every episode ended
        }
        const auto waits = Clock::now();
        steps.WaitAny();
        const double waited = std::chrono::duration<double>(Clock::now() - waits).count();
        counts.env_wait_seconds += waited;
        stream_waits += waited;
      }
    };
    stream.done = [&](StreamedTurn turn) {
      Episode& e = episodes[static_cast<size_t>(turn.tag)];
      e.decoding = false;
      if (!e.live) return;  // its group failed while it decoded: the turn is dropped
      apply_turn(static_cast<size_t>(turn.tag), turn.completion, turn.policy_version);
    };
    const auto t0 = Clock::now();
    ASSIGN_OR_RETURN(TurnStreamStats stats, generator.ContinueStream(stream, kv));
    out.generate_seconds += std::chrono::duration<double>(Clock::now() - t0).count() - stream_waits;
    out.num_completion_tokens += stats.num_completion_tokens;
  } else {
    // Turn by turn: every live episode's step comes back, then one Continue call decodes the
    // next turn of them all.
    for (;;) {
      if (steps.pending() > 0) {
        const auto waits = Clock::now();
        steps.WaitAll();
        counts.env_wait_seconds += std::chrono::duration<double>(Clock::now() - waits).count();
      }
      between_turns();
      std::vector<size_t> live;
      std::vector<Continuation> rows;
      for (size_t i = 0; i < episodes.size(); ++i) {
        if (!ready(episodes[i])) continue;
        live.push_back(i);
        rows.push_back(row_of(i));
      }
      if (live.empty()) {
        if (steps.pending() > 0) continue;     // every live episode resets or steps: wait above
        if (next < episodes.size()) continue;  // every admitted one failed at reset: admit more
        break;
      }
      const auto t0 = Clock::now();
      ASSIGN_OR_RETURN(ContinueResult next_turn, generator.Continue(rows, kv));
      out.generate_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
      out.num_completion_tokens += next_turn.num_completion_tokens;
      for (size_t j = 0; j < live.size(); ++j) {
        apply_turn(live[j], next_turn.completions[j], next_turn.policy_version);
      }
    }
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
