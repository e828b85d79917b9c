#include "env/live/grad_sync.h"

#include <algorithm>
#include <cmath>

namespace parapilot::live {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

class LocalCollectives final : public Collectives {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  Status all_reduce_sum(std::vector<at::Tensor>&) override { return {}; }
  Status all_reduce_max(at::Tensor&) override { return {}; }
  StatusOr<std::vector<at::Tensor>> all_gather(const at::Tensor& input) override {
    return std::vector<at::Tensor>{input.clone()};
  }
  Status broadcast(std::vector<at::Tensor>&) override { return {}; }
  std::string backend() const override { return "local"; }
};

std::uint64_t tensor_bytes(const at::Tensor& t) {
  return static_cast<std::uint64_t>(t.numel()) * static_cast<std::uint64_t>(t.element_size());
}

/// Orthonormalises the columns of p (m x r) in place (Gram-Schmidt, as PowerSGD does).
void orthogonalize(at::Tensor& p) {
  const std::int64_t r = p.size(1);
  for (std::int64_t i = 0; i < r; ++i) {
    at::Tensor col = p.narrow(1, i, 1);
    col.div_(col.norm().clamp_min(1e-8));
    if (i + 1 < r) {
      at::Tensor rest = p.narrow(1, i + 1, r - i - 1);
      rest.sub_(col * (col.t().mm(rest)));
    }
  }
}

}  // namespace

std::unique_ptr<Collectives> make_local_collectives() {
  return std::make_unique<LocalCollectives>();
}

std::uint64_t ring_all_reduce_bytes(std::uint64_t payload, int world) {
  if (world <= 1) return 0;
  return payload * 2 * static_cast<std::uint64_t>(world - 1) / static_cast<std::uint64_t>(world);
}

std::uint64_t ring_all_gather_bytes(std::uint64_t payload, int world) {
  if (world <= 1) return 0;
  return payload * static_cast<std::uint64_t>(world - 1);
}

TopKCompressor::TopKCompressor(std::int64_t numel, double ratio)
    : k_(std::clamp<std::int64_t>(
          static_cast<std::int64_t>(std::ceil(ratio * static_cast<double>(numel))), 1, numel)),
      residual_(at::zeros({numel}, at::kFloat)) {}

std::pair<at::Tensor, at::Tensor> TopKCompressor::compress(const at::Tensor& grad) {
  at::Tensor acc = grad.reshape({-1}) + residual_;
  at::Tensor idx = std::get<1>(acc.abs().topk(k_, 0, true, false));
  at::Tensor values = acc.index_select(0, idx);
  acc.index_fill_(0, idx, 0.0);
  residual_ = acc;
  return {values, idx};
}

void TopKCompressor::set_residual(const at::Tensor& residual) {
  residual_ = residual.reshape({-1}).to(at::kFloat).clone();
}

PowerSgdCompressor::PowerSgdCompressor(std::int64_t m, std::int64_t n, int rank, std::uint64_t seed)
    : m_(m), n_(n), r_(rank), residual_(at::zeros({m, n}, at::kFloat)) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  q_ = at::randn({n, rank}, gen, at::kFloat);
  orthogonalize(q_);
}

StatusOr<std::uint64_t> PowerSgdCompressor::reduce(at::Tensor& grad, Collectives& c) {
  at::Tensor g = grad.reshape({m_, n_});
  at::Tensor acc = g + residual_;
  at::Tensor p = acc.mm(q_);  // m x r
  std::vector<at::Tensor> ps{p};
  if (Status st = c.all_reduce_sum(ps); !st.ok()) return st;
  orthogonalize(p);
  at::Tensor q = acc.t().mm(p);   // n x r: this rank's share of the next basis
  residual_ = acc - p.mm(q.t());  // what the local projection did not capture
  std::vector<at::Tensor> qs{q};
  if (Status st = c.all_reduce_sum(qs); !st.ok()) return st;
  q_ = q.clone();
  g.copy_(p.mm(q.t()));
  return tensor_bytes(p) + tensor_bytes(q);
}

void PowerSgdCompressor::set_residual(const at::Tensor& residual) {
  residual_ = residual.reshape({m_, n_}).to(at::kFloat).clone();
}

void PowerSgdCompressor::set_basis(const at::Tensor& q) {
  q_ = q.reshape({n_, r_}).to(at::kFloat).clone();
}

GradientSync::GradientSync(std::vector<LayerShape> layers, std::uint64_t seed)
    : layers_(std::move(layers)), seed_(seed) {
  compression_.assign(layers_.size(), Compression::none);
  topk_.resize(layers_.size());
  powersgd_.resize(layers_.size());
  pending_.resize(layers_.size());
  pending_basis_.resize(layers_.size());
}

void GradientSync::park(std::size_t i) {
  if (topk_[i]) pending_[i] = topk_[i]->residual().view(layers_[i].shape);
  if (powersgd_[i]) {
    pending_[i] = powersgd_[i]->residual().view(layers_[i].shape);
    pending_basis_[i] = powersgd_[i]->basis();
  }
  topk_[i].reset();
  powersgd_[i].reset();
}

at::Tensor GradientSync::owed(std::size_t i) const {
  if (topk_[i]) return topk_[i]->residual().view(layers_[i].shape);
  if (powersgd_[i]) return powersgd_[i]->residual().view(layers_[i].shape);
  return pending_[i];
}

void GradientSync::set_owed(std::size_t i, const at::Tensor& owed) {
  const at::Tensor value =
      owed.defined() ? owed.reshape(layers_[i].shape).to(at::kFloat).clone() : at::Tensor();
  if (topk_[i] || powersgd_[i]) {
    const at::Tensor residual = value.defined() ? value : at::zeros(layers_[i].shape, at::kFloat);
    if (topk_[i]) topk_[i]->set_residual(residual);
    if (powersgd_[i]) powersgd_[i]->set_residual(residual);
    return;
  }
  pending_[i] = value;
}

at::Tensor GradientSync::basis(std::size_t i) const {
  return powersgd_[i] ? powersgd_[i]->basis() : pending_basis_[i];
}

void GradientSync::set_basis(std::size_t i, const at::Tensor& q) {
  if (!powersgd_[i]) {
    pending_basis_[i] = q.defined() ? q.to(at::kFloat).clone() : at::Tensor();
    return;
  }
  if (q.defined() && q.sizes() == powersgd_[i]->basis().sizes()) powersgd_[i]->set_basis(q);
}

Status GradientSync::configure(const std::vector<Compression>& compression, double topk_ratio,
                               int powersgd_rank, std::int64_t bucket_bytes) {
  std::vector<Compression> next = compression;
  if (next.empty()) next.assign(layers_.size(), Compression::none);
  if (next.size() != layers_.size())
    return Status::invalid_argument("compression plan has " + std::to_string(next.size()) +
                                    " layers; the model has " + std::to_string(layers_.size()));
  const bool params_changed = topk_ratio != topk_ratio_ || powersgd_rank != powersgd_rank_;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    // A matrix with fewer than 2 dimensions cannot be factored: PowerSGD falls back to fp16.
    if (next[i] == Compression::powersgd && layers_[i].shape.size() < 2)
      next[i] = Compression::fp16;
    // What the layer owes (and PowerSGD's Q) waits for the next compressor or dense sync.
    if (next[i] != compression_[i] || params_changed) park(i);
  }
  compression_ = std::move(next);
  topk_ratio_ = topk_ratio;
  powersgd_rank_ = powersgd_rank;
  bucket_bytes_ = bucket_bytes;
  return {};
}

StatusOr<SyncStats> GradientSync::sync(std::vector<at::Tensor>& grads, Collectives& c,
                                       const std::function<void()>& before_call) {
  SyncStats s;
  const int world = c.world_size();
  auto call = [&] {
    if (before_call) before_call();
  };
  // What a dense layer still owes from an earlier compression goes with its next gradient.
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const bool dense = compression_[i] == Compression::none || compression_[i] == Compression::fp16;
    if (dense && pending_[i].defined()) {
      grads[i].add_(pending_[i].view(grads[i].sizes()));
      pending_[i] = at::Tensor();
    }
  }
  // Buckets of dense layers (float32 and float16 separately), in layer order.
  for (const Compression dense : {Compression::none, Compression::fp16}) {
    const std::int64_t elem = dense == Compression::fp16 ? 2 : 4;
    std::vector<std::vector<std::size_t>> buckets;
    std::int64_t bytes = 0;
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      if (compression_[i] != dense) continue;
      const std::int64_t b = layers_[i].numel() * elem;
      if (buckets.empty() || bucket_bytes_ == 0 || bytes + b > bucket_bytes_) {
        buckets.emplace_back();
        bytes = 0;
      }
      buckets.back().push_back(i);
      bytes += b;
    }
    if (buckets.empty()) continue;
    std::vector<at::Tensor> flats;
    for (const auto& bucket : buckets) {
      std::vector<at::Tensor> parts;
      for (std::size_t i : bucket) parts.push_back(grads[i].reshape({-1}));
      at::Tensor flat = at::cat(parts);
      if (dense == Compression::fp16) flat = flat.to(at::kHalf);
      s.payload_bytes += tensor_bytes(flat);
      s.all_reduce_bytes += ring_all_reduce_bytes(tensor_bytes(flat), world);
      flats.push_back(flat);
    }
    call();
    const auto t0 = Clock::now();
    if (Status st = c.all_reduce_sum(flats); !st.ok()) return st;
    s.all_reduce_ms += ms_since(t0);
    s.all_reduce_calls += static_cast<std::uint32_t>(flats.size());
    s.buckets = std::max<std::uint32_t>(s.buckets, static_cast<std::uint32_t>(flats.size()));
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      at::Tensor flat = flats[b].to(at::kFloat);
      std::int64_t off = 0;
      for (std::size_t i : buckets[b]) {
        const std::int64_t n = layers_[i].numel();
        grads[i].copy_(flat.narrow(0, off, n).view(grads[i].sizes()));
        off += n;
      }
    }
  }
  // Compressed layers.
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    if (compression_[i] == Compression::topk) {
      if (!topk_[i]) {
        topk_[i] = std::make_unique<TopKCompressor>(layers_[i].numel(), topk_ratio_);
        if (pending_[i].defined()) topk_[i]->set_residual(pending_[i]);
        pending_[i] = at::Tensor();
      }
      auto [values, idx] = topk_[i]->compress(grads[i]);
      call();
      const auto t0 = Clock::now();
      StatusOr<std::vector<at::Tensor>> all_values = c.all_gather(values);
      if (!all_values.ok()) return all_values.status();
      StatusOr<std::vector<at::Tensor>> all_idx = c.all_gather(idx);
      if (!all_idx.ok()) return all_idx.status();
      s.all_gather_ms += ms_since(t0);
      s.all_gather_calls += 2;
      const std::uint64_t payload = tensor_bytes(values) + tensor_bytes(idx);
      s.payload_bytes += payload;
      s.all_gather_bytes += ring_all_gather_bytes(payload, world);
      at::Tensor sum = at::zeros({layers_[i].numel()}, at::kFloat);
      for (std::size_t r = 0; r < all_values->size(); ++r)
        sum.index_add_(0, (*all_idx)[r], (*all_values)[r]);
      grads[i].copy_(sum.view(grads[i].sizes()));
    } else if (compression_[i] == Compression::powersgd) {
      const std::int64_t m = layers_[i].shape[0];
      const std::int64_t n = layers_[i].numel() / m;
      if (!powersgd_[i]) {
        powersgd_[i] =
            std::make_unique<PowerSgdCompressor>(m, n, powersgd_rank_, seed_ * 1000003u + i);
        if (pending_[i].defined()) powersgd_[i]->set_residual(pending_[i]);
        const at::Tensor& q = pending_basis_[i];
        if (q.defined() && q.sizes() == powersgd_[i]->basis().sizes()) powersgd_[i]->set_basis(q);
        pending_[i] = at::Tensor();
        pending_basis_[i] = at::Tensor();
      }
      call();
      const auto t0 = Clock::now();
      const StatusOr<std::uint64_t> reduced = powersgd_[i]->reduce(grads[i], c);
      if (!reduced.ok()) return reduced.status();
      const std::uint64_t payload = *reduced;
      s.all_reduce_ms += ms_since(t0);
      s.all_reduce_calls += 2;
      s.payload_bytes += payload;
      s.all_reduce_bytes += ring_all_reduce_bytes(payload, world);
    }
  }
  return s;
}

}  // namespace parapilot::live
