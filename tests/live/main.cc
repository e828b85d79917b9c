// doctest main of the live tests. With --live-worker as the first argument the program runs one
// training worker instead (the cluster tests start themselves as workers); with --live-agent,
// the agent of the agent-lost test (below).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "tests/doctest_run.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "env/live/controller.h"
#include "env/live/worker.h"
#include "transport/auth.h"

namespace {

// --live-agent --world N --layout L [--switch-at S] --listen 127.0.0.1:PORT --secret-file FILE
// (the last two appended by LocalCluster): waits for the N ranks and their step 2, then prepares
// a switch to L, committed at step S or later (0: as soon as every rank is ready), and waits for
// it (at most 10 minutes). The tests kill it while the workers stage, or after the commit.
int run_agent(int argc, char** argv) {
  parapilot::live::ControllerOptions o;
  std::string layout;
  std::uint64_t switch_at = 0;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--world") o.world_size = std::stoi(value);
    if (flag == "--layout") layout = value;
    if (flag == "--switch-at") switch_at = std::stoull(value);
    if (flag == "--listen") o.port = static_cast<std::uint16_t>(std::stoi(value.substr(value.rfind(':') + 1)));
    if (flag == "--secret-file") {
      auto secret = parapilot::transport::load_secret_from_file(value);
      if (!secret.ok()) return 2;
      o.secret = *secret;
    }
  }
  auto started = parapilot::live::Controller::start(o);
  if (!started.ok()) {
    std::fprintf(stderr, "live agent: %s\n", started.status().message().c_str());
    return 1;
  }
  parapilot::live::Controller& agent = **started;
  using namespace std::chrono_literals;
  if (!agent.wait_for_ranks(o.world_size, 60s) || !agent.wait_for_step(2, 60s)) return 1;
  parapilot::live::LiveAction a;
  a.layout = layout;
  std::printf("live agent: preparing %s\n", layout.c_str());
  std::fflush(stdout);
  const auto r = agent.apply(a, 600s, switch_at);
  std::printf("live agent: %s\n", r.ok() ? "switched" : r.status().message().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--live-worker") == 0) {
    argv[1] = argv[0];
    return parapilot::live::worker_main(argc - 1, argv + 1);
  }
  if (argc > 1 && std::strcmp(argv[1], "--live-agent") == 0) return run_agent(argc, argv);
  return parapilot::testing::run_doctest(argc, argv);
}
