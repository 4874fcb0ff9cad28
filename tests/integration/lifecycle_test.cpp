// Integration: the daemon's life and its processes: draining on SIGTERM and on `gpuqctl stop`, a
// worker killed mid-job, no CUDA anywhere near a CPU pool or in a supervisor with a gpu pool, and
// a client that forks.
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <optional>
#include <thread>

#include "integration/integration_support.hpp"

namespace gpuq::test {
namespace {

std::string read_proc_file(pid_t pid, const char* name) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/" + name, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

constexpr int kDrainJobs = 5;
constexpr int64_t kDrainJobUs = 100'000;

// Five 100 ms jobs on one worker, the first of them running: most are still queued when the
// drain starts.
std::vector<Job> submit_drain_jobs(Client& client) {
  std::vector<Job> jobs;
  for (int i = 0; i < kDrainJobs; ++i) jobs.push_back(submit_ok(client, sleep_spec(kDrainJobUs)));
  wait_running(jobs.front());
  return jobs;
}

// After the drain began: every queued job still ends Done, a new submit is refused at once, and
// gpuqd exits 0.
void check_drain(DaemonProcess& daemon, Client& client, std::vector<Job>& jobs) {
  // The daemon removes its socket once it has stopped accepting jobs.
  REQUIRE_MESSAGE(wait_until([&] { return !path_exists(daemon.socket_path()); }, 10s),
                  "the daemon did not begin draining within 10 s");
  const uint64_t start = monotonic_ns();
  auto late = client.submit(noop_spec(), 10s);
  const uint64_t elapsed = monotonic_ns() - start;
  REQUIRE_FALSE(late.ok());
  const ErrorCode code = late.error().code();
  CHECK_MESSAGE((code == ErrorCode::kShuttingDown || code == ErrorCode::kDisconnected),
                "a submit during the drain returned " << late.error().to_string());
  CHECK(elapsed < 2 * kSecond);  // refused, not left waiting for room

  auto newcomer = Client::connect(connect_options(daemon.runtime_dir()));
  REQUIRE_FALSE(newcomer.ok());
  CHECK(newcomer.error().code() == ErrorCode::kDisconnected);

  for (auto& job : jobs) {
    JobResult r = wait_done(job);
    CHECK(r.run_ns >= static_cast<uint64_t>(kDrainJobUs) * 1000);
  }
  const ChildExit exit = daemon.wait_exit(30s);
  CHECK_MESSAGE(exit.ok(), "gpuqd " << exit.describe());
}

TEST_CASE("SIGTERM drains: queued jobs finish, new ones are refused, gpuqd exits 0") {
  DaemonProcess daemon(one_pool_config(1, {{"client_queue_share", 1.0}}));
  Client client = connect_client(daemon);
  std::vector<Job> jobs = submit_drain_jobs(client);
  REQUIRE(daemon.send_signal(SIGTERM));
  check_drain(daemon, client, jobs);
}

TEST_CASE("gpuqctl stop drains the same way") {
  DaemonProcess daemon(one_pool_config(1, {{"client_queue_share", 1.0}}));
  Client client = connect_client(daemon);
  std::vector<Job> jobs = submit_drain_jobs(client);
  const CommandResult stop = run_command(std::string("'") + gpuqctl_path() + "' --runtime-dir '" +
                                         daemon.runtime_dir() + "' stop");
  CHECK(stop.exit_code == 0);
  CHECK(stop.output.find("draining") != std::string::npos);
  check_drain(daemon, client, jobs);
}

TEST_CASE("a worker killed mid-job: the job fails with WorkerDied and the worker comes back") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  Job victim = submit_ok(client, sleep_spec(30'000'000));
  wait_running(victim);
  // The worker marks itself busy just after it takes the job: wait for the status to say so.
  nlohmann::json before;
  CHECK(wait_until(
      [&] {
        before = daemon.status()["pools"][0]["workers"][0];
        return before["busy"] == true;
      },
      10s));
  const pid_t old_pid = before["pid"].get<pid_t>();
  const uint32_t worker_id = before["id"].get<uint32_t>();
  REQUIRE(old_pid > 0);
  CHECK(before["restarts"] == 0);

  REQUIRE(::kill(old_pid, SIGKILL) == 0);
  JobResult r = wait_result(victim, 10s);
  CHECK(r.status == JobStatus::kFailed);
  CHECK(r.code == ErrorCode::kWorkerDied);
  CHECK(r.worker_id == worker_id);
  CHECK(r.message.find(std::to_string(old_pid)) != std::string::npos);

  nlohmann::json after;
  const bool back = wait_until(
      [&] {
        after = daemon.status()["pools"][0]["workers"][0];
        return after["state"] == "ready" && after["pid"].get<pid_t>() > 0 &&
               after["pid"].get<pid_t>() != old_pid;
      },
      10s);
  INFO("worker after the kill: " << after.dump());
  REQUIRE(back);
  CHECK(after["restarts"] == 1);
  CHECK(after["id"] == worker_id);
  CHECK(daemon.status()["pools"][0]["status"] == "ready");

  check_echo_works(client);
  Job next = submit_ok(client, sleep_spec(1000));
  CHECK(wait_done(next).worker_id == worker_id);
}

// The pid of the pool's worker once it is running a job (busy in the status document).
pid_t busy_worker_pid(DaemonProcess& daemon) {
  nlohmann::json w;
  const bool busy = wait_until(
      [&] {
        w = daemon.status()["pools"][0]["workers"][0];
        return w["busy"] == true && w["pid"].get<pid_t>() > 0;
      },
      10s);
  INFO("worker: " << w.dump());
  REQUIRE(busy);
  return w["pid"].get<pid_t>();
}

TEST_CASE("a retryable job whose worker dies runs again, once; a second death fails it") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  JobSpec spec = sleep_spec(30'000'000);
  spec.retryable = true;
  Job job = submit_ok(client, spec);
  wait_running(job);
  const pid_t first = busy_worker_pid(daemon);
  REQUIRE(::kill(first, SIGKILL) == 0);

  // Back in the queue, then running again on the respawned worker: not failed.
  const bool rerunning = wait_until(
      [&] {
        const pid_t pid = daemon.status()["pools"][0]["workers"][0]["pid"].get<pid_t>();
        auto st = job.poll();
        return pid > 0 && pid != first && st.ok() && st.value() == JobStatus::kRunning;
      },
      10s);
  REQUIRE(rerunning);
  const pid_t second = busy_worker_pid(daemon);
  REQUIRE(second != first);
  REQUIRE(::kill(second, SIGKILL) == 0);
  JobResult r = wait_result(job, 10s);
  CHECK(r.status == JobStatus::kFailed);
  CHECK(r.code == ErrorCode::kWorkerDied);

  // A job not marked retryable is never run twice.
  Job plain = submit_ok(client, sleep_spec(30'000'000));
  wait_running(plain);
  REQUIRE(::kill(busy_worker_pid(daemon), SIGKILL) == 0);
  JobResult p = wait_result(plain, 10s);
  CHECK(p.status == JobStatus::kFailed);
  CHECK(p.code == ErrorCode::kWorkerDied);
}

TEST_CASE(
    "gpuqd killed with SIGKILL: workers exit, waits return Disconnected, a client reconnects") {
  DaemonProcess daemon(one_pool_config(2));
  Client client = connect_client(daemon);
  const uint64_t old_epoch = client.daemon_epoch();
  const std::vector<pid_t> workers = daemon.worker_pids();
  REQUIRE(workers.size() == 2);
  Job running = submit_ok(client, sleep_spec(30'000'000));
  wait_running(running);

  // A thread blocked in wait() when the daemon dies.
  std::optional<Result<JobResult>> waited;
  uint64_t waited_ns = 0;
  std::thread waiter([&] {
    const uint64_t start = monotonic_ns();
    waited.emplace(running.wait(30s));
    waited_ns = monotonic_ns() - start;
  });
  // Let the waiter fall asleep on the job's futex before the kill.
  timespec nap{0, 50'000'000};
  ::nanosleep(&nap, nullptr);
  const uint64_t killed_at = monotonic_ns();
  REQUIRE(::kill(daemon.pid(), SIGKILL) == 0);
  waiter.join();
  REQUIRE(waited.has_value());
  REQUIRE_FALSE(waited->ok());
  CHECK(waited->error().code() == ErrorCode::kDisconnected);
  CHECK(waited_ns < 30 * kSecond);
  // Bounded: noticed within a 20 ms liveness slice (5 s of slack for a loaded CI machine).
  CHECK(monotonic_ns() - killed_at < 5 * kSecond);

  // No orphans: every worker follows its supervisor within a second (PR_SET_PDEATHSIG).
  const bool workers_gone = wait_until(
      [&] {
        return std::all_of(workers.begin(), workers.end(), [](pid_t pid) {
          return ::kill(pid, 0) != 0 ||
                 read_proc_file(pid, "stat").find(") Z ") != std::string::npos;
        });
      },
      1s);
  CHECK(workers_gone);

  // Calls on the old connection fail at once.
  auto late = client.submit(noop_spec(), 1s);
  REQUIRE_FALSE(late.ok());
  CHECK(late.error().code() == ErrorCode::kDisconnected);

  // A new daemon starts over the old one's leftovers, and the same Client object reconnects.
  daemon.kill_and_restart();
  auto again = client.reconnect();
  REQUIRE_MESSAGE(again.ok(), "reconnect: " << error_text(again));
  CHECK(client.daemon_epoch() != old_epoch);
  check_echo_works(client);
  // The Job of the old connection stays an error, not a hang.
  auto old_result = running.wait(1s);
  REQUIRE_FALSE(old_result.ok());
  CHECK(old_result.error().code() == ErrorCode::kDisconnected);
  CHECK(daemon.status()["clients"] == 1);
}

TEST_CASE("no CUDA library in the supervisor or its CPU workers, which see no GPU") {
  // Even when the daemon's own environment names a GPU, a CPU worker must get -1.
  DaemonProcess daemon(
      DaemonOptions{one_pool_config(2),
                    DaemonOptions::Readiness::kWorkersReady,
                    {"CUDA_VISIBLE_DEVICES=0", "CUDA_DEVICE_ORDER=FASTEST_FIRST"}});
  // Run a job on every worker first, so that a library loaded lazily on the job path shows too.
  Client client = connect_client(daemon);
  std::vector<Job> jobs;
  for (int i = 0; i < 4; ++i) jobs.push_back(submit_ok(client, sleep_spec(20'000)));
  for (auto& job : jobs) wait_done(job);

  const std::vector<pid_t> workers = daemon.worker_pids();
  REQUIRE(workers.size() == 2);
  std::vector<pid_t> all = workers;
  all.push_back(daemon.pid());
  for (pid_t pid : all) {
    INFO("pid " << pid << (pid == daemon.pid() ? " (gpuqd)" : " (worker)"));
    const std::string maps = read_proc_file(pid, "maps");
    REQUIRE(!maps.empty());
    REQUIRE(maps.find("gpuq") != std::string::npos);  // we read the right process's maps
    for (const char* lib : {"libcuda", "libcudart", "libcublas", "libcudnn", "libnvidia"}) {
      INFO("library " << lib);
      CHECK(maps.find(lib) == std::string::npos);
    }
  }
  for (pid_t pid : workers) {
    INFO("worker pid " << pid);
    const std::string environ_text = read_proc_file(pid, "environ");
    REQUIRE(!environ_text.empty());
    std::vector<std::string> cuda_vars;
    for (size_t at = 0; at < environ_text.size();) {
      const size_t end = environ_text.find('\0', at);
      const std::string entry = environ_text.substr(at, end - at);
      if (entry.rfind("CUDA_VISIBLE_DEVICES=", 0) == 0) cuda_vars.push_back(entry);
      if (end == std::string::npos) break;
      at = end + 1;
    }
    REQUIRE(cuda_vars.size() == 1);
    CHECK(cuda_vars[0] == "CUDA_VISIBLE_DEVICES=-1");
  }
}

TEST_CASE("no CUDA or NVIDIA library in the supervisor with a gpu pool configured") {
  // GPU discovery (NVML through dlopen, where there is one) runs in a child process: whether or
  // not this machine has a GPU, nothing NVIDIA may stay mapped in gpuqd.
  DaemonOptions options;
  options.config_json = R"({"pools":[{"name":"cpu","kind":"cpu","workers":1},
                                     {"name":"gpu","kind":"gpu","fallback":"cpu"}]})";
  // A gpu pool without a GPU has no workers, which the fixture's default readiness waits for.
  options.readiness = DaemonOptions::Readiness::kAnswering;
  DaemonProcess daemon(options);
  REQUIRE(wait_until([&] { return daemon.status()["ready"] == true; }, 10s));
  Client client = connect_client(daemon);
  std::vector<Job> jobs;
  for (int i = 0; i < 2; ++i) jobs.push_back(submit_ok(client, sleep_spec(1000, "gpu")));
  for (auto& job : jobs) wait_done(job);

  std::vector<pid_t> pids = daemon.worker_pids("cpu");
  REQUIRE(pids.size() == 1);
  pids.push_back(daemon.pid());
  for (pid_t pid : pids) {
    INFO("pid " << pid << (pid == daemon.pid() ? " (gpuqd)" : " (cpu worker)"));
    const std::string maps = read_proc_file(pid, "maps");
    REQUIRE(maps.find("gpuq") != std::string::npos);
    for (const char* lib : {"libcuda", "libcudart", "libcublas", "libcudnn", "libnvidia"}) {
      INFO("library " << lib);
      CHECK(maps.find(lib) == std::string::npos);
    }
  }
}

TEST_CASE("a client that forks: the child gets ForkedClient and may connect anew") {
  DaemonProcess daemon(one_pool_config(2));
  Client client = connect_client(daemon);
  Job in_flight = submit_ok(client, sleep_spec(200'000));
  const std::string dir = daemon.runtime_dir();

  // The child reports by exit code (no doctest there): 0 is success.
  const pid_t child = fork_child([&]() -> int {
    auto job = client.submit(noop_spec(), 5s);
    if (job.ok()) return 10;
    if (job.error().code() != ErrorCode::kForkedClient) return 11;
    auto buffer = client.allocate(64);
    if (buffer.ok() || buffer.error().code() != ErrorCode::kForkedClient) return 12;
    auto polled = in_flight.poll();
    if (polled.ok() || polled.error().code() != ErrorCode::kForkedClient) return 13;

    auto fresh = Client::connect(connect_options(dir));
    if (!fresh.ok()) return 20;
    auto in = fresh->allocate(1000);
    auto out = fresh->allocate(1000);
    if (!in.ok() || !out.ok()) return 21;
    for (int i = 0; i < 1000; ++i) in->data()[i] = static_cast<std::byte>(i * 13);
    auto echo = fresh->submit(job_spec("echo", *in, *out), 10s);
    if (!echo.ok()) return 22;
    auto r = echo->wait(std::chrono::seconds(30));
    if (!r.ok() || r->status != JobStatus::kDone || r->output_size != 1000) return 23;
    if (std::memcmp(in->data(), out->data(), 1000) != 0) return 24;
    return 0;
  });
  REQUIRE(child > 0);
  const ChildExit exit = wait_child(child, 30 * kSecond);
  CHECK_MESSAGE(exit.ok(), "forked child " << exit.describe());

  // The parent's job and client are unaffected.
  JobResult r = wait_done(in_flight);
  CHECK(r.run_ns >= 200'000'000);
  check_echo_works(client);
}

}  // namespace
}  // namespace gpuq::test
