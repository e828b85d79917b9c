// Loading model, cluster and strategy specs from preset names, TOML files, or (strategies
// only) inline "key=value,..." text; writing a strategy back as TOML. Format: docs/specs.md.
//
// Every loader returns kInvalidArgument naming the file, line, table and key at fault; a
// returned spec is complete and legal. Loaders are independent and thread-safe.
#pragma once

#include <string>

#include "core/status.h"
#include "strategy/cluster.h"
#include "strategy/cost_model.h"
#include "strategy/model.h"
#include "strategy/strategy.h"

namespace parapilot {

// True when `arg` names a file rather than a preset (contains '/' or ends in ".toml").
bool looks_like_path(const std::string& arg);

// A model preset name, or a TOML file holding a [model] table.
StatusOr<ModelSpec> load_model(const std::string& arg);

// A cluster preset ("4x8xa100-80g", "1x8xa100-80g+1x8xh800"), or a TOML file holding a
// [cluster] table.
StatusOr<ClusterSpec> load_cluster(const std::string& arg);

// A TOML file holding a [strategy] table; a preset ("dp", "megatron"); or inline keys
// ("tp=8,pp=2,global_batch=512"), optionally after a preset ("megatron,global_batch=1024").
// The result is legal for this model and cluster (find_problem() is nullopt); whether it fits
// in memory is the cost model's verdict, not the loader's.
StatusOr<Strategy> load_strategy(const std::string& arg, const ModelSpec& model,
                                const ClusterSpec& cluster);

// A TOML file holding a [conditions] table (docs/specs.md): per-GPU speed factors, per-node
// network and NVLink bandwidth factors, failed GPUs, sized for this cluster.
StatusOr<Conditions> load_conditions(const std::string& path, const ClusterSpec& cluster);

// The strategy as a [strategy] TOML table that load_strategy() reads back to an equal value.
std::string strategy_to_toml(const Strategy& s);

}  // namespace parapilot
