// Layout of gpuq's shared memory: the queue segment (one per daemon) and the client segments
// (one per connected client). Every struct here is plain data: fixed size, offsets instead of
// pointers, only always-lock-free atomics, checked by static_assert below.
//
// Queue segment (created by the supervisor, Boost.Interprocess shared_memory_object; mapped by
// the supervisor, every worker and every client):
//   QueueHeader | PoolShm[pool_count] | WorkerShm[worker_count] | ClientShm[max_clients] |
//   a PoolQueue (its lanes) per pool
//
// Client segment (a sealed memfd created by the supervisor for one client and passed with
// SCM_RIGHTS to that client and to the workers; no other client can map it):
//   ClientSegmentHeader | ClientEvents | JobSlot[slot_count] | payload arena
//
// docs/design/job_states.md describes the job slot state machine; docs/design/ring.md the rings.
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#include "gpuq/common/event_count.hpp"
#include "gpuq/common/job_metrics.hpp"
#include "gpuq/common/job_ring.hpp"
#include "gpuq/common/pool_queue.hpp"
#include "gpuq/error.hpp"

namespace gpuq {

inline constexpr uint64_t kQueueMagic = 0x314D485355515047ull;   // "GPQUSHM1"
inline constexpr uint64_t kClientMagic = 0x31474553554B5047ull;  // "GPQKSEG1"
// 11: ClientEvents; 12: JobSlot::message and PoolShm::down_reason of kMessageBytes (2048, was
// 160 and 256), so that a failure's cause reaches its client whole; 13: a pool's queue is lanes
// (PoolQueue: per priority level a fresh lane and client lanes), not one ring.
// 14: JobSlot::stream (a streaming job's parts) and the stream window in a descriptor's flags.
inline constexpr uint32_t kLayoutVersion = 14;

inline constexpr uint32_t kMaxPools = 8;
inline constexpr uint32_t kMaxWorkers = 1024;
inline constexpr uint32_t kMaxClients = 1023;        // 10 bits; index 1023 is never used
inline constexpr uint32_t kMaxSlotsPerClient = 256;  // 8 bits
inline constexpr uint32_t kPoolNameBytes = 32;
inline constexpr uint32_t kMaxParamBytes = 192;
// A job's failure message, NUL included (JobSlot::message; a down pool's reason too). Written
// and read only when a job fails: its size costs memory (slots x clients), never time per job.
inline constexpr uint32_t kMessageBytes = 2048;

// ---- Job references: what the rings carry ------------------------------------------------------

// A 32-bit reference to a job slot: {client:10 | slot:8 | generation:14}. The generation is the
// low 14 bits of the slot's 32-bit generation; a worker compares it before it acts, so a stale
// reference left in a ring by a cancelled job cannot act on the slot's next job.
struct JobRef {
  uint32_t client;
  uint32_t slot;
  uint32_t generation;  // low 14 bits

  static constexpr uint32_t kGenerationMask = (1u << 14) - 1;

  constexpr uint32_t pack() const noexcept {
    return (client << 22) | (slot << 14) | (generation & kGenerationMask);
  }
  static constexpr JobRef unpack(uint32_t v) noexcept {
    return JobRef{v >> 22, (v >> 14) & 0xFFu, v & kGenerationMask};
  }
};
static_assert(JobRef{kMaxClients - 1, kMaxSlotsPerClient - 1, JobRef::kGenerationMask}.pack() !=
              JobRing::kEmptyValue);

// ---- Job slot state word -----------------------------------------------------------------------

// States of a job slot (docs/design/requirements.md, "Jobs").
enum class JobState : uint8_t {
  kFree = 0,       // owned by the client, not in use
  kClaimed = 1,    // the client is writing the descriptor
  kSubmitted = 2,  // in a pool ring, waiting for a worker
  kRunning = 3,    // a worker owns it
  kDone = 4,       // terminal: succeeded
  kFailed = 5,     // terminal: outcome.code says why
  kCancelled = 6,  // terminal: cancelled (queued, or running and stopped)
  kExpired = 7,    // terminal: its deadline passed while queued
};

constexpr bool is_terminal(JobState s) noexcept {
  return s >= JobState::kDone;
}

// The slot's state word: {generation:32 | state:8 | worker+1:24}. Every transition is a CAS on
// the whole word, so an actor holding a stale generation cannot move a reused slot.
struct SlotWord {
  uint32_t generation;
  JobState state;
  uint32_t worker_plus_one;  // 0: no worker; else the id of the worker that owns/ran the job

  constexpr uint64_t pack() const noexcept {
    return (uint64_t{generation} << 32) | (uint64_t{static_cast<uint8_t>(state)} << 24) |
           (worker_plus_one & 0xFFFFFFu);
  }
  static constexpr SlotWord unpack(uint64_t w) noexcept {
    return SlotWord{static_cast<uint32_t>(w >> 32), static_cast<JobState>((w >> 24) & 0xFFu),
                    static_cast<uint32_t>(w & 0xFFFFFFu)};
  }
};

// ---- Client segment ---------------------------------------------------------------------------

// What the client asks for (IN, written by the client while the slot is kClaimed). Untrusted:
// a worker copies it out and validates every field before use.
struct JobDescriptor {
  uint32_t op_id;
  uint32_t pool_id;
  uint32_t flags;  // kJobFlag*
  uint32_t params_bytes;
  uint64_t input_offset;  // relative to the payload arena
  uint64_t input_bytes;
  uint64_t output_offset;  // relative to the payload arena
  uint64_t output_capacity;
  uint64_t deadline_ns;            // CLOCK_MONOTONIC; kNoDeadline for none
  uint64_t submit_stamp;           // when the client pushed it (a job stamp: clock.hpp)
  uint8_t params[kMaxParamBytes];  // ParamBlock encoding (params.hpp)
};
inline constexpr uint32_t kJobFlagRetryable = 1u << 0;  // run again if its worker dies
// The job's Priority (priority.hpp), 2 bits; 3 is not a level (a worker fails such a job).
inline constexpr uint32_t kJobFlagPriorityShift = 1;
inline constexpr uint32_t kJobFlagPriorityMask = 3u << kJobFlagPriorityShift;
// A streaming job's window (docs/design/streams.md): how many parts may wait unread, 1 to
// kMaxStreamWindow; 0: not a stream (the job answers once, at its end). 4 bits.
inline constexpr uint32_t kJobFlagStreamShift = 3;
inline constexpr uint32_t kJobFlagStreamMask = 15u << kJobFlagStreamShift;
inline constexpr uint32_t kMaxStreamWindow = 8;
inline constexpr uint32_t kJobFlagsKnown =
    kJobFlagRetryable | kJobFlagPriorityMask | kJobFlagStreamMask;
constexpr uint32_t stream_flags(uint32_t window) noexcept {
  return (window << kJobFlagStreamShift) & kJobFlagStreamMask;
}
constexpr uint32_t flags_stream_window(uint32_t flags) noexcept {
  return (flags & kJobFlagStreamMask) >> kJobFlagStreamShift;
}
// A stream's output buffer is cut into `window` equal part cells, each a multiple of 64 bytes
// (the rest of the buffer unused): part i lies in cell i % window. 0: too small a buffer.
constexpr uint64_t stream_cell_bytes(uint64_t output_capacity, uint32_t window) noexcept {
  return window == 0 ? 0 : (output_capacity / window) & ~uint64_t{63};
}
constexpr uint32_t priority_flags(Priority p) noexcept {
  return uint32_t{static_cast<uint8_t>(p)} << kJobFlagPriorityShift;
}
// The priority `flags` name; kNormal for the one value that is none (a worker refuses it).
constexpr Priority flags_priority(uint32_t flags) noexcept {
  const uint32_t v = (flags & kJobFlagPriorityMask) >> kJobFlagPriorityShift;
  return v < kPriorityLevels ? static_cast<Priority>(v) : Priority::kNormal;
}
static_assert(std::is_trivially_copyable_v<JobDescriptor>);
static_assert(sizeof(JobDescriptor) == 256);
static_assert(offsetof(JobDescriptor, params) == 64);

// What happened (OUT, written by the worker before it stores the terminal state). The message
// lives apart, in JobSlot::message, and is written and read only when code != kOk: a successful
// job's outcome and state word share one cache line, the one line its client must fetch.
struct JobOutcome {
  int32_t code;  // ErrorCode
  uint32_t worker_id;
  uint64_t output_bytes;   // bytes written to the output buffer
  uint64_t value;          // small scalar result (e.g. checksum)
  uint64_t started_stamp;  // job stamps (clock.hpp); 0: the job never started
  uint64_t finished_stamp;
};
static_assert(std::is_trivially_copyable_v<JobOutcome>);
static_assert(sizeof(JobOutcome) == 40);

// A streaming job's parts (docs/design/streams.md): the worker writes part i into cell
// i % window of the job's output buffer (stream_cell_bytes), its size into part_bytes, then
// publishes it by storing `written` = i + 1 (release) and notifying the slot's `done`. The
// client reads part i once `written` > i (acquire), and gives its cell back by storing `read`
// = i + 1 (release) and notifying `room`, on which a worker with `window` parts unread waits.
// The client zeroes both counters before it submits a stream job. Only the job's client and
// worker write here; each trusts the other's counter no further than its own memory: a client
// that forges `read` loses its own unread parts, one that forges `written` reads garbage.
struct alignas(64) JobStream {
  std::atomic<uint32_t> written;          // parts published (worker)
  std::atomic<uint32_t> read;             // parts whose cells the client gave back (client)
  EventCount room;                        // notified when `read` moves
  uint32_t part_bytes[kMaxStreamWindow];  // the size of the part in each cell
};
static_assert(sizeof(JobStream) == 64);

// Cache-line plan: line 0 holds everything a finished job's client reads (state word, outcome);
// the descriptor starts on line 1 with its fixed fields, params after them.
struct alignas(64) JobSlot {
  std::atomic<uint64_t> state;  // SlotWord
  EventCount done;              // notified when the slot reaches a terminal state
  // Non-zero once the job was asked to stop (kCancelBy* bits); a running op may poll it. The
  // client sets kCancelByClient; the supervisor kCancelByTimeLimit, and kCancelByClient for a
  // client that left (docs/design/faults.md, "Jobs that do not end").
  std::atomic<uint32_t> cancel_requested;
  // The job's own time limit in milliseconds (0: none), written by the client with the
  // descriptor; the smaller of it and its pool's job_time_limit_ms applies. Untrusted, but it
  // can only shorten the pool's limit.
  uint32_t time_limit_ms;
  JobOutcome outcome;
  JobDescriptor desc;
  char message[kMessageBytes];  // NUL-terminated; meaningful only when outcome.code != kOk
  JobStream stream;             // a streaming job's parts; untouched by any other job
};
static_assert(std::is_standard_layout_v<JobSlot>);
static_assert(offsetof(JobSlot, desc) == 64);

inline constexpr uint32_t kCancelByClient = 1u << 0;
inline constexpr uint32_t kCancelByTimeLimit = 1u << 1;

// Copies `text` into `out` (`capacity` bytes, NUL-terminated); returns the length copied. A text
// that does not fit keeps its beginning and its end, with " ... " between: a message names what
// failed first and its cause last, and both matter.
inline size_t fit_message(char* out, size_t capacity, std::string_view text) noexcept {
  if (capacity == 0) return 0;
  size_t n = text.size();
  constexpr std::string_view kCut = " ... ";
  if (n < capacity || capacity <= kCut.size() + 2) {
    n = std::min(n, capacity - 1);  // fits, or too small a room to cut in: its beginning
    std::memcpy(out, text.data(), n);
  } else {
    n = capacity - 1;
    const size_t head = (n - kCut.size()) / 2;
    const size_t tail = n - kCut.size() - head;
    std::memcpy(out, text.data(), head);
    std::memcpy(out + head, kCut.data(), kCut.size());
    std::memcpy(out + head + kCut.size(), text.data() + text.size() - tail, tail);
  }
  out[n] = '\0';
  return n;
}

// Sets `slot`'s message (fit_message). Call before the terminal state store, and only for a job
// that failed: a successful job's message is never written nor read.
inline void set_slot_message(JobSlot& slot, std::string_view text) noexcept {
  fit_message(slot.message, kMessageBytes, text);
}
static_assert(std::is_trivially_destructible_v<JobSlot>);
static_assert(sizeof(JobSlot) % 64 == 0);

struct alignas(64) ClientSegmentHeader {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t client_index;
  uint32_t slot_count;
  uint32_t reserved;
  uint64_t slots_offset;
  uint64_t arena_offset;
  uint64_t arena_bytes;
  uint64_t segment_bytes;
};
static_assert(std::is_trivially_copyable_v<ClientSegmentHeader>);

// Right after the header: what a client waits on when it watches many jobs at once.
struct alignas(64) ClientEvents {
  // Notified after any of this client's jobs reaches a terminal state (by whoever ended it: a
  // worker, the supervisor's recovery, the client's own cancel or expiry), after the job's own
  // `done`. A thread watching many jobs (Client::wait_any) sleeps here instead of polling them.
  // Written by the client too: a forged count costs its own jobs a needless FUTEX_WAKE, nothing
  // more.
  EventCount ended;
};
static_assert(std::is_standard_layout_v<ClientEvents> &&
              std::is_trivially_destructible_v<ClientEvents>);
static_assert(sizeof(ClientEvents) == 64);
// Where the slots may start at the earliest: after the header and the events.
inline constexpr uint64_t kClientSlotsMinOffset =
    sizeof(ClientSegmentHeader) + sizeof(ClientEvents);

// Geometry of a client segment for `slot_count` slots and an arena of at least `arena_bytes`.
struct ClientSegmentGeometry {
  uint64_t slots_offset;
  uint64_t arena_offset;
  uint64_t arena_bytes;
  uint64_t segment_bytes;

  static ClientSegmentGeometry compute(uint32_t slot_count, uint64_t arena_bytes) noexcept {
    ClientSegmentGeometry g{};
    g.slots_offset = kClientSlotsMinOffset;
    uint64_t end = g.slots_offset + uint64_t{slot_count} * sizeof(JobSlot);
    g.arena_offset = (end + 4095) & ~uint64_t{4095};
    g.arena_bytes = (arena_bytes + 4095) & ~uint64_t{4095};
    g.segment_bytes = g.arena_offset + g.arena_bytes;
    return g;
  }
};

// ---- Queue segment ----------------------------------------------------------------------------

enum class DaemonState : uint32_t { kStarting = 0, kRunning = 1, kDraining = 2, kStopped = 3 };
enum class PoolKind : uint32_t { kCpu = 0, kGpu = 1 };
enum class WorkerState : uint32_t {
  kStarting = 0,    // spawned, not ready yet
  kReady = 1,       // waiting for or running jobs
  kRestarting = 2,  // exited; a replacement is scheduled
  kFailed = 3,      // kept dying at start-up; tried again after the start back-off
  kStopped = 4,     // exited during shutdown
};

struct alignas(64) QueueHeader {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t header_bytes;
  uint64_t epoch;  // random per daemon start: a restarted daemon has a new one
  uint64_t segment_bytes;
  uint64_t start_unix_ns;
  uint32_t pool_count;
  uint32_t worker_count;
  uint32_t max_clients;
  uint32_t reserved;
  uint64_t pools_offset;
  uint64_t workers_offset;
  uint64_t clients_offset;
  std::atomic<uint32_t> daemon_state;  // DaemonState
  // Raised (release) by the supervisor whenever the pools or the ops change (a rollout that
  // re-listed a Python pool's ops; a reload): a client compares it with the generation of the
  // catalog it holds (Welcome.catalog) and asks for the new one (CatalogRequest) when they
  // differ. A client may scribble on it: that costs it, and anyone it fooled, one needless
  // request (docs/design/live_changes.md, "Clients see it without reconnecting").
  std::atomic<uint32_t> catalog_generation;
};

// PoolShm::accepting: whether a submit may push to the pool. A client reads it (seq_cst) before
// each push, and the supervisor alone writes it.
inline constexpr uint32_t kPoolNotAccepting = 0;  // draining, or an unavailable pool: ShuttingDown
inline constexpr uint32_t kPoolAccepting = 1;
// No ready worker for pool_down_fail_ms: a submit fails with PoolDown and `down_reason`
// (docs/design/faults.md, "A pool that cannot serve").
inline constexpr uint32_t kPoolDown = 2;
// Removed by a config reload (docs/design/live_changes.md): a submit fails with UnknownPool, its
// queued and running jobs finish. For good: the record is never given to another pool.
inline constexpr uint32_t kPoolRemoved = 3;
inline constexpr uint32_t kPoolDownReasonBytes = kMessageBytes;

struct alignas(64) PoolShm {
  char name[kPoolNameBytes];
  uint32_t id;
  uint32_t kind;      // PoolKind
  uint32_t capacity;  // cells of each lane = queue_factor x workers
  uint32_t worker_count;
  uint32_t first_worker;  // index into WorkerShm[]
  uint32_t client_share;  // most cells one client may hold (client_queue_share x capacity)
  uint64_t queue_offset;  // the PoolQueue, from the start of the queue segment
  uint32_t client_lanes;  // PoolQueue's client lanes per level
  uint32_t reserved_lanes;
  alignas(64) std::atomic<uint32_t> accepting;  // kPoolAccepting, kPoolNotAccepting, kPoolDown
  // Workers of this pool asleep on their own `wake` (a hint for QueueView::wake_worker).
  alignas(64) std::atomic<uint32_t> sleepers;
  // Workers of this pool in the first, pause-only phase of their idle spin (on their core, not
  // yielding it): a push needs no wakeup while one of them is looking at the ring.
  alignas(64) std::atomic<uint32_t> spinning;
  alignas(64) EventCount space;  // producers sleep here when the ring is full
  // Why the pool is down: the error a submit returns while `accepting` is kPoolDown (it names
  // the pool and its last worker's exit). A seqlock: the supervisor makes `down_seq` odd, writes
  // the text, makes it even; read and written a byte at a time as relaxed atomics
  // (set_pool_down_reason, pool_down_reason). Clients can scribble on it: a reader only ever
  // copies it into a message.
  alignas(64) std::atomic<uint32_t> down_seq;
  char down_reason[kPoolDownReasonBytes];  // NUL-terminated
};

static_assert(std::atomic_ref<char>::is_always_lock_free);
static_assert(std::atomic_ref<int32_t>::is_always_lock_free);  // WorkerShm::cpu

// The supervisor's side of PoolShm::down_reason (fit_message). Not thread-safe: one writer.
inline void set_pool_down_reason(PoolShm& p, std::string_view text) noexcept {
  char fitted[kPoolDownReasonBytes];
  const size_t n = fit_message(fitted, sizeof fitted, text);
  const uint32_t seq = p.down_seq.load(std::memory_order_relaxed);
  p.down_seq.store(seq | 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  for (size_t i = 0; i <= n; ++i) {
    std::atomic_ref<char>(p.down_reason[i]).store(fitted[i], std::memory_order_relaxed);
  }
  p.down_seq.store((seq | 1) + 1, std::memory_order_release);
}

// A client's copy of PoolShm::down_reason: a consistent copy unless the supervisor rewrites it
// throughout (then the last try's, still NUL-terminated). Lock-free.
inline std::string pool_down_reason(PoolShm& p) {
  char text[kPoolDownReasonBytes];
  for (int attempt = 0; attempt < 100; ++attempt) {
    const uint32_t before = p.down_seq.load(std::memory_order_acquire);
    for (uint32_t i = 0; i < kPoolDownReasonBytes; ++i) {
      text[i] = std::atomic_ref<char>(p.down_reason[i]).load(std::memory_order_relaxed);
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    if ((before & 1) == 0 && p.down_seq.load(std::memory_order_relaxed) == before) break;
  }
  text[kPoolDownReasonBytes - 1] = '\0';
  return std::string(text);
}

struct alignas(64) WorkerShm {
  uint32_t id;
  uint32_t pool_id;
  // The CPU the worker is pinned to (-1: several). Written by the supervisor (atomic_ref, when
  // a spare is promoted, the two workers' CPUs are swapped), read by wake_worker.
  int32_t cpu;
  uint32_t reserved0;
  EventCount wake;  // the worker sleeps here when its ring is empty
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> state;  // WorkerState
  std::atomic<uint32_t> restarts;
  std::atomic<uint32_t> control_seq;  // bumped by the supervisor after each control message
  std::atomic<uint32_t> busy;         // 1 while running a job
  // 1 while the worker sleeps on `wake` and no one has woken it yet: a waker claims the wakeup
  // by exchanging it to 0, so a burst of pushes wakes distinct workers, not one worker N times.
  std::atomic<uint32_t> asleep;
  alignas(64) std::atomic<uint64_t> jobs_done;
  std::atomic<uint64_t> jobs_failed;
};

// A client's share of each ring (the cells it may hold) is counted by the client itself, not
// here: a count in shared memory cost a cross-core transfer each way per job (the client's
// increment, the worker's decrement), and any client could overwrite another's
// (docs/design/ring.md, "Shares"). `submitting` and `submitted`, which only the client writes
// on its hot path, live on a line of their own and stay in its cache.
struct alignas(64) ClientShm {
  std::atomic<uint64_t> session;  // nonzero while a client holds this index
  std::atomic<int32_t> pid;
  alignas(64) std::atomic<uint32_t> submitting;  // >0 while the client is inside submit
  std::atomic<uint64_t> submitted[kMaxPools];    // jobs pushed to each pool (status counter)
};
static_assert(offsetof(ClientShm, submitting) == 64);

static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<int32_t>::is_always_lock_free);
static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(std::is_standard_layout_v<QueueHeader> &&
              std::is_trivially_destructible_v<QueueHeader>);
static_assert(std::is_standard_layout_v<PoolShm> && std::is_trivially_destructible_v<PoolShm>);
static_assert(std::is_standard_layout_v<WorkerShm> && std::is_trivially_destructible_v<WorkerShm>);
static_assert(std::is_standard_layout_v<ClientShm> && std::is_trivially_destructible_v<ClientShm>);
static_assert(sizeof(QueueHeader) % 64 == 0 && sizeof(PoolShm) % 64 == 0);
static_assert(sizeof(WorkerShm) % 64 == 0 && sizeof(ClientShm) % 64 == 0);
static_assert(offsetof(WorkerShm, jobs_done) == 64);

// A worker's words that only it and the supervisor map: a memfd the supervisor makes for each
// worker and passes at start (fd 4, --private-fd). What the supervisor acts on when it stops a
// worker for a job that did not end must not be writable by clients, which map the queue
// segment (docs/design/faults.md, "Jobs that do not end").
struct alignas(64) WorkerPrivate {
  // Odd while the worker runs a job: it stores `job` and `job_started`, then the odd value
  // (release) after its claim, and the next even value (seq_cst) after the job's end. A reader
  // takes `job` and `job_started` as a seqlock's data: the same odd value before and after.
  std::atomic<uint64_t> job_seq;
  std::atomic<uint64_t> job_started;  // a job stamp (clock.hpp)
  std::atomic<uint64_t> session;      // the job's client's session (a reused index is not it)
  std::atomic<uint32_t> job;          // a packed JobRef
  // How many jobs the running call serves (a batched op's call, docs/python.md "Dynamic
  // batching"; 1 for any other job), with `job` the batch's job whose time limit comes first.
  // Part of the seqlock's data. A client's cancel does not stop a call that serves others.
  std::atomic<uint32_t> batch_jobs;
  // Nonzero: the worker takes no job from its ring. kHoldStop: raised by the supervisor before
  // it kills this worker for a job that did not end (the Dekker pair with job_seq, faults.md);
  // the worker looks again every few milliseconds. kHoldSpare: a spare worker, ready and kept
  // out of the ring (set before it is started, so it never takes a job) until the supervisor
  // promotes it: it lowers `hold` and then sends WorkerPromote, which wakes the worker; a spare
  // sleeps on its control socket with no timeout meanwhile.
  std::atomic<uint32_t> hold;
};
inline constexpr uint32_t kHoldStop = 1;
inline constexpr uint32_t kHoldSpare = 2;
static_assert(std::is_standard_layout_v<WorkerPrivate> &&
              std::is_trivially_destructible_v<WorkerPrivate>);
static_assert(sizeof(WorkerPrivate) <= kWorkerMetricsOffset);
// The private memfd: WorkerPrivate, then WorkerMetrics (job_metrics.hpp) from the next page.
inline constexpr uint64_t kWorkerPrivateBytes =
    kWorkerMetricsOffset + ((sizeof(WorkerMetrics) + 4095) & ~uint64_t{4095});
inline constexpr int kWorkerPrivateFd = 4;  // where a worker finds it

// Where things are in a queue segment: a process-local copy of the layout fields of the header
// and of each pool, taken once. Every process that maps the segment can write those fields (a
// client may scribble over them); indexing with a copy taken at a trusted moment, and checked
// against the mapping's size, keeps such a scribble from moving anyone's accesses.
struct QueueLayout {
  struct Pool {
    uint64_t queue_offset = 0;
    uint32_t capacity = 0;
    uint32_t client_lanes = 1;
    uint32_t first_worker = 0;
    uint32_t worker_count = 0;
  };
  uint64_t pools_offset = 0;
  uint64_t workers_offset = 0;
  uint64_t clients_offset = 0;
  uint32_t pool_count = 0;
  uint32_t worker_count = 0;
  uint32_t max_clients = 0;
  Pool pools[kMaxPools];
};

// Typed views of a mapped queue segment. Cheap to copy; does not own the mapping.
class QueueView {
 public:
  QueueView() = default;
  // Reads the layout from the segment as it is now, unchecked: for the supervisor, which wrote
  // it (construct again after writing the header and the pools).
  explicit QueueView(void* base) noexcept;
  // Reads the layout and checks it against the mapping: magic, version, counts within limits,
  // every array and pool queue inside the first `mapped_bytes` bytes, each pool's workers within
  // the worker array and each queue's and lane's own header agreeing on their geometry. For
  // workers and clients.
  static Result<QueueView> attach(void* base, uint64_t mapped_bytes);

  // Writes the layout fields back into the segment from this view's copy (the supervisor,
  // before it starts a worker, so a scribble cannot stop workers from attaching).
  void restore_shared_layout() const noexcept;

  const QueueLayout& layout() const noexcept { return layout_; }
  QueueHeader& header() const noexcept { return *reinterpret_cast<QueueHeader*>(base_); }
  PoolShm& pool(uint32_t i) const noexcept {
    return reinterpret_cast<PoolShm*>(base_ + layout_.pools_offset)[i];
  }
  WorkerShm& worker(uint32_t i) const noexcept {
    return reinterpret_cast<WorkerShm*>(base_ + layout_.workers_offset)[i];
  }
  ClientShm& client(uint32_t i) const noexcept {
    return reinterpret_cast<ClientShm*>(base_ + layout_.clients_offset)[i];
  }
  PoolQueue queue(uint32_t pool) const noexcept {
    const QueueLayout::Pool& lp = layout_.pools[pool];
    return PoolQueue(base_ + lp.queue_offset, lp.capacity, lp.client_lanes);
  }
  char* base() const noexcept { return base_; }

  // After a push to `pool`: wakes one sleeping worker of the pool, preferring one pinned to
  // `cpu` (the caller's CPU: the wakeup then needs no cross-core interrupt, which costs tens of
  // microseconds on a VM). Costs a fence and one load when no worker sleeps. Lock-free.
  //
  // A wakeup is claimed: the waker exchanges the worker's `asleep` from 1 to 0 and only the
  // winner notifies. A worker already woken but not yet running is skipped, so the next push of
  // a burst wakes the next sleeping worker (on another core) instead of the same one again.
  //
  // No lost wakeup: a worker registers in its `wake` event count, sets `asleep`, raises the
  // pool's `sleepers`, issues a seq_cst fence, and only then re-checks the ring. The pusher's
  // fence (or its seq_cst push) orders its push before its seq_cst load of `sleepers`; so
  // either the worker's re-check sees the push, or the pusher
  // sees `sleepers` > 0 and then that worker's `asleep` = 1 (and notifies it), or `asleep` = 0
  // because the worker is already awake or another pusher claimed it: in both cases the worker
  // returns to the top of its loop, where it pops.
  // `cpu`: the caller's CPU, -1 for sched_getcpu() (called only when a wakeup is needed).
  void wake_worker(uint32_t pool, int cpu = -1) const noexcept {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    wake_worker_after_push(pool, cpu);
  }

  // The same, right after this thread's successful try_push to `pool`, without the fence: the
  // push's CASes are seq_cst (job_ring.hpp), which orders the push before the loads below as
  // the fence would. The worker's side has its fence after raising `sleepers`.
  void wake_worker_after_push(uint32_t pool, int cpu = -1) const noexcept {
    PoolShm& p = this->pool(pool);
    if (p.sleepers.load(std::memory_order_seq_cst) == 0) return;
    if (p.spinning.load(std::memory_order_seq_cst) != 0) return;  // a spinner will pop it
    // sched_getcpu's failure (-1, ENOSYS) needs no check: no worker has CPU -1, so the first
    // pass finds no one and the second looks at every worker.
    if (cpu < 0) cpu = sched_getcpu();
    auto claim = [](WorkerShm& w) {
      uint32_t one = 1;
      return w.asleep.load(std::memory_order_relaxed) == 1 &&
             w.asleep.compare_exchange_strong(one, 0, std::memory_order_seq_cst);
    };
    const QueueLayout::Pool& lp = layout_.pools[pool];
    for (int pass = 0; pass < 2; ++pass) {
      for (uint32_t i = 0; i < lp.worker_count; ++i) {
        WorkerShm& w = worker(lp.first_worker + i);
        // `cpu` moves when a spare takes a dead worker's place (the supervisor stores it).
        const int32_t its_cpu = std::atomic_ref<int32_t>(w.cpu).load(std::memory_order_relaxed);
        if ((pass == 0) != (its_cpu == cpu)) continue;  // pass 0: the caller's CPU; 1: the rest
        if (claim(w)) {
          w.wake.notify_one();
          return;
        }
      }
    }
  }

 private:
  char* base_ = nullptr;
  QueueLayout layout_;
};

// Typed view of a mapped client segment. The geometry comes from the supervisor (never from the
// segment itself, which the client can write).
class ClientSegmentView {
 public:
  ClientSegmentView() = default;
  ClientSegmentView(void* base, const ClientSegmentGeometry& g, uint32_t slot_count) noexcept
      : base_(static_cast<char*>(base)), geometry_(g), slot_count_(slot_count) {}

  JobSlot& slot(uint32_t i) const noexcept {
    return reinterpret_cast<JobSlot*>(base_ + geometry_.slots_offset)[i];
  }
  ClientEvents& events() const noexcept {
    return *reinterpret_cast<ClientEvents*>(base_ + sizeof(ClientSegmentHeader));
  }
  // After `slot` (one of this segment's) reached a terminal state: wakes the threads waiting on
  // the job itself (its `done`), then those watching this client's jobs (ClientEvents::ended).
  // `after_seq_cst_rmw`: the terminal store was a seq_cst read-modify-write, so the first
  // notify needs no fence (EventCount::notify_all_after_rmw); the second never does, being
  // after the first's fence or RMW. True if a thread was waiting on the job itself.
  bool announce_end(JobSlot& slot, bool after_seq_cst_rmw) const noexcept {
    const bool woke = after_seq_cst_rmw ? slot.done.notify_all_after_rmw() : slot.done.notify_all();
    events().ended.notify_all_after_rmw();
    return woke;
  }
  // The same for a streaming job's part, published by a seq_cst exchange of `written`: its
  // client waits on the slot's `done` (Job::next_part) or on `ended` (wait_any).
  void announce_part(JobSlot& slot) const noexcept {
    slot.done.notify_all_after_rmw();
    events().ended.notify_all_after_rmw();
  }
  char* arena() const noexcept { return base_ + geometry_.arena_offset; }
  uint64_t arena_bytes() const noexcept { return geometry_.arena_bytes; }
  uint32_t slot_count() const noexcept { return slot_count_; }
  char* base() const noexcept { return base_; }
  const ClientSegmentGeometry& geometry() const noexcept { return geometry_; }

 private:
  char* base_ = nullptr;
  ClientSegmentGeometry geometry_{};
  uint32_t slot_count_ = 0;
};

}  // namespace gpuq
