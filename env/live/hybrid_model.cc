#include "env/live/hybrid_model.h"

#include <cassert>
#include <chrono>
#include <cmath>

namespace parapilot::live {

namespace {

using Clock = std::chrono::steady_clock;

struct BlockImpl : torch::nn::Module {
  BlockImpl(int d, int heads) : heads_(heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    qkv = register_module("qkv", torch::nn::Linear(d, 3 * d));
    proj = register_module("proj", torch::nn::Linear(d, d));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc1 = register_module("fc1", torch::nn::Linear(d, 4 * d));
    fc2 = register_module("fc2", torch::nn::Linear(4 * d, d));
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& mask) {
    const auto b = x.size(0), t = x.size(1), d = x.size(2);
    const auto dh = d / heads_;
    auto parts = qkv(ln1(x)).chunk(3, -1);
    auto q = parts[0].view({b, t, heads_, dh}).transpose(1, 2);
    auto k = parts[1].view({b, t, heads_, dh}).transpose(1, 2);
    auto v = parts[2].view({b, t, heads_, dh}).transpose(1, 2);
    auto att = q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(dh));
    att = att.masked_fill(mask, -1e9).softmax(-1);
    auto y = att.matmul(v).transpose(1, 2).contiguous().view({b, t, d});
    x = x + proj(y);
    return x + fc2(torch::gelu(fc1(ln2(x))));
  }
  int64_t heads_;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

// ---- the tensor-parallel conjugate operators -----------------------------------------------

TensorParallelGroup* group_of(torch::autograd::AutogradContext* ctx) {
  return reinterpret_cast<TensorParallelGroup*>(ctx->saved_data["group"].toInt());
}

// In place sum over the TP group, timed; a failure is kept in g.failure (and later sums skipped).
void tp_all_reduce(TensorParallelGroup& g, at::Tensor& t) {
  if (!g.failure.ok()) return;
  const auto t0 = Clock::now();
  std::vector<at::Tensor> one{t};
  const Status st = g.group->all_reduce_sum(one);
  g.all_reduce_ms += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  g.all_reduce_calls += 1;
  g.all_reduce_bytes += ring_all_reduce_bytes(
      static_cast<std::uint64_t>(t.numel()) * static_cast<std::uint64_t>(t.element_size()),
      g.group->world_size());
  if (!st.ok()) g.failure = st;
}

// f: identity forward, all-reduce of the gradient backward (before a column-parallel layer).
struct CopyToTensorParallel : torch::autograd::Function<CopyToTensorParallel> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            std::int64_t group) {
    ctx->saved_data["group"] = group;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    at::Tensor g = grads[0].contiguous().clone();
    tp_all_reduce(*group_of(ctx), g);
    return {g, at::Tensor()};
  }
};

// g: all-reduce forward, identity backward (after a row-parallel layer).
struct ReduceFromTensorParallel : torch::autograd::Function<ReduceFromTensorParallel> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            std::int64_t group) {
    at::Tensor y = x.contiguous().clone();
    tp_all_reduce(*reinterpret_cast<TensorParallelGroup*>(group), y);
    (void)ctx;
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

}  // namespace

// ---- the whole model --------------------------------------------------------------------------

LanguageModel::LanguageModel(const ModelConfig& c) : cfg(c) {
  const int d = c.d_model;
  if (c.kind == "transformer") {
    pos = register_parameter("pos", torch::randn({c.seq_len, d}) * 0.02);
    tok = register_module("tok", torch::nn::Embedding(ModelConfig::kVocab, d));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < c.layers; ++i) blocks->push_back(Block(d, c.heads));
    lnf = register_module("lnf", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    head = register_module("head", torch::nn::Linear(d, ModelConfig::kVocab));
  } else {
    tok = register_module("tok", torch::nn::Embedding(ModelConfig::kVocab, d));
    hidden = register_module("hidden", torch::nn::ModuleList());
    int in = c.context * d;
    for (int i = 0; i < c.layers; ++i) {
      hidden->push_back(torch::nn::Linear(in, 4 * d));
      in = 4 * d;
    }
    head = register_module("head", torch::nn::Linear(in, ModelConfig::kVocab));
  }
}

torch::Tensor LanguageModel::loss(const torch::Tensor& seq) {
  const auto t = seq.size(1) - 1;
  if (cfg.kind == "transformer") {
    auto input = seq.narrow(1, 0, t);
    auto x = tok(input) + pos.narrow(0, 0, t);
    auto mask = torch::ones({t, t}, torch::kBool).triu(1);
    for (auto& m : *blocks) x = m->as<Block>()->forward(x, mask);
    auto logits = head(lnf(x));
    return torch::nn::functional::cross_entropy(logits.reshape({-1, ModelConfig::kVocab}),
                                                seq.narrow(1, 1, t).reshape({-1}));
  }
  const int c = cfg.context;
  auto emb = tok(seq.narrow(1, 0, t));  // [B, t, d]
  auto win = emb.unfold(1, c, 1);       // [B, t-c+1, d, c]
  auto x = win.transpose(2, 3).reshape({seq.size(0), t - c + 1, c * cfg.d_model});
  for (auto& m : *hidden) x = torch::gelu(m->as<torch::nn::Linear>()->forward(x));
  auto logits = head(x);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, ModelConfig::kVocab}),
                                              seq.narrow(1, c, t - c + 1).reshape({-1}));
}

// ---- shards -----------------------------------------------------------------------------------

namespace {

// Calls f(full_slice, local_slice) for each of the shard's pieces (one per part).
template <class F>
void for_each_piece(const at::Tensor& full, const at::Tensor& local, const ParamShard& s, F&& f) {
  const int dim = s.kind == ShardKind::rows ? 0 : 1;
  const std::int64_t block = full.size(dim) / s.parts;
  const std::int64_t piece = block / s.pieces;
  for (int part = 0; part < s.parts; ++part)
    f(full.narrow(dim, part * block + s.piece * piece, piece),
      local.defined() ? local.narrow(dim, part * piece, piece) : at::Tensor());
}

}  // namespace

at::Tensor take_shard(const at::Tensor& full, const ParamShard& s) {
  if (s.kind == ShardKind::replicated) return full.clone();
  at::Tensor local = at::empty(s.shape, full.options());
  for_each_piece(full, local, s, [](const at::Tensor& from, at::Tensor to) { to.copy_(from); });
  return local;
}

void put_shard(at::Tensor& full, const at::Tensor& local, const ParamShard& s) {
  if (s.kind == ShardKind::replicated) {
    full.copy_(local);
    return;
  }
  for_each_piece(full, local, s, [](at::Tensor to, const at::Tensor& from) { to.copy_(from); });
}

// ---- one rank's stage -------------------------------------------------------------------------

StageModel::StageModel(const ModelConfig& model, const LiveLayout& layout, int rank,
                       std::uint64_t seed, TensorParallelGroup* tp)
    : cfg_(model), layout_(layout), tp_(layout.tp > 1 ? tp : nullptr) {
  assert(layout.tp == 1 || (tp && tp->group && tp->group->world_size() == layout.tp));
  const RankCoords c = coords_of(layout, rank);
  first_ = c.stage == 0;
  last_ = c.stage == layout.pp - 1;
  blocks_ = layout.stages[static_cast<std::size_t>(c.stage)];
  shards_ = rank_shards(layout, model, rank);
  // The whole model from the seed, as one process builds it; this rank keeps its part.
  torch::manual_seed(seed);
  auto whole = std::make_shared<LanguageModel>(model);
  if (layout.pure_data_parallel()) {
    whole_ = whole;
    params_ = whole_->parameters();
    return;
  }
  torch::NoGradGuard no_grad;
  const std::vector<at::Tensor> full = whole->parameters();
  for (const ParamShard& s : shards_) {
    at::Tensor t = take_shard(full[static_cast<std::size_t>(s.layer)], s);
    t.set_requires_grad(true);
    params_.push_back(t);
  }
}

std::vector<std::int64_t> StageModel::activation_shape(std::int64_t sequences) const {
  return {sequences, cfg_.seq_len, cfg_.d_model};
}

at::Tensor StageModel::block(int b, at::Tensor x, const at::Tensor& mask) {
  // Local tensors of block b of this stage: 12 per block, after pos and tok on the first stage.
  const int base = (first_ ? 2 : 0) + 12 * b;
  const auto bsz = x.size(0), t = x.size(1), d = x.size(2);
  const std::int64_t heads = cfg_.heads / layout_.tp, dh = d / cfg_.heads;
  const auto group = reinterpret_cast<std::int64_t>(tp_);
  auto f = [&](const at::Tensor& h) { return tp_ ? CopyToTensorParallel::apply(h, group) : h; };
  auto g = [&](const at::Tensor& h) { return tp_ ? ReduceFromTensorParallel::apply(h, group) : h; };
  at::Tensor h = f(at::layer_norm(x, {d}, p(base + 0), p(base + 1)));
  auto parts = at::linear(h, p(base + 2), p(base + 3)).chunk(3, -1);
  auto q = parts[0].view({bsz, t, heads, dh}).transpose(1, 2);
  auto k = parts[1].view({bsz, t, heads, dh}).transpose(1, 2);
  auto v = parts[2].view({bsz, t, heads, dh}).transpose(1, 2);
  auto att = q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(dh));
  att = att.masked_fill(mask, -1e9).softmax(-1);
  auto y = att.matmul(v).transpose(1, 2).contiguous().view({bsz, t, heads * dh});
  x = x + (g(at::linear(y, p(base + 4))) + p(base + 5));
  h = f(at::layer_norm(x, {d}, p(base + 6), p(base + 7)));
  auto u = torch::gelu(at::linear(h, p(base + 8), p(base + 9)));
  return x + (g(at::linear(u, p(base + 10))) + p(base + 11));
}

at::Tensor StageModel::forward(const at::Tensor& x_in, const at::Tensor& seq) {
  if (whole_) return whole_->loss(seq);
  const auto t = seq.size(1) - 1;
  at::Tensor x = x_in;
  if (first_) x = at::embedding(p(1), seq.narrow(1, 0, t)) + p(0).narrow(0, 0, t);
  const auto mask = torch::ones({t, t}, torch::kBool).triu(1);
  for (int b = 0; b < blocks_; ++b) x = block(b, x, mask);
  if (!last_) return x;
  const int n = static_cast<int>(params_.size());
  x = at::layer_norm(x, {cfg_.d_model}, p(n - 4), p(n - 3));
  const at::Tensor logits = at::linear(x, p(n - 2), p(n - 1));
  return torch::nn::functional::cross_entropy(logits.reshape({-1, ModelConfig::kVocab}),
                                              seq.narrow(1, 1, t).reshape({-1}));
}

}  // namespace parapilot::live
