#include <iostream>

#include "common/config.h"
#include "common/status.h"
#include "services/cli/cli.h"

namespace grpo::services {

// `grpo config [--config FILE] [--key value ...]`: the effective configuration as JSON, after
// validation. Users check what a run will use; deployments lint their YAML with it.
void AddConfigCommand(CLI::App& app, CliAction* action) {
  auto* cmd = app.add_subcommand("config",
                                 "Print the effective configuration (YAML file plus "
                                 "--key value overrides) as JSON, after validation");
  cmd->allow_extras();
  cmd->footer("Keys:\n" + common::ConfigHelp());
  cmd->callback([cmd, action] {
    *action = [cmd] {
      common::GrpoConfig config;
      Status s = common::ApplyConfigOverrides(config, cmd->remaining());
      if (s.ok()) s = config.Validate();
      if (!s.ok()) {
        std::cerr << "grpo config: " << s.ToString() << "\n";
        return 2;
      }
      std::cout << config.ToJson().dump(2) << "\n";
      return 0;
    };
  });
}

}  // namespace grpo::services
