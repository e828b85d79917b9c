// parapilot: keeps large-model training on the fastest hybrid-parallel layout.
#include <cstdio>
#include <exception>
#include <string>

#include "experiments/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"parapilot: plan, simulate and adapt hybrid-parallel training layouts"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "parapilot 0.1.0");
  parapilot::cli::add_simulate_command(app);
  parapilot::cli::add_plan_command(app);
  parapilot::cli::add_eval_command(app);
  parapilot::cli::add_trace_command(app);
  parapilot::cli::add_train_command(app);
  parapilot::cli::add_worker_command(app);
  parapilot::cli::add_launch_command(app);
  parapilot::cli::add_deploy_command(app);
  if (argc > 1 && argv[1][0] != '-') {
    std::string known;
    bool found = false;
    for (const CLI::App* sub : app.get_subcommands({})) {
      known += (known.empty() ? "" : ", ") + sub->get_name();
      found = found || sub->get_name() == argv[1];
    }
    if (!found) {
      std::fprintf(stderr, "error: unknown command '%s' (commands: %s)\n", argv[1], known.c_str());
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "error: %s\nRun with --help for usage.\n", e.what());
    return 2;
  } catch (const parapilot::InputError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "internal error: %s\n", e.what());
    return 1;
  }
  return 0;
}
