// The parapilot binary as a user runs it: exit codes, messages, JSON and trace outputs.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"

using parapilot::testing::TempFile;

namespace {

struct Run {
  int exit_code;
  std::string out;  // stdout and stderr together
};

Run run_shell(const std::string& command_line) {
  const std::string command = command_line + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  REQUIRE(pipe);
  std::string out;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) out.append(buf.data(), n);
  const int status = ::pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

Run run(const std::string& args) { return run_shell(std::string(PARAPILOT_BIN) + " " + args); }

const std::string kSpecs = std::string(PARAPILOT_SOURCE_DIR) + "/experiments/specs/";

// A bus secret in a file only its owner can read, as the loaders require.
struct SecretFile : TempFile {
  SecretFile() : TempFile("0123456789abcdef0123456789abcdef\n", "secret") {
    namespace fs = std::filesystem;
    fs::permissions(path(), fs::perms::owner_read | fs::perms::owner_write,
                    fs::perm_options::replace);
  }
};

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
      {"simulate --strategy tp=3,global_batch=8", "tp*pp*cp = 3 does not divide the 16 GPUs"},
      {"simulate --conditions " + bad.path(), "no [conditions] table"},
      {"nosuchcommand", "nosuchcommand"},
      {"simulate --trace /nonexistent-dir/trace.json", "cannot write"},
      {"train --scenario 'random*x' --out /nonexistent-dir/run", "a copy count after '*'"},
      {"train --scenario 'sim:random(gpus=64)' --out /nonexistent-dir/run", "gpus"},
      // random*3 and straggler are four scenarios, one parallel env each.
      {"train --scenario 'random*3,straggler' --envs 3 --out /nonexistent-dir/run",
       "--envs 3 is fewer than the 4 scenarios"},
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

TEST_CASE("plan --json: ranked candidates with strategy fields and simulate's metrics") {
  const Run r =
      run("plan --model llama2-7b --cluster 1x8xa100-80g+1x8xh800 --top 3 --current dp --json");
  REQUIRE(r.exit_code == 0);
  const auto j = nlohmann::json::parse(r.out);
  REQUIRE(j["candidates"].is_array());
  CHECK(j["candidates"].size() >= 1);
  CHECK(j["candidates"].size() <= 3);
  CHECK(j["evaluated"].get<long>() > 0);
  CHECK(j["search_ms"].get<double>() >= 0);
  double previous = 1e30;
  for (const auto& c : j["candidates"]) {
    for (const char* key : {"dp", "tp", "pp", "sp", "microbatch_size", "schedule", "virtual_stages",
                            "recompute", "stages", "dp_shares", "compression"}) {
      CHECK_MESSAGE(c["strategy"].contains(key), key);
    }
    CHECK(c["fits_in_memory"] == true);
    const double t = c["tokens_per_s"].get<double>();
    CHECK(t <= previous);  // ranked best first
    previous = t;
  }
}

TEST_CASE("plan rejects bad input with exit code 2") {
  TempFile space("[space]\ntp = [3]\n", "space.toml");
  struct Case {
    std::string args;
    std::string expected;
  };
  const Case cases[] = {
      {"plan --top 0", "top"},
      {"plan --space /nonexistent/space.toml", "no such file"},
      {"plan --space " + space.path(), space.path()},
      {"plan --current tp=3,global_batch=8", "tp"},
  };
  for (const auto& c : cases) {
    const Run r = run(c.args);
    INFO(c.args);
    INFO(r.out);
    CHECK(r.exit_code == 2);
    CHECK(r.out.find(c.expected) != std::string::npos);
  }
}

TEST_CASE("eval --json: every policy scored against the oracle; bad scenarios exit 2") {
  TempFile dir("", "unused");
  const std::string plot = dir.dir() + "/eval.png";
  const Run r =
      run("eval --scenario \"sim:mixed(gpus=16,horizon=12)\" --episodes 2 "
          "--policies static,reactive,uniform-dp,oracle --json --plot " +
          plot);
  REQUIRE(r.exit_code == 0);
  const auto j = nlohmann::json::parse(r.out);
  for (const char* policy : {"static", "reactive", "uniform-dp", "oracle"}) {
    REQUIRE(j["policies"].contains(policy));
    const double score = j["policies"][policy]["score"].get<double>();
    CHECK(score > 0);
    CHECK(score <= 1.0001);
  }
  // The hindsight oracle bounds every causal policy's throughput on the same episodes.
  const double oracle_tps = j["policies"]["oracle"]["throughput_tokens_per_s"].get<double>();
  for (const char* policy : {"static", "reactive", "uniform-dp"}) {
    INFO(policy);
    CHECK(j["policies"][policy]["throughput_tokens_per_s"].get<double>() <= oracle_tps * 1.0001);
    // Where it falls short of the oracle: three parts that add up to 1 - score.
    const auto& gap = j["policies"][policy]["gap_to_oracle"];
    CHECK(gap["onset"]["share"].get<double>() + gap["next"]["share"].get<double>() +
              gap["later"]["share"].get<double>() ==
          doctest::Approx(1 - j["policies"][policy]["score"].get<double>()).epsilon(1e-9));
  }
  std::ifstream png(plot, std::ios::binary);
  char magic[4] = {};
  png.read(magic, 4);
  CHECK(std::string(magic + 1, 3) == "PNG");
  for (const std::string& bad : {std::string("eval --scenario weather"),
                                 std::string("eval --scenario straggler --policies nosuch"),
                                 std::string("eval --scenario straggler --episodes 0"),
                                 std::string("eval --scenario /nonexistent/s.toml")}) {
    const Run b = run(bad);
    INFO(bad);
    INFO(b.out);
    CHECK(b.exit_code == 2);
  }
}

TEST_CASE("policy ids come from the registry: eval and deploy read them, rl:PATH exits 2 with "
          "the new spelling") {
  const std::string ckpt = std::string(PARAPILOT_SOURCE_DIR) + "/checkpoints/default-mixed.ckpt";
  // The shipped policy by its default and by its path: one checkpoint, the same scores.
  const Run r = run("eval --scenario \"sim:mixed(gpus=16,horizon=4)\" --episodes 1 --policies "
                    "\"rl,rl(path=" + ckpt + "),static\" --json");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  const auto j = nlohmann::json::parse(r.out);
  const std::string by_path = "rl(path=" + ckpt + ")";
  REQUIRE(j["policies"].contains(by_path));
  CHECK(j["policies"][by_path]["score"] == j["policies"]["rl"]["score"]);
  CHECK(j["reference"] == "static");  // learned policies are not the default reference
  struct Case {
    std::string args;
    std::string expected;
  };
  const Case cases[] = {
      {"eval --scenario straggler --policies static,rl:runs/a.ckpt", "write rl(path=runs/a.ckpt)"},
      {"eval --scenario straggler --policies nosuch",
       "unknown policy \"nosuch\" (registered: lookahead, measured-shares, oracle, reactive, "
       "reactive-tuned, rl, ski-rental, static, threshold, uniform-dp)"},
      {"eval --scenario straggler --policies 'lookahead(k=0)'",
       "parameter k = \"0\" must be a whole number in [1, 100000]"},
      {"eval --scenario straggler --policies 'lookahead(dynamics=x)'", "must be own or family"},
      {"eval --scenario straggler --policies 'static(k=1)'", "unknown parameter \"k\""},
      {"deploy --policy rl:runs/a.ckpt", "write rl(path=runs/a.ckpt)"},
      {"deploy --policy nosuch", "unknown policy \"nosuch\""},
      {"deploy --policy lookahead", "needs a simulator's planning view"},
      {"deploy --policy oracle", "needs the future"},
  };
  for (const auto& c : cases) {
    // deploy would run until stopped if it took the policy: a time limit, not a hang.
    const Run b = run_shell("timeout -s KILL 60 " + std::string(PARAPILOT_BIN) + " " + c.args);
    INFO(c.args);
    INFO(b.out);
    CHECK(b.exit_code == 2);
    CHECK(b.out.find(c.expected) != std::string::npos);
  }
  // The help lists what the registry holds, with each policy's parameters.
  const Run help = run("eval --help");
  CHECK(help.exit_code == 0);
  for (const char* listed :
       {"reactive-tuned:", "ski-rental:", "uniform-dp:", "oracle:", "rl(path=...):",
        "lookahead(k=32,h=12,min_gain=1.02,seed=1,dynamics=own):",
        "measured-shares(min_gain=1.1,confirm=2):"}) {
    INFO(listed);
    CHECK(help.out.find(listed) != std::string::npos);
  }
}

TEST_CASE("trace analyze: the sample trace's what-if figures; malformed traces exit 2") {
  const std::string dir = std::string(PARAPILOT_TEST_DATA_DIR) + "/traces/bytedance-ST/";
  const Run r = run("trace analyze " + dir + "trace-ST.csv --meta " + dir + "meta-ST.yaml --json");
  REQUIRE(r.exit_code == 0);
  const auto j = nlohmann::json::parse(r.out);
  CHECK(j["slowdown"].get<double>() == doctest::Approx(1.179).epsilon(0.01));
  CHECK(j["cause"] == "stage-imbalance");
  TempFile bad("dp_rank,stage,rank,step,optype,start_ts,duration\n0,0,0,1,forward-compute,0.0,-1\n",
               "bad.csv");
  const Run b = run("trace analyze " + bad.path() + " --meta " + dir + "meta-ST.yaml");
  INFO(b.out);
  CHECK(b.exit_code == 2);
  CHECK(b.out.find(bad.path()) != std::string::npos);
}

TEST_CASE("eval --record writes the simulated telemetry that trace analyze reads") {
  TempFile dir("", "unused");
  const std::string csv = dir.dir() + "/telemetry.csv";
  const Run r =
      run("eval --scenario \"sim:straggler(gpus=16,horizon=6)\" --episodes 1 "
          "--policies static,oracle --record " +
          csv);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("warning") == std::string::npos);  // static kept its layout
  const Run a = run("trace analyze " + csv + " --json");
  INFO(a.out);
  REQUIRE(a.exit_code == 0);
  const auto j = nlohmann::json::parse(a.out);
  CHECK(j["measured_step_s"].get<double>() > 0);
  const Run bad =
      run("eval --scenario \"bandit:arms(horizon=4)\" --policies static --record " + csv);
  CHECK(bad.exit_code == 2);
  CHECK(bad.out.find("does not record telemetry") != std::string::npos);
}

TEST_CASE("eval --record of an episode that changed layout warns, and trace analyze and the "
          "trace env refuse the file naming the step of the change") {
  TempFile dir("", "unused");
  const std::string csv = dir.dir() + "/switched.csv";
  // reactive switches layouts on this draw (four times over its 48 intervals).
  const Run r = run("eval --scenario \"sim:mixed(gpus=32,horizon=48)\" --episodes 1 "
                    "--policies reactive,oracle --record " + csv);
  REQUIRE(r.exit_code == 0);
  CHECK_MESSAGE(r.out.find("warning: --record " + csv + ": the recorded episode (reactive's "
                           "first) changed layout") != std::string::npos,
                r.out);
  for (const std::string& cmd :
       {"trace analyze " + csv, "eval --scenario \"trace:" + csv + "\" --episodes 1"}) {
    const Run a = run(cmd);
    INFO(cmd << ": " << a.out);
    CHECK(a.exit_code == 2);
    CHECK(a.out.find("the layout changes at step") != std::string::npos);
    CHECK(a.out.find("a trace holds one layout") != std::string::npos);
  }
}

// Processes whose environment holds `mark` (NAME=VALUE): what a command started and left behind.
static int processes_marked(const std::string& mark) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string pid = e.path().filename().string();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(e.path() / "environ", std::ios::binary);
    std::string env((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::size_t at = 0;
    for (std::size_t end; (end = env.find('\0', at)) != std::string::npos; at = end + 1) {
      if (env.compare(at, end - at, mark) == 0) {
        ++n;
        break;
      }
    }
  }
  return n;
}

TEST_CASE("bad input to deploy, simcluster, launch and worker exits 2 naming it, and leaves "
          "nothing running") {
  namespace fs = std::filesystem;
  SecretFile secret;
  TempFile open_secret("0123456789abcdef0123456789abcdef\n", "secret");
  fs::permissions(open_secret.path(), fs::perms::owner_read | fs::perms::owner_write |
                                          fs::perms::group_read | fs::perms::others_read,
                  fs::perm_options::replace);
  TempFile short_secret("tiny\n", "secret");
  fs::permissions(short_secret.path(), fs::perms::owner_read | fs::perms::owner_write,
                  fs::perm_options::replace);
  // A port in use: a listening socket of this process.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) == 0);
  REQUIRE(::listen(fd, 1) == 0);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  const std::string busy = std::to_string(ntohs(addr.sin_port));
  const std::string s = " --secret-file " + secret.path();
  struct Case {
    std::string args;
    std::string expected;
  };
  const Case cases[] = {
      {"deploy --listen 127.0.0.1:99999" + s, "--listen \"127.0.0.1:99999\": expected HOST:PORT"},
      {"deploy --listen 127.0.0.1:http" + s, "--listen \"127.0.0.1:http\""},
      {"deploy --listen 127.0.0.1:" + busy + s, "--listen: cannot listen on 127.0.0.1:" + busy},
      {"deploy --listen 127.0.0.1:0 --metrics-port " + busy + s,
       "--metrics-port: metrics endpoint 127.0.0.1:" + busy},
      {"deploy --listen 127.0.0.1:0 --secret-file " + open_secret.path(),
       open_secret.path() + "' is open to other users (mode 0644): make it private with chmod 600"},
      {"deploy --listen 127.0.0.1:0 --secret-file " + short_secret.path(),
       short_secret.path() + "' is shorter than 16 bytes"},
      {"deploy --listen 127.0.0.1:0 --secret-file /nonexistent/secret",
       "cannot read secret file '/nonexistent/secret'"},
      {"simcluster --ranks 0 --agent 127.0.0.1:1" + s, "--ranks 0: must be a multiple of 8"},
      {"simcluster --agent 127.0.0.1" + s, "--agent \"127.0.0.1\": expected HOST:PORT"},
      {"simcluster --agent 127.0.0.1:1 --secret-file " + open_secret.path(),
       "is open to other users"},
      {"launch --workers 0 --steps 1", "--workers 0: must be >= 1"},
      {"launch --workers 2 --steps 1 --layout dp=3", "--layout: dp: dp*tp*pp*cp = 3*1*1*1 = 3 but "
                                                     "the job has 2 ranks"},
      {"launch --workers 2 --steps 1 --layout pipeline", "--layout: \"pipeline\" is not key=value"},
      {"launch --workers 2 --steps 1 --inject rank=5,slow=3x", "--inject: rank 5 does not exist"},
      {"launch --workers 2 --steps 1 --inject rank=1,slow=fast", "slow: 'fast' is not a finite"},
      {"launch --workers 2 --steps 1 --agent 127.0.0.1:0", "--agent \"127.0.0.1:0\""},
      {"launch --workers 2 --steps 1 --agent 127.0.0.1:" + busy + " --secret-file " +
           open_secret.path(),
       "is open to other users"},
      {"worker --layout pipeline", "--layout: \"pipeline\" is not key=value"},
  };
  const std::string mark = "PARAPILOT_CLI_TEST=" + std::to_string(::getpid());
  for (const auto& c : cases) {
    const Run r = run_shell("env " + mark + " timeout -s KILL 60 " + std::string(PARAPILOT_BIN) +
                            " " + c.args);
    INFO(c.args);
    INFO(r.out);
    CHECK(r.exit_code == 2);
    CHECK(r.out.find(c.expected) != std::string::npos);
    CHECK(processes_marked(mark) == 0);
  }
  ::close(fd);
}

TEST_CASE("launch --simulated needs an agent address") {
  const Run r = run("launch --simulated 16");
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("--agent HOST:PORT") != std::string::npos);
}

TEST_CASE("the shipped policy is found from the binary: installed, or not at all (loudly)") {
  namespace fs = std::filesystem;
  TempFile scratch("", "unused");
  const fs::path build = fs::path(PARAPILOT_BIN).parent_path();
  const fs::path prefix = fs::path(scratch.dir()) / "prefix";
  const Run install = run_shell("cmake --install " + build.string() + " --prefix " +
                                prefix.string());
  INFO(install.out);
  REQUIRE(install.exit_code == 0);
  REQUIRE(fs::is_regular_file(prefix / "share/parapilot/default-mixed.ckpt"));
  const std::string eval =
      " eval --scenario \"sim:mixed(gpus=16,horizon=4)\" --episodes 1 --policies rl --json";
  // Installed: the binary finds share/parapilot/ beside its bin/.
  const Run installed = run_shell("env -u PARAPILOT_DEFAULT_POLICY " +
                                  (prefix / "bin/parapilot").string() + eval);
  INFO(installed.out);
  CHECK(installed.exit_code == 0);
  // Moved alone: eval names the file it expected; deploy warns on stderr that it falls back.
  const fs::path lone = fs::path(scratch.dir()) / "lone";
  fs::create_directories(lone / "bin");
  fs::copy_file(prefix / "bin/parapilot", lone / "bin/parapilot");
  const Run moved = run_shell("env -u PARAPILOT_DEFAULT_POLICY " +
                              (lone / "bin/parapilot").string() + eval);
  INFO(moved.out);
  CHECK(moved.exit_code == 2);
  CHECK(moved.out.find((lone / "share/parapilot/default-mixed.ckpt").string()) !=
        std::string::npos);
  SecretFile secret;
  // Only its stderr is kept: the warning must not depend on reading the JSON log.
  const Run deploy = run_shell("(env -u PARAPILOT_DEFAULT_POLICY timeout -s INT 3 " +
                               (lone / "bin/parapilot").string() +
                               " deploy --scenario straggler --listen 127.0.0.1:0 --secret-file " +
                               secret.path() + " 2>&1 >/dev/null)");
  INFO(deploy.out);
  CHECK(deploy.out.find("deciding with the reactive baseline") != std::string::npos);
}

TEST_CASE("deploy with the shipped policy beside 64 simulated ranks, one slowed 3x: every input "
          "it reads is one training produced, and it speeds the job up") {
  SecretFile secret;
  const std::string bin = PARAPILOT_BIN;
  namespace fs = std::filesystem;
  const fs::path dir = secret.dir();  // removed with `secret`
  // One run: deploy (its defaults, the shipped policy) on a free port, the simulated ranks
  // against it, then SIGINT for deploy's closing line. `interval` = deploy's --interval-steps;
  // beyond the run's length it never decides: the job as it runs without an agent.
  auto once = [&](const std::string& name, int interval) {
    const std::string log = (dir / (name + ".log")).string();
    const std::string script =
        bin + " deploy --scenario straggler --listen 127.0.0.1:0 --interval-steps " +
        std::to_string(interval) + " --secret-file " + secret.path() + " > " + log +
        " 2>/dev/null & A=$!; for i in $(seq 200); do grep -q agent_started " + log +
        " && break; sleep 0.1; done; P=$(sed -n 's/.*\"port\":\\([0-9]*\\).*/\\1/p' " + log +
        " | head -1); " + bin + " simcluster --ranks 64 --scenario straggler --agent 127.0.0.1:$P" +
        " --secret-file " + secret.path() + " --no-dynamics --slow 17:3:100 --steps 400 --json; " +
        "kill -INT $A; wait $A";
    const Run r = run_shell(script);
    INFO(script << "\n" << r.out);
    REQUIRE(r.exit_code == 0);
    const auto report = nlohmann::json::parse(r.out.substr(r.out.rfind("\n{") + 1));
    std::ifstream in(log);
    nlohmann::json stopped;
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.value("event", "") == "agent_stopped") stopped = j;
    }
    REQUIRE(stopped.is_object());
    return std::make_pair(report, stopped);
  };
  const auto [with_agent, agent_stats] = once("agent", 10);
  const auto [without, idle_stats] = once("idle", 100000);
  INFO(agent_stats.dump());
  CHECK(agent_stats["committed"].get<int>() >= 1);
  CHECK(agent_stats["features_clipped"] == 0);
  CHECK(agent_stats["features_unseen"] == 0);
  CHECK(idle_stats["committed"] == 0);
  CHECK(with_agent["commits"].get<int>() == agent_stats["committed"].get<int>());
  // The same 400 steps in simulated time: the slowed rank holds every step back until the
  // agent moves work off it (bench_deploy straggler measures about 1.7x).
  const double speedup = without["sim_seconds"].get<double>() / with_agent["sim_seconds"].get<double>();
  MESSAGE("simulated job time: " << without["sim_seconds"] << " s without the agent, "
                                 << with_agent["sim_seconds"] << " s with it (" << speedup << "x)");
  CHECK(speedup > 1.3);
}
