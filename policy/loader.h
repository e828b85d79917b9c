// Loading trained policies: a checkpoint (checkpoints/checkpoint.h) becomes a greedy Policy
// over its actor and observation normalisation, run by the hand-written inference path
// (policy/network.h, FastActor). This header does not include libtorch.
#pragma once

#include <memory>
#include <string>

#include "checkpoints/checkpoint.h"
#include "policy/policy.h"

namespace parapilot::policy {

/// Loads a trained policy (greedy) from a checkpoint file: read_checkpoint()'s Status when the
/// file is missing or invalid, kInvalidArgument naming the file when it holds no usable policy.
StatusOr<std::unique_ptr<Policy>> load_policy(const std::string& path);
/// The same from a checkpoint already read: kInvalidArgument when it does not hold a policy.
StatusOr<std::unique_ptr<Policy>> make_learned_policy(const checkpoints::PolicyCheckpoint& checkpoint);

/// The shipped default policy (trained on the mixed family): $PARAPILOT_DEFAULT_POLICY when
/// set, else share/parapilot/default-mixed.ckpt found from the running binary's directory or
/// one of the three above it (an installed prefix's bin/, or anywhere in the build tree, which
/// holds a copy). When none exists, the installed location (<binary dir>/../share/parapilot/
/// default-mixed.ckpt), so a load names where the file was expected.
std::string default_policy_path();

/// Registers the learned policy in the policy registry (policy/registry.h): "rl" is the shipped
/// default policy (default_policy_path), "rl(path=FILE)" the checkpoint FILE, loaded with
/// load_policy. Idempotent; thread-safe.
void register_learned_policies();

}  // namespace parapilot::policy
