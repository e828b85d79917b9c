// The worker's run summary (`parapilot worker --summary-json FILE`): what a run trained, how
// fast, the layout it ended on and every layout switch it made, as one JSON object that rank 0
// writes at the end. No libtorch here: plain values and a file writer.
//
// Thread-safety: plain values and a free function.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace parapilot::live {

/// One layout switch the job made (the same on every rank but for the per-rank figures).
struct SwitchSummary {
  std::uint64_t plan_id = 0;
  std::string layout;         ///< the layout switched to, layout_text's form.
  std::uint64_t at_step = 0;  ///< the first step trained on it.
  /// The switch's pause: the wall time it added to its step (taking the staged state, the
  /// move, the swap), the largest over the ranks.
  double pause_ms = 0;
  double staged_ms = 0;  ///< wall time of staging beside training, the largest over the ranks.
  /// Bytes of parameters and optimizer state sent between ranks, summed over all the ranks
  /// (what crossed the transfer group; local copies not counted).
  std::uint64_t bytes_moved = 0;
  /// The step rank 0 was training (or about to train) when staging began (its PlanPrepare
  /// arrived), and when staging ended (PlanReady); -1 when not known.
  std::int64_t prepared_at_step = -1;
  std::int64_t ready_at_step = -1;
};

/// What one run of the worker did, as rank 0 saw it.
struct RunSummary {
  std::uint64_t first_step = 0;  ///< the step it started at (> 0 when resumed, --load-state).
  std::uint64_t steps = 0;       ///< steps this run trained.
  std::uint64_t samples = 0;     ///< sequences this run trained on (steps x global batch).
  /// Training wall time: from the start of the first step's boundary to the end of the last
  /// step (rendezvous, loading and saving excluded).
  double train_s = 0;
  std::string layout;  ///< the layout it ended on, layout_text's form.
  /// Wall-clock time (Unix seconds) at which the worker process started, its first step ended
  /// and its last step ended (0 when it trained no step).
  double started_unix_s = 0;
  double first_step_end_unix_s = 0;
  double last_step_end_unix_s = 0;
  /// Per step trained: its wall time from the previous step's end (the first: from the start
  /// of training), boundary and any switch pause included, and its end in seconds since the
  /// worker started (the clock of --slow-at).
  std::vector<double> step_ms;
  std::vector<double> step_end_s;
  std::vector<SwitchSummary> switches;
};

/// The summary as a JSON object: steps, samples, throughput_samples_per_s (samples / train_s;
/// 0 when no step was trained), layout, switches (each {plan_id, layout, at_step, pause_ms,
/// staged_ms, bytes_moved, prepared_at_step, ready_at_step}), plus first_step, train_s, the
/// Unix times and the per-step arrays.
std::string run_summary_json(const RunSummary& summary);

/// Writes run_summary_json to `path` through a temporary file renamed into place (a reader
/// never sees half a file). kInvalidArgument naming the path when it cannot be written.
Status write_run_summary(const std::string& path, const RunSummary& summary);

}  // namespace parapilot::live
