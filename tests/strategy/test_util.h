// Helpers shared by the strategy test suites.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace parapilot::testing {

// A file under a fresh temporary directory, removed with the object.
class TempFile {
 public:
  explicit TempFile(const std::string& content, const std::string& name = "spec.toml") {
    char pattern[] = "/tmp/parapilot-test-XXXXXX";
    dir_ = ::mkdtemp(pattern);
    path_ = dir_ + "/" + name;
    std::ofstream(path_) << content;
  }
  ~TempFile() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  const std::string& path() const { return path_; }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::string path_;
};

}  // namespace parapilot::testing
