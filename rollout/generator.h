// Generator: batched generation of GRPO groups with a KV cache. Every prompt is prefilled once,
// its cache is copied to num_generations rows that share the prompt's keys/values, and all rows
// of all prompts decode together; finished rows leave the batch (Model::KeepRows).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/config.h"
#include "common/model/model.h"
#include "common/mutex.h"
#include "common/rollout_types.h"
#include "common/status.h"
#include "common/thread_annotations.h"
#include "common/tokenizer/tokenizer.h"
#include "rollout/sampler.h"

namespace grpo::rollout {

// Stop-check interval on a GPU: one host sync per 16 tokens instead of one per token.
inline constexpr int64_t kDefaultCudaStopCheckInterval = 16;

struct GeneratorOptions {
  SamplingParams sampling;
  int64_t num_generations = 8;          // G: completions per prompt
  int64_t max_prompt_length = 512;      // tokens; <= 0 = no limit
  int64_t max_completion_length = 256;  // tokens, EOS included
  // "left": keep the LAST max_prompt_length tokens (TRL) and count it; "reject": that prompt
  // fails with InvalidArgument.
  std::string truncate_prompt = "left";
  // Empty = the policy config's eos_token_ids plus the tokenizer's eos (when there is one).
  std::vector<int32_t> eos_token_ids;
  std::vector<int32_t> stop_token_ids;  // also end a completion (kept in token_ids)
  // End a completion once its decoded text contains one; needs a tokenizer. The tokens stay up
  // to the one that completed the stop string; `text` is cut before it.
  std::vector<std::string> stop_strings;
  uint64_t seed = 42;  // with (prompt index, generation index) seeds each row's sampler
  // Decode steps between stop checks (the one device-to-host copy of the tokens, log-probs and
  // finished rows): 0 = auto, 1 on the CPU and kDefaultCudaStopCheckInterval on a GPU. Rows
  // that finish inside a window keep decoding until its end and their extra tokens are dropped,
  // so the groups are the same for every interval (up to the numerics of a larger batch).
  // stop_strings need the text of every token: they force 1.
  int64_t stop_check_interval = 0;
  // In-flight weight updates (config partial_rollouts): a Generate call whose snapshot is
  // replaced by SetPolicy while it decodes switches to the new policy at the end of the current
  // stop-check window, and every token records the version that sampled it
  // (Completion::token_versions). Without it a call keeps its one snapshot to the end.
  bool partial_rollouts = false;
  // At such a switch: true ("recompute") re-prefills every unfinished row's tokens so far under
  // the new weights, so no key/value is read under weights other than those that computed it;
  // false ("keep") reads the old keys/values under the new weights (the peers' default).
  bool recompute_kv_on_update = true;
  // Tests: runs on the decoding thread at the end of each stop-check window with the decode steps
  // done so far, before the in-flight check (so a SetPolicy from it is taken at that window).
  std::function<void(int64_t steps)> window_hook;

  // Sampling keys, num_generations, lengths, truncate_prompt and seed from a GrpoConfig.
  static GeneratorOptions FromConfig(const common::GrpoConfig& config);
  // InvalidArgument naming the key.
  Status Validate() const;
};

struct GenerateResult {
  int64_t policy_version = 0;  // the one snapshot every group below was generated with
  // One per prompt, in input order: the group (prompt_ids after truncation, G completions with
  // token_ids, behaviour logprobs, truncated flag, text when a tokenizer is set), or an
  // InvalidArgument naming the prompt index (empty, out-of-vocabulary id, too long + reject).
  std::vector<StatusOr<common::RolloutGroup>> groups;
  int64_t num_prompts_truncated = 0;  // cut from the left to max_prompt_length
  int64_t num_prompts_failed = 0;
  int64_t num_completion_tokens = 0;
};

// One prompt for GenerateStream.
struct StreamPrompt {
  std::vector<int32_t> ids;
  int64_t seed_index = 0;  // as Generate's prompt_indices: seeds the group's samplers
  int64_t tag = 0;         // the caller's; handed back with the group
  // The group's budget: 0 = max_completion_length, else in [1, max_completion_length] (a
  // prompt outside fails with InvalidArgument).
  int64_t max_new_tokens = 0;
};

struct StreamedGroup {
  int64_t tag = 0;
  // As GenerateResult::groups' entries; policy_version is the version the group started with
  // (its oldest token's).
  StatusOr<common::RolloutGroup> group;
  bool prompt_truncated = false;  // cut from the left to max_prompt_length
};

// The caller's side of GenerateStream. Both functions run on the decoding thread.
struct GroupStream {
  // Up to `room` (>= 1) prompts to start now, with the policy of `version` (their groups'
  // policy_version). `idle`: nothing decodes, so the call may wait for prompts (under a deadline
  // of its own), and an empty answer ends the stream. Not idle: it should return at once (the
  // rows in flight wait for it).
  std::function<std::vector<StreamPrompt>(int64_t room, bool idle, int64_t version)> take;
  // Each group as soon as its num_generations completions are done, or its prompt failed.
  std::function<void(StreamedGroup)> done;
  int64_t max_prompts = 4;  // groups decoding at once, >= 1
};

struct StreamStats {
  int64_t num_groups = 0;  // handed to `done`, failed prompts included
  int64_t num_completion_tokens = 0;
  int64_t num_switches = 0;  // policy versions taken while the stream ran
  // Without partial_rollouts: times admission paused for the groups in flight to finish
  // before a newer policy could be taken.
  int64_t num_drains = 0;
  int64_t max_rows = 0;  // the most rows decoding at once
  // Tokens the in-flight switches that recompute ran through the model: each group's prompt
  // once for its rows, then every row's completion so far.
  int64_t num_recompute_tokens = 0;
};

// One row to continue (a multi-turn episode's next model turn): the episode's tokens so far and
// its own sampler stream.
struct Continuation {
  std::vector<int32_t> context;  // prompt + earlier turns and observations; not truncated
  int64_t seed_index = 0;        // as Generate's prompt_indices
  int64_t generation = 0;        // the episode's index in its group
  int64_t turn = 0;              // 0 = the first model turn (then the stream equals Generate's)
  int64_t max_new_tokens = 0;    // in [1, max_completion_length]: what the episode has left
  int64_t tag = 0;               // the caller's; ContinueStream hands it back with the turn
};

struct ContinueResult {
  int64_t policy_version = 0;                   // the one snapshot every row was generated with
  std::vector<common::Completion> completions;  // one per row, in order (truncated = hit its
                                                // max_new_tokens)
  int64_t num_completion_tokens = 0;
  int64_t num_prefill_tokens = 0;  // context tokens run through the model (shared ones once)
  int64_t num_cached_tokens = 0;   // context tokens whose keys/values came from a TurnCache
};

// One row's turn out of ContinueStream.
struct StreamedTurn {
  int64_t tag = 0;                // the Continuation's
  int64_t policy_version = 0;     // of the snapshot that sampled every token of the turn
  common::Completion completion;  // as Continue's
};

// The caller's side of ContinueStream. Both functions run on the decoding thread, between two
// decode steps; they may Release rows of the stream's TurnCache (not the rows decoding).
struct TurnStream {
  // Rows to start now (each with the caller's tag; no row twice at once). `idle`: nothing
  // decodes, so the call may wait for rows, and an empty answer ends the stream. Not idle: it
  // should return at once (the rows in flight wait for it).
  std::function<std::vector<Continuation>(bool idle)> take;
  // Each row's turn as soon as it stopped.
  std::function<void(StreamedTurn)> done;
};

struct TurnStreamStats {
  int64_t num_turns = 0;  // handed to `done`
  int64_t num_completion_tokens = 0;
  int64_t num_prefill_tokens = 0;  // as ContinueResult's, over every row taken
  int64_t num_cached_tokens = 0;
  int64_t num_switches = 0;  // newer policies taken (each when nothing decoded)
  int64_t num_decode_steps = 0;
  int64_t max_rows = 0;  // the most rows decoding at once
};

// The KV caches of multi-turn rows between their Continue calls, so that a row's next turn
// prefills only what was appended since (its last generated token and the observation) instead
// of its whole context. Entries are keyed by (seed_index, generation) and hold the exact token
// ids their keys/values were computed from; a row reuses the longest common prefix of those
// ids and its new context, so a wrong key or an edited context costs speed, never correctness.
// Memory: per row, 2 x layers x kv_heads x head_dim values of the policy's dtype on its device
// per token of context + completion, held from the end of a Continue call until the next call
// that continues the row (which replaces it), Release, Clear, a policy change (the next call
// drops every row and prefills whole contexts), or destruction. Rows a call does not continue
// stay (an episode whose environment step is still running when the others' turn decodes).
// Not thread-safe: one per caller (e.g. one per ProduceEpisodes call); movable, not copyable.
class TurnCache {
 public:
  TurnCache() = default;
  TurnCache(TurnCache&&) = default;
  TurnCache& operator=(TurnCache&&) = default;
  TurnCache(const TurnCache&) = delete;
  TurnCache& operator=(const TurnCache&) = delete;

  int64_t policy_version() const { return version_; }  // of the held rows; -1 = none yet
  int64_t num_rows() const { return static_cast<int64_t>(rows_.size()); }
  int64_t num_tokens() const;  // tokens whose keys/values are held, over all rows
  int64_t bytes() const;       // keys and values held, over all rows
  // Frees the row of (seed_index, generation), if held (an episode that ended).
  void Release(int64_t seed_index, int64_t generation);
  void Clear();

 private:
  friend class Generator;
  struct Entry {
    std::vector<int32_t> tokens;  // the ids of the held columns, in order
    common::KvCache kv;           // one dense row (Model::CompactRow)
  };
  // Empties the cache unless it holds rows of this snapshot; then holds rows of it.
  void Bind(int64_t version, const common::Model* model);
  // Removes the row of (seed_index, generation) and returns how many leading tokens of
  // `context` it holds (at most context.size() - 1: one is left to prefill), its keys/values
  // moved to *kv when that is > 0.
  int64_t Take(int64_t seed_index, int64_t generation, const std::vector<int32_t>& context,
               common::KvCache* kv);
  // Take for each row: (*held)[i] and (*reuse)[i] (resized to the rows); the tokens reused.
  int64_t TakeRows(const std::vector<Continuation>& rows, std::vector<common::KvCache>* held,
                   std::vector<int64_t>* reuse);
  // Holds `kv`, the keys/values of `context` and `completion` but its last token (never fed).
  void Put(int64_t seed_index, int64_t generation, const std::vector<int32_t>& context,
           const std::vector<int32_t>& completion, common::KvCache kv);
  int64_t version_ = -1;
  const common::Model* model_ = nullptr;  // identity only, never dereferenced
  std::map<std::pair<int64_t, int64_t>, Entry> rows_;
};

// The sampler stream index of turn `turn` of generation `generation` (MakeRowGenerator's
// generation_index): `generation` for turn 0, so a first turn samples what Generate would.
int64_t ContinuationStream(int64_t generation, int64_t turn);

// A non-owning snapshot of `model` for Generator (no deleter): the caller keeps `model` alive,
// and unchanged, for as long as a Generator may use it.
std::shared_ptr<const common::Model> BorrowModel(const common::Model& model);

// Runs on the policy's device in its dtype (logits are upcast to fp32 for sampling); the
// per-row random streams are CPU generators whose uniforms are copied to the device once per
// stop-check window.
// Thread-safe: Generate may run concurrently from several threads (each call owns its KV
// cache) and concurrently with SetPolicy.
//
// Weight updates: a Generate call takes one policy snapshot (shared_ptr) at its start and uses
// it for every token of the call, so a group never mixes two versions and records the version
// of that snapshot (the learner's staleness check relies on it). SetPolicy affects later calls
// only; the old model is freed when the last call using it returns. With partial_rollouts a
// Generate call switches to a newer policy at the end of the stop-check window in which
// SetPolicy installed it (recomputing the unfinished rows' keys/values, or keeping them), each
// token records its version (Completion::token_versions, set on every row of a call that
// switched), and the groups keep the version they started with, their oldest token's. Continue
// never switches inside a turn (an episode takes the newest policy at its next turn).
class Generator {
 public:
  // InvalidArgument on bad options, a null policy, or stop_strings without a tokenizer.
  // `tokenizer` is borrowed (may be null: no text, no stop strings) and must outlive this.
  static StatusOr<std::unique_ptr<Generator>> Create(std::shared_ptr<const common::Model> policy,
                                                     int64_t policy_version,
                                                     GeneratorOptions options,
                                                     const common::Tokenizer* tokenizer = nullptr);

  // Installs the policy for the NEXT Generate call. InvalidArgument for a null policy or one
  // with a different vocabulary size.
  Status SetPolicy(std::shared_ptr<const common::Model> policy, int64_t version) GRPO_EXCLUDES(mu_);
  int64_t policy_version() const GRPO_EXCLUDES(mu_);
  const GeneratorOptions& options() const { return options_; }

  // prompts: token ids per prompt. prompt_indices: per prompt, the index that seeds its rows'
  // samplers (e.g. the dataset row), so its completions do not depend on the rest of the batch;
  // empty = the position in `prompts`. max_new_tokens: per prompt, its rows' budget in
  // [1, max_completion_length] (a row that reaches it is truncated), 0 or empty = the options'.
  // Whole-call errors: InvalidArgument (prompt_indices or max_new_tokens size), Internal
  // (libtorch). Per-prompt errors (a budget out of range too) are in GenerateResult::groups.
  StatusOr<GenerateResult> Generate(const std::vector<std::vector<int32_t>>& prompts,
                                    const std::vector<int64_t>& prompt_indices = {},
                                    const std::vector<int64_t>& max_new_tokens = {}) const;

  // Continuous batching: prompts enter while others decode, and each group leaves through
  // `stream.done` as soon as its rows are done, so one long group holds up no other. Rows
  // sample as Generate's do (a group streamed alone equals Generate's for the same prompt and
  // seed index, up to the numerics of a different batch). A newer policy (SetPolicy) is taken
  // with partial_rollouts as Generate takes it in flight (recompute or keep, per-token versions
  // on the groups whose tokens span two versions); without it, admission pauses until the
  // groups in flight are done (a drain), so a group never mixes versions. Returns when `take`
  // answers an idle call with nothing. InvalidArgument for a stream without both functions or
  // max_prompts < 1; Internal (libtorch): the groups in flight are lost.
  StatusOr<StreamStats> GenerateStream(const GroupStream& stream) const GRPO_EXCLUDES(mu_);

  // One completion per row, each from its own context (no prompt truncation: a context may be
  // longer than max_prompt_length), stopping as Generate's rows do or at the row's
  // max_new_tokens. Without `cache` the whole context is prefilled. With `cache` (borrowed; not
  // shared with a concurrent call), rows whose earlier turn this cache holds, computed with this
  // call's policy snapshot, prefill only the tokens after the held ones, and rows holding nothing
  // with equal contexts (a group's first turn) prefill it once for all; afterwards the cache
  // holds this call's rows (context + completion) in place of their earlier ones, and the rows
  // it held for others as they were. A policy change empties it first. The results equal the
  // no-cache path's up to float rounding (same tokens for the same seeds unless a sample falls
  // within ~1e-6 of a boundary). InvalidArgument naming the row (empty context, id outside the
  // vocabulary, max_new_tokens out of range), checked before the cache is touched; Internal
  // (libtorch), after which the cache is left empty (its rows were partly consumed).
  StatusOr<ContinueResult> Continue(const std::vector<Continuation>& rows,
                                    TurnCache* cache = nullptr) const;

  // Continue with rows that join and leave a running decode (multi-turn episodes whose
  // environment steps end at different times): each row starts when `stream.take` hands it over
  // and goes out through `stream.done` as soon as it stops, so no row waits for a longer one
  // nor for a row that is still in its environment. Rows sample as Continue's (their own
  // streams; the same tokens up to the numerics of another batch), use `cache` as Continue does
  // (each row's held keys/values when it is taken, its own kept when it stops), and a turn never
  // mixes versions: a newer policy is taken when nothing decodes (admission pauses for the rows
  // in flight to stop; the cache is emptied). Returns when `take` answers an idle call with
  // nothing. InvalidArgument for a stream without both functions or a bad row (as Continue's;
  // the rows in flight are lost, the cache keeps what it holds); Internal (libtorch): the rows
  // in flight are lost and the cache is left empty.
  StatusOr<TurnStreamStats> ContinueStream(const TurnStream& stream, TurnCache* cache) const
      GRPO_EXCLUDES(mu_);

  // Benchmark baseline (`grpo bench decode`): the same algorithm and results without a KV
  // cache: each step runs the full forward over every row's whole sequence.
  StatusOr<GenerateResult> GenerateRecomputeBaseline(
      const std::vector<std::vector<int32_t>>& prompts,
      const std::vector<int64_t>& prompt_indices = {}) const;

 private:
  Generator(std::shared_ptr<const common::Model> policy, int64_t version, GeneratorOptions options,
            const common::Tokenizer* tokenizer)
      : options_(std::move(options)),
        tokenizer_(tokenizer),
        policy_(std::move(policy)),
        version_(version) {}

  StatusOr<GenerateResult> Run(const std::vector<std::vector<int32_t>>& prompts,
                               const std::vector<int64_t>& prompt_indices,
                               const std::vector<int64_t>& max_new_tokens, bool use_cache) const
      GRPO_EXCLUDES(mu_);

  // The installed policy and its version.
  std::pair<std::shared_ptr<const common::Model>, int64_t> Snapshot() const GRPO_EXCLUDES(mu_);
  // The installed policy and its version when its version is not `version` (an in-flight
  // update to take); {null, version} otherwise.
  std::pair<std::shared_ptr<const common::Model>, int64_t> PolicyOtherThan(int64_t version) const
      GRPO_EXCLUDES(mu_);

  // Continue's kept keys/values in and out of Decode (g = 1, use_cache); defined in the .cc.
  struct TurnRows;

  // The decode loop: g rows per context (prompt-major), row r sampling from gens[r] and stopping
  // at row_max_new[r] tokens; adds the tokens generated to *num_completion_tokens. With `turn`,
  // starts from its held rows and leaves each row's keys/values in it. `model` is the snapshot
  // of policy `version`; with options_.partial_rollouts (and a KV cache, no `turn`) a newer
  // policy installed meanwhile is switched to between two windows.
  StatusOr<std::vector<common::Completion>> Decode(const common::Model& model, int64_t version,
                                                   const std::vector<std::vector<int32_t>>& ids,
                                                   int64_t g, std::vector<at::Generator> gens,
                                                   const std::vector<int64_t>& row_max_new,
                                                   bool use_cache, int64_t* num_completion_tokens,
                                                   TurnRows* turn = nullptr) const;

  const GeneratorOptions options_;
  const common::Tokenizer* const tokenizer_;  // borrowed, may be null

  mutable common::Mutex mu_;
  std::shared_ptr<const common::Model> policy_ GRPO_GUARDED_BY(mu_);
  int64_t version_ GRPO_GUARDED_BY(mu_);
};

}  // namespace grpo::rollout
