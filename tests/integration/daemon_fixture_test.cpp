// The integration tests' own harness: DaemonProcess cleans up after itself and turns a sanitizer
// report in the daemon's log into a test failure.
#include <signal.h>
#include <sys/stat.h>

#include <fstream>

#include "integration/integration_support.hpp"

namespace gpuq::test {
namespace {

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

bool process_gone(pid_t pid) {
  return ::kill(pid, 0) != 0 && errno == ESRCH;
}

TEST_CASE("DaemonProcess: ready on return, gone without a trace after") {
  pid_t pid = 0;
  std::vector<pid_t> workers;
  std::string dir, segment;
  {
    DaemonProcess daemon(one_pool_config(2));
    pid = daemon.pid();
    dir = daemon.runtime_dir();
    CHECK(dir.size() + sizeof("/gpuqd.sock") < 108);  // fits a Unix socket address
    CHECK(daemon.running());
    const nlohmann::json s = daemon.status();
    CHECK(s["pools"][0]["workers_ready"] == 2);
    workers = daemon.worker_pids();
    REQUIRE(workers.size() == 2);
    std::ifstream(dir + "/queue-segment") >> segment;
    REQUIRE(segment.rfind("gpuq-", 0) == 0);
    CHECK(exists("/dev/shm/" + segment));
    CHECK(exists(daemon.socket_path()));
    CHECK(daemon.log().find("serving") != std::string::npos);
  }
  CHECK(process_gone(pid));
  for (pid_t w : workers) CHECK(wait_until([&] { return process_gone(w); }, 10s));
  CHECK_FALSE(exists(dir));
  CHECK_FALSE(exists("/dev/shm/" + segment));
}

TEST_CASE("DaemonProcess: a killed daemon's queue segment is removed too") {
  std::string segment;
  {
    DaemonProcess daemon(one_pool_config(1));
    std::ifstream(daemon.runtime_dir() + "/queue-segment") >> segment;
    REQUIRE(segment.rfind("gpuq-", 0) == 0);
    REQUIRE(daemon.send_signal(SIGKILL));
    const ChildExit exit = daemon.wait_exit(10s);
    CHECK(exit.signal == SIGKILL);
    CHECK(exists("/dev/shm/" + segment));  // nobody removed it yet
  }
  CHECK_FALSE(exists("/dev/shm/" + segment));
}

TEST_CASE("DaemonProcess: terminate drains and reports exit status 0") {
  DaemonProcess daemon(one_pool_config(1));
  const ChildExit exit = daemon.terminate();
  CHECK(exit.ok());
  CHECK_FALSE(daemon.running());
  CHECK(daemon.log().find("stopped") != std::string::npos);
}

// The fixture must fail this test: the daemon's log holds a sanitizer report.
TEST_CASE("DaemonProcess: a sanitizer report in the daemon's log fails the test" *
          doctest::should_fail()) {
  DaemonProcess daemon(one_pool_config(1));
  std::ofstream(daemon.runtime_dir() + "/gpuqd.log", std::ios::app)
      << "==1==ERROR: AddressSanitizer: heap-use-after-free (injected by the test)\n";
}

}  // namespace
}  // namespace gpuq::test
