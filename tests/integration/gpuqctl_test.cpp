// Integration: gpuqctl against a real daemon: `submit --time-limit-ms` (checked, and a job past
// it failing TimedOut), `submit --timeout-ms` cancelling the job it gives up on, and `status`
// showing the job a busy worker runs and its pool's time limit; `ready --wait` for a daemon
// started after it; `submit --stream` printing a stream's parts as they come.
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

#include "integration/integration_support.hpp"

namespace gpuq::test {
namespace {

CommandResult gpuqctl(const DaemonProcess& daemon, const std::string& args) {
  return run_command(std::string("'") + gpuqctl_path() + "' --runtime-dir '" +
                     daemon.runtime_dir() + "' " + args + " 2>&1");
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Whether every worker of the first pool is idle, in the daemon's status.
bool all_workers_idle(const DaemonProcess& daemon) {
  const nlohmann::json status = daemon.status();  // the loop refers into it
  for (const auto& w : status["pools"][0]["workers"]) {
    if (w["busy"] == true) return false;
  }
  return true;
}

TEST_CASE("gpuqctl submit --time-limit-ms is checked, and names itself when it is wrong") {
  DaemonProcess daemon(one_pool_config(1));
  for (const char* bad : {"abc", "-5", "1.5", "4294967296", "99999999999999999999999"}) {
    INFO("--time-limit-ms " << bad);
    const CommandResult run = gpuqctl(daemon, std::string("submit noop --time-limit-ms ") + bad);
    INFO(run.output);
    CHECK(run.exit_code == 2);
    CHECK(contains(run.output, "--time-limit-ms"));
  }
  const CommandResult negative = gpuqctl(daemon, "submit noop --time-limit-ms=-5");
  CHECK(contains(negative.output, "--time-limit-ms is -5, must be in [0, 4294967295]"));
  const CommandResult missing = gpuqctl(daemon, "submit noop --time-limit-ms");
  CHECK(missing.exit_code == 2);
  CHECK(contains(missing.output, "option --time-limit-ms needs a value"));

  // 0 (no limit of the job's own) and the largest value are accepted; so is --count.
  for (const char* ok : {"0", "4294967295"}) {
    INFO("--time-limit-ms " << ok);
    const CommandResult run =
        gpuqctl(daemon, std::string("submit sleep --param us=1000 --time-limit-ms ") + ok);
    INFO(run.output);
    CHECK(run.exit_code == 0);
    CHECK(contains(run.output, "done: "));
  }
  const CommandResult load = gpuqctl(daemon, "submit noop --count 20 --time-limit-ms 60000");
  INFO(load.output);
  CHECK(load.exit_code == 0);
  CHECK(contains(load.output, "20 jobs in"));
}

TEST_CASE("gpuqctl submit --time-limit-ms: a job past its limit is stopped and fails TimedOut") {
  DaemonProcess daemon(one_pool_config(1));
  const auto start = std::chrono::steady_clock::now();
  const CommandResult run = gpuqctl(daemon, "submit sleep --param us=5000000 --time-limit-ms 200");
  const auto took = std::chrono::steady_clock::now() - start;
  INFO(run.output);
  CHECK(run.exit_code == 1);
  CHECK(contains(run.output, "failed: TimedOut"));
  CHECK(took < std::chrono::seconds(4));  // not the 5 s the op asked for

  // The same through --count: each job fails, and the run says so.
  const CommandResult load =
      gpuqctl(daemon, "submit sleep --param us=5000000 --count 2 --time-limit-ms 100");
  INFO(load.output);
  CHECK(load.exit_code == 1);
  CHECK(contains(load.output, "2 of 2 jobs failed; first: TimedOut"));
}

TEST_CASE("gpuqctl submit --stream prints each part as it comes, and writes them to --output") {
  DaemonProcess daemon(one_pool_config(1));
  const std::string file = daemon.runtime_dir() + "/parts.bin";
  const CommandResult run = gpuqctl(
      daemon, "submit count --param n=3 --param us=1000 --stream 2 --output '" + file + "'");
  INFO(run.output);
  CHECK(run.exit_code == 0);
  CHECK(contains(run.output,
                 "part 0: 8 bytes: 00 00 00 00 00 00 00 00\n"
                 "part 1: 8 bytes: 01 00 00 00 00 00 00 00\n"
                 "part 2: 8 bytes: 02 00 00 00 00 00 00 00\n"
                 "done: output 0 bytes, value 0x3"));
  std::ifstream in(file, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(bytes.size() == 24);
  CHECK((bytes.size() == 24 && bytes[8] == 1 && bytes[16] == 2));

  // A stream that fails says so after its parts (none here: its params are refused).
  const CommandResult bad = gpuqctl(daemon, "submit count --param n=-1 --stream 2");
  INFO(bad.output);
  CHECK(bad.exit_code == 1);
  CHECK(contains(bad.output, "failed: InvalidArgument"));
  for (const char* wrong : {"0", "9", "x"}) {
    const CommandResult usage = gpuqctl(daemon, std::string("submit count --stream ") + wrong);
    INFO(usage.output);
    CHECK(usage.exit_code == 2);
    CHECK(contains(usage.output, "--stream"));
  }
  const CommandResult load = gpuqctl(daemon, "submit count --stream 2 --count 3");
  CHECK(load.exit_code == 2);
  CHECK(contains(load.output, "--stream cannot be used with --count"));
}

TEST_CASE("gpuqctl submit --timeout-ms cancels a job still running, and says so") {
  DaemonProcess daemon(one_pool_config(1));
  const CommandResult run = gpuqctl(daemon, "submit sleep --param us=20000000 --timeout-ms 200");
  INFO(run.output);
  CHECK(run.exit_code == 1);
  CHECK(contains(run.output, "Timeout: the job did not finish within 200 ms"));
  CHECK(contains(run.output, "cancelled the job (it was running"));
  // sleep looks at its cancel flag: the worker is free long before the 20 s were up.
  CHECK(wait_until([&] { return all_workers_idle(daemon); }, 5s));
}

TEST_CASE("gpuqctl submit --timeout-ms cancels a job still queued, and says so") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  Job busy = submit_ok(client, sleep_spec(20'000'000));  // holds the only worker
  wait_running(busy);

  const CommandResult run = gpuqctl(daemon, "submit noop --timeout-ms 200");
  INFO(run.output);
  CHECK(run.exit_code == 1);
  CHECK(contains(run.output, "cancelled the job (it was still queued)"));

  // --count: every job left unfinished at its deadline is cancelled.
  const CommandResult load =
      gpuqctl(daemon, "submit noop --count 3 --concurrency 3 --timeout-ms 200");
  INFO(load.output);
  CHECK(load.exit_code == 1);
  CHECK(contains(load.output, "3 of 3 jobs failed; first: Timeout"));
  CHECK(contains(load.output, "cancelled the 3 jobs still queued or running at --timeout-ms"));

  REQUIRE(busy.cancel().ok());
  CHECK(wait_result(busy).status == JobStatus::kCancelled);
  check_echo_works(client);
}

TEST_CASE("gpuqctl status shows the job a busy worker runs, and its pool's time limit") {
  // The pool's limit is long: the job only has to be seen running under it.
  nlohmann::json config;
  config["pools"] = nlohmann::json::array(
      {{{"name", "cpu"}, {"kind", "cpu"}, {"workers", 1}, {"job_time_limit_ms", 60000}}});
  DaemonProcess daemon(config.dump());
  ConnectOptions options = connect_options(daemon.runtime_dir());
  options.name = "status-test";
  auto connected = Client::connect(options);
  REQUIRE_MESSAGE(connected.ok(), "connect: " << error_text(connected));
  Client client = std::move(connected).value();
  JobSpec spec = sleep_spec(20'000'000);
  spec.time_limit = std::chrono::milliseconds(30000);
  Job busy = submit_ok(client, spec);
  wait_running(busy);

  const CommandResult run = gpuqctl(daemon, "status");
  INFO(run.output);
  CHECK(run.exit_code == 0);
  CHECK(contains(run.output, "job time limit 60.000 s"));
  CHECK(contains(run.output, "JOB"));
  CHECK(contains(run.output, "sleep from client "));
  CHECK(contains(run.output, "\"status-test\""));
  CHECK(contains(run.output, ", running "));
  CHECK(contains(run.output, " of its 30.000 s limit"));

  // --json is the daemon's document as it sent it.
  const CommandResult json_run = gpuqctl(daemon, "status --json");
  const nlohmann::json doc = nlohmann::json::parse(json_run.output, nullptr, false);
  REQUIRE_MESSAGE(!doc.is_discarded(), "gpuqctl status --json printed: " << json_run.output);
  const nlohmann::json& worker = doc["pools"][0]["workers"][0];
  CHECK(worker["job"]["op"] == "sleep");
  CHECK(worker["job"]["client_name"] == "status-test");
  CHECK(worker["job"]["time_limit_ms"] == 30000);

  REQUIRE(busy.cancel().ok());
  CHECK(wait_result(busy).status == JobStatus::kCancelled);
  const CommandResult idle = gpuqctl(daemon, "status");
  INFO(idle.output);
  CHECK(idle.exit_code == 0);
  CHECK(!contains(idle.output, "sleep from client"));
}

#ifdef GPUQ_TEST_PLUGIN
TEST_CASE("gpuqctl status shows a worker stuck on a job past its limit, then its forced stop") {
  // plugin_spin never looks at its cancel flag: past its 100 ms limit the worker is stuck until
  // cancel_grace_ms (8 s: room for a slow gpuqctl under a sanitizer) has passed, then it is
  // stopped and replaced.
  nlohmann::json config;
  config["cancel_grace_ms"] = 8000;
  config["plugins"] = nlohmann::json::array({GPUQ_TEST_PLUGIN});
  config["pools"] = nlohmann::json::array({{{"name", "cpu"}, {"kind", "cpu"}, {"workers", 1}}});
  DaemonProcess daemon(config.dump());
  Client client = connect_client(daemon);
  JobSpec spec = job_spec("plugin_spin");
  spec.time_limit = std::chrono::milliseconds(100);
  Job hung = submit_ok(client, spec);

  REQUIRE_MESSAGE(
      wait_until([&] { return daemon.status()["pools"][0]["workers_stuck"] == 1; }, 10s),
      daemon.status().dump());
  const CommandResult stuck = gpuqctl(daemon, "status");
  INFO(stuck.output);
  CHECK(stuck.exit_code == 0);
  CHECK(contains(stuck.output, "0/1 ready, 1 stuck"));
  CHECK(contains(stuck.output, " stuck "));
  CHECK(contains(stuck.output, "plugin_spin from client "));
  CHECK(contains(stuck.output, "asked to stop (time limit)"));

  JobResult r = wait_result(hung);
  CHECK(r.status == JobStatus::kFailed);
  CHECK(r.code == ErrorCode::kTimedOut);
  REQUIRE_MESSAGE(
      wait_until([&] { return daemon.status()["pools"][0]["workers_ready"] == 1; }, 10s),
      daemon.status().dump());
  const CommandResult after = gpuqctl(daemon, "status");
  INFO(after.output);
  CHECK(contains(after.output, "1/1 ready, 1 worker stopped for jobs that did not end"));
  CHECK(!contains(after.output, "plugin_spin"));
}
#endif

// gpuqctl in the background with --runtime-dir `dir`: its result once joined.
struct BackgroundCommand {
  CommandResult result;
  std::thread thread;
  BackgroundCommand(const std::string& dir, const std::string& args)
      : thread([this, dir, args] {
          result = run_command(std::string("'") + gpuqctl_path() + "' --runtime-dir '" + dir +
                               "' " + args + " 2>&1");
        }) {}
  CommandResult join() {
    thread.join();
    return result;
  }
};

TEST_CASE("gpuqctl ready --wait: waits for a daemon started after it, and gives up with why") {
  char tmpl[] = "/tmp/gpuq-ready-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::string base = tmpl;
  const std::string dir = base + "/run";

  // Nothing there: --wait gives up after its time, with the last reason.
  const auto start = std::chrono::steady_clock::now();
  const CommandResult none = run_command(std::string("'") + gpuqctl_path() + "' --runtime-dir '" +
                                         dir + "' ready --wait 0.3 2>&1");
  CHECK(std::chrono::steady_clock::now() - start >= 300ms);
  CHECK(none.exit_code == 1);
  CHECK_MESSAGE(contains(none.output,
                         "gpuqctl: not ready within 0.3 s: Disconnected: no gpuqd "
                         "is listening at " +
                             dir + "/gpuqd.sock"),
                none.output);

  // The waiter first; then a daemon whose worker takes a second to start: the waiter sees no
  // daemon, then one still starting, then ready.
  BackgroundCommand waiter(dir, "ready --wait 60");
  std::this_thread::sleep_for(300ms);
  std::ofstream(base + "/config.json") << one_pool_config(1) << "\n";
  const std::string gpuqd = gpuqd_path();
  const std::string config = base + "/config.json";
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::setenv("GPUQ_TEST_HOOKS", "1", 1);
    ::setenv("GPUQ_TEST_WORKER_START_DELAY_MS", "1000", 1);
    ::execl(gpuqd.c_str(), "gpuqd", "--config", config.c_str(), "--runtime-dir", dir.c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  const CommandResult while_starting = run_command(
      std::string("'") + gpuqctl_path() + "' --runtime-dir '" + dir + "' ready --wait 0.2 2>&1");
  const CommandResult waited = waiter.join();
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  run_command("rm -rf '" + base + "'");

  CHECK_MESSAGE(waited.exit_code == 0, waited.output);
  CHECK(waited.output == "ready\n");
  // Meanwhile a short wait gave up, with no daemon yet or its pool not ready yet.
  CHECK(while_starting.exit_code == 1);
  CHECK_MESSAGE((contains(while_starting.output,
                          "not ready within 0.2 s: pool 'cpu' has no ready "
                          "worker") ||
                 contains(while_starting.output, "not ready within 0.2 s: Disconnected")),
                while_starting.output);
}

TEST_CASE("gpuqctl ready --wait: a bad number of seconds is a usage error naming it") {
  struct Case {
    const char* arg;
    const char* says;
  };
  for (const Case& c : {Case{"--wait abc", "--wait 'abc' is not a number of seconds"},
                        Case{"--wait -1", "--wait is -1, must be in [0, 86400] seconds"},
                        Case{"--wait 1e9", "--wait is 1e9, must be in [0, 86400] seconds"},
                        Case{"--wait inf", "--wait 'inf' is not a number of seconds"},
                        Case{"--wait", "option --wait needs a value"},
                        Case{"--later", "unknown argument '--later' for ready"}}) {
    const CommandResult r = run_command(std::string("'") + gpuqctl_path() +
                                        "' --runtime-dir /nonexistent ready " + c.arg + " 2>&1");
    INFO(c.arg << ": " << r.output);
    CHECK(r.exit_code == 2);
    CHECK(contains(r.output, c.says));
  }
}

}  // namespace
}  // namespace gpuq::test
