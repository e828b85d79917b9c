#include "env/live/worker_bus.h"

#include <chrono>
#include <thread>


namespace parapilot::live {

namespace {

StatusOr<std::pair<std::string, std::uint16_t>> split_address(const std::string& agent) {
  const std::size_t colon = agent.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return Status::invalid_argument("--agent '" + agent + "': expected HOST:PORT");
  }
  const std::string port_text = agent.substr(colon + 1);
  char* end = nullptr;
  const long port = std::strtol(port_text.c_str(), &end, 10);
  if (port_text.empty() || *end != '\0' || port < 1 || port > 65535) {
    return Status::invalid_argument("--agent '" + agent + "': bad port");
  }
  return std::pair<std::string, std::uint16_t>{agent.substr(0, colon),
                                               static_cast<std::uint16_t>(port)};
}

}  // namespace

WorkerBus::WorkerBus(int rank, PlanReader read_plan, transport::JobInfo job)
    : read_plan_(std::move(read_plan)),
      job_(std::move(job)),
      book_(static_cast<std::uint32_t>(rank), [this](const transport::Message& m) {
        if (transport::Client* c = live_client_.load()) c->send(m);
      }) {}

StatusOr<std::unique_ptr<WorkerBus>> WorkerBus::connect(const std::string& agent,
                                                        const std::string& secret_file, int rank,
                                                        PlanReader read_plan,
                                                        transport::JobInfo job,
                                                        StageAsync stage_async) {
  const StatusOr<std::pair<std::string, std::uint16_t>> address = split_address(agent);
  if (!address.ok()) return address.status();
  if (secret_file.empty()) {
    return Status::invalid_argument("--agent needs --secret-file (the bus shared secret)");
  }
  auto secret = transport::load_secret_from_file(secret_file);
  if (!secret) return Status(secret.status().code(), "--secret-file: " + secret.status().message());
  std::unique_ptr<WorkerBus> bus(new WorkerBus(rank, std::move(read_plan), std::move(job)));
  bus->stage_async_ = std::move(stage_async);
  WorkerBus* self = bus.get();
  transport::ClientOptions o;
  o.server_address = address->first;
  o.port = address->second;
  o.secret = *secret;
  o.name = "worker-" + std::to_string(rank);
  o.role = transport::PeerRole::worker;
  o.rank = static_cast<std::uint32_t>(rank);
  o.logger = transport::stderr_logger(transport::LogLevel::error);
  transport::ClientHandlers h;
  h.on_message = [self](transport::Message&& m) { self->on_message(std::move(m)); };
  h.on_disconnect = [self](std::string_view) { self->book_.drop_uncommitted(); };
  h.on_connect = [self](transport::PeerId) {
    self->announce_pending_ = true;
    if (transport::Client* c = self->live_client_.load();
        c && self->announce_pending_.exchange(false)) {
      c->send(self->job_);
    }
  };
  auto client = transport::make_tcp_client(std::move(o), std::move(h));
  if (!client) return Status(client.status().code(), "--agent: " + client.status().message());
  bus->client_ = std::move(*client);
  bus->live_client_.store(bus->client_.get());
  if (bus->announce_pending_.exchange(false)) bus->client_->send(bus->job_);
  return bus;
}

WorkerBus::~WorkerBus() {
  if (client_) client_->stop();
}

bool WorkerBus::connected() const { return client_->connected(); }

bool WorkerBus::wait_connected(int timeout_ms) const {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (!client_->connected()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

void WorkerBus::send(const transport::Message& m) { client_->send(m); }

void WorkerBus::flush(int timeout_ms) { client_->flush(std::chrono::milliseconds(timeout_ms)); }

std::uint64_t WorkerBus::committed_at(std::uint64_t step, std::uint64_t after_id) const {
  return book_.committed_at(step, after_id);
}

bool WorkerBus::holds(std::uint64_t plan_id) const { return book_.holds(plan_id); }

std::optional<LiveAction> WorkerBus::applied(std::uint64_t plan_id) {
  return book_.applied(plan_id);
}

void WorkerBus::missed(std::uint64_t plan_id, const std::string& detail) {
  book_.missed(plan_id, detail);
}

bool WorkerBus::stop_requested() const { return book_.stop_reason().has_value(); }

void WorkerBus::on_message(transport::Message&& m) {
  const std::optional<transport::PlanPrepare> prepare = book_.on_message(m);
  if (!prepare) return;
  StatusOr<LiveAction> action = read_plan_(*prepare);
  if (!action.ok()) {
    book_.refuse(prepare->plan_id, action.status().message());
    return;
  }
  const std::uint64_t id = prepare->plan_id;
  if (stage_async_ && !action->layout.empty()) {
    const LiveAction staged = *action;
    book_.stage(id, std::move(action).value());
    stage_async_(id, staged, [this, id](const Status& st) {
      if (st.ok())
        book_.ready(id);
      else if (knows(id))
        book_.refuse(id, st.message());
    });
    return;
  }
  book_.stage(id, std::move(action).value());
  book_.ready(id);
}

bool WorkerBus::knows(std::uint64_t plan_id) {
  bool found = false;
  book_.for_each([&](std::uint64_t id, const LiveAction&) { found = found || id == plan_id; });
  return found;
}

}  // namespace parapilot::live
