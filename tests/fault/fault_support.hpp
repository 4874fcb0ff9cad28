// The fault-injection harness shared by tests/fault: seeds and iteration counts, bystander client
// processes that keep verified jobs flowing while something else is killed, victim client
// processes that die at a fault point or by an external SIGKILL, and the checks that a daemon
// came back to its idle values (status counters, /proc, the victims' own job slots).
//
// Seeds: every test prints the suite seed at start and names it in every failure message.
// GPUQ_FAULT_SEED=<n> replays a run (timing still varies between runs, the random choices do
// not). GPUQ_FAULT_ITERATIONS=<factor> multiplies every iteration count (e.g. 10 for a long local
// run); sanitizer builds scale the counts down first (test_support.hpp, scaled()).
//
// Processes: the test process never creates a thread, so that it may fork() bystanders and
// victims at any time; every forked child connects a Client of its own. Children report through
// shared anonymous memory (SharedMemory) and their exit status, never through doctest.
//
// Test-only code.
#pragma once

#include <sys/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "gpuq/client.hpp"
#include "gpuq/common/shm.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "support/rng.hpp"
#include "support/test_support.hpp"

namespace gpuq::test::fault {

// ---- Seeds and counts ------------------------------------------------------------------------

// The suite seed: GPUQ_FAULT_SEED, else a fresh one. Printed to stdout the first time.
uint64_t suite_seed();
// `n` scaled for the build (scaled()) and by GPUQ_FAULT_ITERATIONS; at least 1.
uint32_t iterations(uint32_t n);
// A seed for one part of a test, derived from the suite seed.
uint64_t derive_seed(std::string_view what, uint64_t index = 0);

// ---- Daemon configs and status ---------------------------------------------------------------

// One cpu pool "cpu" of `workers` workers, with restarts that are quick and never give up (so
// that many kills do not mark a worker failed), plus `extra`.
std::string fault_config(uint32_t workers, nlohmann::json extra = nlohmann::json::object());

// The status document, or a null json if the daemon did not answer (no doctest failure).
nlohmann::json try_status(const std::string& runtime_dir);

// Polls `pred` every `nap` until it holds or `timeout` passes; returns its last value. For
// predicates that cost a request to the daemon (wait_until polls much more often).
template <typename Pred>
bool poll_until(Pred&& pred, std::chrono::nanoseconds timeout,
                std::chrono::nanoseconds nap = std::chrono::microseconds(500)) {
  const uint64_t deadline = monotonic_ns() + static_cast<uint64_t>(timeout.count());
  for (;;) {
    if (pred()) return true;
    if (monotonic_ns() >= deadline) return pred();
    timespec ts{0, static_cast<long>(nap.count())};
    nanosleep(&ts, nullptr);
  }
}

// The daemon's queue segment, mapped by the name in <runtime_dir>/queue-segment: where a test
// reads worker pids and states without a status request (which a supervisor fault point counts
// as a connection), and finds the rings.
struct QueueMapping {
  std::string name;
  QueueSegment segment;
  QueueView view;
};
// Empty on success, else why not (no segment yet, bad magic...).
std::string map_queue_segment(const std::string& runtime_dir, QueueMapping* out);

// ---- /proc ---------------------------------------------------------------------------------

// Client payload segments (memfd "gpuq-client-N") that `pid` holds open as descriptors.
int count_client_memfd_fds(pid_t pid);
// Distinct client payload segments that `pid` has mapped.
int count_client_memfd_mappings(pid_t pid);
// The descriptor number of this process's own client segment, or -1.
int own_client_memfd_fd();
// True if `pid` has exited: no such process, or a zombie.
bool process_gone(pid_t pid);

// Makes this process the reaper of orphaned descendants (PR_SET_CHILD_SUBREAPER), so that the
// workers of a killed daemon become its children and can be reaped, not left as zombies.
void become_subreaper();
// Reaps `pid` if it is a zombie child of this process (non-blocking).
void reap_if_child(pid_t pid);

// ---- Another process's client segment ---------------------------------------------------------

// A client segment opened through /proc/<pid>/fd/<fd> while its client lives, so that its job
// slots can be inspected after the client died. Geometry from the segment header (written by
// the supervisor; the victims never touch it).
class ForeignSegment {
 public:
  ForeignSegment() = default;
  ForeignSegment(const ForeignSegment&) = delete;
  ForeignSegment& operator=(const ForeignSegment&) = delete;
  ~ForeignSegment();

  // Empty on success, else why not.
  std::string open(pid_t pid, int fd);
  void close();
  bool valid() const noexcept { return base_ != nullptr; }

  uint32_t slot_count() const noexcept { return slot_count_; }
  // The client index the supervisor gave the segment's client (its header).
  uint32_t client_index() const noexcept;
  JobSlot& slot(uint32_t i) const noexcept;
  SlotWord word(uint32_t i) const noexcept {
    return SlotWord::unpack(slot(i).state.load(std::memory_order_acquire));
  }
  // "slot 3: Submitted gen 7, input@4096; ..." for the slots not FREE.
  std::string describe() const;

 private:
  void* base_ = nullptr;
  uint64_t bytes_ = 0;
  uint64_t slots_offset_ = 0;
  uint32_t slot_count_ = 0;
};

const char* job_state_name(JobState s);

// The ring of pool `pool` of the daemon at `runtime_dir`: head, tail and every cell from the
// head. For failure messages.
std::string describe_ring(const std::string& runtime_dir, uint32_t pool = 0);

// ---- Bystanders ------------------------------------------------------------------------------

struct BystanderOptions {
  std::string runtime_dir;
  int count = 2;
  int in_flight = 4;
  // Jobs that fail with WorkerDied are counted, not errors (tests that kill workers).
  bool allow_worker_died = false;
  // Share of sleep jobs and their length: mostly sleeps keep the workers busy, so that an
  // external kill of a worker lands mid-job.
  double sleep_share = 0.15;
  uint32_t sleep_us_min = 20, sleep_us_max = 400;
  // How long a bystander waits for one job before it reports it stuck.
  std::chrono::nanoseconds wait_timeout = std::chrono::seconds(20);
  // Share of jobs submitted with JobSpec::retryable (run again, once, if their worker dies).
  double retryable_share = 0;
  // Pause after each verified job, so that the bystanders leave CPU to the processes under test.
  uint32_t pace_us = 150;
  uint64_t seed = 0;
};

struct BystanderTotals {
  uint64_t submitted = 0;    // jobs accepted by submit()
  uint64_t done = 0;         // ended Done with the right output
  uint64_t worker_died = 0;  // ended Failed with WorkerDied (allowed or not)
  uint64_t failures = 0;     // anything else: errors, wrong output, stuck jobs
  std::string first_error;   // of the first bystander that recorded one
  std::string describe() const;
};

// `count` client processes, each keeping `in_flight` random jobs (echo, checksum, noop, sleep)
// going and checking every result byte for byte, until told to drain. Start them before any
// victim, from the test process's main thread (they are forked).
class Bystanders {
 public:
  explicit Bystanders(BystanderOptions options);
  Bystanders(const Bystanders&) = delete;
  Bystanders& operator=(const Bystanders&) = delete;
  ~Bystanders();  // kills and reaps any still running

  // Fails the test case (FAIL) unless every bystander connected within 10 s.
  void wait_connected();
  BystanderTotals totals() const;
  // Jobs finished so far (done + worker_died), summed over the bystanders, or of bystander i.
  uint64_t finished() const;
  uint64_t finished_by(int i) const;
  // Stops submitting, waits (up to `timeout`) for every job in flight to finish, and stays
  // connected. False if a bystander did not get there in time (a stuck job).
  bool drain(std::chrono::nanoseconds timeout = std::chrono::seconds(60));
  // After drain(): submits again. False if a bystander was not drained or did not resume.
  bool resume();
  // Disconnects and exits; false unless every bystander exited 0 in time.
  bool release(std::chrono::nanoseconds timeout = std::chrono::seconds(30));
  int count() const noexcept { return options_.count; }
  // What shared memory says about the bystanders' unfinished jobs: each job queued or running
  // in their slots, and whether a ring still holds a reference to a queued one (a queued job
  // with no reference will never run). For failure messages; call while they are connected.
  std::string diagnose() const;

  struct State;

 private:
  BystanderOptions options_;
  std::unique_ptr<SharedMemory> memory_;
  State* states_ = nullptr;
  std::vector<pid_t> pids_;
};

// ---- Victims -----------------------------------------------------------------------------------

enum class VictimWorkload {
  kMixed,    // submit, try_submit, wait, cancel, drop unfinished: all job kinds
  kWaiting,  // sleep jobs, each waited for (the wait sleeps on the futex)
  kCopying,  // memcpy of 512 KiB into its payload buffer, then an echo of it, in a loop
};

struct VictimPlan {
  std::string runtime_dir;
  VictimWorkload workload = VictimWorkload::kMixed;
  std::string fault_point;  // empty: none (the test kills it from outside)
  uint32_t fault_hit = 1;   // die at this hit of fault_point
  bool spin = true;         // wait() spins before it sleeps (false: it sleeps at once)
  uint64_t seed = 0;
};

// Shared state of one victim (lives in shared memory).
struct VictimState {
  static constexpr int kMaxHeld = 16;
  std::atomic<int32_t> memfd_fd;
  std::atomic<uint32_t> phase;  // 0 starting, 1 connected, 2 go, 3 working
  std::atomic<uint64_t> accepted;
  // Input offset + 1 of each job whose handle the victim holds (0: free entry). Set after
  // submit() returned the Job, cleared before the Job is dropped: a set entry is a job that was
  // accepted and whose slot the victim has not freed.
  std::atomic<uint64_t> held[kMaxHeld];
  std::atomic<uint32_t> has_error;
  char error[256];

  void reset();
};

// Runs in a forked child: connects, reports, waits for go, arms the fault point, works until it
// dies. Returns an exit code: 0 if the workload ended without the process dying (the fault
// point was never reached), 20+ for a victim-side error (VictimState::error says which).
int run_victim(VictimState& state, const VictimPlan& plan);

// ---- Idle checks -------------------------------------------------------------------------------

// What "idle" means for a daemon with `live_clients` registered clients. Fills `why` with the
// first value not (yet) at its idle value.
struct IdleExpectations {
  int live_clients = 0;
  bool queues_empty = true;   // queue_depth 0 and cells_held 0 in every pool
  bool no_retiring = false;   // client_indexes_retiring 0
  bool workers_ready = true;  // every worker "ready", and the status says "ready": true
  bool workers_idle = true;   // no worker busy
  bool check_proc = true;     // memfd descriptors in gpuqd and mappings in every worker
};
bool daemon_idle(const std::string& runtime_dir, pid_t gpuqd, const IdleExpectations& e,
                 std::string* why, nlohmann::json* status_out = nullptr);

// Releases the bystanders (REQUIREs that they exit cleanly) and CHECKs that the daemon then
// returns to its idle values with no client at all and no index retiring, within 10 s.
// Returns the last status document read.
nlohmann::json release_and_expect_empty(Bystanders& bystanders, const std::string& runtime_dir,
                                        pid_t gpuqd);

// Checks the slots of a dead victim: every slot FREE or terminal, and every job the victim held
// (VictimState::held) in exactly one slot, in a terminal state. Empty if so, else why not.
std::string victim_slots_settled(const ForeignSegment& segment, const VictimState& state);

}  // namespace gpuq::test::fault
