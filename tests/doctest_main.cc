// The main of every doctest program but live_tests: doctest's run, failing when no test case
// matched the filters (doctest_run.h).
#define DOCTEST_CONFIG_IMPLEMENT
#include "tests/doctest_run.h"

int main(int argc, char** argv) { return parapilot::testing::run_doctest(argc, argv); }
