// The collective backends a worker can run its process groups on, by name, after c10d's backend
// registry: each backend registers once, here, with what it can do; the worker's flags, the
// worker, its layout state and the live env ask the registry instead of comparing names. No
// libtorch here: collectives.h makes a backend's groups (make_collectives).
//
// Thread-safety: collective_backends() is built once, on first use, and is read-only after.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace parapilot::live {

/// Where a backend's reductions run.
enum class BackendDevice { cpu, cuda };

/// Which backend implementation makes the groups (collectives.h dispatches on it).
enum class BackendKind { gloo, nccl, local };

/// A backend and what it can do.
struct BackendInfo {
  std::string name;  ///< "gloo", "nccl", "local": the --backend flag and live:VARIANT value.
  BackendKind kind = BackendKind::gloo;
  BackendDevice device = BackendDevice::cpu;
  bool needs_cuda = false;  ///< needs a CUDA device (the worker binds LOCAL_RANK % devices).
  /// The collectives it implements (collectives.h: Collectives).
  std::vector<std::string> collectives = {"all_reduce_sum", "all_reduce_max", "all_gather",
                                          "broadcast"};
  /// Ranks in separate processes (false: one in-process rank, world size 1 only).
  bool multi_process = true;
  /// A user may choose it (--backend, live:VARIANT); false: the worker picks it itself.
  bool selectable = true;
  /// Layout switches (layout_switch.h) and hybrid layouts offered to the agent run on it.
  bool switches_layouts = false;
  /// A job of one rank without MASTER_PORT runs on the in-process local backend instead (no
  /// rendezvous).
  bool alone_in_process = false;
  bool built = true;      ///< compiled into this build.
  std::string not_built;  ///< why not, when !built.
};

/// Backends by name. Names are unique.
class BackendRegistry {
 public:
  /// Registers `info`. kInvalidArgument when its name is empty or already registered.
  Status add(BackendInfo info);
  /// The backend called `name`. kInvalidArgument naming the known backends when there is none.
  StatusOr<BackendInfo> find(std::string_view name) const;
  /// find(), and kRejected naming the backend and why when it is not built here.
  StatusOr<BackendInfo> find_built(std::string_view name) const;
  /// find(), and kInvalidArgument when the backend is not selectable (naming the selectable
  /// ones). A selectable backend may still not be built here (find_built says).
  StatusOr<BackendInfo> find_selectable(std::string_view name) const;
  /// Every backend, in registration order.
  const std::vector<BackendInfo>& all() const { return backends_; }
  /// The names of the selectable backends, registration order ("gloo, nccl").
  std::vector<std::string> selectable_names() const;

 private:
  std::vector<BackendInfo> backends_;
};

/// The process's registry: gloo, nccl (built only with CUDA and NCCL) and local.
const BackendRegistry& collective_backends();

}  // namespace parapilot::live
