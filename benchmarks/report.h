// Machine-readable benchmark output. A benchmark given `--json FILE` writes one JSON object:
//
//   {"benchmark": NAME, "args": [...], "commit": "4156d61" (+"-dirty" when the tree, docs/data aside, has
//    uncommitted changes; "unknown" outside a git checkout), "cores": N,
//    "load_average": {"start": [1, 5, 15 min], "end": [...]}, "utc": "2026-12-01T09:00:00Z",
//    "figures": {...}}
//
// The figures are the benchmark's own; scripts/render-results.py turns them into the tables
// of docs/results.md, docs/planner.md and docs/cost-model.md. The file is written atomically
// (a temporary file renamed into place), so a benchmark that fails leaves no partial file.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace parapilot::bench {

class Report {
 public:
  /// Records the command line, the commit and the load average at the start.
  Report(std::string benchmark, int argc, char** argv);
  nlohmann::json& figures() { return figures_; }
  /// Writes the report to `path` (no-op for ""), with the load average now. On failure says so
  /// on stderr and returns false.
  bool write(const std::string& path) const;

 private:
  nlohmann::json head_;
  nlohmann::json figures_ = nlohmann::json::object();
};

/// Whether argv asks for help (--help or -h anywhere): then `usage` has been printed to stdout
/// and the benchmark should return 0 without measuring anything.
bool print_help(int argc, char** argv, const char* usage);

/// Removes `--json FILE` from argv (argc shrinks) and returns FILE, "" when absent. Exits with
/// code 2 and a message when --json has no value.
std::string take_json_flag(int& argc, char** argv);

}  // namespace parapilot::bench
