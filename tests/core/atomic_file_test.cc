// core/atomic_file.h: a reader finds the old content or the new, never a mix, even when the
// writer dies in the middle of writing; failures are a Status naming the path.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <ostream>
#include <string>

#include "checkpoints/checkpoint.h"
#include "core/atomic_file.h"

using namespace parapilot;

namespace {

std::string temp_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("parapilot-core-tests-" + std::to_string(::getpid()) + "-" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Runs `write` in a child process whose files may not grow past `limit` bytes: the kernel
// kills it with SIGXFSZ in the middle of its write(2) calls, as a crash or kill -9 would stop
// a save half-way. Returns the signal that ended the child (0 if it exited).
template <class F>
int killed_while_writing(std::size_t limit, F write) {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const rlimit r{static_cast<rlim_t>(limit), static_cast<rlim_t>(limit)};
    ::setrlimit(RLIMIT_FSIZE, &r);
    write();
    ::_exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  return WIFSIGNALED(status) ? WTERMSIG(status) : 0;
}

checkpoints::PolicyCheckpoint policy_checkpoint(const std::string& env_id, std::size_t model_bytes) {
  checkpoints::PolicyCheckpoint c;
  c.env_id = env_id;
  c.config = "{}";
  c.model = std::string(model_bytes, 'm');
  c.optimizer = std::string(1000, 'o');
  return c;
}

}  // namespace

TEST_CASE("atomic file: a writer killed mid-write leaves the previous content whole") {
  const std::string dir = temp_dir("killed");
  const std::string path = dir + "/out.json";
  const std::string before(1 << 16, 'a');
  REQUIRE(write_file_atomically(path, [&](std::ostream& o) { o << before; }).ok());
  const int signal = killed_while_writing(1 << 15, [&] {
    (void)write_file_atomically(path, [&](std::ostream& o) { o << std::string(1 << 20, 'b'); });
  });
  CHECK(signal == SIGXFSZ);  // died inside the write, after the temporary was half written
  CHECK(read_all(path) == before);
  std::filesystem::remove_all(dir);
}

TEST_CASE("atomic file: an unwritable place is a Status naming the path, and nothing is left") {
  const std::string dir = temp_dir("unwritable");
  const std::string path = dir + "/missing-folder/out.json";
  const Status s = write_file_atomically(path, [](std::ostream& o) { o << "x"; });
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find(path + ": cannot write") == 0);
  CHECK(std::filesystem::is_empty(dir));
  std::filesystem::remove_all(dir);
}

TEST_CASE("policy checkpoint: a save killed mid-write leaves the previous checkpoint loadable") {
  const std::string dir = temp_dir("checkpoint");
  const std::string path = dir + "/policy.ckpt";
  const checkpoints::PolicyCheckpoint first = policy_checkpoint("sim:first", 4096);
  REQUIRE(checkpoints::write_checkpoint(path, first).ok());
  const int signal = killed_while_writing(1 << 16, [&] {
    (void)checkpoints::write_checkpoint(path, policy_checkpoint("sim:second", 1 << 20));
  });
  CHECK(signal == SIGXFSZ);
  const auto read = checkpoints::read_checkpoint(path);
  REQUIRE_MESSAGE(read.ok(), read.status().message());
  CHECK(read->env_id == "sim:first");
  CHECK(read->model == first.model);
  // A save that completes replaces it.
  REQUIRE(checkpoints::write_checkpoint(path, policy_checkpoint("sim:third", 100)).ok());
  CHECK(checkpoints::read_checkpoint(path)->env_id == "sim:third");
  std::filesystem::remove_all(dir);
}
