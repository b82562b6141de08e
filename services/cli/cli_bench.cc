// grpo bench <name> [--json]: the benchmarks of docs/BENCHMARKS.md. Each row carries its
// own baseline measured in the same run; memory rows run each configuration in a fresh
// process (this binary, re-executed with --child).
#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "common/malloc_info.h"
#include "common/model/device.h"
#include "common/model/model.h"
#include "common/model/model_config.h"
#include "learner/chunked_logprobs.h"
#include "learner/grpo_trainer.h"
#include "rollout/generator.h"
#include "services/cli/bench_util.h"
#include "services/cli/cli.h"
#include "services/cli/launch.h"

namespace grpo::services {

namespace bench {

std::unique_ptr<common::Model> BenchModel(int64_t layers) {
  auto cfg = common::ModelConfigPreset("bench");
  if (layers > 0) cfg->num_hidden_layers = layers;
  return std::move(common::Model::InitRandom(*cfg, 0)).value();
}

at::Tensor RandomIds(int64_t n, int64_t vocab, uint64_t seed) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  return at::randint(vocab, {n, kPromptLen + kCompletionLen}, g, at::kLong);
}

std::vector<std::vector<int32_t>> RandomPrompts(int64_t n, int64_t len, int64_t vocab,
                                                uint64_t seed) {
  const at::Tensor ids = RandomIds(n, vocab, seed).narrow(1, 0, len).to(at::kInt).contiguous();
  std::vector<std::vector<int32_t>> prompts(n);
  for (int64_t p = 0; p < n; ++p) {
    const int32_t* row = ids[p].data_ptr<int32_t>();
    prompts[p].assign(row, row + len);
  }
  return prompts;
}

int64_t ProcStatusBytes(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(k, 0) == 0) return std::stoll(line.substr(k.size())) * 1024;
  }
  return 0;
}

int64_t AnonymousPeak::Now() { return ProcStatusBytes("RssAnon"); }

AnonymousPeak::AnonymousPeak() : peak_(Now()) {
  sampler_ = std::thread([this] {
    while (!stop_.load()) {
      const int64_t now = Now();
      if (now > peak_.load()) peak_.store(now);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
}

AnonymousPeak::~AnonymousPeak() { Stop(); }

int64_t AnonymousPeak::Stop() {
  if (sampler_.joinable()) {
    stop_.store(true);
    sampler_.join();
    peak_.store(std::max(peak_.load(), Now()));
  }
  return peak_.load();
}

// The resident set a step's peak (VmHWM) is read above. The malloc's free memory goes back to
// the kernel first: on tcmalloc a step would otherwise reuse the pages the one before it freed,
// and its peak would read ~0. Then VmHWM is reset to the current resident set (clear_refs 5).
int64_t StartResidentPeak() {
  common::ReleaseFreeMemory();
  std::ofstream("/proc/self/clear_refs") << "5";
  return ProcStatusBytes("VmRSS");
}

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 0;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}

StatusOr<std::unique_ptr<learner::distributed::RankGroup>> JoinRankProcesses() {
  ASSIGN_OR_RETURN(const learner::distributed::RankEnv env,
                   learner::distributed::RankEnvFromEnvironment());
  return learner::distributed::RankGroup::Join(env, std::chrono::seconds(300));
}

std::vector<nlohmann::json> RunRankProcesses(int world, const std::string& args) {
  const std::string exe = "/proc/" + std::to_string(::getpid()) + "/exe";
  const int port = FreePort();
  std::vector<std::unique_ptr<FILE, int (*)(FILE*)>> children;
  for (int r = 0; r < world; ++r) {
    const std::string cmd = "RANK=" + std::to_string(r) + " WORLD_SIZE=" + std::to_string(world) +
                            " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " " +
                            exe + " " + args;
    children.emplace_back(popen(cmd.c_str(), "r"), &pclose);
  }
  std::vector<nlohmann::json> ranks;
  bool failed = false;
  for (auto& child : children) {
    std::string out;
    char buf[4096];
    size_t n;
    while (child && (n = fread(buf, 1, sizeof(buf), child.get())) > 0) out.append(buf, n);
    const int rc = child ? pclose(child.release()) : -1;
    const size_t brace = out.rfind('{');
    if (rc != 0 || brace == std::string::npos) {
      failed = true;
      continue;
    }
    ranks.push_back(nlohmann::json::parse(out.substr(brace)));
  }
  if (failed) ranks.clear();
  return ranks;
}

Timing LearnerStepTiming(int reps, int64_t micro, bool gradient_checkpointing, double* peak_mib,
                         int64_t layers) {
  auto model = BenchModel(layers);
  common::GrpoConfig cfg;
  cfg.gradient_checkpointing = gradient_checkpointing;
  cfg.num_generations = kBenchGenerations;
  cfg.per_device_train_batch_size = micro;
  cfg.gradient_accumulation_steps = kBenchGenerations / micro;
  cfg.max_completion_length = kCompletionLen;
  cfg.importance_sampling_correction = "none";
  cfg.max_staleness = 1 << 20;
  cfg.max_steps = 1 << 20;
  auto trainer = std::move(learner::GrpoTrainer::Create(cfg, model.get(), nullptr)).value();
  at::Tensor ids = RandomIds(kBenchGenerations, model->config().vocab_size, 2);
  common::RolloutGroup g;
  g.prompt_id = "bench";
  for (int64_t t = 0; t < kPromptLen; ++t) g.prompt_ids.push_back(ids[0][t].item<int32_t>());
  for (int64_t j = 0; j < kBenchGenerations; ++j) {
    common::Completion c;
    for (int64_t t = 0; t < kCompletionLen; ++t) {
      c.token_ids.push_back(ids[j][kPromptLen + t].item<int32_t>());
    }
    c.rewards = {static_cast<double>(j % 4)};
    g.completions.push_back(c);
  }
  auto step = [&] {
    g.policy_version = trainer->policy_version();
    auto r = trainer->TrainGenerationBatch({g});
    if (!r.ok() || r->steps.size() != 1) std::abort();
  };
  step();  // optimizer state and gradients exist now
  const int64_t base = StartResidentPeak();
  const Timing t = TimeIt(reps, step);
  if (peak_mib != nullptr) *peak_mib = (ProcStatusBytes("VmHWM") - base) / 1048576.0;
  return t;
}

}  // namespace bench

namespace {

using bench::BenchModel;
using bench::Clock;
using bench::kCompletionLen;
using bench::kPromptLen;
using bench::RandomIds;
using bench::RandomPrompts;
using bench::Seconds;
using bench::TimeIt;
using bench::Timing;
using nlohmann::json;

// The same-run compute ceiling: fp32 1024x1024 matmul, GFLOP/s, the best of 5 (a ceiling is
// what the machine can do; a median taken under load read so low that a step reported 1.29x
// of it). Benchmarks take the best of several such readings interleaved with their work.
double GemmCeilingGflops() {
  at::Tensor a = at::randn({1024, 1024}), b = at::randn({1024, 1024});
  Timing t = TimeIt(5, [&] { at::mm(a, b); });
  return 2.0 * 1024 * 1024 * 1024 / t.min / 1e9;
}

using bench::ProcStatusBytes;
using bench::StartResidentPeak;

// One child configuration of logprob_memory: forward + backward of the log-probs of G
// sequences; "chunked" in micro-batches of `micro` with accumulation, "naive" all at once
// (TRL's original get_per_token_logps: whole-batch logits, log_softmax, gather).
// On a GPU (device auto) the model runs there and the peak is the CUDA caching allocator's.
json LogprobMemoryChild(const std::string& impl, int64_t G, int64_t micro, int reps) {
  auto model = BenchModel();
  auto resolved = common::ResolveDevice("auto");
  const at::Device device = resolved.ok() ? *resolved : at::Device(at::kCPU);
  if (Status s = model->To(device, at::kFloat); !s.ok()) return {{"error", s.ToString()}};
  model->SetRequiresGrad(true);
  const int64_t V = model->config().vocab_size;
  at::Tensor ids = RandomIds(G, V, 1).to(device);
  at::Tensor adv = at::randn({G}).to(device);
  auto step = [&] {
    for (auto& p : model->Parameters()) {  // as AdamW::ZeroGrad: in place, memory kept
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    // chunked: the learner's path at a fixed micro-batch; chunked_batch_G: the same path over
    // the whole batch at once, as naive does (same GEMM shapes: the cost of chunking alone).
    const bool fused = impl == "chunked" || impl == "chunked_batch_G";
    const int64_t mb = impl == "chunked" ? micro : G;
    for (int64_t b0 = 0; b0 < G; b0 += mb) {
      const int64_t b = std::min(mb, G - b0);
      at::Tensor x = ids.narrow(0, b0, b);
      at::Tensor hidden = model->ForwardHidden(x, at::ones_like(x));
      at::Tensor h = hidden.narrow(1, kPromptLen - 1, kCompletionLen);
      at::Tensor labels = x.narrow(1, kPromptLen, kCompletionLen);
      const at::Tensor a = adv.narrow(0, b0, b);
      if (fused) {
        // The learner's path: fused log-probs + loss gradient (loss below: dL/dlogp_t =
        // -a_i / (C G) for token t of sequence i).
        const at::Tensor g = (-a / static_cast<double>(kCompletionLen * G))
                                 .unsqueeze(1)
                                 .expand({b, kCompletionLen})
                                 .reshape({-1});
        learner::TokenLossGrad token_grad = [&](int64_t s, const at::Tensor& lp) {
          return g.narrow(0, s, lp.size(0));
        };
        at::Tensor logp;
        learner::FusedTokenLogprobsLoss(h, model->LmHeadWeight(), labels, token_grad, &logp, 1024)
            .backward();
      } else {
        at::Tensor lp = learner::NaiveTokenLogprobs(h, model->LmHeadWeight(), labels);
        at::Tensor loss = -(lp.mean(1) * a).sum() / static_cast<double>(G);
        loss.backward();
      }
    }
    if (device.is_cuda())
      torch::cuda::synchronize(device.index());  // the timing covers the kernels
  };
  // Peak RSS counts from here: model and its gradients exist after one step.
  step();
  int64_t base = 0;
  if (device.is_cuda()) {
    common::ResetPeakMemory(device);
    base = common::CurrentMemoryBytes(device);
  } else {
    base = StartResidentPeak();
  }
  Timing t = TimeIt(reps, step);
  const int64_t peak =
      (device.is_cuda() ? common::PeakMemoryBytes(device) : ProcStatusBytes("VmHWM")) - base;
  return {{"bench", "logprob_memory"},
          {"impl", impl},
          {"G", G},
          {"device", device.str()},
          {"micro_batch", impl == "chunked" ? micro : G},
          {"peak_mib", peak / 1048576.0},
          {"step_s_median", t.median},
          {"step_s_min", t.min},
          {"step_s_max", t.max}};
}

json RunChild(const std::string& args) {
  const std::string cmd = "/proc/" + std::to_string(::getpid()) + "/exe bench " + args;
  std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), &pclose);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p.get())) > 0) out.append(buf, n);
  if (pclose(p.release()) != 0 || out.empty()) return {{"error", "child failed: " + cmd}};
  return json::parse(out.substr(0, out.find('\n')));
}

int BenchLogprobMemory(bool as_json, int64_t micro, int reps, const std::vector<int64_t>& gs) {
  std::vector<json> rows;
  for (int64_t G : gs) {
    for (const char* impl : {"chunked", "chunked_batch_G", "naive"}) {
      json r = RunChild(std::string("logprob_memory --child --impl ") + impl + " --G " +
                        std::to_string(G) + " --micro_batch " + std::to_string(micro) + " --reps " +
                        std::to_string(reps));
      if (r.contains("error")) {
        std::cerr << r["error"] << "\n";
        return 1;
      }
      rows.push_back(r);
    }
  }
  auto find = [&](const std::string& impl, int64_t G) -> json& {
    for (auto& r : rows)
      if (r["impl"] == impl && r["G"] == G) return r;
    return rows.front();
  };
  for (int64_t G : gs) {
    json& c = find("chunked", G);
    json& nv = find("naive", G);
    c["vs_naive_memory"] = c["peak_mib"].get<double>() / nv["peak_mib"].get<double>();
    c["vs_naive_speed"] = nv["step_s_median"].get<double>() / c["step_s_median"].get<double>();
    json& cg = find("chunked_batch_G", G);
    cg["vs_naive_memory"] = cg["peak_mib"].get<double>() / nv["peak_mib"].get<double>();
    cg["vs_naive_speed"] = nv["step_s_median"].get<double>() / cg["step_s_median"].get<double>();
    cg["vs_G4_memory"] = cg["peak_mib"].get<double>() /
                         find("chunked_batch_G", gs.front())["peak_mib"].get<double>();
    c["vs_G4_memory"] =
        c["peak_mib"].get<double>() / find("chunked", gs.front())["peak_mib"].get<double>();
    nv["vs_G4_memory"] =
        nv["peak_mib"].get<double>() / find("naive", gs.front())["peak_mib"].get<double>();
  }
  if (as_json) {
    for (auto& r : rows) std::cout << r.dump() << "\n";
    return 0;
  }
  std::cout << "logprob_memory: bench model (vocab 32768), prompt 64 + completion 128 tokens; "
               "chunked = the learner's fused path at micro-batch "
            << micro
            << ", chunked_batch_G = the same path over all G at once (as naive); "
               "peak = VmHWM - RSS before the step\n";
  std::cout << std::left << std::setw(17) << "impl" << std::setw(5) << "G" << std::right
            << std::setw(12) << "peak MiB" << std::setw(12) << "vs G=4" << std::setw(12)
            << "vs naive" << std::setw(12) << "step s" << std::setw(14) << "speed/naive\n";
  for (auto& r : rows) {
    std::cout << std::left << std::setw(17) << r["impl"].get<std::string>() << std::setw(5)
              << r["G"].get<int64_t>() << std::right << std::fixed << std::setprecision(1)
              << std::setw(12) << r["peak_mib"].get<double>() << std::setprecision(2)
              << std::setw(12) << r["vs_G4_memory"].get<double>() << std::setw(12)
              << (r.contains("vs_naive_memory") ? r["vs_naive_memory"].get<double>() : 1.0)
              << std::setprecision(3) << std::setw(12) << r["step_s_median"].get<double>()
              << std::setprecision(2) << std::setw(13)
              << (r.contains("vs_naive_speed") ? r["vs_naive_speed"].get<double>() : 1.0) << "\n";
  }
  return 0;
}

// One optimizer step of GrpoTrainer on the bench model: G=16 completions of one prompt.
int BenchLearnerStep(bool as_json, int reps, int64_t micro, bool gradient_checkpointing,
                     int64_t layers) {
  double ceiling = GemmCeilingGflops();
  double peak_mib = 0;
  Timing t = bench::LearnerStepTiming(reps, micro, gradient_checkpointing, &peak_mib, layers);
  ceiling = std::max(ceiling, GemmCeilingGflops());
  auto model = BenchModel(layers);  // for the FLOP count
  const double tokens = 16.0 * (kPromptLen + kCompletionLen);
  // Model FLOPs: 6 N T (forward 2 N T + backward 4 N T, N = every parameter, the tied LM head
  // once) plus attention (12 L T^2 D). The fused LM head recomputes nothing; the layers'
  // recompute under gradient checkpointing is not counted (it is overhead, not model work).
  const auto& mc = model->config();
  const double n = static_cast<double>(model->NumParameters());
  const double flops = 6 * n * tokens + 12.0 * mc.num_hidden_layers * 16 *
                                            std::pow(kPromptLen + kCompletionLen, 2) *
                                            mc.hidden_size;
  const double gflops = flops / t.median / 1e9;
  json row = {{"bench", "learner_step"},
              {"G", 16},
              {"micro_batch", micro},
              {"gradient_checkpointing", gradient_checkpointing},
              {"layers", model->config().num_hidden_layers},
              {"peak_mib", peak_mib},
              {"tokens_per_second", tokens / t.median},
              {"step_s_median", t.median},
              {"step_s_min", t.min},
              {"step_s_max", t.max},
              {"gflops", gflops},
              {"gemm_ceiling_gflops", ceiling},
              {"vs_ceiling", gflops / ceiling}};
  if (as_json) {
    std::cout << row.dump() << "\n";
  } else {
    std::cout << "learner_step: bench model (" << model->config().num_hidden_layers
              << " layers), 16 x (64 + 128) tokens, micro-batch " << micro
              << (gradient_checkpointing ? ", gradient checkpointing" : "") << "\n  " << std::fixed
              << std::setprecision(1) << peak_mib
              << " MiB peak above the resident set after the first step\n  " << std::fixed
              << std::setprecision(0) << tokens / t.median << " tokens/s, step "
              << std::setprecision(2) << t.median << " s (min " << t.min << ", max " << t.max
              << "), " << std::setprecision(1) << gflops << " GFLOP/s = " << std::setprecision(0)
              << 100 * gflops / ceiling << "% of the " << std::setprecision(1) << ceiling
              << " GFLOP/s GEMM ceiling\n";
  }
  return 0;
}

// Decode: 4 prompts x G=16, prompt 64, completion 128. KV cache + shared prefill vs the
// recompute-everything baseline, and shared vs per-row prefill (each completion its own
// prompt row, G=1).
int BenchDecode(bool as_json, int reps) {
  double ceiling = GemmCeilingGflops();
  auto model = BenchModel();
  std::shared_ptr<const common::Model> snap = std::move(model);
  const std::vector<std::vector<int32_t>> prompts =
      RandomPrompts(4, kPromptLen, snap->config().vocab_size, 3);
  rollout::GeneratorOptions o;
  o.num_generations = 16;
  o.max_completion_length = kCompletionLen;
  o.max_prompt_length = kPromptLen;
  o.eos_token_ids = {static_cast<int32_t>(snap->config().vocab_size - 1)};  // ~never sampled
  o.seed = 7;
  auto gen = std::move(rollout::Generator::Create(snap, 0, o)).value();
  rollout::GeneratorOptions o1 = o;
  o1.num_generations = 1;
  auto gen1 = std::move(rollout::Generator::Create(snap, 0, o1)).value();
  std::vector<std::vector<int32_t>> per_row;
  for (const auto& p : prompts)
    for (int j = 0; j < 16; ++j) per_row.push_back(p);
  int64_t tokens = 0;
  Timing cached = TimeIt(reps, [&] { tokens = gen->Generate(prompts)->num_completion_tokens; });
  ceiling = std::max(ceiling, GemmCeilingGflops());
  Timing per_row_t = TimeIt(reps, [&] { (void)gen1->Generate(per_row); });
  Timing recompute = TimeIt(1, [&] { (void)gen->GenerateRecomputeBaseline(prompts); });
  // Forward FLOPs of the cached path: 2 N per generated token + 2 N per prompt token.
  const double n = static_cast<double>(snap->NumParameters());
  const double gflops = (2 * n * (tokens + 4 * kPromptLen)) / cached.median / 1e9;
  std::vector<json> rows = {{{"bench", "decode"},
                             {"impl", "kv_cache_shared_prefill"},
                             {"tokens", tokens},
                             {"tokens_per_second", tokens / cached.median},
                             {"s_median", cached.median},
                             {"s_min", cached.min},
                             {"s_max", cached.max},
                             {"vs_recompute", recompute.median / cached.median},
                             {"gflops", gflops},
                             {"gemm_ceiling_gflops", ceiling},
                             {"vs_ceiling", gflops / ceiling}},
                            {{"bench", "decode"},
                             {"impl", "kv_cache_per_row_prefill"},
                             {"tokens_per_second", tokens / per_row_t.median},
                             {"s_median", per_row_t.median},
                             {"vs_shared", cached.median / per_row_t.median}},
                            {{"bench", "decode"},
                             {"impl", "recompute"},
                             {"tokens_per_second", tokens / recompute.median},
                             {"s_median", recompute.median}}};
  if (as_json) {
    for (auto& r : rows) std::cout << r.dump() << "\n";
    return 0;
  }
  std::cout << "decode: bench model, 4 prompts x G=16, prompt 64, completion 128 (" << tokens
            << " tokens)\n"
            << std::fixed;
  for (auto& r : rows) {
    std::cout << "  " << std::left << std::setw(26) << r["impl"].get<std::string>() << std::right
              << std::setprecision(0) << std::setw(9) << r["tokens_per_second"].get<double>()
              << " tokens/s  " << std::setprecision(2) << r["s_median"].get<double>() << " s\n";
  }
  std::cout << "  KV cache vs recompute: " << std::setprecision(1)
            << rows[0]["vs_recompute"].get<double>()
            << "x; shared prefill vs per-row prefill: " << per_row_t.median / cached.median << "x; "
            << gflops << " GFLOP/s = " << std::setprecision(0) << 100 * gflops / ceiling
            << "% of the GEMM ceiling\n";
  return 0;
}

// peer_trl: the side-by-side with TRL is a Python script (TRL is Python); exec the venv's
// Python on <source dir>/tests/bench/peer_trl.py with the `grpo` launcher as GRPO_BIN. The source
// dir: $GRPO_SOURCE_DIR, else the one this file was compiled from, else <this binary>/../../..
// (build/services/grpo). The Python: $GRPO_PYTHON, else /opt/grpo-serve/venv/bin/python.
int ExecPeerTrl(const std::vector<std::string>& flags) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  const fs::path rel = "tests/bench/peer_trl.py";
  std::vector<fs::path> roots;
  if (const char* d = std::getenv("GRPO_SOURCE_DIR"); d != nullptr && *d != '\0')
    roots.push_back(d);
  roots.push_back(fs::path(__FILE__).parent_path().parent_path());
  if (!ec) roots.push_back(exe.parent_path().parent_path().parent_path());
  fs::path script;
  for (const auto& r : roots) {
    if (fs::exists(r / rel)) {
      script = r / rel;
      break;
    }
  }
  if (script.empty()) {
    std::cerr << "grpo bench peer_trl: cannot find " << rel.string()
              << " (set GRPO_SOURCE_DIR to the source tree)\n";
    return 2;
  }
  const char* py_env = std::getenv("GRPO_PYTHON");
  const std::string python =
      py_env != nullptr && *py_env != '\0' ? py_env : "/opt/grpo-serve/venv/bin/python";
  // The launcher, as a user runs it (its demo does not load libtorch).
  if (std::getenv("GRPO_BIN") == nullptr) ::setenv("GRPO_BIN", GrpoLauncherExecutable().c_str(), 1);
  std::vector<std::string> args = {python, script.string()};
  args.insert(args.end(), flags.begin(), flags.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::cout.flush();
  ::execv(python.c_str(), argv.data());
  std::perror(("grpo bench peer_trl: exec " + python).c_str());
  return 2;
}

}  // namespace

void AddBenchCommand(CLI::App& app, CliAction* action) {
  auto* cmd = app.add_subcommand(
      "bench",
      "Benchmarks (method: docs/BENCHMARKS.md in the "
      "repository): logprob_memory | learner_step | "
      "decode | episodes | episode_stream | partial_rollouts | long_tail | long_tail_e2e | "
      "weight_sync | ingest | e2e | sharding | loading | peer_trl");
  struct Opts {
    std::string name;
    bool json = false, child = false;
    std::string impl = "chunked";
    int64_t G = 4, micro = 4;
    int reps = 5;  // docs/BENCHMARKS.md: median of at least 5
    std::vector<int64_t> gs = {4, 8, 16, 32, 64};
    int64_t workers = 0, steps = 0, groups = 0, max_turns = 0;
    bool gradient_checkpointing = false;
    int64_t layers = 0;
    bool fast = false;
    int world_size = 1;
    std::string fsdp = "no_shard", out;
    bool bf16 = false;
    double beta = 0;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option(
         "name", o->name,
         "logprob_memory | learner_step | decode | episodes | episode_stream | partial_rollouts | "
         "long_tail | long_tail_e2e | weight_sync | ingest | e2e | sharding | loading | peer_trl")
      ->required()
      ->check(CLI::IsMember({"logprob_memory", "learner_step", "decode", "episodes",
                             "episode_stream", "partial_rollouts", "long_tail", "long_tail_e2e",
                             "weight_sync", "ingest", "e2e", "sharding", "loading", "peer_trl"}));
  cmd->add_flag("--json", o->json, "one JSON object per row");
  // At least one: a median of none would read past an empty vector (Summarize).
  cmd->add_option("--reps", o->reps, "timed repetitions after a warm-up (median reported)")
      ->check(AtLeastOne());
  // Counts: 0 divided a micro-batch by zero (--micro_batch, a child's --world_size) or ran a
  // row of nothing; the options' defaults stand for themselves, a count given must be one.
  cmd->add_option("--micro_batch", o->micro, "sequences per micro-batch (chunked path)")
      ->check(AtLeastOne());
  cmd->add_option("--G", o->gs, "logprob_memory: num_generations values")->check(AtLeastOne());
  cmd->add_flag("--gradient_checkpointing", o->gradient_checkpointing,
                "learner_step: recompute each decoder layer in backward");
  cmd->add_option("--layers", o->layers,
                  "learner_step: decoder layers (default: the bench model's 4); loading: of its "
                  "model (default 16)")
      ->check(AtLeastOne());
  cmd->add_flag("--child", o->child, "internal: one logprob_memory configuration, or one rank");
  cmd->add_option("--world_size", o->world_size, "internal: sharding or loading child's world size")
      ->check(AtLeastOne());
  cmd->add_option("--fsdp", o->fsdp, "internal: sharding child's fsdp mode");
  cmd->add_option("--out", o->out,
                  "internal: sharding child's weights file; loading child's model directory");
  cmd->add_flag("--bf16", o->bf16, "internal: sharding child trains in bf16");
  cmd->add_option("--beta", o->beta,
                  "sharding: the KL coefficient of every row (default 0: no reference model)");
  cmd->add_option("--impl", o->impl,
                  "internal: chunked | chunked_batch_G | naive; loading: sharded | whole");
  cmd->add_option("--workers", o->workers,
                  "weight_sync, ingest (default 2), e2e and long_tail_e2e (default 1): simulated "
                  "workers")
      ->check(AtLeastOne());
  cmd->add_option("--steps", o->steps,
                  "e2e: optimizer steps per run with num_iterations 1 (default 24); "
                  "long_tail_e2e: per run (default 16)")
      ->check(AtLeastOne());
  cmd->add_option("--groups", o->groups,
                  "ingest: groups each worker pushes per repetition (default 128)")
      ->check(AtLeastOne());
  cmd->add_option("--max_turns", o->max_turns, "episodes: model turns per episode (default 4)")
      ->check(AtLeastOne());
  cmd->add_flag("--fast", o->fast,
                "peer_trl: the quick configuration (tiny model, fewer steps); episodes: the tiny "
                "model only");
  cmd->callback([cmd, o, action] {
    if (o->name == "peer_trl") {
      std::vector<std::string> flags;
      if (o->json) flags.push_back("--json");
      if (o->fast) flags.push_back("--fast");
      if (cmd->count("--reps") > 0) flags.insert(flags.end(), {"--reps", std::to_string(o->reps)});
      if (cmd->count("--steps") > 0)
        flags.insert(flags.end(), {"--steps", std::to_string(o->steps)});
      if (cmd->count("--G") > 0) {
        flags.push_back("--G");
        for (int64_t g : o->gs) flags.push_back(std::to_string(g));
      }
      *action = [flags] { return ExecPeerTrl(flags); };
      return;
    }
    // weight_sync, ingest, e2e: at least 5 repetitions unless --reps says otherwise.
    const int service_reps = cmd->count("--reps") > 0 ? o->reps : 5;
    *action = [o, service_reps]() -> int {
      if (o->name == "weight_sync" || o->name == "ingest" || o->name == "e2e" ||
          o->name == "long_tail_e2e") {
        bench::ServiceBenchOptions so;
        so.json = o->json;
        so.reps = service_reps;
        so.micro = o->micro;
        so.workers = o->workers;
        so.steps = o->steps;
        so.groups = o->groups;
        if (o->name == "weight_sync") return bench::BenchWeightSync(so);
        if (o->name == "ingest") return bench::BenchIngest(so);
        if (o->name == "long_tail_e2e") return bench::BenchLongTailE2e(so);
        return bench::BenchE2e(so);
      }
      if (o->name == "episodes" || o->name == "episode_stream") {
        bench::EpisodesBenchOptions eo;
        eo.json = o->json;
        eo.reps = o->reps;
        eo.fast = o->fast;
        eo.max_turns = o->max_turns;
        return o->name == "episodes" ? bench::BenchEpisodes(eo) : bench::BenchEpisodeStream(eo);
      }
      if (o->name == "partial_rollouts") return bench::BenchPartialRollouts(o->json, o->reps);
      if (o->name == "long_tail") return bench::BenchLongTail(o->json, o->reps);
      if (o->name == "loading") {
        bench::LoadingBenchOptions lo;
        lo.json = o->json;
        lo.reps = o->reps;
        lo.layers = o->layers;
        lo.child = o->child;
        lo.world_size = o->world_size;
        lo.impl = o->impl;
        lo.model_dir = o->out;
        return bench::BenchLoading(lo);
      }
      if (o->name == "sharding") {
        bench::ShardingBenchOptions so;
        so.json = o->json;
        so.reps = o->reps;
        so.child = o->child;
        so.world_size = o->world_size;
        so.fsdp = o->fsdp;
        so.bf16 = o->bf16;
        so.out_path = o->out;
        so.beta = o->beta;
        return bench::BenchSharding(so);
      }
      if (o->name == "logprob_memory") {
        if (o->child) {
          std::cout << LogprobMemoryChild(o->impl, o->gs.front(), o->micro, o->reps).dump() << "\n";
          return 0;
        }
        return BenchLogprobMemory(o->json, o->micro, o->reps, o->gs);
      }
      if (o->name == "learner_step")
        return BenchLearnerStep(o->json, o->reps, o->micro, o->gradient_checkpointing, o->layers);
      return BenchDecode(o->json, o->reps);
    };
  });
}

}  // namespace grpo::services
