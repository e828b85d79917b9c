// parapilot trace (placeholder until trace analysis lands).
#include "experiments/commands.h"

namespace parapilot::cli {

void add_trace_command(CLI::App& app) { (void)app; }

}  // namespace parapilot::cli
