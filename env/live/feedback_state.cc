#include "env/live/feedback_state.h"

#include <cassert>

#include "env/live/hybrid_model.h"

namespace parapilot::live {

namespace {

// Into how many TP pieces `layout` cuts each full tensor (1: replicated).
std::vector<std::int64_t> pieces_of(const LiveLayout& layout, const ModelConfig& model) {
  std::vector<std::int64_t> out(model_layers(model).size(), 1);
  for (int r = 0; r < layout.world_size(); ++r)
    for (const ParamShard& s : rank_shards(layout, model, r))
      if (s.kind != ShardKind::replicated) out[static_cast<std::size_t>(s.layer)] = s.pieces;
  return out;
}

}  // namespace

bool FeedbackState::empty() const {
  for (const at::Tensor& t : residual)
    if (t.defined()) return false;
  for (const at::Tensor& t : basis)
    if (t.defined()) return false;
  return true;
}

StatusOr<FeedbackState> gather_feedback(LayoutState& state, Collectives& world, int slots) {
  assert(slots >= 1);
  torch::NoGradGuard no_grad;
  const ModelConfig& model = state.options().model;
  const std::vector<LayerShape> full = model_layers(model);
  const auto n_layers = static_cast<std::int64_t>(full.size());
  const std::vector<ParamShard>& shards = state.model().shards();
  GradientSync& sync = state.gradient_sync();
  const RankCoords me = state.coords();

  // The header: per tensor, whether some rank owes anything, and its bases' n and rank.
  at::Tensor header = at::zeros({3 * n_layers}, at::kDouble);
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const std::int64_t layer = shards[i].layer;
    if (sync.owed(i).defined()) header[layer].fill_(1);
    if (const at::Tensor q = sync.basis(i); q.defined()) {
      header[n_layers + layer].fill_(static_cast<double>(q.size(0)));
      header[2 * n_layers + layer].fill_(static_cast<double>(q.size(1)));
    }
  }
  if (Status st = world.all_reduce_max(header); !st.ok()) return st;
  const auto h = header.to(at::kLong);
  const auto* hv = h.data_ptr<std::int64_t>();

  FeedbackState f;
  f.slots = slots;
  f.residual.resize(full.size());
  f.basis.resize(full.size());
  const std::vector<std::int64_t> pieces = pieces_of(state.layout(), model);
  std::int64_t total = 0;
  for (std::int64_t l = 0; l < n_layers; ++l) {
    if (hv[l]) total += slots * full[static_cast<std::size_t>(l)].numel();
    if (hv[n_layers + l])
      total += pieces[static_cast<std::size_t>(l)] * hv[n_layers + l] * hv[2 * n_layers + l];
  }
  if (total == 0) return f;
  at::Tensor flat = at::zeros({total}, at::kFloat);
  std::int64_t off = 0;
  for (std::int64_t l = 0; l < n_layers; ++l) {
    const auto li = static_cast<std::size_t>(l);
    if (hv[l]) {
      std::vector<std::int64_t> shape{slots};
      shape.insert(shape.end(), full[li].shape.begin(), full[li].shape.end());
      f.residual[li] = flat.narrow(0, off, slots * full[li].numel()).view(shape);
      off += slots * full[li].numel();
    }
    if (hv[n_layers + l]) {
      const std::int64_t n = hv[n_layers + l], r = hv[2 * n_layers + l];
      f.basis[li] = flat.narrow(0, off, pieces[li] * n * r).view({pieces[li], n, r});
      off += pieces[li] * n * r;
    }
  }
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const ParamShard& s = shards[i];
    const auto li = static_cast<std::size_t>(s.layer);
    // A replicated tensor's TP copies are mirrors: TP index 0 speaks for them.
    if (s.kind == ShardKind::replicated && me.tp != 0) continue;
    if (const at::Tensor owed = sync.owed(i); owed.defined()) {
      at::Tensor slot = f.residual[li][me.dp % slots];
      put_shard(slot, owed.to(at::kFloat), s);
    }
    // Q is the same on every replica: replica 0's.
    if (const at::Tensor q = sync.basis(i); q.defined() && me.dp == 0) {
      const int piece = s.kind == ShardKind::replicated ? 0 : s.piece;
      f.basis[li][piece].copy_(q);
    }
  }
  std::vector<at::Tensor> one{flat};
  if (Status st = world.all_reduce_sum(one); !st.ok()) return st;
  return f;
}

void install_feedback(LayoutState& state, const FeedbackState& f) {
  torch::NoGradGuard no_grad;
  const std::vector<ParamShard>& shards = state.model().shards();
  GradientSync& sync = state.gradient_sync();
  const RankCoords me = state.coords();
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const ParamShard& s = shards[i];
    const auto li = static_cast<std::size_t>(s.layer);
    if (li < f.residual.size() && f.residual[li].defined()) {
      at::Tensor owed;
      for (int slot = me.dp; slot < f.slots; slot += state.layout().dp) {
        const at::Tensor part = take_shard(f.residual[li][slot], s);
        owed = owed.defined() ? owed + part : part.clone();
      }
      sync.set_owed(i, owed);
    }
    if (li < f.basis.size() && f.basis[li].defined()) {
      const at::Tensor& b = f.basis[li];
      const std::int64_t cut = s.kind == ShardKind::replicated ? 1 : s.pieces;
      if (b.size(0) == cut) sync.set_basis(i, b[s.kind == ShardKind::replicated ? 0 : s.piece]);
    }
  }
}

}  // namespace parapilot::live
