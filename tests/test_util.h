// Helpers shared by the test suites: temporary files, and reading a Status or StatusOr.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

#include <doctest/doctest.h>

#include "core/status.h"

namespace parapilot::testing {

// The value of a reader's result; the test stops, with the reader's message, when it has none.
template <class T>
T ok(StatusOr<T> result) {
  REQUIRE_MESSAGE(result.ok(), result.status().message());
  return std::move(result).value();
}

// The message of a reader's failure; the check fails when the reader succeeded.
template <class T>
std::string failure_of(const StatusOr<T>& result) {
  CHECK_MESSAGE(!result.ok(), "expected an error");
  return result.status().message();
}

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
