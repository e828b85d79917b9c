// Subcommands of the parapilot CLI. Each adds itself to the app; its callback runs the command
// and reports bad input by throwing InputError (exit code 2).
#pragma once

#include <string>

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

// Impersonates `ranks` ranks of `scenario` from the simulator on the bus of the agent at
// `agent` (HOST:PORT), as `parapilot simcluster` does; runs until SIGINT/SIGTERM. The secret
// comes from `secret_file`, or PARAPILOT_SECRET when empty. Used by `launch --simulated`.
void run_simulated_ranks(int ranks, const std::string& scenario, const std::string& agent,
                         const std::string& secret_file);

}  // namespace parapilot::cli
