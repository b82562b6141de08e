// Generator::ContinueStream: multi-turn rows that join and leave a running decode
// (rollout/generator.h).
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "rollout/decode_parts.h"
#include "rollout/generator.h"

namespace grpo::rollout {
namespace {

using common::KvCache;
using common::Model;

// A row decoding now.
struct Live {
  int64_t tag = 0;
  int64_t seed_index = 0;
  int64_t generation = 0;
  std::vector<int32_t> context;
  int64_t max_new = 0;
  decode::Row row;
};

}  // namespace

StatusOr<TurnStreamStats> Generator::ContinueStream(const TurnStream& stream,
                                                    TurnCache* cache) const {
  if (!stream.take || !stream.done) {
    return Status::InvalidArgument("ContinueStream: the stream needs both take and done");
  }
  auto [model, version] = Snapshot();
  TurnStreamStats stats;
  const int64_t max_new = options_.max_completion_length;
  try {
    c10::InferenceMode inference;  // as Generator::Decode's
    const decode::StreamSetup setup(options_, *model, tokenizer_);
    if (cache != nullptr) cache->Bind(version, model.get());

    std::vector<Live> active;                    // the stepper's rows, in order
    std::vector<at::Generator> gens;             // one stream per active row
    std::unique_ptr<decode::KvStepper> stepper;  // null while nothing decodes
    at::Tensor pending;  // [A] on the device: each row's last sampled token, not fed yet
    at::Tensor seen;     // [A, V] bool with the repetition penalty
    bool draining = false;

    while (true) {
      // 1. A newer policy: taken when nothing decodes, else admission pauses until then.
      auto [newer, newer_version] = PolicyOtherThan(version);
      if (newer != nullptr && active.empty()) {
        model = std::move(newer);
        version = newer_version;
        if (cache != nullptr) cache->Bind(version, model.get());
        draining = false;
        ++stats.num_switches;
      } else if (newer != nullptr) {
        draining = true;
      }

      // 2. The rows in flight feed their last tokens.
      at::Tensor logits;  // [A, V]
      if (!active.empty()) logits = stepper->Step(pending);

      // 3. Admission: each row from the keys/values the cache holds for it (or its group's
      // shared first context), its new tokens prefilled, then appended to the rows in flight.
      std::vector<Continuation> taken;
      if (!draining) taken = stream.take(/*idle=*/active.empty());
      if (active.empty() && taken.empty()) break;
      for (size_t i = 0; i < taken.size(); ++i) {
        RETURN_IF_ERROR(decode::CheckContinuation(
            taken[i], "continuation (tag " + std::to_string(taken[i].tag) + "): ", setup.vocab,
            max_new));
      }
      if (!taken.empty()) {
        std::vector<std::vector<int32_t>> contexts;
        for (const Continuation& c : taken) contexts.push_back(c.context);
        std::vector<KvCache> held(taken.size());
        std::vector<int64_t> reuse(taken.size(), 0);
        const int64_t cached = cache != nullptr ? cache->TakeRows(taken, &held, &reuse) : 0;
        int64_t shared = 0;
        if (cache != nullptr) shared = decode::ShareEqualContexts(*model, contexts, held, reuse);
        stats.num_cached_tokens += cached;
        stats.num_prefill_tokens -= cached + shared;
        for (const auto& c : contexts) stats.num_prefill_tokens += static_cast<int64_t>(c.size());
        const auto [ids, mask] = decode::LeftPadded(contexts, reuse);
        std::vector<const KvCache*> rows;
        for (const KvCache& h : held) rows.push_back(&h);
        const int64_t held_len = *std::max_element(reuse.begin(), reuse.end());
        auto admitted = std::make_unique<decode::KvStepper>(
            *model, model->StackRows(rows, reuse, held_len + ids.size(1) + setup.room));
        held.clear();  // copied into the admitted stepper
        at::Tensor fresh = admitted->Start(ids.to(setup.device), mask.to(setup.device), /*g=*/1, 0);
        at::Tensor fresh_seen;
        if (options_.sampling.uses_penalty()) {
          fresh_seen = decode::SeenTokens(contexts, 1, setup.vocab, setup.device);
        }
        decode::Join(std::move(admitted), fresh, fresh_seen, setup.room, stepper, logits, seen);
        for (Continuation& c : taken) {
          gens.push_back(MakeRowGenerator(options_.seed, c.seed_index,
                                          ContinuationStream(c.generation, c.turn)));
          Live l;
          l.tag = c.tag;
          l.seed_index = c.seed_index;
          l.generation = c.generation;
          l.context = std::move(c.context);
          l.max_new = c.max_new_tokens;
          active.push_back(std::move(l));
        }
      }
      stats.max_rows = std::max<int64_t>(stats.max_rows, static_cast<int64_t>(active.size()));

      // 4. A window of samples; stopped rows leave (their keys/values into the cache).
      ASSIGN_OR_RETURN(decode::Window window,
                       decode::SampleWindow(*stepper, logits, seen, options_.sampling, gens,
                                            setup.interval, setup.device));
      stats.num_decode_steps += setup.interval;
      if (options_.window_hook) options_.window_hook(stats.num_decode_steps);
      std::vector<int64_t> keep;
      for (int64_t a = 0; a < static_cast<int64_t>(active.size()); ++a) {
        Live& l = active[a];
        ASSIGN_OR_RETURN(
            const bool done,
            decode::AppendWindow(window, a, l.max_new, setup.stop_ids, options_.stop_strings,
                                 tokenizer_, l.row, -1, nullptr, &stats.num_completion_tokens));
        if (!done) {
          keep.push_back(a);
          continue;
        }
        common::Completion& c = l.row.completion;
        if (cache != nullptr) {
          // Its tokens so far except the last one, which was sampled but never fed.
          const int64_t fed = static_cast<int64_t>(l.context.size() + c.token_ids.size()) - 1;
          cache->Put(l.seed_index, l.generation, l.context, c.token_ids,
                     model->CompactRow(*stepper->cache(), a, fed));
        }
        if (tokenizer_ != nullptr && !l.row.text_set) {
          ASSIGN_OR_RETURN(c.text, decode::DecodeKnown(*tokenizer_, c.token_ids));
        }
        ++stats.num_turns;
        stream.done(StreamedTurn{l.tag, version, std::move(c)});
      }
      RETURN_IF_ERROR(
          decode::KeepOrEnd(keep, window, setup.device, stepper, seen, pending, active, gens));
    }
    return stats;
  } catch (const c10::Error& e) {
    if (cache != nullptr) cache->Clear();
    return Status::Internal(std::string("ContinueStream: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    if (cache != nullptr) cache->Clear();
    return Status::Internal(std::string("ContinueStream: ") + e.what());
  }
}

}  // namespace grpo::rollout
