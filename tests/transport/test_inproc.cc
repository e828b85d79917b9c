// In-process bus tests: the same contract as TCP without sockets.
#include <doctest/doctest.h>

#include <mutex>

#include "tests/transport/test_util.h"
#include "transport/bus.h"

using namespace parapilot::transport;
using namespace parapilot::transport::testing;

namespace {

struct Inbox {
  std::mutex mu;
  std::vector<std::pair<PeerId, Message>> server_got;
  std::vector<Message> client_got;
  std::vector<std::string> disconnects;
  std::vector<PeerInfo> connects;

  ServerHandlers server() {
    ServerHandlers h;
    h.on_connect = [this](const PeerInfo& p) {
      std::lock_guard lk(mu);
      connects.push_back(p);
    };
    h.on_message = [this](PeerId id, Message&& m) {
      std::lock_guard lk(mu);
      server_got.emplace_back(id, std::move(m));
    };
    h.on_disconnect = [this](PeerId, std::string_view r) {
      std::lock_guard lk(mu);
      disconnects.emplace_back(r);
    };
    return h;
  }
  ClientHandlers client() {
    ClientHandlers h;
    h.on_message = [this](Message&& m) {
      std::lock_guard lk(mu);
      client_got.push_back(std::move(m));
    };
    return h;
  }
  std::size_t server_count() {
    std::lock_guard lk(mu);
    return server_got.size();
  }
  std::size_t client_count() {
    std::lock_guard lk(mu);
    return client_got.size();
  }
};

ClientOptions named(std::string name, std::uint32_t rank) {
  ClientOptions o;
  o.name = std::move(name);
  o.rank = rank;
  return o;
}

}  // namespace

TEST_CASE("inproc: messages flow both ways, in order") {
  InProcHub hub;
  Inbox in;
  auto server = hub.make_server(in.server());
  REQUIRE(server.ok());
  CHECK_FALSE(hub.make_server(in.server()).ok());  // one server per hub
  auto client = hub.make_client(named("w0", 0), in.client());
  REQUIRE(wait_until([&] { return client->connected() && (*server)->peers().size() == 1; }));
  const PeerInfo p = (*server)->peers().at(0);
  CHECK(p.name == "w0");
  CHECK(p.remote_address == "inproc");
  for (std::uint64_t s = 0; s < 1000; ++s) CHECK(client->send(make_telemetry(0, s)));
  CHECK(client->send(PlanReady{1, 0, true, "ok"}));
  CHECK((*server)->send(p.id, PlanCommit{1, 10}));
  CHECK((*server)->broadcast(Shutdown{"bye"}) == 1);
  REQUIRE(client->flush(std::chrono::seconds(10)));
  REQUIRE(wait_until([&] { return in.server_count() == 1001 && in.client_count() == 2; }));
  std::lock_guard lk(in.mu);
  for (std::uint64_t s = 0; s < 1000; ++s)
    CHECK(std::get<Telemetry>(in.server_got[s].second).step == s);
  CHECK(std::holds_alternative<PlanReady>(in.server_got[1000].second));
  CHECK(in.client_got[0] == Message(PlanCommit{1, 10}));
  // Invalid messages are refused as on TCP.
  Telemetry bad = make_telemetry(0, 0);
  bad.compute_ms = std::numeric_limits<double>::quiet_NaN();
  CHECK_FALSE(client->send(bad));
}

TEST_CASE("inproc: clients buffer until a server exists; the oldest telemetry is dropped") {
  InProcHub hub;
  Inbox in;
  auto o = named("w1", 1);
  o.telemetry_buffer_capacity = 10;
  auto client = hub.make_client(o, in.client());
  CHECK_FALSE(client->connected());
  for (std::uint64_t s = 0; s < 5; ++s) client->send(make_telemetry(1, s));
  client->send(PlanReady{2, 1, true, ""});
  for (std::uint64_t s = 5; s < 25; ++s) client->send(make_telemetry(1, s));
  CHECK(client->stats().telemetry_dropped == 15);
  CHECK(client->stats().queued == 11);
  auto server = hub.make_server(in.server());
  REQUIRE(server.ok());
  REQUIRE(wait_until([&] { return in.server_count() == 11; }));
  std::lock_guard lk(in.mu);
  CHECK(std::holds_alternative<PlanReady>(in.server_got[0].second));
  for (std::size_t i = 1; i < 11; ++i)
    CHECK(std::get<Telemetry>(in.server_got[i].second).step == 14 + i);
}

TEST_CASE("inproc: server stop disconnects clients, which reconnect to the next server") {
  InProcHub hub;
  Inbox in1, in2, cin;
  auto s1 = hub.make_server(in1.server());
  REQUIRE(s1.ok());
  auto client = hub.make_client(named("w2", 2), cin.client());
  REQUIRE(wait_until([&] { return client->connected(); }));
  (*s1)->stop();
  CHECK_FALSE(client->connected());
  client->send(make_telemetry(2, 1));
  auto s2 = hub.make_server(in2.server());
  REQUIRE(s2.ok());
  REQUIRE(wait_until([&] { return in2.server_count() == 1; }));
  CHECK(client->stats().connects == 2);
  (*s2)->disconnect((*s2)->peers().at(0).id, "kicked");
  REQUIRE(wait_until([&] {
    std::lock_guard lk(in2.mu);
    return in2.disconnects.size() == 1 && in2.connects.size() == 2;
  }));
  client->stop();
  REQUIRE(wait_until([&] {
    std::lock_guard lk(in2.mu);
    return in2.disconnects.size() == 2;
  }));
  CHECK((*s2)->peers().empty());
}
