#include "common/status.h"

#include <gtest/gtest.h>

#include <memory>

namespace grpo {
namespace {

StatusOr<int> Half(int x) {
  if (x % 2 != 0) return Status::InvalidArgument("odd: " + std::to_string(x));
  return x / 2;
}

StatusOr<int> Quarter(int x) {
  ASSIGN_OR_RETURN(int h, Half(x));
  ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

Status CheckEven(int x) {
  RETURN_IF_ERROR(Half(x).status());
  return Status::OK();
}

TEST(Status, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.ToString(), "OK");
}

TEST(Status, FactoriesCarryCodeAndMessage) {
  Status s = Status::NotFound("model.safetensors");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.ToString(), "NOT_FOUND: model.safetensors");
}

TEST(Status, CodesEqualGrpcNumbering) {
  // grpc::StatusCode values, from grpc/impl/codegen/status_code_enum.h.
  EXPECT_EQ(static_cast<int>(StatusCode::kUnknown), 2);
  EXPECT_EQ(static_cast<int>(StatusCode::kInvalidArgument), 3);
  EXPECT_EQ(static_cast<int>(StatusCode::kDeadlineExceeded), 4);
  EXPECT_EQ(static_cast<int>(StatusCode::kPermissionDenied), 7);
  EXPECT_EQ(static_cast<int>(StatusCode::kFailedPrecondition), 9);
  EXPECT_EQ(static_cast<int>(StatusCode::kUnavailable), 14);
  EXPECT_EQ(static_cast<int>(StatusCode::kUnauthenticated), 16);
}

TEST(Status, WithContextPrefixesMessageAndKeepsCode) {
  Status s = Status::DataLoss("truncated").WithContext("a.safetensors");
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), "a.safetensors: truncated");
  EXPECT_TRUE(Status::OK().WithContext("x").ok());
}

TEST(StatusOr, MacrosPropagateTheFirstError) {
  EXPECT_EQ(*Quarter(8), 2);
  StatusOr<int> r = Quarter(6);  // 6 -> 3 -> odd
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "odd: 3");
  EXPECT_TRUE(CheckEven(4).ok());
  EXPECT_EQ(CheckEven(5).code(), StatusCode::kInvalidArgument);
}

TEST(StatusOr, HoldsMoveOnlyValues) {
  StatusOr<std::unique_ptr<int>> p = std::make_unique<int>(7);
  ASSERT_TRUE(p.ok());
  std::unique_ptr<int> owned = std::move(p).value();
  EXPECT_EQ(*owned, 7);
}

}  // namespace
}  // namespace grpo
