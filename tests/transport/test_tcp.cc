// TCP bus tests on loopback with ephemeral ports: round trips, malformed frames, authentication,
// limits, reconnect with buffered telemetry, heartbeats, backpressure. No timing assertions
// beyond generous timeouts.
#include <doctest/doctest.h>

#include <boost/asio/ip/tcp.hpp>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <set>

#include "tests/transport/raw_peer.h"
#include "tests/transport/test_util.h"
#include "transport/bus.h"

using namespace parapilot::transport;
using namespace parapilot::transport::testing;
using namespace std::chrono_literals;

namespace {

/// Records everything a server's handlers see.
struct ServerLog {
  mutable std::mutex mu;
  std::vector<std::pair<PeerId, Message>> messages;
  std::vector<PeerInfo> connects;
  std::vector<std::pair<PeerId, std::string>> disconnects;

  ServerHandlers handlers() {
    ServerHandlers h;
    h.on_connect = [this](const PeerInfo& p) {
      std::lock_guard lk(mu);
      connects.push_back(p);
    };
    h.on_message = [this](PeerId id, Message&& m) {
      std::lock_guard lk(mu);
      messages.emplace_back(id, std::move(m));
    };
    h.on_disconnect = [this](PeerId id, std::string_view reason) {
      std::lock_guard lk(mu);
      disconnects.emplace_back(id, std::string(reason));
    };
    return h;
  }
  std::size_t message_count() const {
    std::lock_guard lk(mu);
    return messages.size();
  }
  std::size_t connect_count() const {
    std::lock_guard lk(mu);
    return connects.size();
  }
  std::optional<std::string> disconnect_reason(PeerId id) const {
    std::lock_guard lk(mu);
    for (const auto& [p, r] : disconnects) {
      if (p == id) return r;
    }
    return std::nullopt;
  }
  bool has_telemetry_step(PeerId from, std::uint64_t step) const {
    std::lock_guard lk(mu);
    for (const auto& [p, m] : messages) {
      if (p == from && std::holds_alternative<Telemetry>(m) && std::get<Telemetry>(m).step == step)
        return true;
    }
    return false;
  }
  std::vector<Message> from(PeerId id) const {
    std::lock_guard lk(mu);
    std::vector<Message> out;
    for (const auto& [p, m] : messages) {
      if (p == id) out.push_back(m);
    }
    return out;
  }
};

/// Records everything a client's handlers see.
struct ClientLog {
  mutable std::mutex mu;
  std::vector<Message> messages;
  std::vector<std::string> disconnects;
  std::atomic<int> connects{0};

  ClientHandlers handlers() {
    ClientHandlers h;
    h.on_connect = [this](PeerId) { connects.fetch_add(1); };
    h.on_message = [this](Message&& m) {
      std::lock_guard lk(mu);
      messages.push_back(std::move(m));
    };
    h.on_disconnect = [this](std::string_view reason) {
      std::lock_guard lk(mu);
      disconnects.emplace_back(reason);
    };
    return h;
  }
  std::size_t message_count() const {
    std::lock_guard lk(mu);
    return messages.size();
  }
  bool disconnected_with(std::string_view needle) const {
    std::lock_guard lk(mu);
    for (const auto& d : disconnects) {
      if (d.find(needle) != std::string::npos) return true;
    }
    return false;
  }
};

ServerOptions server_options(LogCapture& log) {
  ServerOptions o;
  o.secret = Secret(kTestSecret);
  o.io_threads = 2;
  o.max_frame_bytes = kTestMaxFrameBytes;
  o.logger = log.logger();
  return o;
}

ClientOptions client_options(std::uint16_t port, LogCapture& log, std::string name = "worker-0") {
  ClientOptions o;
  o.port = port;
  o.secret = Secret(kTestSecret);
  o.name = std::move(name);
  o.rank = 0;
  o.reconnect_initial_ms = 10;
  o.reconnect_max_ms = 100;
  o.max_frame_bytes = kTestMaxFrameBytes;
  o.logger = log.logger();
  return o;
}

std::unique_ptr<Server> start_server(ServerOptions o, ServerLog& sl) {
  auto s = make_tcp_server(std::move(o), sl.handlers());
  REQUIRE_MESSAGE(s.ok(), s.status().message());
  return std::move(*s);
}

std::unique_ptr<Client> start_client(ClientOptions o, ClientLog& cl) {
  auto c = make_tcp_client(std::move(o), cl.handlers());
  REQUIRE_MESSAGE(c.ok(), c.status().message());
  return std::move(*c);
}

}  // namespace

TEST_CASE("tcp: defaults are secure and bad options are refused") {
  ServerOptions o;
  CHECK(o.listen_address == "127.0.0.1");
  ServerLog sl;
  auto no_secret = make_tcp_server(o, sl.handlers());
  CHECK_FALSE(no_secret.ok());
  o.secret = Secret("short");
  CHECK_FALSE(make_tcp_server(o, sl.handlers()).ok());
  ClientOptions c;
  CHECK(c.server_address == "127.0.0.1");
  c.port = 1;
  ClientLog cl;
  CHECK_FALSE(make_tcp_client(c, cl.handlers()).ok());
  LogCapture log;
  auto bad_addr = server_options(log);
  bad_addr.listen_address = "not an address";
  CHECK_FALSE(make_tcp_server(bad_addr, sl.handlers()).ok());
}

TEST_CASE("tcp: every message type round-trips between a client and the server") {
  LogCapture log;
  ServerLog sl;
  auto server = start_server(server_options(log), sl);
  CHECK(server->port() != 0);
  ClientLog cl;
  auto client = start_client(client_options(server->port(), log), cl);
  REQUIRE(wait_until([&] { return client->connected() && sl.connect_count() == 1; }));
  const PeerInfo peer = server->peers().at(0);
  CHECK(peer.name == "worker-0");
  CHECK(peer.rank == 0);
  CHECK(peer.remote_address.rfind("127.0.0.1:", 0) == 0);

  const std::vector<Message> upstream = {
      JobInfo{0, 2, 64, kCapDpShares, "pytorch-ddp 1.13.1", {{1000, 2000}}},
      make_telemetry(0, 1), PlanReady{4, 0, true, "ready"}, Ack{MessageType::plan_commit, 4, 0},
      Shutdown{"leaving"}};
  const std::vector<Message> downstream = {
      PlanPrepare{4, Layout{2, 2, 1, 8, {}, {}}, "dp2-tp2", 1000},
      PlanCommit{4, 100},
      PlanAbort{5, "superseded"},
      Ack{MessageType::plan_ready, 4, kNoRank},
      Shutdown{"stop"},
      make_telemetry(3, 9)};
  for (const auto& m : upstream) CHECK(client->send(m));
  for (const auto& m : downstream) CHECK(server->send(peer.id, m));
  REQUIRE(wait_until([&] { return sl.message_count() == upstream.size(); }));
  REQUIRE(wait_until([&] { return cl.message_count() == downstream.size(); }));
  CHECK(sl.from(peer.id) == upstream);
  {
    std::lock_guard lk(cl.mu);
    CHECK(cl.messages == downstream);
  }
  // Every type a user may send: all but the transport's own five (handshake and heartbeat).
  std::set<MessageType> sent;
  for (const auto& m : upstream) sent.insert(type_of(m));
  for (const auto& m : downstream) sent.insert(type_of(m));
  CHECK(sent.size() == std::variant_size_v<Message> - 5);
  CHECK_FALSE(sent.count(MessageType::heartbeat));
  CHECK(server->broadcast(PlanCommit{6, 7}) == 1);
  REQUIRE(wait_until([&] { return cl.message_count() == downstream.size() + 1; }));
  // Invalid messages are refused at the sender.
  Telemetry bad = make_telemetry(0, 1);
  bad.compute_ms = -1;
  CHECK_FALSE(client->send(bad));
  CHECK_FALSE(server->send(peer.id, bad));
  CHECK_FALSE(server->send(peer.id + 1000, PlanCommit{1, 1}));
  CHECK_FALSE(client->send(Heartbeat{1, 1}));  // internal messages are the transport's own
  CHECK_FALSE(server->send(peer.id, Welcome{1, 1, 4096}));
  CHECK(server->broadcast(Auth{}) == 0);
  client->stop();
  REQUIRE(wait_until([&] { return sl.disconnect_reason(peer.id).has_value(); }));
  CHECK_FALSE(log.contains(kTestSecret));
}

TEST_CASE("tcp: each malformed frame closes only its own connection") {
  LogCapture log;
  ServerLog sl;
  auto server = start_server(server_options(log), sl);
  ClientLog cl;
  auto good = start_client(client_options(server->port(), log, "good"), cl);
  REQUIRE(wait_until([&] { return good->connected(); }));
  const PeerId good_id = server->peers().at(0).id;
  const Secret secret(kTestSecret);

  std::uint64_t step = 0;
  auto good_peer_still_works = [&] {
    const std::uint64_t s = ++step;
    REQUIRE(good->send(make_telemetry(0, s)));
    CHECK(wait_until([&] { return sl.has_telemetry_step(good_id, s); }));
    CHECK(good->connected());
  };

  auto cases = malformed_cases();
  // Protocol violations that are well-formed frames.
  Hello again;
  again.name = "again";
  cases.push_back({"hello after authentication", *encode_frame(again), "unexpected hello"});
  cases.push_back(
      {"welcome from a client", *encode_frame(Welcome{1, 1, 4096}), "unexpected welcome"});

  for (const MalformedCase& c : cases) {
    CAPTURE(c.name);
    RawPeer bad;
    REQUIRE(bad.connect(server->port()));
    const PeerId id = bad.client_handshake(secret);
    REQUIRE(id != 0);
    REQUIRE(bad.write(c.bytes));
    if (c.closes_stream) bad.shutdown_send();
    CHECK(bad.closed_by_peer());
    REQUIRE(wait_until([&] { return sl.disconnect_reason(id).has_value(); }));
    CHECK_MESSAGE(sl.disconnect_reason(id)->find(c.reason) != std::string::npos,
                  *sl.disconnect_reason(id));
    good_peer_still_works();
  }

  // Before authentication: garbage, a frame that is not Hello, a bad Hello.
  const std::vector<std::pair<std::string, std::string>> pre_auth = {
      {malformed_case("wrong magic").bytes, "bad magic"},
      {*encode_frame(make_telemetry(0, 1)), "expected hello"},
      {framed(MessageType::hello, payload_of(Hello{PeerRole::worker, 0, "", {}})),
       "hello.name is empty"},
  };
  for (const auto& [bytes, reason] : pre_auth) {
    CAPTURE(reason);
    RawPeer bad;
    REQUIRE(bad.connect(server->port()));
    REQUIRE(bad.write(bytes));
    CHECK(bad.closed_by_peer());
    CHECK(wait_until([&, r = reason] { return log.contains(r); }));
    good_peer_still_works();
  }
  CHECK(server->peers().size() == 1);
  CHECK(server->stats().rejected >= cases.size() + pre_auth.size());
  CHECK(sl.connect_count() == 1 + cases.size());
  CHECK_FALSE(log.contains(kTestSecret));
}

TEST_CASE("tcp: authentication failures") {
  LogCapture log;
  ServerLog sl;
  auto server = start_server(server_options(log), sl);

  SUBCASE("a client with the wrong secret never connects") {
    LogCapture client_log;
    ClientLog cl;
    auto o = client_options(server->port(), client_log);
    o.secret = Secret("wrong-secret-wrong-secret-wrong");
    auto client = start_client(o, cl);
    CHECK(wait_until([&] { return client_log.contains("server failed authentication"); }));
    CHECK_FALSE(client->connected());
    CHECK(sl.connect_count() == 0);
    CHECK(client->stats().connects == 0);
    CHECK_FALSE(client_log.contains("wrong-secret"));
  }
  SUBCASE("a wrong proof is rejected by the server") {
    RawPeer bad;
    REQUIRE(bad.connect(server->port()));
    Hello hello;
    hello.name = "intruder";
    hello.client_nonce = random_nonce();
    REQUIRE(bad.send(hello));
    auto ch = bad.read_message();
    REQUIRE(ch.has_value());
    REQUIRE(std::holds_alternative<Challenge>(*ch));
    const Secret wrong("not-the-secret-not-the-secret");
    REQUIRE(bad.send(
        Auth{client_proof(wrong, std::get<Challenge>(*ch).server_nonce, hello.client_nonce)}));
    CHECK(bad.closed_by_peer());
    CHECK(wait_until([&] { return log.contains("authentication failed"); }));
    CHECK(sl.connect_count() == 0);
    CHECK(server->stats().rejected == 1);
  }
  SUBCASE("replaying a recorded proof fails against a fresh challenge") {
    RawPeer first;
    REQUIRE(first.connect(server->port()));
    Hello hello;
    hello.name = "replayer";
    hello.client_nonce = random_nonce();
    REQUIRE(first.send(hello));
    auto ch = first.read_message();
    REQUIRE(ch.has_value());
    const Auth recorded{client_proof(Secret(kTestSecret), std::get<Challenge>(*ch).server_nonce,
                                     hello.client_nonce)};
    RawPeer second;
    REQUIRE(second.connect(server->port()));
    REQUIRE(second.send(hello));
    REQUIRE(second.read_message().has_value());
    REQUIRE(second.send(recorded));  // proof for the first connection's challenge
    CHECK(second.closed_by_peer());
    CHECK(wait_until([&] { return log.contains("authentication failed"); }));
  }
  CHECK_FALSE(log.contains(kTestSecret));
}

TEST_CASE("tcp: limits on unauthenticated time and on connections") {
  LogCapture log;
  ServerLog sl;
  auto o = server_options(log);
  o.unauthenticated_timeout_ms = 200;
  auto server = start_server(o, sl);

  RawPeer silent;
  REQUIRE(silent.connect(server->port()));
  CHECK(silent.closed_by_peer());  // said nothing: closed after 200 ms
  CHECK(wait_until([&] { return log.contains("unauthenticated for more than"); }));

  RawPeer slow;  // a partial hello is no better
  REQUIRE(slow.connect(server->port()));
  REQUIRE(slow.write(encode_frame(Hello{PeerRole::worker, 0, "slow", {}})->substr(0, 10)));
  CHECK(slow.closed_by_peer());

  // Two connections in the handshake fill max_unauthenticated; a third waits for a slot (not
  // refused, not read, its handshake timeout not running) and gets one when the first goes.
  auto o2 = server_options(log);
  o2.unauthenticated_timeout_ms = 60'000;
  o2.max_unauthenticated = 2;
  ServerLog sl2;
  auto server2 = start_server(o2, sl2);
  std::optional<RawPeer> a(std::in_place);
  RawPeer b, c;
  REQUIRE(a->connect(server2->port()));
  REQUIRE(b.connect(server2->port()));
  REQUIRE(wait_until([&] { return server2->stats().connections == 2; }));
  REQUIRE(c.connect(server2->port()));
  REQUIRE(wait_until([&] { return server2->stats().waiting == 1; }));
  CHECK_FALSE(c.closed_by_peer(300ms));
  CHECK(server2->stats().handshakes_queued == 1);
  a.reset();  // frees a handshake slot
  CHECK(c.client_handshake(Secret(kTestSecret), "waited") != 0);
  CHECK(server2->stats().waiting == 0);
  CHECK(server2->stats().rejected == 0);
}

TEST_CASE("tcp: connection limit") {
  LogCapture log;
  ServerLog sl;
  auto o = server_options(log);
  o.max_connections = 2;
  auto server = start_server(o, sl);
  ClientLog cl1, cl2, cl3;
  auto c1 = start_client(client_options(server->port(), log, "w1"), cl1);
  auto c2 = start_client(client_options(server->port(), log, "w2"), cl2);
  REQUIRE(wait_until([&] { return sl.connect_count() == 2; }));
  // A third waits in the listen backlog (the acceptor pauses), is never refused, and is
  // admitted once a connection closes.
  auto c3 = start_client(client_options(server->port(), log, "w3"), cl3);
  CHECK(wait_until([&] { return log.contains("connection limit (2) reached"); }));
  std::this_thread::sleep_for(300ms);
  CHECK_FALSE(c3->connected());
  CHECK(server->stats().connections == 2);
  CHECK(c1->connected());
  CHECK(c2->connected());
  c1->stop();
  CHECK(wait_until([&] { return c3->connected(); }));
  CHECK(sl.connect_count() == 3);
  CHECK(server->stats().rejected == 0);
  CHECK_FALSE(cl3.disconnected_with(""));  // never refused, never dropped
}

TEST_CASE("tcp: a connection storm is admitted, not refused") {
  // 2,000 clients connect at once to a server that runs at most 64 handshakes at a time:
  // every one is admitted (the rest wait for a slot), none is refused or has to retry.
  constexpr int kClients = 2000;
  LogCapture log;
  ServerLog sl;
  auto o = server_options(log);
  o.max_unauthenticated = 64;
  o.max_connections = 4096;
  o.unauthenticated_timeout_ms = 30'000;
  o.heartbeat_timeout_ms = 30'000;
  auto server = start_server(o, sl);
  auto runtime = std::make_shared<IoRuntime>(2);
  std::vector<std::unique_ptr<ClientLog>> logs;
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < kClients; ++i) {
    auto co = client_options(server->port(), log, "storm-" + std::to_string(i));
    co.rank = static_cast<std::uint32_t>(i);
    co.connect_timeout_ms = 60'000;
    co.heartbeat_timeout_ms = 30'000;
    logs.push_back(std::make_unique<ClientLog>());
    auto c = make_tcp_client(co, logs.back()->handlers(), runtime);
    REQUIRE(c.ok());
    clients.push_back(std::move(*c));
  }
  CHECK(wait_until([&] { return sl.connect_count() == kClients; }, 120s));
  const ServerStats st = server->stats();
  CHECK(st.authenticated == static_cast<std::uint64_t>(kClients));
  CHECK(st.accepted == static_cast<std::uint64_t>(kClients));  // one connection each: no retry
  CHECK(st.rejected == 0);
  CHECK(st.handshakes_queued > 0);  // the limit was reached: the queue paced the storm
  CHECK(st.waiting == 0);
  std::size_t reconnects = 0;
  for (const auto& l : logs) reconnects += l->disconnected_with("") ? 1 : 0;
  CHECK(reconnects == 0);
  CHECK_FALSE(log.contains("refused"));
  for (auto& c : clients) c->stop();
  clients.clear();
}

TEST_CASE("tcp: reconnect delivers buffered telemetry in order") {
  LogCapture log;
  ServerLog sl1, sl2;  // outlive the servers that call into them
  auto server = start_server(server_options(log), sl1);
  const std::uint16_t port = server->port();
  ClientLog cl;
  auto client = start_client(client_options(port, log), cl);
  REQUIRE(wait_until([&] { return client->connected(); }));
  for (std::uint64_t s = 0; s < 100; ++s) REQUIRE(client->send(make_telemetry(0, s)));
  REQUIRE(wait_until([&] { return sl1.message_count() == 100; }));

  server->stop();
  REQUIRE(wait_until([&] { return !client->connected(); }));
  CHECK(cl.disconnected_with("server closed the connection"));
  // While the server is down, telemetry and a control message wait in the client.
  for (std::uint64_t s = 100; s < 200; ++s) REQUIRE(client->send(make_telemetry(0, s)));
  REQUIRE(client->send(PlanReady{1, 0, true, ""}));
  for (std::uint64_t s = 200; s < 250; ++s) REQUIRE(client->send(make_telemetry(0, s)));
  CHECK(client->stats().queued == 151);

  auto o = server_options(log);
  o.port = port;
  server = start_server(o, sl2);
  REQUIRE(wait_until([&] { return sl2.message_count() == 151; }));
  const auto got = sl2.from(server->peers().at(0).id);
  for (std::size_t i = 0; i < 100; ++i) {
    REQUIRE(std::holds_alternative<Telemetry>(got[i]));
    CHECK(std::get<Telemetry>(got[i]).step == 100 + i);
  }
  CHECK(std::holds_alternative<PlanReady>(got[100]));
  for (std::size_t i = 101; i < 151; ++i) CHECK(std::get<Telemetry>(got[i]).step == 99 + i);
  CHECK(client->stats().connects == 2);
  CHECK(client->stats().telemetry_dropped == 0);
}

TEST_CASE("tcp: a full telemetry buffer drops the oldest telemetry, never a control message") {
  LogCapture log;
  ServerLog sl;
  // Reserve a port with a server, then take it down so that the client starts disconnected.
  auto probe = start_server(server_options(log), sl);
  const std::uint16_t port = probe->port();
  probe.reset();

  ClientLog cl;
  auto co = client_options(port, log);
  co.telemetry_buffer_capacity = 50;
  auto client = start_client(co, cl);
  for (std::uint64_t s = 0; s < 30; ++s) REQUIRE(client->send(make_telemetry(0, s)));
  REQUIRE(client->send(PlanReady{7, 0, false, "not yet"}));
  for (std::uint64_t s = 30; s < 100; ++s) REQUIRE(client->send(make_telemetry(0, s)));
  REQUIRE(client->send(Ack{MessageType::plan_commit, 7, 0}));
  CHECK(client->stats().telemetry_dropped == 50);
  CHECK(client->stats().queued == 52);

  auto so = server_options(log);
  so.port = port;
  ServerLog sl2;
  auto server = start_server(so, sl2);
  REQUIRE(wait_until([&] { return sl2.message_count() == 52; }));
  const auto got = sl2.from(server->peers().at(0).id);
  CHECK(std::holds_alternative<PlanReady>(got[0]));
  for (std::size_t i = 1; i <= 50; ++i) CHECK(std::get<Telemetry>(got[i]).step == 49 + i);
  CHECK(std::holds_alternative<Ack>(got[51]));
}

TEST_CASE("tcp: a long outage keeps the newest telemetry and every control message, in order") {
  // Many times the buffer's capacity is sent while disconnected: evicted frames pile up and are
  // compacted away over and over; what arrives is exactly the newest telemetry and all control
  // messages, in the order sent.
  LogCapture log;
  ServerLog sl;
  auto probe = start_server(server_options(log), sl);
  const std::uint16_t port = probe->port();
  probe.reset();

  ClientLog cl;
  auto co = client_options(port, log);
  co.telemetry_buffer_capacity = 700;
  auto client = start_client(co, cl);
  constexpr std::uint64_t kSteps = 20'000;
  for (std::uint64_t s = 0; s < kSteps; ++s) {
    REQUIRE(client->send(make_telemetry(0, s)));
    if (s % 1000 == 999) REQUIRE(client->send(PlanReady{s, 0, true, ""}));
  }
  CHECK(client->stats().telemetry_dropped == kSteps - 700);
  CHECK(client->stats().queued == 700 + 20);

  auto so = server_options(log);
  so.port = port;
  ServerLog sl2;
  auto server = start_server(so, sl2);
  REQUIRE(wait_until([&] { return sl2.message_count() == 720; }));
  const auto got = sl2.from(server->peers().at(0).id);
  std::uint64_t next_step = kSteps - 700, next_plan = 999;
  for (const Message& m : got) {
    if (const auto* t = std::get_if<Telemetry>(&m)) {
      CHECK(t->step == next_step);
      ++next_step;
      // A control message sent after this step must come after it.
      if (t->step > next_plan) FAIL("PlanReady " << next_plan << " arrived after step " << t->step);
    } else {
      REQUIRE(std::holds_alternative<PlanReady>(m));
      CHECK(std::get<PlanReady>(m).plan_id == next_plan);
      next_plan += 1000;
    }
  }
  CHECK(next_step == kSteps);
  CHECK(next_plan == kSteps + 999);
}

TEST_CASE("tcp: heartbeats keep idle peers alive and detect dead ones") {
  LogCapture log;
  ServerLog sl;
  auto so = server_options(log);
  so.heartbeat_interval_ms = 20;
  so.heartbeat_timeout_ms = 300;
  auto server = start_server(so, sl);

  SUBCASE("an idle but healthy client stays connected") {
    ClientLog cl;
    auto co = client_options(server->port(), log);
    co.heartbeat_interval_ms = 20;
    co.heartbeat_timeout_ms = 1000;
    auto client = start_client(co, cl);
    REQUIRE(wait_until([&] { return client->connected(); }));
    std::this_thread::sleep_for(1500ms);  // many heartbeat timeouts of the server
    CHECK(client->connected());
    CHECK(client->stats().connects == 1);
    CHECK(sl.connect_count() == 1);
  }
  SUBCASE("the server drops a peer that went silent") {
    RawPeer silent;
    REQUIRE(silent.connect(server->port()));
    const PeerId id = silent.client_handshake(Secret(kTestSecret));
    REQUIRE(id != 0);
    REQUIRE(wait_until([&] { return sl.disconnect_reason(id).has_value(); }));
    CHECK(sl.disconnect_reason(id)->find("heartbeat timeout") != std::string::npos);
    CHECK(silent.closed_by_peer());
  }
  SUBCASE("a client drops a server that went silent, then reconnects") {
    boost::asio::io_context io;
    boost::asio::ip::tcp::acceptor acc(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
    ClientLog cl;
    auto co = client_options(acc.local_endpoint().port(), log);
    co.heartbeat_interval_ms = 20;
    co.heartbeat_timeout_ms = 300;
    auto client = start_client(co, cl);
    RawPeer fake;
    REQUIRE(fake.accept_from(acc));
    REQUIRE(fake.server_handshake(Secret(kTestSecret), 42));
    REQUIRE(wait_until([&] { return client->connected(); }));
    // The fake server now says nothing.
    REQUIRE(wait_until([&] { return cl.disconnected_with("heartbeat timeout"); }));
    RawPeer again;  // the client comes back
    CHECK(again.accept_from(acc));
    CHECK(again.server_handshake(Secret(kTestSecret), 43));
    CHECK(wait_until([&] { return client->stats().connects == 2; }));
  }
}

TEST_CASE("tcp: a client timeout shorter than the server's heartbeat interval is widened") {
  // The server is silent for up to 1000 ms when idle (its Welcome says so); a client asking to
  // declare it dead after 300 ms of silence keeps the connection anyway (2000 ms).
  LogCapture log;
  ServerLog sl;
  auto so = server_options(log);
  so.heartbeat_interval_ms = 1000;
  so.heartbeat_timeout_ms = 5000;
  auto server = start_server(so, sl);
  ClientLog cl;
  auto co = client_options(server->port(), log);
  co.heartbeat_interval_ms = 20;
  co.heartbeat_timeout_ms = 300;
  auto client = start_client(co, cl);
  REQUIRE(wait_until([&] { return client->connected(); }));
  std::this_thread::sleep_for(2500ms);  // two of the server's heartbeats
  CHECK(client->connected());
  CHECK(client->stats().connects == 1);
  CHECK(sl.connect_count() == 1);
}

TEST_CASE("tcp: backpressure from a slow consumer bounds the client's memory") {
  LogCapture log;
  std::mutex gate_mu;
  std::condition_variable gate_cv;
  bool open = false;
  std::mutex got_mu;
  std::vector<Message> got;
  ServerHandlers h;
  h.on_message = [&](PeerId, Message&& m) {
    {
      std::unique_lock lk(gate_mu);
      gate_cv.wait(lk, [&] { return open; });  // the consumer is stuck until the test opens it
    }
    std::lock_guard lk(got_mu);
    got.push_back(std::move(m));
  };
  auto so = server_options(log);
  so.io_threads = 1;
  so.heartbeat_timeout_ms = 60'000;
  auto server_r = make_tcp_server(so, h);
  REQUIRE(server_r.ok());
  auto server = std::move(*server_r);

  ClientLog cl;
  auto co = client_options(server->port(), log);
  co.telemetry_buffer_capacity = 1000;
  co.heartbeat_timeout_ms = 60'000;
  auto client = start_client(co, cl);
  REQUIRE(wait_until([&] { return client->connected(); }));

  constexpr std::uint64_t kTelemetry = 150'000;  // ~30 MB: more than the socket buffers hold
  std::uint64_t controls = 0;
  std::size_t max_queued = 0;
  for (std::uint64_t s = 0; s < kTelemetry; ++s) {
    REQUIRE(client->send(make_telemetry(0, s)));
    if (s % 10'000 == 0) {
      REQUIRE(client->send(PlanReady{s, 0, true, ""}));
      ++controls;
    }
    if (s % 1000 == 0) max_queued = std::max(max_queued, client->stats().queued);
  }
  max_queued = std::max(max_queued, client->stats().queued);
  CHECK(max_queued <= 1000 + controls);
  const auto dropped = client->stats().telemetry_dropped;
  MESSAGE("telemetry dropped: ", dropped, ", most queued: ", max_queued);
  CHECK(dropped > 0);

  {
    std::lock_guard lk(gate_mu);
    open = true;
  }
  gate_cv.notify_all();
  REQUIRE(client->flush(30s));
  const std::uint64_t expected = kTelemetry - dropped + controls;
  REQUIRE(wait_until(
      [&] {
        std::lock_guard lk(got_mu);
        return got.size() == expected;
      },
      60s));
  std::lock_guard lk(got_mu);
  std::uint64_t last_step = 0, plan_ready = 0, telemetry = 0;
  bool ordered = true;
  for (const auto& m : got) {
    if (const auto* t = std::get_if<Telemetry>(&m)) {
      ordered = ordered && (telemetry == 0 || t->step > last_step);
      last_step = t->step;
      ++telemetry;
    } else if (std::holds_alternative<PlanReady>(m)) {
      ++plan_ready;
    }
  }
  CHECK(ordered);
  CHECK(plan_ready == controls);  // no control message is ever dropped
  CHECK(telemetry + dropped == kTelemetry);
  CHECK(last_step == kTelemetry - 1);  // the newest telemetry survives
}

TEST_CASE("tcp: a peer that stops reading is dropped without affecting others") {
  LogCapture log;
  ServerLog sl;
  auto so = server_options(log);
  so.max_send_queue_bytes = 1u << 20;
  so.heartbeat_timeout_ms = 60'000;
  auto server = start_server(so, sl);
  ClientLog cl;
  auto co = client_options(server->port(), log);
  co.heartbeat_timeout_ms = 60'000;
  auto client = start_client(co, cl);
  REQUIRE(wait_until([&] { return client->connected(); }));
  RawPeer stuck;  // authenticates, then never reads
  REQUIRE(stuck.connect(server->port()));
  const PeerId stuck_id = stuck.client_handshake(Secret(kTestSecret));
  REQUIRE(stuck_id != 0);

  const PlanAbort big{1, std::string(1000, 'x')};
  std::size_t sent = 0;
  for (int i = 0; i < 40'000; ++i) {
    sent += server->broadcast(big) > 0 ? 1 : 0;
    if (sl.disconnect_reason(stuck_id)) break;
    if (i % 64 == 0) {
      // Let the healthy client keep pace so that only the stuck peer falls behind.
      wait_until([&] { return cl.message_count() + 64 >= sent; }, 10s);
    }
  }
  REQUIRE(wait_until([&] { return sl.disconnect_reason(stuck_id).has_value(); }));
  CHECK(sl.disconnect_reason(stuck_id)->find("peer too slow") != std::string::npos);
  CHECK(wait_until([&] { return cl.message_count() == sent; }, 30s));
  CHECK(client->connected());
}

TEST_CASE("tcp: hundreds of clients on one shared I/O thread") {
  LogCapture log;
  ServerLog sl;
  auto server = start_server(server_options(log), sl);
  constexpr std::size_t kClients = 500;  // 1000 descriptors in this one process
  auto runtime = std::make_shared<IoRuntime>(1);
  std::vector<std::unique_ptr<Client>> clients;
  ClientLog cl;  // shared by all clients
  for (std::size_t i = 0; i < kClients; ++i) {
    std::string name = "w";
    name += std::to_string(i);  // (operator+ on a literal trips GCC 12's -Wrestrict)
    auto o = client_options(server->port(), log, name);
    o.rank = static_cast<std::uint32_t>(i);
    auto c = make_tcp_client(o, cl.handlers(), runtime);
    REQUIRE(c.ok());
    clients.push_back(std::move(*c));
  }
  REQUIRE(wait_until([&] { return sl.connect_count() == kClients; }, std::chrono::seconds(60)));
  for (std::uint64_t s = 0; s < 10; ++s) {
    for (std::size_t i = 0; i < kClients; ++i)
      REQUIRE(clients[i]->send(make_telemetry(static_cast<std::uint32_t>(i), s)));
  }
  REQUIRE(
      wait_until([&] { return sl.message_count() == 10 * kClients; }, std::chrono::seconds(60)));
  CHECK(server->broadcast(PlanCommit{1, 2}) == kClients);
  REQUIRE(wait_until([&] { return cl.message_count() == kClients; }, std::chrono::seconds(60)));
  for (const PeerInfo& p : server->peers()) {
    const auto got = sl.from(p.id);
    REQUIRE(got.size() == 10);
    for (std::uint64_t s = 0; s < 10; ++s) {
      CHECK(std::get<Telemetry>(got[s]).step == s);
      CHECK(std::get<Telemetry>(got[s]).rank == p.rank);
    }
  }
  clients.clear();
  CHECK(wait_until([&] { return server->stats().connections == 0; }));
}

TEST_CASE("tcp: a client drops a server that sends a bad frame, then reconnects") {
  LogCapture log;
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor acc(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
  ClientLog cl;
  auto client = start_client(client_options(acc.local_endpoint().port(), log), cl);
  RawPeer fake;
  REQUIRE(fake.accept_from(acc));
  REQUIRE(fake.server_handshake(Secret(kTestSecret), 7));
  REQUIRE(wait_until([&] { return client->connected(); }));
  REQUIRE(fake.write(malformed_case("bad checksum").bytes));
  REQUIRE(wait_until([&] { return cl.disconnected_with("bad frame from server: bad checksum"); }));
  CHECK(fake.closed_by_peer());
  RawPeer again;
  REQUIRE(again.accept_from(acc));
  REQUIRE(again.server_handshake(Secret(kTestSecret), 8));
  CHECK(wait_until([&] { return client->stats().connects == 2; }));
  REQUIRE(client->send(PlanReady{1, 0, true, ""}));
  auto m = again.read_message();
  REQUIRE(m.has_value());
  CHECK(std::holds_alternative<PlanReady>(*m));
}
