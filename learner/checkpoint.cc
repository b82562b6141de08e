#include "learner/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <sstream>

#include "common/atomic_file.h"
#include "common/logging.h"
#include "common/model/safetensors.h"
#include "common/sha256.h"
#include "learner/distributed/state_shards.h"

namespace grpo::learner {
namespace fs = std::filesystem;
namespace {

constexpr const char* kSums = "SHA256SUMS";
constexpr const char* kTokenizerFiles[] = {
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt",     "generation_config.json"};

Status FsyncPath(const fs::path& p, bool directory) {
  int fd = ::open(p.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) return Status::Internal("cannot open " + p.string() + " to fsync");
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return Status::Internal("fsync failed on " + p.string());
  return Status::OK();
}

Status WriteFileAtomic(const fs::path& path, const std::string& content) {
  return common::WriteFileAtomically(path.string(), content, common::Durability::kFsync);
}

std::string Hex(const at::Tensor& bytes) {
  static const char* kHex = "0123456789abcdef";
  at::Tensor b = bytes.contiguous();
  const uint8_t* p = b.data_ptr<uint8_t>();
  std::string out;
  for (int64_t i = 0; i < b.numel(); ++i) {
    out += kHex[p[i] >> 4];
    out += kHex[p[i] & 0xf];
  }
  return out;
}

StatusOr<at::Tensor> Unhex(const std::string& s) {
  if (s.size() % 2 != 0) return Status::InvalidArgument("odd-length hex string");
  at::Tensor t = at::empty({static_cast<int64_t>(s.size() / 2)}, at::kByte);
  uint8_t* p = t.data_ptr<uint8_t>();
  auto val = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < s.size(); i += 2) {
    const int hi = val(s[i]), lo = val(s[i + 1]);
    if (hi < 0 || lo < 0) return Status::InvalidArgument("bad hex digit");
    p[i / 2] = static_cast<uint8_t>(hi * 16 + lo);
  }
  return t;
}

int64_t StepOf(const fs::path& dir) {
  const std::string name = dir.filename().string();
  const std::string prefix = "checkpoint-";
  if (name.rfind(prefix, 0) != 0) return -1;
  try {
    size_t used = 0;
    const int64_t step = std::stoll(name.substr(prefix.size()), &used);
    return used == name.size() - prefix.size() ? step : -1;
  } catch (...) {
    return -1;
  }
}

}  // namespace

std::function<bool(int rank)> TEST_state_shard_probe;

namespace {

// Where the AdamW state of a checkpoint goes.
enum class StateLayout {
  kWhole,      // optimizer.safetensors, written by rank 0 (a parameter at a time when sharded)
  kShards,     // optimizer-rank-<r>-of-<N>.safetensors, each rank's own (state_shards.h)
  kAbandoned,  // the checkpoint failed before its state was written: no more collectives
};

bool StateIsSharded(GrpoTrainer& trainer) {
  return trainer.world_size() > 1 && !trainer.optimizer().StatePieces().empty();
}

// A sharded state at several ranks, called by every rank at the same point of SaveCheckpoint
// and JoinSaveCheckpoint (collectives): each rank writes its own shard into `tmp_dir`, which
// rank 0 prepared (`prepared` says whether it could). First every rank checks that it sees
// rank 0's directory (a probe file holding a number rank 0 broadcasts): ranks on other machines
// without a shared output_dir do not, and then the state is gathered through rank 0 as before
// (kWhole). A rank that cannot write its shard fails the checkpoint on rank 0 (kAbandoned
// elsewhere: the job goes on and the next checkpoint tries again).
StatusOr<StateLayout> SaveStateShards(GrpoTrainer& trainer, const fs::path& tmp_dir,
                                      const Status& prepared) {
  distributed::Collectives& ranks = trainer.ranks();
  const bool root = ranks.rank() == 0;
  const std::string name = tmp_dir.stem().string();
  const fs::path probe = tmp_dir / ".shard-probe";
  Status root_status = prepared;
  int64_t nonce = 0;
  if (root && root_status.ok()) {
    nonce = static_cast<int64_t>(std::random_device{}() | 1u) << 20 | trainer.global_step();
    root_status = WriteFileAtomic(probe, std::to_string(nonce));
    if (!root_status.ok()) nonce = 0;
  }
  std::vector<at::Tensor> head = {at::tensor(std::vector<int64_t>{nonce}, at::kLong)};
  RETURN_IF_ERROR(ranks.Broadcast(head, "broadcast of the shard probe of " + name));
  nonce = head[0].item<int64_t>();
  if (nonce == 0) {
    if (root) return root_status;
    return StateLayout::kAbandoned;
  }
  bool sees = root;
  if (!root) {
    std::ifstream in(probe);
    std::string text;
    sees = static_cast<bool>(std::getline(in, text)) && text == std::to_string(nonce);
  }
  if (TEST_state_shard_probe) sees = TEST_state_shard_probe(ranks.rank());
  std::vector<at::Tensor> blind = {at::tensor(std::vector<double>{sees ? 0.0 : 1.0})};
  RETURN_IF_ERROR(ranks.AllReduceSum(blind, "all-reduce of the shard probe of " + name));
  if (root) {
    std::error_code ec;
    fs::remove(probe, ec);
  }
  const int not_shared = static_cast<int>(blind[0].item<double>());
  if (not_shared > 0) {
    if (root) {
      GRPO_LOG_WARN(
          "checkpoint: {} of {} learner ranks do not see {} (output_dir is not shared): the AdamW "
          "state goes through rank 0, a parameter at a time",
          not_shared, ranks.world_size(), tmp_dir.string());
    }
    return StateLayout::kWhole;
  }
  const fs::path path = tmp_dir / distributed::StateShardFileName(ranks.rank(), ranks.world_size());
  const Status wrote = distributed::WriteStateShard(trainer.optimizer(), path.string(),
                                                    ranks.rank(), ranks.world_size());
  if (!wrote.ok()) {
    GRPO_LOG_ERROR("checkpoint: learner rank {}: {}", ranks.rank(), wrote.ToString());
  }
  std::vector<at::Tensor> failed = {at::tensor(std::vector<double>{wrote.ok() ? 0.0 : 1.0})};
  RETURN_IF_ERROR(ranks.AllReduceSum(failed, "all-reduce of the shard writes of " + name));
  const int failures = static_cast<int>(failed[0].item<double>());
  if (failures > 0) {
    if (!root) return StateLayout::kAbandoned;
    return wrote.ok() ? Status::Internal(std::to_string(failures) +
                                         " learner rank(s) could not write their AdamW shard of " +
                                         name + " (their logs say why)")
                      : wrote;
  }
  return StateLayout::kShards;
}

}  // namespace

Status JoinSaveCheckpoint(GrpoTrainer& trainer, const std::string& output_dir) {
  const std::string name = "checkpoint-" + std::to_string(trainer.global_step());
  StateLayout layout = StateLayout::kWhole;
  if (StateIsSharded(trainer)) {
    const fs::path tmp_dir = fs::path(output_dir) / (name + ".tmp");
    ASSIGN_OR_RETURN(layout, SaveStateShards(trainer, tmp_dir, Status::OK()));
    // Abandoned: rank 0's checkpoint failed, and the job goes on without it.
    if (layout == StateLayout::kAbandoned) return Status::OK();
  }
  if (layout == StateLayout::kWhole) {
    // Sharded (ranks that do not share output_dir): rank 0 writes it a parameter at a time.
    RETURN_IF_ERROR(
        StateIsSharded(trainer)
            ? distributed::WriteStateThroughRankZero(
                  trainer.optimizer(), trainer.policy().NamedParameters(), trainer.ranks(), "",
                  "gather of the AdamW state for " + name)
            : trainer.optimizer().StateDict("gather of the AdamW state for " + name).status());
  }
  if (!trainer.optimizer().ShardsParameters()) return Status::OK();
  return trainer.optimizer().StreamWeights(
      "gather of the weights for " + name, /*every_rank=*/false,
      [](const std::string&, const at::Tensor&) { return Status::OK(); });
}

StatusOr<std::string> SaveCheckpoint(GrpoTrainer& trainer, const std::string& output_dir,
                                     const std::string& tokenizer_dir) {
  const fs::path out(output_dir);
  const std::string name = "checkpoint-" + std::to_string(trainer.global_step());
  const fs::path final_dir = out / name;
  const fs::path tmp_dir = out / (name + ".tmp");
  std::error_code ec;
  fs::create_directories(out, ec);
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  const Status prepared =
      ec ? Status::Internal("cannot create " + tmp_dir.string() + ": " + ec.message())
         : Status::OK();
  // The collectives that every rank joins (RankCommand::kCheckpoint, JoinSaveCheckpoint) come
  // before anything here can fail otherwise. A sharded state: each rank's shard, written by
  // the rank itself, or (ranks that do not share output_dir) gathered here.
  StateLayout layout = StateLayout::kWhole;
  if (StateIsSharded(trainer)) {
    ASSIGN_OR_RETURN(layout, SaveStateShards(trainer, tmp_dir, prepared));
  } else {
    RETURN_IF_ERROR(prepared);
  }
  // A sharded state through rank 0 (ranks that do not share output_dir) is written a parameter
  // at a time; its write's error waits until the weights' collectives, which every rank makes,
  // are done. Otherwise the state is whole here (one rank, no_shard).
  common::NamedTensors whole_state;
  Status state_written = Status::OK();
  const bool whole_here = layout == StateLayout::kWhole && !StateIsSharded(trainer);
  if (layout == StateLayout::kWhole && !whole_here) {
    state_written = distributed::WriteStateThroughRankZero(
        trainer.optimizer(), trainer.policy().NamedParameters(), trainer.ranks(),
        (tmp_dir / "optimizer.safetensors").string(), "gather of the AdamW state for " + name);
  } else if (whole_here) {
    ASSIGN_OR_RETURN(whole_state,
                     trainer.optimizer().StateDict("gather of the AdamW state for " + name));
  }
  // Sharded parameters: the weights too, each unit (or bucket) written as it is gathered
  // (JoinSaveCheckpoint on the other ranks), so rank 0 never holds them whole.
  // The state's error first: when it was a collective's, the weights' say only "failed earlier".
  const Status weights_written =
      trainer.optimizer().ShardsParameters()
          ? trainer.policy().SaveWeightsFrom(tmp_dir.string(),
                                             [&](const common::Model::WeightPut& put) {
                                               return trainer.optimizer().StreamWeights(
                                                   "gather of the weights for " + name,
                                                   /*every_rank=*/false, put);
                                             })
          : trainer.policy().Save(tmp_dir.string());
  RETURN_IF_ERROR(state_written);
  RETURN_IF_ERROR(weights_written);
  if (whole_here) {
    common::NamedTensors optimizer_state;  // on the CPU whatever the trainer's device
    try {
      for (const auto& [name, t] : whole_state) {
        optimizer_state.emplace_back(name, t.to(at::kCPU));
      }
    } catch (const c10::Error& e) {
      return Status::Internal("copying the optimizer state: " +
                              std::string(e.what_without_backtrace()));
    }
    RETURN_IF_ERROR(
        common::WriteSafetensors((tmp_dir / "optimizer.safetensors").string(), optimizer_state));
  }
  nlohmann::json state;
  state["global_step"] = trainer.global_step();
  state["policy_version"] = trainer.policy_version();
  state["lr_scheduler_type"] = trainer.config().lr_scheduler_type;
  state["learning_rate"] = trainer.config().learning_rate;
  state["max_steps"] = trainer.config().max_steps;
  // The adaptive entropy controller (TRL keeps it beside its checkpoint too); +inf (no step yet)
  // is null in JSON.
  state["entropy_coef"] = trainer.entropy_control().coef();
  const double last_entropy = trainer.entropy_control().last_entropy();
  state["last_world_entropy"] =
      std::isfinite(last_entropy) ? nlohmann::json(last_entropy) : nlohmann::json(nullptr);
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    state["cpu_rng_state"] = Hex(gen.get_state());
  }
  state["config"] = trainer.config().ToJson();
  RETURN_IF_ERROR(WriteFileAtomic(tmp_dir / "trainer_state.json", state.dump(2)));
  if (!tokenizer_dir.empty()) {
    for (const char* f : kTokenizerFiles) {
      const fs::path src = fs::path(tokenizer_dir) / f;
      if (fs::exists(src)) {
        fs::copy_file(src, tmp_dir / f, fs::copy_options::overwrite_existing, ec);
        if (ec) return Status::Internal("cannot copy " + src.string() + ": " + ec.message());
      }
    }
  }
  // Checksums over every file, then fsync everything before the rename makes it visible.
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(tmp_dir)) {
    if (e.is_regular_file()) files.push_back(e.path().filename().string());
  }
  std::sort(files.begin(), files.end());
  std::string sums;
  for (const auto& f : files) {
    ASSIGN_OR_RETURN(std::string digest, common::Sha256File((tmp_dir / f).string()));
    sums += digest + "  " + f + "\n";
    RETURN_IF_ERROR(FsyncPath(tmp_dir / f, false));
  }
  RETURN_IF_ERROR(WriteFileAtomic(tmp_dir / kSums, sums));
  RETURN_IF_ERROR(FsyncPath(tmp_dir, true));
  fs::remove_all(final_dir, ec);
  fs::rename(tmp_dir, final_dir, ec);
  if (ec) return Status::Internal("cannot rename " + tmp_dir.string() + ": " + ec.message());
  RETURN_IF_ERROR(FsyncPath(out, true));
  RETURN_IF_ERROR(WriteFileAtomic(out / kLatestFile, name + "\n"));
  return final_dir.string();
}

Status VerifyCheckpoint(const std::string& dir) {
  const fs::path sums_path = fs::path(dir) / kSums;
  std::ifstream in(sums_path);
  if (!in) return Status::NotFound(dir + ": no " + kSums + " (partial checkpoint)");
  std::string line;
  int64_t checked = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    if (line.size() < 67 || line.substr(64, 2) != "  ") {
      return Status::DataLoss(sums_path.string() + ": malformed line '" + line + "'");
    }
    const std::string want = line.substr(0, 64), file = line.substr(66);
    auto got = common::Sha256File((fs::path(dir) / file).string());
    if (!got.ok()) return Status::DataLoss(dir + ": missing file " + file);
    if (*got != want) return Status::DataLoss(dir + ": checksum mismatch for " + file);
    ++checked;
  }
  if (checked == 0) return Status::DataLoss(sums_path.string() + ": empty");
  return Status::OK();
}

std::vector<std::string> ListCheckpoints(const std::string& output_dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(output_dir, ec)) {
    if (!e.is_directory()) continue;
    const int64_t step = StepOf(e.path());
    if (step >= 0) found.emplace_back(step, e.path().string());
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a > b; });
  std::vector<std::string> out;
  for (auto& [s, d] : found) out.push_back(d);
  return out;
}

std::vector<std::string> PruneCheckpoints(const std::string& output_dir, int64_t keep) {
  std::vector<std::string> removed;
  if (keep <= 0) return removed;
  std::string latest_name;
  {
    std::ifstream latest(fs::path(output_dir) / kLatestFile);
    if (latest) std::getline(latest, latest_name);
  }
  int64_t kept = 0;
  for (const std::string& dir : ListCheckpoints(output_dir)) {
    const bool is_latest = !latest_name.empty() && fs::path(dir).filename() == latest_name;
    if (kept < keep || is_latest) {
      ++kept;
      continue;
    }
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (ec) {
      GRPO_LOG_WARN("cannot remove old checkpoint {}: {}", dir, ec.message());
    } else {
      removed.push_back(dir);
    }
  }
  return removed;
}

Status RestoreCheckpoint(GrpoTrainer& trainer, const std::string& dir) {
  RETURN_IF_ERROR(VerifyCheckpoint(dir));
  // Tied models store no lm_head.weight; LoadStateFrom wants exactly the live names.
  common::NamedTensors live = trainer.policy().NamedParameters();
  common::NamedTensors ordered;
  // Sharded parameters (full_shard, shard_grad_op's sharded master): the files are checked here
  // and read a unit or bucket at a time (this rank now, the others in SyncFromRankZero); never
  // whole in fp32 on rank 0.
  std::shared_ptr<const common::ModelWeights> files;
  if (trainer.optimizer().ShardsParameters()) {
    auto opened = common::ModelWeights::Open(dir, trainer.policy().ParameterShapes(),
                                             "a checkpoint of this model");
    if (!opened.ok()) return Status::DataLoss(dir + ": " + opened.status().ToString());
    files = std::move(opened).value();
  } else {
    ASSIGN_OR_RETURN(auto weights, common::SafetensorsCheckpoint::Open(dir));
    common::NamedTensors state;
    for (const auto& name : weights->Names()) {
      ASSIGN_OR_RETURN(at::Tensor t, weights->Get(name));
      state.emplace_back(name, t);
    }
    for (const auto& [name, p] : live) {
      auto it = std::find_if(state.begin(), state.end(),
                             [&](const auto& kv) { return kv.first == name; });
      if (it == state.end()) return Status::DataLoss(dir + ": model.safetensors lacks " + name);
      ordered.emplace_back(name, it->second);
    }
  }
  // The AdamW state: whole (optimizer.safetensors), or per-rank shards of any world size. An
  // optimizer that holds it whole assembles it; a sharded one (several ranks) reads only its
  // own runs, on every rank, when SyncFromRankZero hands the directory out, or takes them from
  // rank 0 a parameter at a time when the state is in one file.
  common::NamedTensors opt_state;
  bool shards_pending = false, file_pending = false;
  if (fs::exists(fs::path(dir) / "optimizer.safetensors") && StateIsSharded(trainer)) {
    file_pending = true;
  } else if (fs::exists(fs::path(dir) / "optimizer.safetensors")) {
    ASSIGN_OR_RETURN(auto opt_file, common::SafetensorsFile::Open(
                                        (fs::path(dir) / "optimizer.safetensors").string()));
    for (const auto& name : opt_file->Names()) {
      ASSIGN_OR_RETURN(at::Tensor t, opt_file->Get(name));
      opt_state.emplace_back(name, t);
    }
  } else {
    ASSIGN_OR_RETURN(auto shards, distributed::StateShards::Open(dir));
    if (StateIsSharded(trainer)) {
      shards_pending = true;
    } else {
      ASSIGN_OR_RETURN(opt_state, distributed::WholeStateFromShards(
                                      *shards, trainer.policy().NamedParameters()));
    }
  }
  std::ifstream in(fs::path(dir) / "trainer_state.json");
  nlohmann::json ts;
  try {
    ts = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    return Status::DataLoss(dir + "/trainer_state.json: " + e.what());
  }
  if (!ts.contains("global_step") || !ts.contains("policy_version") ||
      !ts.contains("cpu_rng_state")) {
    return Status::DataLoss(dir + "/trainer_state.json: missing fields");
  }
  ASSIGN_OR_RETURN(at::Tensor rng, Unhex(ts["cpu_rng_state"].get<std::string>()));
  // Everything read and checked; now change state.
  if (files != nullptr) {
    ASSIGN_OR_RETURN(std::string fingerprint, common::Sha256File((fs::path(dir) / kSums).string()));
    RETURN_IF_ERROR(trainer.optimizer()
                        .LoadWeightsFrom({std::move(files), kSums, std::move(fingerprint)})
                        .WithContext(dir));
  } else {
    RETURN_IF_ERROR(trainer.policy().LoadStateFrom(ordered).WithContext(dir));
  }
  if (shards_pending) {
    trainer.optimizer().pending_state_shards = dir;
  } else if (file_pending) {
    trainer.optimizer().pending_state_file = (fs::path(dir) / "optimizer.safetensors").string();
  } else {
    RETURN_IF_ERROR(trainer.optimizer().LoadStateDict(opt_state).WithContext(dir));
  }
  trainer.RestoreCounters(ts["global_step"].get<int64_t>(), ts["policy_version"].get<int64_t>());
  if (ts.contains("entropy_coef") && ts["entropy_coef"].is_number()) {  // older: the config's
    const auto& last = ts.value("last_world_entropy", nlohmann::json(nullptr));
    trainer.RestoreEntropyControl(
        ts["entropy_coef"].get<double>(),
        last.is_number() ? last.get<double>() : std::numeric_limits<double>::infinity());
  }
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  try {
    gen.set_state(rng);
  } catch (const c10::Error& e) {
    return Status::DataLoss(dir + ": bad RNG state: " + e.what_without_backtrace());
  }
  return Status::OK();
}

StatusOr<std::string> RestoreLatestCheckpoint(GrpoTrainer& trainer, const std::string& output_dir) {
  std::vector<std::string> candidates;
  std::ifstream latest(fs::path(output_dir) / kLatestFile);
  std::string name;
  if (latest && std::getline(latest, name) && !name.empty()) {
    candidates.push_back((fs::path(output_dir) / name).string());
  }
  for (auto& d : ListCheckpoints(output_dir)) {
    if (std::find(candidates.begin(), candidates.end(), d) == candidates.end()) {
      candidates.push_back(d);
    }
  }
  for (const auto& dir : candidates) {
    Status s = RestoreCheckpoint(trainer, dir);
    if (s.ok()) return dir;
    GRPO_LOG_WARN("skipping checkpoint {}: {}", dir, s.ToString());
  }
  return Status::NotFound("no valid checkpoint under " + output_dir);
}

}  // namespace grpo::learner
