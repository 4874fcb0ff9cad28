// Fault injection: worker processes die with SIGKILL at the worker fault points (a reference
// popped, the job claimed, the op running, the outcome written but not published, the end
// published but not counted) and from outside while they run jobs, dozens of times per point,
// while two bystander clients keep verified jobs flowing; a worker that keeps dying at start-up
// is marked failed, which health (status, `gpuqctl ready`) reports, is tried again for good and
// comes back by itself; and a pool whose workers all keep dying fails its jobs with PoolDown.
//
// A daemon runs with GPUQ_FAULT_POINT=<point>:<n> and GPUQ_FAULT_ONCE=<marker>: its workers
// inherit them, and the first worker to reach its n-th hit of the point dies, creating the
// marker. The test counts the marker's appearances and deletes it to allow the next death, so
// every kill is seen exactly once; replacement workers start with fresh counts.
//
// Checked: every job a bystander submitted ends exactly once: Done with the right output, or
// Failed with WorkerDied; a worker that died holding a running job accounts for exactly one
// WorkerDied, or one retry of a retryable job (JobSpec::retryable; the daemon logs each retry),
// and nothing else does (a job only popped must be requeued, a job already published stays
// Done); the daemon's completed-job counters match the submitted ones (a job run twice would
// count twice); every worker is back and ready; queue depth and held cells return to 0; new
// clients are served.
//
// Then what a replacement worker must get right about the clients already connected: its
// state in the queue segment, and every client's segment mapped before it skips a job of a
// client it does not know (three test cases that each fail on a race in worker start-up).
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <regex>
#include <set>

#include "fault/fault_support.hpp"
#include "gpuq/common/job_ring.hpp"
#include "integration/integration_support.hpp"

namespace gpuq::test::fault {
namespace {

using nlohmann::json;

struct WorkerPoint {
  const char* name;
  bool job_fails;  // the dying worker held a RUNNING job: it must end Failed with WorkerDied
  bool uncounted;  // the worker died after publishing the job's end, before counting it
};

void nap_us(uint64_t us) {
  timespec ts{static_cast<time_t>(us / 1'000'000), static_cast<long>(us % 1'000'000) * 1000};
  nanosleep(&ts, nullptr);
}

// Removes a file when it goes out of scope.
struct RemoveFile {
  std::string path;
  ~RemoveFile() { ::unlink(path.c_str()); }
};

uint64_t sum_workers(const json& status, const char* field) {
  uint64_t n = 0;
  for (const auto& pool : status.at("pools")) {
    for (const auto& w : pool.at("workers")) n += w.value(field, uint64_t{0});
  }
  return n;
}

bool any_worker_failed(const json& status) {
  for (const auto& pool : status.at("pools")) {
    for (const auto& w : pool.at("workers")) {
      if (w.value("state", std::string()) == "failed") return true;
    }
  }
  return false;
}

// After the kills: the bystanders drain; every job ended once; the counters agree; the daemon
// is idle with every worker ready; a new client is served; gpuqd drains and exits 0.
// Retries of retryable jobs, from the daemon's log.
uint64_t retries_logged(const DaemonProcess& daemon) {
  const std::string log = daemon.log();
  uint64_t n = 0;
  for (size_t at = log.find("retrying job"); at != std::string::npos;
       at = log.find("retrying job", at + 1)) {
    ++n;
  }
  return n;
}

// After the kills: the bystanders drain; every job ended once (WorkerDied plus retries between
// `ended_by_deaths_min` and `_max`); the counters agree; the daemon is idle with every worker
// ready; a new client is served; gpuqd drains and exits 0.
void check_after_worker_kills(DaemonProcess& daemon, Bystanders& bystanders, uint32_t kills,
                              uint64_t ended_by_deaths_min, uint64_t ended_by_deaths_max,
                              uint64_t uncounted_max) {
  if (!bystanders.drain()) {
    FAIL("bystander jobs stuck: " << bystanders.totals().describe() << "\n"
                                  << bystanders.diagnose() << "\n"
                                  << describe_ring(daemon.runtime_dir()));
  }
  const BystanderTotals totals = bystanders.totals();
  const uint64_t retries = retries_logged(daemon);
  INFO(totals.describe() << "; " << retries << " retries logged");
  CHECK(totals.failures == 0);
  CHECK(totals.submitted == totals.done + totals.worker_died);
  CHECK(totals.worker_died + retries >= ended_by_deaths_min);
  CHECK(totals.worker_died + retries <= ended_by_deaths_max);

  std::string why;
  json status;
  IdleExpectations connected;
  connected.live_clients = bystanders.count();
  const bool idle = poll_until(
      [&] {
        if (!daemon_idle(daemon.runtime_dir(), daemon.pid(), connected, &why, &status)) {
          return false;
        }
        const auto& pool = status.at("pools").at(0);
        const uint64_t submitted = pool.at("jobs_submitted").get<uint64_t>();
        const uint64_t completed = pool.at("jobs_completed").get<uint64_t>();
        if (completed > submitted || completed + uncounted_max < submitted) {
          why = "jobs_completed " + std::to_string(completed) + " vs jobs_submitted " +
                std::to_string(submitted) + " (at most " + std::to_string(uncounted_max) +
                " uncounted)";
          return false;
        }
        return true;
      },
      20s, 1ms);
  CHECK_MESSAGE(idle, "not back to idle with the bystanders connected: " << why << "\n"
                                                                         << status.dump());
  if (!status.is_null()) {
    CHECK(sum_workers(status, "restarts") == kills);
    CHECK_FALSE(any_worker_failed(status));
    // Every job the bystanders submitted reached the pool; the daemon counted each once.
    CHECK(status.at("pools").at(0).at("jobs_submitted").get<uint64_t>() == totals.submitted);
  }
  status = release_and_expect_empty(bystanders, daemon.runtime_dir(), daemon.pid());
  {
    Client fresh = connect_client(daemon);
    check_echo_works(fresh);
    for (int i = 0; i < 8; ++i) check_echo_works(fresh, 4096, static_cast<uint64_t>(i));
  }
  const ChildExit exit = daemon.terminate();
  CHECK_MESSAGE(exit.ok(), "gpuqd " << exit.describe());
}

void run_worker_point(const WorkerPoint& point) {
  const uint64_t seed = suite_seed();
  INFO("worker fault point " << std::string(point.name) << ", suite seed " << seed
                             << " (GPUQ_FAULT_SEED=" << seed << " replays it)");
  Rng rng(derive_seed(point.name));
  const uint32_t hit = static_cast<uint32_t>(rng.between(1, 3));
  INFO("each worker dies at hit " << hit);
  RemoveFile marker{"/tmp/gpuqt-fault-" + std::to_string(::getpid()) + "-" + point.name};
  ::unlink(marker.path.c_str());
  DaemonProcess daemon(
      DaemonOptions{fault_config(2),
                    DaemonOptions::Readiness::kWorkersReady,
                    {"GPUQ_FAULT_POINT=" + std::string(point.name) + ":" + std::to_string(hit),
                     "GPUQ_FAULT_ONCE=" + marker.path}});
  BystanderOptions o;
  o.runtime_dir = daemon.runtime_dir();
  o.allow_worker_died = true;
  o.retryable_share = 0.3;
  o.wait_timeout = 10s;
  o.seed = derive_seed(point.name, 1);
  Bystanders bystanders(o);
  bystanders.wait_connected();

  const uint32_t kills = iterations(80);
  uint32_t rearms = 0;
  const uint64_t start = monotonic_ns();
  for (uint32_t k = 1; k <= kills; ++k) {
    INFO("kill " << k << " of " << kills << " (" << rearms << " re-arms)");
    bool died = poll_until([&] { return ::access(marker.path.c_str(), F_OK) == 0; }, 2s,
                           std::chrono::microseconds(100));
    // A worker reaching its hit while the marker is still there keeps living, disarmed: if
    // every worker did (this process was slow to delete the marker), none will die. Then kill
    // one while no job is anywhere (the bystanders drained), so that its replacement starts
    // armed; that death touches no job.
    for (int attempt = 0; !died && attempt < 5; ++attempt) {
      ++rearms;
      const bool drained = bystanders.drain();
      if (!drained || bystanders.totals().failures != 0) {
        FAIL("no worker died for 2 s, and the bystanders' jobs are stuck: "
             << bystanders.totals().describe() << "\n"
             << bystanders.diagnose() << "\n"
             << describe_ring(daemon.runtime_dir()));
      }
      // Both workers up and idle (a death may be on its way through the supervisor).
      json status;
      const bool idle = poll_until(
          [&] {
            status = try_status(daemon.runtime_dir());
            if (status.is_null() || status.at("pools").at(0).at("workers_ready") != 2) {
              return false;
            }
            for (const auto& w : status.at("pools").at(0).at("workers")) {
              if (w.value("busy", true) || w.value("pid", 0) <= 0) return false;
            }
            return true;
          },
          10s, 1ms);
      REQUIRE_MESSAGE(idle, "workers not idle with the bystanders drained: " << status.dump());
      if (::access(marker.path.c_str(), F_OK) == 0) {  // a late death after all
        died = true;
        --rearms;
        REQUIRE(bystanders.resume());
        break;
      }
      const pid_t pid = status.at("pools").at(0).at("workers").at(rearms % 2).value("pid", 0);
      const uint64_t restarts_before = sum_workers(status, "restarts");
      REQUIRE(::kill(pid, SIGKILL) == 0);
      REQUIRE(poll_until(
          [&] {
            const json now = try_status(daemon.runtime_dir());
            return !now.is_null() && sum_workers(now, "restarts") > restarts_before &&
                   now.at("pools").at(0).at("workers_ready") == 2;
          },
          10s, 1ms));
      REQUIRE(bystanders.resume());
      died = poll_until([&] { return ::access(marker.path.c_str(), F_OK) == 0; }, 10s,
                        std::chrono::microseconds(100));
    }
    if (!died) {
      FAIL("no worker died at " << std::string(point.name) << " within 10 s of a re-arm; "
                                << bystanders.totals().describe()
                                << "\nstatus: " << try_status(daemon.runtime_dir()).dump());
    }
    if (k < kills) ::unlink(marker.path.c_str());  // the last one stays: no more deaths
    const BystanderTotals t = bystanders.totals();
    if (t.failures != 0) {
      FAIL("a bystander saw an error: " << t.describe() << "\n"
                                        << bystanders.diagnose() << "\n"
                                        << describe_ring(daemon.runtime_dir()));
    }
  }
  // The daemon has seen every death and every worker is back.
  json status;
  const bool back = poll_until(
      [&] {
        status = try_status(daemon.runtime_dir());
        return !status.is_null() && sum_workers(status, "restarts") == kills + rearms &&
               status.at("pools").at(0).at("workers_ready") == 2;
      },
      20s, 1ms);
  REQUIRE_MESSAGE(back, "workers not back after " << kills << " kills: " << status.dump());
  std::printf(
      "worker fault point %s (hit %u): %u kills (and %u re-arms) in %.1f s; %s; %llu "
      "retries\n",
      point.name, hit, kills, rearms, static_cast<double>(monotonic_ns() - start) / 1e9,
      bystanders.totals().describe().c_str(),
      static_cast<unsigned long long>(retries_logged(daemon)));
  check_after_worker_kills(daemon, bystanders, kills + rearms, point.job_fails ? kills : 0,
                           point.job_fails ? kills : 0, point.uncounted ? kills : 0);
}

TEST_CASE("workers killed after popping a job: the job is requeued and runs once") {
  run_worker_point({"worker.popped", false, false});
}

TEST_CASE("workers killed after claiming a job: it fails once with WorkerDied") {
  run_worker_point({"worker.claimed", true, false});
}

TEST_CASE("workers killed while running a job: it fails once with WorkerDied") {
  run_worker_point({"worker.running", true, false});
}

TEST_CASE("workers killed before publishing a job's end: it fails once with WorkerDied") {
  run_worker_point({"worker.before_complete", true, false});
}

TEST_CASE("workers killed after publishing a job's end: the job stays Done") {
  run_worker_point({"worker.completed", false, true});
}

// The pid of worker `w` of pool 0 once the supervisor reports it ready (it may be restarting).
pid_t wait_worker_live(const DaemonProcess& daemon, uint32_t w) {
  json status;
  pid_t pid = 0;
  const bool live = poll_until(
      [&] {
        status = try_status(daemon.runtime_dir());
        if (status.is_null()) return false;
        const json& worker = status.at("pools").at(0).at("workers").at(w);
        pid = worker.value("pid", 0);
        return worker.value("state", std::string()) == "ready" && pid > 0;
      },
      10s, 1ms);
  REQUIRE_MESSAGE(live, "worker " << w << " did not come back within 10 s: " << status.dump());
  return pid;
}

TEST_CASE("workers killed from outside mid-job: jobs fail once with WorkerDied, none is lost") {
  const uint64_t seed = suite_seed();
  INFO("suite seed " << seed << " (GPUQ_FAULT_SEED=" << seed << " replays it)");
  DaemonProcess daemon(fault_config(2));
  QueueMapping queue;
  REQUIRE(map_queue_segment(daemon.runtime_dir(), &queue).empty());
  BystanderOptions o;
  o.runtime_dir = daemon.runtime_dir();
  o.allow_worker_died = true;
  o.sleep_share = 0.6;  // keep the workers busy, so that most kills land mid-job
  o.sleep_us_min = 200;
  o.sleep_us_max = 3000;
  o.retryable_share = 0.3;
  o.seed = derive_seed("worker-external", 1);
  Bystanders bystanders(o);
  bystanders.wait_connected();

  Rng rng(derive_seed("worker-external"));
  const uint32_t kills = iterations(100);
  uint32_t busy_kills = 0;
  const uint64_t start = monotonic_ns();
  for (uint32_t k = 1; k <= kills; ++k) {
    const uint32_t w = static_cast<uint32_t>(rng.between(0, 1));
    const uint64_t delay = rng.between(0, 1000);
    INFO("kill " << k << " of " << kills << ": worker " << w << ", " << delay
                 << " us after it is busy");
    // A live worker, by the supervisor's account.
    const pid_t pid = wait_worker_live(daemon, w);
    WorkerShm& ws = queue.view.worker(w);
    const uint32_t restarts = ws.restarts.load();
    // Kill it while it runs a job, most of the time (the bystanders queue mostly sleeps).
    const bool busy =
        poll_until([&] { return ws.busy.load() != 0; }, 200ms, std::chrono::microseconds(50));
    nap_us(delay);
    busy_kills += busy ? 1 : 0;
    REQUIRE(::kill(pid, SIGKILL) == 0);
    const bool seen = poll_until([&] { return ws.restarts.load() == restarts + 1; }, 10s,
                                 std::chrono::microseconds(100));
    REQUIRE_MESSAGE(
        seen, "the supervisor did not see worker " << w << " (pid " << pid << ") die within 10 s");
    const BystanderTotals t = bystanders.totals();
    if (t.failures != 0) {
      FAIL("a bystander saw an error: " << t.describe() << "\n"
                                        << bystanders.diagnose() << "\n"
                                        << describe_ring(daemon.runtime_dir()));
    }
  }
  std::printf("external worker kills: %u (%u while busy) in %.1f s; %s; %llu retries\n", kills,
              busy_kills, static_cast<double>(monotonic_ns() - start) / 1e9,
              bystanders.totals().describe().c_str(),
              static_cast<unsigned long long>(retries_logged(daemon)));
  // A kill between a job's published end and its count leaves it uncounted: at most one per kill.
  check_after_worker_kills(daemon, bystanders, kills, busy_kills > kills / 2 ? 1 : 0, kills, kills);
}

TEST_CASE("a respawned worker's state in the queue segment agrees with the supervisor's") {
  // The supervisor stores pid, busy = 0 and kStarting in a new worker's WorkerShm after fork(),
  // which races with the worker's own stores (kReady, and busy = 1 once it takes a job): when
  // the worker gets there first, the segment says "starting" for good while the worker serves
  // jobs (and "not busy" while it runs one, which the drain reads). Load from bystanders makes
  // the supervisor lose the race more often.
  const uint64_t seed = suite_seed();
  INFO("suite seed " << seed << " (GPUQ_FAULT_SEED=" << seed << " replays it)");
  DaemonProcess daemon(fault_config(2));
  QueueMapping queue;
  REQUIRE(map_queue_segment(daemon.runtime_dir(), &queue).empty());
  BystanderOptions o;
  o.runtime_dir = daemon.runtime_dir();
  o.allow_worker_died = true;
  o.pace_us = 0;
  o.seed = derive_seed("worker-shm-bystanders");
  Bystanders bystanders(o);
  bystanders.wait_connected();
  Rng rng(derive_seed("worker-shm"));
  const uint32_t kills = iterations(300);
  uint32_t disagreements = 0;
  std::string last;
  for (uint32_t k = 1; k <= kills; ++k) {
    const uint32_t w = static_cast<uint32_t>(rng.between(0, 1));
    INFO("kill " << k << " of " << kills << ": worker " << w);
    const pid_t pid = wait_worker_live(daemon, w);
    WorkerShm& ws = queue.view.worker(w);
    if (!poll_until(
            [&] {
              return ws.state.load() == static_cast<uint32_t>(WorkerState::kReady) &&
                     ws.pid.load() == pid;
            },
            1s, std::chrono::microseconds(100))) {
      ++disagreements;
      last = "worker " + std::to_string(w) + " (pid " + std::to_string(pid) +
             ") is ready in the status, but its WorkerShm says state " +
             std::to_string(ws.state.load()) + " (0 = starting), pid " +
             std::to_string(ws.pid.load());
    }
    const uint32_t restarts = ws.restarts.load();
    REQUIRE(::kill(pid, SIGKILL) == 0);
    REQUIRE(poll_until([&] { return ws.restarts.load() == restarts + 1; }, 10s,
                       std::chrono::microseconds(100)));
  }
  std::printf("worker shm state: %u of %u respawned workers disagreed with the status\n",
              disagreements, kills);
  CHECK_MESSAGE(disagreements == 0, disagreements << " of " << kills
                                                  << " respawned workers' WorkerShm disagree "
                                                     "with the status; last: "
                                                  << last);
  REQUIRE(bystanders.drain());
  CHECK(bystanders.totals().failures == 0);
  REQUIRE(bystanders.release());
}

// `count` idle clients in one child process, connected before anything else the test starts,
// so that their segments come first in the supervisor's MapClient messages to a new worker.
class ClientCrowd {
 public:
  ClientCrowd(const std::string& dir, int count) : memory_(4096), count_(count) {
    state_ = reinterpret_cast<std::atomic<int>*>(memory_.base());  // connected, or -1
    exit_ = state_ + 1;
    pid_ = fork_child([&]() -> int {
      std::vector<Client> clients;
      for (int i = 0; i < count; ++i) {
        auto c = Client::connect(connect_options(dir, 4096));
        if (!c) {
          state_->store(-1);
          return 1;
        }
        clients.push_back(std::move(c).value());
      }
      state_->store(count);
      while (exit_->load() == 0) nap_us(1000);
      return 0;
    });
    REQUIRE(pid_ > 0);
    REQUIRE(wait_until([&] { return state_->load() != 0; }, 60 * kSecond));
    REQUIRE_MESSAGE(state_->load() == count_,
                    "the crowd could not connect " << count_ << " clients");
  }
  ClientCrowd(const ClientCrowd&) = delete;
  ClientCrowd& operator=(const ClientCrowd&) = delete;
  ~ClientCrowd() {
    exit_->store(1);
    wait_child(pid_, 10 * kSecond);
  }

 private:
  SharedMemory memory_;
  std::atomic<int>* state_ = nullptr;
  std::atomic<int>* exit_ = nullptr;
  int count_;
  pid_t pid_ = 0;
};

TEST_CASE("a respawned worker runs the queued jobs of every client, the last to connect too") {
  // A new worker learns the current clients' segments from MapClient messages, which the
  // supervisor sends after fork(), one client after another in the order they connected, and
  // announces by bumping the worker's control_seq after each. A new worker that pops a job of a
  // client whose message is not there yet skips it as "an entry of a client that has gone": the
  // job stays queued, with no reference in any ring, for ever. The window is the supervisor's
  // time between fork() and the last message: a loaded machine can stretch it; here the test
  // stops the supervisor (SIGSTOP) as soon as the new worker's pid appears in the queue segment,
  // lets the worker start and pop, then continues it. 200 idle clients connected first keep the
  // bystanders' messages at the end of the line.
  const uint64_t seed = suite_seed();
  INFO("suite seed " << seed << " (GPUQ_FAULT_SEED=" << seed << " replays it)");
  constexpr int kCrowd = 200;
  DaemonProcess daemon(fault_config(2, {{"max_clients", kCrowd + 8}}));
  const std::string dir = daemon.runtime_dir();
  ClientCrowd crowd(dir, kCrowd);
  BystanderOptions o;
  o.runtime_dir = dir;
  o.allow_worker_died = true;
  o.pace_us = 0;
  o.wait_timeout = 5s;
  o.seed = derive_seed("respawn-crowd-bystanders");
  Bystanders bystanders(o);  // connected after the crowd: their messages come last
  bystanders.wait_connected();
  QueueMapping queue;
  REQUIRE(map_queue_segment(dir, &queue).empty());
  const PoolQueue lanes = queue.view.queue(0);
  const uint32_t respawns = iterations(20);
  for (uint32_t k = 1; k <= respawns; ++k) {
    INFO("respawn " << k << " of " << respawns);
    WorkerShm& ws = queue.view.worker(0);
    json status;
    pid_t old_pid = 0;
    const bool live = poll_until(
        [&] {
          status = try_status(dir);
          if (status.is_null()) return false;
          const json& worker = status.at("pools").at(0).at("workers").at(0);
          old_pid = worker.value("pid", 0);
          return worker.value("state", std::string()) == "ready" && old_pid > 0;
        },
        10s, 1ms);
    REQUIRE_MESSAGE(live, "worker 0 did not come back: " << status.dump());
    REQUIRE(::kill(old_pid, SIGKILL) == 0);
    // The supervisor stores the new pid right after fork(), before the MapClient messages.
    pid_t fresh = 0;
    REQUIRE(wait_until(
        [&] {
          fresh = ws.pid.load();
          return fresh > 0 && fresh != old_pid;
        },
        10 * kSecond));
    int mapped = -1;
    {
      ::kill(daemon.pid(), SIGSTOP);
      struct Continue {
        pid_t pid;
        ~Continue() { ::kill(pid, SIGCONT); }
      } resume{daemon.pid()};
      // The worker starts, reports ready (its own store), and pops whatever is queued.
      if (poll_until([&] { return ws.state.load() == static_cast<uint32_t>(WorkerState::kReady); },
                     500ms, std::chrono::microseconds(100))) {
        poll_until([&] { return lanes.size() == 0; }, 200ms, std::chrono::microseconds(100));
        mapped = count_client_memfd_mappings(fresh);
      }
    }
    INFO("the new worker had mapped " << mapped << " of " << kCrowd + 2
                                      << " client segments when it got ready (-1: it was not "
                                         "ready while the supervisor was stopped)");
    // Every job queued now must finish: each bystander finishes two rounds of its jobs in
    // flight, unless one of them is stuck (a bystander gives up on a job after 5 s). No worker
    // dies meanwhile, so no requeue puts a lost job back.
    std::vector<uint64_t> before;
    for (int i = 0; i < bystanders.count(); ++i) before.push_back(bystanders.finished_by(i));
    const bool flowing = poll_until(
        [&] {
          if (bystanders.totals().failures != 0) return false;
          for (int i = 0; i < bystanders.count(); ++i) {
            if (bystanders.finished_by(i) <
                before[static_cast<size_t>(i)] + 2 * static_cast<uint64_t>(o.in_flight)) {
              return false;
            }
          }
          return true;
        },
        20s, 1ms);
    if (!flowing) {
      FAIL("bystander jobs lost after a worker restart: " << bystanders.totals().describe() << "\n"
                                                          << bystanders.diagnose() << "\n"
                                                          << describe_ring(dir));
    }
  }
  REQUIRE(bystanders.drain(60s));
  CHECK(bystanders.totals().failures == 0);
  REQUIRE(bystanders.release());
}

TEST_CASE("a respawned worker maps the segment of every client, however many there are") {
  // The supervisor hands a new worker one MapClient message per client on a non-blocking
  // socketpair, before the worker reads any: with a few hundred clients the socket buffer
  // (net.core.wmem_default, 208 KiB here) fills, the rest fail with EAGAIN ("cannot send to
  // worker"), and the new worker never learns of those clients: it skips every job of theirs.
  // The supervisor holds three descriptors per client (socket, pidfd, segment): as many
  // clients as the descriptor limit allows, up to 400. The daemon raises its soft limit to the
  // hard one; so does this process, for the crowd's two descriptors per client.
  rlimit lim{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &lim) == 0);
  lim.rlim_cur = lim.rlim_max;
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &lim) == 0);
  const int kCrowd = static_cast<int>(std::min<rlim_t>(400, (lim.rlim_cur - 64) / 3));
  REQUIRE_MESSAGE(kCrowd >= 100, "RLIMIT_NOFILE " << lim.rlim_cur << " is too low for a crowd");
  DaemonProcess daemon(fault_config(2, {{"max_clients", kCrowd + 8}}));
  const std::string dir = daemon.runtime_dir();
  ClientCrowd crowd(dir, kCrowd);
  QueueMapping queue;
  REQUIRE(map_queue_segment(dir, &queue).empty());
  const pid_t before = daemon.worker_pids().at(0);
  // A live worker hears of each client as it connects (a burst of connections can overflow its
  // socket the same way) and maps the segment when it reads the message: allow it the time to
  // catch up with the crowd.
  int mapped_before = 0;
  poll_until(
      [&] {
        mapped_before = count_client_memfd_mappings(before);
        return mapped_before == kCrowd;
      },
      10s, 1ms);
  CHECK_MESSAGE(mapped_before == kCrowd,
                "a live worker maps " << mapped_before << " of " << kCrowd << " client segments");
  WorkerShm& ws = queue.view.worker(0);
  const uint32_t restarts = ws.restarts.load();
  REQUIRE(::kill(before, SIGKILL) == 0);
  json status;
  pid_t after = 0;
  const bool back = poll_until(
      [&] {
        status = try_status(dir);
        if (status.is_null() || ws.restarts.load() == restarts) return false;
        const json& worker = status.at("pools").at(0).at("workers").at(0);
        after = worker.value("pid", 0);
        return worker.value("state", std::string()) == "ready" && after > 0 && after != before;
      },
      10s, 1ms);
  REQUIRE_MESSAGE(back, "worker 0 did not come back: " << status.dump());
  int mapped = 0;
  const bool all = poll_until(
      [&] {
        mapped = count_client_memfd_mappings(after);
        return mapped == kCrowd;
      },
      10s, 1ms);
  const std::string log = daemon.log();
  const size_t lost = [&] {
    size_t n = 0;
    for (size_t at = log.find("cannot send to worker"); at != std::string::npos;
         at = log.find("cannot send to worker", at + 1)) {
      ++n;
    }
    return n;
  }();
  CHECK_MESSAGE(all, "the respawned worker maps " << mapped << " of " << kCrowd
                                                  << " client segments; the supervisor logged "
                                                  << lost << " 'cannot send to worker' warnings");
}

// Makes every worker that starts from now on fail before it is ready, until destroyed: hides
// the queue segment (renames it in /dev/shm), which a starting worker opens by name and exits 1
// without. Processes that have it mapped already (the supervisor, live workers, connected
// clients) are not affected.
class StartFailures {
 public:
  explicit StartFailures(const std::string& segment_name)
      : path_("/dev/shm/" + segment_name), hidden_(path_ + ".hidden") {
    REQUIRE_MESSAGE(::rename(path_.c_str(), hidden_.c_str()) == 0,
                    "rename " << path_ << ": " << std::strerror(errno));
  }
  StartFailures(const StartFailures&) = delete;
  StartFailures& operator=(const StartFailures&) = delete;
  ~StartFailures() { ::rename(hidden_.c_str(), path_.c_str()); }

 private:
  std::string path_, hidden_;
};

// The status entry of worker `w` of pool 0 (null when the daemon does not answer).
json worker_status(const DaemonProcess& daemon, uint32_t w) {
  const json status = try_status(daemon.runtime_dir());
  return status.is_null() ? json() : status.at("pools").at(0).at("workers").at(w);
}

// Kills worker `w` (ready) while its replacements cannot start, and waits until the supervisor
// marks it failed. Returns its status entry then.
json kill_until_failed(DaemonProcess& daemon, uint32_t w) {
  const json pool_before = daemon.status().at("pools").at(0);
  const int ready_before = pool_before.at("workers_ready").get<int>();
  const json before = pool_before.at("workers").at(w);
  REQUIRE(before.at("state") == "ready");
  const pid_t pid = before.at("pid").get<pid_t>();
  REQUIRE(::kill(pid, SIGKILL) == 0);
  // Health counts only live, ready workers: the dead one at once, while it is restarting.
  json status;
  const bool noticed = poll_until(
      [&] {
        status = try_status(daemon.runtime_dir());
        return !status.is_null() &&
               status.at("pools").at(0).at("workers").at(w).at("state") != "ready";
      },
      10s, 1ms);
  REQUIRE_MESSAGE(noticed,
                  "the supervisor did not notice worker " << w << " die: " << status.dump());
  CHECK(status.at("pools").at(0).at("workers_ready").get<int>() == ready_before - 1);
  // Back-off 100, 200, 400, 800, 1600 ms, then failed: about 3 s to the fifth failure.
  json worker;
  const bool failed = poll_until(
      [&] {
        worker = worker_status(daemon, w);
        return !worker.is_null() && worker.at("state") == "failed";
      },
      30s, 5ms);
  REQUIRE_MESSAGE(failed, "worker " << w << " not marked failed: " << worker.dump());
  return worker;
}

TEST_CASE(
    "a worker that keeps dying at start-up is marked failed, tried again for good, and comes "
    "back by itself; health says so throughout") {
  // Back-off from 100 ms, doubling; failed after max_start_failures (5) failures in a row,
  // then tried again every start_backoff_initial_ms (300 ms), doubling to 600. No fault point
  // comes before a worker's ready report, and a worker killed after it is ready does not count
  // as a start failure; so the test makes the replacements fail at start by hiding the queue
  // segment they open.
  DaemonProcess daemon(
      one_pool_config(2, {{"start_backoff_initial_ms", 300}, {"start_backoff_max_ms", 600}}));
  QueueMapping queue;
  REQUIRE(map_queue_segment(daemon.runtime_dir(), &queue).empty());
  const std::string ready_command =
      std::string("'") + gpuqctl_path() + "' --runtime-dir '" + daemon.runtime_dir() + "' ready";
  Client client = connect_client(daemon);
  CHECK(run_command(ready_command).exit_code == 0);

  {
    StartFailures failing(queue.name);
    const json first = kill_until_failed(daemon, 0);
    INFO("worker 0: " << first.dump());
    CHECK(first.at("start_failures") == 5);
    CHECK(first.at("restarts") == 6);  // the kill, then 5 start failures: each one restarted
    CHECK(first.at("last_exit").get<std::string>().find("before it was ready") !=
          std::string::npos);
    CHECK_FALSE(first.at("start_error").get<std::string>().empty());
    json status = daemon.status();
    INFO("status: " << status.dump());
    CHECK(status.at("pools").at(0).at("workers_ready") == 1);
    CHECK(status.at("pools").at(0).at("status") == "degraded");
    CHECK(status.at("ready") == true);  // one live worker still serves the pool
    CHECK(run_command(ready_command).exit_code == 0);
    CHECK(daemon.log().find("marked failed, trying again in 300 ms") != std::string::npos);
    // Exponential back-off: restart delays double from restart_backoff_initial_ms (100).
    std::vector<uint32_t> delays;
    {
      const std::string log = daemon.log();
      const std::regex line("worker 0 \\(pid [0-9]+\\) [^\\n]*; restarting in ([0-9]+) ms");
      for (std::sregex_iterator it(log.begin(), log.end(), line), end; it != end; ++it) {
        delays.push_back(static_cast<uint32_t>(std::stoul((*it)[1].str())));
      }
    }
    CHECK(delays == std::vector<uint32_t>{100, 200, 400, 800, 1600});
    check_echo_works(client);  // on the worker that is left

    // Failed is not the end: it is tried again, and fails again, every start back-off.
    json worker;
    CHECK_MESSAGE(poll_until(
                      [&] {
                        worker = worker_status(daemon, 0);
                        return !worker.is_null() && worker.at("start_failures") >= 7;
                      },
                      20s, 5ms),
                  "worker 0 was not tried again: " << worker.dump());
    CHECK(daemon.log().find("failed to start 7 times in a row: marked failed, trying again in "
                            "600 ms") != std::string::npos);
    const std::string text = run_command(std::string("'") + gpuqctl_path() + "' --runtime-dir '" +
                                         daemon.runtime_dir() + "' status")
                                 .output;
    CHECK_MESSAGE(text.find("worker 0: failed to start ") != std::string::npos, text);
    CHECK_MESSAGE(text.find("before it was ready") != std::string::npos, text);
  }  // the segment is back: the next start succeeds

  json worker;
  CHECK_MESSAGE(poll_until(
                    [&] {
                      worker = worker_status(daemon, 0);
                      return !worker.is_null() && worker.at("state") == "ready";
                    },
                    20s, 5ms),
                "worker 0 did not come back: " << worker.dump());
  CHECK(worker.at("start_failures") == 0);
  CHECK(worker.at("next_start_ms").is_null());
  json status = daemon.status();
  CHECK(status.at("pools").at(0).at("status") == "ready");
  CHECK(status.at("ready") == true);
  // It serves: the client's jobs run on both workers again (each one's echo, by its id).
  std::set<uint32_t> served_by;
  for (int i = 0; i < 200 && served_by.size() < 2; ++i) {
    Job job = submit_ok(client, sleep_spec(2000));
    Job other = submit_ok(client, sleep_spec(2000));
    served_by.insert(wait_done(job).worker_id);
    served_by.insert(wait_done(other).worker_id);
  }
  CHECK(served_by == std::set<uint32_t>{0, 1});
  const ChildExit exit = daemon.terminate();
  CHECK_MESSAGE(exit.ok(), "gpuqd " << exit.describe());
}

TEST_CASE(
    "a pool whose workers all keep dying at start-up fails its jobs with PoolDown within "
    "pool_down_fail_ms, refuses new ones at once, and serves again when a worker starts") {
  constexpr auto kDownAfter = 2000ms;
  DaemonProcess daemon(one_pool_config(2, {{"pool_down_fail_ms", kDownAfter.count()},
                                           {"start_backoff_initial_ms", 200},
                                           {"start_backoff_max_ms", 400}}));
  QueueMapping queue;
  REQUIRE(map_queue_segment(daemon.runtime_dir(), &queue).empty());
  Client client = connect_client(daemon);
  check_echo_works(client);
  const std::string gpuqctl =
      std::string("'") + gpuqctl_path() + "' --runtime-dir '" + daemon.runtime_dir() + "' ";
  {
    StartFailures failing(queue.name);
    const auto killed_at = std::chrono::steady_clock::now();
    for (uint32_t w : {0u, 1u}) {
      REQUIRE(::kill(daemon.status().at("pools").at(0).at("workers").at(w).at("pid").get<pid_t>(),
                     SIGKILL) == 0);
    }
    // Jobs queue while the pool has no ready worker: as many as this client's share holds,
    // and one more that waits for room in it.
    const uint32_t share = daemon.status().at("pools").at(0).at("client_share").get<uint32_t>();
    std::vector<Job> queued;
    std::vector<std::chrono::steady_clock::time_point> submitted_at;
    for (uint32_t i = 0; i < share; ++i) {
      auto job = client.try_submit(noop_spec());
      REQUIRE_MESSAGE(job.ok(), "submit " << i << ": " << error_text(job));
      queued.push_back(std::move(*job));
      submitted_at.push_back(std::chrono::steady_clock::now());
    }
    const auto blocked_from = std::chrono::steady_clock::now();
    auto blocked = client.submit(noop_spec(), 30s);
    const auto blocked_until = std::chrono::steady_clock::now();
    REQUIRE_FALSE(blocked.ok());
    CHECK(blocked.error().code() == ErrorCode::kPoolDown);
    CHECK(blocked_until - blocked_from <= kDownAfter + 1s);
    // Not before pool_down_fail_ms: the clock started when the last ready worker died.
    CHECK(blocked_until - killed_at >= kDownAfter - 100ms);
    const std::string why = blocked.error().message();
    INFO("PoolDown: " << why);
    CHECK(why.find("pool 'cpu' is down (no ready worker for 2000 ms): worker ") == 0);
    CHECK(why.find("before it was ready") != std::string::npos);

    for (size_t i = 0; i < queued.size(); ++i) {
      JobResult r = wait_result(queued[i], 10s);
      CHECK(r.status == JobStatus::kFailed);
      CHECK(r.code == ErrorCode::kPoolDown);
      CHECK(r.message.find("pool 'cpu' is down (no ready worker for 2000 ms)") == 0);
      CHECK(r.run_ns == 0);
    }
    // Ended by the time the blocked submit saw the pool down: within the bound of their own
    // submits as well.
    CHECK(blocked_until - submitted_at.front() <= kDownAfter + 1s);

    // New jobs fail at once, blocking or not, while the pool stays down.
    for (int i = 0; i < 3; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      auto now_refused = client.submit(noop_spec(), 30s);
      const auto took = std::chrono::steady_clock::now() - t0;
      REQUIRE_FALSE(now_refused.ok());
      CHECK(now_refused.error().code() == ErrorCode::kPoolDown);
      CHECK(took < 500ms);
      auto try_refused = client.try_submit(noop_spec());
      REQUIRE_FALSE(try_refused.ok());
      CHECK(try_refused.error().code() == ErrorCode::kPoolDown);
    }
    const json status = daemon.status();
    INFO("status: " << status.dump());
    const json& pool = status.at("pools").at(0);
    CHECK(pool.at("failing_jobs") == true);
    CHECK(pool.at("accepting") == false);
    CHECK(pool.at("status") == "down");
    CHECK(pool.at("queue_depth") == 0);
    CHECK(pool.at("failing_jobs_error").get<std::string>().find("pool 'cpu'") == 0);
    CHECK(status.at("ready") == false);
    const CommandResult text = run_command(gpuqctl + "status");
    CHECK_MESSAGE(
        text.output.find("jobs fail with PoolDown: pool 'cpu' is down (no ready worker") !=
            std::string::npos,
        text.output);
    const CommandResult metrics = run_command(gpuqctl + "metrics");
    CHECK_MESSAGE(metrics.output.find("gpuq_pool_down{pool=\"cpu\"} 1") != std::string::npos,
                  metrics.output);
    CHECK_MESSAGE(
        metrics.output.find("outcome=\"pool_down\"} " + std::to_string(share)) != std::string::npos,
        metrics.output);
    CHECK(run_command(gpuqctl + "ready").exit_code == 1);
  }  // the segment is back: the next start succeeds

  // Back by itself, at the next try: the pool takes jobs again.
  json status;
  CHECK_MESSAGE(poll_until(
                    [&] {
                      status = try_status(daemon.runtime_dir());
                      return !status.is_null() &&
                             status.at("pools").at(0).at("workers_ready").get<int>() > 0;
                    },
                    20s, 5ms),
                "no worker came back: " << status.dump());
  CHECK_MESSAGE(poll_until(
                    [&] {
                      status = try_status(daemon.runtime_dir());
                      return !status.is_null() && status.at("pools").at(0).at("accepting") == true;
                    },
                    5s, 5ms),
                status.dump());
  CHECK(status.at("pools").at(0).at("failing_jobs") == false);
  check_echo_works(client);
  const ChildExit exit = daemon.terminate();
  CHECK_MESSAGE(exit.ok(), "gpuqd " << exit.describe());
}

}  // namespace
}  // namespace gpuq::test::fault
