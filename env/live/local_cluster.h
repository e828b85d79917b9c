// A local live cluster for development, demos, tests and measurements: N worker processes on
// this machine (torchrun's environment variables, c10d rendezvous on a free loopback port), an
// in-process agent bus (Controller) they report to, and fault injection (slow rank, link delay,
// killed rank). No libtorch here: workers are separate processes started from a command line.
//
// Thread-safety: one thread drives a LocalCluster; controller() is thread-safe.
#pragma once

#include <sys/types.h>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "env/live/fault_spec.h"
#include "env/live/controller.h"

namespace parapilot::live {

struct LocalClusterOptions {
  int workers = 2;
  /// The program and leading arguments that run one worker, e.g. {"/proc/self/exe", "worker"}.
  std::vector<std::string> worker_command;
  /// Flags given to every worker (model, steps, backend...).
  std::vector<std::string> worker_args;
  std::vector<FaultSpec> faults;
  /// Host a Controller and pass --agent/--secret-file to the workers.
  bool host_agent = true;
  /// Or start this agent process before the workers, e.g. {"/proc/self/exe", "deploy",
  /// "--scenario", "job.toml"}: "--listen 127.0.0.1:PORT --secret-file FILE" are appended, the
  /// workers get the same address and secret, and the agent is stopped (SIGINT, then SIGKILL
  /// after 10 s) by stop_agent() or the destructor. Excludes host_agent.
  std::vector<std::string> agent_command;
  /// File for the agent process's stdout and stderr; empty = inherit this process's.
  std::string agent_log;
  /// Or report to an agent this process already runs (the live env's deploy agent), listening
  /// on 127.0.0.1:agent_port and holding agent_secret. Excludes host_agent and agent_command.
  int agent_port = 0;
  transport::Secret agent_secret;
  /// Pass the agent as --agent/--secret-file flags (parapilot worker). The workers' environment
  /// always carries it as PARAPILOT_AGENT and PARAPILOT_SECRET_FILE (parapilot.pytorch.Session).
  bool agent_flags = true;
  /// Folder for worker-RANK.log (stdout and stderr); empty = inherit this process's.
  std::string log_dir;
};

/// How one worker ended.
struct RankExit {
  int rank = 0;
  bool exited = false;  ///< ended by itself (code valid) or by a signal (signal valid).
  int code = 0;
  int signal = 0;
  double at_s = 0;               ///< seconds after launch.
  std::string describe() const;  ///< "rank 1 killed by signal 9 at 2.1 s", "rank 0 exited 3 ..."
};

class LocalCluster {
 public:
  /// Starts the agent bus (if asked) and the workers. kInvalidArgument for bad options (a
  /// worker count out of range, a fault on a rank that does not exist, a log folder that cannot
  /// be made); kUnavailable when a port, the secret file or a process cannot be had (ranks
  /// already started are stopped). Preconditions: a worker command, and at most one of
  /// host_agent, agent_command and agent_port.
  static StatusOr<std::unique_ptr<LocalCluster>> start(LocalClusterOptions options);
  /// Stops workers still running (SIGTERM, then SIGKILL).
  ~LocalCluster();
  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  /// The in-process agent (nullptr without host_agent).
  Controller* controller() { return controller_.get(); }
  int workers() const { return options_.workers; }
  double elapsed_s() const;
  /// True while some worker runs. Also carries out due kill faults.
  bool poll();
  /// Waits until every worker ended, carrying out kill faults. Once one ends with a failure, the
  /// others get `grace_s` to notice (collective timeouts) before they are terminated. Returns
  /// one RankExit per rank; ranks still running at `timeout_s` are killed and reported so.
  std::vector<RankExit> wait(double timeout_s, double grace_s = 20);
  /// True once some worker ended with a failure (non-zero exit or a signal).
  bool any_failed() const;
  /// Sends SIGKILL to one worker now (what a kill fault does at its time).
  void kill_rank(int rank);
  /// Terminates every worker still running.
  void terminate();
  /// Stops the agent process (SIGINT, then SIGKILL after 10 s). Returns how it ended: its exit
  /// code, or 128 + signal; -1 when there is none or it was already stopped.
  int stop_agent();
  /// The agent process's bus port (0 without agent_command).
  int agent_port() const { return agent_port_; }

 private:
  explicit LocalCluster(LocalClusterOptions options);
  Status launch();  // the agent bus and the workers
  void reap(bool block);
  LocalClusterOptions options_;
  std::unique_ptr<Controller> controller_;
  std::string secret_path_;
  std::vector<pid_t> pids_;
  pid_t agent_pid_ = -1;
  int agent_port_ = 0;
  std::vector<RankExit> exits_;
  std::vector<bool> done_, kill_done_;
  std::chrono::steady_clock::time_point start_;
};

/// Worker flags that inject `f` into its rank (slow and link-delay; kill is done by the cluster).
std::vector<std::string> fault_flags(const FaultSpec& f);
/// A free TCP port on 127.0.0.1 (bound and released; a small race remains); kUnavailable when
/// none can be bound.
StatusOr<int> free_loopback_port();

}  // namespace parapilot::live
