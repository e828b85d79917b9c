// parapilot launch passing the run summary and checkpoint flags to its workers: a job stopped
// with --save-state and relaunched under another layout with --load-state, each with
// --summary-json, and a bad checkpoint refused by launch itself (exit code 2, no worker
// started). Runs the built `parapilot` binary; no assertion depends on machine speed.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

namespace {

std::string temp_dir(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() /
           ("parapilot-launch-state-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

const char* kWorkerFlags =
    " --layers 4 --d-model 32 --heads 2 --seq-len 16 --global-batch 8 --microbatch 1"
    " --threads 1 --collective-timeout 60";

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// `parapilot launch` + flags, its output in `log`; the exit code.
int launch(const std::string& flags, const std::string& log) {
  const std::string cmd = std::string(PARAPILOT_BIN) + " launch --workers 2" + kWorkerFlags + " " +
                          flags + " > " + log + " 2>&1";
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

nlohmann::json read_json(const std::string& path) {
  const nlohmann::json j = nlohmann::json::parse(read_text(path), nullptr, false);
  REQUIRE_MESSAGE(j.is_object(), path << ": " << read_text(path));
  return j;
}

}  // namespace

TEST_CASE(
    "launch: --save-state, a relaunch under another layout with --load-state, and the "
    "run summaries of both") {
  const std::string dir = temp_dir("resume");
  INFO("logs in " << dir);
  REQUIRE(launch("--agent none --layout dp=2 --steps 5 --save-state " + dir +
                     "/state --summary-json " + dir + "/first.json",
                 dir + "/first.log") == 0);
  const nlohmann::json first = read_json(dir + "/first.json");
  CHECK(first["first_step"] == 0);
  CHECK(first["steps"] == 5);
  CHECK(first["samples"] == 40);
  CHECK(first["layout"] == "dp=2,tp=1,pp=1,stages=[4]");
  CHECK(first["switches"].empty());
  CHECK(std::filesystem::exists(dir + "/state/parapilot-state.bin"));
  // --steps counts from step 0: the relaunched job trains steps 5 to 11.
  REQUIRE(launch("--agent none --layout pp=2,stages=[1,3] --steps 12 --load-state " + dir +
                     "/state --summary-json " + dir + "/second.json",
                 dir + "/second.log") == 0);
  const nlohmann::json second = read_json(dir + "/second.json");
  CHECK(second["first_step"] == 5);
  CHECK(second["steps"] == 7);
  CHECK(second["samples"] == 56);
  CHECK(second["step_ms"].size() == 7);
  CHECK(second["layout"] == "dp=1,tp=1,pp=2,stages=[1,3]");
  // The relaunch started after the first job's last step had ended.
  CHECK(second["first_step_end_unix_s"].get<double>() >
        first["last_step_end_unix_s"].get<double>());
  std::filesystem::remove_all(dir);
}

TEST_CASE("launch refuses a checkpoint of another model before starting any worker") {
  const std::string dir = temp_dir("refused");
  INFO("logs in " << dir);
  REQUIRE(launch("--agent none --steps 1 --save-state " + dir + "/state", dir + "/save.log") == 0);
  CHECK(launch("--agent none --steps 2 --d-model 64 --load-state " + dir + "/state",
               dir + "/load.log") == 2);
  const std::string log = read_text(dir + "/load.log");
  CHECK_MESSAGE(
      log.find("--load-state " + dir + "/state: the checkpoint's model") != std::string::npos, log);
  CHECK_MESSAGE(log.find("launched") == std::string::npos, log);  // no worker started
  std::filesystem::remove_all(dir);
}
