// In-process bus: the Server/Client contract without sockets. One dispatch thread per hub runs
// every handler, which gives per-peer ordering for free.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "transport/bus.h"

namespace parapilot::transport {

class InProcClientImpl;
class InProcServerImpl;

struct InProcHub::State : std::enable_shared_from_this<InProcHub::State> {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> tasks;  // guarded by mu
  bool shutting_down = false;               // guarded by mu
  std::thread::id dispatch_id;
  std::thread dispatcher;

  std::shared_ptr<InProcServerImpl> server;                     // guarded by mu
  std::map<PeerId, std::shared_ptr<InProcClientImpl>> clients;  // connected, guarded by mu
  std::vector<std::shared_ptr<InProcClientImpl>> waiting;       // no server yet, guarded by mu
  PeerId next_id = 1;                                           // guarded by mu

  void post(std::function<void()> f) {  // mu held by the caller
    tasks.push_back(std::move(f));
    cv.notify_all();
  }
  void run() {
    std::unique_lock lk(mu);
    for (;;) {
      cv.wait(lk, [&] { return shutting_down || !tasks.empty(); });
      if (tasks.empty()) return;
      auto f = std::move(tasks.front());
      tasks.pop_front();
      lk.unlock();
      f();
      lk.lock();
    }
  }
  /// Waits until every task posted before this call has run (no-op on the dispatch thread).
  void barrier() {
    if (std::this_thread::get_id() == dispatch_id) return;
    std::promise<void> done;
    auto fut = done.get_future();
    {
      std::lock_guard lk(mu);
      if (shutting_down) return;
      post([&done] { done.set_value(); });
    }
    fut.wait();
  }
  void connect_locked(const std::shared_ptr<InProcClientImpl>& c);
};

namespace {

// Round trip through the wire encoding so in-process runs see exactly what TCP peers would.
StatusOr<Message> through_wire(const Message& m) {
  auto frame = encode_frame(m);
  if (!frame) return frame.status();
  return decode_frame(
      std::span(reinterpret_cast<const std::uint8_t*>(frame->data()), frame->size()));
}

bool is_handshake(const Message& m) { return is_internal_type(type_of(m)); }

}  // namespace

class InProcServerImpl {
 public:
  explicit InProcServerImpl(ServerHandlers h) : handlers(std::move(h)) {}
  ServerHandlers handlers;
  std::atomic<bool> stopped{false};
  std::atomic<std::uint64_t> received{0}, sent{0}, accepted{0};
};

class InProcClientImpl {
 public:
  InProcClientImpl(const ClientOptions& o, ClientHandlers h) : opt(o), handlers(std::move(h)) {}
  ClientOptions opt;
  ClientHandlers handlers;
  std::atomic<bool> stopped{false};
  // All below guarded by the hub mutex.
  bool connected = false;
  PeerId id = 0;
  std::deque<std::pair<Message, bool>> buffer;  // (message, is telemetry)
  std::size_t telemetry_buffered = 0;
  std::uint64_t dropped = 0, sent = 0, received = 0, connects = 0;

  PeerInfo info() const {
    PeerInfo p;
    p.id = id;
    p.name = opt.name;
    p.role = opt.role;
    p.rank = opt.rank;
    p.remote_address = "inproc";
    return p;
  }
};

void InProcHub::State::connect_locked(const std::shared_ptr<InProcClientImpl>& c) {
  auto srv = server;
  c->connected = true;
  c->id = next_id++;
  ++c->connects;
  srv->accepted.fetch_add(1);
  clients.emplace(c->id, c);
  const PeerInfo info = c->info();
  post([srv, c, info] {
    if (!srv->stopped && srv->handlers.on_connect) srv->handlers.on_connect(info);
    if (!c->stopped && c->handlers.on_connect) c->handlers.on_connect(info.id);
  });
  while (!c->buffer.empty()) {
    auto [m, telemetry] = std::move(c->buffer.front());
    c->buffer.pop_front();
    if (telemetry) --c->telemetry_buffered;
    ++c->sent;
    srv->received.fetch_add(1);
    post([srv, id = info.id, m = std::move(m)]() mutable {
      if (!srv->stopped && srv->handlers.on_message) srv->handlers.on_message(id, std::move(m));
    });
  }
}

namespace {

class InProcServer final : public Server {
 public:
  InProcServer(std::shared_ptr<InProcHub::State> hub, std::shared_ptr<InProcServerImpl> impl)
      : hub_(std::move(hub)), impl_(std::move(impl)) {}
  ~InProcServer() override { stop(); }

  std::uint16_t port() const override { return 0; }

  bool send(PeerId peer, const Message& m) override {
    auto copy = through_wire(m);
    if (!copy || is_handshake(m) || impl_->stopped) return false;
    std::lock_guard lk(hub_->mu);
    auto it = hub_->clients.find(peer);
    if (it == hub_->clients.end()) return false;
    deliver_locked(it->second, std::move(*copy));
    return true;
  }

  std::size_t broadcast(const Message& m) override {
    auto copy = through_wire(m);
    if (!copy || is_handshake(m) || impl_->stopped) return 0;
    std::lock_guard lk(hub_->mu);
    for (auto& [id, c] : hub_->clients) deliver_locked(c, *copy);
    return hub_->clients.size();
  }

  void disconnect(PeerId peer, std::string_view reason) override {
    std::lock_guard lk(hub_->mu);
    auto it = hub_->clients.find(peer);
    if (it == hub_->clients.end()) return;
    auto c = it->second;
    drop_locked(c, std::string(reason));
    // Like a TCP client, it comes back at once (as a new peer).
    if (!c->stopped && !impl_->stopped) hub_->connect_locked(c);
  }

  std::vector<PeerInfo> peers() const override {
    std::vector<PeerInfo> out;
    std::lock_guard lk(hub_->mu);
    for (auto& [id, c] : hub_->clients) out.push_back(c->info());
    return out;
  }

  ServerStats stats() const override {
    ServerStats s;
    s.accepted = s.authenticated = impl_->accepted.load();
    s.messages_received = impl_->received.load();
    s.messages_sent = impl_->sent.load();
    std::lock_guard lk(hub_->mu);
    s.connections = hub_->clients.size();
    return s;
  }

  void stop() override {
    {
      std::lock_guard lk(hub_->mu);
      if (impl_->stopped) return;
      auto all = hub_->clients;
      for (auto& [id, c] : all) {
        drop_locked(c, "server stopping");
        hub_->waiting.push_back(c);
      }
      hub_->server.reset();
    }
    hub_->barrier();
    impl_->stopped = true;
  }

 private:
  void deliver_locked(const std::shared_ptr<InProcClientImpl>& c, Message m) {
    ++c->received;
    impl_->sent.fetch_add(1);
    hub_->post([c, m = std::move(m)]() mutable {
      if (!c->stopped && c->handlers.on_message) c->handlers.on_message(std::move(m));
    });
  }

  void drop_locked(const std::shared_ptr<InProcClientImpl>& c, std::string reason) {
    hub_->clients.erase(c->id);
    c->connected = false;
    hub_->post([srv = impl_, c, id = c->id, reason = std::move(reason)] {
      if (!srv->stopped && srv->handlers.on_disconnect) srv->handlers.on_disconnect(id, reason);
      if (!c->stopped && c->handlers.on_disconnect) c->handlers.on_disconnect(reason);
    });
  }

  std::shared_ptr<InProcHub::State> hub_;
  std::shared_ptr<InProcServerImpl> impl_;
};

class InProcClient final : public Client {
 public:
  InProcClient(std::shared_ptr<InProcHub::State> hub, std::shared_ptr<InProcClientImpl> impl)
      : hub_(std::move(hub)), impl_(std::move(impl)) {}
  ~InProcClient() override { stop(); }

  bool send(const Message& m) override {
    if (impl_->stopped || is_handshake(m)) return false;
    auto copy = through_wire(m);
    if (!copy) return false;
    const bool telemetry = std::holds_alternative<Telemetry>(m);
    std::lock_guard lk(hub_->mu);
    auto& c = *impl_;
    if (c.connected && hub_->server) {
      ++c.sent;
      auto srv = hub_->server;
      srv->received.fetch_add(1);
      hub_->post([srv, id = c.id, m = std::move(*copy)]() mutable {
        if (!srv->stopped && srv->handlers.on_message) srv->handlers.on_message(id, std::move(m));
      });
      return true;
    }
    if (telemetry) {
      if (c.opt.telemetry_buffer_capacity == 0) {
        ++c.dropped;
        return true;
      }
      if (c.telemetry_buffered >= c.opt.telemetry_buffer_capacity) {
        for (auto it = c.buffer.begin(); it != c.buffer.end(); ++it) {
          if (it->second) {
            c.buffer.erase(it);
            --c.telemetry_buffered;
            ++c.dropped;
            break;
          }
        }
      }
      ++c.telemetry_buffered;
    }
    c.buffer.emplace_back(std::move(*copy), telemetry);
    return true;
  }

  bool connected() const override {
    std::lock_guard lk(hub_->mu);
    return impl_->connected;
  }

  bool flush(std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      {
        std::lock_guard lk(hub_->mu);
        if (impl_->buffer.empty()) break;
      }
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    hub_->barrier();
    return true;
  }

  ClientStats stats() const override {
    std::lock_guard lk(hub_->mu);
    ClientStats s;
    s.connects = impl_->connects;
    s.messages_sent = impl_->sent;
    s.messages_received = impl_->received;
    s.telemetry_dropped = impl_->dropped;
    s.queued = impl_->buffer.size();
    return s;
  }

  void stop() override {
    {
      std::lock_guard lk(hub_->mu);
      if (impl_->stopped) return;
      auto& w = hub_->waiting;
      w.erase(std::remove(w.begin(), w.end(), impl_), w.end());
      if (impl_->connected) {
        hub_->clients.erase(impl_->id);
        impl_->connected = false;
        if (auto srv = hub_->server) {
          hub_->post([srv, id = impl_->id] {
            if (!srv->stopped && srv->handlers.on_disconnect)
              srv->handlers.on_disconnect(id, "client stopped");
          });
        }
      }
      impl_->stopped = true;
    }
    hub_->barrier();
  }

 private:
  std::shared_ptr<InProcHub::State> hub_;
  std::shared_ptr<InProcClientImpl> impl_;
};

}  // namespace

InProcHub::InProcHub() : state_(std::make_shared<State>()) {
  state_->dispatcher = std::thread([s = state_.get()] { s->run(); });
  state_->dispatch_id = state_->dispatcher.get_id();
}

InProcHub::~InProcHub() {
  {
    std::lock_guard lk(state_->mu);
    state_->shutting_down = true;
    state_->cv.notify_all();
  }
  state_->dispatcher.join();
}

StatusOr<std::unique_ptr<Server>> InProcHub::make_server(ServerHandlers handlers) {
  auto impl = std::make_shared<InProcServerImpl>(std::move(handlers));
  std::lock_guard lk(state_->mu);
  if (state_->server) return Status::rejected("the hub already has a server");
  state_->server = impl;
  auto waiting = std::move(state_->waiting);
  state_->waiting.clear();
  for (auto& c : waiting) {
    if (!c->stopped) state_->connect_locked(c);
  }
  return std::unique_ptr<Server>(std::make_unique<InProcServer>(state_, impl));
}

std::unique_ptr<Client> InProcHub::make_client(const ClientOptions& options,
                                               ClientHandlers handlers) {
  auto impl = std::make_shared<InProcClientImpl>(options, std::move(handlers));
  {
    std::lock_guard lk(state_->mu);
    if (state_->server) {
      state_->connect_locked(impl);
    } else {
      state_->waiting.push_back(impl);
    }
  }
  return std::make_unique<InProcClient>(state_, impl);
}

}  // namespace parapilot::transport
