// The supervisor's watch over running jobs (docs/design/faults.md, "Jobs that do not end"):
//   - a job past its time limit (the smaller of its pool's job_time_limit_ms and its own) has
//     kCancelByTimeLimit raised in its cancel flag, which ops that poll it honour;
//   - a job asked to stop (that flag, its client's cancel, or its client gone) and still running
//     cancel_grace_ms later has its worker stopped: the worker's `hold` is raised, the slot is
//     looked at once more, and the worker is killed; the job's end (TimedOut or Cancelled, and
//     a message saying its worker was stopped) is written when the exit is reaped;
//   - what each busy worker runs, for status.
// What a worker runs comes from its private page (WorkerPrivate), which clients cannot write;
// the client's slot only adds what the client itself decides (its own limit, its cancel). It
// writes only cancel flags and `hold`.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
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
struct Worker;

// The end the supervisor gives a job whose worker it stopped (JobRecovery::worker_died).
struct ForcedEnd {
  uint64_t session = 0;
  uint32_t slot = 0;
  uint32_t generation = 0;
  bool generation_known = false;          // false: the slot did not say (then no slot matches)
  uint64_t started_stamp = 0;             // when it started (a job stamp); 0: not known
  ErrorCode code = ErrorCode::kTimedOut;  // or kCancelled
  std::string message;
  uint32_t limit_ms = 0;    // the limit it passed (code kTimedOut)
  uint32_t batch_jobs = 1;  // the jobs its worker's call served (a batched op's call: more)
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
  JobWatch(const Config& config, const ClientRegistry& clients, const StampScale& stamps);

  // The workers to watch (their private pages); before the first tick.
  void attach(WorkerSet* workers);

  // On each timer tick: raises the flags of jobs past their limits, and stops the workers of
  // jobs asked to stop more than cancel_grace_ms ago.
  void tick(uint64_t now);
  // A client is leaving (still registered, its segment still mapped): unless it asked to keep
  // them, its running jobs are asked to stop, and stopped by force cancel_grace_ms later.
  void client_leaving(const Client& client, uint64_t now);
  // Worker `worker` has exited: the end of the job it was stopped for, if it was.
  std::optional<ForcedEnd> take_forced(uint32_t worker);
  // The earliest time something here is due (a limit, the end of a grace), or 0.
  uint64_t next_due() const;
  // A job is followed, or a client left a moment ago: the slow tick must run even with no
  // client connected.
  bool wants_tick(uint64_t now) const;

  // What worker `w` runs now (status), or nothing when it is idle.
  std::optional<RunningJob> running(const Worker& w) const;
  // Its job was asked to stop and has not ended: it takes no work until it does or is replaced.
  bool stuck(const Worker& w) const;

 private:
  struct Track {
    bool active = false;
    uint64_t seq = 0;  // the worker's odd job_seq for this job; 0: not published yet
    uint32_t ref = 0;  // the packed JobRef
    uint64_t session = 0;
    uint32_t generation = 0;  // full, from the slot's state word
    bool generation_known = false;
    uint64_t word = 0;           // that state word (RUNNING on this worker), when generation_known
    uint64_t started_ns = 0;     // CLOCK_MONOTONIC
    uint64_t started_stamp = 0;  // as the worker stamped it; 0 when not known
    uint32_t limit_ms = 0;
    uint32_t op_id = 0;
    uint32_t batch_jobs = 1;  // the jobs the worker's call serves (WorkerPrivate::batch_jobs)
    uint32_t why = 0;         // 0, kCancelByTimeLimit or kCancelByClient: why it was asked to stop
    uint64_t asked_ns = 0;
    bool stopping = false;  // its worker is being killed
    // The segment of a client that left while this job ran (the registry's mapping is gone).
    std::shared_ptr<MemfdSegment> departed;
    ClientSegmentGeometry geometry{};
    uint32_t slot_count = 0;
    pid_t client_pid = 0;
  };
  // A worker's job, from its private page (the truth: clients cannot write it), with its slot
  // when the client's segment is at hand (a departed client's through the track).
  struct Seen {
    uint64_t seq = 0;
    uint32_t ref = 0;
    uint64_t started_stamp = 0;
    uint32_t batch_jobs = 1;
    JobSlot* slot = nullptr;         // null: no segment to read it from
    const Client* client = nullptr;  // null: a client that has left
    uint64_t session = 0;
  };
  std::optional<Seen> observe(const Worker& w) const;
  // The slot of `ref` in a segment, or null when out of range.
  static JobSlot* slot_in(void* base, const ClientSegmentGeometry& g, uint32_t slot_count,
                          uint32_t ref);
  uint32_t limit_for(uint32_t pool, const JobSlot* slot) const;
  uint64_t age_ns(uint64_t started_stamp) const;
  std::string forced_message(const Track& t, ErrorCode code, uint32_t worker, pid_t pid) const;

  const Config& config_;
  const ClientRegistry& clients_;
  const StampScale& stamps_;
  WorkerSet* workers_ = nullptr;
  std::vector<Track> tracks_;
  std::vector<std::optional<ForcedEnd>> forced_;
  uint64_t departure_watch_until_ns_ = 0;
  std::map<uint64_t, uint64_t> kept_sessions_;  // keep_running_jobs clients gone: when they left
};

}  // namespace gpuq::daemon
