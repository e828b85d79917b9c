// Batch shares of a data-parallel job: how many of the global batch's samples each rank takes,
// and the step time a share vector is predicted to give under the job's measured model (each
// rank's fixed part per step plus its compute per sample times its samples; the job's step is
// the slowest rank's).
//
// Pure functions; safe from any thread.
#pragma once

#include <string>
#include <vector>

namespace parapilot::env::dp {

/// Largest-remainder rounding of `exact` (summing to `total`) with every entry at least 1.
/// Precondition: total >= exact.size().
std::vector<int> round_counts(const std::vector<double>& exact, int total);

/// Even split of global_batch (largest remainder, lower ranks first), as the clients do.
std::vector<int> even_counts(int ranks, int global_batch);

/// Samples per rank that equalise fixed_ms[r] + per_sample_ms[r] * n[r] (each >= 1, summing to
/// global_batch; water-filling, then largest remainder). per_sample_ms must be > 0 for every
/// rank; fixed_ms may be empty (all 0). `fixed_apart` (monitor::Beliefs::fixed_apart): the
/// fixed parts run between other synchronisation points than the per-sample work, so only
/// per_sample_ms[r] * n[r] is equalised.
std::vector<int> balanced_counts(const std::vector<double>& per_sample_ms,
                                 const std::vector<double>& fixed_ms, int global_batch,
                                 bool fixed_apart = false);

/// The step's compute for these counts: max_r fixed_ms[r] + per_sample_ms[r] * counts[r]; with
/// `fixed_apart`, max_r per_sample_ms[r] * counts[r] + max_r fixed_ms[r].
double predicted_step_ms(const std::vector<double>& per_sample_ms,
                         const std::vector<double>& fixed_ms, const std::vector<int>& counts,
                         bool fixed_apart = false);

/// "a,b,c": samples per rank as deploy's log and reasons print them.
std::string counts_text(const std::vector<int>& counts);

}  // namespace parapilot::env::dp
