// The pieces of a decode loop that Generator's two loops share (rollout/generator.cc: one batch
// of prompts per call; rollout/generator_stream.cc: prompts admitted while others decode): the
// forward pass behind a loop (Stepper), a window of sampled tokens, the per-token stop rules, a
// prompt's checks. Internal to grpo_rollout: callers use rollout/generator.h.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/model/model.h"
#include "common/rollout_types.h"
#include "common/status.h"
#include "common/tokenizer/tokenizer.h"
#include "rollout/sampler.h"

namespace grpo::rollout {
struct Continuation;
struct GeneratorOptions;
}  // namespace grpo::rollout

namespace grpo::rollout::decode {

// The forward pass behind the decode loop: with a KV cache, or the recompute baseline.
class Stepper {
 public:
  virtual ~Stepper() = default;
  // ids, mask [P, L] (left-padded prompts) -> logits [P * g, V] of the first completion token.
  virtual at::Tensor Start(const at::Tensor& ids, const at::Tensor& mask, int64_t g,
                           int64_t capacity) = 0;
  // tokens [A] (one per current row) -> logits [A, V] of the next token.
  virtual at::Tensor Step(const at::Tensor& tokens) = 0;
  // Keeps the current rows `rows` ([A'] int64, indices into the current rows).
  virtual Status Keep(const at::Tensor& rows) = 0;
  // The KV cache of the current rows; null without one.
  virtual const common::KvCache* cache() const { return nullptr; }
};

// With a `prefix` (P rows, room for the prompts and the completions), Start appends the prompts
// to it instead of to a new cache.
class KvStepper final : public Stepper {
 public:
  explicit KvStepper(const common::Model& model,
                     std::optional<common::KvCache> prefix = std::nullopt)
      : model_(&model), prefix_(std::move(prefix)) {}
  at::Tensor Start(const at::Tensor& ids, const at::Tensor& mask, int64_t g,
                   int64_t capacity) override;
  at::Tensor Step(const at::Tensor& tokens) override { return model_->DecodeStep(tokens, cache_); }
  Status Keep(const at::Tensor& rows) override { return model_->KeepRows(cache_, rows); }
  const common::KvCache* cache() const override { return &cache_; }
  // Later steps run `model` (same architecture) over the keys/values held so far: an in-flight
  // update that keeps the cache (partial_rollout_kv_cache: keep).
  void Rebind(const common::Model& model) { model_ = &model; }
  // Appends `other`'s rows after this one's (ConcatCaches) with room for `room` more steps.
  void Append(const KvStepper& other, int64_t room);
  // Holds `cache` as its own, as Start would have left it (RestartSharingPrompts).
  void Hold(common::KvCache cache) { cache_ = std::move(cache); }

 private:
  const common::Model* model_;
  std::optional<common::KvCache> prefix_;
  common::KvCache cache_;
};

class RecomputeStepper final : public Stepper {
 public:
  explicit RecomputeStepper(const common::Model& model) : model_(model) {}
  at::Tensor Start(const at::Tensor& ids, const at::Tensor& mask, int64_t g,
                   int64_t /*capacity*/) override;
  at::Tensor Step(const at::Tensor& tokens) override;
  Status Keep(const at::Tensor& rows) override;

 private:
  at::Tensor LastLogits() const;

  const common::Model& model_;
  at::Tensor ids_;   // [A, T] int64
  at::Tensor mask_;  // [A, T] int64
};

// One cache holding a's rows then b's, with the columns each needs: a cache's columns from the
// first one real in any of its rows to its length, both right-aligned to the longer span L, the
// columns before a row's own masked out; capacity L + room. Keys/values, masks and positions
// are copied unchanged (a key carries its RoPE position, so where its column lies does not
// matter). TORCH_CHECKs that both have the same layers and shapes.
common::KvCache ConcatCaches(const common::KvCache& a, const common::KvCache& b, int64_t room);

// An in-flight update that recomputes the cache, for rows that share prompts: row i holds
// prompts[row_prompt[i]] and then fed[i], its completion so far but the last token (the fed lengths
// may differ: a Generate call's rows decode in lockstep, continuous batching's groups started at
// different steps). Each prompt that a row holds is prefilled once, its keys/values are copied to
// its rows, and the rows are extended with their fed tokens together (left-padded): the keys/values
// a prefill of the whole contexts computes (each key depends on its own row's tokens before it
// only; positions continue from the row's prompt), from sum(prompts) + sum(fed) tokens instead of
// rows x prompt + sum(fed). Prompts whose longest fed lengths differ by more than 2x are
// prefilled in separate buckets (a bucket's rows padded to its longest, at most twice their
// tokens) whose caches are then joined, so a long group does not pad every short row to its
// length; a prompt's rows stay in one bucket. A KV stepper of `model` with room for `remaining`
// more tokens is returned; the prefill's logits are dropped (the next Step feeds each row's last
// sampled token). `prefilled`, when given, receives the tokens run through the model.
std::unique_ptr<KvStepper> RestartSharingPrompts(const common::Model& model,
                                                 const std::vector<std::vector<int32_t>>& prompts,
                                                 const std::vector<int64_t>& row_prompt,
                                                 const std::vector<std::vector<int32_t>>& fed,
                                                 int64_t remaining, const at::Device& device,
                                                 int64_t* prefilled = nullptr);

// Left-padded ids [P, L] (pad 0) and mask [P, L] bool on the CPU, row i holding contexts[i]
// from its element skip[i] on (skip empty = 0); L the longest.
std::pair<at::Tensor, at::Tensor> LeftPadded(const std::vector<std::vector<int32_t>>& contexts,
                                             const std::vector<int64_t>& skip = {});

// Continue's checks of a row: InvalidArgument naming `where` for an empty context, an id
// outside [0, vocab), or max_new_tokens outside [1, max_completion_length].
Status CheckContinuation(const Continuation& row, const std::string& where, int64_t vocab,
                         int64_t max_completion_length);

// Rows that hold nothing yet (reuse[i] == 0) and have equal contexts of two or more tokens (a
// group's first turn: its G episodes start from one prompt) share one prefill: all but the last
// token of each distinct such context run through `model` once, and each of its rows starts from
// those keys/values (held[i], a dense row as Model::CompactRow makes; reuse[i] = size - 1) as
// from a TurnCache's. held and reuse have one entry per context. Returns the context tokens this
// saved prefilling. Runs without autograd; libtorch errors throw.
int64_t ShareEqualContexts(const common::Model& model,
                           const std::vector<std::vector<int32_t>>& contexts,
                           std::vector<common::KvCache>& held, std::vector<int64_t>& reuse);

// Every token of each context, for the repetition penalty: [P * g, V] bool on `device`, row
// i * g + k marking contexts[i].
at::Tensor SeenTokens(const std::vector<std::vector<int32_t>>& contexts, int64_t g, int64_t vocab,
                      const at::Device& device);

// Decode steps between stop checks: options.stop_check_interval, or (0) 1 on the CPU and
// kDefaultCudaStopCheckInterval on a GPU; 1 with stop strings (they need every token's text).
int64_t StopCheckInterval(const GeneratorOptions& options, const at::Device& device);

// The ids that end a completion: stop_token_ids, and eos_token_ids or (when empty) the policy's
// eos ids and the tokenizer's eos.
std::unordered_set<int64_t> StopIds(const GeneratorOptions& options,
                                    const common::ModelConfig& policy,
                                    const common::Tokenizer* tokenizer);

// A prompt as it is generated from: InvalidArgument naming `where` for an empty prompt, an id
// outside [0, vocab), or one longer than max_prompt_length with truncate_prompt "reject"; cut
// from the left (and *truncated set) with "left".
StatusOr<std::vector<int32_t>> CheckPrompt(std::vector<int32_t> prompt, int64_t vocab,
                                           const GeneratorOptions& options,
                                           const std::string& where, bool* truncated);

// w sampling steps of the current rows from `logits` [A, V]: row a's uniforms from gens[a] in
// its stream's order, copied in one transfer; `seen` (penalty; may be undefined) marks each
// token. Steps the stepper between two samples, not after the last.
struct Window {
  at::Tensor tokens;    // [A, w] int64, CPU
  at::Tensor logprobs;  // [A, w] float32, CPU
  at::Tensor last;      // [A] int64 on the device: the last sampled tokens, not fed yet
};
StatusOr<Window> SampleWindow(Stepper& stepper, at::Tensor logits, at::Tensor& seen,
                              const SamplingParams& sampling, std::vector<at::Generator>& gens,
                              int64_t w, const at::Device& device);

// One generated row.
struct Row {
  int64_t prompt = 0;  // the caller's index of its prompt
  common::Completion completion;
  bool text_set = false;  // cut at a stop string
};

// The row's completion but its last token (sampled, not fed yet): what its keys and values
// after its prompt's were computed from.
std::vector<int32_t> FedTokens(const Row& row);

// Appends row `a`'s tokens of `window` to `row` up to the first that ends it (a stop id, a stop
// string, or max_new tokens); `version` >= 0 is recorded for each token in *versions. True when
// the row ended; adds the tokens appended to *num_tokens.
StatusOr<bool> AppendWindow(const Window& window, int64_t a, int64_t max_new,
                            const std::unordered_set<int64_t>& stop_ids,
                            const std::vector<std::string>& stop_strings,
                            const common::Tokenizer* tokenizer, Row& row, int64_t version,
                            std::vector<int64_t>* versions, int64_t* num_tokens);

// Keeps the current rows `keep` (indices into them, in order) of the stepper, the penalty's
// `seen` (when defined), the next tokens `pending`, and the caller's per-row `active` and `gens`.
template <typename RowId>
Status KeepCurrentRows(const std::vector<int64_t>& keep, const at::Device& device, Stepper& stepper,
                       at::Tensor& seen, at::Tensor& pending, std::vector<RowId>& active,
                       std::vector<at::Generator>& gens) {
  if (keep.size() == active.size()) return Status::OK();
  const at::Tensor keep_t = at::tensor(keep, at::kLong).to(device);
  RETURN_IF_ERROR(stepper.Keep(keep_t));
  if (seen.defined()) seen = seen.index_select(0, keep_t);
  pending = pending.index_select(0, keep_t);
  std::vector<RowId> still;
  std::vector<at::Generator> still_gens;
  for (int64_t a : keep) {  // increasing, each once: every kept row is moved out once
    still.push_back(std::move(active[a]));
    still_gens.push_back(gens[a]);
  }
  active = std::move(still);
  gens = std::move(still_gens);
  return Status::OK();
}

// What a stream (GenerateStream, ContinueStream) decodes with, from the options and the policy
// it starts with.
struct StreamSetup {
  StreamSetup(const GeneratorOptions& options, const common::Model& model,
              const common::Tokenizer* tokenizer);
  at::Device device;
  int64_t vocab;
  std::unordered_set<int64_t> stop_ids;
  int64_t interval;  // StopCheckInterval
  // Columns a row may still need: max_completion_length tokens, and the steps of a window
  // that runs on past them.
  int64_t room;
};

// Admits rows into a stream: their stepper (`admitted`, its first logits `fresh` and penalty
// marks `fresh_seen`, undefined without the penalty) after the rows in flight (its cache
// appended to theirs with `room` more columns), or as the rows in flight when nothing decodes.
void Join(std::unique_ptr<KvStepper> admitted, const at::Tensor& fresh,
          const at::Tensor& fresh_seen, int64_t room, std::unique_ptr<KvStepper>& stepper,
          at::Tensor& logits, at::Tensor& seen);

// A stream's end of window (GenerateStream, ContinueStream): the rows `keep` go on from the
// window's last tokens (KeepCurrentRows), or, when none does, the stepper and the per-row state
// are freed (nothing decodes).
template <typename RowId, typename StepperT>
Status KeepOrEnd(const std::vector<int64_t>& keep, const Window& window, const at::Device& device,
                 std::unique_ptr<StepperT>& stepper, at::Tensor& seen, at::Tensor& pending,
                 std::vector<RowId>& active, std::vector<at::Generator>& gens) {
  if (keep.empty()) {
    stepper.reset();
    active.clear();
    gens.clear();
    seen = at::Tensor();
    return Status::OK();
  }
  pending = window.last;
  return KeepCurrentRows(keep, device, *stepper, seen, pending, active, gens);
}

// Earliest position of any stop string in text, or npos.
size_t FindStop(const std::string& text, const std::vector<std::string>& stops);

// Decodes ids the tokenizer knows (a model vocabulary may be padded past the tokenizer's).
StatusOr<std::string> DecodeKnown(const common::Tokenizer& tokenizer,
                                  const std::vector<int32_t>& ids);

}  // namespace grpo::rollout::decode
