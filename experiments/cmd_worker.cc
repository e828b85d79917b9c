// parapilot worker: one rank of a live data-parallel training job (env/live/worker.h).
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "experiments/commands.h"
#include "core/error.h"
#ifdef PARAPILOT_HAVE_LIVE
#include "agent/deploy/live_env.h"
#include "env/live/worker.h"
#endif

namespace parapilot::cli {

void add_worker_command(CLI::App& app) {
#ifdef PARAPILOT_HAVE_LIVE
  agent::deploy::register_live_envs();
  auto options = std::make_shared<live::WorkerOptions>();
  CLI::App* cmd = app.add_subcommand(
      "worker",
      "Run one rank of a live data-parallel training job (torchrun environment: RANK, "
      "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)");
  live::add_worker_flags(*cmd, *options);
  cmd->callback([options] {
    check(live::read_torchrun_env(*options));
    const int code = take(live::run_worker(*options));
    std::fflush(stdout);
    std::fflush(stderr);
    if (code != 0) std::exit(code);
  });
#else
  CLI::App* cmd = app.add_subcommand("worker", "Live training worker (not in this build)");
  cmd->allow_extras();
  cmd->callback([] {
    std::fprintf(stderr,
                 "error: this build has no live cluster support (Gloo headers, "
                 "libgloo-dev, were not found)\n");
    std::exit(2);
  });
#endif
}

}  // namespace parapilot::cli
