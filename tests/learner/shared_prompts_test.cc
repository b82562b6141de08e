#include "learner/shared_prompts.h"

#include <gtest/gtest.h>

#include <vector>

namespace grpo::learner {
namespace {

std::vector<int64_t> Row(const at::Tensor& t, int64_t r) {
  const at::Tensor row = t[r].contiguous();
  return std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel());
}

// Rows 1..6 of a batch: prompt a (two vectors with its tokens count as one), b, a again after b,
// then c; row 0 and 7 are outside the range.
TEST(SharedPrompts, DistinctPromptsInOrderOfFirstUseLeftPadded) {
  const std::vector<int32_t> a = {7, 8, 9}, a_copy = {7, 8, 9}, b = {4}, c = {5, 6}, z = {1};
  const std::vector<const std::vector<int32_t>*> prompts = {&z, &a, &a_copy, &b, &a, &c, &c, &z};
  const SharedPrompts s = GroupPrompts(prompts, 1, 7, 4);
  ASSERT_EQ(s.distinct(), 3);
  EXPECT_EQ(Row(s.ids, 0), (std::vector<int64_t>{0, 7, 8, 9}));
  EXPECT_EQ(Row(s.mask, 0), (std::vector<int64_t>{0, 1, 1, 1}));
  EXPECT_EQ(Row(s.ids, 1), (std::vector<int64_t>{0, 0, 0, 4}));
  EXPECT_EQ(Row(s.mask, 1), (std::vector<int64_t>{0, 0, 0, 1}));
  EXPECT_EQ(Row(s.ids, 2), (std::vector<int64_t>{0, 0, 5, 6}));
  EXPECT_EQ(Row(s.mask, 2), (std::vector<int64_t>{0, 0, 1, 1}));
  const at::Tensor rows = s.rows.contiguous();
  EXPECT_EQ(std::vector<int64_t>(rows.data_ptr<int64_t>(), rows.data_ptr<int64_t>() + 6),
            (std::vector<int64_t>{0, 0, 1, 0, 2, 2}));
}

TEST(SharedPrompts, NoneWhenEveryRowHasItsOwnOrAPromptIsEmpty) {
  const std::vector<int32_t> a = {7, 8}, b = {7, 9}, empty;
  const std::vector<const std::vector<int32_t>*> distinct = {&a, &b};
  EXPECT_EQ(GroupPrompts(distinct, 0, 2, 2).distinct(), 0);
  const std::vector<const std::vector<int32_t>*> with_empty = {&empty, &empty, &a};
  EXPECT_EQ(GroupPrompts(with_empty, 0, 3, 2).distinct(), 0);
  EXPECT_FALSE(GroupPrompts(with_empty, 0, 3, 2).ids.defined());
}

}  // namespace
}  // namespace grpo::learner
