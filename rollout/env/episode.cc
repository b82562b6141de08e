#include "rollout/env/episode.h"

#include <algorithm>
#include <cstddef>
#include <deque>
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

// A model turn's tokens in its episode's completion, [begin, end), and the policy version that
// sampled them.
struct TurnSpan {
  size_t begin = 0, end = 0;
  int64_t version = 0;
};

struct Episode {
  size_t group = 0;  // index into the run's groups
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
  std::vector<TurnSpan> turn_spans;
};

// Each token's policy version (Completion::token_versions): a model turn's tokens that of the
// turn; an environment token that of the next model turn, or of the last one when none follows
// (`none` when the episode has no turn), so that versions never go down along the completion.
std::vector<int64_t> TokenVersions(const Episode& e, int64_t none) {
  std::vector<int64_t> v(e.completion.token_ids.size(), -1);
  for (const TurnSpan& t : e.turn_spans) {
    std::fill(v.begin() + static_cast<std::ptrdiff_t>(t.begin),
              v.begin() + static_cast<std::ptrdiff_t>(t.end), t.version);
  }
  int64_t next = e.turn_spans.empty() ? none : e.turn_spans.back().version;
  for (size_t k = v.size(); k-- > 0;) {
    if (v[k] < 0) {
      v[k] = next;
    } else {
      next = v[k];
    }
  }
  return v;
}

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

// A deque addressed by indices that only grow: elements are appended at the back and dropped
// from the front, and the others keep their index and their address (StepsInFlight's threads
// hold references to episodes; rows and calls name them by index).
template <typename T>
class Indexed {
 public:
  T& operator[](size_t i) { return items_[i - base_]; }
  const T& operator[](size_t i) const { return items_[i - base_]; }
  size_t begin() const { return base_; }  // the first index held
  size_t end() const { return base_ + items_.size(); }
  T& front() { return items_.front(); }
  T& back() { return items_.back(); }
  bool empty() const { return items_.empty(); }
  void push_back(T x) { items_.push_back(std::move(x)); }
  void pop_front() {
    items_.pop_front();
    ++base_;
  }

 private:
  std::deque<T> items_;
  size_t base_ = 0;
};

// One prompt's group of episodes in a run.
struct Group {
  ProduceInput in;                  // its prompt is the caller's until the group is handed back
  int64_t tag = 0;                  // the caller's
  std::vector<int32_t> prompt_ids;  // truncated as Generate's; shown resets cut its tail
  bool truncated = false;
  Status prompt_error;  // the prompt cannot be generated from: the group fails at once
  GroupShow show;
  size_t first = 0;             // its first episode in the run's episodes
  int64_t oldest_version = -1;  // of its turns
  int64_t newest_version = -1;
  bool handed_back = false;
};

// The groups whose environment answered a reset with messages show them to the model: the
// group's prompt (Group::prompt_ids) loses its generation prompt (options.generation_tail), and
// every episode of it starts with environment tokens, its own reset messages rendered as turns
// followed by the generation prompt, or the generation prompt alone when its reset had none. So
// a group's episodes share one prompt while each sees its own reset observation (TRL appends it
// to each rollout's prompt; our group has one). These tokens count in max_completion_length, as
// every observation does; a prompt that does not end with the generation prompt (a "prompt"
// string row), or a reset observation that leaves no room for a model turn, fails the episode.
// Runs on the episodes just reset (`wave`); a group decides with its first wave (all of it
// when num_generations fits in env_max_concurrency), and an episode of a later wave whose reset
// carries messages when its group's earlier episodes showed none fails (their prompt is fixed).
void ShowResetObservations(const EpisodeOptions& options, Indexed<Group>& groups,
                           Indexed<Episode>& episodes, const std::vector<size_t>& wave,
                           EpisodeCounts& counts) {
  for (size_t i : wave) {
    const Episode& e = episodes[i];
    GroupShow& g = groups[e.group].show;
    if (g.decision != GroupShow::kUndecided) continue;
    bool shows = false;
    for (size_t j : wave) {
      const Episode& o = episodes[j];
      shows = shows || (o.group == e.group && o.error.ok() && !o.reset_messages.empty());
    }
    g.decision = shows ? GroupShow::kYes : GroupShow::kNo;
    if (!shows) continue;
    const std::vector<int32_t>& tail = options.generation_tail;
    std::vector<int32_t>& p = groups[e.group].prompt_ids;
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
    const GroupShow& g = groups[e.group].show;
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

namespace {

// The episodes of a call (ProduceEpisodes) or a stream (StreamEpisodes) and their groups, as
// the loop advances them: groups are added, their episodes admitted as sessions free up (opened
// and reset on StepsInFlight's threads), turned into rows when ready, stepped after each turn,
// and each group handed back once none of its episodes is live or has a call in flight.
// Runs on one thread (the loop's); only StepsInFlight's threads touch an episode meanwhile, one
// at a time, each with its episode to itself until TakeFinished hands its result back.
class EpisodeRun {
 public:
  EpisodeRun(const Generator& generator, Environment& environment, const EpisodeOptions& options)
      : generator_(generator), environment_(environment), options_(options) {}

  // A group of num_generations episodes of `in`; its prompt truncated or refused as Generate's
  // (a refused one is finished at once, with its error).
  void Add(const ProduceInput& in, int64_t tag, const std::string& where) {
    const GeneratorOptions& gen = generator_.options();
    Group g;
    g.in = in;
    g.tag = tag;
    g.first = episodes_.end();
    std::vector<int32_t> p = in.prompt != nullptr ? in.prompt->ids : std::vector<int32_t>{};
    if (in.prompt == nullptr) {
      g.prompt_error = Status::InvalidArgument(where + "no prompt");
    } else if (p.empty()) {
      g.prompt_error = Status::InvalidArgument(where + "empty prompt");
    } else if (gen.max_prompt_length > 0 &&
               static_cast<int64_t>(p.size()) > gen.max_prompt_length) {
      if (gen.truncate_prompt == "reject") {
        g.prompt_error = Status::InvalidArgument(
            where + std::to_string(p.size()) + " tokens > max_prompt_length " +
            std::to_string(gen.max_prompt_length) + " (truncate_prompt: reject)");
      } else {
        p.erase(p.begin(), p.end() - gen.max_prompt_length);
        g.truncated = true;
      }
    }
    g.prompt_ids = std::move(p);
    const size_t index = groups_.end();
    groups_.push_back(std::move(g));
    if (!groups_.back().prompt_error.ok()) return;
    for (int64_t k = 0; k < gen.num_generations; ++k) {
      Episode e;
      e.group = index;
      e.generation = k;
      e.budget = CompletionBudget(*in.prompt, gen.max_completion_length);
      episodes_.push_back(std::move(e));
    }
    counts_.episodes += gen.num_generations;
  }

  // Before each turn: the resets and steps back, failed groups stopped, ended episodes' keys and
  // values freed, sessions freed up given to the next episodes.
  void BetweenTurns() {
    TakeFinished();
    StopFailedGroups();
    for (size_t i = episodes_.begin(); i < episodes_.end(); ++i) {
      const Episode& e = episodes_[i];
      if (!e.live) turn_cache_.Release(groups_[e.group].in.seed_index, e.generation);
    }
    Admit();
  }

  // An episode may take its next model turn once it is admitted, its group's resets are back
  // and shown, and neither its step nor its last turn is in flight.
  bool Ready(size_t i) const {
    const Episode& e = episodes_[i];
    return e.live && e.shown && !e.stepping && !e.decoding;
  }
  // The episodes not handed back yet (with their groups): [first_episode(), end_episode()).
  size_t first_episode() const { return episodes_.begin(); }
  size_t end_episode() const { return episodes_.end(); }
  // Episodes added and not admitted yet (live: a failed group's are skipped).
  bool Waiting() const { return next_ < episodes_.end(); }
  // Sessions free for more episodes, beyond those added and waiting.
  int64_t FreeSessions() const {
    int64_t waiting = 0;
    for (size_t i = next_; i < episodes_.end(); ++i) waiting += episodes_[i].live ? 1 : 0;
    return options_.max_concurrent_sessions - HeldSessions() - waiting;
  }
  int64_t max_sessions() const { return options_.max_concurrent_sessions; }
  StepsInFlight& steps() { return steps_; }
  TurnCache* cache() { return options_.keep_kv_cache ? &turn_cache_ : nullptr; }
  EpisodeCounts& counts() { return counts_; }

  Continuation RowOf(size_t i) const {
    const Episode& e = episodes_[i];
    const Group& g = groups_[e.group];
    Continuation row;
    row.context = g.prompt_ids;
    row.context.insert(row.context.end(), e.completion.token_ids.begin(),
                       e.completion.token_ids.end());
    row.seed_index = g.in.seed_index;
    row.generation = e.generation;
    row.turn = e.turns;
    row.max_new_tokens = e.budget - static_cast<int64_t>(e.completion.token_ids.size());
    row.tag = static_cast<int64_t>(i);
    return row;
  }
  void SetDecoding(size_t i, bool decoding) { episodes_[i].decoding = decoding; }

  // A model turn of episode i: appended to it, then its environment step runs on a thread of
  // its own (which has the episode's session, last turn and tool counts to itself until
  // TakeFinished hands its result back), unless the turn hit the episode's budget. An episode
  // whose group failed while it decoded drops the turn.
  void ApplyTurn(size_t i, Completion& t, int64_t version) {
    Episode& e = episodes_[i];
    if (!e.live) return;
    Group& g = groups_[e.group];
    g.oldest_version = g.oldest_version < 0 ? version : std::min(g.oldest_version, version);
    g.newest_version = std::max(g.newest_version, version);
    Completion& c = e.completion;
    e.turn_spans.push_back({c.token_ids.size(), c.token_ids.size() + t.token_ids.size(), version});
    c.token_ids.insert(c.token_ids.end(), t.token_ids.begin(), t.token_ids.end());
    c.logprobs.insert(c.logprobs.end(), t.logprobs.begin(), t.logprobs.end());
    c.env_mask.insert(c.env_mask.end(), t.token_ids.size(), 1);
    e.last_turn = std::move(t.text);
    e.turns += 1;
    counts_.turns += 1;
    if (t.truncated) {  // cut by max_completion_length: never stepped, never continued
      c.truncated = true;
      counts_.length_truncated += 1;
      e.live = false;
      e.session.reset();  // the episode is over: free the environment's session
      return;
    }
    e.stepping = true;
    steps_.Launch(i, [&e, &options = options_]() -> StatusOr<EnvObservation> {
      const auto deadline = Clock::now() + options.step_timeout;
      return e.uses_tools ? StepToolTurn(*e.session, e.last_turn, deadline, &e.tools)
                          : e.session->Step(e.last_turn, deadline);
    });
  }

  // The groups none of whose episodes is live or has a call in flight, each once, as they
  // finish: built (not scored), with each episode's environment feedback. A group whose episode
  // failed carries the first failure.
  std::vector<EpisodeGroup> TakeFinishedGroups() {
    std::vector<EpisodeGroup> out;
    const size_t g_per = static_cast<size_t>(generator_.options().num_generations);
    for (size_t k = groups_.begin(); k < groups_.end(); ++k) {
      Group& g = groups_[k];
      if (g.handed_back) continue;
      const size_t n = g.prompt_error.ok() ? g_per : 0;
      bool busy = false;
      for (size_t i = g.first; i < g.first + n; ++i) {
        const Episode& e = episodes_[i];
        busy = busy || e.live || e.stepping || e.resetting || e.decoding;
      }
      if (busy) continue;
      out.push_back(Build(g, n));
      g.handed_back = true;
    }
    // Handed back from the front: their episodes are no longer needed (none has a call in
    // flight), so a stream's memory holds the groups in flight only.
    while (!groups_.empty() && groups_.front().handed_back) {
      const size_t n = groups_.front().prompt_error.ok() ? g_per : 0;
      for (size_t i = 0; i < n; ++i) episodes_.pop_front();
      groups_.pop_front();
    }
    next_ = std::max(next_, episodes_.begin());  // a failed group's episodes never admitted
    return out;
  }

 private:
  EpisodeGroup Build(Group& g, size_t n) {
    EpisodeGroup out;
    out.tag = g.tag;
    out.produced.prompt_truncated = g.truncated;
    out.prompt_refused = !g.prompt_error.ok();
    out.produced.prompt_failed = out.prompt_refused;
    Status failed = g.prompt_error;
    for (size_t i = g.first; i < g.first + n; ++i) {
      Episode& e = episodes_[i];
      counts_.tools.Add(e.tools);
      if (e.error.ok()) continue;
      counts_.errors[std::string(EnvErrorKind(e.error))] += 1;
      if (failed.ok()) {
        failed = e.error.WithContext("episode " + std::to_string(e.generation) + " of " +
                                     environment_.name());
      }
    }
    if (!failed.ok()) {
      out.produced.group = failed;
      return out;
    }
    RolloutGroup group;
    group.policy_version = g.oldest_version;
    group.prompt_ids = g.prompt_ids;
    for (size_t i = g.first; i < g.first + n; ++i) {
      Episode& e = episodes_[i];
      e.completion.text = e.last_turn;
      if (e.uses_tools) {
        e.completion.uses_tools = true;
        e.completion.tool_calls = static_cast<int32_t>(e.tools.calls);
        int64_t failures = 0;
        for (const auto& [reason, k] : e.tools.failures) failures += k;
        e.completion.tool_call_failures = static_cast<int32_t>(failures);
      }
      // Turns of more than one policy (a newer one taken between two turns): every row records
      // its tokens' versions, as a Generate call that switched in flight does.
      if (g.newest_version != g.oldest_version) {
        e.completion.token_versions = TokenVersions(e, g.oldest_version);
      }
      group.completions.push_back(std::move(e.completion));
      // The sum of its step rewards (0 when the environment gave none), its last metadata.
      out.feedback.push_back({e.reward, std::move(e.metadata)});
    }
    out.produced.group = std::move(group);
    return out;
  }

  // Sessions held now: a resetting episode's session is its thread's until the reset is back.
  int64_t HeldSessions() const {
    int64_t held = 0;
    for (size_t i = episodes_.begin(); i < episodes_.end(); ++i) {
      held += episodes_[i].resetting || episodes_[i].session != nullptr ? 1 : 0;
    }
    return held;
  }

  // A failed episode fails its group: the group's other episodes stop too (nothing of it trains),
  // those not admitted yet included.
  void StopFailedGroups() {
    std::vector<bool> failed(groups_.end() - groups_.begin(), false);
    const auto failed_of = [&](const Episode& e) { return failed[e.group - groups_.begin()]; };
    for (size_t i = episodes_.begin(); i < episodes_.end(); ++i) {
      const Episode& e = episodes_[i];
      failed[e.group - groups_.begin()] = failed_of(e) || !e.error.ok();
    }
    for (size_t i = episodes_.begin(); i < episodes_.end(); ++i) {
      Episode& e = episodes_[i];
      if (failed_of(e) && e.live) {
        e.live = false;
        if (!e.stepping && !e.resetting) e.session.reset();  // else once its thread is back
        counts_.stopped += 1;
      }
    }
  }

  // Takes the finished resets and steps. A wave's episodes are shown (ShowResetObservations:
  // a group decides with its first wave) once all of its resets are back.
  void TakeFinished() {
    for (StepsInFlight::Finished& f : steps_.TakeFinished()) {
      Episode& e = episodes_[f.episode];
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
        if (--wave_left_[e.wave] == 0) {
          ShowResetObservations(options_, groups_, episodes_, waves_[e.wave], counts_);
          for (size_t i : waves_[e.wave]) episodes_[i].shown = true;
          std::vector<size_t>().swap(waves_[e.wave]);  // done with (a stream's waves only grow)
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
        ApplyObservation(options_, e.turns - 1, *f.result, e, counts_);
      }
      if (!e.live) e.session.reset();  // the episode is over: free the environment's session
    }
  }

  // At most max_concurrent_sessions sessions are held at once (an environment server allows so
  // many): episodes are admitted in order, a session opened and reset for each, as sessions free
  // up; a whole group at a time when num_generations fits (its first turn prefills the prompt
  // once for all of it), else as many of its episodes as fit. Opens and resets run concurrently.
  // Without overlap_env_steps the loop waits for a wave's resets, which then join this turn;
  // with it, the wave joins the first turn after its resets are back.
  void Admit() {
    const int64_t g = generator_.options().num_generations;
    const int64_t cap = options_.max_concurrent_sessions;
    const int64_t held = HeldSessions();
    std::vector<size_t> wave;
    while (next_ < episodes_.end() && held + static_cast<int64_t>(wave.size()) < cap) {
      if (!episodes_[next_].live) {  // its group failed before it started
        ++next_;
        continue;
      }
      const size_t group = episodes_[next_].group;
      int64_t rest = 0;  // of the group, from `next_` on
      for (size_t i = next_; i < episodes_.end() && episodes_[i].group == group; ++i) ++rest;
      const int64_t free = cap - held - static_cast<int64_t>(wave.size());
      if (rest > free && g <= cap) break;  // the whole group when it fits
      for (int64_t k = 0; k < std::min(rest, free); ++k) wave.push_back(next_++);
    }
    if (wave.empty()) return;
    // One wave per group: a group's episodes are shown (and start) together, whatever the
    // other groups' resets do.
    const size_t first = waves_.size();
    for (size_t i : wave) {
      Episode& e = episodes_[i];
      if (waves_.size() == first || episodes_[waves_.back().front()].group != e.group) {
        waves_.emplace_back();
        wave_left_.push_back(0);
      }
      e.wave = static_cast<int64_t>(waves_.size()) - 1;
      e.resetting = true;
      waves_.back().push_back(i);
      wave_left_.back() += 1;
      steps_.Launch(i, [&environment = environment_, &options = options_, &in = groups_[e.group].in,
                        &e] { return OpenAndReset(environment, options, in, e); });
    }
    if (!options_.overlap_env_steps) {
      const auto waits = Clock::now();
      steps_.WaitAll();
      counts_.env_wait_seconds += std::chrono::duration<double>(Clock::now() - waits).count();
      TakeFinished();
      StopFailedGroups();
    }
  }

  const Generator& generator_;
  Environment& environment_;
  const EpisodeOptions& options_;
  EpisodeCounts counts_;
  Indexed<Group> groups_;      // those not handed back yet
  Indexed<Episode> episodes_;  // theirs
  // Declared after `episodes_`, which its threads use: it joins them first.
  StepsInFlight steps_;
  std::vector<std::vector<size_t>> waves_;  // the episodes of one group admitted together
  std::vector<size_t> wave_left_;           // per wave, resets not back yet
  size_t next_ = 0;                         // the first episode not admitted
  TurnCache turn_cache_;                    // the live episodes' keys/values between turns
};

// Turn by turn: every live episode's step comes back, then one Continue call decodes the next
// turn of them all.
Status RunInTurns(const Generator& generator, EpisodeRun& run, double* generate_seconds,
                  int64_t* tokens) {
  for (;;) {
    if (run.steps().pending() > 0) {
      const auto waits = Clock::now();
      run.steps().WaitAll();
      run.counts().env_wait_seconds += std::chrono::duration<double>(Clock::now() - waits).count();
    }
    run.BetweenTurns();
    std::vector<size_t> live;
    std::vector<Continuation> rows;
    for (size_t i = run.first_episode(); i < run.end_episode(); ++i) {
      if (!run.Ready(i)) continue;
      live.push_back(i);
      rows.push_back(run.RowOf(i));
    }
    if (live.empty()) {
      if (run.steps().pending() > 0) continue;  // every live episode resets or steps: wait above
      if (run.Waiting()) continue;              // every admitted one failed at reset: admit more
      return Status::OK();
    }
    const auto t0 = Clock::now();
    ASSIGN_OR_RETURN(ContinueResult next_turn, generator.Continue(rows, run.cache()));
    *generate_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    *tokens += next_turn.num_completion_tokens;
    for (size_t j = 0; j < live.size(); ++j) {
      run.ApplyTurn(live[j], next_turn.completions[j], next_turn.policy_version);
    }
  }
}

// The episodes join and leave one running decode (ContinueStream): an episode whose step or
// reset comes back starts its next turn at the next decode step, and one whose turn stops steps
// at once, so a slow step or reset holds up its own episode only, and no episode waits for a
// longer turn. The batches follow the environment's timing. With a `feed`, more groups are
// added as sessions free up, and each group goes to it as soon as it is finished.
Status RunStreaming(const Generator& generator, EpisodeRun& run, EpisodeFeed* feed,
                    double* generate_seconds, int64_t* tokens) {
  double waits = 0.0;              // inside `take`, nothing decoding
  bool fed_out = feed == nullptr;  // the feed answered an idle call with nothing
  const auto hand_back = [&] {
    if (feed == nullptr) return;
    for (EpisodeGroup& g : run.TakeFinishedGroups()) {
      g.counts = std::exchange(run.counts(), EpisodeCounts{});
      feed->done(std::move(g));
    }
  };
  // More groups from the feed while sessions are free and none waits to start; true when it
  // added some.
  const auto refill = [&](bool idle) {
    // Whole groups when one fits in the sessions (Admit starts a group whole then), else one
    // group once a session is free.
    const int64_t g = generator.options().num_generations;
    const int64_t free = run.FreeSessions();
    const int64_t room = g <= run.max_sessions() ? free / g : std::min<int64_t>(free, 1);
    if (fed_out || run.Waiting() || room <= 0) return false;
    std::vector<FedPrompt> more = feed->take(room, idle);
    if (idle && more.empty()) fed_out = true;
    for (FedPrompt& p : more) {
      run.Add(p.input, p.tag, "prompt (tag " + std::to_string(p.tag) + "): ");
    }
    return !more.empty();
  };
  TurnStream stream;
  stream.take = [&](bool idle) {
    std::vector<Continuation> rows;
    const auto take_ready = [&] {
      for (size_t i = run.first_episode(); i < run.end_episode(); ++i) {
        if (!run.Ready(i)) continue;
        run.SetDecoding(i, true);
        rows.push_back(run.RowOf(i));
      }
    };
    for (;;) {
      run.BetweenTurns();
      hand_back();
      take_ready();
      // The feed is asked idle (it may block) only when nothing is in flight: no episode is
      // ready to decode, steps, resets or waits for a session, so every group is handed back.
      const bool quiet = rows.empty() && run.steps().pending() == 0 && !run.Waiting();
      if (feed != nullptr && !fed_out && refill(idle && quiet)) {
        run.BetweenTurns();  // admit them
        take_ready();
      }
      if (!rows.empty() || !idle) return rows;
      if (run.steps().pending() == 0) {
        if (run.Waiting()) continue;  // every admitted one failed at reset: admit more
        if (!fed_out) continue;       // the feed added groups, or may (an idle call ends it)
        hand_back();
        return rows;  // every episode ended
      }
      const auto t0 = Clock::now();
      run.steps().WaitAny();
      const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
      run.counts().env_wait_seconds += waited;
      waits += waited;
    }
  };
  stream.done = [&](StreamedTurn turn) {
    const size_t i = static_cast<size_t>(turn.tag);
    run.SetDecoding(i, false);
    run.ApplyTurn(i, turn.completion, turn.policy_version);
  };
  const auto t0 = Clock::now();
  StatusOr<TurnStreamStats> stats = generator.ContinueStream(stream, run.cache());
  *generate_seconds += std::chrono::duration<double>(Clock::now() - t0).count() - waits;
  if (!stats.ok()) return stats.status();
  *tokens += stats->num_completion_tokens;
  return Status::OK();
}

}  // namespace

StatusOr<ProduceResult> ProduceEpisodes(const Generator& generator, const RewardRunner* rewards,
                                        Environment& environment, const EpisodeOptions& options,
                                        const std::vector<ProduceInput>& inputs,
                                        EpisodeCounts* counts_out) {
  RETURN_IF_ERROR(options.Validate());
  ProduceResult out;
  out.policy_version = generator.policy_version();
  if (inputs.empty()) return out;
  for (const ProduceInput& in : inputs) {
    if (in.prompt == nullptr) {
      return Status::InvalidArgument("ProduceEpisodes: an input has no prompt");
    }
  }
  EpisodeRun run(generator, environment, options);
  for (size_t i = 0; i < inputs.size(); ++i) {
    run.Add(inputs[i], static_cast<int64_t>(i), "prompt " + std::to_string(i) + ": ");
  }
  RETURN_IF_ERROR(
      options.overlap_env_steps
          ? RunStreaming(generator, run, nullptr, &out.generate_seconds, &out.num_completion_tokens)
          : RunInTurns(generator, run, &out.generate_seconds, &out.num_completion_tokens));
  // Every group is finished: in input order (tag = index), scored.
  std::vector<EpisodeGroup> groups(inputs.size());
  for (EpisodeGroup& g : run.TakeFinishedGroups()) {
    const size_t i = static_cast<size_t>(g.tag);
    groups[i] = std::move(g);
  }
  int64_t oldest = -1;
  for (const EpisodeGroup& g : groups) {
    if (!g.produced.group.ok()) continue;
    const int64_t v = g.produced.group->policy_version;
    oldest = oldest < 0 ? v : std::min(oldest, v);
  }
  if (oldest >= 0) out.policy_version = oldest;
  out.groups.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    EpisodeGroup& g = groups[i];
    out.num_prompts_truncated += g.produced.prompt_truncated ? 1 : 0;
    out.num_prompts_failed += g.prompt_refused ? 1 : 0;
    ScoreEpisodeGroup(rewards, *inputs[i].prompt, g);
    out.groups.push_back(std::move(g.produced));
  }
  if (counts_out != nullptr) *counts_out = std::move(run.counts());
  return out;
}

StatusOr<EpisodeStreamStats> StreamEpisodes(const Generator& generator, Environment& environment,
                                            const EpisodeOptions& options, EpisodeFeed& feed) {
  RETURN_IF_ERROR(options.Validate());
  if (!feed.take || !feed.done) {
    return Status::InvalidArgument("StreamEpisodes: the feed needs both take and done");
  }
  EpisodeOptions streaming = options;
  streaming.overlap_env_steps = true;  // resets waited for in the stream, not at admission
  EpisodeRun run(generator, environment, streaming);
  EpisodeStreamStats stats;
  RETURN_IF_ERROR(
      RunStreaming(generator, run, &feed, &stats.generate_seconds, &stats.num_completion_tokens));
  stats.counts = std::move(run.counts());
  return stats;
}

void ScoreEpisodeGroup(const RewardRunner* rewards, const Prompt& prompt, EpisodeGroup& group) {
  if (rewards == nullptr || !group.produced.group.ok()) return;
  group.produced.rewards =
      rewards->ScoreGroup(*group.produced.group, prompt.text, prompt.row, group.feedback);
}

}  // namespace grpo::rollout
