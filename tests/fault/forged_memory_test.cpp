// Fault injection: a client that writes garbage into the shared memory it can write, while two
// bystander clients keep verified jobs flowing.
//
// The scribbler is an allowed client (same user). It maps its own client segment a second time
// (from its memfd) and the daemon's queue segment, and at random:
//   - forges jobs in its own slots: random descriptors (op ids, pool ids, flags, offsets and
//     lengths at and past the arena's end, values near 2^64, random parameter blocks) with a
//     SUBMITTED state word, and pushes references to them into any lane of the pool's queue;
//   - scribbles random state words (RUNNING for any worker, terminal, states that do not exist),
//     whole slots, and its segment header;
//   - submits real jobs and rewrites their descriptors while workers may be copying them;
//   - pushes random 32-bit references, naming any client, slot and generation;
//   - (second test case only) overwrites lane cells: random words, or a cell's value with its
//     tag kept; a lane's head or tail; the queue's `active` lane bits (all clear, or random).
//
// What must hold (docs/design/requirements.md, "Nothing a client writes into shared memory can
// crash the supervisor or a worker"): no worker dies (same pids, no restarts), the daemon keeps
// serving, every bystander job ends Done with the right output, and once the scribbler is gone the
// daemon is back to its idle values.
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>

#include "fault/fault_support.hpp"
#include "gpuq/common/job_ring.hpp"
#include "integration/integration_support.hpp"
#include "support/raw_ring.hpp"

namespace gpuq::test::fault {
namespace {

using nlohmann::json;

enum Action : int {
  kForgeJob,
  kScribbleState,
  kScribbleSlot,
  kScribbleHeader,
  kRewriteSubmitted,
  kPushRandomRef,
  kRingCellWord,   // ring mode only
  kRingCellValue,  // ring mode only
  kRingHint,       // ring mode only: the head or tail position
  kBystanderRefs,  // ring mode only: entries naming another client, which count in its share
  kActiveBits,     // ring mode only: the lane bits workers look at
  kActions
};
constexpr const char* kActionNames[] = {
    "forged jobs",       "state words",    "whole slots",        "headers",
    "rewritten submits", "random refs",    "ring cells (words)", "ring cells (values)",
    "ring head/tail",    "bystander refs", "lane bits"};

struct ScribblerState {
  std::atomic<uint32_t> phase;  // 0 starting, 1 ready, 2 scribbling, 3 stopped, 9 failed
  std::atomic<uint32_t> go;
  std::atomic<uint32_t> stop;
  std::atomic<uint64_t> actions[kActions];
  char error[256];
};

// A value for an offset or length field: inside the arena, at its edge, past it, or near 2^64.
uint64_t forged_extent(Rng& rng, uint64_t arena) {
  switch (rng.between(0, 7)) {
    case 0:
      return rng.between(0, arena);
    case 1:
      return arena;
    case 2:
      return arena - rng.between(0, 64);
    case 3:
      return arena + rng.between(1, 4096);
    case 4:
      return UINT64_MAX - rng.between(0, 4096);
    case 5:
      return uint64_t{1} << rng.between(0, 63);
    case 6:
      return 0;
    default:
      return rng.next();
  }
}

void forge_descriptor(JobDescriptor& d, Rng& rng, uint64_t arena) {
  d.op_id = static_cast<uint32_t>(rng.chance(0.8) ? rng.between(0, 8) : rng.next());
  d.pool_id = static_cast<uint32_t>(rng.chance(0.8) ? 0 : rng.next() % 4);
  d.flags = static_cast<uint32_t>(rng.chance(0.5) ? rng.between(0, 1) : rng.next());
  d.params_bytes = static_cast<uint32_t>(rng.chance(0.7) ? rng.between(0, 200) : rng.next());
  d.input_offset = forged_extent(rng, arena);
  d.input_bytes = forged_extent(rng, arena);
  d.output_offset = forged_extent(rng, arena);
  d.output_capacity = forged_extent(rng, arena);
  d.deadline_ns = rng.chance(0.7) ? kNoDeadline : rng.next();
  d.submit_stamp = rng.next();
  rng.fill(d.params, sizeof d.params);
  if (rng.chance(0.3)) {
    // A plausible parameter block start: small counts and lengths.
    d.params[0] = static_cast<uint8_t>(rng.between(0, 3));
  }
}

int scribbler_main(ScribblerState& st, const std::string& dir, uint64_t seed, bool ring_cells) {
  auto fail = [&](const std::string& what) {
    std::snprintf(st.error, sizeof st.error, "%s", what.c_str());
    st.phase.store(9);
    return 1;
  };
  Rng rng(seed);
  ConnectOptions o;
  o.runtime_dir = dir;
  o.segment_bytes = 1 << 20;
  o.name = "scribbler";
  auto connected = Client::connect(o);
  if (!connected) return fail("connect: " + connected.error().to_string());
  Client client = std::move(connected).value();
  // Its own segment, a second time, writable.
  const int fd = own_client_memfd_fd();
  if (fd < 0) return fail("no memfd");
  struct stat sb {};
  if (::fstat(fd, &sb) != 0) return fail("fstat memfd");
  const size_t bytes = static_cast<size_t>(sb.st_size);
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return fail("mmap memfd");
  const ClientSegmentHeader header = *static_cast<ClientSegmentHeader*>(base);
  auto* slots = reinterpret_cast<JobSlot*>(static_cast<char*>(base) + header.slots_offset);
  const uint32_t slot_count = header.slot_count;
  const uint64_t arena = header.arena_bytes;
  QueueMapping queue;
  if (auto problem = map_queue_segment(dir, &queue); !problem.empty()) return fail(problem);
  const PoolQueue lanes = queue.view.queue(0);
  auto any_lane = [&] { return rng.between(0, lanes.lane_count() - 1); };
  const uint32_t workers = queue.view.header().worker_count;
  auto buffer = client.allocate(4096);
  if (!buffer) return fail("allocate");

  st.phase.store(1);
  if (!wait_until([&] { return st.go.load() != 0; }, 60 * kSecond)) return fail("no go");
  st.phase.store(2);
  std::vector<Job> jobs;
  // Ring cells are overwritten rarely (one every 100 ms, the five kinds in turn): a few
  // writes show whether the pool survives them.
  uint64_t next_ring_write = monotonic_ns() + 100 * kMillisecond;
  int ring_kind = 0;
  while (st.stop.load() == 0) {
    int action = static_cast<int>(rng.between(0, kRingCellWord - 1));
    if (ring_cells && monotonic_ns() >= next_ring_write) {
      action = kRingCellWord + ring_kind;
      ring_kind = (ring_kind + 1) % (kActions - kRingCellWord);
      next_ring_write += 100 * kMillisecond;
    }
    JobSlot& slot = slots[rng.between(0, slot_count - 1)];
    switch (action) {
      case kForgeJob: {
        const uint32_t s = static_cast<uint32_t>(&slot - slots);
        const uint32_t generation =
            static_cast<uint32_t>(rng.chance(0.5) ? rng.between(0, 8) : rng.next());
        forge_descriptor(slot.desc, rng, arena);
        slot.state.store(SlotWord{generation, JobState::kSubmitted, 0}.pack());
        if (lanes.try_push(any_lane(), JobRef{header.client_index, s, generation}.pack())) {
          queue.view.wake_worker(0);
        }
        break;
      }
      case kScribbleState: {
        uint64_t word = rng.next();
        if (rng.chance(0.6)) {
          const JobState states[] = {JobState::kSubmitted, JobState::kRunning, JobState::kDone,
                                     JobState::kFailed, static_cast<JobState>(0xFF)};
          word = SlotWord{static_cast<uint32_t>(rng.between(0, 8)), states[rng.between(0, 4)],
                          static_cast<uint32_t>(rng.between(0, workers + 1))}
                     .pack();
        }
        slot.state.store(word);
        break;
      }
      case kScribbleSlot:
        rng.fill(reinterpret_cast<char*>(&slot) + sizeof(std::atomic<uint64_t>),
                 sizeof(JobSlot) - sizeof(std::atomic<uint64_t>));
        slot.state.store(rng.next());
        break;
      case kScribbleHeader:
        rng.fill(base, sizeof(ClientSegmentHeader));
        break;
      case kRewriteSubmitted: {
        // A real job, whose descriptor is rewritten right after it is queued.
        JobSpec spec;
        spec.op = rng.chance(0.5) ? "echo" : "checksum";
        spec.input = buffer->slice(0, 2048);
        spec.output = buffer->slice(2048, 2048);
        auto job = client.try_submit(spec);
        if (job) {
          for (uint32_t i = 0; i < slot_count; ++i) {
            if (SlotWord::unpack(slots[i].state.load()).state == JobState::kSubmitted) {
              forge_descriptor(slots[i].desc, rng, arena);
            }
          }
          jobs.push_back(std::move(job).value());
        }
        if (jobs.size() > 8) jobs.clear();  // dropped: cancelled, or left to finish
        break;
      }
      case kPushRandomRef:
        if (lanes.try_push(any_lane(), static_cast<uint32_t>(rng.next() % JobRing::kEmptyValue))) {
          queue.view.wake_worker(0);
        }
        break;
      case kRingCellWord: {
        const RawRing raw(&lanes.lane(any_lane()).header());
        raw.cells[rng.between(0, raw.capacity() - 1)].store(rng.next());
        break;
      }
      case kRingHint: {
        const RawRing raw(&lanes.lane(any_lane()).header());
        std::atomic<uint64_t>& hint = rng.chance(0.5) ? raw.header->head : raw.header->tail;
        const uint64_t old = hint.load();
        switch (rng.between(0, 2)) {
          case 0:
            hint.store(rng.next());  // anywhere
            break;
          case 1:
            hint.store(old - rng.between(1, 2 * raw.capacity()));  // back a little
            break;
          default:
            hint.store(old + rng.between(1, 2 * raw.capacity()));  // ahead a little
            break;
        }
        break;
      }
      case kBystanderRefs: {
        // Entries naming a bystander (its index, any slot and generation): its client counts
        // them against its share when it recounts, until a worker pops and drops them.
        const uint32_t victim = (header.client_index + 1 + rng.between(0, 1)) % 3;
        const uint32_t n = rng.between(1, queue.view.pool(0).client_share);
        for (uint32_t i = 0; i < n; ++i) {
          const JobRef forged{victim, static_cast<uint32_t>(rng.between(0, kMaxSlotsPerClient - 1)),
                              static_cast<uint32_t>(rng.between(0, JobRef::kGenerationMask))};
          if (!lanes.try_push(any_lane(), forged.pack())) break;
        }
        queue.view.wake_worker(0);
        break;
      }
      case kActiveBits:
        lanes.header().active.store(rng.chance(0.5) ? 0 : rng.next());
        break;
      case kRingCellValue: {
        const RawRing raw(&lanes.lane(any_lane()).header());
        std::atomic<uint64_t>& cell = raw.cells[rng.between(0, raw.capacity() - 1)];
        const uint64_t old = cell.load();
        const uint32_t value = rng.chance(0.5)
                                   ? JobRing::kEmptyValue
                                   : static_cast<uint32_t>(rng.next() % JobRing::kEmptyValue);
        cell.store((old & ~uint64_t{0xFFFFFFFF}) | value);
        break;
      }
    }
    st.actions[action].fetch_add(1);
    if (rng.chance(0.05)) sched_yield();
  }
  st.phase.store(3);
  for (;;) ::pause();  // stays connected until the test kills it
}

void run_scribbler(bool ring_cells) {
  const uint64_t seed = suite_seed();
  INFO("suite seed " << seed << " (GPUQ_FAULT_SEED=" << seed << " replays it)");
  DaemonProcess daemon(fault_config(2));
  const json before = daemon.status();
  BystanderOptions o;
  o.runtime_dir = daemon.runtime_dir();
  o.seed = derive_seed(ring_cells ? "forged-ring-bystanders" : "forged-slots-bystanders");
  Bystanders bystanders(o);
  bystanders.wait_connected();

  SharedMemory memory(sizeof(ScribblerState) + 4096);
  SharedArena arena(memory);
  ScribblerState& st = *arena.make_array<ScribblerState>(1);
  const uint64_t scribbler_seed = derive_seed(ring_cells ? "forged-ring" : "forged-slots");
  const std::string dir = daemon.runtime_dir();
  const pid_t scribbler =
      fork_child([&]() -> int { return scribbler_main(st, dir, scribbler_seed, ring_cells); });
  REQUIRE(scribbler > 0);
  struct Kill {
    pid_t pid;
    ~Kill() {
      if (pid <= 0) return;
      ::kill(pid, SIGKILL);
      wait_child(pid, 10 * kSecond);
    }
  } kill_scribbler{scribbler};
  REQUIRE_MESSAGE(wait_until([&] { return st.phase.load() != 0; }, 10 * kSecond),
                  "the scribbler did not start");
  REQUIRE_MESSAGE(st.phase.load() == 1, "the scribbler failed: " << st.error);

  // Scribble for a while, watching for a dead worker or a disturbed bystander.
  const uint64_t finished_before = bystanders.finished();
  st.go.store(1);
  auto worker_pids = [](const json& status) {
    std::vector<pid_t> pids;
    for (const auto& w : status.at("pools").at(0).at("workers")) pids.push_back(w.value("pid", 0));
    return pids;
  };
  const std::vector<pid_t> pids = worker_pids(before);
  auto workers_alive = [&] {
    for (pid_t p : pids) {
      if (process_gone(p)) return false;
    }
    return true;
  };
  const std::chrono::nanoseconds duration(static_cast<int64_t>(iterations(1500)) * 1'000'000);
  const bool disturbed = poll_until(
      [&] {
        return !workers_alive() || bystanders.totals().failures != 0 || process_gone(daemon.pid());
      },
      duration, 1ms);
  if (ring_cells && !disturbed) {
    // At least four writes of each kind (one every 100 ms), whatever the iteration scale.
    poll_until(
        [&] {
          uint64_t writes = 0;
          for (int a = kRingCellWord; a < kActions; ++a) writes += st.actions[a];
          return writes >= 20;
        },
        10s, 1ms);
  }
  st.stop.store(1);
  wait_until([&] { return st.phase.load() >= 3; }, 10 * kSecond);
  std::ostringstream actions;
  for (int a = 0; a < kActions; ++a) {
    actions << kActionNames[a] << " " << st.actions[a].load() << ", ";
  }
  INFO("scribbler: " << actions.str());
  std::printf("scribbler (%s): %s bystanders finished %llu jobs meanwhile\n",
              ring_cells ? "slots, refs and ring cells" : "slots and refs", actions.str().c_str(),
              static_cast<unsigned long long>(bystanders.finished() - finished_before));
  CHECK_FALSE(disturbed);
  CHECK_MESSAGE(workers_alive(), "a worker died while a client scribbled over shared memory");

  // The bystanders' jobs all finish, correctly, with the scribbler still connected.
  const bool drained = bystanders.drain(30s);
  const BystanderTotals totals = bystanders.totals();
  INFO(totals.describe());
  if (!drained || totals.failures != 0) {
    FAIL("bystander jobs lost, stuck or wrong after a client scribbled over "
         << std::string(ring_cells ? "ring cells" : "its slots and pushed forged references")
         << ": " << totals.describe() << "\n"
         << bystanders.diagnose() << "\n"
         << describe_ring(daemon.runtime_dir()));
  }
  CHECK(totals.submitted == totals.done);

  const json during = daemon.status();
  INFO("status: " << during.dump());
  CHECK(worker_pids(during) == pids);  // no worker was replaced
  for (const auto& w : during.at("pools").at(0).at("workers")) CHECK(w.at("restarts") == 0);
  uint64_t failed_jobs = 0;
  for (const auto& w : during.at("pools").at(0).at("workers")) {
    failed_jobs += w.at("jobs_failed").get<uint64_t>();
  }
  const json& pool = during.at("pools").at(0);
  std::printf(
      "forged jobs refused by the workers (jobs_failed): %llu; the audit moved the ring's "
      "head/tail back %llu times, retired %llu ring cells and pushed %llu jobs again\n",
      static_cast<unsigned long long>(failed_jobs),
      static_cast<unsigned long long>(pool.at("ring_positions_restored").get<uint64_t>()),
      static_cast<unsigned long long>(pool.at("ring_cells_retired").get<uint64_t>()),
      static_cast<unsigned long long>(pool.at("jobs_requeued").get<uint64_t>()));

  // The scribbler goes; the daemon returns to its idle values and serves a new client.
  ::kill(scribbler, SIGKILL);
  wait_child(scribbler, 10 * kSecond);
  kill_scribbler.pid = 0;
  std::string why;
  json status;
  IdleExpectations connected;
  connected.live_clients = bystanders.count();
  const bool idle = poll_until(
      [&] { return daemon_idle(daemon.runtime_dir(), daemon.pid(), connected, &why, &status); },
      20s, 1ms);
  CHECK_MESSAGE(idle, "not idle after the scribbler left: " << why << "\n"
                                                            << status.dump() << "\n"
                                                            << describe_ring(daemon.runtime_dir()));
  REQUIRE(bystanders.release());
  {
    Client fresh = connect_client(daemon);
    check_echo_works(fresh);
  }
  const ChildExit exit = daemon.terminate();
  CHECK_MESSAGE(exit.ok(), "gpuqd " << exit.describe());
}

TEST_CASE("a client scribbling over its slots and forging references crashes nothing") {
  run_scribbler(false);
}

// The ring lives in the queue segment, which every allowed client can write. The scribbler
// overwrites cells (whole words, values) and the head and tail positions; the supervisor's
// audit (daemon/supervisor/job_recovery.cpp) moves the positions back, retires the cells and
// pushes again the bystanders' jobs whose entries were lost, and none of their jobs is lost or
// stuck.
TEST_CASE("a client scribbling over ring cells does not lose or stall other clients' jobs") {
  run_scribbler(true);
}

}  // namespace
}  // namespace gpuq::test::fault
