// The rollout worker's retry rule (rollout/retry_policy.h), code by code. The decisions are
// written out by hand from the reasons the header gives, by gRPC number, not read back from the
// code under test.
#include "rollout/retry_policy.h"

#include <gtest/gtest.h>

#include <iterator>
#include <string_view>

namespace grpo::rollout {
namespace {

struct Row {
  int number;
  std::string_view name;
  bool retried;
};

TEST(RetryPolicy, EveryGrpcCodeHasTheDecisionTheHeaderGivesIt) {
  // {gRPC number, its name, retried}: grpc/impl/codegen/status_code_enum.h's 17 codes in order.
  const Row expected[] = {
      {0, "OK", false},  // nothing failed
      {1, "CANCELLED", true},
      {2, "UNKNOWN", true},  // a proxy's unmapped HTTP error (500)
      {3, "INVALID_ARGUMENT", false},
      {4, "DEADLINE_EXCEEDED", true},
      {5, "NOT_FOUND", false},  // the caller registers again
      {6, "ALREADY_EXISTS", false},
      {7, "PERMISSION_DENIED", false},  // a refused credential (a proxy's 403)
      {8, "RESOURCE_EXHAUSTED", true},
      {9, "FAILED_PRECONDITION", true},
      {10, "ABORTED", true},
      {11, "OUT_OF_RANGE", false},
      {12, "UNIMPLEMENTED", false},
      {13, "INTERNAL", true},
      {14, "UNAVAILABLE", true},
      {15, "DATA_LOSS", false},
      {16, "UNAUTHENTICATED", false},  // a refused credential
  };
  static_assert(std::size(expected) == 17);
  for (const Row& row : expected) {
    const auto code = static_cast<StatusCode>(row.number);
    EXPECT_EQ(StatusCodeName(code), row.name) << row.number;
    EXPECT_EQ(IsRetryable(code), row.retried) << row.number << " " << row.name;
  }
}

TEST(RetryPolicy, AValueOutsideTheEnumIsNotRetried) {
  EXPECT_FALSE(IsRetryable(static_cast<StatusCode>(17)));
  EXPECT_FALSE(IsRetryable(static_cast<StatusCode>(-1)));
}

}  // namespace
}  // namespace grpo::rollout
