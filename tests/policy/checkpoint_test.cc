// PolicyCheckpoint files: round trip, checksum, truncation, format and schema versions.
#include <doctest/doctest.h>

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>

#include "policy/loader.h"
#include "checkpoints/checkpoint.h"
#include "core/checksum.h"
#include "core/error.h"

namespace cp = parapilot::checkpoints;

namespace {

std::string temp_path(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("parapilot-policy-tests-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

void put_u32(std::string& bytes, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) bytes[at + i] = static_cast<char>((v >> (8 * i)) & 0xFFu);
}

// Recomputes the trailing CRC so that only the field under test is wrong.
void reseal(std::string& bytes) {
  put_u32(bytes, bytes.size() - 4,
          parapilot::crc32c(std::span(reinterpret_cast<const std::uint8_t*>(bytes.data()),
                                      bytes.size() - 4)));
}

cp::PolicyCheckpoint sample() {
  cp::PolicyCheckpoint c;
  c.env_id = "sim:mixed";
  c.config = "{\"ppo\": {}}";
  c.step = 12345;
  c.update = 17;
  c.metrics = {{"validation_score", 0.97}, {"elapsed_s", 61.5}};
  parapilot::env::Observation o;
  o.state[3] = 2.5f;
  o.mask[0] = 1;
  o.candidates[1] = -1.25f;
  c.normalizer.update(o);
  o.state[3] = 0.5f;
  c.normalizer.update(o);
  c.model = std::string("model\0bytes", 11);
  c.optimizer = std::string(1000, '\x7f');
  return c;
}

std::string expect_error(const std::string& path) {
  const auto read = cp::read_checkpoint(path);
  if (read.ok()) FAIL("no error for " << path);
  return read.status().message();
}

}  // namespace

TEST_CASE("checkpoint: round trip keeps every field") {
  const std::string path = temp_path("round-trip.ckpt");
  const cp::PolicyCheckpoint c = sample();
  REQUIRE(cp::write_checkpoint(path, c).ok());
  const auto read = cp::read_checkpoint(path);
  REQUIRE(read.ok());
  const cp::PolicyCheckpoint& r = *read;
  CHECK(r.env_id == c.env_id);
  CHECK(r.config == c.config);
  CHECK(r.step == c.step);
  CHECK(r.update == c.update);
  CHECK(r.metrics == c.metrics);
  CHECK(r.model == c.model);
  CHECK(r.optimizer == c.optimizer);
  CHECK(r.feature_schema == parapilot::policy::kFeatureSchemaVersion);
  CHECK(r.normalizer.state_stats().count == c.normalizer.state_stats().count);
  CHECK(r.normalizer.state_stats().mean == c.normalizer.state_stats().mean);
  CHECK(r.normalizer.state_stats().m2 == c.normalizer.state_stats().m2);
  CHECK(r.normalizer.state_stats().min == c.normalizer.state_stats().min);
  CHECK(r.normalizer.state_stats().max == c.normalizer.state_stats().max);
  CHECK(r.normalizer.state_stats().max[3] == 2.5);
  CHECK(r.normalizer.candidate_stats().mean == c.normalizer.candidate_stats().mean);
  // No temporary file is left behind.
  int files = 0;
  for (const auto& e :
       std::filesystem::directory_iterator(std::filesystem::path(path).parent_path())) {
    files += e.path().filename().string().find("round-trip.ckpt") != std::string::npos;
  }
  CHECK(files == 1);
}

TEST_CASE(
    "checkpoint: corrupted, truncated, wrong-version and wrong-schema files are refused clearly") {
  const std::string path = temp_path("bad.ckpt");
  REQUIRE(cp::write_checkpoint(path, sample()).ok());
  const std::string good = read_bytes(path);

  SUBCASE("missing") {
    CHECK(expect_error(temp_path("missing.ckpt")).find("cannot open") != std::string::npos);
    CHECK(cp::read_checkpoint(temp_path("missing.ckpt")).status().code() ==
          parapilot::StatusCode::kNotFound);
  }
  SUBCASE("not a checkpoint") {
    write_bytes(path, "hello, world");
    CHECK(expect_error(path).find("not a parapilot checkpoint") != std::string::npos);
  }
  SUBCASE("empty") {
    write_bytes(path, "");
    CHECK(expect_error(path).find("not a parapilot checkpoint") != std::string::npos);
  }
  SUBCASE("one flipped byte in each section") {
    for (size_t at : {size_t{20}, size_t{60}, good.size() / 2, good.size() - 30, good.size() - 2}) {
      std::string bad = good;
      bad[at] = static_cast<char>(bad[at] ^ 0x10);
      write_bytes(path, bad);
      const std::string msg = expect_error(path);
      CHECK_MESSAGE((msg.find("corrupted") != std::string::npos ||
                     msg.find("truncated") != std::string::npos),
                    msg);
    }
  }
  SUBCASE("truncated anywhere") {
    for (size_t keep : {size_t{10}, size_t{30}, size_t{100}, good.size() / 2, good.size() - 1}) {
      write_bytes(path, good.substr(0, keep));
      const std::string msg = expect_error(path);
      CHECK_MESSAGE((msg.find("truncated") != std::string::npos ||
                     msg.find("corrupted") != std::string::npos),
                    msg);
    }
  }
  SUBCASE("another format version") {
    std::string bad = good;
    put_u32(bad, 8, cp::kFormatVersion + 1);
    reseal(bad);
    write_bytes(path, bad);
    CHECK(expect_error(path).find("format version " + std::to_string(cp::kFormatVersion + 1)) != std::string::npos);
  }
  SUBCASE("another feature schema") {
    std::string bad = good;
    put_u32(bad, 12, parapilot::policy::kFeatureSchemaVersion + 7);
    reseal(bad);
    write_bytes(path, bad);
    CHECK(expect_error(path).find("feature schema version") != std::string::npos);
  }
  SUBCASE("valid envelope, unreadable metadata") {
    std::string bad = good;
    bad[40] = '#';  // first byte of the JSON
    reseal(bad);
    write_bytes(path, bad);
    CHECK(expect_error(path).find("unreadable metadata") != std::string::npos);
  }
  SUBCASE("valid envelope, garbage tensors: loading the policy fails cleanly") {
    write_bytes(path, good);
    const auto loaded = parapilot::policy::load_policy(path);
    REQUIRE_FALSE(loaded.ok());
    CHECK(loaded.status().code() == parapilot::StatusCode::kInvalidArgument);
    CHECK(loaded.status().message().find(path) != std::string::npos);
  }
}

TEST_CASE("checkpoint: an unwritable path is an error naming it, and leaves nothing behind") {
  namespace fs = std::filesystem;
  CHECK(cp::write_checkpoint("/nonexistent-dir/x.ckpt", sample()).code() ==
        parapilot::StatusCode::kInvalidArgument);
  // The file is written but cannot be renamed into place (a non-empty directory holds the name):
  // the error names the path, and the temporary file is gone.
  char pattern[] = "/tmp/parapilot-ckpt-XXXXXX";
  const fs::path dir = ::mkdtemp(pattern);
  const fs::path target = dir / "x.ckpt";
  fs::create_directories(target / "occupied");
  const parapilot::Status written = cp::write_checkpoint(target.string(), sample());
  CHECK_FALSE(written.ok());
  CHECK(written.message().find(target.string()) != std::string::npos);
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    CHECK(e.path() == target);
    ++entries;
  }
  CHECK(entries == 1);
  CHECK(fs::is_directory(target / "occupied"));
  fs::remove_all(dir);
}
