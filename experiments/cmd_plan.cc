// parapilot plan (placeholder until the planner lands).
#include "experiments/commands.h"

namespace parapilot::cli {

void add_plan_command(CLI::App& app) { (void)app; }

}  // namespace parapilot::cli
