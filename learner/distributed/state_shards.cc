#include "learner/distributed/state_shards.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <regex>

namespace grpo::learner::distributed {

namespace {

namespace fs = std::filesystem;

constexpr const char* kMoments[2] = {"exp_avg", "exp_avg_sq"};

std::string RunName(int which, const std::string& param, int64_t offset) {
  return std::string(kMoments[which]) + "." + param + "@" + std::to_string(offset);
}

// "<moment>.<param>@<offset>" -> (which, param, offset); false for any other name.
bool ParseRunName(const std::string& name, int* which, std::string* param, int64_t* offset) {
  const size_t at = name.rfind('@');
  if (at == std::string::npos) return false;
  const std::string head = name.substr(0, at);
  const std::string tail = name.substr(at + 1);
  const auto [p, ec] = std::from_chars(tail.data(), tail.data() + tail.size(), *offset);
  if (ec != std::errc() || p != tail.data() + tail.size() || *offset < 0) return false;
  for (int w : {0, 1}) {
    const std::string prefix = std::string(kMoments[w]) + ".";
    if (head.rfind(prefix, 0) == 0 && head.size() > prefix.size()) {
      *which = w;
      *param = head.substr(prefix.size());
      return true;
    }
  }
  return false;
}

int64_t MetadataInt(const common::SafetensorsFile& f, const std::string& key, bool* ok) {
  const auto it = f.metadata().find(key);
  int64_t v = 0;
  if (it == f.metadata().end()) {
    *ok = false;
    return 0;
  }
  const auto [p, ec] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), v);
  if (ec != std::errc() || p != it->second.data() + it->second.size()) *ok = false;
  return v;
}

}  // namespace

std::string StateShardFileName(int rank, int world_size) {
  char name[64];
  std::snprintf(name, sizeof(name), "optimizer-rank-%05d-of-%05d.safetensors", rank, world_size);
  return name;
}

Status WriteStateShard(StepOptimizer& optimizer, const std::string& path, int rank,
                       int world_size) {
  const std::vector<StepOptimizer::StatePiece> pieces = optimizer.StatePieces();
  // A run at a time through the CPU (a view there, one run's copy from a GPU or pinned host
  // memory), so the shard is never held twice.
  std::vector<common::SafetensorSpec> specs;
  for (int which : {0, 1}) {
    for (const StepOptimizer::StatePiece& piece : pieces) {
      specs.push_back({RunName(which, piece.param, piece.offset), at::kFloat, {piece.numel}});
    }
  }
  ASSIGN_OR_RETURN(
      std::unique_ptr<common::SafetensorsWriter> writer,
      common::SafetensorsWriter::CreateFile(path, specs,
                                            {{"rank", std::to_string(rank)},
                                             {"world_size", std::to_string(world_size)},
                                             {"step", std::to_string(optimizer.step_count())}}));
  size_t next = 0;
  for (int which : {0, 1}) {
    for (const StepOptimizer::StatePiece& piece : pieces) {
      at::Tensor run;
      try {
        at::NoGradGuard no_grad;
        run = piece.moments[which].to(at::kCPU, at::kFloat).contiguous();
      } catch (const c10::Error& e) {
        return Status::Internal("copying the AdamW shard of rank " + std::to_string(rank) + ": " +
                                e.what_without_backtrace());
      }
      RETURN_IF_ERROR(writer->Write(specs[next++].name, run));
    }
  }
  return writer->Finish();
}

StatusOr<std::unique_ptr<StateShards>> StateShards::Open(const std::string& dir) {
  static const std::regex kFile(R"(optimizer-rank-([0-9]{5})-of-([0-9]{5})\.safetensors)");
  std::map<int, std::pair<int, std::string>> found;  // rank -> (world size, path)
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string name = e.path().filename().string();
    if (!std::regex_match(name, m, kFile)) continue;
    found[std::stoi(m[1].str())] = {std::stoi(m[2].str()), e.path().string()};
  }
  if (ec) return Status::NotFound("cannot list " + dir + ": " + ec.message());
  if (found.empty()) return Status::NotFound(dir + ": no optimizer shard files");
  auto shards = std::unique_ptr<StateShards>(new StateShards());
  shards->world_size_ = found.begin()->second.first;
  if (shards->world_size_ <= 0) {
    return Status::DataLoss(found.begin()->second.second + ": world size 0 in its name");
  }
  for (int r = 0; r < shards->world_size_; ++r) {
    const auto it = found.find(r);
    if (it == found.end()) {
      return Status::DataLoss(dir + ": " + StateShardFileName(r, shards->world_size_) +
                              " is missing");
    }
    if (it->second.first != shards->world_size_) {
      return Status::DataLoss(dir + ": " + it->second.second + " is of another world size than " +
                              StateShardFileName(0, shards->world_size_));
    }
  }
  if (static_cast<int>(found.size()) != shards->world_size_) {
    return Status::DataLoss(dir + ": shard files of ranks beyond world size " +
                            std::to_string(shards->world_size_));
  }
  for (const auto& [rank, entry] : found) {
    ASSIGN_OR_RETURN(std::unique_ptr<common::SafetensorsFile> f,
                     common::SafetensorsFile::Open(entry.second));
    bool ok = true;
    const int64_t step = MetadataInt(*f, "step", &ok);
    if (!ok) return Status::DataLoss(entry.second + ": no step in its metadata");
    if (rank == 0) shards->step_ = step;
    if (step != shards->step_) {
      return Status::DataLoss(entry.second + ": step " + std::to_string(step) + ", rank 0's is " +
                              std::to_string(shards->step_));
    }
    for (const std::string& name : f->Names()) {
      int which = 0;
      std::string param;
      int64_t offset = 0;
      const common::SafetensorInfo* info = f->Find(name);
      if (!ParseRunName(name, &which, &param, &offset) || info->shape.size() != 1 ||
          info->dtype != at::kFloat) {
        return Status::DataLoss(entry.second + ": '" + name + "' is not a run of AdamW's moments");
      }
      if (which == 0) shards->runs_[param].push_back({offset, info->shape[0], f.get()});
    }
    shards->files_.push_back(std::move(f));
  }
  for (auto& [param, runs] : shards->runs_) {
    std::sort(runs.begin(), runs.end(),
              [](const Run& a, const Run& b) { return a.offset < b.offset; });
  }
  return shards;
}

Status StateShards::Read(const std::string& param, int which, int64_t offset,
                         at::Tensor out) const {
  const int64_t numel = out.numel();
  const auto it = runs_.find(param);
  int64_t covered = 0;
  if (it != runs_.end()) {
    at::NoGradGuard no_grad;
    for (const Run& run : it->second) {
      const int64_t lo = std::max(offset, run.offset);
      const int64_t hi = std::min(offset + numel, run.offset + run.numel);
      if (lo >= hi) continue;
      ASSIGN_OR_RETURN(const at::Tensor values, run.file->Get(RunName(which, param, run.offset)));
      if (values.numel() != run.numel) {
        return Status::DataLoss(run.file->path() + ": the " + kMoments[which] + " run of " + param +
                                " at " + std::to_string(run.offset) +
                                " differs in length from its exp_avg run");
      }
      out.narrow(0, lo - offset, hi - lo).copy_(values.narrow(0, lo - run.offset, hi - lo));
      covered += hi - lo;
    }
  }
  if (covered != numel) {  // runs never overlap: WriteStateShard writes each element once
    return Status::DataLoss("the optimizer shards hold " + std::to_string(covered) + " of the " +
                            std::to_string(numel) + " elements [" + std::to_string(offset) + ", " +
                            std::to_string(offset + numel) + ") of " + kMoments[which] + " of '" +
                            param + "'");
  }
  return Status::OK();
}

Status LoadStateShards(const StateShards& shards, StepOptimizer& optimizer) {
  const std::vector<StepOptimizer::StatePiece> pieces = optimizer.StatePieces();
  for (int which : {0, 1}) {
    for (const StepOptimizer::StatePiece& piece : pieces) {
      RETURN_IF_ERROR(shards.Read(piece.param, which, piece.offset, piece.moments[which]));
    }
  }
  optimizer.SetStepCount(shards.step());
  return Status::OK();
}

StatusOr<common::NamedTensors> WholeStateFromShards(const StateShards& shards,
                                                    const common::NamedTensors& params) {
  std::vector<at::Tensor> avg, sq;
  for (const auto& [name, p] : params) {
    for (auto [out, which] : {std::pair{&avg, 0}, std::pair{&sq, 1}}) {
      at::Tensor whole = at::empty({p.numel()}, at::TensorOptions().dtype(at::kFloat));
      RETURN_IF_ERROR(shards.Read(name, which, 0, whole));
      out->push_back(whole.view(p.sizes()));
    }
  }
  return NameAdamWState(params, avg, sq, shards.step());
}

Status HandOutStateShards(StepOptimizer& optimizer, Collectives& ranks, const std::string& what) {
  if (ranks.world_size() == 1) return Status::OK();
  std::string path = ranks.rank() == 0 ? optimizer.pending_state_shards : std::string();
  RETURN_IF_ERROR(BroadcastString(ranks, &path, what + " (its directory)"));
  if (path.empty()) return Status::OK();
  Status mine = [&]() -> Status {
    ASSIGN_OR_RETURN(std::unique_ptr<StateShards> shards, StateShards::Open(path));
    return LoadStateShards(*shards, optimizer);
  }();
  if (!mine.ok()) {
    mine = Status::DataLoss("learner rank " + std::to_string(ranks.rank()) +
                            " cannot read its AdamW shard: " + mine.ToString());
  }
  // Every rank learns whether any rank failed, so that none goes on with a half-restored state.
  std::vector<at::Tensor> failed = {at::tensor(std::vector<double>{mine.ok() ? 0.0 : 1.0})};
  RETURN_IF_ERROR(ranks.AllReduceSum(failed, what + " (its outcome)"));
  optimizer.pending_state_shards.clear();
  if (!mine.ok()) return mine;
  const double n = failed[0].item<double>();
  if (n > 0) {
    return Status::DataLoss(std::to_string(static_cast<int>(n)) +
                            " learner rank(s) could not read their AdamW shard from " + path);
  }
  return Status::OK();
}

namespace {

// This rank's runs by parameter, and the device their buffers are made on (every rank's runs
// are on the same kind of device, so the collectives of a parameter match).
struct PiecesByParam {
  std::vector<StepOptimizer::StatePiece> pieces;
  std::map<std::string, std::vector<const StepOptimizer::StatePiece*>> of;
  at::Device device = at::kCPU;
};

PiecesByParam MapPieces(StepOptimizer& optimizer) {
  PiecesByParam m;
  m.pieces = optimizer.StatePieces();
  for (const auto& piece : m.pieces) m.of[piece.param].push_back(&piece);
  if (!m.pieces.empty()) m.device = m.pieces.front().moments[0].device();
  return m;
}

}  // namespace

Status WriteStateThroughRankZero(StepOptimizer& optimizer, const common::NamedTensors& params,
                                 Collectives& ranks, const std::string& path,
                                 const std::string& what) {
  at::NoGradGuard no_grad;
  const PiecesByParam mine = MapPieces(optimizer);
  std::unique_ptr<common::SafetensorsWriter> writer;
  Status written = Status::OK();  // rank 0's first failure to write; the collectives go on
  if (ranks.rank() == 0) {
    std::vector<common::SafetensorSpec> specs;
    for (const auto& [name, p] : params) {
      for (const char* moment : kMoments) {
        specs.push_back({std::string(moment) + "." + name, at::kFloat, p.sizes().vec()});
      }
    }
    specs.push_back({"step", at::kLong, {}});
    auto created = common::SafetensorsWriter::CreateFile(path, specs);
    if (created.ok()) {
      writer = std::move(created).value();
    } else {
      written = created.status();
    }
  }
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(mine.device);
  for (const auto& [name, p] : params) {
    const auto runs = mine.of.find(name);
    for (int which : {0, 1}) {
      std::vector<at::Tensor> whole = {at::zeros({p.numel()}, opts)};
      if (runs != mine.of.end()) {
        for (const StepOptimizer::StatePiece* piece : runs->second) {
          whole[0].narrow(0, piece->offset, piece->numel).copy_(piece->moments[which]);
        }
      }
      RETURN_IF_ERROR(ranks.AllReduceSum(
          whole, what + " (" + kMoments[which] + " of '" + name + "', through rank 0)"));
      if (writer != nullptr && written.ok()) {
        written = writer->Write(std::string(kMoments[which]) + "." + name,
                                whole[0].view(p.sizes()).to(at::kCPU));
      }
    }
  }
  if (writer != nullptr && written.ok()) {
    written = writer->Write("step", at::scalar_tensor(optimizer.step_count(), at::kLong));
  }
  if (writer != nullptr && written.ok()) written = writer->Finish();
  return written;
}

Status HandOutStateFile(StepOptimizer& optimizer, const common::NamedTensors& params,
                        Collectives& ranks, const std::string& what) {
  if (ranks.world_size() == 1) return Status::OK();
  const bool root = ranks.rank() == 0;
  std::string path = root ? optimizer.pending_state_file : std::string();
  optimizer.pending_state_file.clear();
  RETURN_IF_ERROR(BroadcastString(ranks, &path, what + " (its file)"));
  if (path.empty()) return Status::OK();
  // Rank 0 checks the whole file before any rank changes its state, and says so.
  std::unique_ptr<common::SafetensorsFile> file;
  int64_t step = 0;
  Status checked = Status::OK();
  if (root) {
    checked = [&]() -> Status {
      ASSIGN_OR_RETURN(file, common::SafetensorsFile::Open(path));
      for (const auto& [name, p] : params) {
        for (const char* moment : kMoments) {
          const std::string key = std::string(moment) + "." + name;
          const common::SafetensorInfo* info = file->Find(key);
          if (info == nullptr || info->shape != p.sizes().vec()) {
            return Status::DataLoss(path + ": no tensor '" + key + "' of the parameter's shape");
          }
        }
      }
      ASSIGN_OR_RETURN(at::Tensor s, file->Get("step"));
      step = s.item<int64_t>();
      return Status::OK();
    }();
  }
  std::vector<at::Tensor> head = {
      at::tensor(std::vector<int64_t>{checked.ok() ? 1 : 0, step}, at::kLong)};
  RETURN_IF_ERROR(ranks.Broadcast(head, what + " (its step)"));
  if (head[0][0].item<int64_t>() == 0) {
    return root ? Status::DataLoss("cannot hand out the AdamW state: " + checked.ToString())
                : Status::DataLoss("rank 0 cannot read the AdamW state of " + path);
  }
  at::NoGradGuard no_grad;
  const PiecesByParam mine = MapPieces(optimizer);
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(mine.device);
  Status read = Status::OK();  // rank 0's; the broadcasts go on
  for (const auto& [name, p] : params) {
    const auto runs = mine.of.find(name);
    for (int which : {0, 1}) {
      std::vector<at::Tensor> whole = {at::zeros({p.numel()}, opts)};
      if (root && read.ok()) {
        auto t = file->Get(std::string(kMoments[which]) + "." + name);
        if (t.ok()) {
          whole[0].copy_(t->reshape({-1}));
        } else {
          read = t.status();
        }
      }
      RETURN_IF_ERROR(
          ranks.Broadcast(whole, what + " (" + kMoments[which] + " of '" + name + "')"));
      if (runs == mine.of.end()) continue;
      for (const StepOptimizer::StatePiece* piece : runs->second) {
        piece->moments[which].copy_(whole[0].narrow(0, piece->offset, piece->numel));
      }
    }
  }
  optimizer.SetStepCount(head[0][1].item<int64_t>());
  std::vector<at::Tensor> failed = {at::tensor(std::vector<double>{read.ok() ? 0.0 : 1.0})};
  RETURN_IF_ERROR(ranks.AllReduceSum(failed, what + " (its outcome)"));
  if (!read.ok()) return Status::DataLoss(path + ": " + read.ToString());
  if (failed[0].item<double>() > 0) {
    return Status::DataLoss("rank 0 could not read the AdamW state of " + path);
  }
  return Status::OK();
}

}  // namespace grpo::learner::distributed
