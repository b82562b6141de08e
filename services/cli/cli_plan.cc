// grpo plan: the predicted peak memory of one learner rank (learner/distributed/memory_plan.h)
// from the model's config.json and the run's config, before anything is loaded, and the smallest
// change that fits when it does not. Exit 0: fits; 1: does not fit; 2: bad input.
#include "services/cli/cli_plan.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/logging.h"
#include "common/model/device.h"
#include "common/model/model_config.h"
#include "learner/distributed/memory_plan.h"
#include "learner/distributed/rank_group.h"
#include "services/cli/cli.h"

namespace grpo::services {
namespace {

namespace fs = std::filesystem;
namespace dist = learner::distributed;

struct PlanOptions {
  std::vector<std::string> overrides;
  std::optional<int> world_size;
  std::optional<int> local_world_size;
  std::optional<double> device_memory_gb;
  std::optional<double> host_memory_gb;
  bool json = false;
};

// The model the learner would train: model_name_or_path's config.json, or the tiny preset it
// initialises when none is configured (cli_learner.cc ModelDir). *source names it.
StatusOr<common::ModelConfig> PlannedModel(const common::GrpoConfig& cfg, std::string* source) {
  if (cfg.model_name_or_path.empty()) {
    *source = "the tiny preset (model_name_or_path is empty)";
    return common::ModelConfigPreset("tiny");
  }
  // A directory (a missing one too: the error names the config.json it needs), or the file.
  std::error_code ec;
  *source = fs::is_regular_file(cfg.model_name_or_path, ec)
                ? cfg.model_name_or_path
                : (fs::path(cfg.model_name_or_path) / "config.json").string();
  return common::LoadModelConfig(*source);
}

// torchrun's variables as the learner reads them (distributed::ParseRankEnv: WORLD_SIZE,
// LOCAL_WORLD_SIZE), without the rendezvous address a plan does not need.
StatusOr<learner::distributed::RankEnv> RankEnvFromEnvironment() {
  return learner::distributed::ParseRankEnv([](const char* name) -> const char* {
    const char* value = std::getenv(name);
    if (value == nullptr && std::strcmp(name, "MASTER_ADDR") == 0) return "127.0.0.1";
    return value;
  });
}

// "cpu" or "cuda" for the planner; "auto" is cuda where this machine sees a GPU.
std::string PlannedDevice(const std::string& device) {
  if (device == "cpu") return "cpu";
  if (device == "auto") return common::CudaAvailable() ? "cuda" : "cpu";
  return "cuda";
}

// `text` broken at spaces into lines of at most 100 columns, the later ones indented by 2; a
// figure stays with its unit ("146.9 GiB").
std::string Wrapped(const std::string& text) {
  constexpr size_t kWidth = 100;
  std::vector<std::string> words;
  std::istringstream in(text);
  for (std::string w; in >> w;) {
    const bool unit = w.rfind("GiB", 0) == 0 || w.rfind("MiB", 0) == 0 || w.rfind("KiB", 0) == 0;
    if (unit && !words.empty()) {
      words.back() += " " + w;
    } else {
      words.push_back(w);
    }
  }
  std::string out, line;
  for (const std::string& w : words) {
    if (!line.empty() && line.size() + 1 + w.size() > kWidth) {
      out += line + "\n";
      line = " ";  // the space below makes the indent 2
    }
    line += (line.empty() ? "" : " ") + w;
  }
  return out + line + "\n";
}

std::string SuggestionText(const StatusOr<dist::Suggestion>& fix) {
  if (!fix.ok()) return fix.status().message();
  std::string text = fix->Text() + " (" + dist::FormatBytes(fix->plan.Total()) + " per rank)";
  const int ranks = fix->plan.world_size;
  bool more_ranks = false;
  for (const auto& c : fix->changes) more_ranks |= c.key == "world_size";
  if (more_ranks && fix->plan.device == "cpu") {
    // A CPU rank's memory is its host's: ranks on one host divide it (LOCAL_WORLD_SIZE).
    text += "; CPU ranks share their host's memory: the " + std::to_string(ranks) + " ranks need " +
            dist::FormatBytes(fix->plan.Total() * ranks) +
            " across their hosts (--local_world_size plans one host's share)";
  }
  return text;
}

nlohmann::json SuggestionJson(const StatusOr<dist::Suggestion>& fix) {
  nlohmann::json s;
  s["changes"] = nlohmann::json::array();
  if (!fix.ok()) {
    s["text"] = fix.status().message();
    return s;
  }
  s["text"] = fix->Text();
  for (const auto& c : fix->changes) s["changes"].push_back({{"key", c.key}, {"value", c.value}});
  s["total_bytes"] = fix->plan.Total();
  return s;
}

int64_t GiB(double gb) { return static_cast<int64_t>(std::llround(gb * (1ll << 30))); }

int RunPlan(const PlanOptions& o) {
  auto fail = [&o](const Status& s) {
    if (o.json) {
      std::cout << nlohmann::json{{"error", s.ToString()}}.dump(2) << "\n";
    }
    std::cerr << "grpo plan: " << s.ToString() << "\n";
    return 2;
  };
  common::GrpoConfig cfg;
  if (Status s = common::ApplyConfigOverrides(cfg, o.overrides); !s.ok()) return fail(s);
  if (Status s = cfg.Validate(); !s.ok()) return fail(s);
  std::string source;
  StatusOr<common::ModelConfig> model = PlannedModel(cfg, &source);
  if (!model.ok()) return fail(model.status());
  StatusOr<learner::distributed::RankEnv> env = RankEnvFromEnvironment();
  if (!env.ok() && !(o.world_size && o.local_world_size)) return fail(env.status());
  const int world_size = o.world_size ? *o.world_size : env->world_size;
  const int local_world_size = o.local_world_size ? *o.local_world_size : env->local_world_size;
  if (local_world_size > world_size) {
    return fail(Status::InvalidArgument("--local_world_size " + std::to_string(local_world_size) +
                                        " is more than the " + std::to_string(world_size) +
                                        " ranks of world_size"));
  }
  const std::string device = PlannedDevice(cfg.device);
  const bool gpu_here = device == "cuda" && common::CudaAvailable();
  int64_t device_bytes = 0;
  if (o.device_memory_gb) {
    if (!(*o.device_memory_gb > 0)) {
      return fail(Status::InvalidArgument("--device_memory_gb must be > 0"));
    }
    device_bytes = GiB(*o.device_memory_gb);
  } else if (device == "cpu") {
    // This host's memory, shared by its learner ranks (as the learner's own check divides it).
    device_bytes = common::TotalMemoryBytes(at::Device(at::kCPU)) / local_world_size;
  } else if (gpu_here) {
    StatusOr<at::Device> d = common::ResolveDevice(cfg.device == "auto" ? "cuda" : cfg.device);
    if (!d.ok()) return fail(d.status());
    device_bytes = common::TotalMemoryBytes(*d);
  } else {
    return fail(Status::InvalidArgument("config key 'device' is " + cfg.device +
                                        " and no GPU is visible here: give "
                                        "--device_memory_gb (the GPU's memory in GiB)"));
  }
  if (device_bytes <= 0) {
    return fail(
        Status::InvalidArgument("cannot read this machine's memory: give "
                                "--device_memory_gb"));
  }
  // Host memory beside a GPU: checked when given, or when planning on the GPU machine itself.
  int64_t host_bytes = 0;
  if (o.host_memory_gb) {
    host_bytes = GiB(*o.host_memory_gb);
  } else if (gpu_here) {
    host_bytes = common::TotalMemoryBytes(at::Device(at::kCPU));
  }

  StatusOr<dist::MemoryPlan> plan = dist::PlanMemory(*model, cfg, world_size, device);
  if (!plan.ok()) return fail(plan.status());
  const bool fits = plan->Fits(device_bytes);
  const bool host_fits = device == "cpu" || host_bytes <= 0 || plan->HostTotal() <= host_bytes;
  std::optional<StatusOr<dist::Suggestion>> fix;
  if (!fits || !host_fits) {
    dist::SuggestOptions so;
    so.host_bytes = host_bytes;
    fix = dist::SuggestFix(*model, cfg, world_size, device, device_bytes, so);
  }

  if (o.json) {
    nlohmann::json j = plan->ToJson();
    j["model"] = source;
    j["device_memory_bytes"] = device_bytes;
    j["local_world_size"] = local_world_size;
    j["fits"] = fits;
    if (device == "cuda") {
      j["host_memory_bytes"] = host_bytes > 0 ? nlohmann::json(host_bytes) : nlohmann::json();
      j["host_fits"] = host_fits;
    }
    j["suggestion"] = fix ? SuggestionJson(*fix) : nlohmann::json();
    std::cout << j.dump(2) << "\n";
  } else {
    std::cout << "model: " << source << "\n" << dist::FormatPlan(*plan, device_bytes);
    if (device == "cpu" && !o.device_memory_gb && local_world_size > 1) {
      std::cout << "  (this host's " << dist::FormatBytes(device_bytes * local_world_size)
                << " shared by its " << local_world_size << " learner ranks)\n";
    }
    if (!host_fits) {
      std::cout << "host memory does not fit: " << dist::FormatBytes(plan->HostTotal())
                << " needed, " << dist::FormatBytes(host_bytes) << " available\n";
    }
    if (fits && host_fits) {
      std::cout << "fits: " << dist::FormatBytes(plan->Total()) << " of "
                << dist::FormatBytes(device_bytes) << "\n";
    } else {
      std::cout << Wrapped("does not fit: " + SuggestionText(*fix));
    }
  }
  return fits && host_fits ? 0 : 1;
}

}  // namespace

void WarnOfCpuBf16(const common::GrpoConfig& cfg, const c10::Device& device) {
  if (!cfg.bf16 || !device.is_cpu()) return;
  const std::string warning = common::CpuBf16Warning(common::MeasureCpuBf16Matmul());
  if (!warning.empty()) GRPO_LOG_WARN("{}", warning);
}

Status CheckLearnerMemoryPlan(const common::GrpoConfig& cfg, int world_size,
                              const std::string& device, int local_world_size) {
  std::string source;
  ASSIGN_OR_RETURN(const common::ModelConfig model, PlannedModel(cfg, &source));
  ASSIGN_OR_RETURN(const at::Device d, common::ResolveDevice(device));
  ASSIGN_OR_RETURN(const common::FsdpSpec fsdp, common::ParseFsdp(cfg.fsdp));
  if (fsdp.offload && !d.is_cuda()) {
    GRPO_LOG_INFO("fsdp '{}': offload changes nothing on the CPU, whose memory is the host's",
                  cfg.fsdp);
  } else if (fsdp.offload && fsdp.mode == common::FsdpMode::kFullShard) {
    GRPO_LOG_INFO(
        "fsdp '{}': the fp32 shards, their gradient and AdamW's state on the host; {} "
        "holds only the units it gathers",
        cfg.fsdp, d.str());
  } else if (fsdp.offload) {
    GRPO_LOG_INFO(
        "fsdp '{}': the fp32 master, its gradient and AdamW's state on the host; a {} "
        "compute copy on {}",
        cfg.fsdp, cfg.bf16 ? "bf16" : "fp32", d.str());
  }
  if (d.is_cuda() || local_world_size <= 1) {
    return dist::CheckFitsDevice(model, cfg, world_size, d.is_cuda() ? "cuda" : "cpu",
                                 common::TotalMemoryBytes(d));
  }
  // CPU ranks on one host: each has its share of the host's memory.
  const int64_t host = common::TotalMemoryBytes(d);
  return dist::CheckFitsDevice(model, cfg, world_size, "cpu", host / local_world_size)
      .WithContext("this host's " + dist::FormatBytes(host) + " shared by its " +
                   std::to_string(local_world_size) + " learner ranks (LOCAL_WORLD_SIZE)");
}

void AddPlanCommand(CLI::App& app, CliAction* action) {
  auto* cmd = app.add_subcommand(
      "plan",
      "Predict the peak memory of one learner rank from config.json and the config (no weights "
      "loaded), and the smallest change that fits when it does not (config keys as --key value; "
      "--config FILE). Exit 0 fits, 1 does not fit, 2 bad input");
  auto o = std::make_shared<PlanOptions>();
  cmd->add_option("--world_size", o->world_size, "learner ranks (default: WORLD_SIZE, else 1)")
      ->check(AtLeastOne());
  cmd->add_option("--local_world_size", o->local_world_size,
                  "learner ranks on this host, which share its memory on cpu (default: "
                  "LOCAL_WORLD_SIZE, else 1)")
      ->check(AtLeastOne());
  cmd->add_option("--device_memory_gb", o->device_memory_gb,
                  "memory of one rank's device in GiB (default: this machine's memory on cpu, "
                  "the visible GPU's on cuda; required for cuda without a GPU here)");
  cmd->add_option("--host_memory_gb", o->host_memory_gb,
                  "host memory beside each GPU in GiB, for offload and the weight snapshots "
                  "(default: this machine's when it has the GPU)");
  cmd->add_flag("--json", o->json, "print the plan as JSON");
  cmd->allow_extras();
  cmd->footer("Keys:\n" + common::ConfigHelp());
  cmd->callback([cmd, o, action] {
    o->overrides = cmd->remaining();
    *action = [o] { return RunPlan(*o); };
  });
}

}  // namespace grpo::services
