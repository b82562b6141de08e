#include "services/grpc_weight_receiver.h"

#include <cstring>
#include <exception>

#include "common/weight_sync/backends.h"
#include "common/weight_sync/group.h"
#include "services/auth.h"
#include "services/convert.h"
#include "services/grpc_store.h"

namespace grpo::services {

Status WeightAssembler::Add(const v1::WeightChunk& chunk) {
  const std::string& name = chunk.name();
  const auto bad = [&](const std::string& what) {
    return Status::DataLoss("weight chunk of tensor '" + name + "' (version " +
                            std::to_string(chunk.version()) + "): " + what);
  };
  if (last_seen_) return bad("arrived after the last chunk");
  if (version_ < 0) {
    version_ = chunk.version();
    incarnation_ = chunk.incarnation();
  } else if (chunk.version() != version_) {
    return bad("version changed mid-stream from " + std::to_string(version_));
  } else if (chunk.incarnation() != incarnation_) {
    return bad("learner incarnation changed mid-stream from '" + incarnation_ + "'");
  }
  if (name.empty()) {
    // A bare terminator is allowed: no data, just `last`.
    if (!chunk.data().empty()) return bad("data without a tensor name");
    last_seen_ = chunk.last();
    return Status::OK();
  }
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    auto dtype = common::ParseSafetensorsDtype(chunk.dtype());
    if (!dtype.ok()) return bad(dtype.status().message());
    std::vector<int64_t> shape(chunk.shape().begin(), chunk.shape().end());
    int64_t numel = 1;
    for (int64_t d : shape) {
      if (d < 0) return bad("negative dimension");
      numel *= d;
    }
    const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(*dtype));
    if (bytes != chunk.tensor_bytes()) {
      return bad("tensor_bytes " + std::to_string(chunk.tensor_bytes()) +
                 " != " + std::to_string(bytes) + " for its shape and dtype");
    }
    Partial p;
    try {
      p.tensor = at::empty(shape, at::TensorOptions().dtype(*dtype));
    } catch (const std::exception& e) {
      return Status::ResourceExhausted("allocating tensor '" + name + "': " + e.what());
    }
    it = tensors_.emplace(name, std::move(p)).first;
    order_.push_back(name);
  }
  Partial& p = it->second;
  const int64_t size = static_cast<int64_t>(p.tensor.nbytes());
  const int64_t n = static_cast<int64_t>(chunk.data().size());
  if (chunk.offset() < 0 || chunk.offset() > size || n > size - chunk.offset()) {
    return bad("bytes [" + std::to_string(chunk.offset()) + ", " +
               std::to_string(chunk.offset() + n) + ") outside the tensor's " +
               std::to_string(size) + " bytes");
  }
  if (p.received + n > size) return bad("more bytes than the tensor holds");
  if (n > 0) {
    std::memcpy(static_cast<char*>(p.tensor.data_ptr()) + chunk.offset(), chunk.data().data(),
                static_cast<size_t>(n));
  }
  p.received += n;
  bytes_received_ += n;
  last_seen_ = chunk.last();
  return Status::OK();
}

StatusOr<common::NamedTensors> WeightAssembler::Finish() {
  if (!last_seen_) {
    return Status::DataLoss("weight stream ended before its last chunk (" +
                            std::to_string(order_.size()) + " tensors started)");
  }
  common::NamedTensors out;
  out.reserve(order_.size());
  for (const auto& name : order_) {
    Partial& p = tensors_.at(name);
    if (p.received != static_cast<int64_t>(p.tensor.nbytes())) {
      return Status::DataLoss("tensor '" + name + "' incomplete: " + std::to_string(p.received) +
                              " of " + std::to_string(p.tensor.nbytes()) + " bytes");
    }
    out.emplace_back(name, p.tensor);
  }
  tensors_.clear();
  order_.clear();
  return out;
}

GrpcWeightReceiver::GrpcWeightReceiver(std::shared_ptr<grpc::Channel> channel,
                                       std::string auth_token, int64_t chunk_bytes)
    : stub_(v1::LearnerService::NewStub(std::move(channel))),
      auth_token_(std::move(auth_token)),
      chunk_bytes_(chunk_bytes) {}

void GrpcWeightReceiver::SetGroup(const rollout::GroupMembership& membership) {
  common::MutexLock lock(&mu_);
  registered_with_ = membership.learner_incarnation;
}

StatusOr<rollout::ReceivedVersion> GrpcWeightReceiver::Receive(int64_t min_version,
                                                               common::Model& model,
                                                               std::chrono::milliseconds timeout) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  AddAuth(context, auth_token_);
  v1::GetWeightsRequest request;
  request.set_min_version(min_version);
  request.set_chunk_bytes(chunk_bytes_);
  {
    common::MutexLock lock(&mu_);
    request.set_incarnation(registered_with_);
  }
  std::unique_ptr<grpc::ClientReader<v1::WeightChunk>> reader =
      stub_->GetWeights(&context, request);
  WeightAssembler assembler;
  v1::WeightChunk chunk;
  Status bad;
  while (reader->Read(&chunk)) {
    bad = assembler.Add(chunk);
    if (!bad.ok()) {
      context.TryCancel();
      break;
    }
  }
  const grpc::Status finished = reader->Finish();
  if (!bad.ok()) return bad;
  if (!finished.ok()) return FromGrpcStatus(finished).WithContext("GetWeights");
  ASSIGN_OR_RETURN(common::NamedTensors tensors, assembler.Finish());
  RETURN_IF_ERROR(model.LoadStateFrom(tensors).WithContext("weights of version " +
                                                           std::to_string(assembler.version())));
  last_bytes_ = assembler.bytes_received();
  return rollout::ReceivedVersion{assembler.version(), assembler.incarnation()};
}

StatusOr<std::unique_ptr<rollout::WeightReceiver>> MakeWeightReceiver(
    std::shared_ptr<grpc::Channel> channel, const std::string& auth_token,
    const std::string& backend, int64_t chunk_bytes, const WeightGroupOptions& group,
    const at::Device& device) {
  auto grpc_receiver = std::make_unique<GrpcWeightReceiver>(channel, auth_token, chunk_bytes);
  if (backend == common::kBackendGrpc)
    return std::unique_ptr<rollout::WeightReceiver>(std::move(grpc_receiver));
  if (!common::IsWeightSyncBackendName(backend)) {
    return Status::InvalidArgument("config key 'weight_sync_backend': unknown backend '" + backend +
                                   "' (grpc, gloo, nccl, cuda_ipc or auto)");
  }
  common::WeightSyncBackendOptions o;
  o.timeout = group.timeout;
  o.hostname = group.hostname;
  o.cuda_device = std::max(0, common::CudaOrdinal(device.str()));
  rollout::GroupWeightReceiverOptions r;
  r.requested_backend = backend;
  r.timeout = group.timeout;
  r.version_wait = group.version_wait;
  r.device = device;
  return std::unique_ptr<rollout::WeightReceiver>(std::make_unique<rollout::GroupWeightReceiver>(
      GrpcEpochStore::Connect(std::move(channel), auth_token, group.timeout),
      std::move(grpc_receiver), common::BuiltinWeightSyncFactory(o), r));
}

}  // namespace grpo::services
