// gpuq client library, C++ API.
//
//   auto client = gpuq::Client::connect();                    // finds the daemon's socket
//   if (!client) { std::cerr << client.error().to_string(); return 1; }
//   auto in = client->allocate(4096);                         // in this client's own segment
//   auto out = client->allocate(4096);
//   std::memcpy(in->data(), src, 4096);
//   gpuq::JobSpec spec;
//   spec.op = "echo";
//   spec.input = *in;
//   spec.output = *out;
//   auto job = client->submit(spec, 1s);                      // waits up to 1 s for room
//   auto result = job->wait(5s);                              // Result<JobResult>
//
// Thread-safety: a Client may be used from many threads at once (submit, allocate, wait...).
// One Job's wait(), poll() and cancel() may run in several threads at once (they read its slot,
// or change it with one atomic step, and a finished job wakes every waiter); moving, assigning
// or destroying a Job must not overlap any call on it. A Client does not survive fork(): in the
// child every call returns ForkedClient; connect a new Client there.
// Never touches CUDA. Links no CUDA library.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gpuq/buffer.hpp"
#include "gpuq/error.hpp"
#include "gpuq/export.hpp"
#include "gpuq/job_spec.hpp"
#include "gpuq/tensor.hpp"

namespace gpuq {

class ClientImpl;

enum class JobStatus { kQueued, kRunning, kDone, kFailed, kCancelled, kExpired };
GPUQ_API std::string_view job_status_name(JobStatus s) noexcept;

// The outcome of a finished job.
struct JobResult {
  JobStatus status = JobStatus::kQueued;
  ErrorCode code = ErrorCode::kOk;  // kOk for kDone; why, otherwise
  std::string message;              // the worker's message for a failure
  uint64_t output_size = 0;         // bytes written to the output buffer
  uint64_t value = 0;               // op's scalar result (checksum: the CRC32C)
  uint32_t worker_id = 0;
  // submit -> start -> finish. The start of a job a worker took straight after its previous
  // one is when that one finished (the worker takes one timestamp per job), so run_ns then
  // includes taking the job from the ring: well under a microsecond. A job that never started
  // (cancelled, expired or failed while queued, or failed when its worker died) has run_ns 0
  // and was queued until it ended. Timestamps come from the TSC where the kernel keeps time
  // with it (the daemon's `job_clock`, docs/config.md), else from CLOCK_MONOTONIC.
  uint64_t queued_ns = 0;  // submit -> start
  uint64_t run_ns = 0;     // start -> finish

  bool ok() const noexcept { return status == JobStatus::kDone; }
};

// A part of a streaming job's answer (JobSpec::stream_window), from Job::next_part. Its bytes
// lie in the job's output buffer and stay valid until the next next_part() on that Job (which
// gives the part's cell back to the worker) or the Job's end.
struct JobPart {
  uint32_t index = 0;  // 0 for the first part of the stream, then 1, 2, ...
  const void* data = nullptr;
  uint64_t size = 0;
};

// A submitted job. Move-only. Destroying an unfinished Job cancels it if it has not started
// and otherwise lets it finish and discards the result; its slot returns to the client then.
class GPUQ_API Job {
 public:
  Job() = default;
  Job(Job&& other) noexcept;
  Job& operator=(Job&& other) noexcept;
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;
  ~Job();

  // Waits until the job is finished or `timeout` passes (negative: forever). Spins briefly, then
  // sleeps on a futex. Errors: Timeout (job still pending; wait again), Disconnected (the daemon
  // died), ForkedClient. Blocking. The result stays readable: wait() again returns it again.
  Result<JobResult> wait(std::chrono::nanoseconds timeout = std::chrono::nanoseconds(-1));

  // A streaming job's next part (JobSpec::stream_window > 0), as soon as the worker has made
  // it: waits until the part comes, the job ends, or `timeout` passes (negative: forever).
  // Parts come in order, each once; reading one gives the previous one's cell back (at most
  // stream_window parts wait unread, and the op waits for room beyond that). Returns the part;
  // an empty optional once the stream has ended well (the job is DONE: wait() returns its
  // result); or, after the last part it made, the job's error (Cancelled, TimedOut, OpFailed,
  // ...: wait() returns the whole result). Errors besides: Timeout (no part yet: call again),
  // InvalidArgument (not a stream job), Disconnected, ForkedClient. Blocking; not thread-safe
  // (one reader per Job).
  Result<std::optional<JobPart>> next_part(
      std::chrono::nanoseconds timeout = std::chrono::nanoseconds(-1));

  // The job's current status, without blocking. Lock-free. A job still queued at its deadline
  // (JobSpec::expire_after) is expired here, as wait() does.
  Result<JobStatus> poll() const;

  // Cancels the job. A queued job ends CANCELLED at once. A running job is asked to stop: an
  // op that checks for cancellation (sleep, echo and checksum do) ends it CANCELLED; an op that
  // finishes first ends it with its result. An op that does neither within the daemon's
  // cancel_grace_ms has its worker stopped (and replaced), and the job ends CANCELLED. Never
  // both: wait() returns the one terminal state. Dropping a running Job asks the same.
  // Errors: NotCancellable (already finished), ForkedClient.
  Result<void> cancel();

  // Cancels the job only if no worker has taken it yet: a queued job ends CANCELLED at once
  // (true); a running or finished one is left as it is (false). What concurrent.futures'
  // cancel() means. Lock-free. Errors: ForkedClient.
  Result<bool> cancel_queued();

  // Waits until one or more of `jobs` have ended (done, failed, cancelled or expired), or
  // `timeout` passes (negative: forever), or wake_waiters() is called on the connection. One
  // thread watches any number of jobs this way without polling them: it sleeps on one event of
  // the connection that every job's end notifies. Returns the positions in `jobs` of those that
  // have ended (an empty handle counts as ended; read each with wait() or poll()): empty when
  // the timeout passed or wake_waiters() woke it. A job still queued at its deadline is expired
  // here, as wait() does. All jobs must be of one connection. Errors: InvalidArgument (jobs of
  // two connections), Disconnected (seen within a second of the daemon's end), ForkedClient.
  // Blocking; thread-safe.
  // (A vector, not std::span: this header is C++17, as the installed package promises.)
  static Result<std::vector<size_t>> wait_any(
      const std::vector<const Job*>& jobs,
      std::chrono::nanoseconds timeout = std::chrono::nanoseconds(-1));

  // Wakes every thread in wait_any() on this job's connection, whichever jobs it waits on: for
  // a watcher whose set of jobs changed (as this one, just submitted). Lock-free.
  void wake_waiters() const noexcept;

  bool valid() const noexcept { return impl_ != nullptr; }

 private:
  friend class ClientImpl;
  Job(ClientImpl* impl, uint32_t slot, uint32_t generation) noexcept
      : impl_(impl), slot_(slot), generation_(generation) {}
  void reset() noexcept;

  // The connection, kept alive while any of its Jobs lives (counted by the connection itself:
  // a shared_ptr here cost two locked instructions per job).
  ClientImpl* impl_ = nullptr;
  uint32_t slot_ = 0;
  uint32_t generation_ = 0;
  uint32_t parts_read_ = 0;  // a stream's parts read by next_part()
};

struct ConnectOptions {
  // Runtime directory of the daemon. Empty: $GPUQ_RUNTIME_DIR, else the daemon's rule
  // ($RUNTIME_DIRECTORY, else $XDG_RUNTIME_DIR/gpuq, else /tmp/gpuq-$UID) if a daemon's socket is
  // there, else /run/gpuq (the system service) if it exists, else the daemon's rule
  // (docs/service.md, "Finding the daemon").
  std::string runtime_dir;
  // Size of this client's payload segment (rounded up to 4 KiB); 0: the daemon's default.
  uint64_t segment_bytes = 0;
  // A name for logs and status (default: the program name).
  std::string name;
  // How long wait() spins at most before it sleeps. Spinning gives microsecond round trips on
  // an idle core; 0 sleeps at once. The connection spins less while its jobs outlast the spin
  // (it halves the spin after each wait that slept longer than this, and doubles it back after
  // one that a spin would have caught), so waits on long jobs burn no CPU.
  std::chrono::nanoseconds spin{std::chrono::microseconds(50)};
  // When this client disconnects or exits with jobs still running, the daemon cancels them
  // (forcing it after its cancel_grace_ms, so they stop holding workers). True: they run to
  // their end instead, and their results are dropped.
  bool keep_running_jobs = false;
};

struct PoolInfo {
  std::string name;
  std::string kind;  // "cpu" or "gpu"
  uint32_t capacity = 0;
  uint32_t client_share = 0;
  // False for a gpu pool that found no usable GPU when the daemon started; `unavailable_reason`
  // says why. Jobs submitted to it go to `runs_on`, or fail with NoDevice when that is empty.
  bool available = true;
  std::string unavailable_reason;
  // The pool that runs this pool's jobs: its own name when available; while unavailable, the
  // cpu pool named by its "fallback": "cpu" config, or empty (no fallback: NoDevice).
  std::string runs_on;
};

class GPUQ_API Client {
 public:
  // Connects to the daemon: checks the protocol version, is authenticated by the daemon
  // (SO_PEERCRED), and maps this client's payload segment. Errors: Disconnected (no daemon at
  // the socket), ProtocolMismatch, PermissionDenied, TooManyClients, InvalidArgument,
  // SystemError. Blocking; thread-safe.
  static Result<Client> connect(const ConnectOptions& options = {});

  // Connects again with the same options, to the daemon now at the runtime directory: after
  // Disconnected (the daemon died or stopped, and a new one, with a new epoch, started), or in
  // a forked child, to get a connection of its own. On success this Client uses the new
  // connection: Jobs of the old one return Disconnected, and its Buffers are invalid (allocate
  // new ones). On failure nothing changes. Errors: as connect(). Blocking; not thread-safe with
  // other calls on the same Client.
  Result<void> reconnect();

  Client(Client&&) noexcept;
  Client& operator=(Client&&) noexcept;
  ~Client();

  // Allocates `size` bytes (64-byte aligned) in the payload segment: blocks of 4 MiB or more
  // from the top of the highest free run that fits, smaller ones from the bottom of the lowest,
  // so that small blocks do not split the room large ones need. Errors: OutOfMemory (no free
  // run that large; the message gives the bytes free, the largest run and the blocks in use),
  // InvalidArgument (size 0), ForkedClient. Thread-safe.
  Result<Buffer> allocate(uint64_t size);
  // Returns a buffer from allocate(). Releasing a buffer a queued or running job uses is the
  // caller's bug: the job may read or write freed memory (only this client's own).
  void release(const Buffer& buffer);

  // Submits a job, waiting up to `timeout` for room in the pool's ring (negative: forever).
  // A job for an unavailable pool (PoolInfo::available) runs on its fallback pool
  // (PoolInfo::runs_on) if it has one. Errors: UnknownOp, UnknownPool, NoDevice (the pool is
  // unavailable and has no fallback; the message names the pool and the reason),
  // InvalidArgument (params), Timeout (the ring stayed full for `timeout`, counted from the
  // first look that found no room, or no job slot came free: every one of this client's
  // `max_jobs_per_client` slots holds an unfinished job), ShuttingDown, PoolDown (the pool has
  // had no ready worker for the daemon's pool_down_fail_ms; the message names the pool and its
  // last worker's exit), Disconnected, ForkedClient. A finished job gives its slot back when a
  // submit needs it, its result kept for its Job, so any number of Jobs may be held. Thread-safe;
  // lock-free when there is room.
  Result<Job> submit(const JobSpec& spec,
                     std::chrono::nanoseconds timeout = std::chrono::nanoseconds(-1));
  // Like submit() but returns QueueFull at once when there is no room (in the ring, or no job
  // slot free or finished). Never blocks.
  Result<Job> try_submit(const JobSpec& spec);

  // Tensor ops: build the job with the matching *_job() builder above, check that every
  // operand and y lie in this client's payload segment, and submit() it to `pool` (empty: the
  // first pool), waiting up to `timeout` for room. Errors: those of the builder; InvalidArgument
  // when a tensor's buffer is not in this client's segment (a Buffer of another Client, or
  // released by reconnect()) or when the dtype is f16 and the pool that would run the job is a
  // cpu pool; then those of submit(). Thread-safe.
  Result<Job> conv2d(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b,
                     const Tensor& y, const Conv2dOptions& options = {},
                     const std::string& pool = {},
                     std::chrono::nanoseconds timeout = std::chrono::nanoseconds(-1));
  Result<Job> activation(const Tensor& x, const Tensor& y, ActivationMode mode,
                         const std::string& pool = {},
                         std::chrono::nanoseconds timeout = std::chrono::nanoseconds(-1));
  Result<Job> softmax(const Tensor& x, const Tensor& y, const SoftmaxOptions& options = {},
                      const std::string& pool = {},
                      std::chrono::nanoseconds timeout = std::chrono::nanoseconds(-1));
  Result<Job> pool2d(const Tensor& x, const Tensor& y, const Pool2dOptions& options,
                     const std::string& pool = {},
                     std::chrono::nanoseconds timeout = std::chrono::nanoseconds(-1));
  Result<Job> batchnorm(const Tensor& x, const Tensor& scale, const Tensor& bias,
                        const Tensor& mean, const Tensor& var, const Tensor& y,
                        const BatchNormOptions& options = {}, const std::string& pool = {},
                        std::chrono::nanoseconds timeout = std::chrono::nanoseconds(-1));
  Result<Job> gemm(const Tensor& a, const Tensor& b, const std::optional<Tensor>& c,
                   const Tensor& y, const GemmOptions& options = {}, const std::string& pool = {},
                   std::chrono::nanoseconds timeout = std::chrono::nanoseconds(-1));

  // The daemon's pools and ops: from the handshake, asked of the daemon again when its catalog
  // has changed since (a rolling restart that added or removed ops; a reload). A reference from
  // pools() stays valid as long as the Client.
  const std::vector<PoolInfo>& pools() const noexcept;
  std::vector<std::string> ops() const;
  uint64_t segment_bytes() const noexcept;
  uint32_t slot_count() const noexcept;
  uint64_t daemon_epoch() const noexcept;

  // The payload arena, where Buffer offsets count from: this process's address of its first
  // byte, and its size. Memory at [arena() + offset, arena() + offset + size) with
  // offset + size <= arena_bytes() is Buffer{offset, size, arena() + offset}: how a binding
  // finds whether an array it was given lies in the segment (and needs no copy).
  std::byte* arena() const noexcept;
  uint64_t arena_bytes() const noexcept;

 private:
  explicit Client(std::shared_ptr<ClientImpl> impl) noexcept;
  std::shared_ptr<ClientImpl> impl_;
};

// Daemon status document (the JSON of `gpuqctl status --json`), over a short control
// connection that registers no client. `runtime_dir` as in ConnectOptions. Errors:
// Disconnected (no daemon), PermissionDenied, ProtocolMismatch. Blocking.
GPUQ_API Result<std::string> daemon_status_json(const std::string& runtime_dir = {});

// The daemon's metrics in the Prometheus text format (docs/metrics.md; `gpuqctl metrics`), over
// a short control connection that registers no client. Errors as daemon_status_json, and
// ProtocolMismatch for a reply without its text. Blocking.
GPUQ_API Result<std::string> daemon_metrics_text(const std::string& runtime_dir = {});

// A rolling restart of pool `pool` (docs/design/live_changes.md): its workers are replaced one
// by one by new processes, each made ready before the one it replaces stops taking jobs; no
// queued job is failed or reordered. Returns once every worker runs the new generation, with
// it. `timeout_s`: how long to wait for that (0: no limit; the rollout goes on after a
// Timeout). Errors: UnknownPool; WorkerDied when a new worker did not start (the message has
// its stderr; the old workers serve on); InvalidArgument when the pool has no seat for a new
// worker or a rollout of it is in progress; ShuttingDown; and daemon_status_json's.
GPUQ_API Result<uint32_t> daemon_restart_pool(const std::string& pool,
                                              const std::string& runtime_dir = {},
                                              uint32_t timeout_s = 0);

// Asks the daemon to read its config file again and apply what changed (docs/service.md,
// "Config reload"): daemon keys that may change live, pools rolled for new Python settings,
// pools removed (they drain). Returns once applied and the rolling restarts it started have
// ended: one line per change. `timeout_s`: how long to wait (0: no limit). Errors:
// InvalidArgument naming the keys that cannot change live, or the file's error (nothing
// changed); WorkerDied when a rollout it started failed (that pool's settings are back);
// ShuttingDown; and daemon_status_json's.
GPUQ_API Result<std::vector<std::string>> daemon_reload(const std::string& runtime_dir = {},
                                                        uint32_t timeout_s = 0);

// Asks the daemon to drain (finish queued and running jobs, accept no new ones) and exit.
// Returns once the daemon has acknowledged. Errors as daemon_status_json.
GPUQ_API Result<void> daemon_stop(const std::string& runtime_dir = {});

// The daemon's runtime directory as resolved by the rule in ConnectOptions::runtime_dir.
GPUQ_API std::string default_runtime_dir();

// Library version string ("0.1.0").
GPUQ_API std::string_view version() noexcept;

}  // namespace gpuq
