// Telemetry bus benchmark: parapilot's TCP bus against ZeroMQ PUSH/PULL doing the same job.
//
// For 1, 16 and 256 publishers sending ~200-byte Telemetry frames to one receiver on loopback:
//   - throughput: messages/s received with a saturating load (at most --window messages in
//     flight, so neither side drops anything);
//   - latency: end-to-end p50/p99/p99.9 (send() call to the receiver's handler) at a fixed
//     offered load of --rate messages/s in total.
// Both sides do the same work per message: encode a Telemetry frame, send it, receive it,
// decode and validate it. Publishers are multiplexed: one generator thread plus one I/O thread
// for all publisher connections (parapilot: a shared IoRuntime; ZeroMQ: one context I/O thread);
// the receiver has one I/O thread. Prints a table; not a test.
//
//   bench_transport [--seconds S] [--rate R] [--window W] [--publishers 1,16,256] [--repeat N]
//                   [--buses parapilot,zeromq] [--json FILE]
// Each configuration runs --repeat times, the buses alternating (parapilot, ZeroMQ, parapilot,
// ...), so that both see the same machine load; the table shows medians. --json also writes
// every run and the medians (benchmarks/report.h).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <sys/resource.h>

#include "benchmarks/report.h"
#include "transport/bus.h"
#include "transport/frame.h"
#include "transport/messages.h"
#include "transport/telemetry_keys.h"

#ifdef PARAPILOT_HAVE_ZMQ
#include <zmq.hpp>
#endif

using namespace parapilot::transport;
using Clock = std::chrono::steady_clock;

namespace {

struct Config {
  double seconds = 2.0;
  double rate = 100'000;
  std::uint64_t window = 20'000;
  std::vector<std::size_t> publishers = {1, 16, 256};
  int repeat = 3;
  bool run_ours = true;
  bool run_zmq = true;  // runs per configuration (alternating buses); the table shows medians
};

struct Row {
  std::string bus;
  std::size_t publishers = 0;
  double max_msgs_per_s = 0;
  double p50_us = 0, p99_us = 0, p999_us = 0, max_us = 0;
  double achieved_rate = 0;
  double cpu_us_per_msg = 0;  // process CPU time (all threads) per message at the fixed rate
  std::uint64_t dropped = 0;
  bool ok = true;
};

double cpu_seconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

std::uint64_t now_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
          .count());
}

Telemetry sample(std::uint32_t rank, std::uint64_t step) {
  Telemetry t;
  t.rank = rank;
  t.step = step;
  t.step_start_ns = 1'700'000'000'000'000'000ULL + step;
  t.step_end_ns = t.step_start_ns + 950'000;
  t.compute_ms = 0.95;
  t.queue_depth = 2;
  t.collectives[telemetry_keys::kAllReduceDp] = CollectiveStat{0.125, 64u << 20, 4};
  t.collectives["all_gather/tp"] = CollectiveStat{0.0625, 8u << 20, 24};
  t.layers = {{0, 1.5F, 0.03F, 0}, {1, 2.25F, 0.06F, 0}, {2, 0.5F, 0.01F, 0}};
  return t;
}

/// What the receiver records. Written by the receiving thread only.
struct Sink {
  std::atomic<std::uint64_t> received{0};
  std::atomic<bool> recording{false};
  std::vector<std::uint64_t> latency_ns;

  void on_telemetry(const Telemetry& t) {
    if (recording.load(std::memory_order_relaxed)) latency_ns.push_back(now_ns() - t.send_time_ns);
    received.fetch_add(1, std::memory_order_release);
  }
};

/// Drives a publisher set: `send(i, telemetry)` must queue one message on publisher i and
/// return false if it could not be queued right now.
template <class SendFn>
std::uint64_t drive(SendFn&& send, std::size_t publishers, Sink& sink, double seconds, double rate,
                    std::uint64_t window) {
  std::uint64_t sent = 0;
  std::size_t next = 0;
  const auto start = Clock::now();
  const auto end = start + std::chrono::duration<double>(seconds);
  while (Clock::now() < end) {
    std::uint64_t due;
    if (rate > 0) {
      due = static_cast<std::uint64_t>(std::chrono::duration<double>(Clock::now() - start).count() *
                                       rate);
    } else {
      due = sink.received.load(std::memory_order_acquire) + window;
    }
    if (sent >= due) {
      if (rate > 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      } else {
        // Window full: let half of it drain before producing again (fewer wake-ups).
        while (sent > sink.received.load(std::memory_order_acquire) + window / 2 &&
               Clock::now() < end) {
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
      }
      continue;
    }
    std::size_t failures = 0;
    while (sent < due && failures < publishers) {
      Telemetry t = sample(static_cast<std::uint32_t>(next), sent);
      t.send_time_ns = now_ns();
      if (send(next, t)) {
        ++sent;
        failures = 0;
      } else {
        ++failures;
      }
      next = (next + 1) % publishers;
    }
    if (failures >= publishers) std::this_thread::sleep_for(std::chrono::microseconds(10));
  }
  return sent;
}

bool wait_for_count(Sink& sink, std::uint64_t n, std::chrono::seconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (sink.received.load(std::memory_order_acquire) < n) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

void fill_latency(Row& row, std::vector<std::uint64_t> v, double seconds, std::uint64_t count) {
  if (v.empty()) return;
  std::sort(v.begin(), v.end());
  auto pct = [&](double p) {
    const std::size_t i =
        std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())));
    return static_cast<double>(v[i]) / 1000.0;
  };
  row.p50_us = pct(0.50);
  row.p99_us = pct(0.99);
  row.p999_us = pct(0.999);
  row.max_us = static_cast<double>(v.back()) / 1000.0;
  row.achieved_rate = static_cast<double>(count) / seconds;
}

// Runs the throughput phase, then the fixed-rate latency phase (first 0.5 s not recorded).
template <class SendFn>
void measure(Row& row, SendFn&& send, std::size_t publishers, Sink& sink, const Config& cfg) {
  const auto t0 = Clock::now();
  const std::uint64_t base0 = sink.received.load();
  const std::uint64_t sent = drive(send, publishers, sink, cfg.seconds, 0, cfg.window);
  row.ok = wait_for_count(sink, base0 + sent, std::chrono::seconds(30));
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
  row.max_msgs_per_s = static_cast<double>(sink.received.load() - base0) / dt;

  const std::uint64_t base1 = sink.received.load();
  const std::uint64_t warm = drive(send, publishers, sink, 0.5, cfg.rate, cfg.window);
  row.ok = wait_for_count(sink, base1 + warm, std::chrono::seconds(30)) && row.ok;
  sink.latency_ns.clear();
  sink.latency_ns.reserve(static_cast<std::size_t>(cfg.rate * cfg.seconds * 1.2));
  const std::uint64_t base2 = sink.received.load();
  sink.recording = true;
  const double cpu0 = cpu_seconds();
  const std::uint64_t n = drive(send, publishers, sink, cfg.seconds, cfg.rate, cfg.window);
  row.ok = wait_for_count(sink, base2 + n, std::chrono::seconds(30)) && row.ok;
  row.cpu_us_per_msg =
      (cpu_seconds() - cpu0) * 1e6 / static_cast<double>(std::max<std::uint64_t>(n, 1));
  sink.recording = false;
  fill_latency(row, sink.latency_ns, cfg.seconds, n);
}

Row run_parapilot(std::size_t publishers, const Config& cfg) {
  Row row;
  row.bus = "parapilot";
  row.publishers = publishers;
  const Secret secret("benchmark-secret-0123456789abcdef");
  Sink sink;
  ServerOptions so;
  so.secret = secret;
  so.io_threads = 1;
  so.max_connections = publishers + 16;
  so.max_unauthenticated = publishers + 16;
  ServerHandlers h;
  h.on_message = [&sink](PeerId, Message&& m) {
    if (const auto* t = std::get_if<Telemetry>(&m)) sink.on_telemetry(*t);
  };
  auto server = make_tcp_server(so, h);
  if (!server) {
    std::fprintf(stderr, "server: %s\n", server.status().message().c_str());
    std::exit(1);
  }
  auto runtime = std::make_shared<IoRuntime>(1);
  std::vector<std::unique_ptr<Client>> clients;
  for (std::size_t i = 0; i < publishers; ++i) {
    ClientOptions co;
    co.port = (*server)->port();
    co.secret = secret;
    co.name = "pub-" + std::to_string(i);
    co.rank = static_cast<std::uint32_t>(i);
    co.telemetry_buffer_capacity = cfg.window + 1024;  // nothing is evicted in this benchmark
    auto c = make_tcp_client(co, {}, runtime);
    if (!c) {
      std::fprintf(stderr, "client: %s\n", c.status().message().c_str());
      std::exit(1);
    }
    clients.push_back(std::move(*c));
  }
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  while ((*server)->peers().size() < publishers && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  auto send = [&](std::size_t i, const Telemetry& t) { return clients[i]->send(t); };
  measure(row, send, publishers, sink, cfg);
  for (auto& c : clients) row.dropped += c->stats().telemetry_dropped;
  clients.clear();
  (*server)->stop();
  return row;
}

#ifdef PARAPILOT_HAVE_ZMQ
Row run_zmq(std::size_t publishers, const Config& cfg) {
  Row row;
  row.bus = "zeromq";
  row.publishers = publishers;
  Sink sink;
  zmq::context_t rx_ctx(1), tx_ctx(1);
  zmq::socket_t pull(rx_ctx, zmq::socket_type::pull);
  pull.set(zmq::sockopt::rcvhwm, 0);
  pull.bind("tcp://127.0.0.1:*");
  const std::string endpoint = pull.get(zmq::sockopt::last_endpoint);
  std::atomic<bool> stop{false};
  std::thread receiver([&] {
    pull.set(zmq::sockopt::rcvtimeo, 100);
    zmq::message_t msg;
    while (!stop.load()) {
      if (!pull.recv(msg)) continue;
      auto m = decode_frame(std::span(static_cast<const std::uint8_t*>(msg.data()), msg.size()));
      if (m && std::holds_alternative<Telemetry>(*m)) sink.on_telemetry(std::get<Telemetry>(*m));
    }
  });
  std::vector<zmq::socket_t> pushes;
  for (std::size_t i = 0; i < publishers; ++i) {
    pushes.emplace_back(tx_ctx, zmq::socket_type::push);
    pushes.back().set(zmq::sockopt::sndhwm, static_cast<int>(cfg.window + 1024));
    pushes.back().set(zmq::sockopt::linger, 0);
    pushes.back().connect(endpoint);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let the connections settle
  std::string frame;
  auto send = [&](std::size_t i, const Telemetry& t) {
    frame.clear();
    if (!append_frame(t, frame)) return false;
    return pushes[i].send(zmq::buffer(frame), zmq::send_flags::dontwait).has_value();
  };
  measure(row, send, publishers, sink, cfg);
  stop = true;
  receiver.join();
  pushes.clear();
  pull.close();
  return row;
}
#endif

/// Field-wise median of several runs of one configuration.
Row median(std::vector<Row> runs) {
  Row out = runs.front();
  auto med = [&](double Row::*field) {
    std::vector<double> v;
    for (const Row& r : runs) v.push_back(r.*field);
    std::sort(v.begin(), v.end());
    out.*field = v[v.size() / 2];
  };
  for (auto f : {&Row::max_msgs_per_s, &Row::p50_us, &Row::p99_us, &Row::p999_us, &Row::max_us,
                 &Row::achieved_rate, &Row::cpu_us_per_msg}) {
    med(f);
  }
  for (const Row& r : runs) {
    out.ok = out.ok && r.ok;
    out.dropped = std::max(out.dropped, r.dropped);
  }
  return out;
}

std::vector<std::size_t> parse_list(const char* s) {
  std::vector<std::size_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(static_cast<std::size_t>(std::stoul(item)));
  return v;
}

}  // namespace

nlohmann::json row_json(const Row& r) {
  return {{"bus", r.bus},
          {"publishers", r.publishers},
          {"throughput_msgs_per_s", r.max_msgs_per_s},
          {"p50_us", r.p50_us},
          {"p99_us", r.p99_us},
          {"p999_us", r.p999_us},
          {"max_us", r.max_us},
          {"achieved_msgs_per_s", r.achieved_rate},
          {"cpu_us_per_msg", r.cpu_us_per_msg},
          {"dropped", r.dropped},
          {"complete", r.ok}};
}

int main(int argc, char** argv) {
  const std::string json_path = parapilot::bench::take_json_flag(argc, argv);
  parapilot::bench::Report report("bench_transport", argc, argv);
  Config cfg;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::printf(
          "usage: bench_transport [--seconds S] [--rate R] [--window N] "
          "[--buses parapilot,zeromq]\n"
          "                       [--repeat N] [--publishers N,N,...] [--json FILE]\n"
          "  telemetry throughput and latency of the parapilot bus (and ZeroMQ, side by side)\n");
      return 0;
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "bench_transport: option %s needs a value (--help)\n", argv[argc - 1]);
    return 2;
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--seconds") {
      cfg.seconds = std::atof(argv[i + 1]);
    } else if (k == "--rate") {
      cfg.rate = std::atof(argv[i + 1]);
    } else if (k == "--window") {
      cfg.window = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (k == "--buses") {
      const std::string v = argv[i + 1];
      cfg.run_ours = v.find("parapilot") != std::string::npos;
      cfg.run_zmq = v.find("zeromq") != std::string::npos;
    } else if (k == "--repeat") {
      cfg.repeat = std::max(1, std::atoi(argv[i + 1]));
    } else if (k == "--publishers") {
      cfg.publishers = parse_list(argv[i + 1]);
    } else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  Telemetry probe = sample(1, 1);
  probe.send_time_ns = now_ns();
  const std::size_t frame_bytes = encode_frame(probe)->size();
  std::printf(
      "telemetry bus benchmark: %zu-byte frames on loopback, %u cores; throughput with <= %llu "
      "in flight, latency at %.0f msgs/s offered, %.1f s per phase, median of %d runs\n",
      frame_bytes, std::thread::hardware_concurrency(), static_cast<unsigned long long>(cfg.window),
      cfg.rate, cfg.seconds, cfg.repeat);
#ifndef PARAPILOT_HAVE_ZMQ
  std::printf("ZeroMQ (cppzmq/libzmq) not found at build time: its rows are skipped\n");
#endif
  std::printf(
      "\n| publishers | bus       | throughput msgs/s | p50 us | p99 us | p99.9 us | max us | "
      "achieved msgs/s | CPU us/msg | dropped |\n");
  std::printf(
      "|-----------:|-----------|------------------:|-------:|-------:|---------:|-------:|"
      "----------------:|-----------:|--------:|\n");
  nlohmann::json& fig = report.figures();
  fig["config"] = {{"frame_bytes", frame_bytes},   {"window", cfg.window},
                   {"rate", cfg.rate},             {"seconds", cfg.seconds},
                   {"repeat", cfg.repeat},         {"cores", std::thread::hardware_concurrency()}};
  fig["medians"] = nlohmann::json::array();
  fig["runs"] = nlohmann::json::array();
  for (std::size_t n : cfg.publishers) {
    std::vector<Row> ours, zmq;
    for (int r = 0; r < cfg.repeat; ++r) {
      if (cfg.run_ours) ours.push_back(run_parapilot(n, cfg));
#ifdef PARAPILOT_HAVE_ZMQ
      if (cfg.run_zmq) zmq.push_back(run_zmq(n, cfg));
#endif
    }
    std::vector<Row> rows;
    if (!ours.empty()) rows.push_back(median(ours));
    if (!zmq.empty()) rows.push_back(median(zmq));
    for (const Row& r : ours) fig["runs"].push_back(row_json(r));
    for (const Row& r : zmq) fig["runs"].push_back(row_json(r));
    for (const Row& r : rows) {
      fig["medians"].push_back(row_json(r));
      std::printf(
          "| %10zu | %-9s | %17.0f | %6.1f | %6.1f | %8.1f | %6.0f | %15.0f | %10.2f | %7llu |%s\n",
          r.publishers, r.bus.c_str(), r.max_msgs_per_s, r.p50_us, r.p99_us, r.p999_us, r.max_us,
          r.achieved_rate, r.cpu_us_per_msg, static_cast<unsigned long long>(r.dropped),
          r.ok ? "" : " (incomplete)");
      std::fflush(stdout);
    }
  }
  return report.write(json_path) ? 0 : 1;
}
