#include "benchmarks/report.h"

#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <thread>

namespace parapilot::bench {

namespace {

std::string run_command(const std::string& command) {
  std::string out;
  if (FILE* p = ::popen(command.c_str(), "r")) {
    char buf[256];
    while (std::fgets(buf, sizeof buf, p)) out += buf;
    ::pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

std::string commit() {
  const std::string git = "git -C '" + std::string(PARAPILOT_SOURCE_DIR) + "' ";
  const std::string hash = run_command(git + "rev-parse --short HEAD 2>/dev/null");
  if (hash.empty()) return "unknown";
  const std::string dirty =
      // docs/data holds the results scripts/run-results.py writes: not a change to the code.
      run_command(git + "status --porcelain --untracked-files=no -- . ':(exclude)docs/data' 2>/dev/null");
  return dirty.empty() ? hash : hash + "-dirty";
}

nlohmann::json load_average() {
  double load[3] = {0, 0, 0};
  if (::getloadavg(load, 3) != 3) return nullptr;
  return {load[0], load[1], load[2]};
}

}  // namespace

Report::Report(std::string benchmark, int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  char utc[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(utc, sizeof utc, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  head_ = {{"benchmark", std::move(benchmark)},
           {"args", args},
           {"commit", commit()},
           {"cores", std::thread::hardware_concurrency()},
           {"load_average", {{"start", load_average()}}},
           {"utc", utc}};
}

bool Report::write(const std::string& path) const {
  if (path.empty()) return true;
  nlohmann::json j = head_;
  j["load_average"]["end"] = load_average();
  j["figures"] = figures_;
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << j.dump(1) << '\n';
    if (!out) {
      std::fprintf(stderr, "--json %s: cannot write\n", path.c_str());
      std::filesystem::remove(tmp);
      return false;
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::fprintf(stderr, "--json %s: %s\n", path.c_str(), ec.message().c_str());
    std::filesystem::remove(tmp, ec);
    return false;
  }
  return true;
}

bool print_help(int argc, char** argv, const char* usage) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      const size_t n = std::strlen(usage);
      std::printf(n > 0 && usage[n - 1] == '\n' ? "%s" : "%s\n", usage);
      return true;
    }
  }
  return false;
}

std::string take_json_flag(int& argc, char** argv) {
  std::string path;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--json") {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "--json: needs a file name\n");
        std::exit(2);
      }
      path = argv[++i];
      continue;
    }
    argv[out++] = argv[i];
  }
  argc = out;
  argv[argc] = nullptr;
  return path;
}

}  // namespace parapilot::bench
