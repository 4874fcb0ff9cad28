// Fault injection: the supervisor (gpuqd) dies with SIGKILL, from outside at a random moment and
// at its fault points (accepting a connection, unregistering a client), with clients in the
// middle of calls; then a new gpuqd starts in the same runtime directory, over what the old one
// left (socket file, lock file, queue segment in /dev/shm), and the same clients reconnect.
//
// Four long-lived client processes (subjects) live through every daemon of a test case:
//   waiter     a 30 s sleep job in flight, blocked in wait() with no timeout;
//   submitter  its share of a one-worker pool full, blocked in submit() with no timeout;
//   looper     echo jobs back to back, each checked;
//   idle       connected and doing nothing; its next call comes after the death.
// Per daemon: they (re)connect (Client::reconnect, except idle, which connects anew), check an
// echo, start their calls; the daemon dies; then, within a bound:
//   - every worker of the dead daemon has exited (no orphans) within 1 s;
//   - every call in progress has returned Disconnected within 3 s (no hang), and the idle
//     client's next call does too, as does a new connect while no daemon listens;
//   - a new gpuqd starts cleanly over the leftovers, with a new epoch, and has removed the old
//     queue segment; the subjects' reconnect() succeeds and the old connection's jobs say
//     Disconnected.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <optional>

#include "fault/fault_support.hpp"
#include "integration/integration_support.hpp"

namespace gpuq::test::fault {
namespace {

using nlohmann::json;

enum Role : int { kWaiter = 0, kSubmitter = 1, kLooper = 2, kIdle = 3, kRoles = 4 };
constexpr const char* kRoleNames[] = {"waiter", "submitter", "looper", "idle"};

// How long a call in progress may take to see that the daemon died (it checks every 20 ms).
constexpr uint64_t kDisconnectBoundNs = 3 * kSecond;
// How long the dead daemon's workers may outlive it.
constexpr uint64_t kWorkerExitBoundNs = 1 * kSecond;

// Pool "cpu" (2 workers) for the waiter, looper and idle client; pool "tiny" (1 worker, a ring
// of 2 cells, 1 per client) for the submitter, whose share it fills.
std::string supervisor_config() {
  return json{{"queue_factor", 2},
              {"client_queue_share", 0.5},
              {"pools", json::array({{{"name", "cpu"}, {"kind", "cpu"}, {"workers", 2}},
                                     {{"name", "tiny"}, {"kind", "cpu"}, {"workers", 1}}})}}
      .dump();
}

struct SubjectState {
  // This daemon's round: 0 not yet, 1 connected and echo checked, 2 in its call, 3 the call
  // returned, 4 could not connect (the daemon died first).
  std::atomic<uint32_t> phase;
  std::atomic<int32_t> connect_code;  // of this round's connect or reconnect
  std::atomic<int32_t> call_code;     // what the call in progress returned (0: it succeeded)
  // waiter: its previous connection's job, waited for after reconnect (Disconnected expected);
  // idle: a new connect() while the daemon is dead (Disconnected expected).
  std::atomic<int32_t> extra_code;
  std::atomic<uint64_t> returned_ns;
  std::atomic<uint64_t> connects_ok;
  std::atomic<uint64_t> echoes_ok;
  std::atomic<uint32_t> has_error;
  char error[256];
};

struct Shared {
  std::atomic<uint32_t> go_connect;  // round r: (re)connect to the daemon now running
  std::atomic<uint32_t> go_call;     // round r: start the call that the death interrupts
  std::atomic<uint32_t> dead;        // round r: the daemon is dead
  std::atomic<uint32_t> stop;
  SubjectState subjects[kRoles];
};

int32_t code_of(const Error& e) {
  return static_cast<int32_t>(e.code());
}

void subject_error(SubjectState& st, const std::string& text) {
  uint32_t expected = 0;
  if (st.has_error.compare_exchange_strong(expected, 1)) {
    std::snprintf(st.error, sizeof st.error, "%s", text.c_str());
  }
}

// Waits (polling) until `pred` or the test says stop; false on stop or after 300 s.
template <typename Pred>
bool subject_wait(Shared& sh, Pred&& pred) {
  return poll_until([&] { return pred() || sh.stop.load() != 0; }, 300s, 200us) &&
         sh.stop.load() == 0;
}

// An echo of 4 KiB on `client`: 0 if it came back byte for byte, else an error code (or -1 for
// a wrong output).
int32_t echo_check(Client& client, Rng& rng) {
  auto in = client.allocate(4096);
  auto out = client.allocate(4096);
  if (!in) return code_of(in.error());
  if (!out) return code_of(out.error());
  rng.fill(in->data(), 4096);
  std::memset(out->data(), 0, 4096);
  JobSpec spec;
  spec.op = "echo";
  spec.input = *in;
  spec.output = *out;
  auto job = client.submit(spec, 10s);
  if (!job) return code_of(job.error());
  auto r = job->wait(30s);
  if (!r) return code_of(r.error());
  if (r->status != JobStatus::kDone || std::memcmp(in->data(), out->data(), 4096) != 0) return -1;
  client.release(*in);
  client.release(*out);
  return 0;
}

JobSpec long_sleep(const char* pool) {
  JobSpec spec;
  spec.op = "sleep";
  spec.pool = pool;
  spec.params.push_back(JobParam::integer("us", 30'000'000));
  return spec;
}

int subject_main(Shared& sh, int role, const std::string& dir, uint64_t seed) {
  SubjectState& st = sh.subjects[role];
  Rng rng(seed);
  ConnectOptions options;
  options.runtime_dir = dir;
  options.segment_bytes = 1 << 20;
  options.name = kRoleNames[role];
  options.spin = rng.chance(0.5) ? std::chrono::nanoseconds(50'000) : std::chrono::nanoseconds(0);
  std::optional<Client> client;
  Job old_job;            // the waiter's job on the previous connection
  std::vector<Job> held;  // the submitter's jobs
  for (uint32_t round = 1;; ++round) {
    if (!subject_wait(sh, [&] { return sh.go_connect.load() >= round; })) break;
    // Connect: the idle client anew each time, the others by reconnect().
    Error failed;
    bool connected = true;
    if (role == kIdle || !client) {
      client.reset();
      auto c = Client::connect(options);
      if (c) {
        client.emplace(std::move(c).value());
      } else {
        connected = false;
        failed = c.error();
      }
    } else if (auto r = client->reconnect(); !r) {
      connected = false;
      failed = r.error();
    }
    if (!connected) {
      st.connect_code.store(code_of(failed));
      st.phase.store(4);
      continue;
    }
    st.connect_code.store(0);
    st.connects_ok.fetch_add(1);
    held.clear();
    if (old_job.valid()) {
      auto r = old_job.wait(std::chrono::milliseconds(100));
      st.extra_code.store(r ? 0 : code_of(r.error()));
      old_job = Job();
    }
    if (const int32_t echo = echo_check(*client, rng); echo != 0) {
      if (echo == static_cast<int32_t>(ErrorCode::kDisconnected)) {
        st.phase.store(4);  // the daemon died already
        continue;
      }
      subject_error(st, std::string(kRoleNames[role]) +
                            ": echo after connecting failed: " + std::to_string(echo));
    } else {
      st.echoes_ok.fetch_add(1);
    }
    st.phase.store(1);
    if (!subject_wait(sh, [&] { return sh.go_call.load() >= round; })) break;

    int32_t code = 0;
    switch (role) {
      case kWaiter: {
        auto job = client->submit(long_sleep("cpu"), 10s);
        if (!job) {
          code = code_of(job.error());
          break;
        }
        st.phase.store(2);
        auto r = job->wait();
        code = r ? 0 : code_of(r.error());
        old_job = std::move(job).value();
        break;
      }
      case kSubmitter: {
        // The pool's one worker runs the first sleep; its ring then takes one more job of this
        // client (its share), and the next submit waits for room that never comes.
        st.phase.store(2);
        for (int i = 0; i < 32; ++i) {
          auto job = client->submit(long_sleep("tiny"));
          if (!job) {
            code = code_of(job.error());
            break;
          }
          held.push_back(std::move(job).value());
        }
        break;
      }
      case kLooper: {
        st.phase.store(2);
        for (;;) {
          code = echo_check(*client, rng);
          if (code != 0) break;
          st.echoes_ok.fetch_add(1);
        }
        break;
      }
      case kIdle: {
        st.phase.store(2);
        if (!subject_wait(sh, [&] { return sh.dead.load() >= round; })) return 0;
        JobSpec noop;
        noop.op = "noop";
        auto job = client->submit(noop);
        if (!job) {
          code = code_of(job.error());
        } else {
          // A submit may still land in the dead daemon's ring; the wait must say Disconnected.
          auto r = job->wait();
          code = r ? 0 : code_of(r.error());
        }
        auto fresh = Client::connect(options);
        st.extra_code.store(fresh ? 0 : code_of(fresh.error()));
        break;
      }
    }
    st.call_code.store(code);
    st.returned_ns.store(monotonic_ns());
    st.phase.store(3);
  }
  return 0;
}

enum class Death {
  kExternal,       // SIGKILL from the test at a random moment
  kAccepting,      // fault point supervisor.client_accepted (a connection being accepted)
  kUnregistering,  // fault point supervisor.client_unregistering (a client leaving)
};

struct DaemonFacts {
  std::string segment;
  uint64_t epoch = 0;
  std::vector<pid_t> workers;
};

DaemonFacts facts_of(const DaemonProcess& daemon) {
  DaemonFacts f;
  QueueMapping q;
  const std::string problem = map_queue_segment(daemon.runtime_dir(), &q);
  REQUIRE_MESSAGE(problem.empty(), problem);
  f.segment = q.name;
  f.epoch = q.view.header().epoch;
  for (uint32_t w = 0; w < q.view.header().worker_count; ++w) {
    f.workers.push_back(q.view.worker(w).pid.load());
  }
  return f;
}

bool all_in(Shared& sh, std::initializer_list<uint32_t> phases) {
  for (int r = 0; r < kRoles; ++r) {
    const uint32_t p = sh.subjects[r].phase.load();
    if (std::find(phases.begin(), phases.end(), p) == phases.end()) return false;
  }
  return true;
}

std::string describe_subjects(Shared& sh) {
  std::ostringstream s;
  for (int r = 0; r < kRoles; ++r) {
    const SubjectState& st = sh.subjects[r];
    s << kRoleNames[r] << ": phase " << st.phase.load() << ", connect "
      << error_code_name(static_cast<ErrorCode>(st.connect_code.load())) << ", call "
      << error_code_name(static_cast<ErrorCode>(st.call_code.load())) << ", extra "
      << st.extra_code.load() << (st.has_error.load() ? ", error: " : "")
      << (st.has_error.load() ? st.error : "") << "; ";
  }
  return s.str();
}

void run_supervisor_deaths(Death death, uint32_t rounds) {
  const uint64_t seed = suite_seed();
  const std::string mode = death == Death::kExternal    ? "external"
                           : death == Death::kAccepting ? "accepting"
                                                        : "unregistering";
  INFO("supervisor deaths (" << mode << "), suite seed " << seed << " (GPUQ_FAULT_SEED=" << seed
                             << " replays it)");
  become_subreaper();  // the dead daemon's workers become this process's children
  Rng rng(derive_seed("supervisor-" + mode));
  DaemonOptions options{supervisor_config(), DaemonOptions::Readiness::kWorkersReady, {}};
  uint64_t hit = 0;
  if (death == Death::kAccepting) {
    // Every connection counts, the fixture's readiness polls included: leave room for them.
    hit = rng.between(100, 150);
    options.env.push_back("GPUQ_FAULT_POINT=supervisor.client_accepted:" + std::to_string(hit));
  } else if (death == Death::kUnregistering) {
    hit = rng.between(1, 3);
    options.env.push_back("GPUQ_FAULT_POINT=supervisor.client_unregistering:" +
                          std::to_string(hit));
  }
  INFO("fault hit " << hit);
  DaemonProcess daemon(options);

  SharedMemory memory(sizeof(Shared) + 4096);
  SharedArena arena(memory);
  Shared& sh = *arena.make_array<Shared>(1);
  std::vector<pid_t> subjects;
  for (int r = 0; r < kRoles; ++r) {
    const uint64_t subject_seed = rng.next();
    const std::string dir = daemon.runtime_dir();
    const pid_t pid = fork_child([&]() -> int { return subject_main(sh, r, dir, subject_seed); });
    REQUIRE(pid > 0);
    subjects.push_back(pid);
  }
  struct Reap {
    Shared& sh;
    std::vector<pid_t>& pids;
    ~Reap() {
      sh.stop.store(1);
      for (pid_t p : pids) {
        if (p > 0) wait_child(p, 10 * kSecond);
      }
    }
  } reap{sh, subjects};

  const uint64_t start = monotonic_ns();
  uint64_t max_disconnect_ns = 0, max_worker_exit_ns = 0;
  for (uint32_t round = 1; round <= rounds; ++round) {
    INFO("round " << round << " of " << rounds);
    const DaemonFacts facts = facts_of(daemon);
    for (auto& st : sh.subjects) {
      st.phase.store(0);
      st.connect_code.store(-1);
      st.call_code.store(-1);
      st.extra_code.store(-1);
      st.returned_ns.store(0);
    }
    auto daemon_dead = [&] { return process_gone(daemon.pid()); };
    sh.go_connect.store(round);
    const bool connected = poll_until(
        [&] {
          return all_in(sh, {1, 4}) || daemon_dead();
        },
        20s, 200us);
    REQUIRE_MESSAGE(connected, "subjects did not connect: " << describe_subjects(sh));
    if (death != Death::kAccepting) {
      REQUIRE_MESSAGE(all_in(sh, {1}),
                      "subjects could not connect to a live daemon: " << describe_subjects(sh));
    }
    sh.go_call.store(round);
    const bool in_call = poll_until(
        [&] {
          return all_in(sh, {2, 3, 4}) || daemon_dead();
        },
        20s, 200us);
    REQUIRE_MESSAGE(in_call, "subjects did not start their calls: " << describe_subjects(sh));

    // The death.
    const uint64_t delay_us = rng.between(0, 20'000);
    switch (death) {
      case Death::kExternal: {
        timespec ts{0, static_cast<long>(delay_us * 1000)};
        nanosleep(&ts, nullptr);
        REQUIRE(daemon.send_signal(SIGKILL));
        break;
      }
      case Death::kAccepting:
        // Connections until one is the fatal one (status requests: no client is registered).
        for (int i = 0; i < 1000 && !daemon_dead(); ++i) {
          if (!daemon_status_json(daemon.runtime_dir())) break;
        }
        break;
      case Death::kUnregistering:
        // Clients that come and go until one's leaving is the fatal one. A client connecting
        // while the daemon dies must get Disconnected, and at once.
        for (int i = 0; i < 20 && !daemon_dead(); ++i) {
          const uint64_t t0 = monotonic_ns();
          auto c = Client::connect(connect_options(daemon.runtime_dir()));
          if (!c) {
            CHECK(c.error().code() == ErrorCode::kDisconnected);
            CHECK(monotonic_ns() - t0 < kDisconnectBoundNs);
            break;
          }
        }
        break;
    }
    const ChildExit exit = daemon.wait_exit(10s);
    const uint64_t dead_ns = monotonic_ns();
    REQUIRE_MESSAGE(exit.signal == SIGKILL, "gpuqd was to die by SIGKILL but " << exit.describe());
    sh.dead.store(round);

    // No orphans: PR_SET_PDEATHSIG kills every worker with the supervisor.
    const bool workers_gone = poll_until(
        [&] {
          for (pid_t w : facts.workers) {
            if (w <= 0) continue;
            reap_if_child(w);
            if (!process_gone(w)) return false;
          }
          return true;
        },
        std::chrono::nanoseconds(5 * kWorkerExitBoundNs), 100us);
    max_worker_exit_ns = std::max(max_worker_exit_ns, monotonic_ns() - dead_ns);
    CHECK_MESSAGE(workers_gone, "workers of the dead daemon still run 5 s later");
    CHECK(monotonic_ns() - dead_ns < kWorkerExitBoundNs + 100 * kMillisecond);

    // Every call in progress returns Disconnected, in bounded time.
    const bool returned = poll_until(
        [&] {
          return all_in(sh, {3, 4});
        },
        std::chrono::nanoseconds(kDisconnectBoundNs), 200us);
    CHECK_MESSAGE(returned, "calls still blocked "
                                << kDisconnectBoundNs / kMillisecond
                                << " ms after the daemon died (a hang): " << describe_subjects(sh));
    for (int r = 0; r < kRoles; ++r) {
      const SubjectState& st = sh.subjects[r];
      INFO(std::string(kRoleNames[r]) << ": " << describe_subjects(sh));
      CHECK(st.has_error.load() == 0);
      if (st.phase.load() == 4) {
        CHECK(st.connect_code.load() == static_cast<int32_t>(ErrorCode::kDisconnected));
        continue;
      }
      CHECK(st.call_code.load() == static_cast<int32_t>(ErrorCode::kDisconnected));
      const uint64_t at = st.returned_ns.load();
      if (at > dead_ns) max_disconnect_ns = std::max(max_disconnect_ns, at - dead_ns);
      if (r == kIdle) {
        // No daemon listens now: a new connect says so at once.
        CHECK(st.extra_code.load() == static_cast<int32_t>(ErrorCode::kDisconnected));
      }
    }

    // A new daemon starts over the leftovers: the socket file, the lock, the old segment.
    struct stat ignored {};
    CHECK(::stat(daemon.socket_path().c_str(), &ignored) == 0);
    CHECK(::stat(("/dev/shm/" + facts.segment).c_str(), &ignored) == 0);
    daemon.kill_and_restart();
    const DaemonFacts fresh = facts_of(daemon);
    CHECK(fresh.epoch != facts.epoch);
    CHECK(fresh.segment != facts.segment);
    CHECK_MESSAGE(::stat(("/dev/shm/" + facts.segment).c_str(), &ignored) != 0,
                  "the new daemon did not remove the old queue segment " << facts.segment);
  }
  // The subjects' last round: reconnect to the daemon now running, check an echo, and leave.
  sh.go_connect.store(rounds + 1);
  const bool last = poll_until([&] { return all_in(sh, {1, 4}); }, 20s, 200us);
  CHECK_MESSAGE(last, "subjects did not reconnect: " << describe_subjects(sh));
  for (int r = 0; r < kRoles; ++r) {
    const SubjectState& st = sh.subjects[r];
    INFO(std::string(kRoleNames[r]) << ": " << describe_subjects(sh));
    if (death != Death::kAccepting) CHECK(st.phase.load() == 1);
    if (r == kWaiter && st.phase.load() == 1) {
      // The job of the dead daemon's connection, after reconnect(): Disconnected.
      CHECK(st.extra_code.load() == static_cast<int32_t>(ErrorCode::kDisconnected));
    }
    CHECK(st.has_error.load() == 0);
    CHECK(st.connects_ok.load() >= 1);
  }
  sh.stop.store(1);
  for (pid_t& p : subjects) {
    const ChildExit e = wait_child(p, 30 * kSecond);
    CHECK_MESSAGE(e.ok(), "subject " << e.describe());
    p = 0;
  }
  std::printf(
      "supervisor deaths (%s, hit %llu): %u in %.1f s; calls returned Disconnected "
      "within %.1f ms, workers gone within %.1f ms of the death\n",
      mode.c_str(), static_cast<unsigned long long>(hit), rounds,
      static_cast<double>(monotonic_ns() - start) / 1e9,
      static_cast<double>(max_disconnect_ns) / 1e6, static_cast<double>(max_worker_exit_ns) / 1e6);
  if (death == Death::kExternal) {
    Client client = connect_client(daemon);
    check_echo_works(client);
  }
  if (death != Death::kUnregistering) {
    const ChildExit exit = daemon.terminate();
    CHECK_MESSAGE(exit.ok(), "gpuqd " << exit.describe());
  }
}

TEST_CASE("the supervisor killed at random moments: no orphans, no hang, a clean restart") {
  run_supervisor_deaths(Death::kExternal, iterations(20));
}

TEST_CASE("the supervisor killed while accepting a connection") {
  run_supervisor_deaths(Death::kAccepting, iterations(8));
}

TEST_CASE("the supervisor killed while unregistering a client") {
  run_supervisor_deaths(Death::kUnregistering, iterations(8));
}

}  // namespace
}  // namespace gpuq::test::fault
