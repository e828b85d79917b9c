// Subcommands of the parapilot CLI. Each adds itself to the app; its callback runs the command
// and reports bad input by throwing InputError (exit code 2).
#pragma once

#include <CLI/CLI.hpp>

namespace parapilot::cli {

void add_simulate_command(CLI::App& app);
void add_plan_command(CLI::App& app);
void add_eval_command(CLI::App& app);
void add_trace_command(CLI::App& app);
void add_train_command(CLI::App& app);
void add_worker_command(CLI::App& app);
void add_launch_command(CLI::App& app);
void add_deploy_command(CLI::App& app);

}  // namespace parapilot::cli
