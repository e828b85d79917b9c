// The parapilot binary as a user runs it: exit codes, messages, JSON and trace outputs.
#include <doctest/doctest.h>

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/strategy/test_util.h"

using parapilot::testing::TempFile;

namespace {

struct Run {
  int exit_code;
  std::string out;  // stdout and stderr together
};

Run run(const std::string& args) {
  const std::string command = std::string(PARAPILOT_BIN) + " " + args + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  REQUIRE(pipe);
  std::string out;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) out.append(buf.data(), n);
  const int status = ::pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

const std::string kSpecs = std::string(PARAPILOT_SOURCE_DIR) + "/experiments/specs/";

}  // namespace

TEST_CASE("simulate runs on the built-in defaults") {
  const Run r = run("simulate");
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("iteration") != std::string::npos);
  CHECK(r.out.find("llama2-7b") != std::string::npos);
}

TEST_CASE("simulate --json carries the documented fields") {
  const Run r =
      run("simulate --model gpt3-175b --cluster 16x8xa100-80g "
          "--strategy tp=8,pp=8,sp=true,recompute=selective,global_batch=256 --json");
  REQUIRE(r.exit_code == 0);
  const auto j = nlohmann::json::parse(r.out);
  for (const char* key : {"iteration_time_s", "tflops_per_gpu", "mfu", "tokens_per_s",
                          "memory_gb_per_gpu", "fits_in_memory", "breakdown", "strategy"}) {
    CHECK_MESSAGE(j.contains(key), key);
  }
  CHECK(j["iteration_time_s"].get<double>() > 0);
  CHECK(j["strategy"]["dp"] == 2);
  double sum = 0;
  for (const auto& [k, v] : j["breakdown"].items()) sum += v.get<double>();
  CHECK(sum == doctest::Approx(j["iteration_time_s"].get<double>()));
}

TEST_CASE("simulate reads one file holding all three tables, and writes a trace") {
  TempFile dir("", "unused");
  const std::string trace = dir.dir() + "/trace.json";
  const std::string file = kSpecs + "gpt3-175b-selene.toml";
  const Run r = run("simulate --model " + file + " --cluster " + file + " --strategy " + file +
                    " --trace " + trace);
  REQUIRE(r.exit_code == 0);
  std::ifstream in(trace);
  const auto j = nlohmann::json::parse(in);
  int stages = 0;
  for (const auto& e : j["traceEvents"]) stages += e["name"] == "process_name";
  CHECK(stages == 8);
}

TEST_CASE("bad input exits with code 2 and a message naming what is wrong") {
  TempFile bad("[strategy]\ntp = 8\nglobal_batch = 8\ntpp = 2\n", "bad.toml");
  struct Case {
    std::string args;
    std::string expected;
  };
  const Case cases[] = {
      {"simulate --model gpt5", "unknown preset \"gpt5\""},
      {"simulate --cluster 4x8xtpu", "not a cluster preset"},
      {"simulate --strategy " + bad.path(), bad.path() + ":4: [strategy] unknown key 'tpp'"},
      {"simulate --model /nonexistent/model.toml", "no such file"},
      {"simulate --frobnicate", "frobnicate"},
      {"simulate --strategy tp=3,global_batch=8", "tp*pp = 3 does not divide the 16 GPUs"},
      {"simulate --conditions " + bad.path(), "no [conditions] table"},
      {"nosuchcommand", "nosuchcommand"},
      {"simulate --trace /nonexistent-dir/trace.json", "cannot write"},
  };
  for (const auto& c : cases) {
    const Run r = run(c.args);
    INFO(c.args);
    INFO(r.out);
    CHECK(r.exit_code == 2);
    CHECK(r.out.find(c.expected) != std::string::npos);
  }
  CHECK_FALSE(std::filesystem::exists("/nonexistent-dir/trace.json"));
}

TEST_CASE("--help exits 0") {
  const Run r = run("simulate --help");
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("--strategy") != std::string::npos);
}
