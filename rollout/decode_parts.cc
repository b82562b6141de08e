#include "rollout/decode_parts.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <map>
#include <utility>

#include "rollout/generator.h"

namespace grpo::rollout::decode {

using common::Completion;
using common::KvCache;
using common::Model;

at::Tensor KvStepper::Start(const at::Tensor& ids, const at::Tensor& mask, int64_t g,
                            int64_t capacity) {
  KvCache prompt_cache = prefix_ ? std::move(*prefix_) : model_->NewCache(ids.size(0), capacity);
  prefix_.reset();
  at::Tensor logits = model_->Prefill(ids, mask, prompt_cache);  // [P, V]
  if (g == 1) {
    cache_ = std::move(prompt_cache);
    return logits;
  }
  cache_ = model_->ExpandCache(prompt_cache, g);  // P * g rows
  return logits.repeat_interleave(g, 0);
}

void KvStepper::Append(const KvStepper& other, int64_t room) {
  cache_ = ConcatCaches(cache_, other.cache_, room);
}

at::Tensor RecomputeStepper::Start(const at::Tensor& ids, const at::Tensor& mask, int64_t g,
                                   int64_t /*capacity*/) {
  ids_ = ids.repeat_interleave(g, 0);
  mask_ = mask.to(at::kLong).repeat_interleave(g, 0);
  return LastLogits();
}

at::Tensor RecomputeStepper::Step(const at::Tensor& tokens) {
  ids_ = at::cat({ids_, tokens.unsqueeze(1)}, 1);
  mask_ = at::cat({mask_, at::ones_like(tokens).unsqueeze(1)}, 1);
  return LastLogits();
}

Status RecomputeStepper::Keep(const at::Tensor& rows) {
  ids_ = ids_.index_select(0, rows);
  mask_ = mask_.index_select(0, rows);
  return Status::OK();
}

at::Tensor RecomputeStepper::LastLogits() const {
  at::NoGradGuard no_grad;
  at::Tensor hidden = model_.ForwardHidden(ids_, mask_);  // [A, T, D]
  return model_.Logits(hidden.select(1, hidden.size(1) - 1));
}

namespace {

// Columns of `c` from the first one real in any row to its length.
int64_t Span(const KvCache& c) {
  if (c.batch() == 0 || c.length == 0) return 0;
  const at::Tensor used = c.key_mask.narrow(1, 0, c.length).any(0).nonzero();
  return used.numel() == 0 ? 0 : c.length - used.min().item<int64_t>();
}

}  // namespace

KvCache ConcatCaches(const KvCache& a, const KvCache& b, int64_t room) {
  TORCH_CHECK(a.keys.size() == b.keys.size() && !a.keys.empty(), "ConcatCaches: ", a.keys.size(),
              " and ", b.keys.size(), " layers");
  TORCH_CHECK(room >= 1, "ConcatCaches: room ", room, " < 1");
  at::NoGradGuard no_grad;
  const int64_t ba = a.batch(), bb = b.batch();
  const int64_t sa = Span(a), sb = Span(b);
  const int64_t len = std::max(sa, sb), capacity = len + room;
  KvCache out;
  const auto place = [&](const at::Tensor& from_a, const at::Tensor& from_b, int64_t dim) {
    std::vector<int64_t> shape = from_a.sizes().vec();
    TORCH_CHECK(from_b.sizes().size() == shape.size(), "ConcatCaches: shapes differ");
    shape[0] = ba + bb;
    shape[dim] = capacity;
    at::Tensor t = at::zeros(shape, from_a.options());
    if (sa > 0) {
      t.narrow(0, 0, ba).narrow(dim, len - sa, sa).copy_(from_a.narrow(dim, a.length - sa, sa));
    }
    if (sb > 0) {
      t.narrow(0, ba, bb).narrow(dim, len - sb, sb).copy_(from_b.narrow(dim, b.length - sb, sb));
    }
    return t;
  };
  for (size_t li = 0; li < a.keys.size(); ++li) {
    out.keys.push_back(place(a.keys[li], b.keys[li], 2));
    out.values.push_back(place(a.values[li], b.values[li], 2));
  }
  out.key_mask = place(a.key_mask, b.key_mask, 1);
  out.next_position = at::cat({a.next_position, b.next_position});
  out.length = len;
  out.capacity = capacity;
  return out;
}

std::pair<at::Tensor, at::Tensor> LeftPadded(const std::vector<std::vector<int32_t>>& contexts,
                                             const std::vector<int64_t>& skip) {
  const int64_t n = static_cast<int64_t>(contexts.size());
  const auto skipped = [&](int64_t i) { return skip.empty() ? 0 : skip[i]; };
  int64_t len = 0;
  for (int64_t i = 0; i < n; ++i) {
    len = std::max<int64_t>(len, static_cast<int64_t>(contexts[i].size()) - skipped(i));
  }
  at::Tensor ids = at::zeros({n, len}, at::kLong);
  at::Tensor mask = at::zeros({n, len}, at::kBool);
  auto dst = ids.accessor<int64_t, 2>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = static_cast<int64_t>(contexts[i].size()) - skipped(i);
    for (int64_t j = 0; j < k; ++j) dst[i][len - k + j] = contexts[i][skipped(i) + j];
    mask[i].narrow(0, len - k, k).fill_(true);
  }
  return {ids, mask};
}

namespace {

// The cache of rows `rows` (indices into row_prompt and fed) of RestartSharingPrompts: their
// prompts prefilled once each, copied to their rows, then every row's fed tokens at once,
// left-padded to the longest of them; `extra` columns of room beyond. Adds the tokens run to
// *tokens.
KvCache PrefillRows(const Model& model, const std::vector<std::vector<int32_t>>& prompts,
                    const std::vector<int64_t>& row_prompt,
                    const std::vector<std::vector<int32_t>>& fed, const std::vector<size_t>& rows,
                    int64_t extra, const at::Device& device, int64_t* tokens) {
  // The prompts the rows hold, each once, in order of first use; the row -> its index there.
  std::vector<int64_t> slot(prompts.size(), -1), of_row;
  std::vector<std::vector<int32_t>> used, rows_fed;
  int64_t f = 0;
  for (size_t i : rows) {
    int64_t& k = slot[row_prompt[i]];
    if (k < 0) {
      k = static_cast<int64_t>(used.size());
      used.push_back(prompts[row_prompt[i]]);
      *tokens += static_cast<int64_t>(used.back().size());
    }
    of_row.push_back(k);
    rows_fed.push_back(fed[i]);
    f = std::max(f, static_cast<int64_t>(fed[i].size()));
    *tokens += static_cast<int64_t>(fed[i].size());
  }
  auto [ids, mask] = LeftPadded(used);
  KvCache cache = model.NewCache(ids.size(0), ids.size(1) + f + extra);
  model.Prefill(ids.to(device), mask.to(device), cache);
  const Status copied =
      model.KeepRows(cache, at::tensor(of_row, at::kLong).to(device));  // a prompt's rows
  TORCH_CHECK(copied.ok(), copied.ToString());
  if (f > 0) {  // every row's fed completion tokens at once, after its prompt, left-padded
    auto [fed_ids, fed_mask] = LeftPadded(rows_fed);
    model.Prefill(fed_ids.to(device), fed_mask.to(device), cache);
  }
  return cache;
}

}  // namespace

std::unique_ptr<KvStepper> RestartSharingPrompts(const Model& model,
                                                 const std::vector<std::vector<int32_t>>& prompts,
                                                 const std::vector<int64_t>& row_prompt,
                                                 const std::vector<std::vector<int32_t>>& fed,
                                                 int64_t remaining, const at::Device& device,
                                                 int64_t* prefilled) {
  TORCH_CHECK(row_prompt.size() == fed.size(), "RestartSharingPrompts: ", row_prompt.size(),
              " rows, ", fed.size(), " completions");
  const size_t rows = fed.size();
  // Each prompt's longest fed completion.
  std::vector<int64_t> prompt_fed(prompts.size(), -1);
  for (size_t i = 0; i < rows; ++i) {
    TORCH_CHECK(row_prompt[i] >= 0 && row_prompt[i] < static_cast<int64_t>(prompts.size()),
                "RestartSharingPrompts: row ", i, " names prompt ", row_prompt[i]);
    int64_t& longest = prompt_fed[row_prompt[i]];
    longest = std::max(longest, static_cast<int64_t>(fed[i].size()));
  }
  // Buckets of prompts by that length, longest first: a bucket takes the prompts whose longest is
  // at least half its first's, so padding a bucket's rows to its longest at most doubles their
  // fed tokens (one bucket for all rows would pad a long-tail group's short rows to its long
  // ones). A prompt's rows stay in one bucket: each prompt is prefilled once.
  std::vector<int64_t> order;
  for (size_t k = 0; k < prompts.size(); ++k) {
    if (prompt_fed[k] >= 0) order.push_back(static_cast<int64_t>(k));
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return prompt_fed[a] > prompt_fed[b]; });
  std::vector<int64_t> bucket_of(prompts.size(), -1);
  int64_t buckets = 0, first = 0;
  for (int64_t k : order) {
    if (buckets == 0 || 2 * prompt_fed[k] < first) {
      ++buckets;
      first = prompt_fed[k];
    }
    bucket_of[k] = buckets - 1;
  }
  at::NoGradGuard no_grad;
  int64_t tokens = 0;
  KvCache cache;
  if (buckets <= 1) {
    std::vector<size_t> all(rows);
    for (size_t i = 0; i < rows; ++i) all[i] = i;
    cache = PrefillRows(model, prompts, row_prompt, fed, all, remaining + 1, device, &tokens);
  } else {
    // Each bucket's cache, joined right-aligned (ConcatCaches), then the rows put back in order.
    std::vector<int64_t> position(rows);  // row -> its row in the joined cache
    int64_t joined_rows = 0;
    for (int64_t b = 0; b < buckets; ++b) {
      std::vector<size_t> members;
      for (size_t i = 0; i < rows; ++i) {
        if (bucket_of[row_prompt[i]] == b) members.push_back(i);
      }
      KvCache part = PrefillRows(model, prompts, row_prompt, fed, members, 0, device, &tokens);
      for (size_t i : members) position[i] = joined_rows++;
      cache = b == 0 ? std::move(part) : ConcatCaches(cache, part, remaining + 1);
    }
    const Status ordered = model.KeepRows(cache, at::tensor(position, at::kLong).to(device));
    TORCH_CHECK(ordered.ok(), ordered.ToString());
  }
  auto stepper = std::make_unique<KvStepper>(model);
  stepper->Hold(std::move(cache));
  if (prefilled != nullptr) *prefilled = tokens;
  return stepper;
}

Status CheckContinuation(const Continuation& row, const std::string& where, int64_t vocab,
                         int64_t max_completion_length) {
  if (row.context.empty()) return Status::InvalidArgument(where + "empty context");
  auto bad = std::find_if(row.context.begin(), row.context.end(),
                          [&](int32_t t) { return t < 0 || t >= vocab; });
  if (bad != row.context.end()) {
    return Status::InvalidArgument(where + "token id " + std::to_string(*bad) +
                                   " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
  }
  if (row.max_new_tokens < 1 || row.max_new_tokens > max_completion_length) {
    return Status::InvalidArgument(where + "max_new_tokens " + std::to_string(row.max_new_tokens) +
                                   " outside [1, " + std::to_string(max_completion_length) + "]");
  }
  return Status::OK();
}

int64_t ShareEqualContexts(const Model& model, const std::vector<std::vector<int32_t>>& contexts,
                           std::vector<KvCache>& held, std::vector<int64_t>& reuse) {
  std::map<std::vector<int32_t>, std::vector<size_t>> rows_of;
  for (size_t i = 0; i < contexts.size(); ++i) {
    if (reuse[i] == 0 && contexts[i].size() >= 2) rows_of[contexts[i]].push_back(i);
  }
  std::vector<std::vector<int32_t>> prefixes;  // one per shared context: all but its last token
  std::vector<const std::vector<size_t>*> sharers;
  for (const auto& [context, rows] : rows_of) {
    if (rows.size() < 2) continue;
    prefixes.emplace_back(context.begin(), context.end() - 1);
    sharers.push_back(&rows);
  }
  if (prefixes.empty()) return 0;
  at::NoGradGuard no_grad;
  const at::Device device = model.LmHeadWeight().device();
  const auto [ids, mask] = LeftPadded(prefixes);
  KvCache cache = model.NewCache(ids.size(0), ids.size(1));
  model.Prefill(ids.to(device), mask.to(device), cache);
  int64_t saved = 0;
  for (size_t k = 0; k < prefixes.size(); ++k) {
    const int64_t n = static_cast<int64_t>(prefixes[k].size());
    const KvCache row = model.CompactRow(cache, static_cast<int64_t>(k), n);
    for (size_t i : *sharers[k]) {
      held[i] = row;  // the tensors are shared: StackRows copies them into the decode's cache
      reuse[i] = n;
    }
    saved += n * static_cast<int64_t>(sharers[k]->size() - 1);
  }
  return saved;
}

at::Tensor SeenTokens(const std::vector<std::vector<int32_t>>& contexts, int64_t g, int64_t vocab,
                      const at::Device& device) {
  at::Tensor seen = at::zeros({static_cast<int64_t>(contexts.size()), vocab}, at::kBool);
  auto dst = seen.accessor<bool, 2>();
  for (size_t i = 0; i < contexts.size(); ++i) {
    for (int32_t t : contexts[i]) dst[i][t] = true;
  }
  return seen.repeat_interleave(g, 0).to(device);
}

int64_t StopCheckInterval(const GeneratorOptions& options, const at::Device& device) {
  if (!options.stop_strings.empty()) return 1;
  if (options.stop_check_interval > 0) return options.stop_check_interval;
  return device.is_cuda() ? kDefaultCudaStopCheckInterval : 1;
}

StreamSetup::StreamSetup(const GeneratorOptions& options, const Model& model,
                         const common::Tokenizer* tokenizer)
    : device(model.LmHeadWeight().device()),
      vocab(model.config().vocab_size),
      stop_ids(StopIds(options, model.config(), tokenizer)),
      interval(StopCheckInterval(options, device)),
      room(options.max_completion_length + interval) {}

void Join(std::unique_ptr<KvStepper> admitted, const at::Tensor& fresh,
          const at::Tensor& fresh_seen, int64_t room, std::unique_ptr<KvStepper>& stepper,
          at::Tensor& logits, at::Tensor& seen) {
  if (stepper == nullptr) {
    stepper = std::move(admitted);
    logits = fresh;
    seen = fresh_seen;
    return;
  }
  stepper->Append(*admitted, room);
  logits = at::cat({logits, fresh});
  if (seen.defined()) seen = at::cat({seen, fresh_seen});
}

std::unordered_set<int64_t> StopIds(const GeneratorOptions& options,
                                    const common::ModelConfig& policy,
                                    const common::Tokenizer* tokenizer) {
  std::unordered_set<int64_t> ids(options.stop_token_ids.begin(), options.stop_token_ids.end());
  if (options.eos_token_ids.empty()) {
    ids.insert(policy.eos_token_ids.begin(), policy.eos_token_ids.end());
    if (tokenizer != nullptr && tokenizer->eos_token_id()) ids.insert(*tokenizer->eos_token_id());
  } else {
    ids.insert(options.eos_token_ids.begin(), options.eos_token_ids.end());
  }
  return ids;
}

StatusOr<std::vector<int32_t>> CheckPrompt(std::vector<int32_t> p, int64_t vocab,
                                           const GeneratorOptions& options,
                                           const std::string& where, bool* truncated) {
  *truncated = false;
  if (p.empty()) return Status::InvalidArgument(where + "empty prompt");
  auto bad = std::find_if(p.begin(), p.end(), [&](int32_t t) { return t < 0 || t >= vocab; });
  if (bad != p.end()) {
    return Status::InvalidArgument(where + "token id " + std::to_string(*bad) + " at position " +
                                   std::to_string(bad - p.begin()) +
                                   " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
  }
  if (options.max_prompt_length > 0 && static_cast<int64_t>(p.size()) > options.max_prompt_length) {
    if (options.truncate_prompt == "reject") {
      return Status::InvalidArgument(
          where + std::to_string(p.size()) + " tokens > max_prompt_length " +
          std::to_string(options.max_prompt_length) + " (truncate_prompt: reject)");
    }
    p.erase(p.begin(), p.end() - options.max_prompt_length);
    *truncated = true;
  }
  return p;
}

StatusOr<Window> SampleWindow(Stepper& stepper, at::Tensor logits, at::Tensor& seen,
                              const SamplingParams& sampling, std::vector<at::Generator>& gens,
                              int64_t w, const at::Device& device) {
  const int64_t num_active = static_cast<int64_t>(gens.size());
  at::Tensor uniforms;
  if (!sampling.greedy()) {
    at::Tensor host = at::empty(
        {num_active, w}, at::TensorOptions().dtype(at::kDouble).pinned_memory(device.is_cuda()));
    double* u = host.data_ptr<double>();
    for (int64_t a = 0; a < num_active; ++a) {
      for (int64_t j = 0; j < w; ++j) u[a * w + j] = NextUniform(gens[a]);
    }
    uniforms = host.to(device, /*non_blocking=*/true);
  }
  std::vector<at::Tensor> tokens, logprobs;  // w x [A] on the device
  for (int64_t j = 0; j < w; ++j) {
    ASSIGN_OR_RETURN(SampleOutput sample,
                     SampleWithUniforms(logits, seen, sampling,
                                        sampling.greedy() ? at::Tensor() : uniforms.select(1, j)));
    if (seen.defined()) seen.scatter_(1, sample.tokens.unsqueeze(1), true);
    tokens.push_back(sample.tokens);
    logprobs.push_back(sample.logprobs);
    if (j + 1 < w) logits = stepper.Step(sample.tokens);
  }
  Window out;
  out.tokens = at::stack(tokens, 1).to(at::kCPU);
  out.logprobs = at::stack(logprobs, 1).to(at::kCPU, at::kFloat);
  out.last = tokens.back();
  return out;
}

StatusOr<bool> AppendWindow(const Window& window, int64_t a, int64_t max_new,
                            const std::unordered_set<int64_t>& stop_ids,
                            const std::vector<std::string>& stop_strings,
                            const common::Tokenizer* tokenizer, Row& row, int64_t version,
                            std::vector<int64_t>* versions, int64_t* num_tokens) {
  const int64_t w = window.tokens.size(1);
  const int64_t* tok = window.tokens.data_ptr<int64_t>();
  const float* lp = window.logprobs.data_ptr<float>();
  Completion& c = row.completion;
  for (int64_t j = 0; j < w; ++j) {
    const int64_t t = tok[a * w + j];
    c.token_ids.push_back(static_cast<int32_t>(t));
    c.logprobs.push_back(lp[a * w + j]);
    if (version >= 0) versions->push_back(version);
    ++*num_tokens;
    if (stop_ids.count(t) > 0) return true;
    if (!stop_strings.empty()) {
      ASSIGN_OR_RETURN(std::string text, DecodeKnown(*tokenizer, c.token_ids));
      const size_t pos = FindStop(text, stop_strings);
      if (pos != std::string::npos) {
        c.text = text.substr(0, pos);
        row.text_set = true;
        return true;
      }
    }
    if (static_cast<int64_t>(c.token_ids.size()) == max_new) {
      c.truncated = true;
      return true;
    }
  }
  return false;
}

std::vector<int32_t> FedTokens(const Row& row) {
  const std::vector<int32_t>& done = row.completion.token_ids;
  return std::vector<int32_t>(done.begin(), done.end() - 1);
}

size_t FindStop(const std::string& text, const std::vector<std::string>& stops) {
  size_t best = std::string::npos;
  for (const auto& s : stops) best = std::min(best, text.find(s));
  return best;
}

StatusOr<std::string> DecodeKnown(const common::Tokenizer& tokenizer,
                                  const std::vector<int32_t>& ids) {
  std::vector<int32_t> known;
  known.reserve(ids.size());
  for (int32_t t : ids) {
    if (t < tokenizer.vocab_size()) known.push_back(t);
  }
  return tokenizer.Decode(known, /*skip_special_tokens=*/true);
}

}  // namespace grpo::rollout::decode
