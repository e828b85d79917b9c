#include "env/live/layout_state.h"

#include <algorithm>

namespace parapilot::live {

StatusOr<std::unique_ptr<LayoutState>> LayoutState::build(const LiveLayout& layout, int rank,
                                                          Collectives& world,
                                                          c10::intrusive_ptr<c10d::Store> store,
                                                          const LayoutStateOptions& o) {
  std::unique_ptr<LayoutState> s(new LayoutState());
  s->layout_ = layout;
  s->coords_ = coords_of(layout, rank);
  s->options_ = o;
  const int world_size = layout.world_size();
  const StatusOr<BackendInfo> backend = collective_backends().find_built(o.backend);
  if (!backend.ok()) return backend.status();

  // Groups, in the one order every rank follows.
  for (const GroupSpec& g : layout_groups(layout)) {
    const auto at = std::find(g.ranks.begin(), g.ranks.end(), rank);
    if (at == g.ranks.end()) continue;
    const int me = static_cast<int>(at - g.ranks.begin());
    const int size = static_cast<int>(g.ranks.size());
    const std::string kind = g.name.substr(0, 2);
    if (kind == "pp") {
      auto p = make_gloo_point_to_point(group_store(store, g.name), me, size, o.groups);
      if (!p.ok()) return p.status();
      s->pipe_ = std::move(*p);
      continue;
    }
    Collectives* used = nullptr;
    std::unique_ptr<Collectives> owned;
    if (size == world_size) {
      used = &world;
    } else {
      StatusOr<std::unique_ptr<Collectives>> c =
          make_collectives(*backend, group_store(store, g.name), me, size, o.groups, o.device);
      if (!c.ok()) return c.status();
      owned = std::move(*c);
      used = owned.get();
    }
    if (kind == "dp") {
      s->dp_owned_ = std::move(owned);
      s->dp_ = used;
    } else {
      s->tp_owned_ = std::move(owned);
      s->tp_.group = used;
    }
  }
  if (!s->dp_) {
    if (layout.dp == world_size) {
      s->dp_ = &world;
    } else {
      s->dp_owned_ = make_local_collectives();
      s->dp_ = s->dp_owned_.get();
    }
  }

  s->model_ = std::make_unique<StageModel>(o.model, layout, rank, o.seed, s->tp());
  const std::vector<LayerShape> full = model_layers(o.model);
  const std::vector<at::Tensor>& params = s->model_->parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ParamShard& sh = s->model_->shards()[i];
    s->local_layers_.push_back({full[static_cast<std::size_t>(sh.layer)].name, sh.shape});
    if (params[i].sizes().vec() != sh.shape)
      throw std::logic_error("rank_shards() disagrees with the stage model at " +
                             s->local_layers_.back().name);
  }
  s->optimizer_ = make_optimizer(params, o);
  s->gsync_ = std::make_unique<GradientSync>(s->local_layers_, o.seed);
  return s;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(std::vector<at::Tensor> params,
                                                        const LayoutStateOptions& options) {
  if (options.optimizer == "adam")
    return std::make_unique<torch::optim::Adam>(std::move(params),
                                                torch::optim::AdamOptions(options.lr));
  return std::make_unique<torch::optim::SGD>(std::move(params),
                                             torch::optim::SGDOptions(options.lr));
}

Status LayoutState::broadcast_parameters() {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> params = model_->parameters();
  return dp_->broadcast(params);
}

StatusOr<std::vector<at::Tensor>> LayoutState::gather_full_model(Collectives& world) {
  torch::NoGradGuard no_grad;
  const std::vector<at::Tensor>& params = model_->parameters();
  std::vector<at::Tensor> out;
  if (layout_.pure_data_parallel()) {
    for (const at::Tensor& p : params) out.push_back(p.detach().to(at::kFloat).clone());
    return out;
  }
  const std::vector<LayerShape> full = model_layers(options_.model);
  std::int64_t total = 0;
  for (const LayerShape& l : full) total += l.numel();
  at::Tensor flat = at::zeros({total}, at::kFloat);
  std::int64_t off = 0;
  for (const LayerShape& l : full) {
    out.push_back(flat.narrow(0, off, l.numel()).view(l.shape));
    off += l.numel();
  }
  const int rank = rank_of(layout_, coords_);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ParamShard& s = model_->shards()[i];
    if (writes_in_gather(layout_, rank, s))
      put_shard(out[static_cast<std::size_t>(s.layer)], params[i].detach().to(at::kFloat), s);
  }
  std::vector<at::Tensor> one{flat};
  if (Status st = world.all_reduce_sum(one); !st.ok()) return st;
  return out;
}

StatusOr<double> LayoutState::tp_replica_spread() {
  if (!tp_.group) return 0.0;
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> parts;
  const std::vector<at::Tensor>& params = model_->parameters();
  for (std::size_t i = 0; i < params.size(); ++i)
    if (model_->shards()[i].kind == ShardKind::replicated)
      parts.push_back(params[i].detach().reshape({-1}).to(at::kDouble));
  if (parts.empty()) return 0.0;
  at::Tensor hi = at::cat(parts), lo = -hi;
  if (Status st = tp_.group->all_reduce_max(hi); !st.ok()) return st;
  if (Status st = tp_.group->all_reduce_max(lo); !st.ok()) return st;
  return (hi + lo).max().item<double>();
}

}  // namespace parapilot::live
