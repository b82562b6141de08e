// The weight-sync group as both ends see it (docs/ARCHITECTURE.md "Weight sync"): the backend
// names, the store keys of a group (one definition for the learner's publisher and the
// workers' receivers), the roster format, and which backend a worker gets (AssignBackend).
// Pure: no transport, no CUDA.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace grpo::common {

// weight_sync_backend values. kBackendAuto and kBackendGrpc are worker-side choices: auto is
// resolved by the learner at Register (AssignBackend); grpc means GetWeights, no group.
inline constexpr std::string_view kBackendGrpc = "grpc";
inline constexpr std::string_view kBackendGloo = "gloo";
inline constexpr std::string_view kBackendNccl = "nccl";
inline constexpr std::string_view kBackendCudaIpc = "cuda_ipc";
inline constexpr std::string_view kBackendAuto = "auto";

// True for the names above.
bool IsWeightSyncBackendName(std::string_view name);
// The backends that form a group (one per backend and epoch), in the order the learner
// serves them.
const std::vector<std::string_view>& GroupBackends();

// Keys of one backend's group, inside an epoch of the EpochStore:
//   roster        "grpo/<backend>/roster": the worker ids of ranks 1..N, one a line (the
//                 learner writes it before it creates its rank 0);
//   version k     "grpo/<backend>/version/<k>": the announcement of the epoch's k-th
//                 broadcast, written before the publisher's Begin: the policy version and the
//                 incarnation of the learner process that publishes it
//                 (FormatVersionAnnouncement);
//   group prefix  "grpo/<backend>/group": the backend's own rendezvous keys (a c10d
//                 PrefixStore), so two backends' groups of one epoch never share a key.
std::string RosterKey(std::string_view backend);
std::string VersionKey(std::string_view backend, int64_t seq);
std::string GroupPrefix(std::string_view backend);

std::string FormatRoster(const std::vector<std::string>& worker_ids);
// The non-empty lines, in order (rank = index + 1).
std::vector<std::string> ParseRoster(const std::string& text);

// A broadcast's announcement (the VersionKey value): the policy version and the incarnation of
// the learner that publishes it. Weights carry the incarnation end to end: a restarted learner's
// versions restart from its checkpoint, so a version number alone names no weights.
struct VersionAnnouncement {
  int64_t version = -1;
  std::string incarnation;  // empty from an older learner (the value was the version alone)
  // > 0: the learner streams the version (weight_publish: stream) as it produces it: one
  // Broadcast per StreamGrouping (weight_sync.h) group of this many bytes at most, in
  // Model::NamedParameters order, instead of one for the whole list. Needs an incarnation.
  int64_t stream_group_bytes = 0;
};
std::string FormatVersionAnnouncement(const VersionAnnouncement& a);
// Reads "<version>", "<version> <incarnation>" or "<version> <incarnation> stream <bytes>";
// nullopt when malformed.
std::optional<VersionAnnouncement> ParseVersionAnnouncement(const std::string& text);

// Where one end of a weight sync computes: on a GPU (with the GPU's UUID, as
// cudaDeviceProp::uuid / nvidia-smi -L give it) or on the CPU.
struct SyncEndpoint {
  bool cuda = false;
  std::string gpu_uuid;  // empty on the CPU, or when unknown
};

// The backend a worker gets, and why when it is not the one it asked for.
struct BackendAssignment {
  std::string backend;
  std::string note;  // empty when the request was granted as asked (auto: always set)
};

// The learner's rule (a pure function of what each end says at Register):
//   grpc                  -> grpc
//   gloo                  -> gloo (CPU tensors; either end may be on a GPU)
//   nccl                  -> nccl when both ends are on GPUs and on different ones; a worker on
//                            the learner's own GPU gets cuda_ipc (NCCL refuses two ranks on one
//                            GPU: "Duplicate GPU detected")
//   cuda_ipc              -> cuda_ipc when both ends are on the same GPU
//   auto                  -> cuda_ipc on the learner's GPU, nccl on another GPU, gloo otherwise
// A backend not `built` into the learner, or impossible for the two ends, falls back to gloo
// (when built and the request was auto) or grpc, with a note saying why.
BackendAssignment AssignBackend(std::string_view requested, const SyncEndpoint& learner,
                                const SyncEndpoint& worker,
                                const std::function<bool(std::string_view)>& built);

}  // namespace grpo::common
