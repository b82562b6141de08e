#include "services/convert.h"

namespace grpo::services {

void ToProto(const common::RolloutGroup& group, v1::RolloutGroup* out) {
  out->set_prompt_id(group.prompt_id);
  out->set_lease_id(group.lease_id);
  out->set_policy_version(group.policy_version);
  out->set_policy_incarnation(group.policy_incarnation);
  out->mutable_prompt_ids()->Assign(group.prompt_ids.begin(), group.prompt_ids.end());
  for (const auto& c : group.completions) {
    v1::Completion* pc = out->add_completions();
    pc->mutable_token_ids()->Assign(c.token_ids.begin(), c.token_ids.end());
    pc->mutable_logprobs()->Assign(c.logprobs.begin(), c.logprobs.end());
    pc->set_truncated(c.truncated);
    pc->set_text(c.text);
    for (const auto& r : c.rewards) {
      v1::RewardValue* v = pc->add_rewards();
      if (r) v->set_value(*r);
    }
  }
}

common::RolloutGroup FromProto(const v1::RolloutGroup& group) {
  common::RolloutGroup g;
  g.prompt_id = group.prompt_id();
  g.lease_id = group.lease_id();
  g.policy_version = group.policy_version();
  g.policy_incarnation = group.policy_incarnation();
  g.prompt_ids.assign(group.prompt_ids().begin(), group.prompt_ids().end());
  for (const auto& pc : group.completions()) {
    common::Completion c;
    c.token_ids.assign(pc.token_ids().begin(), pc.token_ids().end());
    c.logprobs.assign(pc.logprobs().begin(), pc.logprobs().end());
    c.truncated = pc.truncated();
    c.text = pc.text();
    for (const auto& v : pc.rewards()) {
      c.rewards.push_back(v.has_value() ? std::optional<double>(v.value()) : std::nullopt);
    }
    g.completions.push_back(std::move(c));
  }
  return g;
}

grpc::Status ToGrpcStatus(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), status.message());
}

Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return Status::OK();
  return Status(static_cast<StatusCode>(status.error_code()), status.error_message());
}

}  // namespace grpo::services
