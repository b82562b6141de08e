#include "learner/distributed/group_codec.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace grpo::learner::distributed {

namespace {

class Writer {
 public:
  template <typename T>
  void Pod(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void Str(const std::string& s) {
    Pod<uint64_t>(s.size());
    out_.append(s);
  }
  template <typename T>
  void Vec(const std::vector<T>& v) {
    Pod<uint64_t>(v.size());
    out_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& in) : in_(in) {}
  template <typename T>
  Status Pod(T* v, const char* field) {
    if (in_.size() - at_ < sizeof(T)) return Ended(field);
    std::memcpy(v, in_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return Status::OK();
  }
  Status Count(uint64_t* n, size_t element, const char* field) {
    RETURN_IF_ERROR(Pod(n, field));
    if (*n > (in_.size() - at_) / element) return Ended(field);
    return Status::OK();
  }
  Status Str(std::string* s, const char* field) {
    uint64_t n = 0;
    RETURN_IF_ERROR(Count(&n, 1, field));
    s->assign(in_.data() + at_, n);
    at_ += n;
    return Status::OK();
  }
  template <typename T>
  Status Vec(std::vector<T>* v, const char* field) {
    uint64_t n = 0;
    RETURN_IF_ERROR(Count(&n, sizeof(T), field));
    v->resize(n);
    // An empty vector's data() may be null, and memcpy's pointers must not be, even for 0 bytes
    // (UBSan: tests/fuzz/wire_message_fuzz.cc found it on a group with no log-probs).
    if (n > 0) std::memcpy(v->data(), in_.data() + at_, n * sizeof(T));
    at_ += n * sizeof(T);
    return Status::OK();
  }
  bool done() const { return at_ == in_.size(); }

 private:
  Status Ended(const char* field) const {
    return Status::DataLoss(std::string("generation batch bytes end inside ") + field +
                            " (at byte " + std::to_string(at_) + " of " +
                            std::to_string(in_.size()) + ")");
  }
  const std::string& in_;
  size_t at_ = 0;
};

constexpr uint32_t kMagic = 0x47525033;  // "GRP3": with env_mask, tool counts, token versions

}  // namespace

std::string EncodeGroups(const std::vector<common::RolloutGroup>& groups) {
  Writer w;
  w.Pod(kMagic);
  w.Pod<uint64_t>(groups.size());
  for (const common::RolloutGroup& g : groups) {
    w.Str(g.prompt_id);
    w.Str(g.lease_id);
    w.Pod(g.policy_version);
    w.Str(g.policy_incarnation);
    w.Vec(g.prompt_ids);
    w.Pod<uint64_t>(g.completions.size());
    for (const common::Completion& c : g.completions) {
      w.Vec(c.token_ids);
      w.Vec(c.logprobs);
      w.Vec(c.env_mask);
      w.Pod<uint8_t>(c.truncated ? 1 : 0);
      w.Pod<uint8_t>(c.uses_tools ? 1 : 0);
      w.Pod<int32_t>(c.tool_calls);
      w.Pod<int32_t>(c.tool_call_failures);
      w.Vec(c.token_versions);
      w.Pod<uint64_t>(c.rewards.size());
      for (const auto& r : c.rewards) {
        w.Pod<uint8_t>(r ? 1 : 0);
        w.Pod<double>(r ? *r : 0.0);
      }
      w.Str(c.text);
    }
  }
  return w.Take();
}

StatusOr<std::vector<common::RolloutGroup>> DecodeGroups(const std::string& bytes) {
  Reader r(bytes);
  uint32_t magic = 0;
  RETURN_IF_ERROR(r.Pod(&magic, "the header"));
  if (magic != kMagic) return Status::DataLoss("generation batch bytes: not a group batch");
  uint64_t n = 0;
  RETURN_IF_ERROR(r.Count(&n, 8, "the group count"));
  std::vector<common::RolloutGroup> groups(n);
  for (common::RolloutGroup& g : groups) {
    RETURN_IF_ERROR(r.Str(&g.prompt_id, "prompt_id"));
    RETURN_IF_ERROR(r.Str(&g.lease_id, "lease_id"));
    RETURN_IF_ERROR(r.Pod(&g.policy_version, "policy_version"));
    RETURN_IF_ERROR(r.Str(&g.policy_incarnation, "policy_incarnation"));
    RETURN_IF_ERROR(r.Vec(&g.prompt_ids, "prompt_ids"));
    uint64_t nc = 0;
    RETURN_IF_ERROR(r.Count(&nc, 8, "the completion count"));
    g.completions.resize(nc);
    for (common::Completion& c : g.completions) {
      RETURN_IF_ERROR(r.Vec(&c.token_ids, "token_ids"));
      RETURN_IF_ERROR(r.Vec(&c.logprobs, "logprobs"));
      RETURN_IF_ERROR(r.Vec(&c.env_mask, "env_mask"));
      uint8_t truncated = 0;
      RETURN_IF_ERROR(r.Pod(&truncated, "truncated"));
      c.truncated = truncated != 0;
      uint8_t uses_tools = 0;
      RETURN_IF_ERROR(r.Pod(&uses_tools, "uses_tools"));
      c.uses_tools = uses_tools != 0;
      RETURN_IF_ERROR(r.Pod(&c.tool_calls, "tool_calls"));
      RETURN_IF_ERROR(r.Pod(&c.tool_call_failures, "tool_call_failures"));
      RETURN_IF_ERROR(r.Vec(&c.token_versions, "token_versions"));
      uint64_t nr = 0;
      RETURN_IF_ERROR(r.Count(&nr, 9, "the reward count"));
      c.rewards.resize(nr);
      for (auto& reward : c.rewards) {
        uint8_t has = 0;
        double v = 0;
        RETURN_IF_ERROR(r.Pod(&has, "a reward"));
        RETURN_IF_ERROR(r.Pod(&v, "a reward"));
        if (has) reward = v;
      }
      RETURN_IF_ERROR(r.Str(&c.text, "text"));
    }
  }
  if (!r.done()) return Status::DataLoss("generation batch bytes: trailing bytes after the groups");
  return groups;
}

}  // namespace grpo::learner::distributed
