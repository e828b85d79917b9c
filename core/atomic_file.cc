#include "core/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <ostream>
#include <sstream>

namespace parapilot {

Status write_file_atomically(const std::string& path,
                             const std::function<void(std::ostream&)>& write) {
  std::ostringstream content;
  write(content);
  const std::string data = content.str();
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  auto failed = [&](int err) {
    ::unlink(tmp.c_str());
    return Status::invalid_argument(path + ": cannot write: " + std::strerror(err));
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::invalid_argument(path + ": cannot write: " + std::strerror(errno));
  size_t written = 0;
  while (written < data.size()) {
    const ssize_t n = ::write(fd, data.data() + written, data.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return failed(err);
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return failed(err);
  }
  if (::close(fd) != 0 || std::rename(tmp.c_str(), path.c_str()) != 0) return failed(errno);
  // The rename itself is durable once the directory is.
  const std::filesystem::path target(path);
  const std::string dir = target.has_parent_path() ? target.parent_path().string() : ".";
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return {};
}

}  // namespace parapilot
