#include "env/simcluster/sim_cluster.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "env/sim/step_telemetry.h"
#include "strategy/error.h"

namespace parapilot::env {

using agent::runtime::from_wire;
using agent::runtime::layout_name;
using agent::runtime::make_job;

namespace {

using transport::Message;

// The deterministic update of step s (what one optimizer step adds to the parameters).
double update_of(uint64_t step, int i) {
  return 1e-3 * std::sin(0.1 * static_cast<double>(step) + static_cast<double>(i)) +
         1e-6 * static_cast<double>(i + 1);
}

struct Staged {
  uint64_t plan_id = 0;
  Strategy target;
  std::vector<double> buffer;        // the second buffer: a snapshot of the parameters...
  uint64_t buffer_updates = 0;       // ...with the count of updates it holds...
  std::vector<uint64_t> replay_log;  // ...and the steps applied since, replayed at the commit.
  uint64_t ready_at = 0;
  bool ready_sent = false;
};

struct Rank {
  uint32_t id = 0;
  std::unique_ptr<transport::Client> client;
  std::atomic<bool> connected{false};
  bool alive = true;
  bool kill_on_prepare = false;
  bool refuse_prepare = false;
  bool drop_commit = false;
  std::mutex inbox_mutex;
  std::vector<Message> inbox;
  bool agent_lost = false;  // set by the disconnect handler, handled at the next boundary
  bool agent_lost_seen = false;
  std::vector<double> params;
  uint64_t updates = 0;  // updates applied to params (travels with the buffer at a switch)
  Strategy layout;       // the layout this rank runs
  std::optional<Staged> staged;
  std::optional<transport::PlanCommit> commit;
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
  if (options.param_dim < 1) throw InputError("param_dim must be >= 1");
  m.o = std::move(options);
  job_ = take(make_job(m.o.scenario, m.o.ranks));
  m.job = job_;
  if (job_->gpus() != m.o.ranks) {
    throw InputError("scenario " + m.o.scenario + " has " + std::to_string(job_->gpus()) +
                     " GPUs, not --ranks " + std::to_string(m.o.ranks));
  }
  m.truth = env::generate_truth(job_->scenario, m.o.seed);
  m.rng.seed(m.o.seed * 7919 + 17);
  if (!Job::is_initial_name(m.o.initial_layout)) {
    throw InputError("unknown initial layout \"" + m.o.initial_layout + "\" (planned | uniform-dp)");
  }
  m.layout = job_->initial(m.o.initial_layout);
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
    r->params.assign(m.o.param_dim, 0.0);
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

uint64_t SimulatedCluster::current_step() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->step;
}

std::vector<double> SimulatedCluster::reference_params(uint64_t steps, int dim) {
  std::vector<double> p(dim, 0.0);
  for (uint64_t s = 0; s < steps; ++s) {
    for (int i = 0; i < dim; ++i) p[i] += update_of(s, i);
  }
  return p;
}

void SimulatedCluster::step() {
  Impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  const uint64_t s = m.step;

  // 1. Control messages, handled at the iteration boundary.
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
    for (Message& msg : inbox) {
      if (!r.alive) break;
      if (auto* p = std::get_if<transport::PlanPrepare>(&msg)) {
        if (r.kill_on_prepare) {
          r.alive = false;
          r.client->stop();
          m.log("rank " + std::to_string(r.id) + " died on PlanPrepare " +
                std::to_string(p->plan_id));
          break;
        }
        if (r.refuse_prepare) {
          m.send(r, transport::PlanReady{p->plan_id, r.id, false, "refused (fault injection)"});
          continue;
        }
        std::optional<Strategy> target = from_wire(p->layout, *m.job, p->layout_name);
        if (!target) {
          m.send(r, transport::PlanReady{p->plan_id, r.id, false, "layout not legal for this job"});
          continue;
        }
        Staged st;
        st.plan_id = p->plan_id;
        st.target = *target;
        st.buffer = r.params;  // background copy into the second buffer
        st.buffer_updates = r.updates;
        st.ready_at = s + m.o.stage_steps;
        r.staged = std::move(st);
        r.commit.reset();
      } else if (auto* c = std::get_if<transport::PlanCommit>(&msg)) {
        if (r.drop_commit) continue;
        if (r.staged && r.staged->plan_id == c->plan_id) {
          r.commit = *c;
        } else {
          m.send(r, transport::PlanReady{c->plan_id, r.id, false, "commit for a plan not staged"});
        }
      } else if (auto* a = std::get_if<transport::PlanAbort>(&msg)) {
        if (r.staged && r.staged->plan_id == a->plan_id) {
          r.staged.reset();
          r.commit.reset();
          if (r.id == 0 || m.report.aborts == 0)
            m.log("plan " + std::to_string(a->plan_id) + " aborted: " + a->reason);
          ++m.report.aborts;
        }
      }
    }
  }

  // The agent went away (after everything in the inbox arrived): a plan not yet committed is
  // dropped, so everyone stays on the committed layout.
  for (auto& rp : m.ranks) {
    Rank& r = *rp;
    if (!r.alive || !r.agent_lost_seen) continue;
    r.agent_lost_seen = false;
    if (r.staged && !r.commit) {
      r.staged.reset();
      if (r.id == 0) m.log("agent lost: staged plan dropped");
    }
  }

  // 2. The commit agreement at this boundary: switch only if every live rank holds the commit.
  std::optional<uint64_t> due;
  for (auto& rp : m.ranks) {
    if (rp->alive && rp->commit && rp->commit->switch_at_step <= s) due = rp->commit->plan_id;
  }
  if (due) {
    bool all = true;
    for (auto& rp : m.ranks) {
      if (!rp->alive) continue;
      all = all && rp->commit && rp->commit->plan_id == *due && rp->commit->switch_at_step == s;
    }
    if (all) {
      Strategy target;
      for (auto& rp : m.ranks) {
        Rank& r = *rp;
        if (!r.alive) continue;
        for (uint64_t logged : r.staged->replay_log) {
          for (int i = 0; i < m.o.param_dim; ++i) r.staged->buffer[i] += update_of(logged, i);
          ++r.staged->buffer_updates;
        }
        r.params.swap(r.staged->buffer);
        r.updates = r.staged->buffer_updates;
        r.layout = r.staged->target;
        target = r.staged->target;
        r.staged.reset();
        r.commit.reset();
        m.send(r, transport::Ack{transport::MessageType::plan_commit, *due, r.id});
      }
      m.layout = target;
      m.layout_changed();
      ++m.report.commits;
      m.report.commit_steps.push_back(s);
      m.report.sim_seconds += kSwitchPauseS;
      m.log("switched to " + layout_name(target) + " at step " + std::to_string(s));
    } else {
      for (auto& rp : m.ranks) {
        Rank& r = *rp;
        if (!r.alive || !r.commit || r.commit->plan_id != *due) continue;
        m.send(r, transport::PlanReady{*due, r.id, false,
                                       "commit not held by every rank at the boundary; stayed"});
        r.staged.reset();
        r.commit.reset();
      }
      ++m.report.missed_commits;
      m.log("plan " + std::to_string(*due) + ": commit missed at step " + std::to_string(s));
    }
  }

  // 3. Train one step on every live rank.
  const Conditions truth = m.true_conditions(s);
  const int n = m.o.ranks;
  std::vector<uint8_t> alive(n, 0);
  bool staging = false;
  for (int g = 0; g < n; ++g) {
    Rank& r = *m.ranks[g];
    if (!r.alive) continue;
    alive[g] = 1;
    for (int i = 0; i < m.o.param_dim; ++i) r.params[i] += update_of(s, i);
    ++r.updates;
    m.report.samples += m.telemetry->gpu_samples()[g];
    if (r.staged) {
      staging = true;
      r.staged->replay_log.push_back(s);
    }
  }
  const uint64_t start_ns = m.clock_ns;
  std::vector<monitor::StepSample> samples;
  const double step_ms =
      m.telemetry->generate(truth, s, start_ns, m.o.telemetry_noise, m.rng, samples, &alive);
  const CostBreakdown b = m.job->planner->cost_model().evaluate(m.layout, truth);
  double tps = b.feasible && b.fits_in_memory ? b.tokens_per_s : 0.0;
  if (staging) tps *= 1.0 - m.job->scenario.staging_slowdown;
  const double tokens = static_cast<double>(m.job->global_batch) * m.job->scenario.model.seq_len;
  m.report.tokens += tokens;
  m.report.sim_seconds += tps > 0 ? tokens / tps : 0.0;
  m.report.tokens_per_s_by_step.push_back(tps);

  // 4. Telemetry and PlanReady of every live rank.
  for (int g = 0; g < n; ++g) {
    Rank& r = *m.ranks[g];
    if (!r.alive) continue;
    if (r.staged && !r.staged->ready_sent && s + 1 >= r.staged->ready_at) {
      r.staged->ready_sent = true;
      m.send(r, transport::PlanReady{r.staged->plan_id, r.id, true, ""});
    }
  }
  for (const monitor::StepSample& x : samples) {
    Rank& r = *m.ranks[x.rank];
    transport::Telemetry t = monitor::to_telemetry(x);
    t.rank = r.id;
    t.queue_depth = r.staged ? 2u : 1u;
    for (int l = 0; l < m.o.grad_layers; ++l) {
      t.layers.push_back({static_cast<uint32_t>(l), static_cast<float>(1.0 + 0.1 * l), 0.5f, 0});
    }
    t.send_time_ns = start_ns;
    m.send(r, t);
    ++m.report.telemetry_sent;
  }
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
  const Rank* first = nullptr;
  for (const auto& rp : m.ranks) {
    if (!rp->alive) continue;
    ++r.live_ranks;
    r.connected_ranks += rp->connected ? 1 : 0;
    if (!first)
      first = rp.get();
    else if (rp->params != first->params || rp->updates != first->updates ||
             !(rp->layout == first->layout))
      r.replicas_agree = false;
  }
  if (first) {
    r.params = first->params;
    r.updates = first->updates;
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
