#include "env/live/layout_switch.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

namespace parapilot::live {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// The part of `local` (this rank's tensor `shard`) that piece `p` names, as a view: the same
// range in each of the shard's parts, in the shard's own coordinates.
std::vector<at::Tensor> piece_views(const at::Tensor& local, const ParamShard& shard,
                                    const ShardRange& held, const TransferPiece& p) {
  if (p.dim < 0) return {local.view({-1}).narrow(0, p.begin, p.end - p.begin)};
  const std::int64_t block = local.size(p.dim) / p.parts;
  std::vector<at::Tensor> out;
  for (int part = 0; part < p.parts; ++part)
    out.push_back(local.narrow(p.dim, part * block + (p.begin - held.begin), p.end - p.begin));
  (void)shard;
  return out;
}

// This rank's tensors of a layout state by full-model tensor: (index, range held).
struct Local {
  std::size_t index;
  ShardRange range;
};
std::map<int, Local> by_layer(LayoutState& s, const ModelConfig& model) {
  std::map<int, Local> out;
  const std::vector<ParamShard>& shards = s.model().shards();
  for (std::size_t i = 0; i < shards.size(); ++i)
    out[shards[i].layer] = {i, shard_range(shards[i], model)};
  return out;
}

std::string state_key(const at::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }

// The tensors moved per parameter: the parameter, then Adam's moments when it has them.
std::vector<at::Tensor> moved_tensors(LayoutState& s, std::size_t i, bool adam_state) {
  const at::Tensor& p = s.model().parameters()[i];
  std::vector<at::Tensor> out{p.detach()};
  if (adam_state) {
    auto& st = static_cast<torch::optim::AdamParamState&>(*s.optimizer().state().at(state_key(p)));
    out.push_back(st.exp_avg());
    out.push_back(st.exp_avg_sq());
  }
  return out;
}

}  // namespace

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

StatusOr<SwitchStats> move_state(LayoutState& from, StagedLayout& to, int rank,
                                 const ModelConfig& model) {
  const auto t0 = Clock::now();
  torch::NoGradGuard no_grad;
  if (!(from.layout() == to.from)) {
    to.from = from.layout();
    to.plan = transfer_plan(to.from, to.to, model);
  }
  // Adam state exists once the optimizer stepped (every parameter steps together).
  auto* adam = dynamic_cast<torch::optim::Adam*>(&from.optimizer());
  const std::vector<at::Tensor>& old_params = from.model().parameters();
  const bool adam_state =
      adam && !old_params.empty() && adam->state().count(state_key(old_params[0])) > 0;
  std::int64_t step = 0;
  if (adam_state)
    step = static_cast<torch::optim::AdamParamState&>(*adam->state().at(state_key(old_params[0])))
               .step();
  // The new optimizer's state, zero until filled below (every element has one piece).
  if (adam_state) {
    auto& new_adam = static_cast<torch::optim::Adam&>(to.state->optimizer());
    for (const at::Tensor& p : to.state->model().parameters()) {
      auto st = std::make_unique<torch::optim::AdamParamState>();
      st->step(step);
      st->exp_avg(at::zeros_like(p));
      st->exp_avg_sq(at::zeros_like(p));
      new_adam.state()[state_key(p)] = std::move(st);
    }
  }
  const std::map<int, Local> old_at = by_layer(from, model);
  const std::map<int, Local> new_at = by_layer(*to.state, model);
  const std::vector<ParamShard>& old_shards = from.model().shards();
  const std::vector<ParamShard>& new_shards = to.state->model().shards();
  // The views of one piece in the sender's (old) or the receiver's (new) tensors, every moved
  // tensor kind in turn.
  auto old_views = [&](const TransferPiece& p) {
    const Local& l = old_at.at(p.layer);
    std::vector<at::Tensor> out;
    for (const at::Tensor& t : moved_tensors(from, l.index, adam_state))
      for (at::Tensor& v : piece_views(t, old_shards[l.index], l.range, p)) out.push_back(v);
    return out;
  };
  auto new_views = [&](const TransferPiece& p) {
    const Local& l = new_at.at(p.layer);
    std::vector<at::Tensor> out;
    for (const at::Tensor& t : moved_tensors(*to.state, l.index, adam_state))
      for (at::Tensor& v : piece_views(t, new_shards[l.index], l.range, p)) out.push_back(v);
    return out;
  };

  SwitchStats stats;
  const int world = to.to.world_size();
  std::vector<std::vector<const TransferPiece*>> to_peer(world), from_peer(world);
  for (const TransferPiece& p : to.plan) {
    if (p.source == rank && p.target == rank) {
      std::vector<at::Tensor> src = old_views(p), dst = new_views(p);
      for (std::size_t k = 0; k < src.size(); ++k) {
        dst[k].copy_(src[k]);
        stats.bytes_local += static_cast<std::uint64_t>(src[k].numel()) * 4;
      }
    } else if (p.source == rank) {
      to_peer[static_cast<std::size_t>(p.target)].push_back(&p);
    } else if (p.target == rank) {
      from_peer[static_cast<std::size_t>(p.source)].push_back(&p);
    }
  }
  // One message per peer: the pieces in plan order, each moved tensor kind in turn.
  constexpr std::uint32_t kTag = 1;
  for (int q = 0; q < world; ++q) {
    if (to_peer[static_cast<std::size_t>(q)].empty()) continue;
    std::vector<at::Tensor> flat;
    for (const TransferPiece* p : to_peer[static_cast<std::size_t>(q)])
      for (const at::Tensor& v : old_views(*p)) flat.push_back(v.reshape({-1}).to(at::kFloat));
    at::Tensor msg = at::cat(flat);
    stats.bytes_sent += static_cast<std::uint64_t>(msg.numel()) * 4;
    if (Status st = to.transfer->send(msg, q, kTag); !st.ok()) return st;
  }
  for (int q = 0; q < world; ++q) {
    if (from_peer[static_cast<std::size_t>(q)].empty()) continue;
    std::vector<at::Tensor> dst;
    std::int64_t n = 0;
    for (const TransferPiece* p : from_peer[static_cast<std::size_t>(q)])
      for (at::Tensor& v : new_views(*p)) {
        n += v.numel();
        dst.push_back(v);
      }
    at::Tensor msg = at::empty({n}, at::kFloat);
    if (Status st = to.transfer->recv(msg, q, kTag); !st.ok()) return st;
    stats.bytes_received += static_cast<std::uint64_t>(n) * 4;
    std::int64_t off = 0;
    for (at::Tensor& v : dst) {
      v.copy_(msg.narrow(0, off, v.numel()).view(v.sizes()));
      off += v.numel();
    }
  }
  if (Status st = to.transfer->wait_sends(); !st.ok()) return st;
  stats.move_ms = ms_since(t0);
  return stats;
}

void LayoutStager::start(std::uint64_t plan_id, Stage stage,
                         std::function<void(const Status&)> done) {
  std::lock_guard lock(mu_);
  if (plans_.count(plan_id)) return;
  Entry& e = plans_[plan_id];
  e.cancelled = std::make_shared<std::atomic<bool>>(false);
  e.finished = std::make_shared<std::atomic<bool>>(false);
  auto cancelled = e.cancelled;
  auto finished = e.finished;
  e.thread = std::thread(
      [this, plan_id, stage = std::move(stage), done = std::move(done), cancelled, finished] {
        StatusOr<StagedLayout> made = Status::internal("staging did not run");
        try {
          made = stage([cancelled] { return cancelled->load(); });
        } catch (const std::exception& err) {  // libtorch's errors while building the new layout
          made = Status::internal("staging plan " + std::to_string(plan_id) + ": " + err.what());
        }
        Status status = made.status();
        {
          std::lock_guard held(mu_);
          auto it = plans_.find(plan_id);
          if (made.ok() && !cancelled->load() && it != plans_.end())
            it->second.staged = std::make_unique<StagedLayout>(std::move(*made));
          else if (made.ok())
            status = Status::unavailable("plan " + std::to_string(plan_id) + " was dropped");
        }
        // Staged state of a dropped plan (made, when not kept) goes with this thread.
        finished->store(true);
        if (!cancelled->load()) done(status);
      });
}

std::unique_ptr<StagedLayout> LayoutStager::take(std::uint64_t plan_id) {
  std::unique_lock lock(mu_);
  auto it = plans_.find(plan_id);
  if (it == plans_.end() || !it->second.staged) return nullptr;
  Entry e = std::move(it->second);
  plans_.erase(it);
  lock.unlock();
  if (e.thread.joinable()) e.thread.join();
  return std::move(e.staged);
}

std::vector<std::uint64_t> LayoutStager::keep_only(const std::function<bool(std::uint64_t)>& keep) {
  std::vector<Entry> finished;
  std::vector<std::uint64_t> dropped;
  {
    std::lock_guard lock(mu_);
    for (auto it = plans_.begin(); it != plans_.end();) {
      if (keep(it->first)) {
        ++it;
        continue;
      }
      it->second.cancelled->store(true);
      dropped.push_back(it->first);
      dropped_.push_back(std::move(it->second));
      it = plans_.erase(it);
    }
    for (auto it = dropped_.begin(); it != dropped_.end();) {
      if (it->finished->load()) {
        finished.push_back(std::move(*it));
        it = dropped_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // Joined and destroyed (with their staged groups) outside the lock.
  for (Entry& e : finished)
    if (e.thread.joinable()) e.thread.join();
  return dropped;
}

std::size_t LayoutStager::size() const {
  std::lock_guard lock(mu_);
  return plans_.size();
}

LayoutStager::~LayoutStager() {
  std::vector<Entry> all;
  {
    std::lock_guard lock(mu_);
    for (auto& [id, e] : plans_) {
      e.cancelled->store(true);
      all.push_back(std::move(e));
    }
    plans_.clear();
    for (Entry& e : dropped_) all.push_back(std::move(e));
    dropped_.clear();
  }
  for (Entry& e : all)
    if (e.thread.joinable()) e.thread.join();
}

}  // namespace parapilot::live
