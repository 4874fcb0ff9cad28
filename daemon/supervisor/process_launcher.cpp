#include "process_launcher.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include "gpuq/common/log.hpp"
#include "gpuq/common/posix_call.hpp"

namespace gpuq::daemon {

Result<pid_t> ForkExecLauncher::launch(const LaunchSpec& spec) {
  if (spec.argv.empty()) return Error(ErrorCode::kInvalidArgument, "launch: no executable");
  std::vector<std::string> args = spec.argv, env = spec.env;
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  for (int cpu : spec.cpus) {
    if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_SET(cpu, &cpus);
  }
  sigset_t empty;
  sigemptyset(&empty);
  const char* path = argv.front();
  const int control = spec.control_fd, out = spec.stdout_fd, err = spec.stderr_fd;
  const int private_page = spec.private_fd;

  const pid_t pid = ::fork();
  if (pid < 0) return GPUQ_SYSTEM_ERROR("fork");
  if (pid == 0) {
    // Child: raw async-signal-safe calls only, and nothing to report a failure to but stderr
    // and the exit status (the supervisor logs the worker's death). Wire fds 1, 2, 3, 4; pin;
    // die with the supervisor; exec. The private page first goes above them all, so that the
    // dup2s below cannot close it whatever number it had.
    const int page = private_page >= 0 ? fcntl(private_page, F_DUPFD_CLOEXEC, 10) : -1;
    if (private_page >= 0 && page < 0) {
      static const char kNoPage[] = "gpuq-worker: no descriptor for its private page\n";
      (void)!write(2, kNoPage, sizeof kNoPage - 1);
      _exit(127);
    }
    if (control == 3) {
      (void)fcntl(3, F_SETFD, 0);  // keep it across exec
    } else {
      (void)dup2(control, 3);
    }
    (void)dup2(out, 1);
    (void)dup2(err, 2);
    if (page >= 0) (void)dup2(page, 4);  // the copy at 4 has FD_CLOEXEC clear: it survives exec
    (void)sched_setaffinity(0, sizeof cpus, &cpus);  // not pinned beats not running
    (void)prctl(PR_SET_PDEATHSIG, SIGKILL);
    (void)sigprocmask(SIG_SETMASK, &empty, nullptr);
    (void)signal(SIGPIPE, SIG_DFL);
    execve(path, argv.data(), envp.data());
    static const char kMsg[] = "gpuq-worker: execve failed\n";
    (void)!write(2, kMsg, sizeof kMsg - 1);
    _exit(127);
  }
  return pid;
}

void ForkExecLauncher::kill(pid_t pid) {
  // ESRCH: it has exited already and waits to be reaped; nothing else can fail for a child.
  if (pid <= 0) return;
  if (auto r = GPUQ_POSIX_CALL(::kill, pid, SIGKILL); !r && errno != ESRCH) {
    GPUQ_LOG_WARN("cannot kill pid %d: %s", pid, r.error().to_string().c_str());
  }
}

std::optional<ChildExit> ForkExecLauncher::reap() {
  int status = 0;
  auto pid = GPUQ_POSIX_CALL(::waitpid, -1, &status, WNOHANG);
  // 0: children, none exited; ECHILD: no children at all.
  if (!pid || *pid == 0) return std::nullopt;
  return ChildExit{static_cast<pid_t>(*pid), status};
}

Result<void> ForkExecLauncher::set_affinity(pid_t pid, const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int cpu : cpus) {
    if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_SET(cpu, &set);
  }
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  std::set<pid_t> pinned;
  // A thread started during a pass inherits the affinity of the thread that started it, which
  // may not have been pinned yet: pass again until a pass finds no new thread (a few at most).
  for (int pass = 0; pass < 8; ++pass) {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) return GPUQ_SYSTEM_ERROR(("opendir " + dir).c_str());
    bool found_new = false;
    Result<void> result;
    while (const dirent* e = ::readdir(d)) {
      char* end = nullptr;
      const long tid = std::strtol(e->d_name, &end, 10);
      if (end == e->d_name || *end != '\0' || tid <= 0) continue;  // "." and ".."
      if (!pinned.insert(static_cast<pid_t>(tid)).second) continue;
      found_new = true;
      // ESRCH: the thread has ended since the listing.
      if (auto r = GPUQ_POSIX_CALL(::sched_setaffinity, static_cast<pid_t>(tid), sizeof set, &set);
          !r && errno != ESRCH && result) {
        result = r.error();
      }
    }
    (void)::closedir(d);  // a directory stream: nothing to lose
    if (!result) return result;
    if (!found_new) return {};
  }
  return {};
}

}  // namespace gpuq::daemon
