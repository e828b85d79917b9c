// Cutting a worker's links to its peers (link_cut.h).
#include "env/live/link_cut.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

namespace parapilot::live {

namespace {

// The port of a socket address (IPv4 or IPv6); -1 for another family.
int port_of(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
  return -1;
}

// Whether `fd` is a connected TCP socket with neither end on a kept port.
bool is_peer_link(int fd, const std::vector<int>& keep_ports) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return false;
  int type = 0;
  socklen_t len = sizeof type;
  if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) return false;
  sockaddr_storage local{}, remote{};
  socklen_t local_len = sizeof local, remote_len = sizeof remote;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0) return false;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&remote), &remote_len) != 0) return false;
  const int lp = port_of(local), rp = port_of(remote);
  if (lp < 0 || rp < 0) return false;  // a Unix socket
  auto kept = [&](int p) {
    return std::find(keep_ports.begin(), keep_ports.end(), p) != keep_ports.end();
  };
  return !kept(lp) && !kept(rp);
}

}  // namespace

StatusOr<int> cut_peer_links(const std::vector<int>& keep_ports) {
  std::error_code ec;
  std::filesystem::directory_iterator it("/proc/self/fd", ec);
  if (ec) return Status::unavailable("cannot list /proc/self/fd: " + ec.message());
  std::vector<int> fds;
  for (const auto& entry : it) {
    const std::string name = entry.path().filename().string();
    if (!name.empty() &&
        std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; }))
      fds.push_back(std::stoi(name));
  }
  int cut = 0;
  for (int fd : fds)
    if (is_peer_link(fd, keep_ports) && ::shutdown(fd, SHUT_RDWR) == 0) ++cut;
  return cut;
}

}  // namespace parapilot::live
