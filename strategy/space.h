// What the planner may choose from ([space] TOML) and what it knows about gradients
// ([gradients] TOML). Formats and defaults: docs/planner.md.
//
// Both are plain values, safe to share read-only between threads. Loaders return
// kInvalidArgument naming the file, line, table and key at fault, like every spec loader.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "strategy/model.h"
#include "strategy/strategy.h"

namespace parapilot {

// Allowed values per strategy field. An empty list means "every legal value" (for
// microbatch_size: every divisor of the global batch; for virtual_stages: 2..8).
struct SearchSpace {
  std::vector<int> tp;
  std::vector<int> pp;
  // Context-parallel degrees; empty: every power of two whose 2 * cp divides the sequence and
  // whose tp x cp GPUs fit in a node or fill whole nodes (docs/planner.md).
  std::vector<int> cp;
  std::vector<int> dp;  // empty: as many replicas as the usable GPUs allow
  std::vector<int> microbatch_size;
  std::vector<int> virtual_stages;
  std::vector<int> zero;  // 0..3
  std::vector<bool> sp;   // {false}, {true} or both
  std::vector<Schedule> schedule;
  std::vector<Recompute> recompute;
  int max_pp = 0;  // deepest pipeline allowed; 0 = no limit beyond the layer count
  // The global batch: fixed when global_batch > 0; otherwise the largest legal value in
  // [global_batch_min, global_batch_max] per layout; when all three are 0, the current
  // layout's batch, else the default_global_batch() below.
  int global_batch = 0;
  int global_batch_min = 0;
  int global_batch_max = 0;
  // Whether one pipeline replica may put its stages on different GPU types (a stage itself is
  // a tensor-parallel group inside one node, so it never mixes types).
  bool mixed_types_in_pipeline = true;
  // Whether per-layer gradient compression may be chosen (needs [gradients] statistics).
  bool compression = true;
};

// Per-layer gradient statistics the monitor measures, and the error the run tolerates.
// Vectors are per transformer block (size = model layers) or empty when unknown.
struct GradientStats {
  // Fraction of a layer's gradient energy (squared L2 norm) held by its largest topk_ratio
  // entries; 1 - this is top-k's relative error (without error feedback).
  double topk_ratio = 0.01;
  std::vector<double> topk_energy;
  // Relative residual energy of a rank-powersgd_rank approximation of the layer's gradient
  // matrices: PowerSGD's relative error.
  int powersgd_rank = 4;
  std::vector<double> lowrank_residual;
  // Relative error of rounding a gradient to fp16 (2^-11 unit roundoff).
  double fp16_error = 4.9e-4;
  // Largest relative gradient error allowed in any layer.
  double error_budget = 0.0;

  bool empty() const {
    return topk_energy.empty() && lowrank_residual.empty() && error_budget == 0;
  }
};

// Reads the [space] table of a TOML file; kInvalidArgument naming the file, line and key at
// fault.
StatusOr<SearchSpace> load_search_space(const std::string& path, const ModelSpec& model);

// Reads the optional [gradients] table of a TOML file (typically the --conditions file); an
// absent table gives empty statistics (no compression is chosen). Errors as load_search_space.
StatusOr<GradientStats> load_gradient_stats(const std::string& path, const ModelSpec& model);

// The global batch used when neither the space nor a current layout fixes it: the smallest
// power of two >= max(256, gpus).
int default_global_batch(int gpus);

}  // namespace parapilot
