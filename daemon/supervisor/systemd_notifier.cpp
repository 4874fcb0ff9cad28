// The libsystemd-backed ServiceNotifier (service_notifier.hpp). Linked into gpuqd only: the
// worker and the tests of the daemon core do not depend on libsystemd.
#include <cstdlib>
#include <cstring>
#include <string>

#include "gpuq/common/log.hpp"
#include "gpuq/common/posix_call.hpp"
#include "service_notifier.hpp"

#if GPUQ_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

namespace gpuq::daemon {
namespace {

#if GPUQ_HAVE_SYSTEMD

// STATUS= ends at the line's end: keep a status to one line.
std::string one_line(const std::string& s) {
  std::string out = s;
  for (char& c : out) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return out;
}

class SystemdNotifier final : public ServiceNotifier {
 public:
  SystemdNotifier() {
    const char* socket = std::getenv("NOTIFY_SOCKET");
    active_ = socket != nullptr && *socket != '\0';
    uint64_t usec = 0;
    auto enabled = GPUQ_NEG_ERRNO_CALL(sd_watchdog_enabled, 0, &usec);
    if (!enabled) {
      GPUQ_LOG_ERROR("WATCHDOG_USEC/WATCHDOG_PID are malformed (%s): no watchdog keep-alives",
                     enabled.error().message().c_str());
    } else if (*enabled > 0) {
      if (!active_) {
        GPUQ_LOG_WARN("WATCHDOG_USEC is set but NOTIFY_SOCKET is not: no watchdog keep-alives");
      } else {
        watchdog_interval_ns_ = usec * 1000 / 2;  // ping at half the timeout
        if (watchdog_interval_ns_ == 0) watchdog_interval_ns_ = 1;
        GPUQ_LOG_INFO("watchdog: timeout %llu ms, keep-alive every %llu ms",
                      static_cast<unsigned long long>(usec / 1000),
                      static_cast<unsigned long long>(watchdog_interval_ns_ / 1'000'000));
      }
    }
  }

  bool active() const override { return active_; }
  void ready(const std::string& status) override {
    send(("READY=1\nSTATUS=" + one_line(status)).c_str(), failed_ready_);
  }
  void status(const std::string& status) override {
    send(("STATUS=" + one_line(status)).c_str(), failed_status_);
  }
  void stopping(const std::string& status) override {
    send(("STOPPING=1\nSTATUS=" + one_line(status)).c_str(), failed_stopping_);
  }
  void watchdog() override { send("WATCHDOG=1", failed_watchdog_); }
  uint64_t watchdog_interval_ns() const override { return watchdog_interval_ns_; }

 private:
  // Logs the first failure of each kind only: a keep-alive every few seconds must not flood
  // the journal when the socket has gone away.
  void send(const char* state, bool& failed_before) {
    if (!active_) return;
    auto sent = GPUQ_NEG_ERRNO_CALL(sd_notify, 0, state);
    if (!sent && !failed_before) {
      failed_before = true;
      GPUQ_LOG_ERROR("%s, sending \"%.*s\"", sent.error().message().c_str(),
                     static_cast<int>(std::strcspn(state, "\n")), state);
    }
  }

  bool active_ = false;
  uint64_t watchdog_interval_ns_ = 0;
  bool failed_ready_ = false, failed_status_ = false, failed_stopping_ = false,
       failed_watchdog_ = false;
};

#else  // !GPUQ_HAVE_SYSTEMD

class SystemdNotifier final : public ServiceNotifier {
 public:
  SystemdNotifier() {
    const char* socket = std::getenv("NOTIFY_SOCKET");
    if (socket != nullptr && *socket != '\0') {
      GPUQ_LOG_ERROR(
          "NOTIFY_SOCKET is set, but this gpuqd was built without libsystemd: it cannot send "
          "READY=1, so a Type=notify unit will time out (rebuild with libsystemd-dev)");
    }
  }
  bool active() const override { return false; }
  void ready(const std::string&) override {}
  void status(const std::string&) override {}
  void stopping(const std::string&) override {}
  void watchdog() override {}
  uint64_t watchdog_interval_ns() const override { return 0; }
};

#endif

}  // namespace

std::unique_ptr<ServiceNotifier> make_systemd_notifier() {
  return std::make_unique<SystemdNotifier>();
}

}  // namespace gpuq::daemon
