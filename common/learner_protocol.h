// The learner's worker-facing protocol as plain structs: what a rollout worker sends and gets
// back (LearnerService in learner.proto, less the weights and the rendezvous store). One
// definition for both ends: the worker's rollout::LearnerLink and the learner's
// learner::Learner speak it, and services/convert.h maps it to and from protobuf. Header only;
// no gRPC, protobuf or torch.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace grpo::common {

struct RegisterRequest {
  std::string worker_id;  // empty: the learner assigns one
  std::string hostname;
  int32_t pid = 0;
  std::string
      weight_sync_backend;  // WeightReceiver::backend(): grpc | gloo | nccl | cuda_ipc | auto
  std::string device;       // where the worker generates: "cpu", "cuda:N"
  std::string gpu_uuid;     // on a GPU: its UUID (a worker on the learner's GPU: cuda_ipc)
};

struct Registration {
  std::string worker_id;
  int32_t rank = -1;  // in the weight-sync group; the learner is rank 0
  int32_t world_size = 0;
  int64_t group_epoch = 0;
  int64_t policy_version = 0;
  std::string config_json;            // the learner's GrpoConfig as JSON (MergeLearnerConfig)
  int64_t heartbeat_interval_ms = 0;  // 0 = the worker's default
  std::string model_config_json;      // the policy's config.json
  std::string learner_incarnation;    // this learner process's id
  // The weight-sync backend the learner assigned (empty from an older learner) and why when it
  // is not the one asked for.
  std::string weight_sync_backend;
  std::string weight_sync_note;
};

struct HeartbeatRequest {
  std::string worker_id;
  int64_t weight_version = -1;  // the policy version the worker generates with
  int32_t leases_held = 0;
};

struct HeartbeatReply {
  int64_t policy_version = 0;
  int64_t group_epoch = 0;
  bool shutdown = false;            // the job ended
  std::string learner_incarnation;  // empty from an older learner
};

struct PromptLease {
  std::string lease_id;
  std::string prompt_id;
  std::string row_json;  // the dataset row (common/tokenizer/dataset_row.h)
  int64_t deadline_unix_ms = 0;
};

struct LeaseReply {
  std::vector<PromptLease> leases;
  int64_t policy_version = 0;
  bool job_done = false;       // nothing more will be leased
  int64_t retry_after_ms = 0;  // when leases is empty: wait this long before asking again
  std::string learner_incarnation;
};

struct PushReply {
  int64_t accepted = 0;
  int64_t rejected = 0;
  // Received and recorded, not trained: dynamic sampling found no learning signal in them
  // (all rewards equal). Not a fault of the worker; nothing to retry.
  int64_t filtered = 0;
  std::map<std::string, int64_t> rejected_by_reason;
  std::vector<std::string> messages;  // the first few rejection messages
};

}  // namespace grpo::common
