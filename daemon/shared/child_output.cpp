#include "child_output.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string_view>

#include "gpuq/common/clock.hpp"
#include "gpuq/common/log.hpp"
#include "gpuq/common/posix_call.hpp"
#include "gpuq/common/unique_fd.hpp"

extern char** environ;

namespace gpuq::daemon {

std::string describe_child_status(int status) {
  return WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status))
                             : "exit status " + std::to_string(WEXITSTATUS(status));
}

std::vector<std::string> environment_without(const std::vector<std::string>& drop) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view v(*e);
    bool keep = true;
    for (const auto& d : drop) keep = keep && v.rfind(d + "=", 0) != 0;
    if (keep) env.emplace_back(v);
  }
  return env;
}

Result<ChildOutput> run_child_for_output(const std::vector<std::string>& argv_in,
                                         const std::vector<std::string>& env_in,
                                         uint32_t timeout_ms) {
  auto internal = [](const Error& e) { return Error(ErrorCode::kInternal, e.message()); };
  int out_fds[2], err_fds[2];
  if (auto r = GPUQ_POSIX_CALL(::pipe2, out_fds, O_CLOEXEC); !r) return internal(r.error());
  UniqueFd out_read(out_fds[0]), out_write(out_fds[1]);
  if (auto r = GPUQ_POSIX_CALL(::pipe2, err_fds, O_CLOEXEC); !r) return internal(r.error());
  UniqueFd err_read(err_fds[0]), err_write(err_fds[1]);
  // Everything the child needs, prepared before fork.
  std::vector<std::string> args = argv_in, env = env_in;
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  auto forked = GPUQ_POSIX_CALL(::fork);
  if (!forked) return internal(forked.error());
  const auto pid = static_cast<pid_t>(*forked);
  if (pid == 0) {
    // The child, until execve: the parent may have other threads, so only async-signal-safe
    // calls, raw (the checked wrappers allocate on failure). A failed dup2 shows as the
    // output missing; a failed execve as exit status 127.
    ::dup2(out_write.get(), 1);
    ::dup2(err_write.get(), 2);
    ::execve(argv[0], argv.data(), envp.data());
    static const char kMsg[] = "execve failed: no such executable, or not executable\n";
    ssize_t ignored = ::write(2, kMsg, sizeof kMsg - 1);
    (void)ignored;
    _exit(127);
  }
  out_write.reset();
  err_write.reset();
  ChildOutput result;
  const uint64_t deadline = monotonic_ns() + uint64_t{timeout_ms} * 1'000'000;
  bool timed_out = false;
  std::string poll_failure;
  UniqueFd* const streams[2] = {&out_read, &err_read};
  pollfd fds[2] = {{out_read.get(), POLLIN, 0}, {err_read.get(), POLLIN, 0}};
  int open_fds = 2;
  while (open_fds > 0) {
    const uint64_t now = monotonic_ns();
    if (now >= deadline) {
      timed_out = true;
      break;
    }
    // EINTR restarts the poll with the same timeout; the deadline check above bounds it.
    auto ready =
        GPUQ_POSIX_CALL(::poll, fds, 2, static_cast<int>((deadline - now) / 1'000'000) + 1);
    if (!ready) {
      poll_failure = ready.error().message();
      break;
    }
    if (*ready == 0) continue;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char chunk[4096];
      // A read error ends that stream as its end does; the child's exit status says the rest.
      auto n = GPUQ_POSIX_CALL(::read, fds[i].fd, chunk, sizeof chunk);
      if (!n || *n == 0) {
        streams[i]->reset();
        fds[i].fd = -1;
        --open_fds;
        continue;
      }
      (i == 0 ? result.out : result.err).append(chunk, static_cast<size_t>(*n));
    }
  }
  out_read.reset();
  err_read.reset();
  if (timed_out || !poll_failure.empty()) {
    // The child is not reaped yet, so it cannot be missed; a failure would leave waitpid below
    // waiting for the child to end by itself.
    if (auto r = GPUQ_POSIX_CALL(::kill, pid, SIGKILL); !r) {
      GPUQ_LOG_WARN("%s: %s", argv_in[0].c_str(), r.error().message().c_str());
    }
  }
  if (auto r = GPUQ_POSIX_CALL(::waitpid, pid, &result.status, 0); !r) {
    // Not this process's child any more (ECHILD: SIGCHLD ignored, or reaped elsewhere): its
    // status is unknown, and the output alone decides (status 0).
    GPUQ_LOG_WARN("%s: %s", argv_in[0].c_str(), r.error().message().c_str());
    result.status = 0;
  }
  if (!poll_failure.empty()) return Error(ErrorCode::kInternal, poll_failure);
  if (timed_out) {
    return Error(ErrorCode::kTimeout,
                 "did not finish within " + std::to_string(timeout_ms) + " ms");
  }
  while (!result.err.empty() && (result.err.back() == '\n' || result.err.back() == '\r')) {
    result.err.pop_back();
  }
  return result;
}

}  // namespace gpuq::daemon
