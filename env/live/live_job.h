// The job of a local live cluster as the deploy agent sees it: a scenario (env/sim/scenario.h)
// naming the workers' model, one node of `workers` GPUs, the global batch, and a search space of
// what the C++ workers can switch today (data-parallel shares). `parapilot launch --agent deploy`
// hands it to the deploy process; the live env (live_env.h) builds its in-process agent's job
// from it. No libtorch here.
#pragma once

#include <string>

#include "env/live/action.h"

namespace parapilot::live {

/// Writes job.toml into `dir` (whole, then renamed into place) for a job training `model` (a
/// preset name or a model TOML path) and returns its path; kInvalidArgument naming the file
/// when the folder cannot be written.
StatusOr<std::string> write_job_scenario(const std::string& model, int workers,
                                         int global_batch, const std::string& dir);
/// The same for the C++ workers' model, written beside it as model.toml.
StatusOr<std::string> write_job_scenario(const ModelConfig& model, int workers, int global_batch,
                                         const std::string& dir);

}  // namespace parapilot::live
