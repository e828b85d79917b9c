#include "env/live/collective_backends.h"

#include <algorithm>
#include <cassert>
#include <utility>

namespace parapilot::live {

namespace {

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) {
    if (!out.empty()) out += ", ";
    out += n;
  }
  return out;
}

BackendRegistry make_registry() {
  BackendRegistry r;
  BackendInfo gloo;
  gloo.name = "gloo";
  gloo.kind = BackendKind::gloo;
  gloo.switches_layouts = true;
  gloo.alone_in_process = true;
  [[maybe_unused]] Status st = r.add(std::move(gloo));
  assert(st.ok());

  // The NCCL backend (nccl_comm.h): host tensors reduced through a CUDA device.
  BackendInfo nccl;
  nccl.name = "nccl";
  nccl.kind = BackendKind::nccl;
  nccl.device = BackendDevice::cuda;
  nccl.needs_cuda = true;
#ifdef PARAPILOT_HAVE_NCCL
  nccl.built = true;
#else
  nccl.built = false;
  nccl.not_built = "this build has no NCCL (CMake found no CUDA/NCCL)";
#endif
  st = r.add(std::move(nccl));
  assert(st.ok());

  // World size 1: every collective is the identity (a single process, tests).
  BackendInfo local;
  local.name = "local";
  local.kind = BackendKind::local;
  local.multi_process = false;
  local.selectable = false;
  st = r.add(std::move(local));
  assert(st.ok());
  return r;
}

}  // namespace

Status BackendRegistry::add(BackendInfo info) {
  if (info.name.empty()) return Status::invalid_argument("a collective backend needs a name");
  for (const BackendInfo& b : backends_)
    if (b.name == info.name)
      return Status::invalid_argument("collective backend '" + info.name +
                                      "' is already registered");
  backends_.push_back(std::move(info));
  return {};
}

StatusOr<BackendInfo> BackendRegistry::find(std::string_view name) const {
  const auto at = std::find_if(backends_.begin(), backends_.end(),
                               [&](const BackendInfo& b) { return b.name == name; });
  if (at != backends_.end()) return *at;
  std::vector<std::string> known;
  for (const BackendInfo& b : backends_) known.push_back(b.name);
  std::string message(1, '\'');
  message.append(name).append("' is not a collective backend (known: ");
  return Status::invalid_argument(message + joined(known) + ")");
}

StatusOr<BackendInfo> BackendRegistry::find_built(std::string_view name) const {
  StatusOr<BackendInfo> b = find(name);
  if (b.ok() && !b->built)
    return Status::rejected("collective backend '" + b->name +
                            "' is not built here: " + b->not_built);
  return b;
}

StatusOr<BackendInfo> BackendRegistry::find_selectable(std::string_view name) const {
  StatusOr<BackendInfo> b = find(name);
  if (b.ok() && !b->selectable)
    return Status::invalid_argument(
        "collective backend '" + b->name +
        "' is not chosen by name (choose one of: " + joined(selectable_names()) + ")");
  return b;
}

std::vector<std::string> BackendRegistry::selectable_names() const {
  std::vector<std::string> names;
  for (const BackendInfo& b : backends_)
    if (b.selectable) names.push_back(b.name);
  return names;
}

const BackendRegistry& collective_backends() {
  static const BackendRegistry registry = make_registry();
  return registry;
}

}  // namespace parapilot::live
