// grpo learner: the learner service (services/learner_service.h) as a process. Runs until the
// job ends (done, cancelled, failed) or SIGTERM/SIGINT, then checkpoints and exits.
#include <cmath>
#include <csignal>
#include <filesystem>
#include <iostream>
#include <thread>

#include "common/config.h"
#include "common/logging.h"
#include "common/metrics/http_exposer.h"
#include "common/metrics/process_metrics.h"
#include "common/model/device.h"
#include "common/model/model.h"
#include "common/model/model_config.h"
#include "common/tokenizer/byte_tokenizer.h"
#include "learner/distributed/rank_group.h"
#include "learner/distributed/trainer_rank.h"
#include "learner/grpo_trainer.h"
#include "learner/step_optimizer.h"
#include "services/cli/cli.h"
#include "services/cli/cli_plan.h"
#include "services/learner_service.h"

namespace grpo::services {
namespace {

namespace fs = std::filesystem;

// How long workers get to see shutdown=true in a heartbeat after the job ended.
constexpr std::chrono::milliseconds kDefaultLinger{5000};
constexpr std::chrono::milliseconds kSignalPoll{200};

volatile std::sig_atomic_t g_signal = 0;
extern "C" void OnSignal(int sig) { g_signal = sig; }

struct LearnerOptions {
  std::vector<std::string> overrides;
  double linger_seconds = kDefaultLinger.count() / 1000.0;
};

// The configured model directory, or a tiny model initialised from scratch under output_dir
// (as train-local does). Returns the directory to load.
StatusOr<std::string> ModelDir(const common::GrpoConfig& cfg) {
  if (!cfg.model_name_or_path.empty()) return cfg.model_name_or_path;
  const std::string dir = (fs::path(cfg.output_dir) / "initial-model").string();
  if (!fs::exists(fs::path(dir) / "config.json")) {
    ASSIGN_OR_RETURN(common::ModelConfig preset, common::ModelConfigPreset("tiny"));
    ASSIGN_OR_RETURN(auto model, common::Model::InitRandom(preset, cfg.seed));
    RETURN_IF_ERROR(model->Save(dir));
    RETURN_IF_ERROR(common::ByteTokenizer().Save(dir + "/tokenizer.json"));
  }
  return dir;
}

// The policy (or the reference: `what`) of a learner rank of `world` training on `device` from
// model_name_or_path, placed on `home`: deferred (Model::LoadDeferred) where full_shard's gate
// fills the policy's parameters, each rank then reading only its own shard of the files (no
// rank holds the whole model: README "Know before you launch"), and for the policy where
// shard_grad_op keeps its fp32 master in chunks beside a compute copy (the copy read whole, the
// master a chunk a rank); whole otherwise. Without model_name_or_path every rank has the tiny
// model in memory and rank 0's is broadcast.
StatusOr<std::unique_ptr<common::Model>> LoadModel(const common::GrpoConfig& cfg,
                                                   const at::Device& home, const at::Device& device,
                                                   int world, bool is_policy) {
  ASSIGN_OR_RETURN(const common::FsdpSpec fsdp, common::ParseFsdp(cfg.fsdp));
  const char* what = is_policy ? "the policy" : "the reference model";
  if (learner::GatesParameters(fsdp, world, home)) {
    GRPO_LOG_INFO("learner: sharded loading: this rank reads only its shards of {} ({})",
                  cfg.model_name_or_path, what);
    return common::Model::LoadDeferred(cfg.model_name_or_path, home);
  }
  if (is_policy && learner::ShardsMasterBesideCopy(fsdp, world, cfg.bf16, device)) {
    GRPO_LOG_INFO(
        "learner: sharded loading: this rank reads its chunks of the fp32 master of {} and its "
        "compute copy whole",
        cfg.model_name_or_path);
    return common::Model::LoadDeferred(cfg.model_name_or_path, home);
  }
  return common::Model::Load(cfg.model_name_or_path, home);
}

// learner::MasterHome of the config's `fsdp` (a bad spelling is refused later, by the trainer).
at::Device PolicyHome(const common::GrpoConfig& cfg, const at::Device& device) {
  auto fsdp = common::ParseFsdp(cfg.fsdp);
  return fsdp.ok() ? learner::MasterHome(*fsdp, device) : device;
}

// The policy (and the reference when beta != 0) of a learner rank > 0. Rank 0 alone writes under
// output_dir (the initial model, checkpoints, the ledger), so without model_name_or_path this
// rank builds the same tiny model in memory; its weights are rank 0's after the first command.
Status LoadTrainerRankModels(const common::GrpoConfig& cfg, const at::Device& device, int world,
                             std::unique_ptr<common::Model>* policy,
                             std::unique_ptr<common::Model>* reference) {
  if (cfg.model_name_or_path.empty()) {
    ASSIGN_OR_RETURN(const common::ModelConfig preset, common::ModelConfigPreset("tiny"));
    ASSIGN_OR_RETURN(*policy, common::Model::InitRandom(preset, cfg.seed));
    RETURN_IF_ERROR(
        (*policy)->To(PolicyHome(cfg, device), (*policy)->dtype()).WithContext("policy"));
  } else {
    ASSIGN_OR_RETURN(*policy, LoadModel(cfg, PolicyHome(cfg, device), device, world, true));
  }
  if (cfg.beta != 0) {  // as the policy: deferred, or whole (rank 0's then broadcast if sharded)
    if (cfg.model_name_or_path.empty()) {
      ASSIGN_OR_RETURN(*reference, (*policy)->Copy(device, (*policy)->dtype()));
    } else {
      ASSIGN_OR_RETURN(*reference, LoadModel(cfg, device, device, world, false));
    }
  }
  return Status::OK();
}

// A learner rank > 0 (README "Learner ranks"): a trainer that does what rank 0 says until the job
// ends (exit 0) or the group fails (exit 1, for the orchestrator to restart the group).
int RunTrainerRank(const common::GrpoConfig& cfg, const at::Device& device,
                   learner::distributed::RankGroup& ranks) {
  const std::string me = "grpo learner: rank " + std::to_string(ranks.rank()) + " of " +
                         std::to_string(ranks.world_size());
  std::unique_ptr<common::Model> policy, reference;
  if (Status s = LoadTrainerRankModels(cfg, device, ranks.world_size(), &policy, &reference);
      !s.ok()) {
    std::cerr << me << ": " << s.ToString() << "\n";
    return 1;
  }
  auto trainer =
      learner::GrpoTrainer::Create(cfg, policy.get(), std::move(reference), &ranks, device);
  if (!trainer.ok()) {
    std::cerr << me << ": " << trainer.status().ToString() << "\n";
    return trainer.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::cerr << me << ": training the generation batches rank 0 hands out\n";
  if (Status s = learner::distributed::ServeRankZero(ranks, **trainer); !s.ok()) {
    std::cerr << me << ": " << s.ToString()
              << "; exiting 1 for the orchestrator to restart the learner group from its last "
                 "checkpoint\n";
    return 1;
  }
  std::cerr << me << ": the job ended\n";
  return 0;
}

int RunLearner(const LearnerOptions& o) {
  auto fail = [](const Status& s, int code = 1) {
    std::cerr << "grpo learner: " << s.ToString() << "\n";
    return code;
  };
  common::GrpoConfig cfg;
  if (Status s = common::ApplyConfigOverrides(cfg, o.overrides); !s.ok()) return fail(s, 2);
  if (Status s = cfg.Validate(); !s.ok()) return fail(s, 2);
  if (cfg.reward_funcs.empty()) {
    // Workers score with the learner's reward_funcs; without any, every group is refused.
    return fail(Status::InvalidArgument("config key 'reward_funcs' must name at least one "
                                        "reward function"),
                2);
  }
  auto rank_env = learner::distributed::RankEnvFromEnvironment();
  if (!rank_env.ok()) return fail(rank_env.status(), 2);
  if (rank_env->world_size > 1 && (cfg.device == "cuda" || cfg.device == "auto")) {
    // One GPU a rank, as torchrun's LOCAL_RANK says (on the CPU "auto" stays the CPU).
    auto any = common::ResolveDevice(cfg.device);
    if (any.ok() && any->is_cuda()) cfg.device = "cuda:" + std::to_string(rank_env->local_rank);
  }
  // `device`, as train-local: the fp32 policy loads there (with `bf16` the trainer trains a bf16
  // copy of it); LearnerServer::Create would move it there otherwise.
  auto device = common::ResolveDevice(cfg.device);
  if (!device.ok()) return fail(device.status(), 2);
  // Refuse what cannot fit the device, naming the knob, before any weight is loaded (grpo plan).
  if (Status s = CheckLearnerMemoryPlan(cfg, rank_env->world_size, device->str(),
                                        rank_env->local_world_size);
      !s.ok()) {
    return fail(s, 2);
  }
  std::unique_ptr<learner::distributed::RankGroup> ranks;
  if (rank_env->world_size > 1) {
    const auto timeout = std::chrono::milliseconds(
        static_cast<int64_t>(std::ceil(cfg.rank_timeout_seconds * 1000.0)));
    auto joined = learner::distributed::RankGroup::Join(*rank_env, timeout, *device);
    if (!joined.ok()) return fail(joined.status());
    ranks = std::move(joined).value();
    if (rank_env->rank > 0) return RunTrainerRank(cfg, *device, *ranks);
  }
  WarnOfCpuBf16(cfg, *device);
  std::error_code ec;
  fs::create_directories(cfg.output_dir, ec);
  auto model_dir = ModelDir(cfg);
  if (!model_dir.ok()) return fail(model_dir.status());
  const at::Device home = PolicyHome(cfg, *device);
  auto policy = cfg.model_name_or_path.empty()
                    ? common::Model::Load(*model_dir, home)
                    : LoadModel(cfg, home, *device, rank_env->world_size, true);
  if (!policy.ok()) return fail(policy.status());
  std::unique_ptr<common::Model> reference;
  if (cfg.beta != 0) {
    auto ref = cfg.model_name_or_path.empty()
                   ? common::Model::Load(*model_dir, *device)
                   : LoadModel(cfg, *device, *device, rank_env->world_size, false);
    if (!ref.ok()) return fail(ref.status());
    reference = std::move(ref).value();
  }
  // The registry /metrics serves: the learner's families and the process's (CPU, memory, file
  // descriptors, malloc). Declared before the server, which borrows it.
  common::Registry registry;
  if (Status s = common::AddProcessMetrics(&registry); !s.ok()) return fail(s);
  LearnerServerOptions options;
  options.model_dir = *model_dir;
  options.ranks = ranks.get();
  options.metrics_registry = &registry;
  auto server =
      LearnerServer::Create(cfg, std::move(policy).value(), std::move(reference), options);
  if (!server.ok()) {
    return fail(server.status(), server.status().code() == StatusCode::kInvalidArgument ? 2 : 1);
  }
  if (Status s = (*server)->Start(); !s.ok()) return fail(s);
  // /metrics and /healthz on metrics_bind_address (every interface by default: the deploy
  // manifests scrape it); destroyed before the server, whose registry it borrows.
  LearnerServer* learner = server->get();
  common::HttpExposer exposer((*server)->metrics_registry(),
                              [learner] { return learner->Health(); },
                              common::HttpExposerLimitsFrom(cfg));
  if (Status s = exposer.Start(cfg.metrics_bind_address, static_cast<uint16_t>(cfg.metrics_port));
      !s.ok()) {
    (void)(*server)->Stop(/*checkpoint=*/false);
    return fail(s.WithContext("metrics_port"));
  }
  std::cerr << "grpo learner: listening on port " << (*server)->port() << ", metrics on port "
            << exposer.port() << "\n";
  // One line on stdout for scripts that start the learner on port 0.
  std::cout << "{\"port\": " << (*server)->port() << ", \"metrics_port\": " << exposer.port()
            << "}\n"
            << std::flush;

  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);

  bool ended = false;
  while (g_signal == 0 && !ended) ended = (*server)->WaitForJobEnd(kSignalPoll);
  if (ended) {
    std::cerr << "grpo learner: job " << JobStateName((*server)->job_state()) << "\n";
    const auto linger =
        std::chrono::milliseconds(static_cast<int64_t>(std::max(0.0, o.linger_seconds) * 1000));
    const auto until = std::chrono::steady_clock::now() + linger;
    while (g_signal == 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(kSignalPoll);
    }
  } else {
    std::cerr << "grpo learner: signal " << g_signal << ": checkpointing and stopping\n";
  }
  Status s = (*server)->Stop(/*checkpoint=*/true);
  if (!s.ok()) return fail(s);
  return (*server)->job_state() == JobState::kFailed ? 1 : 0;
}

}  // namespace

void AddLearnerCommands(CLI::App& app, CliAction* action) {
  auto* cmd = app.add_subcommand(
      "learner",
      "Serve the learner: lease prompts to rollout workers, train on their groups, publish "
      "weights (config keys as --key value; --config FILE)");
  auto o = std::make_shared<LearnerOptions>();
  cmd->add_option("--linger_seconds", o->linger_seconds,
                  "keep serving this long after the job ends so workers see shutdown");
  cmd->allow_extras();
  cmd->footer("Keys:\n" + common::ConfigHelp());
  cmd->callback([cmd, o, action] {
    o->overrides = cmd->remaining();
    *action = [o] { return RunLearner(*o); };
  });
  AddClientCommands(app, action);
}

}  // namespace grpo::services
