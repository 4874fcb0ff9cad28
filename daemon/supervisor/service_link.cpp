// The supervisor's link to its service manager (docs/service.md): READY=1 once every pool is up,
// STATUS= lines that follow the pools' capacity, STOPPING=1 when a drain begins, WATCHDOG=1 from
// the event loop, and the SIGUSR2 stall hook of the watchdog tests. Everything here runs on the
// event loop's thread; the notifier is options_.notifier (absent: nothing is sent). These are
// Supervisor members: they read the drain state and the status report, and own two of the
// loop's descriptors.
#include <sys/signalfd.h>
#include <sys/timerfd.h>
#include <time.h>

#include <cerrno>
#include <csignal>
#include <string>

#include "gpuq/common/clock.hpp"
#include "gpuq/common/log.hpp"
#include "gpuq/common/posix_call.hpp"
#include "supervisor.hpp"

namespace gpuq::daemon {

Result<void> Supervisor::start_service_link() {
  ServiceNotifier* n = options_.notifier.get();
  if (n != nullptr && n->watchdog_interval_ns() > 0) {
    auto fd = GPUQ_POSIX_CALL(::timerfd_create, CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (!fd) return fd.error();
    watchdog_fd_.reset(static_cast<int>(*fd));
    const uint64_t ns = n->watchdog_interval_ns();
    const timespec period{static_cast<time_t>(ns / 1'000'000'000),
                          static_cast<long>(ns % 1'000'000'000)};
    const itimerspec its{period, period};
    if (auto r = GPUQ_POSIX_CALL(::timerfd_settime, watchdog_fd_.get(), 0, &its, nullptr); !r) {
      return r.error();
    }
    n->watchdog();  // the timeout runs from the service's start: the first keep-alive at once
  }
  if (options_.test_hooks.enabled) {
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGUSR2);
    // Workers unblock every signal before exec (ForkExecLauncher).
    if (auto r = GPUQ_POSIX_CALL(::sigprocmask, SIG_BLOCK, &mask, nullptr); !r) return r.error();
    auto fd = GPUQ_POSIX_CALL(::signalfd, -1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
    if (!fd) return fd.error();
    test_hook_fd_.reset(static_cast<int>(*fd));
    GPUQ_LOG_WARN("test hooks are on (GPUQ_TEST_HOOKS=1): SIGUSR2 stalls the event loop for %u ms",
                  options_.test_hooks.stall_ms);
  }
  return {};
}

void Supervisor::on_watchdog_timer() {
  uint64_t expirations = 0;
  // EAGAIN: a stale wakeup; the keep-alive goes out all the same.
  (void)GPUQ_POSIX_CALL(::read, watchdog_fd_.get(), &expirations, sizeof expirations);
  // One keep-alive however many periods passed: a loop that was late is alive again now.
  options_.notifier->watchdog();
}

void Supervisor::on_test_hook_signal() {
  signalfd_siginfo si;
  bool stall = false;
  while (GPUQ_POSIX_CALL(::read, test_hook_fd_.get(), &si, sizeof si)) {  // until EAGAIN
    if (si.ssi_signo == SIGUSR2) stall = true;
  }
  if (!stall) return;
  const uint32_t ms = options_.test_hooks.stall_ms;
  GPUQ_LOG_WARN("test hook: SIGUSR2: stalling the event loop for %u ms", ms);
  // A monotonic deadline, so that no signal can shorten the stall.
  timespec until{};
  (void)clock_gettime(CLOCK_MONOTONIC, &until);  // cannot fail: a valid clock and pointer
  until.tv_sec += static_cast<time_t>(ms / 1000);
  until.tv_nsec += static_cast<long>(ms % 1000) * 1'000'000;
  if (until.tv_nsec >= 1'000'000'000) {
    until.tv_sec += 1;
    until.tv_nsec -= 1'000'000'000;
  }
  // clock_nanosleep returns an error number; only EINTR (a signal) ends it early.
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, nullptr) == EINTR) {
  }
  GPUQ_LOG_WARN("test hook: the event loop runs again");
}

// READY=1 once no worker is still starting or restarting: every worker is ready, or its starts
// keep failing (`failed`, after max_start_failures failed starts in a row; it is tried again
// after the start back-off, and counts as failed while it tries). A pool whose workers all
// failed is up with no capacity: the status says so ("down", and "failing jobs" once
// pool_down_fail_ms has passed), and so does `gpuqctl status`. An unavailable pool (a gpu pool that
// found no GPU) has no worker to wait for: it is settled from the start, and the service it was
// asked to give is missing, so the state is "degraded" while the other pools serve (and "down" if
// none does). After READY=1 the STATUS= line follows every change of capacity.
void Supervisor::update_service_state() {
  ServiceNotifier* n = options_.notifier.get();
  if (n == nullptr || !n->active() || draining_) return;
  const std::vector<PoolHealth> pools = status_->pool_health();
  bool settled = true;
  bool unavailable = false;
  uint32_t ready = 0, total = 0;
  for (const PoolHealth& p : pools) {
    settled = settled && p.settling == 0;
    unavailable = unavailable || p.unavailable;
    ready += p.ready;
    total += p.total;
  }
  const char* state = !ready_notified_ && !settled     ? "starting"
                      : ready == 0                     ? "down"
                      : ready == total && !unavailable ? "ready"
                                                       : "degraded";
  std::string line = std::string(state) + ": " + pools_summary(pools);
  if (!ready_notified_ && settled) {
    ready_notified_ = true;
    last_service_status_ = line;
    GPUQ_LOG_INFO("all pools are up (%s): notifying READY=1", line.c_str());
    n->ready(line);
    return;
  }
  if (line != last_service_status_) {
    last_service_status_ = line;
    n->status(line);
  }
}

void Supervisor::notify_stopping(const char* reason) {
  ServiceNotifier* n = options_.notifier.get();
  if (n == nullptr || !n->active()) return;
  n->stopping(std::string("draining (") + reason + "): " + pools_summary(status_->pool_health()));
}

}  // namespace gpuq::daemon
