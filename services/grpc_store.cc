#include "services/grpc_store.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "services/auth.h"
#include "services/convert.h"

namespace grpo::services {
namespace {

using Clock = std::chrono::steady_clock;

// c10d reports failures by throwing.
template <typename T> T ValueOrThrow(StatusOr<T> v) {
  TORCH_CHECK(v.ok(), "grpo store: ", v.status().ToString());
  return std::move(v).value();
}

std::vector<uint8_t> ToBytes(const std::string &s) {
  return {s.begin(), s.end()};
}
std::string FromBytes(const std::vector<uint8_t> &v) {
  return {v.begin(), v.end()};
}

} // namespace

GrpcStore::GrpcStore(StoreCall call, int64_t epoch,
                     std::chrono::milliseconds timeout)
    : c10d::Store(timeout), call_(std::move(call)), epoch_(epoch) {}

c10::intrusive_ptr<GrpcStore>
GrpcStore::Connect(std::shared_ptr<grpc::Channel> channel,
                   std::string auth_token, int64_t epoch,
                   std::chrono::milliseconds timeout) {
  std::shared_ptr<v1::LearnerService::Stub> stub =
      v1::LearnerService::NewStub(std::move(channel));
  StoreCall call = [stub, token = std::move(auth_token)](
                       const v1::StoreRequest &request,
                       v1::StoreResponse *response,
                       std::chrono::milliseconds deadline) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + deadline);
    AddAuth(context, token);
    return FromGrpcStatus(stub->Store(&context, request, response));
  };
  return c10::make_intrusive<GrpcStore>(std::move(call), epoch, timeout);
}

c10::intrusive_ptr<c10d::Store> GrpcStore::clone() {
  return c10::make_intrusive<GrpcStore>(call_, epoch_, timeout_);
}

StatusOr<v1::StoreResponse>
GrpcStore::Call(v1::StoreRequest request, std::chrono::milliseconds deadline) {
  request.set_group_epoch(epoch_);
  v1::StoreResponse response;
  RETURN_IF_ERROR(call_(request, &response, deadline)
                      .WithContext("Store " +
                                   v1::StoreRequest::Op_Name(request.op()) +
                                   " '" + request.key() + "' (epoch " +
                                   std::to_string(epoch_) + ")"));
  return response;
}

StatusOr<std::string> GrpcStore::Get(const std::string &key,
                                     std::chrono::milliseconds timeout) {
  v1::StoreRequest request;
  request.set_op(v1::StoreRequest::GET);
  request.set_key(key);
  request.set_timeout_ms(std::max<int64_t>(1, timeout.count()));
  ASSIGN_OR_RETURN(v1::StoreResponse response,
                   Call(std::move(request), timeout + kStoreRpcSlack));
  return response.value();
}

Status GrpcStore::Set(const std::string &key, const std::string &value) {
  v1::StoreRequest request;
  request.set_op(v1::StoreRequest::SET);
  request.set_key(key);
  request.set_value(value);
  return Call(std::move(request), timeout_).status();
}

StatusOr<int64_t> GrpcStore::Add(const std::string &key, int64_t delta) {
  v1::StoreRequest request;
  request.set_op(v1::StoreRequest::ADD);
  request.set_key(key);
  request.set_add(delta);
  ASSIGN_OR_RETURN(v1::StoreResponse response,
                   Call(std::move(request), timeout_));
  return response.number();
}

void GrpcStore::set(const std::string &key, const std::vector<uint8_t> &value) {
  const Status s = Set(key, FromBytes(value));
  TORCH_CHECK(s.ok(), "grpo store: ", s.ToString());
}

std::vector<uint8_t>
GrpcStore::compareSet(const std::string &key,
                      const std::vector<uint8_t> &expected,
                      const std::vector<uint8_t> &desired) {
  v1::StoreRequest request;
  request.set_op(v1::StoreRequest::COMPARE_SET);
  request.set_key(key);
  request.set_expected(FromBytes(expected));
  request.set_value(FromBytes(desired));
  return ToBytes(ValueOrThrow(Call(std::move(request), timeout_)).value());
}

std::vector<uint8_t> GrpcStore::get(const std::string &key) {
  return ToBytes(ValueOrThrow(Get(key, timeout_)));
}

int64_t GrpcStore::add(const std::string &key, int64_t value) {
  return ValueOrThrow(Add(key, value));
}

bool GrpcStore::deleteKey(const std::string &key) {
  v1::StoreRequest request;
  request.set_op(v1::StoreRequest::DELETE);
  request.set_key(key);
  return ValueOrThrow(Call(std::move(request), timeout_)).ok();
}

bool GrpcStore::check(const std::vector<std::string> &keys) {
  v1::StoreRequest request;
  request.set_op(v1::StoreRequest::CHECK);
  for (const auto &k : keys)
    request.add_keys(k);
  return ValueOrThrow(Call(std::move(request), timeout_)).ok();
}

int64_t GrpcStore::getNumKeys() {
  v1::StoreRequest request;
  request.set_op(v1::StoreRequest::NUM_KEYS);
  return ValueOrThrow(Call(std::move(request), timeout_)).number();
}

void GrpcStore::wait(const std::vector<std::string> &keys) {
  wait(keys, timeout_);
}

void GrpcStore::wait(const std::vector<std::string> &keys,
                     const std::chrono::milliseconds &timeout) {
  // One deadline for all keys (c10d semantics); kNoTimeout is capped at the
  // store's timeout.
  const auto total = timeout == kNoTimeout ? timeout_ : timeout;
  const auto deadline = Clock::now() + total;
  for (const auto &key : keys) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - Clock::now());
    TORCH_CHECK(left.count() > 0, "grpo store: wait for '", key,
                "' timed out after ", total.count(), " ms");
    (void)ValueOrThrow(Get(key, left));
  }
}

} // namespace grpo::services
