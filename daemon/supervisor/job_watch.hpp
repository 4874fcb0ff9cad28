// The supervisor's watch over running jobs (docs/design/faults.md, "Jobs that do not end"):
//   - a job past its time limit (the smaller of its pool's job_time_limit_ms and its own) has
//     kCancelByTimeLimit raised in its cancel flag, which ops that poll it honour;
//   - a job asked to stop (that flag, its client's cancel, or its client gone) and still running
//     cancel_grace_ms later has its worker stopped: the worker's `hold` is raised, the slot is
//     looked at once more, and the worker is killed; the job's end (TimedOut or Cancelled, and
//     a message saying its worker was stopped) is written when the exit is reaped;
//   - what each busy worker runs, for status.
// It reads the workers' shared words and the clients' slots; it writes only cancel flags and
// `hold`. A worker's word is believed only once the slot it names says RUNNING on that worker
// with that generation.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "client_registry.hpp"
#include "config.hpp"
#include "gpuq/common/clock.hpp"
#include "gpuq/common/shm.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "gpuq/error.hpp"

namespace gpuq::daemon {

class WorkerSet;

// The end the supervisor gives a job whose worker it stopped (JobRecovery::worker_died).
struct ForcedEnd {
  uint64_t session = 0;
  uint32_t slot = 0;
  uint32_t generation = 0;
  ErrorCode code = ErrorCode::kTimedOut;  // or kCancelled
  std::string message;
};

// What status shows for a busy worker.
struct RunningJob {
  uint32_t op_id = 0;
  uint32_t client = 0;
  pid_t client_pid = 0;
  std::string client_name;  // empty for a client that has left
  uint32_t slot = 0;
  uint64_t age_ns = 0;
  uint32_t time_limit_ms = 0;            // the one that applies; 0: none
  const char* stop_requested = nullptr;  // null, "time_limit" or "cancel"
};

class JobWatch {
 public:
  // `stamps`: converts the workers' job stamps into nanoseconds (the supervisor keeps its TSC
  // rate up to date in it).
  JobWatch(const Config& config, QueueView& queue, const ClientRegistry& clients,
           const StampScale& stamps);

  void set_worker_count(uint32_t n) {
    tracks_.assign(n, Track{});
    forced_.assign(n, std::nullopt);
  }

  // On each timer tick: raises the flags of jobs past their limits, and stops the workers of
  // jobs asked to stop more than cancel_grace_ms ago.
  void tick(uint64_t now, WorkerSet& workers);
  // A client is leaving (still registered, its segment still mapped): unless it asked to keep
  // them, its running jobs are asked to stop, and stopped by force cancel_grace_ms later.
  void client_leaving(const Client& client, uint64_t now);
  // Worker `worker` has exited: the end of the job it was stopped for, if it was.
  std::optional<ForcedEnd> take_forced(uint32_t worker);
  // The earliest time something here is due (a limit, the end of a grace), or 0: the
  // supervisor ticks fast when it is near.
  uint64_t next_due() const;

  // What worker `worker` runs now (status), or nothing when it is idle.
  std::optional<RunningJob> running(uint32_t worker) const;
  // Its job was asked to stop and has not ended: it takes no work until it does or is replaced.
  bool stuck(uint32_t worker) const;

 private:
  struct Track {
    bool active = false;
    uint32_t ref = 0;  // the packed JobRef the worker published
    uint64_t session = 0;
    uint32_t generation = 0;  // full, from the slot's state word
    uint64_t started_ns = 0;  // CLOCK_MONOTONIC
    uint32_t limit_ms = 0;
    uint32_t op_id = 0;
    uint32_t why = 0;  // 0, kCancelByTimeLimit or kCancelByClient: why it was asked to stop
    uint64_t asked_ns = 0;
    bool stopping = false;  // its worker is being killed
    // The segment of a client that left while this job ran (the registry's mapping is gone).
    std::shared_ptr<MemfdSegment> departed;
    ClientSegmentGeometry geometry{};
    uint32_t slot_count = 0;
    pid_t client_pid = 0;
  };
  // A busy worker's job, checked against its slot.
  struct Seen {
    JobSlot* slot = nullptr;
    uint64_t word = 0;  // the slot's state word: RUNNING on this worker
    uint32_t ref = 0;
    uint64_t session = 0;
    uint64_t started_stamp = 0;
    const Client* client = nullptr;  // null: a client that has left (Track::departed)
  };
  std::optional<Seen> observe(uint32_t worker) const;
  uint32_t pool_of(uint32_t worker) const;
  uint32_t limit_for(uint32_t pool, const JobSlot& slot) const;
  uint64_t age_ns(uint64_t started_stamp) const;
  std::string forced_message(const Track& t, uint32_t worker, pid_t pid) const;

  const Config& config_;
  QueueView& queue_;
  const ClientRegistry& clients_;
  const StampScale& stamps_;
  std::vector<Track> tracks_;
  std::vector<std::optional<ForcedEnd>> forced_;
};

}  // namespace gpuq::daemon
