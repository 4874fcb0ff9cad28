// ServiceNotifier: what gpuqd tells the service manager that started it, in systemd's
// notification protocol (sd_notify(3)): READY=1 once every pool is up, STATUS= with the pools and
// their capacity, STOPPING=1 when a drain begins, WATCHDOG=1 from the event loop while the unit
// has WatchdogSec= set. docs/service.md says when each is sent.
//
// The supervisor holds one through SupervisorOptions and calls it from its event loop only; it
// is a seam (STYLE.md, habit 11): make_systemd_notifier() gives the libsystemd implementation
// gpuqd uses, and a test can pass its own. Not thread-safe; none of its calls blocks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace gpuq::daemon {

class ServiceNotifier {
 public:
  virtual ~ServiceNotifier() = default;

  // False when no service manager listens (NOTIFY_SOCKET unset, or sd_notify compiled out):
  // the supervisor then skips building status lines. Constant over the object's life.
  virtual bool active() const = 0;
  // Start-up is complete (READY=1) and `status` describes the pools (STATUS=).
  virtual void ready(const std::string& status) = 0;
  // A one-line status for `systemctl status` (STATUS=).
  virtual void status(const std::string& status) = 0;
  // A drain has begun: the daemon accepts no new work and will exit (STOPPING=1, STATUS=).
  virtual void stopping(const std::string& status) = 0;
  // Keep-alive from the event loop (WATCHDOG=1).
  virtual void watchdog() = 0;
  // How often watchdog() must be called: half the service manager's watchdog timeout
  // (WATCHDOG_USEC), in nanoseconds; 0 when no watchdog applies to this process.
  virtual uint64_t watchdog_interval_ns() const = 0;
};

// The notifier backed by libsystemd (sd_notify, sd_watchdog_enabled). Reads NOTIFY_SOCKET,
// WATCHDOG_USEC and WATCHDOG_PID once, here. Never fails: a send error is logged (once per
// kind), a malformed WATCHDOG_USEC is logged and disables the watchdog. In a build without
// libsystemd (GPUQ_HAVE_SYSTEMD off) it is inactive, and logs an error if NOTIFY_SOCKET is set,
// since a Type=notify unit would then wait for a READY=1 that never comes.
std::unique_ptr<ServiceNotifier> make_systemd_notifier();

}  // namespace gpuq::daemon
