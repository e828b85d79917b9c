// Everything one rank holds for one layout (libtorch): its data-parallel, tensor-parallel and
// pipeline groups, its part of the model, the optimizer over that part, and the gradient
// reduction (with its compressors' error-feedback state). The training loop reads the layout
// only through this object, so switching layouts is building another one for the new layout
// and moving the state the ranks' new shards need into it (layout.h: rank_shards says which
// part of every tensor a rank holds under a layout).
//
// Thread-safety: none; one training thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "core/status.h"
#include "env/live/collectives.h"
#include "env/live/grad_sync.h"
#include "env/live/hybrid_model.h"
#include "env/live/layout.h"

namespace parapilot::live {

struct LayoutStateOptions {
  ModelConfig model;
  std::uint64_t seed = 1;          ///< model initialisation and PowerSGD bases (same on all ranks).
  std::string optimizer = "adam";  ///< "adam" or "sgd".
  double lr = 3e-3;
  /// DP and TP groups' backend (collective_backends.h; pipelines use Gloo).
  std::string backend = "gloo";
  int device = 0;                ///< nccl: the CUDA device.
  GroupOptions groups;
};

/// The job's optimizer (options.optimizer, options.lr; torch's defaults otherwise) over
/// `params`: every LayoutState's, and the one a layout switch replays streamed updates with.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<at::Tensor> params,
                                                        const LayoutStateOptions& options);

class LayoutState {
 public:
  /// Builds `rank`'s part of `layout` (valid for options.model: parse_layout). Groups are built
  /// over `store` in layout_groups() order (a group of the whole world reuses `world`, which
  /// must outlive the state); `store` may be null when the layout has no group. The failed
  /// rendezvous's Status (kCollectiveFailed); the registry's when options.backend is unknown or
  /// not built here.
  static StatusOr<std::unique_ptr<LayoutState>> build(const LiveLayout& layout, int rank,
                                                      Collectives& world,
                                                      c10::intrusive_ptr<c10d::Store> store,
                                                      const LayoutStateOptions& options);

  const LiveLayout& layout() const { return layout_; }
  const LayoutStateOptions& options() const { return options_; }
  const RankCoords& coords() const { return coords_; }
  StageModel& model() { return *model_; }
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  GradientSync& gradient_sync() { return *gsync_; }
  /// The DP group (same stage and TP index; size dp).
  Collectives& dp() { return *dp_; }
  /// The model's TP group and its all-reduce time; null when tp == 1.
  TensorParallelGroup* tp() { return tp_.group ? &tp_ : nullptr; }
  /// The replica's pipeline (group rank = stage); null when pp == 1.
  PointToPoint* pipeline() { return pipe_.get(); }

  /// This rank's tensors as GradientSync layers (names of the full model's tensors).
  const std::vector<LayerShape>& local_layers() const { return local_layers_; }
  /// The per-layer entries of a full-model list (model_layers order) for this rank's tensors.
  template <class T>
  std::vector<T> local_entries(const std::vector<T>& full) const {
    std::vector<T> out;
    for (const ParamShard& s : model_->shards())
      out.push_back(full[static_cast<std::size_t>(s.layer)]);
    return out;
  }

  /// Copies the parameters of DP-group rank 0 to the group (as DDP does at the start).
  Status broadcast_parameters();
  /// The whole model, model_layers order, on every rank of `world`: with pure data parallel
  /// this rank's tensors; otherwise one sum all-reduce over the world of zero-filled full
  /// tensors into which exactly one rank (writes_in_gather) copied each element — exact,
  /// since adding zeros is. Every rank of the world must call it.
  StatusOr<std::vector<at::Tensor>> gather_full_model(Collectives& world);
  /// The largest difference, over the TP group, of any element of a tensor replicated within
  /// it (0 when the TP ranks agree bit for bit); 0 without TP. The whole TP group must call it.
  StatusOr<double> tp_replica_spread();

 private:
  LayoutState() = default;

  LiveLayout layout_;
  RankCoords coords_;
  LayoutStateOptions options_;
  std::unique_ptr<Collectives> dp_owned_, tp_owned_;
  Collectives* dp_ = nullptr;
  TensorParallelGroup tp_;
  std::unique_ptr<PointToPoint> pipe_;
  std::unique_ptr<StageModel> model_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::vector<LayerShape> local_layers_;
  std::unique_ptr<GradientSync> gsync_;
};

}  // namespace parapilot::live
