#include "services/grpc_store.h"

#include <algorithm>
#include <utility>

#include "services/auth.h"
#include "services/convert.h"

namespace grpo::services {

GrpcEpochStore::GrpcEpochStore(StoreCall call, std::chrono::milliseconds timeout)
    : call_(std::move(call)), timeout_(timeout) {}

std::shared_ptr<GrpcEpochStore> GrpcEpochStore::Connect(std::shared_ptr<grpc::Channel> channel,
                                                        std::string auth_token,
                                                        std::chrono::milliseconds timeout) {
  std::shared_ptr<v1::LearnerService::Stub> stub = v1::LearnerService::NewStub(std::move(channel));
  StoreCall call = [stub, token = std::move(auth_token)](const v1::StoreRequest& request,
                                                         v1::StoreResponse* response,
                                                         std::chrono::milliseconds deadline) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + deadline);
    AddAuth(context, token);
    return FromGrpcStatus(stub->Store(&context, request, response));
  };
  return std::make_shared<GrpcEpochStore>(std::move(call), timeout);
}

StatusOr<v1::StoreResponse> GrpcEpochStore::Call(int64_t epoch, v1::StoreRequest request,
                                                 std::chrono::milliseconds deadline) {
  request.set_group_epoch(epoch);
  v1::StoreResponse response;
  RETURN_IF_ERROR(call_(request, &response, deadline)
                      .WithContext("Store " + v1::StoreRequest::Op_Name(request.op()) + " '" +
                                   request.key() + "' (epoch " + std::to_string(epoch) + ")"));
  return response;
}

StatusOr<std::string> GrpcEpochStore::Get(int64_t epoch, const std::string& key,
                                          std::chrono::milliseconds timeout) {
  v1::StoreRequest request;
  request.set_op(v1::StoreRequest::GET);
  request.set_key(key);
  request.set_timeout_ms(std::max<int64_t>(1, timeout.count()));
  ASSIGN_OR_RETURN(v1::StoreResponse response,
                   Call(epoch, std::move(request), timeout + kStoreRpcSlack));
  return response.value();
}

Status GrpcEpochStore::Set(int64_t epoch, const std::string& key, const std::string& value) {
  v1::StoreRequest request;
  request.set_op(v1::StoreRequest::SET);
  request.set_key(key);
  request.set_value(value);
  return Call(epoch, std::move(request), timeout_).status();
}

StatusOr<int64_t> GrpcEpochStore::Add(int64_t epoch, const std::string& key, int64_t delta) {
  v1::StoreRequest request;
  request.set_op(v1::StoreRequest::ADD);
  request.set_key(key);
  request.set_add(delta);
  ASSIGN_OR_RETURN(v1::StoreResponse response, Call(epoch, std::move(request), timeout_));
  return response.number();
}

StatusOr<bool> GrpcEpochStore::Check(int64_t epoch, const std::vector<std::string>& keys) {
  v1::StoreRequest request;
  request.set_op(v1::StoreRequest::CHECK);
  for (const auto& k : keys) request.add_keys(k);
  ASSIGN_OR_RETURN(v1::StoreResponse response, Call(epoch, std::move(request), timeout_));
  return response.ok();
}

StatusOr<bool> GrpcEpochStore::Delete(int64_t epoch, const std::string& key) {
  v1::StoreRequest request;
  request.set_op(v1::StoreRequest::DELETE);
  request.set_key(key);
  ASSIGN_OR_RETURN(v1::StoreResponse response, Call(epoch, std::move(request), timeout_));
  return response.ok();
}

StatusOr<int64_t> GrpcEpochStore::NumKeys(int64_t epoch) {
  v1::StoreRequest request;
  request.set_op(v1::StoreRequest::NUM_KEYS);
  ASSIGN_OR_RETURN(v1::StoreResponse response, Call(epoch, std::move(request), timeout_));
  return response.number();
}

StatusOr<std::string> GrpcEpochStore::CompareSet(int64_t epoch, const std::string& key,
                                                 const std::string& expected,
                                                 const std::string& desired, bool* swapped) {
  v1::StoreRequest request;
  request.set_op(v1::StoreRequest::COMPARE_SET);
  request.set_key(key);
  request.set_expected(expected);
  request.set_value(desired);
  ASSIGN_OR_RETURN(v1::StoreResponse response, Call(epoch, std::move(request), timeout_));
  if (swapped != nullptr) *swapped = response.ok();
  return response.value();
}

Status ServeStoreRequest(common::InMemoryEpochStore& store, const v1::StoreRequest& request,
                         v1::StoreResponse* response, const common::CancelToken* cancel) {
  const int64_t epoch = request.group_epoch();
  const std::string& key = request.key();
  switch (request.op()) {
    case v1::StoreRequest::SET:
      RETURN_IF_ERROR(store.Set(epoch, key, request.value()));
      response->set_ok(true);
      return Status::OK();
    case v1::StoreRequest::GET: {
      const auto timeout = request.timeout_ms() > 0
                               ? std::chrono::milliseconds(request.timeout_ms())
                               : common::kDefaultEpochStoreTimeout;
      ASSIGN_OR_RETURN(std::string value, store.GetUnlessCancelled(epoch, key, timeout, cancel));
      response->set_value(std::move(value));
      response->set_ok(true);
      return Status::OK();
    }
    case v1::StoreRequest::ADD: {
      ASSIGN_OR_RETURN(int64_t value, store.Add(epoch, key, request.add()));
      response->set_number(value);
      response->set_value(std::to_string(value));
      response->set_ok(true);
      return Status::OK();
    }
    case v1::StoreRequest::CHECK: {
      std::vector<std::string> keys(request.keys().begin(), request.keys().end());
      if (!key.empty()) keys.push_back(key);
      ASSIGN_OR_RETURN(bool all, store.Check(epoch, keys));
      response->set_ok(all);
      return Status::OK();
    }
    case v1::StoreRequest::DELETE: {
      ASSIGN_OR_RETURN(bool existed, store.Delete(epoch, key));
      response->set_ok(existed);
      return Status::OK();
    }
    case v1::StoreRequest::NUM_KEYS: {
      ASSIGN_OR_RETURN(int64_t n, store.NumKeys(epoch));
      response->set_number(n);
      response->set_ok(true);
      return Status::OK();
    }
    case v1::StoreRequest::COMPARE_SET: {
      bool swapped = false;
      ASSIGN_OR_RETURN(std::string now,
                       store.CompareSet(epoch, key, request.expected(), request.value(), &swapped));
      response->set_value(std::move(now));
      response->set_ok(swapped);
      return Status::OK();
    }
    default:
      return Status::InvalidArgument("Store: unknown op");
  }
}

}  // namespace grpo::services
