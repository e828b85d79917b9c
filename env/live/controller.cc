#include "env/live/controller.h"

#include <algorithm>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>

#include "transport/plan_executor.h"
#include "transport/telemetry_keys.h"

namespace parapilot::live {

namespace keys = transport::telemetry_keys;

Controller::Controller(ControllerOptions options) : options_(std::move(options)) {}

StatusOr<std::unique_ptr<Controller>> Controller::start(ControllerOptions options) {
  std::unique_ptr<Controller> controller(new Controller(std::move(options)));
  if (Status listening = controller->listen(); !listening.ok()) return listening;
  return controller;
}

Status Controller::listen() {
  transport::ServerOptions so;
  so.port = options_.port;
  so.secret = options_.secret;
  so.io_threads = 1;
  so.logger = transport::stderr_logger(transport::LogLevel::error);
  transport::ServerHandlers h;
  h.on_connect = [this](const transport::PeerInfo& p) {
    std::lock_guard lock(mu_);
    if (p.rank != transport::kNoRank) rank_of_[p.id] = static_cast<int>(p.rank);
    cv_.notify_all();
  };
  h.on_message = [this](transport::PeerId peer, transport::Message&& m) {
    on_message(peer, std::move(m));
  };
  h.on_disconnect = [this](transport::PeerId peer, std::string_view reason) {
    std::shared_ptr<transport::PlanExecutor> executor;
    int rank = -1;
    {
      std::lock_guard lock(mu_);
      auto it = rank_of_.find(peer);
      if (it == rank_of_.end()) return;
      rank = it->second;
      rank_of_.erase(it);
      if (std::find(finished_.begin(), finished_.end(), rank) == finished_.end()) {
        lost_.push_back(rank);
        events_.push_back("rank " + std::to_string(rank) + " lost: " + std::string(reason));
      }
      executor = executor_;
      cv_.notify_all();
    }
    if (executor) {
      executor->on_rank_lost(static_cast<std::uint32_t>(rank),
                             transport::PlanExecutor::Clock::now());
    }
  };
  auto server = transport::make_tcp_server(std::move(so), std::move(h));
  if (!server) {
    return Status(server.status().code(), "agent bus server: " + server.status().message());
  }
  server_ = std::move(*server);
  return {};
}

Controller::~Controller() {
  if (server_) server_->stop();
}

std::uint16_t Controller::port() const { return server_->port(); }

int Controller::connected_ranks() const {
  std::lock_guard lock(mu_);
  return static_cast<int>(rank_of_.size());
}

bool Controller::wait_for_ranks(int n, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return static_cast<int>(rank_of_.size()) >= n; });
}

void Controller::on_message(transport::PeerId peer, transport::Message&& m) {
  std::shared_ptr<transport::PlanExecutor> executor;
  std::uint64_t newest = 0;
  {
    std::lock_guard lock(mu_);
    auto it = rank_of_.find(peer);
    const int rank = it == rank_of_.end() ? -1 : it->second;
    if (auto* t = std::get_if<transport::Telemetry>(&m)) {
      if (t0_ns_ == 0) t0_ns_ = t->step_start_ns;
      trace::TelemetrySample s;
      s.rank = s.dp_rank = static_cast<int>(t->rank);
      s.step = static_cast<std::int64_t>(t->step);
      s.start_s = (static_cast<double>(t->step_start_ns) - static_cast<double>(t0_ns_)) * 1e-9;
      s.end_s = (static_cast<double>(t->step_end_ns) - static_cast<double>(t0_ns_)) * 1e-9;
      s.start_s = std::max(0.0, s.start_s);
      s.end_s = std::max(s.start_s, s.end_s);
      s.compute_ms = t->compute_ms;
      if (auto mb = keys::info(*t, keys::kMicrobatches)) s.microbatches = static_cast<int>(*mb);
      if (auto replica = keys::info(*t, keys::kReplica)) s.dp_rank = static_cast<int>(*replica);
      if (auto stage = keys::info(*t, keys::kStage)) s.stage = static_cast<int>(*stage);
      for (const auto& [name, c] : t->collectives) {
        if (name.ends_with("/dp")) {
          s.dp_comm.ms += c.ms;
          s.dp_comm.bytes += static_cast<double>(c.bytes);
        } else if (name == keys::kP2pPp) {
          s.pp_comm = {c.ms, static_cast<double>(c.bytes)};
        } else if (name == keys::kAllReduceTp) {
          s.tp_comm = {c.ms, static_cast<double>(c.bytes)};
        }
      }
      recorded_.push_back(s);
      auto& last = last_step_[static_cast<int>(t->rank)];
      last = std::max(last, t->step);
      pending_.push_back(std::move(*t));
    } else if (std::holds_alternative<transport::PlanReady>(m) ||
               std::holds_alternative<transport::Ack>(m)) {
      executor = executor_;
      for (const auto& [r, s] : last_step_) newest = std::max(newest, s);
    } else if (auto* s = std::get_if<transport::Shutdown>(&m)) {
      events_.push_back(s->reason);
      if (rank >= 0 && s->reason.find("finished") != std::string::npos) finished_.push_back(rank);
    }
    cv_.notify_all();
  }
  if (!executor) return;
  const auto now = transport::PlanExecutor::Clock::now();
  if (auto* r = std::get_if<transport::PlanReady>(&m)) executor->on_ready(*r, newest, now);
  if (auto* a = std::get_if<transport::Ack>(&m)) executor->on_ack(*a, now);
}

StatusOr<AppliedPlan> Controller::apply(const LiveAction& action,
                                        std::chrono::milliseconds timeout,
                                        std::uint64_t not_before_step) {
  using transport::PlanEnd;
  using transport::PlanExecutor;
  using transport::PlanOutcome;
  transport::PlanPrepare prep;
  prep.layout.dp = static_cast<std::uint32_t>(options_.world_size);
  StatusOr<std::string> name = encode_action(action);
  if (!name.ok()) return name.status();
  prep.layout_name = std::move(name).value();

  transport::PlanExecutorOptions mo;
  mo.prepare_deadline_ms = static_cast<std::uint32_t>(timeout.count());
  mo.ack_timeout_ms = static_cast<std::uint32_t>(timeout.count());
  mo.commit_margin_steps = 1;  // the switch lands two steps past the newest step seen
  mo.commit_lead_ms = 0;
  mo.min_switch_step = not_before_step;
  std::optional<PlanOutcome> outcome;
  auto executor = std::make_shared<PlanExecutor>(
      mo, [this](const transport::Message& msg) { server_->broadcast(msg); },
      [this, &outcome](const PlanOutcome& o) {
        std::lock_guard lock(mu_);
        outcome = o;
        cv_.notify_all();
      });
  std::set<std::uint32_t> members;
  {
    std::lock_guard lock(mu_);
    for (const auto& [peer, rank] : rank_of_) members.insert(static_cast<std::uint32_t>(rank));
    executor_ = executor;
  }
  auto unhook = [&] {
    std::lock_guard lock(mu_);
    executor_.reset();
  };
  if (static_cast<int>(members.size()) < options_.world_size) {
    unhook();
    return Status::unavailable("not every rank is connected: " + std::to_string(members.size()) +
                               " of " + std::to_string(options_.world_size));
  }
  if (auto started = executor->prepare(prep, members, PlanExecutor::Clock::now()); !started.ok()) {
    unhook();
    return started.status();
  }
  // Wait for the outcome; the executor's deadlines run on its tick.
  std::unique_lock lock(mu_);
  while (!outcome) {
    cv_.wait_for(lock, std::chrono::milliseconds(20));
    if (outcome) break;
    lock.unlock();
    executor->tick(PlanExecutor::Clock::now());
    lock.lock();
  }
  const PlanOutcome done = *outcome;
  executor_.reset();
  if (!done.committed)
    events_.push_back("plan " + std::to_string(done.plan_id) + " aborted: " + done.reason);
  lock.unlock();
  switch (done.end) {
    case PlanEnd::committed:
      return AppliedPlan{done.plan_id, done.switch_at_step};
    case PlanEnd::acks_missing:
      return Status::unavailable("committed, but not every rank acknowledged the switch in time (" +
                                 done.reason + ")");
    case PlanEnd::refused:
    case PlanEnd::missed:
      return Status::rejected(done.reason);
    case PlanEnd::timed_out:
    case PlanEnd::rank_lost:
      return Status::unavailable(done.reason);
  }
  return Status::internal("unknown migration end");
}

bool Controller::wait_for_step(std::uint64_t step, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  return cv_.wait_for(lock, timeout, [&] {
    if (!lost_.empty()) return true;
    if (static_cast<int>(last_step_.size()) < options_.world_size) return false;
    for (const auto& [rank, s] : last_step_)
      if (s < step) return false;
    return true;
  }) && lost_.empty();
}

std::uint64_t Controller::completed_step() const {
  std::lock_guard lock(mu_);
  if (static_cast<int>(last_step_.size()) < options_.world_size) return 0;
  std::uint64_t s = UINT64_MAX;
  for (const auto& [rank, v] : last_step_) s = std::min(s, v);
  return s;
}

std::vector<transport::Telemetry> Controller::take_telemetry() {
  std::lock_guard lock(mu_);
  std::vector<transport::Telemetry> out;
  out.swap(pending_);
  return out;
}

std::vector<trace::TelemetrySample> Controller::recorded() const {
  std::lock_guard lock(mu_);
  return recorded_;
}

void Controller::request_stop(const std::string& reason) {
  server_->broadcast(transport::Shutdown{reason.substr(0, transport::kMaxTextBytes)});
}

std::vector<std::string> Controller::events() const {
  std::lock_guard lock(mu_);
  return events_;
}

std::vector<int> Controller::lost_ranks() const {
  std::lock_guard lock(mu_);
  return lost_;
}

std::vector<double> elastic_shares(const std::vector<transport::Telemetry>& telemetry, int world) {
  std::vector<double> ms(static_cast<std::size_t>(world), 0),
      mbs(static_cast<std::size_t>(world), 0);
  for (const auto& t : telemetry) {
    if (static_cast<int>(t.rank) >= world) continue;
    const double n = static_cast<double>(keys::info(t, keys::kMicrobatches).value_or(1));
    if (n <= 0) continue;
    ms[t.rank] += t.compute_ms;
    mbs[t.rank] += n;
  }
  std::vector<double> speed(static_cast<std::size_t>(world), 0);
  double sum = 0;
  int known = 0;
  for (int r = 0; r < world; ++r) {
    if (ms[r] > 0) {
      speed[r] = mbs[r] / ms[r];
      sum += speed[r];
      ++known;
    }
  }
  if (known == 0) return std::vector<double>(static_cast<std::size_t>(world), 1.0 / world);
  const double mean = sum / known;
  double total = 0;
  for (double& s : speed) {
    if (s == 0) s = mean;
    total += s;
  }
  for (double& s : speed) s /= total;
  return speed;
}

std::vector<LayerGradSummary> grad_summary(const std::vector<transport::Telemetry>& telemetry,
                                           std::size_t layers) {
  std::vector<LayerGradSummary> out(layers);
  std::vector<int> n(layers, 0);
  for (const auto& t : telemetry) {
    for (const auto& l : t.layers) {
      if (l.layer >= layers) continue;
      out[l.layer].norm += static_cast<double>(l.norm);
      out[l.layer].max_abs = std::max(out[l.layer].max_abs, static_cast<double>(l.max_abs));
      out[l.layer].nonfinite += l.nonfinite_count;
      ++n[l.layer];
    }
  }
  for (std::size_t i = 0; i < layers; ++i)
    if (n[i]) out[i].norm /= n[i];
  return out;
}

double measured_steps_per_s(const std::vector<trace::TelemetrySample>& rows, std::int64_t from,
                            std::int64_t to) {
  double start = 1e300, end = -1e300;
  std::int64_t lo = INT64_MAX, hi = INT64_MIN;
  for (const auto& r : rows) {
    if (r.step < from || r.step > to) continue;
    start = std::min(start, r.start_s);
    end = std::max(end, r.end_s);
    lo = std::min(lo, r.step);
    hi = std::max(hi, r.step);
  }
  if (hi < lo || end <= start) return 0;
  return static_cast<double>(hi - lo + 1) / (end - start);
}

transport::Secret random_secret() {
  std::random_device rd;
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < 32; ++i) s += hex[rd() % 16];
  return transport::Secret(s);
}

}  // namespace parapilot::live
