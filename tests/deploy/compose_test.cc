// deploy/docker-compose.yml, deploy/prometheus/prometheus.yml, deploy/config.yaml and
// deploy/Dockerfile, checked statically (no Docker engine runs here): docker-compose and
// promtool validate their files; the services agree with docs/ARCHITECTURE.md "Ports and
// endpoints"; the compose healthcheck works against the real HttpExposer; the runtime image
// installs a package for every shared library of the built `grpo`.
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/metrics/http_exposer.h"
#include "tests/deploy/deploy_test_util.h"
#include "tests/test_util.h"

namespace grpo::testing {
namespace {

const char* kCompose = "deploy/docker-compose.yml";

// The compose file as docker-compose resolves it (anchors and merge keys applied).
YAML::Node ResolvedCompose() {
  const CommandResult r = RunShell("docker-compose -f " + RepoPath(kCompose) + " config");
  EXPECT_EQ(r.rc, 0) << r.out;
  return YAML::Load(r.out);
}

std::vector<std::string> Strings(const YAML::Node& seq) {
  std::vector<std::string> out;
  for (const auto& n : seq) out.push_back(n.as<std::string>());
  return out;
}

bool Contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

// The value after `flag` in an argument list, or "".
std::string FlagValue(const std::vector<std::string>& args, const std::string& flag) {
  const auto it = std::find(args.begin(), args.end(), flag);
  return it != args.end() && it + 1 != args.end() ? *(it + 1) : "";
}

#define SKIP_WITHOUT(tool) \
  if (!HaveTool(tool)) GTEST_SKIP() << tool << " not installed (deploy/setup.sh)"

TEST(DeployCompose, DockerComposeConfigIsValid) {
  SKIP_WITHOUT("docker-compose");
  const CommandResult r = RunShell("docker-compose -f " + RepoPath(kCompose) + " config -q");
  EXPECT_EQ(r.rc, 0) << r.out;
}

TEST(DeployCompose, ServicesUseTheDefaultPortsVolumeAndSecret) {
  SKIP_WITHOUT("docker-compose");
  const YAML::Node services = ResolvedCompose()["services"];
  ASSERT_TRUE(services.IsMap());

  const YAML::Node learner = services["learner"];
  const std::vector<std::string> cmd = Strings(learner["command"]);
  ASSERT_FALSE(cmd.empty());
  EXPECT_EQ(cmd[0], "learner");
  EXPECT_EQ(FlagValue(cmd, "--config"), "/etc/grpo/config.yaml");
  std::set<int> published;
  for (const auto& p : learner["ports"]) {
    if (p.IsMap()) {
      published.insert(p["target"].as<int>());
    } else {  // "127.0.0.1:9400:9400/tcp"
      const std::string s = p.as<std::string>();
      const size_t colon = s.rfind(':');
      published.insert(std::stoi(s.substr(colon + 1)));
    }
  }
  EXPECT_EQ(published, (std::set<int>{50051, 9400}));
  bool state_volume = false;
  for (const auto& v : learner["volumes"]) {
    const std::string s = v.as<std::string>();
    state_volume |= s.rfind("learner-state:/var/lib/grpo", 0) == 0;
  }
  EXPECT_TRUE(state_volume) << "learner needs a volume for /var/lib/grpo";
  EXPECT_TRUE(learner["healthcheck"]["test"].IsSequence());

  int workers = 0;
  for (const auto& kv : services) {
    const std::string name = kv.first.as<std::string>();
    const YAML::Node s = kv.second;
    if (s["secrets"].IsDefined() && s["secrets"].size() > 0) {
      EXPECT_EQ(s["secrets"][0]["source"].as<std::string>(), "grpo_auth_token") << name;
    }
    if (!s["command"].IsDefined() || s["command"][0].as<std::string>() != "rollout") continue;
    ++workers;
    const std::vector<std::string> args = Strings(s["command"]);
    EXPECT_EQ(FlagValue(args, "--learner_address"), "learner:50051") << name;
    EXPECT_EQ(FlagValue(args, "--metrics_port"), "9401") << name;
    EXPECT_EQ(s["depends_on"]["learner"]["condition"].as<std::string>(), "service_healthy");
    EXPECT_NE(s["healthcheck"]["test"][3].as<std::string>().find("/dev/tcp/127.0.0.1/9401"),
              std::string::npos)
        << name;
    EXPECT_EQ(s["secrets"][0]["source"].as<std::string>(), "grpo_auth_token") << name;
  }
  EXPECT_EQ(workers, 2);
  // Two learner ranks (README "Learner ranks"): the same command, torchrun's variables, rank 0
  // at the rendezvous address both name.
  const YAML::Node rank1 = services["learner-rank1"];
  ASSERT_TRUE(rank1.IsDefined());
  EXPECT_EQ(Strings(rank1["command"]), cmd);
  for (const auto& [node, rank] : {std::pair{learner, "0"}, std::pair{rank1, "1"}}) {
    const YAML::Node env = node["environment"];
    EXPECT_EQ(env["RANK"].as<std::string>(), rank);
    EXPECT_EQ(env["WORLD_SIZE"].as<std::string>(), "2");
    EXPECT_EQ(env["MASTER_ADDR"].as<std::string>(), "learner");
    EXPECT_EQ(env["MASTER_PORT"].as<std::string>(), "29500");
  }
  EXPECT_TRUE(services["prometheus"].IsDefined());
  EXPECT_TRUE(services["grafana"].IsDefined());
  EXPECT_TRUE(services["learner"]["secrets"].IsDefined());
}

// Runs the learner's compose healthcheck command (pointed at a test port) against HttpExposer.
TEST(DeployCompose, HealthcheckCommandAcceptsHealthyAndRejectsUnhealthy) {
  SKIP_WITHOUT("docker-compose");
  SKIP_WITHOUT("bash");
  const YAML::Node test = ResolvedCompose()["services"]["learner"]["healthcheck"]["test"];
  ASSERT_EQ(test.size(), 4u);
  ASSERT_EQ(test[0].as<std::string>(), "CMD");
  ASSERT_EQ(test[1].as<std::string>(), "bash");
  std::string script = test[3].as<std::string>();
  const std::string port_text = "/dev/tcp/127.0.0.1/9400";
  const size_t at = script.find(port_text);
  ASSERT_NE(at, std::string::npos) << script;

  common::Registry registry;
  bool healthy = true;
  common::HttpExposer exposer(
      registry, [&healthy] { return healthy ? Status::OK() : Status::Unavailable("not ready"); });
  ASSERT_TRUE(exposer.Start("127.0.0.1", 0).ok());
  script.replace(at, port_text.size(), "/dev/tcp/127.0.0.1/" + std::to_string(exposer.port()));
  // Single quotes around the script: it holds none (checked), so no escaping is needed.
  ASSERT_EQ(script.find('\''), std::string::npos);
  const std::string cmd = "timeout 10 bash -c '" + script + "'";
  EXPECT_EQ(RunShell(cmd).rc, 0) << cmd;
  healthy = false;
  EXPECT_NE(RunShell(cmd).rc, 0) << cmd;
}

TEST(DeployCompose, PrometheusConfigIsValidAndScrapesEveryService) {
  const std::string path = RepoPath("deploy/prometheus/prometheus.yml");
  if (HaveTool("promtool")) {
    const CommandResult r = RunShell("promtool check config " + path);
    EXPECT_EQ(r.rc, 0) << r.out;
  }
  std::set<std::string> targets;
  for (const auto& job : YAML::LoadFile(path)["scrape_configs"]) {
    for (const auto& sc : job["static_configs"]) {
      for (const auto& t : sc["targets"]) targets.insert(t.as<std::string>());
    }
  }
  EXPECT_EQ(targets, (std::set<std::string>{"learner:9400", "worker-1:9401", "worker-2:9401"}));
  if (!HaveTool("docker-compose")) return;
  const YAML::Node services = ResolvedCompose()["services"];
  for (const std::string& t : targets) {
    EXPECT_TRUE(services[t.substr(0, t.find(':'))].IsDefined()) << t << " is not a service";
  }
}

TEST(DeployCompose, ContainerConfigParsesAndValidates) {
  auto config = common::LoadConfigFile(RepoPath("deploy/config.yaml"));
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_TRUE(config->Validate().ok()) << config->Validate().ToString();
  EXPECT_EQ(config->grpc_port, 50051);
  EXPECT_EQ(config->metrics_port, 9400);
  EXPECT_EQ(config->output_dir, "/var/lib/grpo");
  EXPECT_EQ(config->auth_token_file, "/run/secrets/grpo_auth_token");
}

// The runtime stage's package list from the Dockerfile's `apt-get install` (runtime stage).
std::vector<std::string> RuntimePackages(const std::string& dockerfile) {
  const size_t runtime = dockerfile.find("AS runtime");
  const size_t install = dockerfile.find("apt-get install", runtime);
  const size_t end = dockerfile.find("&& rm -rf", install);
  std::vector<std::string> pkgs;
  std::istringstream words(dockerfile.substr(install, end - install));
  for (std::string w; words >> w;) {
    if (w == "\\" || w[0] == '-' || w == "apt-get" || w == "install") continue;
    pkgs.push_back(w);
  }
  return pkgs;
}

TEST(DeployDockerfile, TwoDebianStagesNonRootUserAndGrpoEntrypoint) {
  const std::string d = ReadRepoFile("deploy/Dockerfile");
  EXPECT_NE(d.find("FROM debian:bookworm AS builder"), std::string::npos);
  EXPECT_NE(d.find("FROM debian:bookworm-slim AS runtime"), std::string::npos);
  EXPECT_NE(d.find("bash deploy/setup.sh"), std::string::npos);
  EXPECT_NE(d.find("bash deploy/build.sh grpo"), std::string::npos);
  EXPECT_NE(d.find("COPY --from=builder /src/build/services/grpo /usr/local/bin/grpo"),
            std::string::npos);
  // Where the launcher looks for grpo-torch: ../lib/grpo/ from /usr/local/bin (launch.h).
  EXPECT_NE(d.find("COPY --from=builder /src/build/services/grpo-torch "
                   "/usr/local/lib/grpo/grpo-torch"),
            std::string::npos);
  EXPECT_NE(d.find("useradd --system --uid 10001 --gid grpo"), std::string::npos);
  EXPECT_NE(d.find("WORKDIR /var/lib/grpo"), std::string::npos);
  EXPECT_NE(d.find("\nUSER 10001:10001\n"), std::string::npos);
  EXPECT_NE(d.find("\nENTRYPOINT [\"grpo\"]\n"), std::string::npos);
  const std::vector<std::string> pkgs = RuntimePackages(d);
  EXPECT_TRUE(Contains(pkgs, "libgrpc++1.51")) << "runtime packages parsed wrong";
  EXPECT_FALSE(Contains(pkgs, "libtorch1.13"))
      << "one libtorch: the wheel's, copied from the builder";
  for (const char* dir : {"/opt/grpo-serve/venv/lib/python3.11/site-packages/torch/lib",
                          "/opt/grpo-serve/venv/lib/python3.11/site-packages/nvidia"}) {
    EXPECT_NE(d.find(std::string("COPY --from=builder ") + dir + " " + dir), std::string::npos)
        << dir;
  }
  if (!HaveTool("apt-cache") || RunShell("apt-cache show --no-all-versions libc6").rc != 0) {
    return;  // no package index to look the names up in
  }
  std::string list;
  for (const std::string& p : pkgs) list += " " + p;
  const CommandResult show = RunShell("apt-cache show --no-all-versions" + list + " >/dev/null");
  EXPECT_EQ(show.rc, 0) << "not Debian packages: " << show.out;
}

// Every shared library the built binary loads comes from a package the runtime stage installs
// (directly or as a dependency) or from the base image (Priority: required).
TEST(DeployDockerfile, RuntimePackagesCoverTheBinarysSharedLibraries) {
  const char* grpo = std::getenv("GRPO_BIN");
  if (grpo == nullptr || !std::filesystem::exists(grpo)) GTEST_SKIP() << "grpo not built";
  // The launcher and grpo-torch, which it executes (services/cli/launch.h).
  const std::string bin = std::string(grpo) + " " + GrpoTorchBin();
  if (!HaveTool("dpkg") || !HaveTool("apt-cache") || !HaveTool("ldd") ||
      RunShell("apt-cache show --no-all-versions libc6").rc != 0) {
    GTEST_SKIP() << "needs dpkg, ldd and apt-cache with a package index";
  }
  // Owning packages of the binary's libraries; a second pass without /usr for merged-/usr
  // paths that dpkg registered under /lib.
  const CommandResult owners = RunShell(
      std::string("ldd ") + bin +
      " | awk '$3 ~ /^\\// {print $3}' | xargs -r readlink -f | sort -u > /tmp/grpo_libs.$$ && "
      "{ xargs -r dpkg -S < /tmp/grpo_libs.$$; sed 's|^/usr||' /tmp/grpo_libs.$$ | "
      "xargs -r dpkg -S; } 2>/dev/null | grep ': /' | sed 's/: .*//; s/, /\\n/g' | "
      "sed 's/:.*//' | sort -u; rm -f /tmp/grpo_libs.$$");
  std::set<std::string> needed;
  std::istringstream lines(owners.out);
  for (std::string pkg; std::getline(lines, pkg);) needed.insert(pkg);
  ASSERT_FALSE(needed.empty());

  std::string list;
  for (const std::string& p : RuntimePackages(ReadRepoFile("deploy/Dockerfile"))) list += " " + p;
  const CommandResult deps = RunShell(
      "apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks "
      "--no-replaces --no-enhances" +
      list + " | sed -E 's/^ *\\|?(Pre)?Depends: //; s/[<>]//g; s/:any$//' | sort -u");
  ASSERT_EQ(deps.rc, 0) << deps.out;
  std::set<std::string> provided;
  std::istringstream dl(deps.out);
  for (std::string p; std::getline(dl, p);) provided.insert(p);
  const CommandResult base = RunShell(
      "dpkg-query -W -f='${Package} ${Priority}\\n' | awk '$2 == \"required\" {print $1}'");
  std::istringstream bl(base.out);
  for (std::string p; std::getline(bl, p);) provided.insert(p);
  for (const std::string& p : needed) {
    EXPECT_TRUE(provided.count(p) > 0) << p << " (a library of grpo) is not installed by the "
                                       << "runtime stage of deploy/Dockerfile";
  }
  // Libraries that no package owns (libtorch and CUDA's, from the venv) lie under a folder the
  // runtime stage copies from the builder to the same path.
  const std::string dockerfile = ReadRepoFile("deploy/Dockerfile");
  const CommandResult unowned = RunShell(
      std::string("ldd ") + bin + " | awk '$3 ~ /^\\/opt\\// {print $3}' | xargs -r readlink -f");
  std::istringstream ul(unowned.out);
  int venv_libs = 0;
  for (std::string lib; std::getline(ul, lib);) {
    ++venv_libs;
    bool copied = false;
    std::istringstream dl2(dockerfile);
    for (std::string line; std::getline(dl2, line);) {
      std::istringstream words(line);
      std::string copy, from, src, dst;
      words >> copy >> from >> src >> dst;
      if (copy == "COPY" && from == "--from=builder" && src == dst &&
          lib.rfind(src + "/", 0) == 0) {
        copied = true;
      }
    }
    EXPECT_TRUE(copied) << lib << " (a library of grpo) is not copied into the runtime stage";
  }
  EXPECT_GT(venv_libs, 0) << "libtorch comes from the venv";
}

}  // namespace
}  // namespace grpo::testing
