// Codec tests: CRC32C, SHA-256, HMAC-SHA256 (RFC 4231), message round trips, cereal layout
// compatibility, validation, malformed frames at the decoder level, the documented wire example,
// secret loading, and replay of the fuzz regression inputs.
#include <doctest/doctest.h>

#include <cereal/archives/portable_binary.hpp>
#include <cereal/types/map.hpp>
#include <cereal/types/string.hpp>
#include <cereal/types/vector.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include <unistd.h>

#include "tests/transport/fuzz_harness.h"
#include "tests/transport/test_util.h"
#include "transport/auth.h"
#include "core/checksum.h"
#include "transport/frame.h"
#include "transport/messages.h"

using parapilot::crc32c;
using parapilot::crc32c_portable;
using namespace parapilot::transport;
using namespace parapilot::transport::testing;

namespace {

std::vector<std::uint8_t> bytes_of(std::string_view s) { return {s.begin(), s.end()}; }

std::string hex(std::span<const std::uint8_t> b) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  for (auto x : b) {
    s.push_back(kDigits[x >> 4]);
    s.push_back(kDigits[x & 0xF]);
  }
  return s;
}
std::string hex(std::string_view s) {
  return hex(std::span(reinterpret_cast<const std::uint8_t*>(s.data()), s.size()));
}

std::span<const std::uint8_t> span_of(const std::string& s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

std::vector<Message> one_of_each() {
  Hello h;
  h.role = PeerRole::trace_replay;
  h.rank = 12;
  h.name = "replay-12";
  for (std::size_t i = 0; i < h.client_nonce.size(); ++i)
    h.client_nonce[i] = static_cast<std::uint8_t>(i);
  Challenge c;
  c.server_nonce.fill(0xAB);
  c.server_proof.fill(0xCD);
  Auth a;
  a.client_proof.fill(0x11);
  return {h,
          c,
          a,
          Welcome{99, 1000, 1u << 20},
          Heartbeat{5, 123456789},
          make_telemetry(7, 1234),
          PlanPrepare{3,
                      Layout{8,
                             4,
                             2,
                             16,
                             {16, 16, 16, 16, 8, 8, 24, 24},
                             {LayerCompression{0, 3, CompressionMethod::topk, 0.01f},
                              LayerCompression{4, 7, CompressionMethod::powersgd, 4.0f}}},
                      "dp8-tp4-pp2", 2000},
          PlanReady{3, 17, false, "out of memory on tp shard"},
          PlanCommit{3, 5000},
          PlanAbort{3, "rank 17 not ready"},
          Ack{MessageType::plan_commit, 3, 17},
          Shutdown{"job finished"},
          JobInfo{1, 4, 64, kCapDpShares | kCapCompression, "pytorch-ddp 1.13.1",
                  {{262144, 1048576}, {512, 2048}}}};
}

}  // namespace

TEST_CASE("crc32c matches known vectors") {
  CHECK(crc32c(bytes_of("123456789")) == 0xE3069283u);
  std::vector<std::uint8_t> zeros(32, 0), ones(32, 0xFF), inc(32), dec(32);
  for (std::size_t i = 0; i < 32; ++i) {
    inc[i] = static_cast<std::uint8_t>(i);
    dec[i] = static_cast<std::uint8_t>(31 - i);
  }
  // RFC 3720, appendix B.4.
  CHECK(crc32c(zeros) == 0x8A9136AAu);
  CHECK(crc32c(ones) == 0x62A8AB43u);
  CHECK(crc32c(inc) == 0x46DD794Eu);
  CHECK(crc32c(dec) == 0x113FDB5Cu);
  CHECK(crc32c({}) == 0u);
  // The hardware and table implementations agree on every length and alignment.
  std::vector<std::uint8_t> buf(300);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<std::uint8_t>(i * 7 + 3);
  for (std::size_t off = 0; off < 8; ++off) {
    for (std::size_t len = 0; len + off <= buf.size(); len += 13) {
      const std::span<const std::uint8_t> s(buf.data() + off, len);
      CHECK(crc32c(s, 0x1234u) == crc32c_portable(s, 0x1234u));
    }
  }
  CHECK(crc32c_portable(bytes_of("123456789")) == 0xE3069283u);
  // Incremental == one shot, for every split point.
  const auto data = bytes_of("The quick brown fox jumps over the lazy dog, twice over.");
  for (std::size_t cut = 0; cut <= data.size(); ++cut) {
    const std::span<const std::uint8_t> all(data);
    CHECK(crc32c(all.subspan(cut), crc32c(all.first(cut))) == crc32c(all));
  }
}

TEST_CASE("sha256 matches FIPS 180-4 examples") {
  CHECK(hex(sha256(bytes_of(""))) ==
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(hex(sha256(bytes_of("abc"))) ==
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(hex(sha256(bytes_of("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"))) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  Sha256 s;
  const std::string chunk(1000, 'a');
  for (int i = 0; i < 1000; ++i) s.update(chunk);
  CHECK(hex(s.finish()) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_CASE("hmac-sha256 matches RFC 4231 test cases") {
  struct Case {
    std::vector<std::uint8_t> key;
    std::vector<std::uint8_t> data;
    std::string mac;
  };
  std::vector<std::uint8_t> key4;
  for (std::uint8_t i = 1; i <= 25; ++i) key4.push_back(i);
  const std::vector<Case> cases = {
      {std::vector<std::uint8_t>(20, 0x0b), bytes_of("Hi There"),
       "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {bytes_of("Jefe"), bytes_of("what do ya want for nothing?"),
       "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {std::vector<std::uint8_t>(20, 0xaa), std::vector<std::uint8_t>(50, 0xdd),
       "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"},
      {key4, std::vector<std::uint8_t>(50, 0xcd),
       "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"},
      {std::vector<std::uint8_t>(20, 0x0c), bytes_of("Test With Truncation"),
       "a3b6167473100ee06e0c796c2955552b"},  // truncated to 128 bits
      {std::vector<std::uint8_t>(131, 0xaa),
       bytes_of("Test Using Larger Than Block-Size Key - Hash Key First"),
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
      {std::vector<std::uint8_t>(131, 0xaa),
       bytes_of("This is a test using a larger than block-size key and a larger than block-size "
                "data. The key needs to be hashed before being used by the HMAC algorithm."),
       "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    CAPTURE(i + 1);
    const std::string got = hex(hmac_sha256(cases[i].key, cases[i].data));
    CHECK(got.substr(0, cases[i].mac.size()) == cases[i].mac);
  }
}

TEST_CASE("constant_time_equal") {
  const auto a = bytes_of("0123456789abcdef");
  auto b = a;
  CHECK(constant_time_equal(a, b));
  b[15] = 'x';
  CHECK_FALSE(constant_time_equal(a, b));
  b = a;
  b[0] = 'x';
  CHECK_FALSE(constant_time_equal(a, b));
  CHECK_FALSE(constant_time_equal(a, std::span(a).first(15)));
  CHECK(constant_time_equal({}, {}));
}

TEST_CASE("handshake proofs differ by direction and depend on every input") {
  const Secret s{std::string(kTestSecret)};
  Nonce c{}, n{};
  c.fill(1);
  n.fill(2);
  CHECK(server_proof(s, c, n) != client_proof(s, n, c));
  // Deterministic: a fresh copy of every input gives the same proof.
  const Nonce c_copy = c, n_copy = n;
  CHECK(server_proof(Secret(std::string(kTestSecret)), c_copy, n_copy) == server_proof(s, c, n));
  const Secret other("another secret of enough length");
  Nonce c2 = c, n2 = n;
  c2[31] = 9;
  n2[0] ^= 1;
  CHECK(server_proof(s, c, n) != server_proof(s, c2, n));
  CHECK(server_proof(s, c, n) != server_proof(s, c, n2));
  CHECK(server_proof(other, c, n) != server_proof(s, c, n));
  CHECK(client_proof(s, n, c) != client_proof(s, n2, c));
  CHECK(client_proof(s, n, c) != client_proof(s, n, c2));
  CHECK(client_proof(other, n, c) != client_proof(s, n, c));
  CHECK(random_nonce() != random_nonce());
}

TEST_CASE("every message type round-trips through a frame") {
  for (const Message& m : one_of_each()) {
    CAPTURE(type_name(type_of(m)));
    CHECK(validate(m).ok());
    auto f = encode_frame(m);
    REQUIRE(f.ok());
    auto back = decode_frame(span_of(*f));
    REQUIRE_MESSAGE(back.ok(), back.status().message());
    CHECK(*back == m);
  }
  // Every type is covered, each once.
  std::set<MessageType> types;
  for (const Message& m : one_of_each()) types.insert(type_of(m));
  CHECK(types.size() == std::variant_size_v<Message>);
  CHECK(one_of_each().size() == types.size());
}

TEST_CASE("a stream of frames decodes in any chunking") {
  std::string stream;
  const auto all = one_of_each();
  for (const Message& m : all) REQUIRE(append_frame(m, stream).ok());
  for (std::size_t chunk : {1u, 2u, 7u, 16u, 100u, 4096u}) {
    CAPTURE(chunk);
    FrameDecoder d;
    std::vector<Message> got;
    for (std::size_t off = 0; off < stream.size(); off += chunk) {
      d.feed(span_of(stream).subspan(off, std::min(chunk, stream.size() - off)));
      Message m;
      while (d.next(m) == FrameDecoder::Status::message) got.push_back(m);
      REQUIRE(d.error().empty());
    }
    CHECK(got == all);
    CHECK(d.buffered_bytes() == 0);
  }
}

TEST_CASE("payload layout equals cereal's own PortableBinary encoding of the same fields") {
  const Telemetry t = make_telemetry(3, 77);
  std::ostringstream os;
  {
    cereal::PortableBinaryOutputArchive ar(
        os, cereal::PortableBinaryOutputArchive::Options::LittleEndian());
    ar(t.rank, t.step, t.step_start_ns, t.step_end_ns, t.send_time_ns, t.compute_ms, t.queue_depth);
    std::map<std::string, std::tuple<double, std::uint64_t, std::uint32_t>> tmp;
    ar(cereal::make_size_tag(static_cast<cereal::size_type>(t.collectives.size())));
    for (const auto& [k, v] : t.collectives) ar(k, v.ms, v.bytes, v.calls);
    ar(cereal::make_size_tag(static_cast<cereal::size_type>(t.layers.size())));
    for (const auto& l : t.layers) ar(l.layer, l.norm, l.max_abs, l.nonfinite_count);
    ar(cereal::make_size_tag(static_cast<cereal::size_type>(t.counts.size())));
    for (const auto& [k, v] : t.counts) ar(k, v);
    ar(cereal::make_size_tag(static_cast<cereal::size_type>(t.measures.size())));
    for (const auto& [k, v] : t.measures) ar(k, v);
  }
  std::string ours;
  encode_payload(t, ours);
  CHECK(hex(ours) == hex(os.str()));

  // Strings, vectors and maps use cereal's std::string/std::vector/std::map layouts.
  std::ostringstream os2;
  {
    cereal::PortableBinaryOutputArchive ar(
        os2, cereal::PortableBinaryOutputArchive::Options::LittleEndian());
    ar(std::uint64_t{9}, std::string("because"));
  }
  std::string ours2;
  encode_payload(PlanAbort{9, "because"}, ours2);
  CHECK(hex(ours2) == hex(os2.str()));
}

TEST_CASE("the worked example of docs/wire-format.md") {
  const PlanAbort m{7, "rank 3 not ready"};
  auto f = encode_frame(m);
  REQUIRE(f.ok());
  CHECK(hex(*f) ==
        "50504c54020a000021000000f7f2e92f"    // header
        "01"                                  // little-endian marker
        "0700000000000000"                    // plan_id = 7
        "1000000000000000"                    // reason length = 16
        "72616e6b2033206e6f74207265616479");  // "rank 3 not ready"
}

TEST_CASE("validate rejects out-of-range values") {
  auto bad_telemetry = [](auto mutate) {
    Telemetry t = make_telemetry(1, 1);
    mutate(t);
    return validate(t).message();
  };
  CHECK(bad_telemetry([](Telemetry& t) { t.compute_ms = std::nan(""); }).find("NaN") !=
        std::string::npos);
  CHECK(!bad_telemetry([](Telemetry& t) { t.compute_ms = -1; }).empty());
  CHECK(!bad_telemetry([](Telemetry& t) {
           t.compute_ms = std::numeric_limits<double>::infinity();
         }).empty());
  CHECK(!bad_telemetry([](Telemetry& t) { t.rank = kMaxRanks; }).empty());
  CHECK(!bad_telemetry([](Telemetry& t) { t.step_end_ns = t.step_start_ns - 1; }).empty());
  CHECK(!bad_telemetry([](Telemetry& t) { t.collectives.begin()->second.ms = -0.5; }).empty());
  CHECK(!bad_telemetry([](Telemetry& t) { t.collectives[""] = {}; }).empty());
  CHECK(!bad_telemetry([](Telemetry& t) { t.layers[0].norm = std::nanf(""); }).empty());
  CHECK(!bad_telemetry([](Telemetry& t) { t.layers[0].max_abs = -1; }).empty());
  CHECK(bad_telemetry([](Telemetry& t) {
          t.measures["info/loss"] = std::numeric_limits<double>::infinity();
        }).find("telemetry.measures.info/loss is not finite") != std::string::npos);
  CHECK(!bad_telemetry([](Telemetry& t) { t.counts[""] = 1; }).empty());
  CHECK(!bad_telemetry([](Telemetry& t) {
           for (int i = 0; i <= static_cast<int>(kMaxFacts); ++i) t.counts["info/" + std::to_string(i)] = 1;
         }).empty());
  CHECK(validate(make_telemetry(1, 1)).ok());
  CHECK_FALSE(validate(PlanPrepare{1, Layout{0, 1, 1, 1, {}, {}}, "", 0}).ok());
  CHECK_FALSE(validate(PlanPrepare{1, Layout{1024, 1024, 2, 1, {}, {}}, "", 0}).ok());
  CHECK_FALSE(validate(PlanPrepare{1, Layout{1, 1, 1, 0, {}, {}}, "", 0}).ok());
  // Shares: one per replica, each in [1, 2^24].
  CHECK(validate(PlanPrepare{1, Layout{2, 1, 1, 1, {3, 5}, {}}, "", 0}).ok());
  CHECK_FALSE(validate(PlanPrepare{1, Layout{2, 1, 1, 1, {3}, {}}, "", 0}).ok());
  CHECK_FALSE(validate(PlanPrepare{1, Layout{2, 1, 1, 1, {3, 0}, {}}, "", 0}).ok());
  // Compression: ranges and parameters per method.
  auto with = [](LayerCompression c) { return PlanPrepare{1, Layout{1, 1, 1, 1, {}, {c}}, "", 0}; };
  CHECK(validate(with({0, 9, CompressionMethod::fp16, 0})).ok());
  CHECK_FALSE(validate(with({5, 4, CompressionMethod::fp16, 0})).ok());
  CHECK_FALSE(validate(with({0, 1, CompressionMethod::topk, 1.5f})).ok());
  CHECK_FALSE(validate(with({0, 1, CompressionMethod::topk, std::nanf("")})).ok());
  CHECK_FALSE(validate(with({0, 1, CompressionMethod::powersgd, 2.5f})).ok());
  CHECK_FALSE(validate(with({0, 1, static_cast<CompressionMethod>(9), 0})).ok());
  CHECK_FALSE(validate(PlanAbort{1, std::string(kMaxTextBytes + 1, 'x')}).ok());
  CHECK_FALSE(validate(Ack{static_cast<MessageType>(0), 1, 1}).ok());
  CHECK_FALSE(validate(Ack{static_cast<MessageType>(14), 1, 1}).ok());
  CHECK(validate(JobInfo{3, 4, 64, kCapDpShares, "pytorch-ddp", {{10, 40}}}).ok());
  CHECK_FALSE(validate(JobInfo{4, 4, 64, kCapDpShares, "", {}}).ok());   // rank >= world
  CHECK_FALSE(validate(JobInfo{0, 0, 64, kCapDpShares, "", {}}).ok());   // empty world
  CHECK_FALSE(validate(JobInfo{0, 4, 64, 1u << 9, "", {}}).ok());        // unknown capability
  CHECK_FALSE(validate(JobInfo{0, 4, (1u << 30) + 1, 0, "", {}}).ok());  // batch too large
  CHECK_FALSE(validate(Welcome{0, 1, 1}).ok());
  Hello h;
  h.name = "";
  CHECK_FALSE(validate(h).ok());
  h.name = "bad\nname";
  CHECK_FALSE(validate(h).ok());
  h.name = "w";
  h.role = static_cast<PeerRole>(9);
  CHECK_FALSE(validate(h).ok());
  // Encoding refuses invalid messages.
  Telemetry t = make_telemetry(1, 1);
  t.compute_ms = std::nan("");
  CHECK_FALSE(encode_frame(t).ok());
}

TEST_CASE("malformed frames are rejected with a reason, never a crash") {
  for (const MalformedCase& c : malformed_cases()) {
    CAPTURE(c.name);
    FrameDecoder d(kTestMaxFrameBytes);
    d.feed(span_of(c.bytes));
    Message m;
    auto st = d.next(m);
    if (c.closes_stream) {
      // The stream ends mid-frame: the decoder keeps waiting; the connection layer reports it.
      CHECK(st == FrameDecoder::Status::need_more);
    } else {
      REQUIRE(st == FrameDecoder::Status::error);
      CHECK_MESSAGE(d.error().find(c.reason) != std::string::npos, d.error());
      CHECK(d.next(m) == FrameDecoder::Status::error);  // stays failed
    }
  }
}

TEST_CASE("decoder rejects huge length prefixes before allocating") {
  // A PlanAbort whose reason claims 2^62 bytes.
  std::string payload("\x01", 1);
  for (int i = 0; i < 8; ++i) payload.push_back(static_cast<char>(i == 0 ? 1 : 0));  // plan_id
  for (int i = 0; i < 8; ++i) payload.push_back(static_cast<char>(i == 7 ? 0x40 : 0));
  auto r = decode_payload(MessageType::plan_abort, span_of(payload));
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message().find("exceeds limit") != std::string::npos);
  // A telemetry layer count within the limit but beyond the remaining bytes.
  std::string t;
  Telemetry no_facts = make_telemetry(1, 1);  // the layers end the payload
  no_facts.counts.clear();
  no_facts.measures.clear();
  encode_payload(no_facts, t);
  t.resize(t.size() - 16);  // the two empty fact counts
  t.resize(t.size() - 16 * 2 - 8);  // cut the layers off, keep the count position
  std::string count(8, '\0');
  count[0] = static_cast<char>(200);
  auto r2 = decode_payload(MessageType::telemetry, span_of(t + count));
  REQUIRE_FALSE(r2.ok());
  CHECK(r2.status().message().find("remaining") != std::string::npos);
}

TEST_CASE("secrets load from a file or the environment and are checked") {
  const auto dir = std::filesystem::temp_directory_path();
  const auto path = dir / ("parapilot-secret-" + std::to_string(::getpid()));
  namespace fs = std::filesystem;
  { std::ofstream(path) << kTestSecret << "\n"; }
  // Open to other users: refused, naming the file, its mode and the fix.
  fs::permissions(path, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                            fs::perms::others_read, fs::perm_options::replace);
  auto open = load_secret_from_file(path.string());
  REQUIRE_FALSE(open.ok());
  CHECK(open.status().message().find(path.string()) != std::string::npos);
  CHECK(open.status().message().find("mode 0644") != std::string::npos);
  CHECK(open.status().message().find("chmod 600") != std::string::npos);
  // Readable by its group but not by others: accepted (group access is the owner's choice).
  fs::permissions(path, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read,
                  fs::perm_options::replace);
  auto s = load_secret_from_file(path.string());
  REQUIRE(s.ok());
  CHECK(s->size() == std::string_view(kTestSecret).size());
  { std::ofstream(path) << "tiny-pw\n"; }
  auto bad = load_secret_from_file(path.string());
  CHECK_FALSE(bad.ok());
  CHECK(bad.status().message().find("tiny-pw") == std::string::npos);       // never echoes content...
  CHECK(bad.status().message().find("shorter than") != std::string::npos);  // ...only the rule
  std::filesystem::remove(path);
  CHECK_FALSE(load_secret_from_file(path.string()).ok());

  ::setenv("PARAPILOT_TEST_SECRET_VAR", kTestSecret, 1);
  auto e = load_secret_from_env("PARAPILOT_TEST_SECRET_VAR");
  REQUIRE(e.ok());
  CHECK(e->size() == std::string_view(kTestSecret).size());
  ::unsetenv("PARAPILOT_TEST_SECRET_VAR");
  CHECK_FALSE(load_secret_from_env("PARAPILOT_TEST_SECRET_VAR").ok());
}

TEST_CASE("fuzz regression inputs replay without crashing") {
  const std::filesystem::path dir =
      std::filesystem::path(PARAPILOT_TEST_DATA_DIR) / "fuzz-transport";
  REQUIRE(std::filesystem::is_directory(dir));
  std::size_t n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (!entry.is_regular_file() || entry.path().filename() == "README.md") continue;
    std::ifstream in(entry.path(), std::ios::binary);
    const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    CAPTURE(entry.path().filename().string());
    fuzz::run_one_input(reinterpret_cast<const std::uint8_t*>(data.data()), data.size());
    ++n;
  }
  CHECK(n > 0);
  // The generated malformed cases go through the same harness (mode 0: a byte stream).
  for (const MalformedCase& c : malformed_cases()) {
    const std::string in = std::string("\x00\x0f", 2) + c.bytes;
    fuzz::run_one_input(reinterpret_cast<const std::uint8_t*>(in.data()), in.size());
  }
}
