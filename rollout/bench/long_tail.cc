#include "rollout/bench/long_tail.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>

#include "rollout/generator.h"

namespace grpo::rollout::bench {

std::vector<std::vector<int32_t>> LongTailPrompts(int64_t n, int64_t len, int64_t vocab,
                                                  uint64_t seed) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  const at::Tensor ids = at::randint(vocab, {n, len}, g, at::kInt).contiguous();
  std::vector<std::vector<int32_t>> prompts(n);
  for (int64_t p = 0; p < n; ++p) {
    const int32_t* row = ids[p].data_ptr<int32_t>();
    prompts[p].assign(row, row + len);
  }
  return prompts;
}

StatusOr<LongTailRun> RunLongTail(std::shared_ptr<const common::Model> policy,
                                  const LongTailShape& shape, const LongTailMode& mode,
                                  const std::vector<std::vector<int32_t>>& prompts) {
  if (static_cast<int64_t>(prompts.size()) != shape.groups) {
    return Status::InvalidArgument("long_tail: " + std::to_string(prompts.size()) +
                                   " prompts for " + std::to_string(shape.groups) + " groups");
  }
  LongTailRun run;
  int64_t rows_now = 0, last_steps = 0, next_update = mode.update_every, version = 0;
  Generator* gen_ptr = nullptr;
  GeneratorOptions o;
  o.num_generations = shape.num_generations;
  o.max_completion_length = std::max(shape.short_tokens, shape.long_tokens);
  o.max_prompt_length = shape.prompt_tokens;
  o.eos_token_ids = {-1};  // no id: every row runs to its group's budget
  o.seed = 11;
  o.partial_rollouts = mode.partial_rollouts;
  o.recompute_kv_on_update = mode.recompute_kv;
  Status update_status;
  o.window_hook = [&](int64_t steps) {
    run.row_steps += rows_now * (steps - last_steps);
    last_steps = steps;
    run.decode_steps = steps;
    if (mode.update_every > 0 && steps >= next_update) {
      // The same weights under a new version: the stream's work at an update is what it would
      // be with new ones.
      const Status s = gen_ptr->SetPolicy(policy, ++version);
      if (!s.ok() && update_status.ok()) update_status = s;
      ++run.updates;
      while (next_update <= steps) next_update += mode.update_every;
    }
  };
  ASSIGN_OR_RETURN(std::unique_ptr<Generator> gen, Generator::Create(policy, version, o));
  gen_ptr = gen.get();

  size_t next = 0;
  int64_t failed = 0;
  std::string first_failure;
  GroupStream stream;
  stream.max_prompts = shape.in_flight;
  stream.take = [&](int64_t room, bool idle, int64_t) {
    std::vector<StreamPrompt> out;
    if (!mode.continuous && !idle) return out;
    while (room-- > 0 && next < prompts.size()) {
      const int64_t i = static_cast<int64_t>(next++);
      out.push_back(
          {prompts[i], i, i, i % shape.long_every == 0 ? shape.long_tokens : shape.short_tokens});
      rows_now += shape.num_generations;
    }
    return out;
  };
  stream.done = [&](StreamedGroup g) {
    rows_now -= shape.num_generations;
    if (!g.group.ok()) {
      if (failed++ == 0) first_failure = g.group.status().ToString();
      return;
    }
    for (const auto& c : g.group->completions) {
      run.tokens += static_cast<int64_t>(c.token_ids.size());
    }
  };
  const auto t0 = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(StreamStats stats, gen->GenerateStream(stream));
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  RETURN_IF_ERROR(update_status);
  if (failed > 0) {
    return Status::Internal("long_tail: " + std::to_string(failed) +
                            " groups failed, first: " + first_failure);
  }
  if (stats.num_groups != shape.groups) {
    return Status::Internal("long_tail: " + std::to_string(stats.num_groups) + " groups of " +
                            std::to_string(shape.groups));
  }
  run.switches = stats.num_switches;
  run.drains = stats.num_drains;
  run.recompute_tokens = stats.num_recompute_tokens;
  return run;
}

}  // namespace grpo::rollout::bench
