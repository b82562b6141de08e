// The spellings of `loss_type`, in the order of the learner's objective table
// (learner/loss/objectives.cc checks the order at compile time): the config's list of choices.
#pragma once

#include <array>
#include <string_view>

namespace grpo::common {

inline constexpr std::array<std::string_view, 8> kLossTypeNames = {
    "grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"};

}  // namespace grpo::common
