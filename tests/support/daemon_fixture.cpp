#include "support/daemon_fixture.hpp"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <doctest/doctest.h>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <mutex>
#include <sstream>

#include "gpuq/client.hpp"

#if !defined(GPUQ_TEST_GPUQD) || !defined(GPUQ_TEST_GPUQCTL)
#error "build with -DGPUQ_TEST_GPUQD=<path of gpuqd> -DGPUQ_TEST_GPUQCTL=<path of gpuqctl>"
#endif

extern char** environ;

namespace gpuq::test {
namespace {

// Grace a still-running daemon gets to drain when the fixture is destroyed, before SIGKILL.
constexpr uint64_t kTeardownGraceNs = 5 * kSecond;
// Most of a daemon's log that a failed test case prints (its tail).
constexpr size_t kMaxPrintedLog = 48 * 1024;

// What a sanitizer writes when it finds something (the daemon and its workers are built with the
// sanitizer the tests are built with; a worker's stderr reaches the daemon's log line by line).
constexpr const char* kSanitizerMarkers[] = {
    "ERROR: AddressSanitizer",  "ERROR: LeakSanitizer",   "runtime error:",
    "WARNING: ThreadSanitizer", "ERROR: ThreadSanitizer",
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string tail(const std::string& text, size_t bytes) {
  if (text.size() <= bytes) return text;
  return "[... " + std::to_string(text.size() - bytes) + " bytes cut ...]\n" +
         text.substr(text.size() - bytes);
}

// The logs of the daemons the current test case has used, printed if it fails (see the listener
// below). Filled by ~Handle, which runs before the test case ends.
std::mutex g_logs_mutex;
std::vector<std::string> g_logs;

void record_log(const std::string& dir, const std::string& text) {
  std::lock_guard<std::mutex> lock(g_logs_mutex);
  g_logs.push_back("---- gpuqd log (" + dir + ") ----\n" + tail(text, kMaxPrintedLog) +
                   (text.empty() || text.back() == '\n' ? "" : "\n") +
                   "---- end of gpuqd log ----\n");
}

// A doctest listener: prints the daemon logs of a test case that failed.
struct DaemonLogListener : public doctest::IReporter {
  explicit DaemonLogListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData&) override {
    std::lock_guard<std::mutex> lock(g_logs_mutex);
    g_logs.clear();
  }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats& stats) override {
    std::lock_guard<std::mutex> lock(g_logs_mutex);
    if (!stats.testCaseSuccess) {
      for (const auto& log : g_logs) std::cerr << log;
      std::cerr.flush();
    }
    g_logs.clear();
  }
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};

}  // namespace
}  // namespace gpuq::test

DOCTEST_REGISTER_LISTENER("gpuq_daemon_logs", 1, gpuq::test::DaemonLogListener);

namespace gpuq::test {

const char* gpuqd_path() {
  return GPUQ_TEST_GPUQD;
}
const char* gpuqctl_path() {
  return GPUQ_TEST_GPUQCTL;
}

CommandResult run_command(const std::string& command) {
  CommandResult result;
  std::fflush(stdout);
  std::fflush(stderr);
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) result.output.append(buffer, n);
  const int status = ::pclose(pipe);
  if (status != -1 && WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  return result;
}

DaemonProcess::Handle::~Handle() {
  if (dir.empty()) return;
  if (pid > 0 && !reaped) {
    ::kill(pid, SIGTERM);
    exit = wait_child(pid, kTeardownGraceNs);  // SIGKILLs it if it does not drain in time
    reaped = true;
  }
  const std::string text = read_file(log_path);
  for (const char* marker : kSanitizerMarkers) {
    if (text.find(marker) != std::string::npos) {
      FAIL_CHECK("gpuqd or one of its workers reported '" << std::string(marker) << "' (log of "
                                                          << dir << " below)\n"
                                                          << tail(text, kMaxPrintedLog));
      break;
    }
  }
  record_log(dir, text);
  // A daemon that was killed leaves its queue segment in /dev/shm: remove it.
  std::string segment = read_file(dir + "/queue-segment");
  segment = segment.substr(0, segment.find('\n'));
  if (segment.rfind("gpuq-", 0) == 0) ::shm_unlink(("/" + segment).c_str());
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

DaemonProcess::DaemonProcess(DaemonOptions options) {
  start(options);
}

DaemonProcess::~DaemonProcess() = default;

void DaemonProcess::start(const DaemonOptions& options) {
  char dir_template[] = "/tmp/gpuqt-XXXXXX";
  if (::mkdtemp(dir_template) == nullptr) {
    FAIL("mkdtemp: " << std::strerror(errno));
  }
  handle_.dir = dir_template;
  handle_.log_path = handle_.dir + "/gpuqd.log";
  options_ = options;
  launch(options);
}

void DaemonProcess::kill_and_restart() {
  if (running()) {
    ::kill(handle_.pid, SIGKILL);
    handle_.exit = wait_child(handle_.pid, kTeardownGraceNs);
    handle_.reaped = true;
  }
  handle_.pid = 0;
  handle_.reaped = false;
  handle_.exit = {};
  launch(options_);
}

void DaemonProcess::launch(const DaemonOptions& options) {
  std::vector<std::string> args = {options.gpuqd.empty() ? gpuqd_path() : options.gpuqd,
                                   "--runtime-dir", handle_.dir};
  if (!options.config_json.empty()) {
    const std::string config_path = handle_.dir + "/config.json";
    std::ofstream(config_path) << options.config_json << "\n";
    args.push_back("--config");
    args.push_back(config_path);
  }
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string key = entry.substr(0, entry.find('=') + 1);
    bool replaced = options.set_watchdog_pid && key == "WATCHDOG_PID=";
    for (const auto& extra : options.env) replaced = replaced || extra.rfind(key, 0) == 0;
    if (!replaced) env.push_back(entry);
  }
  env.insert(env.end(), options.env.begin(), options.env.end());
  // WATCHDOG_PID's value is the child's pid: the child writes it in place after fork.
  constexpr size_t kPidOffset = sizeof "WATCHDOG_PID=" - 1;
  if (options.set_watchdog_pid) env.push_back("WATCHDOG_PID=" + std::string(24, '\0'));

  // Everything the child needs is prepared before fork: after it, only async-signal-safe calls.
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  const int log_fd =
      ::open(handle_.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (log_fd < 0) FAIL("open " << handle_.log_path << ": " << std::strerror(errno));
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const pid_t parent = ::getpid();
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    // The daemon must not outlive a test executable that crashes or is killed (a ctest
    // timeout): SIGTERM, so that it drains and removes its queue segment and socket itself.
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(127);
    if (options.set_watchdog_pid) {
      char digits[24];
      int n = 0;
      for (pid_t v = ::getpid(); v > 0 && n < 23; v /= 10)
        digits[n++] = static_cast<char>('0' + v % 10);
      char* out = envp[env.size() - 1] + kPidOffset;
      while (n > 0) *out++ = digits[--n];
      *out = '\0';
    }
    ::dup2(null_fd, 0);
    ::dup2(log_fd, 1);
    ::dup2(log_fd, 2);
    ::execve(argv[0], argv.data(), envp.data());
    static const char msg[] = "daemon_fixture: execve of gpuqd failed\n";
    ssize_t ignored = ::write(2, msg, sizeof msg - 1);
    (void)ignored;
    ::_exit(127);
  }
  ::close(log_fd);
  if (null_fd >= 0) ::close(null_fd);
  if (pid < 0) FAIL("fork: " << std::strerror(errno));
  handle_.pid = pid;

  // Wait on the state itself: poll the status document, and notice an early exit.
  const uint64_t deadline =
      monotonic_ns() +
      static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(kDaemonReadyTimeout).count());
  std::string problem;
  for (;;) {
    int status = 0;
    pid_t r;
    do {
      r = ::waitpid(pid, &status, WNOHANG);
    } while (r == -1 && errno == EINTR);
    if (r == pid) {
      handle_.reaped = true;
      handle_.exit.reaped = true;
      handle_.exit.exited = WIFEXITED(status);
      handle_.exit.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      handle_.exit.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
      FAIL("gpuqd " << handle_.exit.describe() << " while starting (" << handle_.dir
                    << "); its log:\n"
                    << log());
    }
    problem = readiness_problem(options.readiness);
    if (problem.empty()) return;
    if (monotonic_ns() >= deadline) break;
    timespec nap{0, 2'000'000};  // 2 ms between status requests
    ::nanosleep(&nap, nullptr);
  }
  FAIL("gpuqd (pid " << pid << ", " << handle_.dir << ") not ready after "
                     << kDaemonReadyTimeout.count() << " s: " << problem << "; its log:\n"
                     << log());
}

std::string DaemonProcess::readiness_problem(DaemonOptions::Readiness readiness) const {
  auto text = gpuq::daemon_status_json(handle_.dir);
  if (!text) {
    if (readiness == DaemonOptions::Readiness::kAnswering &&
        text.error().code() != ErrorCode::kDisconnected) {
      return {};  // it answered, if only to refuse
    }
    return "status: " + text.error().to_string();
  }
  if (readiness == DaemonOptions::Readiness::kAnswering) return {};
  nlohmann::json doc = nlohmann::json::parse(text.value(), nullptr, false);
  if (doc.is_discarded() || !doc.contains("pools") || !doc["pools"].is_array() ||
      doc["pools"].empty()) {
    return "status document has no pools: " + text.value();
  }
  for (const auto& pool : doc["pools"]) {
    if (!pool.contains("workers") || !pool["workers"].is_array() || pool["workers"].empty()) {
      return "pool without workers in the status document";
    }
    for (const auto& w : pool["workers"]) {
      if (w.value("state", std::string()) != "ready") {
        return "pool " + pool.value("name", std::string("?")) + " worker " +
               w.value("id", nlohmann::json()).dump() + " is " + w.value("state", std::string("?"));
      }
    }
  }
  return {};
}

std::string DaemonProcess::socket_path() const {
  return handle_.dir + "/gpuqd.sock";
}

nlohmann::json DaemonProcess::status() const {
  auto text = gpuq::daemon_status_json(handle_.dir);
  if (!text) FAIL("daemon_status_json(" << handle_.dir << "): " << text.error().to_string());
  nlohmann::json doc = nlohmann::json::parse(text.value(), nullptr, false);
  if (doc.is_discarded()) FAIL("the status document is not JSON: " << text.value());
  return doc;
}

std::vector<pid_t> DaemonProcess::worker_pids(const std::string& pool) const {
  std::vector<pid_t> pids;
  const nlohmann::json doc = status();
  for (const auto& p : doc.at("pools")) {
    if (!pool.empty() && p.at("name") != pool) continue;
    for (const auto& w : p.at("workers")) pids.push_back(w.at("pid").get<pid_t>());
  }
  return pids;
}

bool DaemonProcess::send_signal(int signal) {
  if (!running()) return false;
  return ::kill(handle_.pid, signal) == 0;
}

ChildExit DaemonProcess::wait_exit(std::chrono::nanoseconds timeout) {
  if (handle_.pid <= 0 || handle_.reaped) return handle_.exit;
  handle_.exit = wait_child(handle_.pid, static_cast<uint64_t>(timeout.count()));
  handle_.reaped = true;
  return handle_.exit;
}

ChildExit DaemonProcess::terminate(std::chrono::nanoseconds timeout) {
  send_signal(SIGTERM);
  return wait_exit(timeout);
}

std::string DaemonProcess::log() const {
  return read_file(handle_.log_path);
}

}  // namespace gpuq::test
