#include "policy/loader.h"

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <sstream>

#include <nlohmann/json.hpp>
#include <torch/serialize.h>

#include "policy/learned.h"
#include "policy/registry.h"

namespace parapilot::policy {

namespace {

// The actor-critic's hidden width, from the training config stored beside the weights.
StatusOr<int> network_width(const checkpoints::PolicyCheckpoint& checkpoint) {
  const nlohmann::json j = nlohmann::json::parse(checkpoint.config, nullptr, false);
  if (!j.is_object() || !j.contains("ppo") || !j["ppo"].is_object() ||
      !j["ppo"].contains("hidden") || !j["ppo"]["hidden"].is_number_integer()) {
    return Status::invalid_argument("checkpoint: unreadable training config (no ppo.hidden)");
  }
  const int hidden = j["ppo"]["hidden"].get<int>();
  if (hidden < kMinHidden || hidden > kMaxHidden)
    return Status::invalid_argument("checkpoint: network width " + std::to_string(hidden) +
                                    " is outside [" + std::to_string(kMinHidden) + ", " +
                                    std::to_string(kMaxHidden) + "]");
  return hidden;
}

}  // namespace

StatusOr<std::unique_ptr<Policy>> make_learned_policy(const checkpoints::PolicyCheckpoint& checkpoint) {
  const StatusOr<int> width = network_width(checkpoint);
  if (!width.ok()) return width.status();
  NetworkOptions o;
  o.hidden = *width;
  ActorCritic net(o);
  try {
    std::istringstream in(checkpoint.model, std::ios::binary);
    torch::load(net, in);
  } catch (const std::exception& e) {  // libtorch reports bad bytes by throwing
    std::string what = e.what();
    if (const auto nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
    return Status::invalid_argument("checkpoint weights: " + what);
  }
  return std::unique_ptr<Policy>(std::make_unique<LearnedPolicy>(net, checkpoint.normalizer));
}

StatusOr<std::unique_ptr<Policy>> load_policy(const std::string& path) {
  const StatusOr<checkpoints::PolicyCheckpoint> c = checkpoints::read_checkpoint(path);
  if (!c.ok()) return c.status();
  StatusOr<std::unique_ptr<Policy>> policy = make_learned_policy(*c);
  if (!policy.ok()) return Status(policy.status().code(), path + ": " + policy.status().message());
  return policy;
}

std::string default_policy_path() {
  if (const char* path = std::getenv("PARAPILOT_DEFAULT_POLICY"); path && *path) return path;
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  fs::path dir = ec ? fs::current_path(ec) : exe.parent_path();
  const fs::path file = fs::path("share") / "parapilot" / "default-mixed.ckpt";
  const fs::path installed = dir.parent_path() / file;
  for (int up = 0; up < 4; ++up, dir = dir.parent_path()) {
    if (fs::is_regular_file(dir / file, ec)) return (dir / file).string();
  }
  return installed.string();
}

void register_learned_policies() {
  static std::once_flag once;
  std::call_once(once, [] {
    PolicyInfo info;
    info.name = "rl";
    info.description = "the greedy policy of a trained checkpoint (default: the shipped policy)";
    info.params = {{"path", ParamType::kText, "", 0, 0, {},
                    "checkpoint file (default: the shipped policy, default-mixed.ckpt)"}};
    info.capabilities.learned = true;
    register_policy(info, [](const PolicyArgs& args, const env::Env*) {
      const std::string& path = args.text("path");
      return load_policy(path.empty() ? default_policy_path() : path);
    });
  });
}

}  // namespace parapilot::policy
