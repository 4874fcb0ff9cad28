// How the supervisor starts, stops and reaps its worker processes, behind a small interface so
// that a test can step the supervisor with a launcher that starts nothing (and decides when a
// "worker" exits) while everything else runs for real. gpuqd uses ForkExecLauncher.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "gpuq/error.hpp"

namespace gpuq::daemon {

// One worker process to start. The descriptors are owned by the caller (it closes the child's
// ends after launch() returns): they become the child's fds 3 (control), 1, 2 and 4 (the
// worker's private page, kWorkerPrivateFd; none when -1).
struct LaunchSpec {
  std::vector<std::string> argv;  // argv[0]: the executable's path
  std::vector<std::string> env;   // NAME=value, the whole environment
  std::vector<int> cpus;          // the CPU affinity
  int control_fd = -1;
  int stdout_fd = -1;
  int stderr_fd = -1;
  int private_fd = -1;
};

struct ChildExit {
  pid_t pid = 0;
  int status = 0;  // as waitpid() reports it
};

class ProcessLauncher {
 public:
  virtual ~ProcessLauncher() = default;
  // Starts the process; its pid. The child dies with the supervisor (PR_SET_PDEATHSIG).
  virtual Result<pid_t> launch(const LaunchSpec& spec) = 0;
  // Sends SIGKILL to a process launch() started (its exit is reported by reap()).
  virtual void kill(pid_t pid) = 0;
  // A child that has exited, or nothing when none has. The supervisor calls it on SIGCHLD until
  // it returns nothing.
  virtual std::optional<ChildExit> reap() = 0;
  // Pins every thread of running process `pid` to `cpus` (a promoted spare worker takes the
  // CPUs of the worker it replaces; a Python worker has several threads). Errors: SystemError
  // when its threads cannot be listed or one cannot be pinned (one that exits meanwhile is no
  // error).
  virtual Result<void> set_affinity(pid_t pid, const std::vector<int>& cpus) = 0;
};

// fork + execve. Everything the child needs is prepared before fork(); after it, the child
// makes only async-signal-safe calls (the supervisor is single-threaded, but the rule keeps
// the child correct whatever the parent becomes).
class ForkExecLauncher final : public ProcessLauncher {
 public:
  Result<pid_t> launch(const LaunchSpec& spec) override;
  void kill(pid_t pid) override;
  std::optional<ChildExit> reap() override;
  // sched_setaffinity on each thread of /proc/<pid>/task, again until a pass finds no thread
  // it had not pinned (one a thread started meanwhile).
  Result<void> set_affinity(pid_t pid, const std::vector<int>& cpus) override;
};

}  // namespace gpuq::daemon
