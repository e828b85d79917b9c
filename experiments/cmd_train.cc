// parapilot train (placeholder until it lands).
#include "experiments/commands.h"

namespace parapilot::cli {

void add_train_command(CLI::App& app) { (void)app; }

}  // namespace parapilot::cli
