#include "worker.hpp"

#include <fcntl.h>
#include <sched.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstddef>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "gpuq/common/clock.hpp"
#include "gpuq/common/log.hpp"
#include "gpuq/common/protocol.hpp"
#include "gpuq/common/shm.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "job_validation.hpp"

namespace gpuq::daemon {
namespace {

constexpr uint64_t kIdleRecheckNs = 1'000'000'000;
// The part of the idle spin during which this worker counts as `spinning` (see loop()).
constexpr uint64_t kSpinningNs = kSpinPauseOnlyNs;

struct MappedClient {
  uint64_t session = 0;
  MemfdSegment segment;
  ClientSegmentView view;
};

class Worker {
 public:
  explicit Worker(const WorkerOptions& o) : options_(o) {}

  int run() {
    auto seg = QueueSegment::open(options_.queue_segment);
    if (!seg) {
      GPUQ_LOG_ERROR("cannot open the queue segment: %s", seg.error().to_string().c_str());
      return 1;
    }
    segment_ = std::move(*seg);
    queue_ = QueueView(segment_.address());
    const QueueHeader& h = queue_.header();
    if (h.magic != kQueueMagic || h.layout_version != kLayoutVersion ||
        options_.worker_id >= h.worker_count || options_.pool_id >= h.pool_count) {
      GPUQ_LOG_ERROR("queue segment '%s' does not match this worker (layout %u)",
                     options_.queue_segment.c_str(), h.layout_version);
      return 1;
    }
    clients_.resize(h.max_clients);
    pool_ = &queue_.pool(options_.pool_id);
    self_ = &queue_.worker(options_.worker_id);
    ring_ = queue_.ring(options_.pool_id);

    // Control messages queued before start-up (the current clients' segments).
    seen_control_ = self_->control_seq.load(std::memory_order_acquire);
    if (!drain_control()) return 1;

    self_->pid.store(getpid(), std::memory_order_relaxed);
    self_->state.store(static_cast<uint32_t>(WorkerState::kReady), std::memory_order_release);
    nlohmann::json ready{{"worker", options_.worker_id}};
    if (auto r = send_message(options_.control_fd, MessageType::kWorkerReady, ready.dump()); !r) {
      GPUQ_LOG_ERROR("cannot report ready: %s", r.error().to_string().c_str());
      return 1;
    }
    return loop();
  }

 private:
  int loop() {
    const uint64_t spin_ns = uint64_t{options_.spin_us} * 1000;
    for (;;) {
      if (self_->control_seq.load(std::memory_order_acquire) != seen_control_) {
        seen_control_ = self_->control_seq.load(std::memory_order_acquire);
        if (!drain_control()) return 1;
      }
      uint32_t value;
      if (ring_.try_pop(&value)) {
        handle(value);
        continue;
      }
      if (stopping_) return 0;  // ring drained after WorkerStop
      // Nothing queued: spin a little, then sleep on the pool's event count.
      auto has_work = [&] {
        return ring_.value_at_head() ||
               self_->control_seq.load(std::memory_order_acquire) != seen_control_;
      };
      // First the pause-only phase, counted in the pool's `spinning` so that pushers need not
      // wake a sleeping worker meanwhile (the decrement comes before the sleep protocol's
      // re-check, so a push that saw this worker spinning is popped or seen by that re-check);
      // then the rest of the spin, which yields the core between looks.
      pool_->spinning.fetch_add(1, std::memory_order_seq_cst);
      const bool found = spin_until(has_work, std::min(spin_ns, kSpinningNs));
      pool_->spinning.fetch_sub(1, std::memory_order_seq_cst);
      if (found || (spin_ns > kSpinningNs && spin_until(has_work, spin_ns - kSpinningNs))) {
        continue;
      }
      // Register, mark this worker asleep, raise the pool's sleeper count, then re-check (see
      // QueueView::wake_worker for why no wakeup is lost).
      EventCount::Key key = self_->wake.prepare_wait();
      self_->asleep.store(1, std::memory_order_seq_cst);
      pool_->sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (has_work() || ring_.has_values()) {
        self_->asleep.store(0, std::memory_order_relaxed);
        pool_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
        self_->wake.cancel_wait();
        continue;
      }
      // Bounded, as a safety net: a producer killed between its cell CAS and its notify leaves
      // a value that no notify announces. One wakeup a second costs nothing measurable.
      self_->wake.wait(key, monotonic_ns() + kIdleRecheckNs);
      self_->asleep.store(0, std::memory_order_relaxed);
      pool_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  // Processes every control message waiting on the socket. False if the supervisor is gone.
  bool drain_control() {
    for (;;) {
      auto m = receive_message(options_.control_fd);
      if (!m) {
        if (m.error().code() == ErrorCode::kTimeout) return true;  // none left
        GPUQ_LOG_ERROR("control socket: %s", m.error().to_string().c_str());
        return false;
      }
      if (m->type == MessageType::kWorkerStop) {
        stopping_ = true;
        continue;
      }
      try {
        auto j = nlohmann::json::parse(m->body);
        uint32_t index = j.at("client").get<uint32_t>();
        if (index >= clients_.size()) continue;
        if (m->type == MessageType::kMapClient && !m->fds.empty()) {
          ClientSegmentGeometry g{
              j.at("slots_offset").get<uint64_t>(), j.at("arena_offset").get<uint64_t>(),
              j.at("arena_bytes").get<uint64_t>(), j.at("segment_bytes").get<uint64_t>()};
          uint32_t slots = j.at("slot_count").get<uint32_t>();
          auto seg = MemfdSegment::map(std::move(m->fds[0]), g.segment_bytes);
          if (!seg) {
            GPUQ_LOG_ERROR("cannot map client %u: %s", index, seg.error().to_string().c_str());
            continue;
          }
          auto& mc = clients_[index].emplace();
          mc.session = j.at("session").get<uint64_t>();
          mc.segment = std::move(*seg);
          mc.view = ClientSegmentView(mc.segment.address(), g, slots);
        } else if (m->type == MessageType::kUnmapClient) {
          if (clients_[index] && clients_[index]->session == j.at("session").get<uint64_t>()) {
            clients_[index].reset();
          }
        }
      } catch (const std::exception& e) {
        GPUQ_LOG_ERROR("bad control message from the supervisor: %s", e.what());
      }
    }
  }

  void handle(uint32_t value) {
    const JobRef ref = JobRef::unpack(value);
    if (ref.client < clients_.size() && !clients_[ref.client] &&
        self_->control_seq.load(std::memory_order_acquire) != seen_control_) {
      // A client that has just connected: its MapClient message was sent before its Welcome,
      // so it is waiting on the control socket now.
      seen_control_ = self_->control_seq.load(std::memory_order_acquire);
      drain_control();
    }
    if (ref.client >= clients_.size() || !clients_[ref.client]) {
      pool_->space.notify_all();
      return;  // an entry of a client that has gone, or a forged one
    }
    MappedClient& mc = *clients_[ref.client];
    // A ring cell and a cell of the client's share are free: producers blocked on either may
    // go on (decrement first, so a woken producer sees the room). Saturating, so that no
    // accounting slip can wrap the counter and lock the client out.
    std::atomic<uint32_t>& queued = queue_.client(ref.client).queued[options_.pool_id];
    uint32_t q = queued.load(std::memory_order_relaxed);
    while (q > 0 && !queued.compare_exchange_weak(q, q - 1, std::memory_order_relaxed)) {
    }
    pool_->space.notify_all();
    if (ref.slot >= mc.view.slot_count()) return;
    JobSlot& slot = mc.view.slot(ref.slot);

    uint64_t word = slot.state.load(std::memory_order_acquire);
    SlotWord sw = SlotWord::unpack(word);
    if (sw.state != JobState::kSubmitted ||
        (sw.generation & JobRef::kGenerationMask) != ref.generation ||
        slot.desc.pool_id != options_.pool_id) {
      // Cancelled; or a stale entry for an earlier use of the slot, whose 14-bit generation
      // happens to match a job now queued on another pool (that pool's own entry runs it).
      return;
    }
    const SlotWord running{sw.generation, JobState::kRunning, options_.worker_id + 1};
    if (!slot.state.compare_exchange_strong(word, running.pack(), std::memory_order_acq_rel,
                                            std::memory_order_acquire)) {
      return;  // the client cancelled it first
    }
    self_->busy.store(1, std::memory_order_relaxed);
    // One copy, validated once (no re-reads): the fixed fields, then only the params in use.
    JobDescriptor d;
    std::memcpy(&d, &slot.desc, offsetof(JobDescriptor, params));
    d.params_bytes = std::min<uint32_t>(d.params_bytes, kMaxParamBytes);
    std::memcpy(d.params, slot.desc.params, d.params_bytes);
    JobOutcome out{};
    out.worker_id = options_.worker_id;
    out.started_ns = monotonic_ns();
    JobState final_state = JobState::kDone;

    if (d.deadline_ns != kNoDeadline && out.started_ns > d.deadline_ns) {
      final_state = JobState::kExpired;
      set_outcome(out, Error(ErrorCode::kExpired, "deadline passed while the job was queued"));
    } else if (auto v = validate_descriptor(d, mc.view.arena_bytes(), options_.pool_id); !v) {
      final_state = JobState::kFailed;
      set_outcome(out, v.error());
    } else {
      char* arena = mc.view.arena();
      OpContext ctx{reinterpret_cast<const std::byte*>(arena + v->input_offset),
                    v->input_bytes,
                    reinterpret_cast<std::byte*>(arena + v->output_offset),
                    v->output_capacity,
                    v->params,
                    slot.cancel_requested};
      auto r = v->op->run(ctx);
      if (r) {
        out.output_bytes = r->output_bytes;
        out.value = r->value;
      } else {
        final_state =
            r.error().code() == ErrorCode::kCancelled ? JobState::kCancelled : JobState::kFailed;
        set_outcome(out, r.error());
      }
    }
    out.finished_ns = monotonic_ns();
    if (out.code != 0) set_slot_message(slot, error_message_.c_str());
    std::memcpy(&slot.outcome, &out, sizeof out);
    const SlotWord done{sw.generation, final_state, options_.worker_id + 1};
    slot.state.store(done.pack(), std::memory_order_release);
    // A client asleep on this job is most likely on this CPU (the pusher wakes the worker
    // pinned to its own CPU): give it the core now instead of spinning in front of it.
    if (slot.done.notify_all()) sched_yield();
    self_->busy.store(0, std::memory_order_relaxed);
    if (final_state == JobState::kDone) {
      self_->jobs_done.fetch_add(1, std::memory_order_relaxed);
    } else {
      self_->jobs_failed.fetch_add(1, std::memory_order_relaxed);
    }
  }

  void set_outcome(JobOutcome& out, const Error& e) {
    out.code = static_cast<int32_t>(e.code());
    error_message_ = e.message();
  }

  WorkerOptions options_;
  QueueSegment segment_;
  QueueView queue_;
  PoolShm* pool_ = nullptr;
  WorkerShm* self_ = nullptr;
  JobRing ring_;
  std::vector<std::optional<MappedClient>> clients_;
  uint32_t seen_control_ = 0;
  bool stopping_ = false;
  std::string error_message_;  // the current job's failure message
};

}  // namespace

int run_worker(const WorkerOptions& options) {
  // Die with the supervisor; if it is already gone, do not start.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != options.supervisor_pid) return 1;
  signal(SIGPIPE, SIG_IGN);
  fcntl(options.control_fd, F_SETFL, fcntl(options.control_fd, F_GETFL) | O_NONBLOCK);
  Worker w(options);
  return w.run();
}

}  // namespace gpuq::daemon
