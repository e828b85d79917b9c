#include "env/live/checkpoint_state.h"

#include <cstring>

#include "env/live/feedback_state.h"
#include "env/live/hybrid_model.h"

namespace parapilot::live {

namespace {

// The optimizer's key of a parameter's state (torch::optim's own).
std::string state_key(const at::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }

torch::optim::AdamParamState* adam_state_of(LayoutState& s, const at::Tensor& p) {
  auto* adam = dynamic_cast<torch::optim::Adam*>(&s.optimizer());
  if (!adam) return nullptr;
  auto it = adam->state().find(state_key(p));
  if (it == adam->state().end()) return nullptr;
  return static_cast<torch::optim::AdamParamState*>(it->second.get());
}

at::Tensor full_tensor(const std::vector<float>& values, const LayerShape& shape) {
  return at::from_blob(const_cast<float*>(values.data()), shape.shape, at::kFloat);
}

std::vector<float> values_of(const at::Tensor& t) {
  const at::Tensor c = t.contiguous().to(at::kFloat);
  std::vector<float> out(static_cast<std::size_t>(c.numel()));
  std::memcpy(out.data(), c.data_ptr<float>(), out.size() * 4);
  return out;
}

}  // namespace

StatusOr<TrainingState> gather_checkpoint(LayoutState& state, Collectives& world,
                                       const ModelConfig& model, const std::string& optimizer,
                                       std::uint64_t next_step) {
  torch::NoGradGuard no_grad;
  const std::vector<at::Tensor>& params = state.model().parameters();
  const std::vector<ParamShard>& shards = state.model().shards();
  // Adam state exists once the optimizer stepped (every parameter steps together).
  torch::optim::AdamParamState* first =
      params.empty() ? nullptr : adam_state_of(state, params.front());
  const int kinds = first ? 3 : 1;
  const std::vector<LayerShape> full = model_layers(model);
  std::int64_t total = 0;
  for (const LayerShape& l : full) total += l.numel();
  at::Tensor flat = at::zeros({kinds * total}, at::kFloat);
  // views[kind][layer]: the full tensor `layer` of one kind inside `flat`.
  std::vector<std::vector<at::Tensor>> views(static_cast<std::size_t>(kinds));
  std::int64_t off = 0;
  for (auto& kind : views)
    for (const LayerShape& l : full) {
      kind.push_back(flat.narrow(0, off, l.numel()).view(l.shape));
      off += l.numel();
    }
  const int rank = rank_of(state.layout(), state.coords());
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ParamShard& s = shards[i];
    if (!writes_in_gather(state.layout(), rank, s)) continue;
    const auto layer = static_cast<std::size_t>(s.layer);
    put_shard(views[0][layer], params[i].detach().to(at::kFloat), s);
    if (first) {
      torch::optim::AdamParamState* st = adam_state_of(state, params[i]);
      put_shard(views[1][layer], st->exp_avg().to(at::kFloat), s);
      put_shard(views[2][layer], st->exp_avg_sq().to(at::kFloat), s);
    }
  }
  std::vector<at::Tensor> one{flat};
  if (Status st = world.all_reduce_sum(one); !st.ok()) return st;
  // What compression owes, one slot per replica (a resume under as many gets its own back).
  const StatusOr<FeedbackState> owed = gather_feedback(state, world, state.layout().dp);
  if (!owed.ok()) return owed.status();
  TrainingState c;
  for (std::size_t l = 0; l < full.size(); ++l) {
    const at::Tensor& residual = owed->residual[l];
    const at::Tensor& basis = owed->basis[l];
    if (!residual.defined() && !basis.defined()) continue;
    TrainingState::TensorFeedback fb;
    fb.layer = static_cast<int>(l);
    if (residual.defined()) fb.residual = values_of(residual);
    if (basis.defined()) {
      fb.basis_shape = basis.sizes().vec();
      fb.basis = values_of(basis);
    }
    c.feedback.push_back(std::move(fb));
  }
  c.feedback_replicas = c.feedback.empty() ? 0 : owed->slots;
  c.model = model;
  c.optimizer = optimizer;
  c.next_step = next_step;
  c.adam_step = first ? first->step() : 0;
  std::vector<std::vector<float>>* out[] = {&c.params, &c.exp_avg, &c.exp_avg_sq};
  for (int k = 0; k < kinds; ++k)
    for (const at::Tensor& v : views[static_cast<std::size_t>(k)]) {
      const at::Tensor t = v.contiguous();
      std::vector<float> values(static_cast<std::size_t>(t.numel()));
      std::memcpy(values.data(), t.data_ptr<float>(), values.size() * 4);
      out[k]->push_back(std::move(values));
    }
  return c;
}

void install_checkpoint(LayoutState& state, const TrainingState& c) {
  torch::NoGradGuard no_grad;
  const std::vector<LayerShape> full = model_layers(c.model);
  const std::vector<at::Tensor>& params = state.model().parameters();
  const std::vector<ParamShard>& shards = state.model().shards();
  auto* adam = dynamic_cast<torch::optim::Adam*>(&state.optimizer());
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto layer = static_cast<std::size_t>(shards[i].layer);
    at::Tensor p = params[i];
    p.copy_(take_shard(full_tensor(c.params[layer], full[layer]), shards[i]));
    if (adam && !c.exp_avg.empty()) {
      auto st = std::make_unique<torch::optim::AdamParamState>();
      st->step(c.adam_step);
      st->exp_avg(take_shard(full_tensor(c.exp_avg[layer], full[layer]), shards[i]).clone());
      st->exp_avg_sq(take_shard(full_tensor(c.exp_avg_sq[layer], full[layer]), shards[i]).clone());
      adam->state()[state_key(p)] = std::move(st);
    }
  }
  FeedbackState owed;
  owed.slots = c.feedback_replicas;
  owed.residual.resize(full.size());
  owed.basis.resize(full.size());
  for (const TrainingState::TensorFeedback& fb : c.feedback) {
    const auto layer = static_cast<std::size_t>(fb.layer);
    if (!fb.residual.empty()) {
      std::vector<std::int64_t> shape{c.feedback_replicas};
      shape.insert(shape.end(), full[layer].shape.begin(), full[layer].shape.end());
      owed.residual[layer] =
          at::from_blob(const_cast<float*>(fb.residual.data()), shape, at::kFloat);
    }
    if (!fb.basis.empty())
      owed.basis[layer] =
          at::from_blob(const_cast<float*>(fb.basis.data()), fb.basis_shape, at::kFloat);
  }
  install_feedback(state, owed);
}

}  // namespace parapilot::live
