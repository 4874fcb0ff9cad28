// Integration: jobs that do not end (docs/design/faults.md, "Jobs that do not end"), on a real
// gpuqd with the test plug-in's plugin_spin (a loop that never looks at its cancel flag) and
// plugin_block (a blocking system call that never returns), and the built-in sleep (which
// polls its flag):
//   - a pool's job_time_limit_ms and a job's own limit (the smaller applies) end a job
//     TimedOut: an op that honours its flag stops by itself, one that ignores it has its
//     worker stopped after cancel_grace_ms and replaced;
//   - a cancel of a running job is forced the same way;
//   - a client that exits with a running job frees its worker (unless it asked to keep it);
//   - two stuck workers: status and readiness say so, and a third client is served within the
//     limit plus the grace plus a worker start.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string>
#include <vector>

#include "gpuq/common/shm_layout.hpp"
#include "integration/integration_support.hpp"

namespace gpuq::test {
namespace {

using nlohmann::json;

// One cpu pool of `workers` with `limit_ms` (0: none), the given grace, the test plug-in.
std::string limits_config(uint32_t workers, uint32_t limit_ms, uint32_t grace_ms) {
  json pool = {{"name", "cpu"}, {"kind", "cpu"}, {"workers", workers}};
  if (limit_ms != 0) pool["job_time_limit_ms"] = limit_ms;
  return json{{"cancel_grace_ms", grace_ms},
              {"plugins", json::array({GPUQ_TEST_PLUGIN})},
              {"pools", json::array({pool})}}
      .dump();
}

const json& pool_status(const json& status) {
  return status["pools"][0];
}

uint64_t stops_forced(const DaemonProcess& daemon) {
  return pool_status(daemon.status())["stops_forced"].get<uint64_t>();
}

// Waits until every worker of the pool is ready again (a stopped one has been replaced).
void wait_all_ready(const DaemonProcess& daemon) {
  const bool ready = wait_until(
      [&] {
        const json p = pool_status(daemon.status());
        return p["workers_ready"] == p["workers_total"];
      },
      10s);
  REQUIRE_MESSAGE(ready, "workers not all ready: " << daemon.status().dump());
}

JobResult expect_end(Job& job, JobStatus status, ErrorCode code) {
  JobResult r = wait_result(job);
  CHECK_MESSAGE(r.status == status, "ended " << job_status_name(r.status) << " ("
                                             << error_code_name(r.code) << "): " << r.message);
  CHECK(r.code == code);
  return r;
}

TEST_CASE("a pool's time limit ends a job that ignores its flag: TimedOut, worker replaced") {
  DaemonProcess daemon(limits_config(1, 300, 200));
  CHECK(pool_status(daemon.status())["job_time_limit_ms"] == 300);
  Client client = connect_client(daemon);
  const std::vector<pid_t> before = daemon.worker_pids();

  for (const char* op : {"plugin_spin", "plugin_block"}) {
    INFO("op " << op);
    Job job = submit_ok(client, job_spec(op));
    const JobResult r = expect_end(job, JobStatus::kFailed, ErrorCode::kTimedOut);
    CHECK(r.message.find("time limit (300 ms)") != std::string::npos);
    CHECK(r.message.find("was stopped") != std::string::npos);
    CHECK(r.run_ns >= 300'000'000);  // it ran until it was stopped
    wait_all_ready(daemon);
    check_echo_works(client);  // the replacement serves
  }
  CHECK(stops_forced(daemon) == 2);
  CHECK(daemon.worker_pids() != before);
  CHECK(pool_status(daemon.status())["workers"][0]["restarts"] == 2);
  CHECK(pool_status(daemon.status())["workers"][0]["start_ms"].is_number());
}

TEST_CASE("an op that honours its flag ends TimedOut at the limit, and its worker serves on") {
  DaemonProcess daemon(limits_config(1, 300, 5000));
  Client client = connect_client(daemon);
  const std::vector<pid_t> before = daemon.worker_pids();
  Job job = submit_ok(client, sleep_spec(30'000'000));
  const JobResult r = expect_end(job, JobStatus::kFailed, ErrorCode::kTimedOut);
  CHECK(r.message == "sleep: stopped at the job's time limit (300 ms)");
  CHECK(daemon.worker_pids() == before);
  CHECK(stops_forced(daemon) == 0);
  check_echo_works(client);
}

TEST_CASE("a job's own time limit: the smaller of it and the pool's applies") {
  SUBCASE("no pool limit: the job's own ends it") {
    DaemonProcess daemon(limits_config(1, 0, 200));
    CHECK(pool_status(daemon.status())["job_time_limit_ms"].is_null());
    Client client = connect_client(daemon);
    JobSpec sleep = sleep_spec(30'000'000);
    sleep.time_limit = 200ms;
    Job a = submit_ok(client, sleep);
    CHECK(expect_end(a, JobStatus::kFailed, ErrorCode::kTimedOut).message ==
          "sleep: stopped at the job's time limit (200 ms)");
    JobSpec block = job_spec("plugin_block");
    block.time_limit = 200ms;
    Job b = submit_ok(client, block);
    CHECK(expect_end(b, JobStatus::kFailed, ErrorCode::kTimedOut).message.find("(200 ms)") !=
          std::string::npos);
    wait_all_ready(daemon);
    // A job without a limit of its own runs as long as it takes.
    Job c = submit_ok(client, sleep_spec(500'000));
    wait_done(c);
  }
  SUBCASE("a longer limit of its own does not extend the pool's") {
    DaemonProcess daemon(limits_config(1, 300, 200));
    Client client = connect_client(daemon);
    JobSpec spin = job_spec("plugin_spin");
    spin.time_limit = 60s;
    Job a = submit_ok(client, spin);
    CHECK(expect_end(a, JobStatus::kFailed, ErrorCode::kTimedOut).message.find("(300 ms)") !=
          std::string::npos);
  }
  SUBCASE("a limit out of range is refused at submit") {
    DaemonProcess daemon(limits_config(1, 0, 200));
    Client client = connect_client(daemon);
    JobSpec s = noop_spec();
    s.time_limit = -1ms;
    auto r = client.submit(s);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == ErrorCode::kInvalidArgument);
    CHECK(r.error().message().find("time_limit") != std::string::npos);
  }
}

TEST_CASE("cancelling a running job: an op that ignores it has its worker stopped") {
  DaemonProcess daemon(limits_config(1, 0, 300));
  Client client = connect_client(daemon);
  Job spin = submit_ok(client, job_spec("plugin_spin"));
  wait_running(spin);
  REQUIRE(spin.cancel().ok());
  const JobResult r = expect_end(spin, JobStatus::kCancelled, ErrorCode::kCancelled);
  CHECK(r.message.find("cancelled while running") != std::string::npos);
  CHECK(r.message.find("was stopped") != std::string::npos);
  wait_all_ready(daemon);
  CHECK(stops_forced(daemon) == 1);

  // One that honours it ends Cancelled by itself; no worker is stopped.
  Job sleep = submit_ok(client, sleep_spec(30'000'000));
  wait_running(sleep);
  REQUIRE(sleep.cancel().ok());
  expect_end(sleep, JobStatus::kCancelled, ErrorCode::kCancelled);
  CHECK(stops_forced(daemon) == 1);
  check_echo_works(client);
}

// Forks a child that connects (keep_running_jobs as given), submits `spec`, waits until it runs
// and exits without a word. Returns once the child has been reaped.
void exit_with_running_job(const DaemonProcess& daemon, const JobSpec& spec, bool keep) {
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ConnectOptions o = connect_options(daemon.runtime_dir());
    o.keep_running_jobs = keep;
    auto c = Client::connect(o);
    if (!c) ::_exit(2);
    auto job = c->submit(spec);
    if (!job) ::_exit(3);
    for (int i = 0; i < 1000; ++i) {
      auto s = job->poll();
      if (s && *s == JobStatus::kRunning) ::_exit(0);  // no destructors: as if it crashed
      ::usleep(10'000);
    }
    ::_exit(4);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE_MESSAGE((WIFEXITED(status) && WEXITSTATUS(status) == 0), "child status " << status);
}

TEST_CASE("a client that exits with a running job frees its worker") {
  SUBCASE("by default its job is cancelled, by force when it ignores that") {
    DaemonProcess daemon(limits_config(1, 0, 300));
    const pid_t worker = daemon.worker_pids().at(0);
    exit_with_running_job(daemon, job_spec("plugin_block"), false);
    // No status requests meanwhile: with no client left, only the supervisor's own timer can
    // end the grace (a request would wake its loop). The worker's pid is gone once gpuqd has
    // killed and reaped it.
    const bool reaped = wait_until([&] { return ::kill(worker, 0) == -1 && errno == ESRCH; }, 20s);
    const json after = daemon.status();
    REQUIRE_MESSAGE(reaped, after.dump());
    REQUIRE_MESSAGE(pool_status(after)["stops_forced"] == 1, after.dump());
    wait_all_ready(daemon);
    Client client = connect_client(daemon);
    check_echo_works(client);
  }
  SUBCASE("keep_running_jobs: its job runs to its end") {
    DaemonProcess daemon(limits_config(1, 0, 100));
    exit_with_running_job(daemon, sleep_spec(1'000'000), true);
    const json busy = pool_status(daemon.status())["workers"][0];
    CHECK(busy["busy"] == true);
    CHECK(busy["job"]["op"] == "sleep");
    REQUIRE(wait_until([&] { return pool_status(daemon.status())["workers"][0]["jobs_done"] == 1; },
                       10s));
    CHECK(stops_forced(daemon) == 0);
    CHECK(pool_status(daemon.status())["workers"][0]["jobs_failed"] == 0);
  }
}

TEST_CASE("two stuck workers: status and readiness say so; a third client is still served") {
  // Generous: the status taken within the limit, and the one taken within the grace, must come
  // in time on a loaded machine under a sanitizer.
  constexpr uint32_t kLimitMs = 2000, kGraceMs = 4000;
  DaemonProcess daemon(limits_config(2, kLimitMs, kGraceMs));
  Client a = connect_client(daemon);
  Client b = connect_client(daemon);
  Job ja = submit_ok(a, job_spec("plugin_spin"));
  Job jb = submit_ok(b, job_spec("plugin_block"));
  wait_running(ja);
  wait_running(jb);

  // While busy (within the limit, unless the machine is very slow): the job is shown.
  {
    const json st = daemon.status();
    for (const json& w : pool_status(st)["workers"]) {
      CHECK(w["busy"] == true);
      CHECK((w["state"] == "ready" || w["state"] == "stuck"));
      CHECK(w["job"]["time_limit_ms"] == kLimitMs);
      CHECK(w["job"]["client_pid"] == ::getpid());
      CHECK(w["job"]["age_ms"].get<double>() >= 0);
    }
  }
  // Past the limit, within the grace: stuck, the pool down, the daemon not ready.
  json s;
  const bool stuck = wait_until(
      [&] {
        s = daemon.status();
        return pool_status(s)["workers_stuck"] == 2;
      },
      10s);
  REQUIRE_MESSAGE(stuck, s.dump());
  const auto asked = std::chrono::steady_clock::now();
  CHECK(s["ready"] == false);
  CHECK(pool_status(s)["status"] == "down");
  CHECK(pool_status(s)["workers_ready"] == 0);
  CHECK(pool_status(s)["reason"].get<std::string>().find("stuck") != std::string::npos);
  for (const json& w : pool_status(s)["workers"]) {
    CHECK(w["state"] == "stuck");
    CHECK(w["job"]["stop_requested"] == "time_limit");
    CHECK(w["job"]["age_ms"].get<double>() >= kLimitMs);
  }
  std::vector<std::string> ops;
  for (const json& w : pool_status(s)["workers"]) ops.push_back(w["job"]["op"]);
  std::sort(ops.begin(), ops.end());
  CHECK(ops == std::vector<std::string>{"plugin_block", "plugin_spin"});

  // A third client's job waits for a replacement: the grace, then a worker start.
  Client c = connect_client(daemon);
  Job jc = submit_ok(c, noop_spec());
  wait_done(jc);
  const double served_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - asked).count();
  expect_end(ja, JobStatus::kFailed, ErrorCode::kTimedOut);
  expect_end(jb, JobStatus::kFailed, ErrorCode::kTimedOut);
  wait_all_ready(daemon);
  const json after = daemon.status();
  double slowest_start_ms = 0;
  for (const json& w : pool_status(after)["workers"]) {
    slowest_start_ms = std::max(slowest_start_ms, w["start_ms"].get<double>());
  }
  // Bound: the grace and a worker start, plus the supervisor's tick and scheduling slack.
  const double bound_ms = kGraceMs + slowest_start_ms + 2000;
  CHECK_MESSAGE(served_ms < bound_ms,
                "served after " << served_ms << " ms; bound " << bound_ms << " ms");
  CHECK(after["ready"] == true);
  CHECK(pool_status(after)["stops_forced"] == 2);
}

TEST_CASE("a client that rewrites its own job's slot cannot keep a worker past the limit") {
  // What the supervisor acts on (which job a worker runs, since when, whether it has ended)
  // comes from the worker's private page; the client's slot is the client's to scribble on.
  DaemonProcess daemon(limits_config(1, 300, 200));
  Client client = connect_client(daemon);
  Job job = submit_ok(client, job_spec("plugin_spin"));
  wait_running(job);
  // The slots sit before the arena (shm_layout.hpp); the first job took slot 0. Say it is done.
  const ClientSegmentGeometry g = ClientSegmentGeometry::compute(64, client.arena_bytes());
  auto* slots = reinterpret_cast<JobSlot*>(client.arena() - g.arena_offset + g.slots_offset);
  const SlotWord was = SlotWord::unpack(slots[0].state.load());
  REQUIRE(was.state == JobState::kRunning);
  slots[0].state.store(SlotWord{was.generation, JobState::kDone, was.worker_plus_one}.pack());
  REQUIRE_MESSAGE(wait_until([&] { return stops_forced(daemon) == 1; }, 10s),
                  daemon.status().dump());
  wait_all_ready(daemon);
  check_echo_works(client);
}

}  // namespace
}  // namespace gpuq::test
