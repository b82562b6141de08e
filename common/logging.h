// Logging through spdlog. Every binary calls InitLogging once; libraries log through GRPO_LOG_*.
#pragma once

#include <spdlog/spdlog.h>

#include <string>
#include <string_view>

#include "common/status.h"

namespace grpo::common {

// level: trace|debug|info|warn|error|off. Logs go to stderr so stdout stays machine-readable.
// Returns InvalidArgument naming the level when it is unknown.
Status InitLogging(std::string_view level);

// `text` for a log line when it comes from outside (a dataset name, a worker id or hostname, a
// cancel reason): printable ASCII as it is, a backslash doubled, \n \r \t by name and every other
// byte as \xHH (lower-case hex; non-ASCII too, so no C1 control or U+2028 reaches the log raw).
// The result is one line that cannot forge another or carry a terminal escape sequence.
std::string EscapeForLog(std::string_view text);

}  // namespace grpo::common

#define GRPO_LOG_DEBUG(...) ::spdlog::debug(__VA_ARGS__)
#define GRPO_LOG_INFO(...) ::spdlog::info(__VA_ARGS__)
#define GRPO_LOG_WARN(...) ::spdlog::warn(__VA_ARGS__)
#define GRPO_LOG_ERROR(...) ::spdlog::error(__VA_ARGS__)
