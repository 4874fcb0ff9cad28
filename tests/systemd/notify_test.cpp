// Integration: gpuqd's side of systemd's notification protocol (docs/service.md), against a real
// NOTIFY_SOCKET this test binds, as the service manager would: READY=1 only once every pool is
// up, STATUS= with the pools' capacity, STOPPING=1 on SIGTERM, WATCHDOG=1 at half of
// WATCHDOG_USEC from the event loop, and none while the loop is stuck (the SIGUSR2 test hook).
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <poll.h>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "integration/integration_support.hpp"

namespace gpuq::test {
namespace {

// One datagram from gpuqd: newline-separated assignments ("READY=1\nSTATUS=...").
struct Notification {
  uint64_t at_ns = 0;  // when it arrived (monotonic)
  std::string text;

  bool has(std::string_view assignment) const {
    size_t start = 0;
    while (start <= text.size()) {
      size_t end = text.find('\n', start);
      if (end == std::string::npos) end = text.size();
      if (std::string_view(text).substr(start, end - start) == assignment) return true;
      start = end + 1;
    }
    return false;
  }
  // The value of `key` ("STATUS"), or nullopt.
  std::optional<std::string> value(const std::string& key) const {
    size_t start = 0;
    while (start <= text.size()) {
      size_t end = text.find('\n', start);
      if (end == std::string::npos) end = text.size();
      std::string line = text.substr(start, end - start);
      if (line.rfind(key + "=", 0) == 0) return line.substr(key.size() + 1);
      start = end + 1;
    }
    return std::nullopt;
  }
};

// The service manager's end: a datagram socket in a fresh directory; gpuqd gets its path as
// NOTIFY_SOCKET. Keeps every notification with its arrival time.
class NotifyListener {
 public:
  NotifyListener() {
    char dir[] = "/tmp/gpuqn-XXXXXX";
    REQUIRE_MESSAGE(::mkdtemp(dir) != nullptr, "mkdtemp: " << std::strerror(errno));
    dir_ = dir;
    path_ = dir_ + "/notify";
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    REQUIRE_MESSAGE(fd_ >= 0, "socket: " << std::strerror(errno));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path_.c_str(), path_.size() + 1);
    REQUIRE_MESSAGE(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0,
                    "bind " << path_ << ": " << std::strerror(errno));
  }
  ~NotifyListener() {
    if (fd_ >= 0) ::close(fd_);
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  NotifyListener(const NotifyListener&) = delete;
  NotifyListener& operator=(const NotifyListener&) = delete;

  std::string env() const { return "NOTIFY_SOCKET=" + path_; }
  const std::vector<Notification>& received() const { return received_; }

  // Receives until a notification satisfies `pred` (returned) or `timeout` passes (nullopt).
  std::optional<Notification> wait_for(const std::function<bool(const Notification&)>& pred,
                                       std::chrono::nanoseconds timeout) {
    const uint64_t deadline = monotonic_ns() + static_cast<uint64_t>(timeout.count());
    for (;;) {
      const uint64_t now = monotonic_ns();
      if (now >= deadline) return std::nullopt;
      if (auto n = receive_one(deadline - now); n && pred(*n)) return n;
    }
  }
  std::optional<Notification> wait_for(std::string_view assignment,
                                       std::chrono::nanoseconds timeout) {
    return wait_for([&](const Notification& n) { return n.has(assignment); }, timeout);
  }
  // Receives whatever arrives during `duration`.
  void collect(std::chrono::nanoseconds duration) {
    const uint64_t deadline = monotonic_ns() + static_cast<uint64_t>(duration.count());
    for (uint64_t now = monotonic_ns(); now < deadline; now = monotonic_ns()) {
      receive_one(deadline - now);
    }
  }
  // Arrival times of the WATCHDOG=1 notifications received in [from_ns, to_ns).
  std::vector<uint64_t> pings(uint64_t from_ns, uint64_t to_ns = UINT64_MAX) const {
    std::vector<uint64_t> t;
    for (const auto& n : received_) {
      if (n.has("WATCHDOG=1") && n.at_ns >= from_ns && n.at_ns < to_ns) t.push_back(n.at_ns);
    }
    return t;
  }
  size_t count(std::string_view assignment) const {
    return static_cast<size_t>(std::count_if(received_.begin(), received_.end(),
                                             [&](const auto& n) { return n.has(assignment); }));
  }
  std::string transcript() const {
    std::string s;
    for (const auto& n : received_) {
      std::string t = n.text;
      std::replace(t.begin(), t.end(), '\n', '|');
      s.append("  ")
          .append(std::to_string(n.at_ns / 1'000'000))
          .append(" ms: ")
          .append(t)
          .append("\n");
    }
    return s;
  }

 private:
  std::optional<Notification> receive_one(uint64_t timeout_ns) {
    pollfd p{fd_, POLLIN, 0};
    const int ms = static_cast<int>(std::min<uint64_t>(timeout_ns / 1'000'000 + 1, 1000));
    if (::poll(&p, 1, ms) <= 0) return std::nullopt;
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, MSG_DONTWAIT);
    if (n <= 0) return std::nullopt;
    received_.push_back({monotonic_ns(), std::string(buf, static_cast<size_t>(n))});
    return received_.back();
  }

  std::string dir_, path_;
  int fd_ = -1;
  std::vector<Notification> received_;
};

constexpr uint64_t kMs = kMillisecond;

DaemonOptions notify_options(const NotifyListener& listener, std::string config,
                             std::vector<std::string> env) {
  DaemonOptions o;
  o.config_json = std::move(config);
  // The fixture must not wait for the workers: READY=1 is what this test watches.
  o.readiness = DaemonOptions::Readiness::kAnswering;
  o.env = std::move(env);
  o.env.push_back(listener.env());
  return o;
}

// The workers' states from the status document, "ready,failed".
std::string worker_states(const DaemonProcess& daemon) {
  std::string states;
  const nlohmann::json status = daemon.status();
  for (const auto& pool : status.at("pools")) {
    for (const auto& w : pool.at("workers")) {
      if (!states.empty()) states += ',';
      states += w.at("state").get<std::string>();
    }
  }
  return states;
}

TEST_CASE("notify: READY=1 once every worker is ready, STATUS= with capacity, STOPPING=1") {
  NotifyListener listener;
  // Each worker sleeps 300 ms before it starts: READY=1 must wait for them.
  const uint64_t t0 = monotonic_ns();
  DaemonProcess daemon(notify_options(
      listener, one_pool_config(2), {"GPUQ_TEST_HOOKS=1", "GPUQ_TEST_WORKER_START_DELAY_MS=300"}));

  auto ready = listener.wait_for("READY=1", 30s);
  REQUIRE_MESSAGE(ready, "no READY=1 in 30 s; received:\n" << listener.transcript());
  CHECK(worker_states(daemon) == "ready,ready");
  CHECK(ready->at_ns - t0 >= 300 * kMs);
  CHECK(ready->value("STATUS") == std::optional<std::string>("ready: cpu 2/2 ready, ring 20"));
  // The daemon logs in order: both workers reported ready before it notified, none after.
  const std::string log = daemon.log();
  const size_t notified = log.find("notifying READY=1");
  REQUIRE(notified != std::string::npos);
  size_t ready_lines = 0;
  for (size_t at = log.find(") is ready"); at < notified; at = log.find(") is ready", at + 1)) {
    ++ready_lines;
  }
  CHECK(ready_lines == 2);
  CHECK(log.find(") is ready", notified) == std::string::npos);
  // Before READY=1, STATUS= said it was starting.
  bool starting_seen = false;
  for (const auto& n : listener.received()) {
    if (n.at_ns >= ready->at_ns) break;
    CHECK_FALSE(n.has("READY=1"));
    if (auto s = n.value("STATUS")) starting_seen = starting_seen || s->rfind("starting: ", 0) == 0;
  }
  CHECK(starting_seen);

  REQUIRE(daemon.send_signal(SIGTERM));
  auto stopping = listener.wait_for("STOPPING=1", 30s);
  REQUIRE_MESSAGE(stopping, "no STOPPING=1 after SIGTERM; received:\n" << listener.transcript());
  CHECK(stopping->value("STATUS").value_or("").rfind("draining (SIGTERM): cpu 2/2 ready", 0) == 0);
  const ChildExit exit = daemon.wait_exit(30s);
  CHECK_MESSAGE(exit.ok(), "gpuqd " << exit.describe());
  listener.collect(50ms);
  CHECK(listener.count("READY=1") == 1);
}

TEST_CASE(
    "notify: a pool whose workers keep failing to start is up, and STATUS= says it is degraded "
    "or down, then failing its jobs") {
  NotifyListener listener;
  // A failed worker is tried again after the start back-off: a minute here, so that it stays
  // `failed` (not `starting`) while the test looks.
  const std::string config = one_pool_config(2, {{"max_start_failures", 2},
                                                 {"restart_backoff_initial_ms", 10},
                                                 {"start_backoff_initial_ms", 60000},
                                                 {"pool_down_fail_ms", 500}});
  SUBCASE("one worker of two fails") {
    DaemonProcess daemon(
        notify_options(listener, config, {"GPUQ_TEST_HOOKS=1", "GPUQ_TEST_WORKER_FAIL=1"}));
    auto ready = listener.wait_for("READY=1", 30s);
    REQUIRE_MESSAGE(ready, "no READY=1 in 30 s; received:\n" << listener.transcript());
    CHECK(worker_states(daemon) == "ready,failed");
    CHECK(ready->value("STATUS") ==
          std::optional<std::string>("degraded: cpu 1/2 ready, 1 failed, ring 20"));
  }
  SUBCASE("every worker fails") {
    DaemonProcess daemon(
        notify_options(listener, config, {"GPUQ_TEST_HOOKS=1", "GPUQ_TEST_WORKER_FAIL=0,1"}));
    auto ready = listener.wait_for("READY=1", 30s);
    REQUIRE_MESSAGE(ready, "no READY=1 in 30 s; received:\n" << listener.transcript());
    CHECK(worker_states(daemon) == "failed,failed");
    // READY=1 at the second failure of the second worker, within pool_down_fail_ms of the
    // first failure; the pool's jobs fail from then on, and STATUS= says so.
    const std::optional<std::string> status = ready->value("STATUS");
    REQUIRE(status.has_value());
    CHECK((status == std::optional<std::string>("down: cpu 0/2 ready, 2 failed, ring 20") ||
           status ==
               std::optional<std::string>("down: cpu 0/2 ready, 2 failed, failing jobs, ring 20")));
    if (status->find("failing jobs") == std::string::npos) {
      auto failing =
          listener.wait_for("STATUS=down: cpu 0/2 ready, 2 failed, failing jobs, ring 20", 10s);
      CHECK_MESSAGE(failing, "no STATUS= with failing jobs; received:\n" << listener.transcript());
    }
  }
}

#ifdef GPUQ_TEST_PLUGIN
TEST_CASE(
    "notify: workers stuck on jobs past their time limit make STATUS= say so, until replaced") {
  NotifyListener listener;
  const std::string config = one_pool_config(
      2, {{"cancel_grace_ms", 1500}, {"plugins", nlohmann::json::array({GPUQ_TEST_PLUGIN})}});
  DaemonProcess daemon(notify_options(listener, config, {}));
  auto ready = listener.wait_for("READY=1", 30s);
  REQUIRE_MESSAGE(ready, "no READY=1 in 30 s; received:\n" << listener.transcript());
  auto client = Client::connect(connect_options(daemon.runtime_dir()));
  REQUIRE(client.ok());
  std::vector<Job> jobs;
  for (int i = 0; i < 2; ++i) {
    JobSpec spin;
    spin.op = "plugin_spin";  // never ends, never looks at its cancel flag
    spin.time_limit = 200ms;
    auto job = client->submit(spin);
    REQUIRE(job.ok());
    jobs.push_back(std::move(*job));
  }
  auto down = listener.wait_for("STATUS=down: cpu 0/2 ready, 2 stuck, ring 20", 10s);
  REQUIRE_MESSAGE(down, "no STATUS= with 2 stuck; received:\n" << listener.transcript());
  // Stopped after the grace and replaced: ready again, READY=1 not sent a second time.
  auto again = listener.wait_for("STATUS=ready: cpu 2/2 ready, ring 20", 30s);
  REQUIRE_MESSAGE(again, "not ready again; received:\n" << listener.transcript());
  CHECK(again->at_ns > down->at_ns);
  for (Job& j : jobs) {
    auto r = j.wait(10s);
    REQUIRE(r.ok());
    CHECK(r->code == ErrorCode::kTimedOut);
  }
  CHECK(listener.count("READY=1") == 1);
}
#endif

TEST_CASE("watchdog: WATCHDOG=1 at half of WATCHDOG_USEC") {
  NotifyListener listener;
  DaemonOptions o = notify_options(listener, one_pool_config(1), {"WATCHDOG_USEC=1000000"});
  o.set_watchdog_pid = true;
  DaemonProcess daemon(o);
  auto ready = listener.wait_for("READY=1", 30s);
  REQUIRE_MESSAGE(ready, "no READY=1 in 30 s; received:\n" << listener.transcript());
  const uint64_t from = monotonic_ns();
  listener.collect(3s);
  const std::vector<uint64_t> pings = listener.pings(from);
  INFO("received:\n" << listener.transcript());
  // Every 500 ms: about 6 in 3 s.
  CHECK(pings.size() >= 4);
  CHECK(pings.size() <= 8);
  REQUIRE(pings.size() >= 2);
  uint64_t max_gap = 0;
  for (size_t i = 1; i < pings.size(); ++i) max_gap = std::max(max_gap, pings[i] - pings[i - 1]);
  const uint64_t mean_gap = (pings.back() - pings.front()) / (pings.size() - 1);
  CHECK(max_gap < 1000 * kMs);  // never as late as the timeout
  CHECK(mean_gap >= 400 * kMs);
  CHECK(mean_gap <= 650 * kMs);
}

TEST_CASE("watchdog: no WATCHDOG=1 while the event loop is stuck (SIGUSR2 test hook)") {
  NotifyListener listener;
  DaemonOptions o =
      notify_options(listener, one_pool_config(1),
                     {"WATCHDOG_USEC=400000", "GPUQ_TEST_HOOKS=1", "GPUQ_TEST_STALL_MS=1500"});
  o.set_watchdog_pid = true;
  DaemonProcess daemon(o);
  REQUIRE(listener.wait_for("READY=1", 30s));
  REQUIRE(listener.wait_for("WATCHDOG=1", 5s));

  const uint64_t signalled = monotonic_ns();
  REQUIRE(daemon.send_signal(SIGUSR2));
  listener.collect(2500ms);
  INFO("SIGUSR2 at " << signalled / kMs << " ms; received:\n" << listener.transcript());
  // A keep-alive already on its way when the signal came may arrive in the first moments.
  CHECK(listener.pings(signalled + 150 * kMs, signalled + 1400 * kMs).empty());
  // Then they resume.
  const std::vector<uint64_t> after = listener.pings(signalled + 1400 * kMs);
  REQUIRE_FALSE(after.empty());
  CHECK(after.front() < signalled + 2300 * kMs);
  CHECK(daemon.log().find("stalling the event loop for 1500 ms") != std::string::npos);
  CHECK(daemon.running());
}

TEST_CASE("watchdog: none for another process's WATCHDOG_PID or a malformed WATCHDOG_USEC") {
  NotifyListener listener;
  SUBCASE("WATCHDOG_PID names another process") {
    DaemonProcess daemon(
        notify_options(listener, one_pool_config(1), {"WATCHDOG_USEC=200000", "WATCHDOG_PID=1"}));
    REQUIRE(listener.wait_for("READY=1", 30s));
    listener.collect(800ms);
    CHECK(listener.count("WATCHDOG=1") == 0);
  }
  SUBCASE("WATCHDOG_USEC is not a number") {
    DaemonOptions o = notify_options(listener, one_pool_config(1), {"WATCHDOG_USEC=soon"});
    o.set_watchdog_pid = true;
    DaemonProcess daemon(o);
    REQUIRE(listener.wait_for("READY=1", 30s));
    listener.collect(500ms);
    CHECK(listener.count("WATCHDOG=1") == 0);
    CHECK(daemon.log().find("WATCHDOG_USEC/WATCHDOG_PID are malformed") != std::string::npos);
  }
}

TEST_CASE("test hooks: a malformed value stops gpuqd with a message naming the variable") {
  const std::string gpuqd = gpuqd_path();
  for (const char* bad : {"GPUQ_TEST_STALL_MS=0", "GPUQ_TEST_STALL_MS=5s",
                          "GPUQ_TEST_WORKER_START_DELAY_MS=-1", "GPUQ_TEST_WORKER_FAIL=1,x"}) {
    CAPTURE(bad);
    const CommandResult r = run_command("env GPUQ_TEST_HOOKS=1 " + std::string(bad) + " " + gpuqd +
                                        " --runtime-dir /nonexistent/gpuq-hooks 2>&1");
    CHECK(r.exit_code == 2);
    const std::string name(bad, std::strchr(bad, '=') - bad);
    CHECK(r.output.find(name) != std::string::npos);
  }
  // Without GPUQ_TEST_HOOKS=1 the same variables are not even read.
  DaemonProcess daemon(DaemonOptions{one_pool_config(1),
                                     DaemonOptions::Readiness::kWorkersReady,
                                     {"GPUQ_TEST_STALL_MS=0", "GPUQ_TEST_WORKER_FAIL=0"}});
  CHECK(daemon.log().find("test hook") == std::string::npos);
}

}  // namespace
}  // namespace gpuq::test
