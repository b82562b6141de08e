#include "common/logging.h"

#include <spdlog/sinks/stdout_color_sinks.h>

namespace grpo::common {

Status InitLogging(std::string_view level) {
  auto lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") {
    return Status::InvalidArgument("log_level: unknown level '" + std::string(level) +
                                   "' (expected trace, debug, info, warn, error or off)");
  }
  auto logger = spdlog::stderr_color_mt("grpo");
  spdlog::set_default_logger(logger);
  spdlog::set_level(lvl);
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ [%n] %v");
  return Status::OK();
}

}  // namespace grpo::common
