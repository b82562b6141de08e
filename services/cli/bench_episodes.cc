// grpo bench episodes: multi-turn episodes per second of one process (ProduceEpisodes on one
// Generator), the KV cache kept between turns vs every turn prefilled again, with an environment
// that answers at once, one that takes 50 ms per step, a skewed one (5 ms, and 100 ms for one
// step in 8) and one with slow resets (5 ms steps, 200 ms to reset the second prompt's
// episodes), each with and without overlap_env_steps (kept cache); the single-turn path
// (Generate) for the same completion tokens as the reference. All configurations of a model run
// interleaved, rep by rep, after one warm-up each.
#include <ATen/Parallel.h>

#include <chrono>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/model/model_config.h"
#include "rollout/env/episode.h"
#include "rollout/generator.h"
#include "services/cli/bench_util.h"

namespace grpo::services::bench {
namespace {

using nlohmann::json;

// One model's episode shape. Turns end at a stop token drawn with probability 1 / turn_tokens
// per token (every turn_tokens-th id of the vocabulary, the untrained models' distribution
// being near uniform), so turn lengths are geometric with that mean, as sampled turns are.
struct Shape {
  std::string preset;
  int64_t prompts = 0, g = 0;  // episodes = prompts x g
  int64_t prompt_tokens = 0, turn_tokens = 0, observation_tokens = 0, max_turns = 0;
  int64_t max_completion_length = 0;
};

const std::vector<Shape>& Shapes() {
  static const std::vector<Shape> shapes = {
      {"tiny", 4, 8, 32, 24, 24, 4, 448},
      {"bench", 2, 8, 64, 32, 32, 4, 1024},
  };
  return shapes;
}

std::vector<std::vector<int32_t>> Prompts(const Shape& s, int64_t vocab) {
  std::vector<std::vector<int32_t>> prompts(s.prompts);
  for (int64_t p = 0; p < s.prompts; ++p) {
    for (int64_t t = 0; t < s.prompt_tokens; ++t) {
      prompts[p].push_back(static_cast<int32_t>((977 * p + 131 * t + 7) % vocab));
    }
  }
  return prompts;
}

// How long an environment takes: every step `step_ms`, or `slow_step_ms` for one step in 8 when
// that is > 0 (which ones: a hash of the episode's reset seed and the step's index, the same in
// every run), and every reset of the second prompt's episodes (its row says "slow_reset": 1
// prompt of 4 on tiny, 1 of 2 on bench) `slow_reset_ms`, the others at once.
struct EnvTiming {
  int64_t step_ms = 0, slow_step_ms = 0, slow_reset_ms = 0;
  bool operator==(const EnvTiming&) const = default;
};

// Every step shows `observation_tokens` tokens after its time; max_turns ends the episode.
rollout::FunctionEnvironment SlowEnvironment(EnvTiming timing, int64_t observation_tokens) {
  return rollout::FunctionEnvironment(
      "bench",
      [timing](const json& row, uint64_t seed, json& state) -> StatusOr<rollout::EnvObservation> {
        state = {{"seed", seed}, {"step", 0}};
        if (timing.slow_reset_ms > 0 && row.value("slow_reset", false)) {
          std::this_thread::sleep_for(std::chrono::milliseconds(timing.slow_reset_ms));
        }
        return rollout::EnvObservation{};
      },
      [timing, observation_tokens](const std::string&,
                                   json& state) -> StatusOr<rollout::EnvObservation> {
        const uint64_t step = state["step"].get<uint64_t>() + 1;
        state["step"] = step;
        const uint64_t h =
            state["seed"].get<uint64_t>() * 0x9E3779B97F4A7C15ull + step * 0xBF58476D1CE4E5B9ull;
        const int64_t ms =
            timing.slow_step_ms > 0 && (h >> 61) == 0 ? timing.slow_step_ms : timing.step_ms;
        if (ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
        rollout::EnvObservation obs;
        obs.messages = {{"user", std::string(observation_tokens, 'o')}};
        return obs;
      });
}

struct Config {
  std::string impl;                // kept_cache | reprefill | single_turn
  EnvTiming env;                   // episodes only
  bool overlap = false;            // overlap_env_steps
  std::vector<double> s;           // one per timed rep
  std::vector<double> generate_s;  // the Continue calls' share of each rep
  rollout::EpisodeCounts counts;
  int64_t completion_tokens = 0;
};

// The generator options of a shape: G, lengths, and turns that end at its stop tokens only.
rollout::GeneratorOptions ShapeGeneratorOptions(const Shape& shape, int64_t vocab) {
  rollout::GeneratorOptions go;
  go.num_generations = shape.g;
  go.max_prompt_length = shape.prompt_tokens;
  go.max_completion_length = shape.max_completion_length;
  go.eos_token_ids = {-1};  // turns end at the stop tokens below only
  for (int64_t t = 0; t < vocab; t += shape.turn_tokens) {
    go.stop_token_ids.push_back(static_cast<int32_t>(t));
  }
  go.seed = 5;
  return go;
}

// The episodes' options: 16 sessions at once, observations rendered to made-up ids.
rollout::EpisodeOptions ShapeEpisodeOptions(int64_t max_turns, int64_t vocab) {
  rollout::EpisodeOptions eo;
  eo.max_turns = max_turns;
  eo.max_concurrent_sessions = 16;
  eo.end_of_turn_id = 0;
  eo.render = [vocab](const std::vector<common::ChatMessage>& m,
                      bool) -> StatusOr<std::vector<int32_t>> {
    std::vector<int32_t> ids;
    for (size_t j = 0; j < m[0].content.size(); ++j) {
      ids.push_back(static_cast<int32_t>((1 + 37 * j) % vocab));
    }
    return ids;
  };
  return eo;
}

}  // namespace

int BenchEpisodes(const EpisodesBenchOptions& o) {
  std::vector<json> rows;
  for (const Shape& shape : Shapes()) {
    if (o.fast && shape.preset != "tiny") continue;
    auto cfg = common::ModelConfigPreset(shape.preset);
    std::shared_ptr<const common::Model> model =
        std::move(common::Model::InitRandom(*cfg, 0)).value();
    const int64_t vocab = model->config().vocab_size;
    const rollout::GeneratorOptions go = ShapeGeneratorOptions(shape, vocab);
    auto gen = std::move(rollout::Generator::Create(model, 0, go)).value();

    std::vector<rollout::Prompt> prompts;
    for (auto& ids : Prompts(shape, vocab)) {
      // The second prompt's environment is slow to reset (when the timing says so).
      const json row = prompts.size() == 1 ? json{{"slow_reset", true}} : json::object();
      prompts.push_back({"", std::move(ids), row});
    }
    std::vector<rollout::ProduceInput> inputs;
    for (size_t p = 0; p < prompts.size(); ++p) {
      inputs.push_back({&prompts[p], static_cast<int64_t>(p)});
    }
    const rollout::EpisodeOptions eo =
        ShapeEpisodeOptions(o.max_turns > 0 ? o.max_turns : shape.max_turns, vocab);

    // Per environment: the kept cache with every turn waiting for every step, the same with
    // overlap_env_steps, and for the uniform ones every turn prefilled again.
    std::vector<Config> configs;
    for (const EnvTiming& env :
         {EnvTiming{0, 0, 0}, EnvTiming{50, 0, 0}, EnvTiming{5, 100, 0}, EnvTiming{5, 0, 200}}) {
      const bool uniform = env.slow_step_ms == 0 && env.slow_reset_ms == 0;
      for (const char* impl : {"kept_cache", "overlap", "reprefill"}) {
        if (!uniform && impl == std::string("reprefill")) continue;
        Config c;
        c.overlap = impl == std::string("overlap");
        c.impl = c.overlap ? "kept_cache" : impl;
        c.env = env;
        configs.push_back(std::move(c));
      }
    }
    // The configuration of the same environment with `impl` and `overlap`.
    const auto same_env = [&configs](const Config& c, const std::string& impl,
                                     bool overlap) -> const Config* {
      for (const Config& o : configs) {
        if (o.impl == impl && o.overlap == overlap && o.env == c.env) {
          return &o;
        }
      }
      return nullptr;
    };
    configs.emplace_back();
    configs.back().impl = "single_turn";
    // The single-turn reference: the same prompts and G, every completion as long as an
    // episode's model tokens on average (measured by the first kept-cache episodes run).
    std::unique_ptr<rollout::Generator> single;
    std::vector<std::vector<int32_t>> single_prompts;
    for (const auto& p : prompts) single_prompts.push_back(p.ids);

    auto run = [&](Config& c) -> double {
      const auto t0 = Clock::now();
      if (c.impl == "single_turn") {
        auto r = single->Generate(single_prompts);
        if (!r.ok()) std::abort();
        c.completion_tokens = r->num_completion_tokens;
        return Seconds(t0);
      }
      rollout::EpisodeOptions e = eo;
      e.keep_kv_cache = c.impl == "kept_cache";
      e.overlap_env_steps = c.overlap;
      rollout::FunctionEnvironment env = SlowEnvironment(c.env, shape.observation_tokens);
      auto r = rollout::ProduceEpisodes(*gen, nullptr, env, e, inputs, &c.counts);
      if (!r.ok()) {
        std::cerr << "episodes: " << r.status().ToString() << "\n";
        std::abort();
      }
      c.completion_tokens = r->num_completion_tokens;
      c.generate_s.push_back(r->generate_seconds);
      return Seconds(t0);
    };
    // Warm-ups (the first one sizes the single-turn reference), then interleaved reps.
    for (Config& c : configs) {
      if (c.impl == "single_turn") {
        rollout::GeneratorOptions so = go;
        so.stop_token_ids.clear();
        so.max_completion_length =
            std::max<int64_t>(1, configs[0].completion_tokens / configs[0].counts.episodes);
        single = std::move(rollout::Generator::Create(model, 0, so)).value();
      }
      run(c);
      c.generate_s.clear();
    }
    for (int rep = 0; rep < o.reps; ++rep) {
      for (Config& c : configs) c.s.push_back(run(c));
    }
    const Timing single_t = Summarize(configs.back().s);
    for (size_t i = 0; i < configs.size(); ++i) {
      const Config& c = configs[i];
      const Timing t = Summarize(c.s);
      json row = {{"bench", "episodes"},
                  {"model", shape.preset},
                  {"impl", c.impl},
                  {"completion_tokens", c.completion_tokens},
                  {"s_median", t.median},
                  {"s_min", t.min},
                  {"s_max", t.max},
                  {"reps", o.reps},
                  {"intra_op_threads", at::get_num_threads()},
                  {"max_turns", eo.max_turns}};
      if (c.impl == "single_turn") {
        row["rows"] = shape.prompts * shape.g;
        row["prompt_tokens"] = shape.prompt_tokens;
        row["tokens_per_second"] = c.completion_tokens / t.median;
      } else {
        row["env_step_ms"] = c.env.step_ms;
        row["env_slow_step_ms"] = c.env.slow_step_ms;    // one step in 8 (0: none)
        row["env_slow_reset_ms"] = c.env.slow_reset_ms;  // the second prompt's resets (0: none)
        row["overlap_env_steps"] = c.overlap;
        row["episodes"] = c.counts.episodes;
        row["turns"] = c.counts.turns;
        row["observation_tokens"] = c.counts.observation_tokens;
        row["episodes_per_second"] = c.counts.episodes / t.median;
        row["generate_s_median"] = Summarize(c.generate_s).median;
        row["vs_single_turn_time"] = t.median / single_t.median;
        if (const Config* r = same_env(c, "reprefill", false);
            r != nullptr && c.impl == "kept_cache" && !c.overlap) {
          row["vs_reprefill"] = Summarize(r->s).median / t.median;
        }
        if (c.overlap) {
          row["vs_waiting"] = Summarize(same_env(c, c.impl, false)->s).median / t.median;
        }
      }
      rows.push_back(row);
    }
  }
  if (o.json) {
    for (auto& r : rows) std::cout << r.dump() << "\n";
    return 0;
  }
  const std::string turns = o.max_turns > 0 ? std::to_string(o.max_turns) : "4";
  std::cout << "episodes: one process, ProduceEpisodes; tiny: 4 prompts x G=8, prompt 32, " << turns
            << " turns of ~24 tokens, observations 24; bench: 2 x 8, prompt 64, " << turns
            << " turns of ~32, "
               "observations 32; median of "
            << o.reps << " interleaved reps, " << at::get_num_threads() << " intra-op thread(s)\n"
            << std::fixed;
  for (const json& r : rows) {
    std::cout << "  " << std::left << std::setw(6) << r["model"].get<std::string>() << std::setw(12)
              << r["impl"].get<std::string>();
    if (r["impl"] == "single_turn") {
      std::cout << "            " << std::right << std::setw(6)
                << r["completion_tokens"].get<int64_t>() << " tokens  " << std::setprecision(3)
                << r["s_median"].get<double>() << " s (" << r["s_min"].get<double>() << "-"
                << r["s_max"].get<double>() << ")\n";
      continue;
    }
    std::string env = std::to_string(r["env_step_ms"].get<int64_t>()) + " ms";
    if (r["env_slow_step_ms"].get<int64_t>() > 0) {
      env += ", 1 in 8 " + std::to_string(r["env_slow_step_ms"].get<int64_t>());
    }
    if (r["env_slow_reset_ms"].get<int64_t>() > 0) {
      env += ", 2nd prompt resets " + std::to_string(r["env_slow_reset_ms"].get<int64_t>());
    }
    if (r["overlap_env_steps"].get<bool>()) env += ", overlap";
    std::cout << "env " << std::left << std::setw(34) << env << std::right << std::setw(6)
              << r["completion_tokens"].get<int64_t>() << " tokens  " << std::setprecision(3)
              << r["s_median"].get<double>() << " s (" << r["s_min"].get<double>() << "-"
              << r["s_max"].get<double>() << "; generating " << r["generate_s_median"].get<double>()
              << ")  " << std::setprecision(1) << r["episodes_per_second"].get<double>()
              << " episodes/s  " << std::setprecision(2) << r["vs_single_turn_time"].get<double>()
              << "x single-turn time";
    if (r.contains("vs_reprefill")) {
      std::cout << "  kept / reprefill speed " << r["vs_reprefill"].get<double>() << "x";
    }
    if (r.contains("vs_waiting")) {
      std::cout << "  overlap / waiting speed " << r["vs_waiting"].get<double>() << "x";
    }
    std::cout << "\n";
  }
  return 0;
}

int BenchEpisodeStream(const EpisodesBenchOptions& o) {
  // The tiny shape with 16 prompts (its 4, four times over), 2 prompts a lease: 16 groups of 8,
  // 16 sessions (2 groups at once).
  Shape shape = Shapes().front();
  shape.prompts = 16;
  constexpr int64_t kLease = 2;
  auto cfg = common::ModelConfigPreset(shape.preset);
  std::shared_ptr<const common::Model> model =
      std::move(common::Model::InitRandom(*cfg, 0)).value();
  const int64_t vocab = model->config().vocab_size;
  auto gen =
      std::move(rollout::Generator::Create(model, 0, ShapeGeneratorOptions(shape, vocab))).value();
  std::vector<rollout::Prompt> prompts;
  for (auto& ids : Prompts(shape, vocab)) prompts.push_back({"", std::move(ids), json::object()});
  rollout::EpisodeOptions eo =
      ShapeEpisodeOptions(o.max_turns > 0 ? o.max_turns : shape.max_turns, vocab);
  eo.overlap_env_steps = true;

  struct Mode {
    EnvTiming env;
    bool stream = false;
    std::vector<double> s;
    int64_t tokens = 0, episodes = 0;
  };
  std::vector<Mode> modes;
  for (const EnvTiming& env : {EnvTiming{0, 0, 0}, EnvTiming{5, 100, 0}}) {
    for (bool stream : {false, true}) modes.push_back({env, stream, {}, 0, 0});
  }
  const auto run = [&](Mode& m) -> double {
    rollout::FunctionEnvironment env = SlowEnvironment(m.env, shape.observation_tokens);
    m.tokens = 0;
    m.episodes = 0;
    const auto t0 = Clock::now();
    if (!m.stream) {  // a worker's rounds: one ProduceEpisodes call per lease
      for (size_t first = 0; first < prompts.size(); first += kLease) {
        std::vector<rollout::ProduceInput> inputs;
        for (size_t p = first; p < first + kLease; ++p) {
          inputs.push_back({&prompts[p], static_cast<int64_t>(p)});
        }
        rollout::EpisodeCounts counts;
        auto r = rollout::ProduceEpisodes(*gen, nullptr, env, eo, inputs, &counts);
        if (!r.ok()) {
          std::cerr << "episode_stream: " << r.status().ToString() << "\n";
          std::abort();
        }
        m.tokens += r->num_completion_tokens;
        m.episodes += counts.episodes;
      }
      return Seconds(t0);
    }
    size_t next = 0;
    rollout::EpisodeFeed feed;
    feed.take = [&](int64_t room, bool) {
      std::vector<rollout::FedPrompt> out;
      for (; room > 0 && next < prompts.size(); --room, ++next) {
        out.push_back({{&prompts[next], static_cast<int64_t>(next)}, static_cast<int64_t>(next)});
      }
      return out;
    };
    feed.done = [&](rollout::EpisodeGroup g) { m.episodes += g.counts.episodes; };
    auto r = rollout::StreamEpisodes(*gen, env, eo, feed);
    if (!r.ok()) {
      std::cerr << "episode_stream: " << r.status().ToString() << "\n";
      std::abort();
    }
    m.tokens = r->num_completion_tokens;
    m.episodes += r->counts.episodes;
    return Seconds(t0);
  };
  for (Mode& m : modes) run(m);  // warm-up
  for (int rep = 0; rep < o.reps; ++rep) {
    for (Mode& m : modes) m.s.push_back(run(m));
  }
  std::vector<json> rows;
  for (const Mode& m : modes) {
    const Timing t = Summarize(m.s);
    json row = {{"bench", "episode_stream"},
                {"model", shape.preset},
                {"mode", m.stream ? "stream" : "per_lease"},
                {"env_step_ms", m.env.step_ms},
                {"env_slow_step_ms", m.env.slow_step_ms},
                {"prompts", shape.prompts},
                {"prompts_per_lease", kLease},
                {"episodes", m.episodes},
                {"completion_tokens", m.tokens},
                {"s_median", t.median},
                {"s_min", t.min},
                {"s_max", t.max},
                {"episodes_per_second", static_cast<double>(m.episodes) / t.median},
                {"reps", o.reps},
                {"intra_op_threads", at::get_num_threads()}};
    if (m.stream) {
      for (const Mode& other : modes) {
        if (!other.stream && other.env == m.env) {
          row["vs_per_lease"] = Summarize(other.s).median / t.median;
        }
      }
    }
    rows.push_back(row);
  }
  if (o.json) {
    for (auto& r : rows) std::cout << r.dump() << "\n";
    return 0;
  }
  std::cout << "episode_stream: tiny, 16 prompts x G=8 (" << kLease
            << " a lease), 16 sessions, 4 turns, overlap_env_steps; one ProduceEpisodes call per "
               "lease against one StreamEpisodes call; median of "
            << o.reps << " interleaved reps, " << at::get_num_threads() << " intra-op thread(s)\n"
            << std::fixed;
  for (const json& r : rows) {
    std::string env = std::to_string(r["env_step_ms"].get<int64_t>()) + " ms";
    if (r["env_slow_step_ms"].get<int64_t>() > 0) {
      env += ", 1 in 8 " + std::to_string(r["env_slow_step_ms"].get<int64_t>());
    }
    std::cout << "  env " << std::left << std::setw(20) << env << std::setw(10)
              << r["mode"].get<std::string>() << std::right << std::setw(6)
              << r["completion_tokens"].get<int64_t>() << " tokens  " << std::setprecision(3)
              << r["s_median"].get<double>() << " s (" << r["s_min"].get<double>() << "-"
              << r["s_max"].get<double>() << ")  " << std::setprecision(1)
              << r["episodes_per_second"].get<double>() << " episodes/s";
    if (r.contains("vs_per_lease")) {
      std::cout << "  stream / per lease speed " << std::setprecision(2)
                << r["vs_per_lease"].get<double>() << "x";
    }
    std::cout << "\n";
  }
  return 0;
}

}  // namespace grpo::services::bench
