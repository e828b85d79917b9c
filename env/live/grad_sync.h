// Gradient synchronisation of the live data-parallel worker: a collective interface (Gloo,
// NCCL or an in-process fake for tests), per-layer compressors with error feedback, and the
// bucketed all-reduce that combines them. Uses libtorch.
//
// Semantics: every rank passes its local gradient contribution (already weighted by its batch
// share); after sync() every rank holds the same sum over ranks (compressed layers: the sum of
// what each rank sent). A compressor's residual keeps, per rank, exactly what it did not send, and
// adds it to the next step's gradient (error feedback). What a layer owes (its residual) outlives
// a change of its compression: another compressor starts from it, and a layer that becomes
// none or fp16 adds it to its next gradient once (GradientSync::owed).
//
// Thread-safety: none; one GradientSync per worker thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "core/status.h"
#include "env/live/action.h"

namespace parapilot::live {

/// Collectives over the data-parallel group. Calls must be made in the same order on every rank.
/// A failure (a peer gone, a timeout) returns kCollectiveFailed naming the backend's reason;
/// after one, the group is not usable again.
class Collectives {
 public:
  virtual ~Collectives() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// In-place sum of each tensor across ranks (all launched, then all waited for).
  virtual Status all_reduce_sum(std::vector<at::Tensor>& tensors) = 0;
  /// In-place element-wise maximum across ranks.
  virtual Status all_reduce_max(at::Tensor& tensor) = 0;
  /// Every rank's `input` (same shape on all ranks), in rank order.
  virtual StatusOr<std::vector<at::Tensor>> all_gather(const at::Tensor& input) = 0;
  /// Copies rank 0's tensors to every rank.
  virtual Status broadcast(std::vector<at::Tensor>& tensors) = 0;
  /// "gloo", "nccl", "local".
  virtual std::string backend() const = 0;
};

/// World size 1: every collective is the identity (tests, single-process reference runs).
std::unique_ptr<Collectives> make_local_collectives();

/// Top-k sparsification with error feedback for one layer.
class TopKCompressor {
 public:
  /// Sends ceil(ratio * numel) elements per step.
  TopKCompressor(std::int64_t numel, double ratio);
  /// acc = grad + residual; picks the k largest |acc|; residual = acc with those zeroed.
  /// Returns (values, indices as int64) this rank sends.
  std::pair<at::Tensor, at::Tensor> compress(const at::Tensor& grad);
  const at::Tensor& residual() const { return residual_; }
  /// Replaces the residual by `residual` (numel elements, any shape; copied).
  void set_residual(const at::Tensor& residual);
  std::int64_t k() const { return k_; }

 private:
  std::int64_t k_;
  at::Tensor residual_;
};

/// PowerSGD of rank r with error feedback for one matrix-shaped layer (m x n, higher dimensions
/// folded into n). Every rank must construct it with the same seed (same initial Q).
class PowerSgdCompressor {
 public:
  PowerSgdCompressor(std::int64_t m, std::int64_t n, int rank, std::uint64_t seed);
  /// In place: `grad` (m x n) becomes the sum over ranks of the rank-r approximations; the
  /// residual keeps grad + old residual - (this rank's projection onto the shared basis).
  /// Returns the bytes this rank contributed to the two all-reduces.
  StatusOr<std::uint64_t> reduce(at::Tensor& grad, Collectives& c);
  const at::Tensor& residual() const { return residual_; }
  /// Replaces the residual by `residual` (m x n elements, any shape; copied).
  void set_residual(const at::Tensor& residual);
  /// The shared basis Q (n x rank) the next reduce() starts from.
  const at::Tensor& basis() const { return q_; }
  /// Replaces Q (n x rank; copied). Every rank of the group must set the same Q.
  void set_basis(const at::Tensor& q);

 private:
  std::int64_t m_, n_;
  int r_;
  at::Tensor q_, residual_;
};

/// Time and volume of one step's gradient synchronisation on this rank.
struct SyncStats {
  double all_reduce_ms = 0;
  std::uint64_t all_reduce_bytes = 0;  ///< bytes this rank sent (ring: 2(W-1)/W x payload).
  std::uint32_t all_reduce_calls = 0;
  double all_gather_ms = 0;
  std::uint64_t all_gather_bytes = 0;  ///< bytes this rank sent (ring: (W-1) x own payload).
  std::uint32_t all_gather_calls = 0;
  std::uint64_t payload_bytes = 0;  ///< tensor bytes this rank handed to collectives.
  std::uint32_t buckets = 0;        ///< collective calls queued at once at the peak.
};

/// Bytes a rank sends in a ring all-reduce / all-gather of `payload` bytes per rank.
std::uint64_t ring_all_reduce_bytes(std::uint64_t payload, int world);
std::uint64_t ring_all_gather_bytes(std::uint64_t payload, int world);

/// Reduces a model's gradients: layers set to none / fp16 go into buckets of bucket_bytes (0 =
/// one call per layer), top-k layers are all-gathered, PowerSGD layers use two small
/// all-reduces. Per-layer compressor state (residuals, PowerSGD's Q) lives here. When a layer's
/// compression or the compressors' parameters change, what it owes is kept: a top-k or
/// PowerSGD compressor starts from it as its residual, a none or fp16 layer adds it to its next
/// gradient; PowerSGD's Q is kept while its shape (n x rank) is, else made afresh from the seed.
class GradientSync {
 public:
  /// `seed` must be the same on every rank (PowerSGD's initial bases).
  GradientSync(std::vector<LayerShape> layers, std::uint64_t seed);
  /// Applies the per-layer compression (empty: all none) and its parameters. kInvalidArgument
  /// (nothing changed) when `compression` is neither empty nor one entry per layer.
  Status configure(const std::vector<Compression>& compression, double topk_ratio, int powersgd_rank,
                 std::int64_t bucket_bytes);
  /// In place: grads[i] becomes the sum over ranks (as compressed). `before_call` runs before
  /// each collective call (fault injection: link delay).
  /// A collective's failure is returned as it came (the gradients are then undefined).
  StatusOr<SyncStats> sync(std::vector<at::Tensor>& grads, Collectives& c,
                           const std::function<void()>& before_call = {});
  const std::vector<Compression>& compression() const { return compression_; }

  /// What layer i owes the model on this rank, in the layer's shape: its compressor's residual,
  /// or what its next sync adds to a none / fp16 gradient. Undefined when it owes nothing
  /// (no error feedback, or no step yet).
  at::Tensor owed(std::size_t i) const;
  /// Replaces what layer i owes by `owed` (the layer's numel; copied; undefined: nothing). A
  /// top-k or PowerSGD layer's compressor takes it as its residual, a none or fp16 layer adds
  /// it to its next gradient.
  void set_owed(std::size_t i, const at::Tensor& owed);
  /// PowerSGD's basis Q of layer i (n x rank), undefined when the layer has none yet.
  at::Tensor basis(std::size_t i) const;
  /// The Q layer i's PowerSGD compressor uses from its next sync when `q` has its shape
  /// (n x the PowerSGD rank); otherwise (or undefined) the compressor keeps the Q it has, and
  /// one built next starts from the seed's. Every rank of the DP group must set the same Q.
  void set_basis(std::size_t i, const at::Tensor& q);

 private:
  // Moves layer i's compressor state into pending_ / pending_basis_ and drops the compressors.
  void park(std::size_t i);
  std::vector<LayerShape> layers_;
  std::uint64_t seed_;
  std::vector<Compression> compression_;
  double topk_ratio_ = 0.01;
  int powersgd_rank_ = 4;
  std::int64_t bucket_bytes_ = 1 << 20;
  std::vector<std::unique_ptr<TopKCompressor>> topk_;
  std::vector<std::unique_ptr<PowerSgdCompressor>> powersgd_;
  // What a layer owes while it has no compressor (none / fp16, or not built yet), and the Q a
  // PowerSGD compressor built next starts from; undefined: nothing.
  std::vector<at::Tensor> pending_, pending_basis_;
};

}  // namespace parapilot::live
