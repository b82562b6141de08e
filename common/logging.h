// Logging through spdlog. Every binary calls InitLogging once; libraries log through GRPO_LOG_*.
#pragma once

#include <spdlog/spdlog.h>

#include <string_view>

#include "common/status.h"

namespace grpo::common {

// level: trace|debug|info|warn|error|off. Logs go to stderr so stdout stays machine-readable.
// Returns InvalidArgument naming the level when it is unknown.
Status InitLogging(std::string_view level);

}  // namespace grpo::common

#define GRPO_LOG_DEBUG(...) ::spdlog::debug(__VA_ARGS__)
#define GRPO_LOG_INFO(...) ::spdlog::info(__VA_ARGS__)
#define GRPO_LOG_WARN(...) ::spdlog::warn(__VA_ARGS__)
#define GRPO_LOG_ERROR(...) ::spdlog::error(__VA_ARGS__)
