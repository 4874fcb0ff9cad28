// DaemonProcess: the real gpuqd binary, started for one integration test and torn down after it.
//
//   gpuq::test::DaemonProcess daemon(R"({"pools":[{"name":"cpu","workers":1}]})");
//   auto client = gpuq::Client::connect({.runtime_dir = daemon.runtime_dir()});
//   ...
//   CHECK(daemon.terminate().ok());  // SIGTERM drains; exit status 0
//
// The constructor makes a fresh runtime directory (mkdtemp, short enough for a socket path),
// writes the config there, spawns gpuqd with its stdout and stderr sent to a log file in that
// directory, and waits (up to 10 s, polling the state, never a fixed sleep) until every worker of
// every pool reports "ready" in the status document. If the daemon exits or does not get ready
// in time, the constructor fails the current doctest test case (FAIL, which throws) with the
// daemon's log.
//
// The destructor stops a daemon that still runs (SIGTERM, then SIGKILL after a short grace),
// fails the test if the log holds a sanitizer report (ASan, UBSan, TSan, LSan: the daemon and
// its workers are built with the same sanitizer as the test), removes a queue segment a killed
// daemon left in /dev/shm, and removes the directory. The log of every daemon a test case used is
// printed when that test case fails. If the test executable itself dies (a crash, a ctest
// timeout), the daemon gets SIGTERM (PR_SET_PDEATHSIG) and drains; only its directory, with the
// log, is left behind.
//
// Test-only code; use from the main thread of a doctest test case. Not thread-safe.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "support/test_support.hpp"

namespace gpuq::test {

// How long the constructor waits for the daemon's workers to get ready.
inline constexpr std::chrono::seconds kDaemonReadyTimeout{10};

// Polls `pred` until it holds or `timeout` passes; returns its last value (a chrono-typed
// spelling of test_support's wait_until).
template <typename Pred>
bool wait_until(Pred&& pred, std::chrono::nanoseconds timeout) {
  return wait_until(std::forward<Pred>(pred), static_cast<uint64_t>(timeout.count()));
}

struct DaemonOptions {
  // Config document; empty: gpuqd runs without --config (built-in defaults).
  std::string config_json;
  enum class Readiness {
    kWorkersReady,  // every worker of every pool is "ready" in the status document
    kAnswering,     // the socket answers a status request at all, even with an error (a daemon
                    // that refuses this test's own user)
  };
  Readiness readiness = Readiness::kWorkersReady;
  // Extra "KEY=VALUE" entries added to (or replacing those of) the daemon's environment.
  std::vector<std::string> env;
  // Adds WATCHDOG_PID=<gpuqd's own pid> to its environment, as systemd does for the main process
  // of a unit with WatchdogSec= (tests/systemd).
  bool set_watchdog_pid = false;
  // The gpuqd to run; empty: the build's (gpuqd_path()). A copy elsewhere finds its workers
  // next to itself, so a test can leave one out.
  std::string gpuqd = {};
};

class DaemonProcess {
 public:
  explicit DaemonProcess(DaemonOptions options = {});
  explicit DaemonProcess(std::string config_json)
      : DaemonProcess(DaemonOptions{std::move(config_json), {}, {}}) {}
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;
  ~DaemonProcess();

  // The runtime directory given to gpuqd (--runtime-dir): pass it to ConnectOptions.
  const std::string& runtime_dir() const noexcept { return handle_.dir; }
  // "<runtime_dir>/gpuqd.sock".
  std::string socket_path() const;
  pid_t pid() const noexcept { return handle_.pid; }
  // True until the daemon has been reaped (by terminate() or wait_exit()).
  bool running() const noexcept { return handle_.pid > 0 && !handle_.reaped; }

  // The status document (gpuq::daemon_status_json), parsed. Fails the test case (FAIL, throws)
  // if the daemon does not answer or the document is not JSON.
  nlohmann::json status() const;
  // The pids of the workers of every pool (or of pool `pool` when not empty), from status().
  std::vector<pid_t> worker_pids(const std::string& pool = {}) const;

  // Sends `signal` to gpuqd. False if it has already been reaped or kill() failed.
  bool send_signal(int signal);
  // SIGKILLs gpuqd (its workers are left to notice) and starts a new one with the same
  // options in the same runtime directory, over whatever the old one left there. Returns when
  // the new one is ready.
  void kill_and_restart();
  // Waits up to `timeout` for gpuqd to exit and reaps it; on timeout it is killed (SIGKILL) and
  // the result says timed_out. Safe to call again: returns the first result.
  ChildExit wait_exit(std::chrono::nanoseconds timeout = std::chrono::seconds(30));
  // SIGTERM (drain), then wait_exit(timeout).
  ChildExit terminate(std::chrono::nanoseconds timeout = std::chrono::seconds(30));

  // Everything gpuqd (and, through it, its workers) wrote to stdout and stderr so far.
  std::string log() const;

 private:
  // Owns the process and the directory, so that they are cleaned up even when the constructor
  // fails the test (a throwing constructor runs the destructors of finished members only).
  struct Handle {
    std::string dir;
    std::string log_path;
    pid_t pid = 0;
    bool reaped = false;
    ChildExit exit;
    ~Handle();
  };

  void start(const DaemonOptions& options);
  // Starts gpuqd in handle_.dir and waits until it is ready.
  void launch(const DaemonOptions& options);
  // Empty when the daemon's workers are ready (per `readiness`), else why not yet.
  std::string readiness_problem(DaemonOptions::Readiness readiness) const;

  Handle handle_;
  DaemonOptions options_;
};

// Path of a binary of the build, from the compile definitions GPUQ_TEST_GPUQD and
// GPUQ_TEST_GPUQCTL.
const char* gpuqd_path();
const char* gpuqctl_path();

// Runs `command` through the shell (popen) and returns its exit status and its stdout.
struct CommandResult {
  int exit_code = -1;  // -1: did not exit normally
  std::string output;
};
CommandResult run_command(const std::string& command);

}  // namespace gpuq::test
