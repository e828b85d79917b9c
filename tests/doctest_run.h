// The doctest main's run: like doctest's own, except that a run in which no test case passed
// the filters (a --test-case pattern that matches nothing) fails, naming the filter, instead of
// passing having tested nothing. Queries (--help, --list-test-cases, --count) are unaffected.
// Include from exactly one translation unit per test program (it registers a listener).
#pragma once

#include <doctest/doctest.h>

#include <cstdio>

namespace parapilot::testing {

// Records how many test cases passed the filters; -1 until a run ends (and after a query).
struct CaseCounter : doctest::IReporter {
  static inline int cases = -1;
  explicit CaseCounter(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& s) override {
    cases = static_cast<int>(s.numTestCasesPassingFilters);
  }
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("parapilot_case_counter", 1, CaseCounter);

/// Runs the test cases argv selects; 1 when no test case was selected.
inline int run_doctest(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int rc = context.run();
  if (context.shouldExit()) return rc;
  if (rc == 0 && CaseCounter::cases == 0) {
    std::fprintf(stderr, "%s: no test case matched the filters: a run that tests nothing fails\n",
                 argv[0]);
    return 1;
  }
  return rc;
}

}  // namespace parapilot::testing
