// Fault injection: client processes die with SIGKILL at the client library's fault points (a job
// slot taken, half a descriptor written, before and after the ring push, asleep in wait) and by
// an external SIGKILL at random moments (while copying into its payload buffer, while waiting,
// anywhere), hundreds of times against one daemon, while two bystander clients keep verified
// jobs flowing.
//
// After every kill, within a deadline (never a fixed sleep):
//   - every job the victim had been given back from submit() is in exactly one of its slots, in
//     a terminal state, and no slot is left queued or running (the test opened the victim's
//     segment through /proc before letting it work, so it can look after the death);
//   - the daemon has let go of the victim: `clients` counts only the bystanders, gpuqd holds
//     and every worker maps only the bystanders' segments;
//   - the bystanders have seen no error.
// At the end: the bystanders drain (every job they submitted ended Done with the right output),
// queue depth and held cells are 0, every worker is ready and was never restarted, every retired
// client index is released, and a new client is served.
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <map>

#include "fault/fault_support.hpp"
#include "integration/integration_support.hpp"

namespace gpuq::test::fault {
namespace {

constexpr const char* kClientPoints[] = {
    "client.submit.slot_acquired", "client.submit.mid_descriptor", "client.submit.before_push",
    "client.submit.before_mark",   "client.submit.after_push",     "client.wait.sleeping",
};

constexpr int kBystanders = 2;

void nap_us(uint64_t us) {
  timespec ts{static_cast<time_t>(us / 1'000'000), static_cast<long>(us % 1'000'000) * 1000};
  nanosleep(&ts, nullptr);
}

// Runs victims one at a time against `daemon`, and checks after each death that the daemon
// reclaimed everything it held.
class VictimRunner {
 public:
  VictimRunner(DaemonProcess& daemon, Bystanders& bystanders)
      : daemon_(daemon), bystanders_(bystanders), memory_(sizeof(VictimState) + 4096) {
    SharedArena arena(memory_);
    state_ = arena.make_array<VictimState>(1);
  }

  // Runs one victim to its death: by its fault point if `kill_after_us` < 0, else by SIGKILL
  // that long after it starts working. `label` names the iteration in failure messages.
  void run(const VictimPlan& plan, int64_t kill_after_us, const std::string& label) {
    INFO(label);
    VictimState& st = *state_;
    st.reset();
    const pid_t pid = fork_child([&]() -> int { return run_victim(st, plan); });
    REQUIRE_MESSAGE(pid > 0, "fork: " << std::strerror(errno));
    const bool connected = wait_until(
        [&] {
          return st.phase.load(std::memory_order_acquire) >= 1 ||
                 st.has_error.load(std::memory_order_acquire) != 0;
        },
        10 * kSecond);
    if (!connected || st.phase.load() < 1) {
      const ChildExit exit = wait_child(pid, 5 * kSecond);
      FAIL("the victim did not connect: " << exit.describe() << ": " << st.error);
    }
    ForeignSegment segment;
    const std::string opened = segment.open(pid, st.memfd_fd.load());
    if (!opened.empty()) {
      ::kill(pid, SIGKILL);
      wait_child(pid, 5 * kSecond);
      FAIL("cannot open the victim's segment: " << opened);
    }
    st.phase.store(2, std::memory_order_release);
    if (kill_after_us >= 0) {
      nap_us(static_cast<uint64_t>(kill_after_us));
      ::kill(pid, SIGKILL);
    }
    const ChildExit exit = wait_child(pid, 60 * kSecond);
    if (exit.signal != SIGKILL) {
      FAIL("the victim was to die by SIGKILL but "
           << exit.describe() << " (accepted " << st.accepted.load()
           << " jobs): " << (st.has_error.load() ? st.error : ""));
    }

    // What the victim left in flight (the supervisor may already have cancelled some).
    for (uint32_t i = 0; i < segment.slot_count(); ++i) {
      const JobState s = segment.word(i).state;
      if (s == JobState::kSubmitted) ++queued_at_death_;
      if (s == JobState::kRunning) ++running_at_death_;
    }

    // The daemon must let go of everything the victim held.
    std::string why;
    nlohmann::json status;
    IdleExpectations expect;
    expect.live_clients = bystanders_.count();
    expect.queues_empty = false;  // the bystanders keep working
    expect.workers_idle = false;
    const bool settled = poll_until(
        [&] {
          why = victim_slots_settled(segment, st);
          if (!why.empty()) return false;
          return daemon_idle(daemon_.runtime_dir(), daemon_.pid(), expect, &why, &status);
        },
        10s);
    if (!settled) {
      FAIL("not reclaimed within 10 s of the victim's death: "
           << why << "\nvictim: accepted " << st.accepted.load()
           << " jobs; slots in use: " << segment.describe() << "\nstatus: " << status.dump());
    }
    const BystanderTotals totals = bystanders_.totals();
    if (totals.failures != 0) {
      FAIL("a bystander was disturbed: " << totals.describe() << "\n"
                                         << bystanders_.diagnose() << "\n"
                                         << describe_ring(daemon_.runtime_dir()));
    }
    accepted_ += st.accepted.load();
  }

  // "N jobs accepted; seen queued at death M, running K".
  std::string describe() const {
    return std::to_string(accepted_) + " victim jobs accepted; seen at the victims' deaths: " +
           std::to_string(queued_at_death_) + " queued, " + std::to_string(running_at_death_) +
           " running";
  }

 private:
  DaemonProcess& daemon_;
  Bystanders& bystanders_;
  SharedMemory memory_;
  VictimState* state_ = nullptr;
  uint64_t accepted_ = 0;
  uint64_t queued_at_death_ = 0;
  uint64_t running_at_death_ = 0;
};

BystanderOptions bystander_options(const DaemonProcess& daemon, const char* what) {
  BystanderOptions o;
  o.runtime_dir = daemon.runtime_dir();
  o.count = kBystanders;
  o.seed = derive_seed(what);
  return o;
}

// After the kills: the bystanders drain and leave, the daemon is idle, no worker was restarted,
// and a new client is served.
void check_daemon_recovered(DaemonProcess& daemon, Bystanders& bystanders) {
  if (!bystanders.drain()) {
    FAIL("bystander jobs stuck: " << bystanders.totals().describe() << "\n"
                                  << bystanders.diagnose() << "\n"
                                  << describe_ring(daemon.runtime_dir()));
  }
  const BystanderTotals totals = bystanders.totals();
  INFO(totals.describe());
  CHECK(totals.failures == 0);
  CHECK(totals.worker_died == 0);
  CHECK(totals.submitted == totals.done);
  CHECK(totals.done > 0);

  std::string why;
  nlohmann::json status;
  IdleExpectations connected;
  connected.live_clients = bystanders.count();
  const bool idle = poll_until(
      [&] { return daemon_idle(daemon.runtime_dir(), daemon.pid(), connected, &why, &status); },
      10s, 1ms);
  CHECK_MESSAGE(idle, "not idle with only the bystanders connected: " << why << "\n"
                                                                      << status.dump());
  status = release_and_expect_empty(bystanders, daemon.runtime_dir(), daemon.pid());
  for (const auto& pool : status.at("pools")) {
    for (const auto& w : pool.at("workers")) {
      INFO("worker " << w.dump());
      CHECK(w.at("restarts") == 0);  // a client's death never costs a worker
    }
    CHECK(pool.at("jobs_completed").get<uint64_t>() <= pool.at("jobs_submitted").get<uint64_t>());
  }

  {
    Client fresh = connect_client(daemon);
    check_echo_works(fresh);
    check_echo_works(fresh, 1 << 20, 11);
  }
  const ChildExit exit = daemon.terminate();
  CHECK_MESSAGE(exit.ok(), "gpuqd " << exit.describe());
}

TEST_CASE("clients killed at every client fault point: nothing lost, leaked or stuck") {
  const uint64_t seed = suite_seed();
  INFO("suite seed " << seed << " (GPUQ_FAULT_SEED=" << seed << " replays it)");
  DaemonProcess daemon(fault_config(2));
  Bystanders bystanders(bystander_options(daemon, "client-points-bystanders"));
  bystanders.wait_connected();
  VictimRunner runner(daemon, bystanders);

  Rng rng(derive_seed("client-points"));
  const uint32_t per_point = iterations(200);
  std::vector<int> schedule;
  for (int p = 0; p < static_cast<int>(std::size(kClientPoints)); ++p) {
    schedule.insert(schedule.end(), per_point, p);
  }
  for (size_t i = schedule.size(); i > 1; --i) {
    std::swap(schedule[i - 1], schedule[rng.between(0, i - 1)]);
  }
  std::map<std::string, uint32_t> kills;
  const uint64_t start = monotonic_ns();
  for (size_t i = 0; i < schedule.size(); ++i) {
    const std::string point = kClientPoints[schedule[i]];
    const bool wait_point = point == "client.wait.sleeping";
    VictimPlan plan;
    plan.runtime_dir = daemon.runtime_dir();
    plan.fault_point = point;
    plan.fault_hit = static_cast<uint32_t>(wait_point ? rng.between(1, 4) : rng.between(1, 10));
    plan.workload =
        wait_point && rng.chance(0.5) ? VictimWorkload::kWaiting : VictimWorkload::kMixed;
    plan.spin = rng.chance(0.5);
    plan.seed = rng.next();
    std::ostringstream label;
    label << "kill " << i + 1 << " of " << schedule.size() << ": fault point " << point << ":"
          << plan.fault_hit << (plan.workload == VictimWorkload::kWaiting ? " (waiting" : " (mixed")
          << " workload, spin " << plan.spin << "), suite seed " << seed;
    runner.run(plan, -1, label.str());
    ++kills[point];
  }
  std::printf("client fault points: %zu kills in %.1f s (", schedule.size(),
              static_cast<double>(monotonic_ns() - start) / 1e9);
  for (const auto& [point, n] : kills) std::printf(" %s %u", point.c_str(), n);
  std::printf(" ); %s; %s\n", runner.describe().c_str(), bystanders.totals().describe().c_str());
  check_daemon_recovered(daemon, bystanders);
}

TEST_CASE("clients killed from outside: mid-copy, mid-wait, at random moments") {
  const uint64_t seed = suite_seed();
  INFO("suite seed " << seed << " (GPUQ_FAULT_SEED=" << seed << " replays it)");
  DaemonProcess daemon(fault_config(2));
  Bystanders bystanders(bystander_options(daemon, "client-external-bystanders"));
  bystanders.wait_connected();
  VictimRunner runner(daemon, bystanders);

  struct Kind {
    const char* name;
    VictimWorkload workload;
    uint64_t min_us, max_us;  // when the SIGKILL comes, after the victim starts working
  };
  const Kind kinds[] = {
      {"mid-copy", VictimWorkload::kCopying, 500, 4000},
      {"mid-wait", VictimWorkload::kWaiting, 0, 8000},
      {"random", VictimWorkload::kMixed, 0, 5000},
  };
  Rng rng(derive_seed("client-external"));
  const uint32_t per_kind = iterations(100);
  std::vector<int> schedule;
  for (int k = 0; k < 3; ++k) schedule.insert(schedule.end(), per_kind, k);
  for (size_t i = schedule.size(); i > 1; --i) {
    std::swap(schedule[i - 1], schedule[rng.between(0, i - 1)]);
  }
  const uint64_t start = monotonic_ns();
  for (size_t i = 0; i < schedule.size(); ++i) {
    const Kind& kind = kinds[schedule[i]];
    VictimPlan plan;
    plan.runtime_dir = daemon.runtime_dir();
    plan.workload = kind.workload;
    plan.spin = rng.chance(0.5);
    plan.seed = rng.next();
    const int64_t after = static_cast<int64_t>(rng.between(kind.min_us, kind.max_us));
    std::ostringstream label;
    label << "kill " << i + 1 << " of " << schedule.size() << ": SIGKILL " << kind.name << " after "
          << after << " us (spin " << plan.spin << "), suite seed " << seed;
    runner.run(plan, after, label.str());
  }
  std::printf("external client kills: %zu (%u each mid-copy, mid-wait, random) in %.1f s; %s; %s\n",
              schedule.size(), per_kind, static_cast<double>(monotonic_ns() - start) / 1e9,
              runner.describe().c_str(), bystanders.totals().describe().c_str());
  check_daemon_recovered(daemon, bystanders);
}

}  // namespace
}  // namespace gpuq::test::fault
