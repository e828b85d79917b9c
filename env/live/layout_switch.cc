#include "env/live/layout_switch.h"

#include <algorithm>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "env/live/feedback_state.h"

namespace parapilot::live {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Tags on a plan's transfer group: the boundary move, the snapshot's header and data, and each
// step's gradients (a tag per step, so a late message can never be taken for another step's).
constexpr std::uint32_t kMoveTag = 1;
constexpr std::uint32_t kSnapshotHeaderTag = 2;
constexpr std::uint32_t kSnapshotTag = 3;
std::uint32_t gradient_tag(std::uint64_t step) {
  return 16 + static_cast<std::uint32_t>(step & 0xFFFFFF);
}

// The part of `local` (this rank's tensor of a shard covering `held`) that piece `p` names, as
// views: the same range in each of the shard's parts, in the shard's own coordinates.
std::vector<at::Tensor> piece_views(const at::Tensor& local, const ShardRange& held,
                                    const TransferPiece& p) {
  if (p.dim < 0) return {local.view({-1}).narrow(0, p.begin, p.end - p.begin)};
  const std::int64_t block = local.size(p.dim) / p.parts;
  std::vector<at::Tensor> out;
  for (int part = 0; part < p.parts; ++part)
    out.push_back(local.narrow(p.dim, part * block + (p.begin - held.begin), p.end - p.begin));
  return out;
}

std::string state_key(const at::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }

// The tensors of one parameter that a switch moves or streams.
enum class Kind { param, exp_avg, exp_avg_sq, grad };

// Adam's state of `p` in `opt`, or null (SGD, or Adam before its first step).
torch::optim::AdamParamState* adam_state_of(torch::optim::Optimizer& opt, const at::Tensor& p) {
  auto* adam = dynamic_cast<torch::optim::Adam*>(&opt);
  if (!adam) return nullptr;
  auto it = adam->state().find(state_key(p));
  return it == adam->state().end() ? nullptr
                                   : static_cast<torch::optim::AdamParamState*>(it->second.get());
}

// One rank's tensors of a layout state, found by full-model tensor, with the range each holds.
class Holdings {
 public:
  Holdings(LayoutState& s, const ModelConfig& model) : s_(s) {
    const std::vector<ParamShard>& shards = s.model().shards();
    for (std::size_t i = 0; i < shards.size(); ++i)
      at_[shards[i].layer] = {i, shard_range(shards[i], model)};
  }
  // The views of `pieces` (in order, each piece's parts in order) in tensor kind `k`; null
  // tensors where Adam has no state yet.
  std::vector<at::Tensor> views(const std::vector<const TransferPiece*>& pieces, Kind k) const {
    std::vector<at::Tensor> out;
    for (const TransferPiece* p : pieces) {
      const Local& l = at_.at(p->layer);
      const at::Tensor& param = s_.model().parameters()[l.index];
      at::Tensor t;
      if (k == Kind::param) {
        t = param.detach();
      } else if (k == Kind::grad) {
        t = param.grad();
      } else if (auto* st = adam_state_of(s_.optimizer(), param)) {
        t = k == Kind::exp_avg ? st->exp_avg() : st->exp_avg_sq();
      }
      if (!t.defined()) {
        out.emplace_back();
        continue;
      }
      for (at::Tensor& v : piece_views(t, l.range, *p)) out.push_back(v);
    }
    return out;
  }

 private:
  struct Local {
    std::size_t index;
    ShardRange range;
  };
  LayoutState& s_;
  std::map<int, Local> at_;
};

// The pieces of `plan` this rank sends to each peer, and those it takes from each peer.
struct PeerPieces {
  std::vector<std::vector<const TransferPiece*>> to_peer, from_peer;
};
PeerPieces peer_pieces(const std::vector<TransferPiece>& plan, int rank, int world) {
  PeerPieces out;
  out.to_peer.resize(static_cast<std::size_t>(world));
  out.from_peer.resize(static_cast<std::size_t>(world));
  for (const TransferPiece& p : plan) {
    if (p.source == rank && p.target != rank)
      out.to_peer[static_cast<std::size_t>(p.target)].push_back(&p);
    else if (p.target == rank && p.source != rank)
      out.from_peer[static_cast<std::size_t>(p.source)].push_back(&p);
  }
  return out;
}

std::int64_t numel_of(const std::vector<const TransferPiece*>& pieces, const ModelConfig& model) {
  std::int64_t n = 0;
  for (const TransferPiece* p : pieces) n += piece_numel(*p, model);
  return n;
}

// The views' elements as one new float tensor (zeros for null views of `n` elements in all).
at::Tensor flatten(const std::vector<at::Tensor>& views, std::int64_t n) {
  std::vector<at::Tensor> flat;
  for (const at::Tensor& v : views) {
    if (!v.defined()) return at::zeros({n}, at::kFloat);
    flat.push_back(v.reshape({-1}).to(at::kFloat));
  }
  return flat.empty() ? at::zeros({0}, at::kFloat) : at::cat(flat);
}

// Copies consecutive ranges of `flat` (from `offset`) into `views`; returns the next offset.
std::int64_t scatter(const at::Tensor& flat, std::int64_t offset,
                     const std::vector<at::Tensor>& views) {
  for (const at::Tensor& v : views) {
    at::Tensor dst = v;
    dst.copy_(flat.narrow(0, offset, v.numel()).view(v.sizes()));
    offset += v.numel();
  }
  return offset;
}

}  // namespace

StagedLayout::StagedLayout() = default;
StagedLayout::StagedLayout(StagedLayout&&) noexcept = default;
StagedLayout& StagedLayout::operator=(StagedLayout&&) noexcept = default;
StagedLayout::~StagedLayout() = default;

StatusOr<StagedLayout> stage_layout(std::uint64_t plan_id, const LiveLayout& from,
                                    const LiveLayout& to, int rank, Collectives& world,
                                    c10::intrusive_ptr<c10d::Store> store,
                                    const LayoutStateOptions& options,
                                    std::chrono::milliseconds delay,
                                    const std::function<bool()>& cancelled) {
  const auto t0 = Clock::now();
  StagedLayout s;
  s.plan_id = plan_id;
  s.from = from;
  s.to = to;
  s.plan = transfer_plan(from, to, options.model);
  while (Clock::now() - t0 < delay) {
    if (cancelled())
      return Status::unavailable("staging of plan " + std::to_string(plan_id) + " cancelled");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (cancelled())
    return Status::unavailable("staging of plan " + std::to_string(plan_id) + " cancelled");
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
      "parapilot/switch/" + std::to_string(plan_id), std::move(store));
  StatusOr<std::unique_ptr<LayoutState>> state =
      LayoutState::build(to, rank, world, prefixed, options);
  if (!state.ok()) return state.status();
  s.state = std::move(*state);
  StatusOr<std::unique_ptr<PointToPoint>> xfer = make_gloo_point_to_point(
      group_store(prefixed, "transfer"), rank, to.world_size(), options.groups);
  if (!xfer.ok()) return xfer.status();
  s.transfer = std::move(*xfer);
  s.staged_ms = ms_since(t0);
  return s;
}

// ---- streaming --------------------------------------------------------------------------------

// One source's pieces on the receiver: the staged parameters (a flat leaf tensor the replay
// optimizer steps) and the step its snapshot was taken at.
struct IncomingState::Source {
  int rank = 0;
  std::vector<const TransferPiece*> pieces;
  std::int64_t numel = 0;
  std::uint64_t snapshot_step = 0;
  at::Tensor params;
  std::unique_ptr<torch::optim::Optimizer> replay;
};

IncomingState::IncomingState(const StagedLayout& staged, int rank)
    : options_(staged.state->options()) {
  const PeerPieces peers = peer_pieces(staged.plan, rank, staged.to.world_size());
  for (int q = 0; q < staged.to.world_size(); ++q) {
    const auto& pieces = peers.from_peer[static_cast<std::size_t>(q)];
    if (pieces.empty()) continue;
    auto src = std::make_unique<Source>();
    src->rank = q;
    src->pieces = pieces;
    src->numel = numel_of(pieces, options_.model);
    sources_.push_back(std::move(src));
  }
}

IncomingState::~IncomingState() = default;

Status IncomingState::receive_snapshots(PointToPoint& transfer) {
  torch::NoGradGuard no_grad;
  std::uint64_t first = std::numeric_limits<std::uint64_t>::max();
  for (auto& src : sources_) {
    at::Tensor header = at::empty({3}, at::kLong);
    if (Status st = transfer.recv(header, src->rank, kSnapshotHeaderTag); !st.ok()) return st;
    const auto* h = header.data_ptr<std::int64_t>();
    if (h[2] != src->numel)
      return Status::internal("snapshot from rank " + std::to_string(src->rank) + " has " +
                              std::to_string(h[2]) + " elements; the plan says " +
                              std::to_string(src->numel));
    at::Tensor data = at::empty({3 * src->numel}, at::kFloat);
    if (Status st = transfer.recv(data, src->rank, kSnapshotTag); !st.ok()) return st;
    src->snapshot_step = static_cast<std::uint64_t>(h[0]);
    first = std::min(first, src->snapshot_step);
    src->params = data.narrow(0, 0, src->numel).clone();
    src->params.set_requires_grad(true);
    src->replay = make_optimizer({src->params}, options_);
    if (auto* adam = dynamic_cast<torch::optim::Adam*>(src->replay.get()); adam && h[1] > 0) {
      auto st = std::make_unique<torch::optim::AdamParamState>();
      st->step(h[1]);
      st->exp_avg(data.narrow(0, src->numel, src->numel).clone());
      st->exp_avg_sq(data.narrow(0, 2 * src->numel, src->numel).clone());
      adam->state()[state_key(src->params)] = std::move(st);
    }
  }
  next_step_ = sources_.empty() ? 0 : first;  // without sources, apply() only counts steps
  return {};
}

Status IncomingState::apply(PointToPoint& transfer, std::uint64_t step) {
  for (auto& src : sources_) {
    if (src->snapshot_step > step) continue;
    at::Tensor grad = at::empty({src->numel}, at::kFloat);
    if (Status st = transfer.recv(grad, src->rank, gradient_tag(step)); !st.ok()) return st;
    src->params.mutable_grad() = grad;
    src->replay->step();
  }
  next_step_ = step + 1;
  return {};
}

std::uint64_t IncomingState::install(LayoutState& to, bool adam_state) {
  torch::NoGradGuard no_grad;
  const Holdings held(to, options_.model);
  std::uint64_t bytes = 0;
  for (auto& src : sources_) {
    scatter(src->params.detach(), 0, held.views(src->pieces, Kind::param));
    bytes += static_cast<std::uint64_t>(src->numel) * 4;
    if (!adam_state) continue;
    if (auto* st = adam_state_of(*src->replay, src->params)) {
      scatter(st->exp_avg(), 0, held.views(src->pieces, Kind::exp_avg));
      scatter(st->exp_avg_sq(), 0, held.views(src->pieces, Kind::exp_avg_sq));
      bytes += static_cast<std::uint64_t>(src->numel) * 8;
    }
  }
  return bytes;
}

StatusOr<std::uint64_t> send_snapshot(LayoutState& running, StagedLayout& staged, int rank,
                                      std::uint64_t step) {
  torch::NoGradGuard no_grad;
  const ModelConfig& model = running.options().model;
  const Holdings held(running, model);
  const PeerPieces peers = peer_pieces(staged.plan, rank, staged.to.world_size());
  const std::vector<at::Tensor>& params = running.model().parameters();
  const torch::optim::AdamParamState* first =
      params.empty() ? nullptr : adam_state_of(running.optimizer(), params[0]);
  const std::int64_t adam_step = first ? first->step() : 0;
  std::uint64_t bytes = 0;
  for (int q = 0; q < staged.to.world_size(); ++q) {
    const auto& pieces = peers.to_peer[static_cast<std::size_t>(q)];
    if (pieces.empty()) continue;
    const std::int64_t n = numel_of(pieces, model);
    at::Tensor header = at::empty({3}, at::kLong);
    auto* h = header.data_ptr<std::int64_t>();
    h[0] = static_cast<std::int64_t>(step);
    h[1] = adam_step;
    h[2] = n;
    at::Tensor data = at::cat({flatten(held.views(pieces, Kind::param), n),
                               flatten(held.views(pieces, Kind::exp_avg), n),
                               flatten(held.views(pieces, Kind::exp_avg_sq), n)});
    if (Status st = staged.transfer->send(header, q, kSnapshotHeaderTag); !st.ok()) return st;
    if (Status st = staged.transfer->send(data, q, kSnapshotTag); !st.ok()) return st;
    bytes += static_cast<std::uint64_t>(data.numel()) * 4 + 24;
  }
  return bytes;
}

StatusOr<std::uint64_t> send_gradients(LayoutState& running, StagedLayout& staged, int rank,
                                       std::uint64_t step) {
  torch::NoGradGuard no_grad;
  const ModelConfig& model = running.options().model;
  const Holdings held(running, model);
  const PeerPieces peers = peer_pieces(staged.plan, rank, staged.to.world_size());
  std::uint64_t bytes = 0;
  for (int q = 0; q < staged.to.world_size(); ++q) {
    const auto& pieces = peers.to_peer[static_cast<std::size_t>(q)];
    if (pieces.empty()) continue;
    at::Tensor grads = flatten(held.views(pieces, Kind::grad), numel_of(pieces, model));
    if (Status st = staged.transfer->send(grads, q, gradient_tag(step)); !st.ok()) return st;
    bytes += static_cast<std::uint64_t>(grads.numel()) * 4;
  }
  return bytes;
}

// ---- the boundary -----------------------------------------------------------------------------

namespace {

// What `from`'s compressors owe, into `to`'s (new replica d: old replicas d' % to.dp == d).
// Returns the all-reduce's bytes.
StatusOr<std::uint64_t> move_feedback(LayoutState& from, LayoutState& to, Collectives& world) {
  StatusOr<FeedbackState> owed = gather_feedback(from, world, to.layout().dp);
  if (!owed.ok()) return owed.status();
  install_feedback(to, *owed);
  std::uint64_t bytes = 0;
  for (const auto* kind : {&owed->residual, &owed->basis})
    for (const at::Tensor& t : *kind)
      if (t.defined()) bytes += static_cast<std::uint64_t>(t.numel()) * 4;
  return bytes;
}

}  // namespace

StatusOr<SwitchStats> move_state(LayoutState& from, StagedLayout& to, int rank,
                                 const ModelConfig& model, Collectives& job) {
  const auto t0 = Clock::now();
  torch::NoGradGuard no_grad;
  const bool streamed = to.incoming && from.layout() == to.from;
  if (!(from.layout() == to.from)) {
    to.from = from.layout();
    to.plan = transfer_plan(to.from, to.to, model);
  }
  // Adam state exists once the optimizer stepped (every parameter steps together).
  const std::vector<at::Tensor>& old_params = from.model().parameters();
  const torch::optim::AdamParamState* first =
      old_params.empty() ? nullptr : adam_state_of(from.optimizer(), old_params[0]);
  const bool adam_state = first != nullptr;
  // The new optimizer's state, zero until filled below (every element has one piece).
  if (adam_state) {
    auto& new_adam = static_cast<torch::optim::Adam&>(to.state->optimizer());
    for (const at::Tensor& p : to.state->model().parameters()) {
      auto st = std::make_unique<torch::optim::AdamParamState>();
      st->step(first->step());
      st->exp_avg(at::zeros_like(p));
      st->exp_avg_sq(at::zeros_like(p));
      new_adam.state()[state_key(p)] = std::move(st);
    }
  }
  const Holdings old_held(from, model), new_held(*to.state, model);
  std::vector<Kind> kinds{Kind::param};
  if (adam_state) kinds.insert(kinds.end(), {Kind::exp_avg, Kind::exp_avg_sq});
  auto views_of = [&kinds](const Holdings& h, const std::vector<const TransferPiece*>& pieces) {
    std::vector<at::Tensor> out;
    for (Kind k : kinds)
      for (at::Tensor& v : h.views(pieces, k)) out.push_back(v);
    return out;
  };

  SwitchStats stats;
  stats.streamed = streamed;
  for (const TransferPiece& p : to.plan) {
    if (p.source != rank || p.target != rank) continue;
    const std::vector<at::Tensor> src = views_of(old_held, {&p}), dst = views_of(new_held, {&p});
    for (std::size_t k = 0; k < src.size(); ++k) {
      at::Tensor d = dst[k];
      d.copy_(src[k]);
      stats.bytes_local += static_cast<std::uint64_t>(src[k].numel()) * 4;
    }
  }
  if (streamed) {
    // The moved pieces arrived before the boundary; what remains is this rank's own sends
    // (long received: every receiver applied them) and the copy into the new tensors.
    stats.bytes_local += to.incoming->install(*to.state, adam_state);
    if (Status st = to.transfer->wait_sends(); !st.ok()) return st;
    const StatusOr<std::uint64_t> fed = move_feedback(from, *to.state, job);
    if (!fed.ok()) return fed.status();
    stats.feedback_bytes = *fed;
    stats.move_ms = ms_since(t0);
    return stats;
  }
  // One message per peer: the pieces in plan order, each moved tensor kind in turn.
  const int world = to.to.world_size();
  const PeerPieces peers = peer_pieces(to.plan, rank, world);
  for (int q = 0; q < world; ++q) {
    const auto& pieces = peers.to_peer[static_cast<std::size_t>(q)];
    if (pieces.empty()) continue;
    at::Tensor msg = flatten(views_of(old_held, pieces), 0);
    stats.bytes_sent += static_cast<std::uint64_t>(msg.numel()) * 4;
    if (Status st = to.transfer->send(msg, q, kMoveTag); !st.ok()) return st;
  }
  for (int q = 0; q < world; ++q) {
    const auto& pieces = peers.from_peer[static_cast<std::size_t>(q)];
    if (pieces.empty()) continue;
    const std::vector<at::Tensor> dst = views_of(new_held, pieces);
    std::int64_t n = 0;
    for (const at::Tensor& v : dst) n += v.numel();
    at::Tensor msg = at::empty({n}, at::kFloat);
    if (Status st = to.transfer->recv(msg, q, kMoveTag); !st.ok()) return st;
    stats.bytes_received += static_cast<std::uint64_t>(n) * 4;
    scatter(msg, 0, dst);
  }
  if (Status st = to.transfer->wait_sends(); !st.ok()) return st;
  const StatusOr<std::uint64_t> fed = move_feedback(from, *to.state, job);
  if (!fed.ok()) return fed.status();
  stats.feedback_bytes = *fed;
  stats.move_ms = ms_since(t0);
  return stats;
}

}  // namespace parapilot::live
