// The worker's model (libtorch): the whole byte-level language model as one process trains it,
// and one rank's part of it under a hybrid layout: the blocks of its pipeline stage (the
// embedding with the first stage, the final norm, output layer and loss with the last), with
// Megatron-style tensor-parallel attention and MLP inside its TP group (layout.h says which
// part of every tensor a rank holds).
//
// Tensor parallel: a block computes
//     h = f(ln1(x)); y = attention over this rank's heads of qkv_shard(h);
//     x = x + g(y proj_shard^T) + proj.bias; the MLP the same with fc1 (column) and fc2 (row),
// where f is the identity forward and an all-reduce (sum) of the gradient backward, and g an
// all-reduce forward and the identity backward. Every TP rank so holds the same residual stream,
// the same loss and the same full gradient of every replicated tensor.
//
// Initialisation: every rank builds the whole model from the seed exactly as one process does
// and keeps its shards, so a layout starts from the same parameters as the single-process run.
//
// Thread-safety: none; one model per training thread.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "env/live/action.h"
#include "env/live/grad_sync.h"
#include "env/live/layout.h"

namespace parapilot::live {

/// The whole model (transformer or MLP), parameters in model_layers() order.
struct LanguageModel : torch::nn::Module {
  explicit LanguageModel(const ModelConfig& c);
  /// Mean cross-entropy of predicting seq[:, 1:] from what precedes it.
  torch::Tensor loss(const torch::Tensor& seq);

  ModelConfig cfg;
  torch::Tensor pos;
  torch::nn::Embedding tok{nullptr};
  torch::nn::ModuleList blocks{nullptr}, hidden{nullptr};
  torch::nn::LayerNorm lnf{nullptr};
  torch::nn::Linear head{nullptr};
};

/// A TP group as the model uses it, with the time its all-reduces took.
struct TensorParallelGroup {
  Collectives* group = nullptr;  ///< size = layout.tp (> 1).
  double all_reduce_ms = 0;
  std::uint64_t all_reduce_bytes = 0;  ///< bytes this rank sent (ring all-reduce).
  std::uint32_t all_reduce_calls = 0;
  /// The first failed all-reduce's Status (forward and backward cannot return one): later
  /// all-reduces are skipped, leaving the tensors as they are, and the pipeline step returns it
  /// after the pass (pipeline.h). Not reset: a group is not usable after a failure.
  Status failure;
};

/// This rank's part of the model under `layout`.
class StageModel {
 public:
  /// Preconditions: `layout` is valid for `model` (parse_layout), tp > 1 only with a TP group of
  /// that size (outliving this), tp or pp > 1 only for the transformer.
  StageModel(const ModelConfig& model, const LiveLayout& layout, int rank, std::uint64_t seed,
             TensorParallelGroup* tp);

  bool first_stage() const { return first_; }
  bool last_stage() const { return last_; }
  /// This rank's tensors in rank_shards() order (leaf tensors that require grad).
  const std::vector<at::Tensor>& parameters() const { return params_; }
  const std::vector<ParamShard>& shards() const { return shards_; }
  /// The activation a stage passes on for a microbatch of `sequences`: [sequences, seq_len, d].
  std::vector<std::int64_t> activation_shape(std::int64_t sequences) const;

  /// One microbatch through this stage. `seq` is the microbatch ([B, seq_len + 1] bytes as
  /// int64); `x` the previous stage's activation (ignored on the first stage). Returns the
  /// mean loss on the last stage, else the activation for the next stage.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& seq);

 private:
  at::Tensor block(int b, at::Tensor x, const at::Tensor& mask);
  at::Tensor& p(int local) { return params_[static_cast<std::size_t>(local)]; }

  ModelConfig cfg_;
  LiveLayout layout_;
  bool first_ = true, last_ = true;
  int blocks_ = 0;
  std::shared_ptr<LanguageModel> whole_;  ///< pure data parallel: the whole model as is.
  TensorParallelGroup* tp_ = nullptr;
  std::vector<ParamShard> shards_;
  std::vector<at::Tensor> params_;
};

/// This rank's part `shard` of the full tensor `full`.
at::Tensor take_shard(const at::Tensor& full, const ParamShard& shard);
/// Writes `local` (this rank's part `shard`) into its place in `full`.
void put_shard(at::Tensor& full, const at::Tensor& local, const ParamShard& shard);

}  // namespace parapilot::live
