#include "env/live/local_cluster.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cassert>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>

#include "core/error.h"

extern char** environ;

namespace parapilot::live {

namespace {

std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

}  // namespace

std::string RankExit::describe() const {
  std::string s = "rank " + std::to_string(rank);
  if (!exited) return s + " still running";
  if (signal)
    s += " killed by signal " + std::to_string(signal) + " (" + strsignal(signal) + ")";
  else if (code == 0)
    s += " finished";
  else if (code == 3)
    s += " stopped: a collective failed (peer lost, link cut or timeout), exit 3";
  else
    s += " exited with code " + std::to_string(code);
  return s + " at " + number(at_s) + " s";
}

std::vector<std::string> fault_flags(const FaultSpec& f) {
  std::vector<std::string> out;
  std::string prefix;
  if (f.kind == FaultSpec::Kind::slow) {
    out = {"--slow", number(f.factor)};
    prefix = "--slow-";
  } else if (f.kind == FaultSpec::Kind::link_delay) {
    out = {"--link-delay-ms", number(f.delay_ms)};
    prefix = "--link-delay-";
  } else if (f.kind == FaultSpec::Kind::link_cut) {
    return {"--link-cut-at-step", std::to_string(f.at_step)};
  } else {
    return out;
  }
  if (f.at_step >= 0) {
    out.insert(out.end(), {prefix + "at-step", std::to_string(f.at_step)});
    if (f.for_steps >= 0) out.insert(out.end(), {prefix + "for-steps", std::to_string(f.for_steps)});
  } else {
    out.insert(out.end(), {prefix + "at", number(f.at_s)});
    if (f.for_s < 1e300) out.insert(out.end(), {prefix + "for", number(f.for_s)});
  }
  return out;
}

StatusOr<int> free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return Status::unavailable("socket: " + std::string(std::strerror(errno)));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return Status::unavailable("cannot find a free port: " + std::string(std::strerror(errno)));
  }
  const int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

namespace {

// A 0600 temporary file holding `secret`; returns its path.
StatusOr<std::string> write_secret_file(const transport::Secret& secret) {
  char path[] = "/tmp/parapilot-secret-XXXXXX";
  const int fd = ::mkstemp(path);  // mode 0600
  if (fd < 0) {
    return Status::unavailable("cannot create the secret file: " + std::string(std::strerror(errno)));
  }
  const auto bytes = secret.bytes();
  if (::write(fd, bytes.data(), bytes.size()) != static_cast<ssize_t>(bytes.size())) {
    ::close(fd);
    ::unlink(path);
    return Status::unavailable("cannot write the secret file");
  }
  ::close(fd);
  return std::string(path);
}

// Starts `args` with environment `env`, stdout and stderr to `log` (empty: inherited).
StatusOr<pid_t> spawn(std::vector<std::string> args, std::vector<std::string> env,
                      const std::string& log) {
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return Status::unavailable("fork: " + std::string(std::strerror(errno)));
  if (pid == 0) {
    if (!log.empty()) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
        ::close(fd);
      }
    }
    ::execve(argv[0], argv.data(), envp.data());
    std::fprintf(stderr, "cannot start %s: %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  return pid;
}

}  // namespace

LocalCluster::LocalCluster(LocalClusterOptions options) : options_(std::move(options)) {}

StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::start(LocalClusterOptions options) {
  const int n = options.workers;
  if (n < 1 || n > 64) return Status::invalid_argument("--workers: must be in [1, 64]");
  // Preconditions (local_cluster.h): the callers build these, not a person.
  assert(!options.worker_command.empty());
  assert(static_cast<int>(options.host_agent) + static_cast<int>(!options.agent_command.empty()) +
             static_cast<int>(options.agent_port > 0) <= 1);
  for (const FaultSpec& f : options.faults)
    if (f.rank >= n)
      return Status::invalid_argument("--inject: rank " + std::to_string(f.rank) +
                                      " does not exist (" + std::to_string(n) + " workers)");
  for (const std::string& dir : {options.log_dir, std::filesystem::path(options.agent_log)
                                                      .parent_path()
                                                      .string()}) {
    if (dir.empty()) continue;
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return Status::invalid_argument("log folder '" + dir + "': " + ec.message());
  }
  std::unique_ptr<LocalCluster> cluster(new LocalCluster(std::move(options)));
  if (Status started = cluster->launch(); !started.ok()) return started;
  return cluster;
}

Status LocalCluster::launch() {
  const int n = options_.workers;
  start_ = std::chrono::steady_clock::now();
  const bool has_agent =
      options_.host_agent || !options_.agent_command.empty() || options_.agent_port > 0;
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    if (key != "RANK" && key != "WORLD_SIZE" && key != "LOCAL_RANK" && key != "MASTER_ADDR" &&
        key != "MASTER_PORT" && key != "LOCAL_WORLD_SIZE" &&
        !(has_agent && (key == "PARAPILOT_AGENT" || key == "PARAPILOT_SECRET_FILE")))
      env.push_back(kv);
  }
  std::vector<std::string> common = options_.worker_args;
  if (has_agent) {
    const transport::Secret secret =
        options_.agent_port > 0 ? options_.agent_secret : random_secret();
    StatusOr<std::string> secret_path = write_secret_file(secret);
    if (!secret_path.ok()) return secret_path.status();
    secret_path_ = std::move(secret_path).value();
    int port = options_.agent_port;
    if (options_.agent_port > 0) {
      // The caller's agent is already listening.
    } else if (options_.host_agent) {
      ControllerOptions co;
      co.world_size = n;
      co.secret = secret;
      StatusOr<std::unique_ptr<Controller>> controller = Controller::start(co);
      if (!controller.ok()) return controller.status();
      controller_ = std::move(controller).value();
      port = controller_->port();
    } else {
      const StatusOr<int> free = free_loopback_port();
      if (!free.ok()) return free.status();
      port = agent_port_ = *free;
      std::vector<std::string> args = options_.agent_command;
      args.insert(args.end(), {"--listen", "127.0.0.1:" + std::to_string(port), "--secret-file",
                               secret_path_});
      const StatusOr<pid_t> agent = spawn(args, env, options_.agent_log);
      if (!agent.ok()) return agent.status();
      agent_pid_ = *agent;
    }
    if (options_.agent_flags) {
      common.insert(common.end(), {"--agent", "127.0.0.1:" + std::to_string(port),
                                   "--secret-file", secret_path_});
    }
    env.insert(env.end(), {"PARAPILOT_AGENT=127.0.0.1:" + std::to_string(port),
                           "PARAPILOT_SECRET_FILE=" + secret_path_});
  }
  const StatusOr<int> master = free_loopback_port();
  if (!master.ok()) return master.status();
  const int master_port = *master;
  exits_.resize(n);
  done_.assign(n, false);
  kill_done_.assign(options_.faults.size(), false);
  for (int r = 0; r < n; ++r) {
    std::vector<std::string> args = options_.worker_command;
    args.insert(args.end(), common.begin(), common.end());
    for (const FaultSpec& f : options_.faults)
      if (f.rank == r) {
        auto extra = fault_flags(f);
        args.insert(args.end(), extra.begin(), extra.end());
      }
    std::vector<std::string> rank_env = env;
    rank_env.insert(rank_env.end(),
                    {"RANK=" + std::to_string(r), "WORLD_SIZE=" + std::to_string(n),
                     "LOCAL_RANK=" + std::to_string(r), "LOCAL_WORLD_SIZE=" + std::to_string(n),
                     "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + std::to_string(master_port),
                     "OMP_NUM_THREADS=1"});
    const StatusOr<pid_t> pid =
        spawn(args, rank_env,
              options_.log_dir.empty() ? ""
                                       : options_.log_dir + "/worker-" + std::to_string(r) + ".log");
    if (!pid.ok()) return pid.status();  // the destructor stops the ranks already started
    pids_.push_back(*pid);
  }
  return {};
}

LocalCluster::~LocalCluster() {
  terminate();
  stop_agent();
  if (!secret_path_.empty()) ::unlink(secret_path_.c_str());
}

double LocalCluster::elapsed_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void LocalCluster::reap(bool block) {
  for (std::size_t r = 0; r < pids_.size(); ++r) {
    if (done_[r]) continue;
    int status = 0;
    const pid_t p = ::waitpid(pids_[r], &status, block ? 0 : WNOHANG);
    if (p != pids_[r]) continue;
    done_[r] = true;
    RankExit& e = exits_[r];
    e.rank = static_cast<int>(r);
    e.exited = true;
    e.at_s = elapsed_s();
    if (WIFSIGNALED(status))
      e.signal = WTERMSIG(status);
    else
      e.code = WEXITSTATUS(status);
  }
}

bool LocalCluster::poll() {
  for (std::size_t i = 0; i < options_.faults.size(); ++i) {
    const FaultSpec& f = options_.faults[i];
    if (f.kind == FaultSpec::Kind::kill && !kill_done_[i] && elapsed_s() >= f.at_s) {
      kill_done_[i] = true;
      if (!done_[f.rank]) ::kill(pids_[f.rank], SIGKILL);
    }
  }
  reap(false);
  for (bool d : done_)
    if (!d) return true;
  return false;
}

std::vector<RankExit> LocalCluster::wait(double timeout_s, double grace_s) {
  double failed_at = -1;
  while (poll()) {
    const double now = elapsed_s();
    if (failed_at < 0)
      for (std::size_t r = 0; r < exits_.size(); ++r)
        if (done_[r] && (exits_[r].signal || exits_[r].code != 0)) failed_at = now;
    if (now >= timeout_s || (failed_at >= 0 && now - failed_at >= grace_s)) {
      terminate();
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (std::size_t r = 0; r < exits_.size(); ++r) exits_[r].rank = static_cast<int>(r);
  return exits_;
}

bool LocalCluster::any_failed() const {
  for (std::size_t r = 0; r < exits_.size(); ++r)
    if (done_[r] && (exits_[r].signal != 0 || exits_[r].code != 0)) return true;
  return false;
}

void LocalCluster::kill_rank(int rank) {
  reap(false);
  if (rank >= 0 && rank < static_cast<int>(pids_.size()) && !done_[rank])
    ::kill(pids_[rank], SIGKILL);
}

void LocalCluster::terminate() {
  reap(false);
  for (std::size_t r = 0; r < pids_.size(); ++r)
    if (!done_[r]) ::kill(pids_[r], SIGTERM);
  for (int i = 0; i < 100; ++i) {
    reap(false);
    bool all = true;
    for (bool d : done_) all = all && d;
    if (all) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (std::size_t r = 0; r < pids_.size(); ++r)
    if (!done_[r]) ::kill(pids_[r], SIGKILL);
  reap(true);
}

int LocalCluster::stop_agent() {
  if (agent_pid_ <= 0) return -1;
  ::kill(agent_pid_, SIGINT);
  int status = 0;
  pid_t p = 0;
  for (int i = 0; i < 500 && (p = ::waitpid(agent_pid_, &status, WNOHANG)) == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (p == 0) {
    ::kill(agent_pid_, SIGKILL);
    p = ::waitpid(agent_pid_, &status, 0);
  }
  agent_pid_ = -1;
  if (p < 0) return -1;
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

}  // namespace parapilot::live
