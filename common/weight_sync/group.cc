#include "common/weight_sync/group.h"

#include <charconv>
#include <sstream>

namespace grpo::common {

bool IsWeightSyncBackendName(std::string_view name) {
  return name == kBackendGrpc || name == kBackendGloo || name == kBackendNccl ||
         name == kBackendCudaIpc || name == kBackendAuto;
}

const std::vector<std::string_view>& GroupBackends() {
  static const std::vector<std::string_view> kAll = {kBackendGloo, kBackendNccl, kBackendCudaIpc};
  return kAll;
}

std::string RosterKey(std::string_view backend) {
  return "grpo/" + std::string(backend) + "/roster";
}

std::string VersionKey(std::string_view backend, int64_t seq) {
  return "grpo/" + std::string(backend) + "/version/" + std::to_string(seq);
}

std::string GroupPrefix(std::string_view backend) {
  return "grpo/" + std::string(backend) + "/group";
}

std::string FormatRoster(const std::vector<std::string>& worker_ids) {
  std::string roster;
  for (const std::string& id : worker_ids) roster += id + "\n";
  return roster;
}

std::vector<std::string> ParseRoster(const std::string& text) {
  std::vector<std::string> ids;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) ids.push_back(line);
  }
  return ids;
}

std::string FormatVersionAnnouncement(const VersionAnnouncement& a) {
  if (a.incarnation.empty()) return std::to_string(a.version);
  std::string text = std::to_string(a.version) + " " + a.incarnation;
  if (a.stream_group_bytes > 0) text += " stream " + std::to_string(a.stream_group_bytes);
  return text;
}

namespace {

// Digits only (no sign), within int64; nullopt otherwise.
std::optional<int64_t> ParseDecimal(const std::string& text) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos) {
    return std::nullopt;
  }
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

}  // namespace

std::optional<VersionAnnouncement> ParseVersionAnnouncement(const std::string& text) {
  const size_t space = text.find(' ');
  const std::optional<int64_t> version = ParseDecimal(text.substr(0, space));
  if (!version) return std::nullopt;
  VersionAnnouncement a;
  a.version = *version;
  if (space != std::string::npos) {
    std::string rest = text.substr(space + 1);
    const size_t second = rest.find(' ');
    if (second != std::string::npos) {
      const std::string tail = rest.substr(second + 1);
      if (tail.rfind("stream ", 0) != 0) return std::nullopt;
      const std::optional<int64_t> bytes = ParseDecimal(tail.substr(7));
      if (!bytes || *bytes <= 0) return std::nullopt;
      a.stream_group_bytes = *bytes;
      rest.resize(second);
    }
    a.incarnation = std::move(rest);
    if (a.incarnation.empty() || a.incarnation.find_first_of(" \n") != std::string::npos) {
      return std::nullopt;
    }
  }
  return a;
}

BackendAssignment AssignBackend(std::string_view requested, const SyncEndpoint& learner,
                                const SyncEndpoint& worker,
                                const std::function<bool(std::string_view)>& built) {
  const bool same_gpu = learner.cuda && worker.cuda && !learner.gpu_uuid.empty() &&
                        learner.gpu_uuid == worker.gpu_uuid;
  const bool other_gpu = learner.cuda && worker.cuda && !same_gpu;
  // What a request that cannot be served gets instead.
  auto fallback = [&](const std::string& why) -> BackendAssignment {
    if (requested == kBackendAuto && built(kBackendGloo)) {
      return {std::string(kBackendGloo), why + "; gloo"};
    }
    return {std::string(kBackendGrpc), why + "; GetWeights (grpc) instead"};
  };
  auto gpu_backend = [&](std::string_view backend) -> BackendAssignment {
    if (!built(backend)) {
      return fallback("the learner was built without " + std::string(backend));
    }
    return {std::string(backend), requested == backend ? "" : "auto: " + std::string(backend)};
  };
  if (requested.empty() || requested == kBackendGrpc) return {std::string(kBackendGrpc), ""};
  if (requested == kBackendGloo) {
    if (!built(kBackendGloo)) return fallback("the learner was built without gloo");
    return {std::string(kBackendGloo), ""};
  }
  if (requested == kBackendNccl) {
    if (!learner.cuda) return fallback("nccl needs the learner on a GPU (it is on the CPU)");
    if (!worker.cuda) return fallback("nccl needs the worker on a GPU (it is on the CPU)");
    if (same_gpu) {
      BackendAssignment a = gpu_backend(kBackendCudaIpc);
      if (a.backend == kBackendCudaIpc) {
        a.note = "the worker is on the learner's GPU " + learner.gpu_uuid +
                 " (NCCL refuses two ranks on one GPU); cuda_ipc";
      }
      return a;
    }
    return gpu_backend(kBackendNccl);
  }
  if (requested == kBackendCudaIpc) {
    if (!same_gpu) {
      return fallback("cuda_ipc needs the worker on the learner's GPU (learner " +
                      (learner.cuda ? learner.gpu_uuid : std::string("cpu")) + ", worker " +
                      (worker.cuda ? worker.gpu_uuid : std::string("cpu")) + ")");
    }
    return gpu_backend(kBackendCudaIpc);
  }
  if (requested == kBackendAuto) {
    if (same_gpu && built(kBackendCudaIpc)) return gpu_backend(kBackendCudaIpc);
    if (other_gpu && built(kBackendNccl)) return gpu_backend(kBackendNccl);
    if (built(kBackendGloo)) {
      auto where = [](const SyncEndpoint& e) {
        return e.cuda ? "GPU " + e.gpu_uuid : std::string("the CPU");
      };
      return {std::string(kBackendGloo),
              "auto: gloo (learner on " + where(learner) + ", worker on " + where(worker) + ")"};
    }
    return {std::string(kBackendGrpc), "auto: grpc (no group backend built)"};
  }
  return {std::string(kBackendGrpc),
          "unknown weight_sync_backend '" + std::string(requested) + "'; GetWeights (grpc)"};
}

}  // namespace grpo::common
