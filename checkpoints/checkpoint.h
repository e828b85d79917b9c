// Policy checkpoints: one file holding everything needed to use a trained policy or to resume
// its training exactly — network weights, optimizer state, observation-normalisation
// statistics, the feature-schema version, the training config, the env id, the step count and
// metrics.
//
// File layout (integers little-endian):
//   magic "PPLTCKPT" | u32 format version | u32 feature-schema version |
//   u64 metadata length | u64 model length | u64 optimizer length |
//   metadata (cereal JSON) | model (torch::save bytes) | optimizer (torch::save bytes) |
//   u32 CRC32C (core/checksum.h) of everything before it
// Writes go through core/atomic_file.h (temporary, fsync, rename, fsync of the folder), so
// a reader sees the old file or the new one, never a mix. Reads validate everything before
// returning; a bad file is a Status naming the file and the reason.
// This module does not depend on libtorch: tensors arrive and leave as serialised bytes.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "core/status.h"
#include "policy/features.h"

namespace parapilot::checkpoints {

inline constexpr uint32_t kFormatVersion = 2;  // 2: CRC32C (was CRC-32 in 1)

/// A trained policy and what resuming its training needs (the live worker's training state
/// is another thing: env/live/checkpoint.h, TrainingState).
struct PolicyCheckpoint {
  uint32_t feature_schema = policy::kFeatureSchemaVersion;
  std::string env_id;                     // the env (or comma-separated envs) it was trained on
  std::string config;                     // the training config, as written by the trainer (JSON)
  int64_t step = 0;                       // env steps taken
  int64_t update = 0;                     // optimiser updates (PPO iterations) done
  std::map<std::string, double> metrics;  // e.g. validation_score, mean_reward, elapsed_s
  policy::ObservationNormalizer normalizer;
  std::string model;      // torch::save of the network
  std::string optimizer;  // torch::save of the optimizer (empty: inference only)
};

// Writes `checkpoint` to `path` atomically. kInvalidArgument naming `path` when it cannot be
// written; then the old file, if any, is untouched and no temporary file is left.
Status write_checkpoint(const std::string& path, const PolicyCheckpoint& checkpoint);
// Reads and validates a checkpoint. kNotFound when `path` does not exist; kInvalidArgument
// naming `path` when it is unreadable, truncated, corrupted (checksum), of another format
// version or of another feature schema.
StatusOr<PolicyCheckpoint> read_checkpoint(const std::string& path);

}  // namespace parapilot::checkpoints
