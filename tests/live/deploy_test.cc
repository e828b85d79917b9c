// parapilot deploy driving real Gloo workers (parapilot launch --agent deploy, or an external
// deploy): the closed loop and the agent going away. Runs the built `parapilot` binary.
// Assertions never depend on machine speed; every wait has a timeout.
#include <doctest/doctest.h>

#include <unistd.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "env/trace/telemetry.h"

namespace {

std::string temp_dir(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() /
           ("parapilot-deploy-live-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

// A model whose steps take tens of milliseconds, so that an injected slowdown stands well out
// of scheduling noise.
const char* kWorkerFlags =
    " --layers 2 --d-model 64 --heads 4 --seq-len 64 --global-batch 16 --microbatch 2"
    " --threads 1 --collective-timeout 60 --corpus " PARAPILOT_SOURCE_DIR "/docs";

std::vector<nlohmann::json> json_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] != '{') continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded()) out.push_back(std::move(j));
  }
  return out;
}

int run(const std::string& command) {
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

// `policy_flag`: "" for deploy's default, the shipped learned policy; or " --agent-policy P".
void drives_live_workers(const std::string& policy_flag, const std::string& expected_policy) {
  const std::string dir = temp_dir("loop");
  const std::string cmd = std::string(PARAPILOT_BIN) +
                          " launch --workers 2 --agent deploy" + policy_flag +
                          " --inject rank=1,slow=4x,at=20steps --steps 70 --log-dir " + dir +
                          " --record " + dir + "/telemetry.csv" + kWorkerFlags + " > " + dir +
                          "/launch.log 2>&1";
  INFO("logs in " << dir);
  REQUIRE(run(cmd) == 0);  // workers and the agent ended cleanly

  // The agent saw the slow rank and committed a switch after it.
  const auto lines = json_lines(dir + "/agent.log");
  REQUIRE(!lines.empty());
  CHECK(lines.front()["event"] == "agent_started");
  CHECK(lines.front()["ranks"] == 2);
  CHECK(lines.front()["policy"] == expected_policy);  // no fallback
  // The slow-rank event fires when the belief first crosses the threshold, which may be on the
  // way down; the belief itself must then reach the 4x slowdown (speed < 0.5).
  long slow_step = -1;
  double min_belief = 1;
  std::vector<long> switch_steps;
  for (const auto& e : lines) {
    if (slow_step < 0 && e["event"] == "slow_rank" && e["rank"] == 1)
      slow_step = e["step"].get<long>();
    if (slow_step >= 0 && e["event"] == "decision" && e.contains("beliefs"))
      min_belief = std::min(min_belief, e["beliefs"]["min_speed"].get<double>());
    if (e["event"] == "migration" && e["outcome"] == "committed")
      switch_steps.push_back(e["switch_at_step"].get<long>());
  }
  REQUIRE(slow_step >= 0);
  CHECK(min_belief < 0.5);
  REQUIRE(!switch_steps.empty());
  CHECK(lines.back()["event"] == "agent_stopped");
  // Conformance beside live workers: every input the policy read is one its training produced.
  CHECK(lines.back()["features_unseen"] == 0);
  CHECK(lines.back()["features_clipped"] == 0);

  // Every step ran exactly once on each rank, and its 8 microbatches were split without loss
  // or repetition, across every switch.
  const auto read = parapilot::trace::read_telemetry(dir + "/telemetry.csv");
  REQUIRE_MESSAGE(read.ok(), read.status().message());
  const auto& trace = *read;
  std::map<long, std::map<int, int>> mb;  // step -> rank -> microbatches
  for (const auto& s : trace.samples) {
    REQUIRE(mb[s.step].count(s.rank) == 0);
    mb[s.step][s.rank] = s.microbatches;
  }
  REQUIRE(mb.size() == 70);
  for (const auto& [step, ranks] : mb) {
    CAPTURE(step);
    REQUIRE(ranks.size() == 2);
    REQUIRE(ranks.at(0) + ranks.at(1) == 8);
    // The split changes only at a step the agent committed a switch for.
    if (step > 0 && mb[step - 1] != ranks)
      REQUIRE(std::count(switch_steps.begin(), switch_steps.end(), step) == 1);
  }
  // By the end, the agent has moved work off the slowed rank.
  CAPTURE(slow_step);
  REQUIRE(mb[69][1] < mb[69][0]);
  // launch's closing summary says what the agent did, as its log recorded it.
  std::ifstream launch_log(dir + "/launch.log");
  const std::string out((std::istreambuf_iterator<char>(launch_log)), {});
  INFO(out);
  const std::string committed = std::to_string(switch_steps.size()) + " switches committed";
  CHECK(out.find(committed) != std::string::npos);
  CHECK(out.find("  now: " + lines.back()["layout"].get<std::string>()) != std::string::npos);
  CHECK(out.find("after the last switch:") != std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace

TEST_CASE("parapilot deploy with the shipped policy drives live Gloo workers: a slowed rank gets "
          "a smaller share") {
  drives_live_workers("", "rl");
}

TEST_CASE("the same with the reactive baseline") {
  drives_live_workers(" --agent-policy reactive", "reactive");
}

TEST_CASE("with hybrid switches, parapilot deploy moves a pipeline job off its slowed stage: a "
          "real layout switch, every step once on every rank") {
  const std::string dir = temp_dir("hybrid");
  const std::string cmd = std::string(PARAPILOT_BIN) +
                          " launch --workers 2 --agent deploy --agent-switches hybrid"
                          " --agent-interval-steps 5 --steps 60 --layout dp=1,pp=2"
                          " --inject rank=1,slow=4x,at=10steps --log-dir " + dir +
                          " --record " + dir + "/telemetry.csv"
                          " --layers 4 --d-model 32 --heads 2 --seq-len 16 --global-batch 8"
                          " --microbatch 1 --threads 1 --collective-timeout 60 > " + dir +
                          "/launch.log 2>&1";
  INFO("logs in " << dir);
  REQUIRE(run(cmd) == 0);  // workers and the agent ended cleanly
  const auto lines = json_lines(dir + "/agent.log");
  REQUIRE(!lines.empty());
  CHECK(lines.front()["event"] == "agent_started");
  // The agent committed a switch out of the two-stage pipeline.
  std::vector<long> switch_steps;
  std::string last_layout;
  for (const auto& e : lines) {
    if (e["event"] == "migration" && e["outcome"] == "committed") {
      switch_steps.push_back(e["switch_at_step"].get<long>());
      last_layout = e["layout"].get<std::string>();
    }
  }
  REQUIRE(!switch_steps.empty());
  CHECK(last_layout.find("-pp2-") == std::string::npos);
  // Every step ran once on each rank, across the switch.
  const auto read = parapilot::trace::read_telemetry(dir + "/telemetry.csv");
  REQUIRE_MESSAGE(read.ok(), read.status().message());
  std::map<long, std::map<int, int>> rows;  // step -> rank -> rows
  for (const auto& x : read->samples) ++rows[x.step][x.rank];
  REQUIRE(rows.size() == 60);
  for (const auto& [step, ranks] : rows) {
    CAPTURE(step);
    CHECK(ranks.size() == 2);
    for (const auto& [rank, n] : ranks) CHECK(n == 1);
  }
  // The workers logged the switch with its pause.
  std::ifstream w0(dir + "/worker-0.log");
  const std::string log0((std::istreambuf_iterator<char>(w0)), {});
  CHECK(log0.find("switched to layout dp=2,tp=1,pp=1") != std::string::npos);
  std::filesystem::remove_all(dir);
}

TEST_CASE("the agent killed: live workers train on, reconnect to a new agent, finish cleanly") {
  const std::string dir = temp_dir("restart");
  const std::string bin = PARAPILOT_BIN;
  {
    std::ofstream(dir + "/secret") << "a-test-secret-of-at-least-16-bytes\n";
    std::filesystem::permissions(dir + "/secret", std::filesystem::perms::owner_read |
                                                      std::filesystem::perms::owner_write,
                                 std::filesystem::perm_options::replace);
    std::ofstream(dir + "/model.toml")
        << "[model]\nlayers = 2\nhidden = 64\nheads = 4\nseq_len = 64\nvocab = 256\n";
    std::ofstream(dir + "/job.toml")
        << "[scenario]\nfamily = \"straggler\"\ncluster = \"1x2xa100-80g\"\n"
        << "model = \"" << dir << "/model.toml\"\nglobal_batch = 16\n[space]\ntp = [1]\n"
        << "pp = [1]\nmicrobatch_size = [1]\nzero = [1]\nrecompute = [\"selective\"]\n";
  }
  const std::string deploy = bin + " deploy --policy reactive --scenario " + dir +
                             "/job.toml --secret-file " + dir + "/secret --listen 127.0.0.1:";
  // Agent A listens on a port the system picks (its agent_started line names it) and runs until
  // the workers report to it, then dies (SIGKILL). The workers train on; agent B starts on the
  // same address, and the workers report to it until they finish. Every wait has a deadline; a
  // missed one ends the script with status 3 and says which.
  const std::string script =
      "set -u; D=" + dir + "; A=; B=; L=\n"
      "fail() { echo \"run.sh: $*\" >&2; kill -9 $A $B $L 2>/dev/null; exit 3; }\n"
      "wait_line() { for i in $(seq $(($3 * 10))); do grep -q \"$2\" \"$1\" 2>/dev/null && "
      "return 0; sleep 0.1; done; return 1; }\n" +
      deploy + "0 > $D/a.log 2>&1 & A=$!\n"
      "wait_line $D/a.log agent_started 30 || fail 'agent A did not start'\n"
      "PORT=$(grep -o '\"port\":[0-9]*' $D/a.log | head -1 | cut -d: -f2)\n"
      "[ -n \"$PORT\" ] && [ \"$PORT\" != 0 ] || fail 'agent A named no port'\n" +
      bin + " launch --workers 2 --agent 127.0.0.1:$PORT --secret-file $D/secret --steps 0 "
      "--max-seconds 25" + kWorkerFlags + " > $D/launch.log 2>&1 & L=$!\n"
      "wait_line $D/a.log '\"decision\"' 60 || fail 'the workers never reported to agent A'\n"
      "kill -9 $A; wait $A; A=\n"
      // The address is free once A is gone; B retries in case the system is slow to release it.
      "for try in $(seq 20); do " + deploy + "$PORT > $D/b.log 2>&1 & B=$!; "
      "wait_line $D/b.log agent_started 5 && break; kill -9 $B 2>/dev/null; wait $B; B=; "
      "sleep 0.25; done\n"
      "[ -n \"$B\" ] || fail \"agent B could not listen on port $PORT\"\n"
      "wait_line $D/b.log '\"decision\"' 60 || fail 'the workers never reported to agent B'\n"
      "wait $L; echo $? > $D/launch.rc; L=\n"
      "kill -INT $B; wait $B; echo $? > $D/b.rc\n";
  std::ofstream(dir + "/run.sh") << script;
  INFO("logs in " << dir);
  CHECK(run("bash " + dir + "/run.sh") == 0);
  auto read_int = [](const std::string& path) {
    int v = -1;
    std::ifstream(path) >> v;
    return v;
  };
  CHECK(read_int(dir + "/launch.rc") == 0);  // every worker finished; none was lost
  CHECK(read_int(dir + "/b.rc") == 0);
  bool a_decided = false, b_decided = false;
  for (const auto& e : json_lines(dir + "/a.log")) a_decided |= e["event"] == "decision";
  for (const auto& e : json_lines(dir + "/b.log")) b_decided |= e["event"] == "decision";
  CHECK(a_decided);
  CHECK(b_decided);  // the workers reconnected and reported to the new agent
  std::filesystem::remove_all(dir);
}
