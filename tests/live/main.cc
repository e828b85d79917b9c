// doctest main of the live tests. With --live-worker as the first argument the program runs one
// training worker instead (the cluster tests start themselves as workers).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstring>

#include "env/live/worker.h"

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--live-worker") == 0) {
    argv[1] = argv[0];
    return parapilot::live::worker_main(argc - 1, argv + 1);
  }
  doctest::Context context(argc, argv);
  return context.run();
}
