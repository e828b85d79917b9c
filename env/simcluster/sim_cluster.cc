#include "env/simcluster/sim_cluster.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "env/sim/step_telemetry.h"
#include "core/error.h"
#include "transport/plan_book.h"

namespace parapilot::env {


namespace {

using transport::Message;

struct Staged {
  Strategy target;
  uint64_t ready_at = 0;             // staging ends (PlanReady) after this step
};

struct Rank {
  uint32_t id = 0;
  std::unique_ptr<transport::Client> client;
  std::atomic<bool> connected{false};
  bool alive = true;
  bool kill_on_prepare = false;
  bool refuse_prepare = false;
  bool drop_commit = false;
  bool lose_staged = false;
  std::mutex inbox_mutex;
  std::vector<Message> inbox;
  bool agent_lost = false;  // set by the disconnect handler, handled at the next boundary
  bool agent_lost_seen = false;
  Strategy layout;       // the layout this rank runs
  // The rank's side of the switch protocol; sends through `client`.
  std::unique_ptr<transport::PlanBook<Staged>> book;
};

}  // namespace

struct SimulatedCluster::Impl {
  SimClusterOptions o;
  std::shared_ptr<const Job> job;
  env::Truth truth;
  std::shared_ptr<transport::IoRuntime> io;
  std::vector<std::unique_ptr<Rank>> ranks;
  mutable std::mutex mutex;  // guards the job state below (held by step())
  uint64_t step = 0;
  uint64_t plan_id = 0;  // the plan the job runs (0: the start layout)
  Strategy layout;
  std::optional<env::StepTelemetry> telemetry;  // what each rank measures under `layout`
  SimClusterReport report;
  std::mt19937_64 rng;
  uint64_t clock_ns = 0;

  void log(const std::string& line) const {
    if (o.log) o.log(line);
  }
  void layout_changed();
  Conditions true_conditions(uint64_t s) const;
  // The phases of one lockstep step s (step()), in order.
  void handle_control(uint64_t s);     // each rank's inbox at the boundary; the agent's loss
  void agree_on_commit(uint64_t s);    // the commit agreement: everyone switches or nobody
  double train(uint64_t s, std::vector<monitor::StepSample>& samples);  // returns the step's ms
  void send_reports(uint64_t s, const std::vector<monitor::StepSample>& samples,
                    uint64_t start_ns);
  void send(Rank& r, const Message& m) {
    if (r.client) r.client->send(m);
  }
};

void SimulatedCluster::Impl::layout_changed() {
  telemetry.emplace(job->planner->cost_model(), layout);
}

Conditions SimulatedCluster::Impl::true_conditions(uint64_t s) const {
  Conditions c;
  if (o.use_truth && !truth.conditions.empty()) {
    const size_t interval = std::min<size_t>(s / static_cast<uint64_t>(o.steps_per_interval),
                                             truth.conditions.size() - 1);
    c = truth.conditions[interval];
  }
  for (const SlowdownInjection& inj : o.slowdowns) {
    if (s < inj.from_step || s >= inj.to_step || inj.rank >= static_cast<uint32_t>(o.ranks))
      continue;
    if (c.gpu_speed.empty()) c.gpu_speed.assign(o.ranks, 1.0);
    c.gpu_speed[inj.rank] /= inj.factor;
  }
  return c;
}

SimulatedCluster::SimulatedCluster() : impl_(std::make_unique<Impl>()) {}

StatusOr<std::unique_ptr<SimulatedCluster>> SimulatedCluster::start(SimClusterOptions options) {
  return catch_input_error([&] {
    std::unique_ptr<SimulatedCluster> cluster(new SimulatedCluster());
    cluster->build(std::move(options));
    return cluster;
  });
}

void SimulatedCluster::build(SimClusterOptions options) {
  Impl& m = *impl_;
  if (options.ranks < 8 || options.ranks % 8 != 0) {
    throw InputError("--ranks " + std::to_string(options.ranks) +
                     ": must be a multiple of 8, >= 8");
  }
  if (options.steps_per_interval < 1) throw InputError("steps per interval must be >= 1");
  m.o = std::move(options);
  job_ = take(make_job(m.o.scenario, m.o.ranks));
  m.job = job_;
  if (job_->gpus() != m.o.ranks) {
    throw InputError("scenario " + m.o.scenario + " has " + std::to_string(job_->gpus()) +
                     " GPUs, not --ranks " + std::to_string(m.o.ranks));
  }
  m.truth = env::generate_truth(job_->scenario, m.o.seed);
  m.rng.seed(m.o.seed * 7919 + 17);
  m.layout = take(job_->start_layout(m.o.initial_layout));
  m.layout_changed();
  m.clock_ns = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                         std::chrono::system_clock::now().time_since_epoch())
                                         .count());
  if (!m.o.hub) {
    if (m.o.agent_port == 0) throw InputError("--agent: a port is required");
    m.io = std::make_shared<transport::IoRuntime>(std::max<size_t>(1, m.o.io_threads));
  }
  m.ranks.reserve(m.o.ranks);
  for (int i = 0; i < m.o.ranks; ++i) {
    auto r = std::make_unique<Rank>();
    r->id = static_cast<uint32_t>(i);
    r->book = std::make_unique<transport::PlanBook<Staged>>(r->id, [rank = r.get()](const Message& msg) {
      if (rank->client) rank->client->send(msg);
    });
    r->layout = m.layout;
    m.ranks.push_back(std::move(r));
  }
  for (auto& rp : m.ranks) {
    Rank* r = rp.get();
    transport::ClientOptions co;
    co.server_address = m.o.agent_address;
    co.port = m.o.agent_port;
    co.secret = m.o.secret;
    co.name = "simrank-" + std::to_string(r->id);
    co.role = transport::PeerRole::simulator;
    co.rank = r->id;
    co.reconnect_initial_ms = 20;
    co.reconnect_max_ms = 1000;
    co.telemetry_buffer_capacity = 64;
    co.logger = transport::stderr_logger(transport::LogLevel::error);  // reconnects are expected
    transport::ClientHandlers h;
    h.on_connect = [r](transport::PeerId) { r->connected = true; };
    h.on_disconnect = [r](std::string_view) {
      r->connected = false;
      std::lock_guard lock(r->inbox_mutex);
      r->agent_lost = true;
    };
    h.on_message = [r](Message&& msg) {
      std::lock_guard lock(r->inbox_mutex);
      r->inbox.push_back(std::move(msg));
    };
    if (m.o.hub) {
      r->client = m.o.hub->make_client(co, std::move(h));
    } else {
      auto c = transport::make_tcp_client(co, std::move(h), m.io);
      if (!c) throw InputError("simulated rank " + std::to_string(r->id) + ": " + c.status().message());
      r->client = std::move(*c);
    }
  }
}

SimulatedCluster::~SimulatedCluster() { stop(); }

void SimulatedCluster::stop() {
  for (auto& r : impl_->ranks) {
    if (r->client) r->client->stop();
  }
}

bool SimulatedCluster::wait_connected(std::chrono::milliseconds timeout) const {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    bool all = true;
    for (const auto& r : impl_->ranks) {
      std::lock_guard lock(impl_->mutex);
      if (r->alive && !r->connected) {
        all = false;
        break;
      }
    }
    if (all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

void SimulatedCluster::kill_rank(uint32_t rank) {
  std::lock_guard lock(impl_->mutex);
  if (rank >= impl_->ranks.size()) return;
  Rank& r = *impl_->ranks[rank];
  if (!r.alive) return;
  r.alive = false;
  if (r.client) r.client->stop();
  impl_->log("rank " + std::to_string(rank) + " killed");
}

void SimulatedCluster::kill_on_prepare(uint32_t rank) {
  std::lock_guard lock(impl_->mutex);
  if (rank < impl_->ranks.size()) impl_->ranks[rank]->kill_on_prepare = true;
}

void SimulatedCluster::refuse_prepare(uint32_t rank) {
  std::lock_guard lock(impl_->mutex);
  if (rank < impl_->ranks.size()) impl_->ranks[rank]->refuse_prepare = true;
}

void SimulatedCluster::drop_commit(uint32_t rank) {
  std::lock_guard lock(impl_->mutex);
  if (rank < impl_->ranks.size()) impl_->ranks[rank]->drop_commit = true;
}

void SimulatedCluster::lose_staged(uint32_t rank) {
  std::lock_guard lock(impl_->mutex);
  if (rank < impl_->ranks.size()) impl_->ranks[rank]->lose_staged = true;
}

uint64_t SimulatedCluster::current_step() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->step;
}

void SimulatedCluster::Impl::handle_control(uint64_t s) {
  Impl& m = *this;
  // Control messages, handled at the iteration boundary.
  for (auto& rp : m.ranks) {
    Rank& r = *rp;
    if (!r.alive) continue;
    std::vector<Message> inbox;
    bool agent_lost = false;
    {
      std::lock_guard il(r.inbox_mutex);
      inbox.swap(r.inbox);
      agent_lost = r.agent_lost;
      r.agent_lost = false;
    }
    r.agent_lost_seen = agent_lost;
    transport::PlanBook<Staged>& book = *r.book;
    for (Message& msg : inbox) {
      if (!r.alive) break;
      if (std::holds_alternative<transport::PlanCommit>(msg)) {
        if (r.drop_commit) continue;
        if (r.lose_staged) {  // the staged copy is gone before the commit arrives
          book.drop_uncommitted();
          continue;
        }
      }
      const std::size_t held_before = book.size();
      const std::optional<transport::PlanPrepare> p = book.on_message(msg);
      if (std::holds_alternative<transport::PlanAbort>(msg) && book.size() < held_before) {
        if (r.id == 0 || m.report.aborts == 0)
          m.log("plan " + std::to_string(std::get<transport::PlanAbort>(msg).plan_id) +
                " aborted: " + std::get<transport::PlanAbort>(msg).reason);
        ++m.report.aborts;
      }
      if (!p) continue;
      if (r.kill_on_prepare) {
        r.alive = false;
        r.client->stop();
        m.log("rank " + std::to_string(r.id) + " died on PlanPrepare " +
              std::to_string(p->plan_id));
        break;
      }
      if (r.refuse_prepare) {
        book.refuse(p->plan_id, "refused (fault injection)");
        continue;
      }
      StatusOr<Strategy> target = from_wire(p->layout, *m.job, p->layout_name);
      if (!target.ok()) {
        book.refuse(p->plan_id, target.status().message());
        continue;
      }
      Staged st;
      st.target = *target;
      st.ready_at = s + m.o.stage_steps;
      book.stage(p->plan_id, std::move(st));
    }
  }

  // The agent went away (after everything in the inbox arrived): a plan not yet committed is
  // dropped, so everyone stays on the committed layout.
  for (auto& rp : m.ranks) {
    Rank& r = *rp;
    if (!r.alive || !r.agent_lost_seen) continue;
    r.agent_lost_seen = false;
    const std::size_t held_before = r.book->size();
    r.book->drop_uncommitted();
    if (r.id == 0 && r.book->size() < held_before) m.log("agent lost: staged plan dropped");
  }
}

void SimulatedCluster::Impl::agree_on_commit(uint64_t s) {
  Impl& m = *this;
  // The commit agreement at this boundary (transport/plan_book.h): the newest plan some live
  // rank holds a commit for (MAX), switched to only if every live rank holds it (AND).
  uint64_t due = 0;
  for (auto& rp : m.ranks) {
    if (rp->alive) due = std::max(due, rp->book->committed_at(s, m.plan_id));
  }
  if (due > m.plan_id) {
    bool all = true;
    for (auto& rp : m.ranks) all = all && (!rp->alive || rp->book->holds(due));
    if (all) {
      Strategy target;
      for (auto& rp : m.ranks) {
        Rank& r = *rp;
        if (!r.alive) continue;
        std::optional<Staged> staged = r.book->applied(due);
        r.layout = staged->target;
        target = staged->target;
      }
      m.plan_id = due;
      m.layout = target;
      m.layout_changed();
      ++m.report.commits;
      m.report.commit_steps.push_back(s);
      m.report.sim_seconds += m.job->scenario.switch_pause_s;
      m.log("switched to " + layout_name(target) + " at step " + std::to_string(s));
    } else {
      for (auto& rp : m.ranks) {
        if (rp->alive)
          rp->book->missed(due, "plan not staged on every rank at the boundary; nobody switched");
      }
      ++m.report.missed_commits;
      m.log("plan " + std::to_string(due) + ": commit missed at step " + std::to_string(s));
    }
  }
}

double SimulatedCluster::Impl::train(uint64_t s, std::vector<monitor::StepSample>& samples) {
  Impl& m = *this;
  // Train one step on every live rank.
  const Conditions now = m.true_conditions(s);
  const int n = m.o.ranks;
  std::vector<uint8_t> alive(n, 0);
  bool staging = false;
  for (int g = 0; g < n; ++g) {
    Rank& r = *m.ranks[g];
    if (!r.alive) continue;
    alive[g] = 1;
    r.book->for_each([&](uint64_t, const Staged&) { staging = true; });
  }
  const double step_ms =
      m.telemetry->generate(now, s, m.clock_ns, m.o.telemetry_noise, m.rng, samples, &alive);
  const CostBreakdown b = m.job->planner->cost_model().evaluate(m.layout, now);
  double tps = b.feasible && b.fits_in_memory ? b.tokens_per_s : 0.0;
  if (staging) tps *= 1.0 - m.job->scenario.staging_slowdown;
  const double tokens = static_cast<double>(m.job->global_batch) * m.job->scenario.model.seq_len;
  m.report.tokens += tokens;
  m.report.sim_seconds += tps > 0 ? tokens / tps : 0.0;
  m.report.tokens_per_s_by_step.push_back(tps);
  return step_ms;
}

void SimulatedCluster::Impl::send_reports(uint64_t s,
                                           const std::vector<monitor::StepSample>& samples,
                                           uint64_t start_ns) {
  Impl& m = *this;
  // Telemetry and PlanReady of every live rank.
  for (int g = 0; g < m.o.ranks; ++g) {
    Rank& r = *m.ranks[g];
    if (!r.alive) continue;
    std::vector<uint64_t> done;  // staging complete: PlanReady (once; the book ignores repeats)
    r.book->for_each([&](uint64_t id, const Staged& st) {
      if (s + 1 >= st.ready_at) done.push_back(id);
    });
    for (uint64_t id : done) r.book->ready(id);
  }
  for (const monitor::StepSample& x : samples) {
    Rank& r = *m.ranks[x.rank];
    transport::Telemetry t = monitor::to_telemetry(x);
    t.rank = r.id;
    t.queue_depth = r.book->size() > 0 ? 2u : 1u;
    for (int l = 0; l < m.o.grad_layers; ++l) {
      t.layers.push_back({static_cast<uint32_t>(l), static_cast<float>(1.0 + 0.1 * l), 0.5f, 0});
    }
    t.send_time_ns = start_ns;
    m.send(r, t);
    ++m.report.telemetry_sent;
  }
}

void SimulatedCluster::step() {
  Impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const uint64_t s = m.step;
  m.handle_control(s);
  m.agree_on_commit(s);
  const uint64_t start_ns = m.clock_ns;
  std::vector<monitor::StepSample> samples;
  const double step_ms = m.train(s, samples);
  m.send_reports(s, samples, start_ns);
  m.clock_ns += static_cast<uint64_t>(step_ms * 1e6);
  ++m.step;
}

void SimulatedCluster::run(uint64_t steps, const std::atomic<bool>* stop) {
  auto next = std::chrono::steady_clock::now();
  for (uint64_t i = 0; i < steps; ++i) {
    if (stop && stop->load()) return;
    step();
    if (impl_->o.step_ms > 0) {
      next += std::chrono::microseconds(static_cast<int64_t>(impl_->o.step_ms * 1000));
      std::this_thread::sleep_until(next);
    }
  }
}

SimClusterReport SimulatedCluster::report() const {
  const Impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  SimClusterReport r = m.report;
  r.steps = m.step;
  r.layout = m.layout;
  for (const auto& rp : m.ranks) {
    if (!rp->alive) continue;
    ++r.live_ranks;
    r.connected_ranks += rp->connected ? 1 : 0;
    r.ranks_holding_plans += rp->book->size() > 0 ? 1 : 0;
  }
  return r;
}

StatusOr<SimClusterReport> run_simulated_cluster(const SimClusterOptions& options,
                                                 const std::atomic<bool>& stop,
                                                 uint64_t max_steps) {
  StatusOr<std::unique_ptr<SimulatedCluster>> started = SimulatedCluster::start(options);
  if (!started.ok()) return started.status();
  SimulatedCluster& cluster = **started;
  // Wait (up to 30 s) for the ranks to connect; training starts anyway, as a job would.
  for (int i = 0; i < 300 && !stop.load(); ++i) {
    if (cluster.wait_connected(std::chrono::milliseconds(100))) break;
  }
  cluster.run(max_steps > 0 ? max_steps : UINT64_MAX, &stop);
  SimClusterReport r = cluster.report();
  cluster.stop();
  return r;
}

}  // namespace parapilot::env
