// deploy/k8s/ (kustomize), checked statically with yaml-cpp: every resource file exists and
// parses; selectors match pod labels; container, probe, Service and annotation ports agree
// with docs/ARCHITECTURE.md "Ports and endpoints" (learner gRPC 50051 + metrics 9400, worker
// metrics 9401); volumes, the ConfigMap and the Secret fit together.
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/config.h"
#include "tests/deploy/deploy_test_util.h"

namespace grpo::testing {
namespace {

constexpr int kGrpcPort = 50051, kLearnerMetricsPort = 9400, kWorkerMetricsPort = 9401;
constexpr int kRendezvousPort = 29500;  // the learner ranks' (torchrun's default MASTER_PORT)

struct Manifests {
  std::vector<std::string> files;
  std::map<std::string, YAML::Node> by_key;  // "Kind/name"
};

Manifests Load() {
  Manifests m;
  const std::string dir = RepoPath("deploy/k8s");
  const YAML::Node kustomization = YAML::LoadFile(dir + "/kustomization.yaml");
  EXPECT_EQ(kustomization["kind"].as<std::string>(), "Kustomization");
  for (const auto& r : kustomization["resources"]) {
    const std::string file = r.as<std::string>();
    m.files.push_back(file);
    if (!std::filesystem::exists(dir + "/" + file)) continue;
    for (const YAML::Node& doc : YAML::LoadAllFromFile(dir + "/" + file)) {
      if (doc.IsNull()) continue;
      const std::string key =
          doc["kind"].as<std::string>() + "/" + doc["metadata"]["name"].as<std::string>();
      EXPECT_EQ(m.by_key.count(key), 0u) << key << " defined twice";
      m.by_key[key] = doc;
    }
  }
  return m;
}

std::map<std::string, std::string> StringMap(const YAML::Node& n) {
  std::map<std::string, std::string> out;
  for (const auto& kv : n) out[kv.first.as<std::string>()] = kv.second.as<std::string>();
  return out;
}

// True when every selector entry is among the labels.
bool Selects(const std::map<std::string, std::string>& selector,
             const std::map<std::string, std::string>& labels) {
  for (const auto& [k, v] : selector) {
    const auto it = labels.find(k);
    if (it == labels.end() || it->second != v) return false;
  }
  return !selector.empty();
}

YAML::Node Container(const YAML::Node& workload, const std::string& name) {
  for (const auto& c : workload["spec"]["template"]["spec"]["containers"]) {
    if (c["name"].as<std::string>() == name) return c;
  }
  ADD_FAILURE() << "no container " << name;
  return YAML::Node();
}

// containerPort by port name.
std::map<std::string, int> Ports(const YAML::Node& container) {
  std::map<std::string, int> out;
  for (const auto& p : container["ports"])
    out[p["name"].as<std::string>()] = p["containerPort"].as<int>();
  return out;
}

std::vector<std::string> Args(const YAML::Node& container) {
  std::vector<std::string> out;
  for (const auto& a : container["args"]) out.push_back(a.as<std::string>());
  return out;
}

std::string FlagValue(const std::vector<std::string>& args, const std::string& flag) {
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == flag) return args[i + 1];
  }
  return "";
}

class K8sManifests : public ::testing::Test {
 protected:
  void SetUp() override { m_ = Load(); }
  const YAML::Node& Get(const std::string& key) {
    static const YAML::Node kMissing;
    auto it = m_.by_key.find(key);
    if (it == m_.by_key.end()) {
      ADD_FAILURE() << "missing " << key;
      return kMissing;
    }
    return it->second;
  }
  std::vector<YAML::Node> Workloads() {
    std::vector<YAML::Node> out;
    for (const auto& [key, doc] : m_.by_key) {
      if (key.rfind("StatefulSet/", 0) == 0 || key.rfind("Deployment/", 0) == 0 ||
          key.rfind("Job/", 0) == 0) {
        out.push_back(doc);
      }
    }
    return out;
  }
  Manifests m_;
};

TEST_F(K8sManifests, EveryKustomizationResourceExistsAndHasAKnownKind) {
  ASSERT_FALSE(m_.files.empty());
  for (const std::string& f : m_.files) {
    EXPECT_TRUE(std::filesystem::exists(RepoPath("deploy/k8s/" + f))) << f;
  }
  const std::set<std::string> kinds = {"ConfigMap",   "Secret",     "Service",
                                       "StatefulSet", "Deployment", "Job"};
  for (const auto& [key, doc] : m_.by_key) {
    EXPECT_TRUE(kinds.count(doc["kind"].as<std::string>())) << key;
    EXPECT_TRUE(doc["apiVersion"].IsDefined()) << key;
  }
  std::set<std::string> keys;
  for (const auto& [key, doc] : m_.by_key) keys.insert(key);
  EXPECT_EQ(keys, (std::set<std::string>{"ConfigMap/grpo-config", "Secret/grpo-auth",
                                         "Service/grpo-learner", "Service/grpo-learner-headless",
                                         "Service/grpo-rollout", "StatefulSet/grpo-learner",
                                         "Job/grpo-learner-ranks", "Deployment/grpo-rollout"}));
}

TEST_F(K8sManifests, WorkloadSelectorsMatchTheirPodTemplates) {
  for (const YAML::Node& w : Workloads()) {
    if (w["kind"].as<std::string>() == "Job") continue;  // Kubernetes generates a Job's selector
    EXPECT_TRUE(Selects(StringMap(w["spec"]["selector"]["matchLabels"]),
                        StringMap(w["spec"]["template"]["metadata"]["labels"])))
        << w["metadata"]["name"];
  }
}

TEST_F(K8sManifests, EachServiceSelectsOneWorkloadAndTargetsItsPorts) {
  for (const auto& [key, svc] : m_.by_key) {
    if (key.rfind("Service/", 0) != 0) continue;
    const auto selector = StringMap(svc["spec"]["selector"]);
    int matches = 0;
    for (const YAML::Node& w : Workloads()) {
      if (!Selects(selector, StringMap(w["spec"]["template"]["metadata"]["labels"]))) continue;
      ++matches;
      std::map<std::string, int> ports;
      for (const auto& c : w["spec"]["template"]["spec"]["containers"]) {
        for (const auto& [name, port] : Ports(c)) ports[name] = port;
      }
      for (const auto& p : svc["spec"]["ports"]) {
        const std::string target = p["targetPort"].as<std::string>();
        ASSERT_TRUE(ports.count(target)) << key << " targets unknown port " << target;
        EXPECT_EQ(p["port"].as<int>(), ports[target]) << key;
      }
    }
    EXPECT_EQ(matches, 1) << key;
  }
}

TEST_F(K8sManifests, LearnerServesGrpcAndMetricsOnTheDefaultPorts) {
  const YAML::Node& sts = Get("StatefulSet/grpo-learner");
  ASSERT_TRUE(sts.IsDefined());
  EXPECT_EQ(sts["spec"]["replicas"].as<int>(), 1);
  EXPECT_EQ(Get("Service/" + sts["spec"]["serviceName"].as<std::string>())["spec"]["clusterIP"]
                .as<std::string>(),
            "None");
  const YAML::Node c = Container(sts, "learner");
  EXPECT_EQ(Ports(c), (std::map<std::string, int>{{"grpc", kGrpcPort},
                                                  {"metrics", kLearnerMetricsPort},
                                                  {"rendezvous", kRendezvousPort}}));
  for (const char* probe : {"startupProbe", "readinessProbe", "livenessProbe"}) {
    EXPECT_EQ(c[probe]["grpc"]["port"].as<int>(), kGrpcPort) << probe;
  }
  const auto annotations = StringMap(sts["spec"]["template"]["metadata"]["annotations"]);
  EXPECT_EQ(annotations.at("prometheus.io/scrape"), "true");
  EXPECT_EQ(annotations.at("prometheus.io/port"), std::to_string(kLearnerMetricsPort));
  EXPECT_EQ(annotations.at("prometheus.io/path"), "/metrics");
  const std::vector<std::string> args = Args(c);
  ASSERT_FALSE(args.empty());
  EXPECT_EQ(args[0], "learner");
  // The state volume is a PVC from volumeClaimTemplates, mounted where the config writes.
  const std::string claim =
      sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"].as<std::string>();
  bool mounted = false;
  for (const auto& vm : c["volumeMounts"]) {
    mounted |= vm["name"].as<std::string>() == claim &&
               vm["mountPath"].as<std::string>() == "/var/lib/grpo";
  }
  EXPECT_TRUE(mounted) << "PVC " << claim << " not mounted at /var/lib/grpo";
}

// The learner group (README "Learner ranks"): rank 0 is the StatefulSet's pod, ranks 1 ..
// WORLD_SIZE-1 the indexed Job's (RANK = JOB_COMPLETION_INDEX + GRPO_RANK_OFFSET, as
// learner/distributed/rank_group.h reads them); both name the same world and meet at rank 0's
// stable DNS name on its rendezvous port, which the headless Service publishes before the pod
// is ready (rank 0 serves gRPC, its readiness, only after the ranks have met).
TEST_F(K8sManifests, LearnerRanksMeetRankZeroAtItsHeadlessName) {
  const YAML::Node& sts = Get("StatefulSet/grpo-learner");
  const YAML::Node& job = Get("Job/grpo-learner-ranks");
  ASSERT_TRUE(sts.IsDefined() && job.IsDefined());
  auto env = [](const YAML::Node& c) {
    std::map<std::string, std::string> out;
    for (const auto& e : c["env"]) out[e["name"].as<std::string>()] = e["value"].as<std::string>();
    return out;
  };
  const auto rank0 = env(Container(sts, "learner"));
  const auto ranks = env(Container(job, "learner"));
  EXPECT_EQ(rank0.at("RANK"), "0");
  EXPECT_EQ(ranks.count("RANK"), 0u) << "the Job's ranks come from their completion index";
  EXPECT_EQ(ranks.at("GRPO_RANK_OFFSET"), "1");
  const int world = std::stoi(rank0.at("WORLD_SIZE"));
  EXPECT_EQ(ranks.at("WORLD_SIZE"), rank0.at("WORLD_SIZE"));
  EXPECT_EQ(job["spec"]["completionMode"].as<std::string>(), "Indexed");
  EXPECT_EQ(job["spec"]["completions"].as<int>(), world - 1);
  EXPECT_EQ(job["spec"]["parallelism"].as<int>(), world - 1);
  EXPECT_EQ(job["spec"]["template"]["spec"]["restartPolicy"].as<std::string>(), "OnFailure");
  const std::string headless = sts["spec"]["serviceName"].as<std::string>();
  const std::string master = sts["metadata"]["name"].as<std::string>() + "-0." + headless;
  for (const auto* e : {&rank0, &ranks}) {
    EXPECT_EQ(e->at("MASTER_ADDR"), master);
    EXPECT_EQ(e->at("MASTER_PORT"), rank0.at("MASTER_PORT"));
    EXPECT_EQ(e->at("LOCAL_RANK"), "0");  // one device per pod
  }
  EXPECT_EQ(Ports(Container(sts, "learner")).at("rendezvous"), std::stoi(rank0.at("MASTER_PORT")));
  const YAML::Node& svc = Get("Service/" + headless);
  EXPECT_TRUE(svc["spec"]["publishNotReadyAddresses"].as<bool>());
  bool rendezvous = false;
  for (const auto& p : svc["spec"]["ports"]) {
    rendezvous |= p["targetPort"].as<std::string>() == "rendezvous" &&
                  p["port"].as<int>() == std::stoi(rank0.at("MASTER_PORT"));
  }
  EXPECT_TRUE(rendezvous) << headless << " does not publish the rendezvous port";
  // The Job's pods train the same config and model as rank 0.
  EXPECT_EQ(Args(Container(job, "learner")), Args(Container(sts, "learner")));
}

TEST_F(K8sManifests, WorkersServeMetricsAndHealthOn9401AndDialTheLearnerService) {
  const YAML::Node& dep = Get("Deployment/grpo-rollout");
  ASSERT_TRUE(dep.IsDefined());
  EXPECT_EQ(dep["spec"]["replicas"].as<int>(), 2);
  const YAML::Node c = Container(dep, "rollout");
  EXPECT_EQ(Ports(c), (std::map<std::string, int>{{"metrics", kWorkerMetricsPort}}));
  for (const char* probe : {"readinessProbe", "livenessProbe"}) {
    EXPECT_EQ(c[probe]["httpGet"]["path"].as<std::string>(), "/healthz") << probe;
    EXPECT_EQ(c[probe]["httpGet"]["port"].as<int>(), kWorkerMetricsPort) << probe;
  }
  const auto annotations = StringMap(dep["spec"]["template"]["metadata"]["annotations"]);
  EXPECT_EQ(annotations.at("prometheus.io/scrape"), "true");
  EXPECT_EQ(annotations.at("prometheus.io/port"), std::to_string(kWorkerMetricsPort));
  const std::vector<std::string> args = Args(c);
  ASSERT_FALSE(args.empty());
  EXPECT_EQ(args[0], "rollout");
  EXPECT_EQ(FlagValue(args, "--metrics_port"), std::to_string(kWorkerMetricsPort));
  const std::string address = FlagValue(args, "--learner_address");
  const size_t colon = address.find(':');
  ASSERT_NE(colon, std::string::npos) << address;
  const YAML::Node& svc = Get("Service/" + address.substr(0, colon));
  bool has_port = false;
  for (const auto& p : svc["spec"]["ports"])
    has_port |= p["port"].as<std::string>() == address.substr(colon + 1);
  EXPECT_TRUE(has_port) << address;
}

TEST_F(K8sManifests, ContainersHaveResourceRequestsAndLimitsAndRunAsTheGrpoUser) {
  for (const YAML::Node& w : Workloads()) {
    const YAML::Node pod = w["spec"]["template"]["spec"];
    EXPECT_TRUE(pod["securityContext"]["runAsNonRoot"].as<bool>());
    EXPECT_EQ(pod["securityContext"]["runAsUser"].as<int>(), 10001);
    for (const char* list : {"initContainers", "containers"}) {
      for (const auto& c : pod[list]) {
        for (const char* kind : {"requests", "limits"}) {
          for (const char* res : {"cpu", "memory"}) {
            EXPECT_TRUE(c["resources"][kind][res].IsDefined())
                << w["metadata"]["name"] << "/" << c["name"] << " " << kind << "." << res;
          }
        }
        EXPECT_EQ(c["image"].as<std::string>(), "grpo-serve:latest");
      }
    }
  }
}

TEST_F(K8sManifests, VolumesExistAndConfigAndSecretFitTogether) {
  const std::string config_text =
      Get("ConfigMap/grpo-config")["data"]["config.yaml"].as<std::string>();
  EXPECT_EQ(config_text, ReadRepoFile("deploy/config.yaml"))
      << "deploy/k8s/configmap.yaml must carry deploy/config.yaml's text";
  auto config = common::ParseConfigYaml(config_text, "configmap.yaml");
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_TRUE(config->Validate().ok()) << config->Validate().ToString();
  EXPECT_EQ(config->grpc_port, kGrpcPort);
  EXPECT_EQ(config->metrics_port, kLearnerMetricsPort);
  const auto secret_data = StringMap(Get("Secret/grpo-auth")["stringData"]);

  for (const YAML::Node& w : Workloads()) {
    const YAML::Node pod = w["spec"]["template"]["spec"];
    std::map<std::string, YAML::Node> volumes;
    for (const auto& v : pod["volumes"]) volumes[v["name"].as<std::string>()] = YAML::Node(v);
    for (const auto& t : w["spec"]["volumeClaimTemplates"])
      volumes[t["metadata"]["name"].as<std::string>()] = YAML::Node(t);
    for (const char* list : {"initContainers", "containers"}) {
      for (const auto& c : pod[list]) {
        bool has_config = false, has_token = false;
        for (const auto& vm : c["volumeMounts"]) {
          const std::string name = vm["name"].as<std::string>();
          ASSERT_TRUE(volumes.count(name)) << w["metadata"]["name"] << ": no volume " << name;
          const YAML::Node& v = volumes[name];
          const std::string path = vm["mountPath"].as<std::string>();
          if (v["configMap"].IsDefined()) {
            EXPECT_TRUE(m_.by_key.count("ConfigMap/" + v["configMap"]["name"].as<std::string>()));
            has_config = path + "/config.yaml" == FlagValue(Args(c), "--config");
          }
          if (v["secret"].IsDefined()) {
            EXPECT_TRUE(m_.by_key.count("Secret/" + v["secret"]["secretName"].as<std::string>()));
            for (const auto& item : v["secret"]["items"]) {
              EXPECT_TRUE(secret_data.count(item["key"].as<std::string>()));
              has_token |= path + "/" + item["path"].as<std::string>() == config->auth_token_file;
            }
          }
        }
        if (list == std::string("containers")) {
          EXPECT_TRUE(has_config) << c["name"] << ": config not mounted where --config points";
          EXPECT_TRUE(has_token) << c["name"] << ": token not at auth_token_file";
        }
      }
    }
  }
}

}  // namespace
}  // namespace grpo::testing
