// The checks `grpo learner` and `grpo train-local` make at start-up (cli_plan.cc). Apart from
// cli.h: libtorch is in the interface, and the launcher's commands (launch.h) build without it.
#pragma once

#include <c10/core/Device.h>

#include <string>

#include "common/config.h"
#include "common/status.h"

namespace grpo::services {

// The learner's start-up check (cli_plan.cc): the memory plan of `cfg` for its model's
// config.json (the tiny preset when model_name_or_path is empty) with `world_size` ranks on
// `device` (cpu, cuda:N). On the CPU the `local_world_size` ranks on this host share its memory:
// each has its share. FailedPrecondition naming the change that fits when the device's memory is
// too small; NotFound / InvalidArgument for a missing or bad config.json or device.
Status CheckLearnerMemoryPlan(const common::GrpoConfig& cfg, int world_size,
                              const std::string& device, int local_world_size = 1);
// The start-up warning of `bf16` on a CPU that emulates it (cli_plan.cc; common/model/device.h
// CpuBf16Warning), logged by learner and train-local: measured only when `bf16` is set and
// `device` is the CPU.
void WarnOfCpuBf16(const common::GrpoConfig& cfg, const c10::Device& device);

}  // namespace grpo::services
