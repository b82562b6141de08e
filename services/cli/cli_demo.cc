// grpo demo: the distributed system on one machine. Starts a learner and N
// rollout workers as separate processes on loopback (with a generated auth
// token), submits the built-in task (services/cli/demo_task.h), follows the job
// over WatchJob and ends with the reward curve. Every child runs in one process
// group and is killed and reaped on exit, error or Ctrl-C.
#include <poll.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/atomic_file.h"
#include "common/config.h"
#include "common/logging.h"
#include "common/process.h"
#include "common/status.h"
#include "services/cli/cli.h"
#include "services/cli/demo_task.h"
#include "services/cli/launch.h"
#include "services/learner_client.h"

namespace grpo::services {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

// The learner initialises (or loads) the model before it prints its port.
constexpr std::chrono::seconds kDefaultLearnerStartTimeout{120};
// After the job ended, children get this long to exit on their own (the learner
// lingers so workers see shutdown, then checkpoints).
constexpr std::chrono::seconds kDefaultChildExitWait{60};
// Between SIGTERM and SIGKILL when the demo stops its children.
constexpr std::chrono::seconds kDefaultChildKillGrace{10};
// Deadline of the whole WatchJob stream.
constexpr double kDefaultDemoWatchTimeoutSeconds = 6 * 3600;
constexpr std::chrono::milliseconds kChildPoll{100};
// Log lines of a failed child quoted in the error.
constexpr int kLogTailLines = 8;

volatile std::sig_atomic_t g_signal = 0;
extern "C" void OnDemoSignal(int sig) { g_signal = sig; }

struct DemoOptions {
  std::vector<std::string> overrides;
  std::string output_dir;  // empty = a fresh temp dir
  int64_t workers = 2;
  bool json = false;
  int64_t target_length = kDemoTargetLength;
  std::string task = "length";  // length | multi_turn
};

// One child process (common/process.h); its log is spec.stderr_path.
using Child = common::Process;

std::string LogTail(const std::string &path) {
  std::ifstream in(path);
  std::deque<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    lines.push_back(line);
    if (lines.size() > kLogTailLines) lines.pop_front();
  }
  std::string out;
  for (const auto &l : lines) out += "    " + l + "\n";
  return out;
}

std::string Describe(const Child &c) {
  std::ostringstream out;
  out << c.name << " (pid " << c.pid << ") "
      << (c.exit_code > 128 ? "was killed by signal " + std::to_string(c.exit_code - 128)
                            : "exited with code " + std::to_string(c.exit_code))
      << "; its log is " << c.spec.stderr_path;
  const std::string tail = LogTail(c.spec.stderr_path);
  if (!tail.empty()) out << ", ending:\n" << tail;
  return out.str();
}

// Runs `grpo-torch args...` (launch.h) in the demo's one process group, dying with the demo
// (PR_SET_PDEATHSIG), stderr (and stdout unless `pipe_stdout`) in `log`; with `pipe_stdout`,
// the child's stdout_fd reads its stdout.
StatusOr<Child *> SpawnGrpo(common::ProcessSupervisor &group, const std::string &name,
                            const std::vector<std::string> &args, const std::string &log,
                            bool pipe_stdout = false) {
  StatusOr<std::string> torch = GrpoTorchExecutable();
  if (!torch.ok()) return torch.status();
  common::ProcessSpec spec;
  spec.argv = {*torch};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.stdout_path = log;
  spec.stderr_path = log;
  spec.pipe_stdout = pipe_stdout;
  spec.own_group = false;
  spec.die_with_parent = true;
  return group.Spawn(name, std::move(spec));
}

// The intra-op threads of each child when the user did not set OMP_NUM_THREADS: the cores this
// process may run on, split between the learner and the workers, at least 1 each. The children
// share the cores; a team of OpenMP threads per process on them spins while another process
// needs the core. `grpo bench peer_trl --fast` (2 cores, a learner and 2 workers, the demo task):
// 5.1 steps/s with 1 thread per process against 2.0 with 2 (4.5 with 2 before grpo's OpenMP
// threads spun between regions: services/cli/main.cc).
int64_t ThreadsPerChild(int64_t children) {
  cpu_set_t set;
  CPU_ZERO(&set);
  int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) cores = std::max(1, CPU_COUNT(&set));
  return std::max<int64_t>(1, cores / std::max<int64_t>(1, children));
}

// A random hex token in `path` (mode 0600).
Status WriteAuthToken(const std::string &path) {
  std::ifstream urandom("/dev/urandom", std::ios::binary);
  unsigned char bytes[16];
  if (!urandom.read(reinterpret_cast<char *>(bytes), sizeof(bytes))) {
    return Status::Internal("cannot read /dev/urandom");
  }
  std::ostringstream hex;
  for (unsigned char b : bytes) hex << std::hex << std::setw(2) << std::setfill('0') << int{b};
  {
    std::ofstream out(path, std::ios::trunc);
    out << hex.str() << "\n";
    if (!out) return Status::Internal("cannot write " + path);
  }
  ::chmod(path.c_str(), 0600);
  return Status::OK();
}

// Reads the learner's {"port": N} line from `fd`; fails when the learner exits
// first, on a signal, or after kDefaultLearnerStartTimeout.
StatusOr<int> ReadLearnerPort(int fd, common::ProcessSupervisor &group, const Child &learner) {
  const auto until = Clock::now() + kDefaultLearnerStartTimeout;
  std::string buf;
  while (Clock::now() < until) {
    if (g_signal != 0) return Status::Cancelled("interrupted");
    const size_t nl = buf.find('\n');
    if (nl != std::string::npos) {
      const json j = json::parse(buf.substr(0, nl), nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("port") && j["port"].is_number_integer()) {
        return j["port"].get<int>();
      }
      return Status::Internal("unexpected first line from the learner: " + buf.substr(0, nl));
    }
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(kChildPoll.count())) > 0) {
      char chunk[256];
      const ssize_t n = ::read(fd, chunk, sizeof(chunk));
      if (n > 0) buf.append(chunk, static_cast<size_t>(n));
      if (n == 0) std::this_thread::sleep_for(kChildPoll);  // closed: the exit shows below
    }
    group.Reap();
    if (learner.reaped) return Status::Unavailable(Describe(learner));
  }
  return Status::DeadlineExceeded("the learner printed no port within " +
                                  std::to_string(kDefaultLearnerStartTimeout.count()) +
                                  " s; its log is " + learner.spec.stderr_path);
}

int RunDemo(const DemoOptions &o) {
  auto fail = [](const Status &s, int code = 1) {
    std::cerr << "grpo demo: " << s.ToString() << "\n";
    return code;
  };
  const auto t_start = Clock::now();
  // The demo task's defaults; workers generate while the learner trains
  // (max_staleness 1).
  const bool multi_turn = o.task == "multi_turn";
  common::GrpoConfig cfg = multi_turn ? MultiTurnTaskConfig() : DemoTaskConfig();
  cfg.max_staleness = 1;
  cfg.save_steps = 30;
  if (Status s = common::ApplyConfigOverrides(cfg, o.overrides); !s.ok()) return fail(s, 2);
  if (Status s = cfg.Validate(); !s.ok()) return fail(s, 2);
  if (cfg.reward_funcs.empty()) {
    return fail(Status::InvalidArgument("config key 'reward_funcs' must name at least one "
                                        "reward function"),
                2);
  }
  if (o.workers < 1) return fail(Status::InvalidArgument("--workers must be >= 1"), 2);

  // Output dir, token, and the learner's config (JSON is YAML) in it.
  std::string out_dir = o.output_dir;
  std::error_code ec;
  if (out_dir.empty()) {
    std::string tmpl = (fs::temp_directory_path() / "grpo-demo-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) {
      return fail(Status::Internal(std::string("mkdtemp: ") + std::strerror(errno)));
    }
    out_dir = tmpl;
  } else if (fs::create_directories(out_dir, ec); ec) {
    return fail(Status::Internal("cannot create " + out_dir + ": " + ec.message()));
  }
  const fs::path dir(out_dir);
  cfg.output_dir = out_dir;
  cfg.auth_token_file = (dir / "auth_token").string();
  cfg.grpc_port = 0;
  cfg.metrics_port = 0;
  if (Status s = WriteAuthToken(cfg.auth_token_file); !s.ok()) return fail(s);
  const std::string config_path = (dir / "learner_config.yaml").string();
  {
    std::ofstream out(config_path, std::ios::trunc);
    out << cfg.ToJson().dump(2) << "\n";
    if (!out) return fail(Status::Internal("cannot write " + config_path));
  }

  struct sigaction sa {};
  sa.sa_handler = OnDemoSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);
  auto interrupted = [&] {
    std::cerr << "grpo demo: signal " << g_signal << ": stopping the children\n";
    return 128 + g_signal;
  };

  // The children inherit this environment: split the cores between them unless the user chose.
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    ::setenv("OMP_NUM_THREADS", std::to_string(ThreadsPerChild(o.workers + 1)).c_str(), 1);
  }
  const std::string threads_per_child = std::getenv("OMP_NUM_THREADS");

  // The children's logs say at least what info says; more when `grpo --log_level debug demo`.
  const std::string child_log_level = spdlog::get_level() <= spdlog::level::trace   ? "trace"
                                      : spdlog::get_level() <= spdlog::level::debug ? "debug"
                                                                                    : "info";

  // Stopped on every way out: SIGTERM, kDefaultChildKillGrace, then SIGKILL.
  common::ProcessSupervisor group(kDefaultChildKillGrace);
  auto learner = SpawnGrpo(group, "learner",
                           {"--log_level", child_log_level, "learner", "--config", config_path},
                           (dir / "learner.log").string(), /*pipe_stdout=*/true);
  if (!learner.ok()) return fail(learner.status());
  // The workers start beside the learner (each process's start is mostly libtorch's load) and
  // wait for its address in a file, written (renamed into place) once the learner serves.
  const fs::path address_file = dir / "learner_address";
  fs::remove(address_file);
  for (int64_t i = 0; i < o.workers; ++i) {
    const std::string name = "rollout-" + std::to_string(i);
    auto worker = SpawnGrpo(
        group, name,
        {"--log_level", child_log_level, "rollout", "--learner_address_file", address_file.string(),
         "--worker_id", name, "--metrics_port", "0", "--reward_options",
         (multi_turn ? json::object() : DemoRewardOptions(o.target_length)).dump(),
         "--auth_token_file", cfg.auth_token_file},
        (dir / (name + ".log")).string());
    if (!worker.ok()) return fail(worker.status());
  }
  const int learner_out = (*learner)->stdout_fd;
  auto port = ReadLearnerPort(learner_out, group, **learner);
  if (!port.ok()) {
    if (g_signal != 0) return interrupted();
    return fail(port.status().WithContext("starting the learner"));
  }
  const std::string address = "127.0.0.1:" + std::to_string(*port);
  if (Status s = common::WriteFileAtomically(address_file.string(), address + "\n"); !s.ok()) {
    return fail(s);
  }
  // A worker that failed while the learner started (reaped above, unseen by the monitor below).
  for (const auto &c : group.processes()) {
    if (c->reaped && c->exit_code != 0) return fail(Status::Aborted(Describe(*c)));
  }
  if (!o.json) {
    std::cout << "grpo demo: learner on " << address << " + " << o.workers << " rollout workers, "
              << threads_per_child << " intra-op thread" << (threads_per_child == "1" ? "" : "s")
              << " each (logs, checkpoints and token in " << out_dir << ")\n"
              << "task: answer in about " << o.target_length << " tokens (reward "
              << cfg.reward_funcs[0] << "), " << cfg.max_steps << " optimizer steps, "
              << cfg.num_generations << " generations per prompt\n"
              << std::flush;
  }

  auto client = ConnectLearner(address, cfg.auth_token_file);
  if (!client.ok()) return fail(client.status());
  std::ostringstream rows;
  for (const json &row : BuiltinDataset()) rows << row.dump() << "\n";
  std::istringstream jsonl(rows.str());
  auto submitted =
      SubmitLines(*client, jsonl, "grpo-demo", "builtin-demo-task", kDefaultCallTimeoutSeconds);
  if (!submitted.ok()) {
    group.Reap();
    for (const auto &c : group.processes()) {
      if (c->reaped) return fail(Status::Unavailable(Describe(*c)));
    }
    return fail(submitted.status().WithContext("submitting the dataset"));
  }
  const auto t_submit = Clock::now();

  // Watch the job; a monitor thread cancels the watch on a signal or when a
  // child dies early.
  WatchCanceller canceller;
  std::atomic<bool> watching{true};
  const Child *died = nullptr;  // written by the monitor, read after join
  std::thread monitor([&] {
    while (watching.load()) {
      if (g_signal != 0) {
        canceller.Cancel();
        return;
      }
      for (Child *c : group.Reap()) {
        if (died == nullptr && c->exit_code != 0) died = c;
      }
      bool workers_left = false;
      for (const auto &c : group.processes()) {
        if (c->name != "learner" && !c->reaped) workers_left = true;
      }
      if (died != nullptr || !workers_left) {
        canceller.Cancel();
        return;
      }
      std::this_thread::sleep_for(kChildPoll);
    }
  });
  std::vector<double> curve;
  bool header = false;
  auto state = FollowJob(
      *client, kDefaultDemoWatchTimeoutSeconds,
      [&](const v1::JobEvent &e) {
        if (e.metrics().empty()) {
          std::cerr << JobStateLine(e) << "\n";
          return;
        }
        auto it = e.metrics().find("reward");
        curve.push_back(it == e.metrics().end() ? 0.0 : it->second);
        if (o.json) {
          std::cout << StepJson(e).dump() << "\n" << std::flush;
        } else {
          if (!header) std::cout << StepTableHeader();
          header = true;
          std::cout << StepTableRow(e) << std::flush;
        }
      },
      &canceller);
  watching.store(false);
  monitor.join();
  // Close the channel now: the learner's gRPC shutdown waits (up to its grace) for the
  // connections still open, and this one would stay open until the demo returns.
  client->stub.reset();
  const auto t_end = Clock::now();
  const double train_seconds = std::chrono::duration<double>(t_end - t_submit).count();
  if (g_signal != 0) return interrupted();
  if (died != nullptr) return fail(Status::Aborted(Describe(*died)));
  if (!state.ok()) {
    if (state.status().code() == StatusCode::kCancelled) {
      return fail(
          Status::Aborted("every rollout worker exited before the job ended; logs in " + out_dir));
    }
    return fail(state.status().WithContext("watching the job (logs in " + out_dir + ")"));
  }

  // The job ended: the children exit on their own (workers see shutdown, the
  // learner checkpoints); the ones that do not are stopped. The learner lingers
  // (--linger_seconds) for workers that have not seen the end yet: once every
  // worker here has exited, SIGTERM ends that wait (it still checkpoints, exit 0).
  const auto exit_by = Clock::now() + kDefaultChildExitWait;
  bool workers_exited = true;
  for (int64_t i = 0; i < o.workers; ++i) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(exit_by - Clock::now());
    if (!group.Wait("rollout-" + std::to_string(i), std::max(left, std::chrono::milliseconds(0)))) {
      workers_exited = false;
    }
  }
  if (workers_exited) group.Signal("learner", SIGTERM);
  const bool exited = group.WaitAll(std::chrono::duration_cast<std::chrono::milliseconds>(
      std::max<Clock::duration>(exit_by - Clock::now(), Clock::duration::zero())));
  group.StopAll(kDefaultChildKillGrace);
  bool children_ok = exited;
  json processes = json::array();
  for (const auto &c : group.processes()) {
    processes.push_back({{"name", c->name},
                         {"pid", c->pid},
                         {"exit_code", c->exit_code},
                         {"log", c->spec.stderr_path}});
    if (c->exit_code != 0) {
      children_ok = false;
      std::cerr << "grpo demo: " << Describe(*c) << "\n";
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  // From the job's end to the last child's exit (the learner's checkpoint included).
  const double shutdown_seconds = std::chrono::duration<double>(Clock::now() - t_end).count();
  const CurveSummary c = SummarizeCurve(curve);
  if (o.json) {
    std::cout << json{{"summary", true},
                      {"job_state", std::string(JobStateName(*state))},
                      {"steps", c.steps},
                      {"seconds", seconds},
                      {"train_seconds", train_seconds},
                      {"shutdown_seconds", shutdown_seconds},
                      {"reward_first", c.first},
                      {"reward_last", c.last},
                      {"reward_gain_in_std_errors", c.gain_in_std_errors},
                      {"output_dir", out_dir},
                      {"threads_per_process", threads_per_child},
                      {"processes", processes}}
                     .dump()
              << "\n";
  } else {
    if (!curve.empty()) std::cout << "\nmean reward per step\n" << TextPlot(curve) << "\n";
    std::cout << "job " << JobStateName(*state) << ": " << c.steps << " steps in " << std::fixed
              << std::setprecision(0) << train_seconds << " s (" << seconds << " s in all)\n";
    if (c.steps > 0) {
      std::cout << "reward: first " << c.window << " steps " << std::setprecision(3) << c.first
                << ", last " << c.window << " steps " << c.last << " (" << std::setprecision(1)
                << c.gain_in_std_errors << " standard errors)\n";
    }
    std::cout << "processes:";
    for (const auto &p : processes) {
      std::cout << " " << p["name"].get<std::string>() << " exit " << p["exit_code"].get<int>();
    }
    std::cout << "\npolicy checkpoints, logs and config in " << out_dir << "\n";
  }
  std::cout << std::flush;
  ::close(learner_out);
  return *state == learner::JobState::kDone && children_ok ? 0 : 1;
}

}  // namespace

void AddDemoCommand(CLI::App &app, CliAction *action) {
  auto *cmd = app.add_subcommand("demo",
                                 "Run the distributed system on this machine: "
                                 "a learner and rollout workers as separate "
                                 "processes on loopback learn the built-in "
                                 "task; config keys as --key value");
  auto o = std::make_shared<DemoOptions>();
  cmd->add_option("--workers", o->workers, "rollout worker processes")->capture_default_str();
  cmd->add_option("--output_dir", o->output_dir,
                  "checkpoints, logs, token and config (default: a fresh temp dir)");
  cmd->add_option("--target_length", o->target_length, "the length reward's target (tokens)")
      ->capture_default_str();
  cmd->add_option("--task", o->task,
                  "length: TRL's length reward, single-turn; multi_turn: the built-in turns "
                  "environment (three short turns per episode)")
      ->check(CLI::IsMember({"length", "multi_turn"}))
      ->capture_default_str();
  cmd->add_flag("--json", o->json,
                "one JSON object per optimizer step (as `grpo submit --json "
                "--follow`), then a "
                "summary object");
  cmd->allow_extras();
  cmd->footer("Keys:\n" + common::ConfigHelp());
  cmd->callback([cmd, o, action] {
    o->overrides = cmd->remaining();
    *action = [o] { return RunDemo(*o); };
  });
}

}  // namespace grpo::services
