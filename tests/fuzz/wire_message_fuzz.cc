// libFuzzer target: the messages the learner and the workers read off the wire and the proto
// conversions behind them (services/convert.h), plus the bytes rank 0 hands the other learner
// ranks (learner/distributed/group_codec.h). The first byte picks the message:
//   0  a RolloutGroup, as PushRollouts streams it from any worker: converted, then checked as
//      the learner checks a group before training (learner/group_check.h, the tiny model's
//      limits), then through the ranks' codec;
//   1  a LeasePromptsResponse, 2 a RegisterResponse, 3 a HeartbeatResponse (a worker reads these
//      from the learner);
//   4  the ranks' generation-batch bytes themselves.
// Any input must convert or be refused, never crash or hit undefined behaviour; a conversion
// must lose nothing (message -> ours -> message -> ours gives the same bytes), and a group must
// come back from the ranks' codec as it went in.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "grpo/v1/learner.pb.h"
#include "learner/distributed/group_codec.h"
#include "learner/group_check.h"
#include "services/convert.h"

namespace {

namespace v1 = grpo::v1;
using grpo::services::FromProto;
using grpo::services::ToProto;

template <typename Proto>
std::string Bytes(const Proto& message) {
  std::string out;
  google::protobuf::io::StringOutputStream stream(&out);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  if (!message.SerializeToCodedStream(&coded)) std::abort();
  coded.Trim();
  return out;
}

// ours -> message -> ours -> message must give the bytes of the first message.
template <typename Proto, typename Ours>
void CheckRoundTrip(const Ours& ours) {
  Proto once;
  ToProto(ours, &once);
  Proto again;
  ToProto(FromProto(once), &again);
  if (Bytes(once) != Bytes(again)) std::abort();
}

// A group's bytes in the ranks' codec: equal bytes, equal groups (floats compared bit for bit).
std::string GroupBytes(const grpo::common::RolloutGroup& group) {
  return grpo::learner::distributed::EncodeGroups({group});
}

void RolloutGroup(const uint8_t* data, size_t size) {
  v1::RolloutGroup message;
  if (!message.ParseFromArray(data, static_cast<int>(size))) return;
  const grpo::common::RolloutGroup group = FromProto(message);
  CheckRoundTrip<v1::RolloutGroup>(group);
  grpo::learner::GroupLimits limits;  // the tiny model's vocabulary, G 4, one reward
  limits.num_generations = 4;
  limits.vocab_size = 259;
  limits.max_completion_length = 64;
  limits.reward_funcs = 1;
  limits.policy_version = 3;
  limits.max_staleness = 1;
  grpo::common::GroupRefusal reason{};
  (void)grpo::learner::CheckGroup(group, limits, &reason);
  auto decoded =
      grpo::learner::distributed::DecodeGroups(grpo::learner::distributed::EncodeGroups({group}));
  if (!decoded.ok() || decoded->size() != 1 || GroupBytes((*decoded)[0]) != GroupBytes(group)) {
    std::abort();
  }
}

template <typename Proto>
void Reply(const uint8_t* data, size_t size) {
  Proto message;
  if (!message.ParseFromArray(data, static_cast<int>(size))) return;
  using Ours = decltype(FromProto(message));
  CheckRoundTrip<Proto, Ours>(FromProto(message));
}

void RankBytes(const uint8_t* data, size_t size) {
  auto groups = grpo::learner::distributed::DecodeGroups(
      std::string(reinterpret_cast<const char*>(data), size));
  if (!groups.ok()) return;
  auto again =
      grpo::learner::distributed::DecodeGroups(grpo::learner::distributed::EncodeGroups(*groups));
  if (!again.ok() || again->size() != groups->size()) std::abort();
  for (size_t i = 0; i < groups->size(); ++i) {
    if (GroupBytes((*again)[i]) != GroupBytes((*groups)[i])) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Parsing refuses a string field that is not UTF-8, as it should; its log line for each
  // such input would drown the fuzzer's own output.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t* body = data + 1;
  const size_t n = size - 1;
  switch (data[0] % 5) {
    case 0:
      RolloutGroup(body, n);
      break;
    case 1:
      Reply<v1::LeasePromptsResponse>(body, n);
      break;
    case 2:
      Reply<v1::RegisterResponse>(body, n);
      break;
    case 3:
      Reply<v1::HeartbeatResponse>(body, n);
      break;
    default:
      RankBytes(body, n);
      break;
  }
  return 0;
}
