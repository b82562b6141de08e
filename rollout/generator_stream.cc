// Generator::GenerateStream: continuous batching (rollout/generator.h).
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "rollout/decode_parts.h"
#include "rollout/generator.h"

namespace grpo::rollout {
namespace {

using common::Model;
using decode::Row;

// A group in flight.
struct Slot {
  int64_t tag = 0;
  common::RolloutGroup group;  // prompt_ids and policy_version set at admission
  bool truncated = false;
  int64_t rows_left = 0;
  int64_t max_new = 0;                         // tokens per row
  std::vector<Row> rows;                       // one per generation
  std::vector<std::vector<int64_t>> versions;  // per generation, per token
};

// A row decoding now: generation `k` of slot `slot`.
struct Active {
  int64_t slot = 0;
  int64_t k = 0;
};

// A KV stepper of `model` for the rows in flight, their cache computed anew
// (decode::RestartSharingPrompts): each group's prompt prefilled once for its rows, then every
// row's tokens so far; room for `room` more. The tokens it ran are added to *recomputed.
std::unique_ptr<decode::KvStepper> Recompute(const Model& model,
                                             const std::map<int64_t, Slot>& slots,
                                             const std::vector<Active>& active, int64_t room,
                                             const at::Device& device, int64_t* recomputed) {
  std::vector<std::vector<int32_t>> prompts;
  std::map<int64_t, int64_t> prompt_of_slot;
  std::vector<int64_t> row_prompt;
  std::vector<std::vector<int32_t>> fed;
  for (const Active& a : active) {
    const Slot& s = slots.at(a.slot);
    auto [it, added] = prompt_of_slot.emplace(a.slot, static_cast<int64_t>(prompts.size()));
    if (added) prompts.push_back(s.group.prompt_ids);
    row_prompt.push_back(it->second);
    fed.push_back(decode::FedTokens(s.rows[a.k]));
  }
  int64_t prefilled = 0;
  auto stepper =
      decode::RestartSharingPrompts(model, prompts, row_prompt, fed, room, device, &prefilled);
  *recomputed += prefilled;
  return stepper;
}

}  // namespace

StatusOr<StreamStats> Generator::GenerateStream(const GroupStream& stream) const {
  if (!stream.take || !stream.done) {
    return Status::InvalidArgument("GenerateStream: the stream needs both take and done");
  }
  if (stream.max_prompts < 1) {
    return Status::InvalidArgument("GenerateStream: max_prompts must be >= 1, got " +
                                   std::to_string(stream.max_prompts));
  }
  auto [model, version] = Snapshot();
  StreamStats stats;
  const int64_t g = options_.num_generations;
  const int64_t max_new = options_.max_completion_length;
  try {
    c10::InferenceMode inference;  // as Generator::Decode's
    const decode::StreamSetup setup(options_, *model, tokenizer_);

    std::map<int64_t, Slot> slots;
    int64_t next_slot = 0;
    std::vector<Active> active;                  // the stepper's rows, in order
    std::vector<at::Generator> gens;             // one stream per active row
    std::unique_ptr<decode::KvStepper> stepper;  // null while nothing decodes
    at::Tensor pending;  // [A] on the device: each row's last sampled token, not fed yet
    at::Tensor seen;     // [A, V] bool with the repetition penalty
    bool draining = false;
    int64_t steps = 0;

    const auto finish = [&](int64_t id) -> Status {
      Slot& s = slots.at(id);
      bool mixed = false;
      for (const auto& v : s.versions) {
        mixed |=
            std::any_of(v.begin(), v.end(), [&](int64_t x) { return x != s.group.policy_version; });
      }
      for (int64_t k = 0; k < g; ++k) {
        common::Completion& c = s.rows[k].completion;
        if (mixed) c.token_versions = std::move(s.versions[k]);
        if (tokenizer_ != nullptr && !s.rows[k].text_set) {
          ASSIGN_OR_RETURN(c.text, decode::DecodeKnown(*tokenizer_, c.token_ids));
        }
        s.group.completions.push_back(std::move(c));
      }
      StreamedGroup out{s.tag, std::move(s.group), s.truncated};
      slots.erase(id);
      ++stats.num_groups;
      stream.done(std::move(out));
      return Status::OK();
    };

    while (true) {
      // 1. A newer policy: taken at once when nothing decodes, in flight with partial_rollouts,
      // else after a drain.
      auto [newer, newer_version] = PolicyOtherThan(version);
      if (newer != nullptr && (active.empty() || options_.partial_rollouts)) {
        if (!active.empty()) {
          if (options_.recompute_kv_on_update) {
            stepper = Recompute(*newer, slots, active, setup.room, setup.device,
                                &stats.num_recompute_tokens);
          } else {
            stepper->Rebind(*newer);
          }
        }
        model = std::move(newer);  // after the stepper stopped using the one it replaces
        version = newer_version;
        draining = false;
        ++stats.num_switches;
      } else if (newer != nullptr && !draining) {
        draining = true;
        ++stats.num_drains;
      }

      // 2. The rows in flight feed their last tokens.
      at::Tensor logits;  // [A, V]
      if (!active.empty()) logits = stepper->Step(pending);

      // 3. Admission.
      const int64_t free = stream.max_prompts - static_cast<int64_t>(slots.size());
      std::vector<StreamPrompt> taken;
      if (!draining && free > 0) taken = stream.take(free, /*idle=*/active.empty(), version);
      if (active.empty() && taken.empty()) break;
      std::vector<std::vector<int32_t>> ids;
      for (StreamPrompt& p : taken) {
        bool truncated = false;
        auto checked =
            decode::CheckPrompt(std::move(p.ids), setup.vocab, options_,
                                "prompt (tag " + std::to_string(p.tag) + "): ", &truncated);
        if (checked.ok() && (p.max_new_tokens < 0 || p.max_new_tokens > max_new)) {
          checked = Status::InvalidArgument(
              "prompt (tag " + std::to_string(p.tag) + "): max_new_tokens " +
              std::to_string(p.max_new_tokens) + " outside [1, " + std::to_string(max_new) + "]");
        }
        if (!checked.ok()) {
          ++stats.num_groups;
          stream.done(StreamedGroup{p.tag, checked.status(), false});
          continue;
        }
        Slot s;
        s.tag = p.tag;
        s.group.prompt_ids = *checked;
        s.group.policy_version = version;
        s.truncated = truncated;
        s.rows_left = g;
        s.max_new = p.max_new_tokens > 0 ? p.max_new_tokens : max_new;
        s.rows.resize(g);
        s.versions.resize(g);
        const int64_t id = next_slot++;
        for (int64_t k = 0; k < g; ++k) {
          active.push_back({id, k});
          gens.push_back(MakeRowGenerator(options_.seed, p.seed_index, k));
        }
        ids.push_back(std::move(checked).value());
        slots.emplace(id, std::move(s));
      }
      if (!ids.empty()) {
        const auto [prompt_ids, prompt_mask] = decode::LeftPadded(ids);
        auto admitted = std::make_unique<decode::KvStepper>(*model);
        at::Tensor fresh =
            admitted->Start(prompt_ids.to(setup.device), prompt_mask.to(setup.device), g,
                            prompt_ids.size(1) + setup.room);
        at::Tensor fresh_seen;
        if (options_.sampling.uses_penalty()) {
          fresh_seen = decode::SeenTokens(ids, g, setup.vocab, setup.device);
        }
        decode::Join(std::move(admitted), fresh, fresh_seen, setup.room, stepper, logits, seen);
      }
      if (active.empty()) continue;  // every prompt taken failed
      stats.max_rows = std::max<int64_t>(stats.max_rows, static_cast<int64_t>(active.size()));

      // 4. A window of samples; finished rows leave, finished groups go out.
      ASSIGN_OR_RETURN(decode::Window window,
                       decode::SampleWindow(*stepper, logits, seen, options_.sampling, gens,
                                            setup.interval, setup.device));
      steps += setup.interval;
      if (options_.window_hook) options_.window_hook(steps);
      std::vector<int64_t> keep;
      for (int64_t a = 0; a < static_cast<int64_t>(active.size()); ++a) {
        Slot& s = slots.at(active[a].slot);
        ASSIGN_OR_RETURN(
            const bool done,
            decode::AppendWindow(window, a, s.max_new, setup.stop_ids, options_.stop_strings,
                                 tokenizer_, s.rows[active[a].k], version, &s.versions[active[a].k],
                                 &stats.num_completion_tokens));
        if (!done) {
          keep.push_back(a);
        } else if (--s.rows_left == 0) {
          RETURN_IF_ERROR(finish(active[a].slot));
        }
      }
      RETURN_IF_ERROR(
          decode::KeepOrEnd(keep, window, setup.device, stepper, seen, pending, active, gens));
    }
    return stats;
  } catch (const c10::Error& e) {
    return Status::Internal(std::string("GenerateStream: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return Status::Internal(std::string("GenerateStream: ") + e.what());
  }
}

}  // namespace grpo::rollout
