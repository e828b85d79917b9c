// scripted_agent: a bus server built from transport/ that plays the agent in the Python client's
// tests. It prints what it receives as JSON lines on stdout and sends what stdin tells it to.
//
//   scripted_agent --secret-file F [--port P] [--heartbeat-ms N]
//     stdout: {"event":"listening","port":P}, then one line per connect, telemetry, plan_ready,
//             ack, shutdown and disconnect.
//     stdin, one command per line:
//       prepare ID DP SHARES COMPRESSION [DEADLINE_MS [NAME [TP PP [MICRO_BATCHES]]]]
//           SHARES: "-" (uniform) or "3,1,2"; COMPRESSION: "-" or "FIRST-LAST:METHOD:PARAM;..."
//           with METHOD a number (0 none, 1 fp16, 2 topk, 3 powersgd)
//       commit ID STEP | abort ID REASON... | shutdown REASON... | stop
//     EOF or "stop" closes the server (the agent going away) and exits 0.
//   scripted_agent --dump-frames   prints canonical frames as "TYPE HEX" lines (codec cross-check)
//   scripted_agent --decode        reads hex frames from stdin, prints "ok TYPE" or "error REASON"
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "transport/auth.h"
#include "transport/bus.h"
#include "transport/frame.h"
#include "transport/telemetry_keys.h"

namespace tp = parapilot::transport;

namespace {

std::mutex g_out_mutex;

void emit(const std::string& line) {
  std::lock_guard lock(g_out_mutex);
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

std::string quote(std::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7E) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned char>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string hex(const std::string& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (const unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

std::string unhex(const std::string& text) {
  std::string out;
  for (std::size_t i = 0; i + 1 < text.size(); i += 2) {
    out += static_cast<char>(std::stoi(text.substr(i, 2), nullptr, 16));
  }
  return out;
}

std::vector<tp::Message> canonical_messages() {
  std::vector<tp::Message> out;
  tp::Hello h;
  h.role = tp::PeerRole::tool;
  h.rank = 17;
  h.name = "worker-17";
  for (std::size_t i = 0; i < h.client_nonce.size(); ++i) h.client_nonce[i] = std::uint8_t(i);
  out.emplace_back(h);
  tp::Challenge c;
  for (std::size_t i = 0; i < 32; ++i) {
    c.server_nonce[i] = std::uint8_t(255 - i);
    c.server_proof[i] = std::uint8_t(i * 3);
  }
  out.emplace_back(c);
  tp::Auth a;
  for (std::size_t i = 0; i < 32; ++i) a.client_proof[i] = std::uint8_t(i * 5);
  out.emplace_back(a);
  out.emplace_back(tp::Welcome{42, 1000, 1u << 20});
  out.emplace_back(tp::Heartbeat{9, 123456789012345ull});
  tp::Telemetry t;
  t.rank = 3;
  t.step = 1234567;
  t.step_start_ns = 1700000000000000000ull;
  t.step_end_ns = 1700000000012345678ull;
  t.send_time_ns = 1700000000012399999ull;
  t.compute_ms = 10.25;
  t.queue_depth = 2;
  t.collectives[tp::telemetry_keys::kAllReduceDp] = {3.5, 4096, 2};
  t.collectives[tp::telemetry_keys::kAllGatherDp] = {0.125, 512, 1};
  tp::telemetry_keys::set_info(t, tp::telemetry_keys::kPlan, 1'800'000'000'000'000'123ull);
  tp::telemetry_keys::set_loss(t, -2.75);
  t.layers = {{0, 1.5f, 0.25f, 0}, {5, 0.0f, 0.0f, 3}};
  out.emplace_back(t);
  tp::PlanPrepare p;
  p.plan_id = 1ull << 40;
  p.layout.dp = 3;
  p.layout.micro_batches = 4;
  p.layout.dp_shares = {5, 1, 2};
  p.layout.compression = {{0, 3, tp::CompressionMethod::fp16, 0.0f},
                          {4, 4, tp::CompressionMethod::topk, 0.125f},
                          {5, 16383, tp::CompressionMethod::powersgd, 4.0f}};
  p.layout_name = "dp3-elastic";
  p.deadline_ms = 30000;
  out.emplace_back(p);
  out.emplace_back(tp::PlanReady{8, 2, false, "cannot stage: \"tp\" > 1"});
  out.emplace_back(tp::PlanCommit{8, 120});
  out.emplace_back(tp::PlanAbort{7, "rank 3 not ready"});
  out.emplace_back(tp::Ack{tp::MessageType::plan_commit, 8, 1});
  out.emplace_back(tp::Shutdown{"job finished"});
  out.emplace_back(tp::JobInfo{2, 4, 64, tp::kCapDpShares | tp::kCapCompression,
                               "pytorch-ddp 1.13.1", {{1024, 4096}, {33, 132}}});
  return out;
}

int dump_frames() {
  for (const tp::Message& m : canonical_messages()) {
    auto f = tp::encode_frame(m);
    if (!f) {
      std::cerr << "encode failed: " << f.status().message() << "\n";
      return 1;
    }
    std::cout << static_cast<int>(tp::type_of(m)) << " " << hex(*f) << "\n";
  }
  return 0;
}

int decode_lines() {
  std::string line;
  while (std::getline(std::cin, line)) {
    const std::string bytes = unhex(line);
    auto m = tp::decode_frame(std::span(reinterpret_cast<const std::uint8_t*>(bytes.data()),
                                        bytes.size()));
    if (m) {
      // Re-encode: the Python encoder must produce exactly the C++ bytes.
      auto again = tp::encode_frame(*m);
      std::cout << "ok " << static_cast<int>(tp::type_of(*m)) << " "
                << (again && *again == bytes ? "same" : "different") << "\n";
    } else {
      std::cout << "error " << m.status().message() << "\n";
    }
    std::cout.flush();
  }
  return 0;
}

std::string telemetry_json(tp::PeerId peer, const tp::Telemetry& t) {
  std::ostringstream o;
  o << "{\"event\":\"telemetry\",\"peer\":" << peer << ",\"rank\":" << t.rank
    << ",\"step\":" << t.step << ",\"start_ns\":" << t.step_start_ns
    << ",\"end_ns\":" << t.step_end_ns << ",\"send_ns\":" << t.send_time_ns
    << ",\"compute_ms\":" << num(t.compute_ms) << ",\"queue_depth\":" << t.queue_depth
    << ",\"collectives\":{";
  bool first = true;
  for (const auto& [name, c] : t.collectives) {
    o << (first ? "" : ",") << quote(name) << ":[" << num(c.ms) << "," << c.bytes << ","
      << c.calls << "]";
    first = false;
  }
  o << "},\"layers\":[";
  first = true;
  for (const auto& l : t.layers) {
    o << (first ? "" : ",") << "[" << l.layer << "," << num(l.norm) << "," << num(l.max_abs)
      << "," << l.nonfinite_count << "]";
    first = false;
  }
  o << "],\"counts\":{";
  first = true;
  for (const auto& [name, v] : t.counts) {
    o << (first ? "" : ",") << quote(name) << ":" << v;
    first = false;
  }
  o << "},\"measures\":{";
  first = true;
  for (const auto& [name, v] : t.measures) {
    o << (first ? "" : ",") << quote(name) << ":" << num(v);
    first = false;
  }
  o << "}}";
  return o.str();
}

bool parse_prepare(std::istringstream& in, tp::PlanPrepare& p, std::string& why) {
  std::string shares, compression;
  in >> p.plan_id >> p.layout.dp >> shares >> compression;
  if (!in) {
    why = "prepare needs ID DP SHARES COMPRESSION";
    return false;
  }
  p.deadline_ms = 30000;
  p.layout_name = "scripted";
  if (!(in >> p.deadline_ms)) p.deadline_ms = 30000;
  if (!(in >> p.layout_name)) p.layout_name = "scripted";
  if (!(in >> p.layout.tp >> p.layout.pp)) {
    p.layout.tp = p.layout.pp = 1;
  } else if (!(in >> p.layout.micro_batches)) {
    p.layout.micro_batches = 1;
  }
  if (shares != "-") {
    std::istringstream s(shares);
    std::string item;
    while (std::getline(s, item, ',')) p.layout.dp_shares.push_back(static_cast<std::uint32_t>(std::stoul(item)));
  }
  if (compression != "-") {
    std::istringstream s(compression);
    std::string item;
    while (std::getline(s, item, ';')) {
      tp::LayerCompression c;
      unsigned first = 0, last = 0, method = 0;
      float param = 0;
      if (std::sscanf(item.c_str(), "%u-%u:%u:%f", &first, &last, &method, &param) != 4) {
        why = "bad compression item '" + item + "'";
        return false;
      }
      c.first_layer = first;
      c.last_layer = last;
      c.method = static_cast<tp::CompressionMethod>(method);
      c.parameter = param;
      p.layout.compression.push_back(c);
    }
  }
  const parapilot::Status valid = tp::validate(p);
  why = valid.message();
  return valid.ok();
}

int serve(const std::string& secret_file, std::uint16_t port, std::uint32_t heartbeat_ms) {
  auto secret = tp::load_secret_from_file(secret_file);
  if (!secret) {
    std::cerr << "scripted_agent: " << secret.status().message() << "\n";
    return 2;
  }
  tp::ServerOptions o;
  o.port = port;
  o.secret = *secret;
  o.io_threads = 1;
  o.heartbeat_interval_ms = heartbeat_ms;
  o.heartbeat_timeout_ms = heartbeat_ms * 5;
  o.logger = tp::stderr_logger(tp::LogLevel::warn);
  tp::ServerHandlers h;
  h.on_connect = [](const tp::PeerInfo& p) {
    emit("{\"event\":\"connect\",\"peer\":" + std::to_string(p.id) +
         ",\"rank\":" + std::to_string(p.rank) + ",\"name\":" + quote(p.name) + "}");
  };
  h.on_disconnect = [](tp::PeerId peer, std::string_view reason) {
    emit("{\"event\":\"disconnect\",\"peer\":" + std::to_string(peer) +
         ",\"reason\":" + quote(reason) + "}");
  };
  h.on_message = [](tp::PeerId peer, tp::Message&& m) {
    if (auto* t = std::get_if<tp::Telemetry>(&m)) {
      emit(telemetry_json(peer, *t));
    } else if (auto* r = std::get_if<tp::PlanReady>(&m)) {
      emit("{\"event\":\"plan_ready\",\"peer\":" + std::to_string(peer) +
           ",\"plan_id\":" + std::to_string(r->plan_id) + ",\"rank\":" + std::to_string(r->rank) +
           ",\"ok\":" + (r->ok ? "true" : "false") + ",\"detail\":" + quote(r->detail) + "}");
    } else if (auto* a = std::get_if<tp::Ack>(&m)) {
      emit("{\"event\":\"ack\",\"peer\":" + std::to_string(peer) +
           ",\"acked\":" + std::to_string(static_cast<int>(a->acked)) +
           ",\"id\":" + std::to_string(a->id) + ",\"rank\":" + std::to_string(a->rank) + "}");
    } else if (auto* s = std::get_if<tp::Shutdown>(&m)) {
      emit("{\"event\":\"shutdown\",\"peer\":" + std::to_string(peer) +
           ",\"reason\":" + quote(s->reason) + "}");
    } else {
      emit("{\"event\":\"other\",\"peer\":" + std::to_string(peer) + ",\"type\":" +
           quote(tp::type_name(tp::type_of(m))) + "}");
    }
  };
  auto server = tp::make_tcp_server(std::move(o), std::move(h));
  if (!server) {
    std::cerr << "scripted_agent: " << server.status().message() << "\n";
    return 2;
  }
  emit("{\"event\":\"listening\",\"port\":" + std::to_string((*server)->port()) + "}");
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    std::string why;
    std::size_t sent = 0;
    if (cmd.empty()) continue;
    if (cmd == "stop") break;
    if (cmd == "prepare") {
      tp::PlanPrepare p;
      if (parse_prepare(in, p, why)) sent = (*server)->broadcast(p);
    } else if (cmd == "commit") {
      tp::PlanCommit c;
      in >> c.plan_id >> c.switch_at_step;
      if (in) sent = (*server)->broadcast(c); else why = "commit needs ID STEP";
    } else if (cmd == "abort" || cmd == "shutdown") {
      tp::PlanAbort a;
      if (cmd == "abort") in >> a.plan_id;
      std::string reason;
      std::getline(in, reason);
      if (!reason.empty() && reason[0] == ' ') reason.erase(0, 1);
      if (cmd == "abort") {
        a.reason = reason;
        sent = (*server)->broadcast(a);
      } else {
        sent = (*server)->broadcast(tp::Shutdown{reason});
      }
    } else {
      why = "unknown command '" + cmd + "'";
    }
    if (!why.empty()) {
      emit("{\"event\":\"error\",\"reason\":" + quote(why) + "}");
    } else {
      emit("{\"event\":\"sent\",\"command\":" + quote(cmd) + ",\"peers\":" + std::to_string(sent) +
           "}");
    }
  }
  (*server)->stop();
  emit("{\"event\":\"stopped\"}");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string secret_file;
  long port = 0;
  long heartbeat_ms = 1000;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--dump-frames") return dump_frames();
    if (a == "--decode") return decode_lines();
    if (i + 1 < argc && a == "--secret-file") {
      secret_file = argv[++i];
    } else if (i + 1 < argc && a == "--port") {
      port = std::strtol(argv[++i], nullptr, 10);
    } else if (i + 1 < argc && a == "--heartbeat-ms") {
      heartbeat_ms = std::strtol(argv[++i], nullptr, 10);
    } else {
      std::cerr << "scripted_agent: unknown argument '" << a << "'\n";
      return 2;
    }
  }
  if (secret_file.empty() || port < 0 || port > 65535 || heartbeat_ms < 10) {
    std::cerr << "usage: scripted_agent --secret-file F [--port P] [--heartbeat-ms N]\n";
    return 2;
  }
  return serve(secret_file, static_cast<std::uint16_t>(port),
               static_cast<std::uint32_t>(heartbeat_ms));
}
