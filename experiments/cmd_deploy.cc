// parapilot deploy (placeholder until it lands).
#include "experiments/commands.h"

namespace parapilot::cli {

void add_deploy_command(CLI::App& app) { (void)app; }

}  // namespace parapilot::cli
