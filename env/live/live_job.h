// The job of a local live cluster as the deploy agent sees it: a scenario (env/sim/scenario.h)
// naming the workers' model, one node of `workers` GPUs, the global batch, and a search space of
// what the workers can switch (JobSwitches: data-parallel shares always; tensor- and
// pipeline-parallel degrees and stage boundaries where the workers can move their state).
// `parapilot launch --agent deploy` hands it to the deploy process; the live env (live_env.h)
// builds its in-process agent's job from it. No libtorch here.
#pragma once

#include <string>
#include <vector>

#include "env/live/model_config.h"

namespace parapilot::live {

/// The degrees the agent may choose for the job (its planner's [space]); every layout uses all
/// the workers. Default: pure data parallel.
struct JobSwitches {
  std::vector<int> tp = {1};
  std::vector<int> pp = {1};
};

/// Writes job.toml into `dir` (whole, then renamed into place) for a job training `model` (a
/// preset name or a model TOML path) and returns its path; kInvalidArgument naming the file
/// when the folder cannot be written.
StatusOr<std::string> write_job_scenario(const std::string& model, int workers,
                                         int global_batch, const std::string& dir,
                                         const JobSwitches& switches = {});
/// The same for the C++ workers' model, written beside it as model.toml.
StatusOr<std::string> write_job_scenario(const ModelConfig& model, int workers, int global_batch,
                                         const std::string& dir,
                                         const JobSwitches& switches = {});

}  // namespace parapilot::live
