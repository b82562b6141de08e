#include "rollout/generator.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <exception>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>

#include "rollout/decode_parts.h"

namespace grpo::rollout {

using common::Completion;
using common::KvCache;
using common::Model;
using common::RolloutGroup;
using decode::Row;

// Continue's rows with a TurnCache. In: per context, the held dense row to start from (empty =
// none) and how many of its leading tokens to reuse (a prefix of the context, shorter than it).
// Out: per row, its keys/values of context + completion without the last token (never fed).
struct Generator::TurnRows {
  std::vector<KvCache> held;   // one per context; freed once stacked
  std::vector<int64_t> reuse;  // one per context
  std::vector<KvCache> kept;   // one per row
};

int64_t TurnCache::num_tokens() const {
  int64_t n = 0;
  for (const auto& [key, e] : rows_) n += static_cast<int64_t>(e.tokens.size());
  return n;
}

int64_t TurnCache::bytes() const {
  int64_t n = 0;
  for (const auto& [key, e] : rows_) {
    for (const auto& k : e.kv.keys) n += static_cast<int64_t>(k.nbytes());
    for (const auto& v : e.kv.values) n += static_cast<int64_t>(v.nbytes());
  }
  return n;
}

void TurnCache::Release(int64_t seed_index, int64_t generation) {
  rows_.erase({seed_index, generation});
}

void TurnCache::Clear() {
  rows_.clear();
  version_ = -1;
  model_ = nullptr;
}

void TurnCache::Bind(int64_t version, const common::Model* model) {
  if (version_ != version || model_ != model) Clear();
  version_ = version;
  model_ = model;
}

int64_t TurnCache::Take(int64_t seed_index, int64_t generation, const std::vector<int32_t>& context,
                        KvCache* kv) {
  auto node = rows_.extract({seed_index, generation});
  if (node.empty()) return 0;
  const std::vector<int32_t>& held = node.mapped().tokens;
  const size_t limit = std::min(held.size(), context.size() - 1);
  size_t n = 0;
  while (n < limit && held[n] == context[n]) ++n;
  if (n > 0) *kv = std::move(node.mapped().kv);
  return static_cast<int64_t>(n);
}

int64_t TurnCache::TakeRows(const std::vector<Continuation>& rows, std::vector<KvCache>* held,
                            std::vector<int64_t>* reuse) {
  held->assign(rows.size(), KvCache{});
  reuse->assign(rows.size(), 0);
  int64_t n = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    (*reuse)[i] = Take(rows[i].seed_index, rows[i].generation, rows[i].context, &(*held)[i]);
    n += (*reuse)[i];
  }
  return n;
}

void TurnCache::Put(int64_t seed_index, int64_t generation, const std::vector<int32_t>& context,
                    const std::vector<int32_t>& completion, KvCache kv) {
  Entry& e = rows_[{seed_index, generation}];
  e.tokens = context;
  e.tokens.insert(e.tokens.end(), completion.begin(), completion.end() - 1);
  e.kv = std::move(kv);
}

GeneratorOptions GeneratorOptions::FromConfig(const common::GrpoConfig& config) {
  GeneratorOptions o;
  o.sampling = SamplingParams::FromConfig(config);
  o.num_generations = config.num_generations;
  o.max_prompt_length = config.max_prompt_length;
  o.max_completion_length = config.max_completion_length;
  o.truncate_prompt = config.truncate_prompt;
  o.seed = config.seed;
  o.partial_rollouts = config.partial_rollouts;
  o.recompute_kv_on_update = config.partial_rollout_kv_cache != "keep";
  return o;
}

Status GeneratorOptions::Validate() const {
  RETURN_IF_ERROR(sampling.Validate());
  if (num_generations < 1) {
    return Status::InvalidArgument("num_generations must be >= 1, got " +
                                   std::to_string(num_generations));
  }
  if (max_completion_length < 1) {
    return Status::InvalidArgument("max_completion_length must be >= 1, got " +
                                   std::to_string(max_completion_length));
  }
  if (truncate_prompt != "left" && truncate_prompt != "reject") {
    return Status::InvalidArgument("truncate_prompt must be \"left\" or \"reject\", got \"" +
                                   truncate_prompt + "\"");
  }
  for (const auto& s : stop_strings) {
    if (s.empty()) return Status::InvalidArgument("stop_strings: empty stop string");
  }
  if (stop_check_interval < 0) {
    return Status::InvalidArgument("stop_check_interval must be >= 0 (0 = auto), got " +
                                   std::to_string(stop_check_interval));
  }
  return Status::OK();
}

std::shared_ptr<const Model> BorrowModel(const Model& model) {
  // Aliasing constructor with an empty owner: no reference count, no deleter.
  return std::shared_ptr<const Model>(std::shared_ptr<const Model>(), &model);
}

StatusOr<std::unique_ptr<Generator>> Generator::Create(std::shared_ptr<const Model> policy,
                                                       int64_t policy_version,
                                                       GeneratorOptions options,
                                                       const common::Tokenizer* tokenizer) {
  if (!policy) return Status::InvalidArgument("Generator: null policy");
  RETURN_IF_ERROR(options.Validate());
  if (!options.stop_strings.empty() && tokenizer == nullptr) {
    return Status::InvalidArgument("stop_strings need a tokenizer");
  }
  return std::unique_ptr<Generator>(
      new Generator(std::move(policy), policy_version, std::move(options), tokenizer));
}

Status Generator::SetPolicy(std::shared_ptr<const Model> policy, int64_t version) {
  if (!policy) return Status::InvalidArgument("SetPolicy: null policy");
  common::MutexLock lock(&mu_);
  if (policy->config().vocab_size != policy_->config().vocab_size) {
    return Status::InvalidArgument("SetPolicy: vocab_size " +
                                   std::to_string(policy->config().vocab_size) +
                                   " != " + std::to_string(policy_->config().vocab_size));
  }
  policy_ = std::move(policy);
  version_ = version;
  return Status::OK();
}

std::pair<std::shared_ptr<const Model>, int64_t> Generator::Snapshot() const {
  common::MutexLock lock(&mu_);
  return {policy_, version_};
}

std::pair<std::shared_ptr<const Model>, int64_t> Generator::PolicyOtherThan(int64_t version) const {
  common::MutexLock lock(&mu_);
  if (version_ == version) return {nullptr, version};
  return {policy_, version_};
}

int64_t Generator::policy_version() const {
  common::MutexLock lock(&mu_);
  return version_;
}

StatusOr<GenerateResult> Generator::Generate(const std::vector<std::vector<int32_t>>& prompts,
                                             const std::vector<int64_t>& prompt_indices,
                                             const std::vector<int64_t>& max_new_tokens) const {
  return Run(prompts, prompt_indices, max_new_tokens, /*use_cache=*/true);
}

StatusOr<GenerateResult> Generator::GenerateRecomputeBaseline(
    const std::vector<std::vector<int32_t>>& prompts,
    const std::vector<int64_t>& prompt_indices) const {
  return Run(prompts, prompt_indices, /*max_new_tokens=*/{}, /*use_cache=*/false);
}

StatusOr<GenerateResult> Generator::Run(const std::vector<std::vector<int32_t>>& prompts,
                                        const std::vector<int64_t>& prompt_indices,
                                        const std::vector<int64_t>& max_new_tokens,
                                        bool use_cache) const {
  if (!prompt_indices.empty() && prompt_indices.size() != prompts.size()) {
    return Status::InvalidArgument("Generate: " + std::to_string(prompt_indices.size()) +
                                   " prompt_indices for " + std::to_string(prompts.size()) +
                                   " prompts");
  }
  if (!max_new_tokens.empty() && max_new_tokens.size() != prompts.size()) {
    return Status::InvalidArgument("Generate: " + std::to_string(max_new_tokens.size()) +
                                   " max_new_tokens for " + std::to_string(prompts.size()) +
                                   " prompts");
  }
  // The one snapshot of this call.
  std::shared_ptr<const Model> model;
  GenerateResult result;
  std::tie(model, result.policy_version) = Snapshot();
  const common::ModelConfig& cfg = model->config();
  const int64_t vocab = cfg.vocab_size;
  const int64_t g = options_.num_generations;
  // Validate and truncate prompts; each failure stays with its prompt.
  result.groups.reserve(prompts.size());
  std::vector<size_t> valid;  // indices into prompts
  std::vector<std::vector<int32_t>> ids;
  std::vector<int64_t> budgets;  // per valid prompt
  for (size_t i = 0; i < prompts.size(); ++i) {
    bool truncated = false;
    const int64_t budget = max_new_tokens.empty() ? 0 : max_new_tokens[i];
    auto p = decode::CheckPrompt(prompts[i], vocab, options_, "prompt " + std::to_string(i) + ": ",
                                 &truncated);
    if (p.ok() && (budget < 0 || budget > options_.max_completion_length)) {
      p = Status::InvalidArgument("prompt " + std::to_string(i) + ": max_new_tokens " +
                                  std::to_string(budget) + " outside [1, " +
                                  std::to_string(options_.max_completion_length) + "]");
    }
    if (!p.ok()) {
      result.groups.emplace_back(p.status());
      ++result.num_prompts_failed;
      continue;
    }
    result.num_prompts_truncated += truncated ? 1 : 0;
    RolloutGroup group;
    group.policy_version = result.policy_version;
    group.prompt_ids = *p;
    result.groups.emplace_back(std::move(group));
    valid.push_back(i);
    ids.push_back(std::move(p).value());
    budgets.push_back(budget > 0 ? budget : options_.max_completion_length);
  }
  if (valid.empty()) return result;

  std::vector<at::Generator> gens;
  gens.reserve(valid.size() * g);
  for (size_t p = 0; p < valid.size(); ++p) {
    const int64_t seed_index =
        prompt_indices.empty() ? static_cast<int64_t>(valid[p]) : prompt_indices[valid[p]];
    for (int64_t k = 0; k < g; ++k) gens.push_back(MakeRowGenerator(options_.seed, seed_index, k));
  }
  std::vector<int64_t> max_new;  // per row
  for (int64_t budget : budgets) max_new.insert(max_new.end(), g, budget);
  ASSIGN_OR_RETURN(std::vector<Completion> completions,
                   Decode(*model, result.policy_version, ids, g, std::move(gens), max_new,
                          use_cache, &result.num_completion_tokens));
  for (size_t r = 0; r < completions.size(); ++r) {
    result.groups[valid[r / g]]->completions.push_back(std::move(completions[r]));
  }
  return result;
}

StatusOr<ContinueResult> Generator::Continue(const std::vector<Continuation>& rows,
                                             TurnCache* cache) const {
  std::shared_ptr<const Model> model;
  ContinueResult result;
  std::tie(model, result.policy_version) = Snapshot();
  const int64_t vocab = model->config().vocab_size;
  std::vector<std::vector<int32_t>> contexts;
  std::vector<at::Generator> gens;
  std::vector<int64_t> max_new;
  for (size_t i = 0; i < rows.size(); ++i) {
    const Continuation& row = rows[i];
    RETURN_IF_ERROR(decode::CheckContinuation(row, "continuation " + std::to_string(i) + ": ",
                                              vocab, options_.max_completion_length));
    contexts.push_back(row.context);
    gens.push_back(MakeRowGenerator(options_.seed, row.seed_index,
                                    ContinuationStream(row.generation, row.turn)));
    max_new.push_back(row.max_new_tokens);
  }
  // Rows held for this snapshot start from their longest common prefix with the new context
  // (at least one token is left to prefill: it gives the first logits); the rows of others stay.
  std::optional<TurnRows> turn;
  if (cache != nullptr) {
    cache->Bind(result.policy_version, model.get());
    turn.emplace();
    result.num_cached_tokens = cache->TakeRows(rows, &turn->held, &turn->reuse);
  }
  // Rows with nothing held and one context (a group's first turn) share its prefill.
  int64_t shared = 0;
  if (turn) {
    try {
      shared = decode::ShareEqualContexts(*model, contexts, turn->held, turn->reuse);
    } catch (const c10::Error& e) {
      cache->Clear();
      return Status::Internal(std::string("Continue: shared prefill: ") +
                              e.what_without_backtrace());
    } catch (const std::exception& e) {
      cache->Clear();
      return Status::Internal(std::string("Continue: shared prefill: ") + e.what());
    }
  }
  for (const auto& c : contexts) result.num_prefill_tokens += static_cast<int64_t>(c.size());
  result.num_prefill_tokens -= result.num_cached_tokens + shared;
  if (rows.empty()) return result;
  // Version -1: no in-flight switch inside a turn (an episode takes the newest policy at each
  // turn's Continue call instead).
  StatusOr<std::vector<Completion>> decoded =
      Decode(*model, /*version=*/-1, contexts, /*g=*/1, std::move(gens), max_new,
             /*use_cache=*/true, &result.num_completion_tokens, turn ? &*turn : nullptr);
  if (!decoded.ok()) {
    if (cache != nullptr) cache->Clear();
    return decoded.status();
  }
  result.completions = std::move(decoded).value();
  if (cache != nullptr) {
    for (size_t i = 0; i < rows.size(); ++i) {
      cache->Put(rows[i].seed_index, rows[i].generation, contexts[i],
                 result.completions[i].token_ids, std::move(turn->kept[i]));
    }
  }
  return result;
}

int64_t ContinuationStream(int64_t generation, int64_t turn) {
  return turn == 0 ? generation : generation + (turn << 32);
}

StatusOr<std::vector<Completion>> Generator::Decode(const Model& model, int64_t version,
                                                    const std::vector<std::vector<int32_t>>& ids,
                                                    int64_t g, std::vector<at::Generator> gens,
                                                    const std::vector<int64_t>& row_max_new,
                                                    bool use_cache, int64_t* num_completion_tokens,
                                                    TurnRows* turn) const {
  const common::ModelConfig& cfg = model.config();
  const int64_t vocab = cfg.vocab_size;
  const std::unordered_set<int64_t> stop_ids = decode::StopIds(options_, cfg, tokenizer_);
  const int64_t max_new = *std::max_element(row_max_new.begin(), row_max_new.end());
  try {
    // Inference mode, not just no-grad: every op of a decode step then skips autograd's and
    // the version counters' dispatch (a decode step of a small model is ~150 tiny ops, so this
    // is ~15% of its time here). What it makes stays inside generation (KV caches, logits,
    // samples; a TurnCache's rows come back only to the next Decode); what leaves is host data.
    c10::InferenceMode inference;
    const at::Device device = model.LmHeadWeight().device();
    const int64_t num_prompts = static_cast<int64_t>(ids.size());
    // Each prompt's tokens to prefill: all, or those after the ones `turn` holds.
    std::vector<int64_t> skip(num_prompts, 0);
    if (turn != nullptr) skip = turn->reuse;
    // Left-padded prompts [P, L] (pad id 0, masked out).
    const auto [prompt_ids, prompt_mask] = decode::LeftPadded(ids, skip);
    const int64_t max_len = prompt_ids.size(1);

    // Rows: prompt-major, generation-minor (row r = prompt r / g, generation r % g).
    const int64_t num_rows = num_prompts * g;
    std::vector<Row> rows(num_rows);
    std::vector<at::Generator> active_gens = std::move(gens);  // one stream per current row
    for (int64_t r = 0; r < num_rows; ++r) rows[r].prompt = r / g;
    // Tokens of prompt + completion so far, for the repetition penalty: [A, V] bool.
    at::Tensor seen;
    if (options_.sampling.uses_penalty()) seen = decode::SeenTokens(ids, g, vocab, device);

    // In-flight weight updates: the snapshot decoding now (held here once it is not the
    // caller's) and its version.
    const bool in_flight =
        options_.partial_rollouts && use_cache && turn == nullptr && version >= 0;
    std::shared_ptr<const Model> switched;
    const Model* current = &model;
    int64_t current_version = version;
    std::vector<std::vector<int64_t>> versions(in_flight ? num_rows : 0);  // per row, per token

    std::unique_ptr<decode::Stepper> stepper;
    if (turn != nullptr) {
      std::vector<const KvCache*> held;
      for (const KvCache& h : turn->held) held.push_back(&h);
      const int64_t held_len = *std::max_element(skip.begin(), skip.end());
      KvCache prefix = model.StackRows(held, skip, held_len + max_len + max_new);
      turn->held.clear();  // copied into `prefix`: free them before decoding
      turn->kept.resize(num_prompts * g);
      stepper = std::make_unique<decode::KvStepper>(model, std::move(prefix));
    } else if (use_cache) {
      stepper = std::make_unique<decode::KvStepper>(model);
    } else {
      stepper = std::make_unique<decode::RecomputeStepper>(model);
    }
    at::Tensor logits =
        stepper->Start(prompt_ids.to(device), prompt_mask.to(device), g, max_len + max_new);

    // Decode in windows of `interval` steps: every row (finished or not) steps inside a window;
    // at its end one host copy of the window's tokens and log-probs decides which rows stop
    // where (the same per-token rules as interval 1) and the finished rows leave the batch.
    const int64_t interval = decode::StopCheckInterval(options_, device);
    std::vector<int64_t> active(num_rows);  // current stepper row -> row id
    for (int64_t r = 0; r < num_rows; ++r) active[r] = r;
    for (int64_t step = 0; step < max_new;) {
      const int64_t w = std::min(interval, max_new - step);
      const int64_t num_active = static_cast<int64_t>(active.size());
      ASSIGN_OR_RETURN(
          decode::Window window,
          decode::SampleWindow(*stepper, logits, seen, options_.sampling, active_gens, w, device));
      step += w;
      std::vector<int64_t> keep;  // stepper rows that go on
      for (int64_t a = 0; a < num_active; ++a) {
        ASSIGN_OR_RETURN(const bool done,
                         decode::AppendWindow(
                             window, a, row_max_new[active[a]], stop_ids, options_.stop_strings,
                             tokenizer_, rows[active[a]], in_flight ? current_version : -1,
                             in_flight ? &versions[active[a]] : nullptr, num_completion_tokens));
        if (!done) {
          keep.push_back(a);
        } else if (turn != nullptr) {
          // Its tokens so far except the last one, which was sampled but never fed.
          const Completion& c = rows[active[a]].completion;
          const int64_t fed = static_cast<int64_t>(ids[active[a] / g].size() + c.token_ids.size());
          turn->kept[active[a]] = model.CompactRow(*stepper->cache(), a, fed - 1);
        }
      }
      if (keep.empty()) break;
      at::Tensor next = window.last;  // [A] on the device
      RETURN_IF_ERROR(
          decode::KeepCurrentRows(keep, device, *stepper, seen, next, active, active_gens));
      if (options_.window_hook) options_.window_hook(step);
      if (in_flight) {
        auto [newer, newer_version] = PolicyOtherThan(current_version);
        if (newer != nullptr) {
          current = newer.get();
          current_version = newer_version;
          if (options_.recompute_kv_on_update) {
            // Each prompt prefilled once for its rows, then every row's completion so far.
            std::vector<int64_t> row_prompt;
            std::vector<std::vector<int32_t>> fed;
            for (int64_t r : active) {
              row_prompt.push_back(r / g);
              fed.push_back(decode::FedTokens(rows[r]));  // the last is fed by Step
            }
            stepper = decode::RestartSharingPrompts(*current, ids, row_prompt, fed, max_new - step,
                                                    device);
          } else {
            static_cast<decode::KvStepper*>(stepper.get())->Rebind(*current);
          }
          switched = std::move(newer);  // after the stepper stopped using the one it replaces
        }
      }
      logits = stepper->Step(next);
    }

    // Texts, then the rows in order.
    const bool any_switch = in_flight && current_version != version;
    std::vector<Completion> out;
    out.reserve(num_rows);
    for (int64_t r = 0; r < num_rows; ++r) {
      Completion& c = rows[r].completion;
      if (any_switch) c.token_versions = std::move(versions[r]);
      if (tokenizer_ != nullptr && !rows[r].text_set) {
        ASSIGN_OR_RETURN(c.text, decode::DecodeKnown(*tokenizer_, c.token_ids));
      }
      out.push_back(std::move(c));
    }
    return out;
  } catch (const c10::Error& e) {
    return Status::Internal(std::string("Generate: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Status::Internal(std::string("Generate: ") + e.what());
  }
}

}  // namespace grpo::rollout
