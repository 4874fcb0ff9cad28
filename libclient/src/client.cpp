#include "gpuq/client.hpp"

#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>

#include "control_channel.hpp"
#include "gpuq/common/clock.hpp"
#include "gpuq/common/event_count.hpp"
#include "gpuq/common/fault_point.hpp"
#include "gpuq/common/messages.hpp"
#include "gpuq/common/params.hpp"
#include "gpuq/common/posix_call.hpp"
#include "gpuq/common/prefetch.hpp"
#include "gpuq/common/protocol.hpp"
#include "gpuq/common/runtime_dir.hpp"
#include "gpuq/common/shm.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "op_table.hpp"
#include "payload_arena.hpp"

namespace gpuq {
namespace {

// Bumped in every child after fork(); a ClientImpl made before the fork sees a different value.
std::atomic<uint64_t> g_fork_generation{0};
void on_fork_child() {
  g_fork_generation.fetch_add(1, std::memory_order_relaxed);
}

// How often a sleeping waiter wakes to check that the daemon is still there.
constexpr uint64_t kLivenessCheckNs = 20'000'000;
// How often wait_any(), asleep on the connection's event, checks that the daemon is still
// there: a thread watching jobs that run for minutes wakes once a second, not fifty times.
constexpr uint64_t kWatchLivenessCheckNs = 1'000'000'000;
// How long a submit waiting for a job slot sleeps on one job's end before it looks again.
constexpr uint64_t kSlotWaitSliceNs = 2'000'000;

Error forked_error() {
  return Error(ErrorCode::kForkedClient,
               "this Client was connected by the parent process before fork(); connect a new "
               "Client in the child");
}

}  // namespace

class ClientImpl : public std::enable_shared_from_this<ClientImpl> {
 public:
  struct Pool {
    PoolInfo info;
    uint32_t id = 0;
    int fallback = -1;  // while unavailable: the id of the pool that runs its jobs, or -1
  };

  // The daemon's pools and ops as one Welcome or CatalogReply gave them (immutable).
  struct Catalog {
    uint32_t generation = 0;  // QueueHeader::catalog_generation it is of
    std::vector<Pool> pools;
    std::vector<PoolInfo> infos;  // Client::pools()
    OpTable ops;

    const Pool* find_pool(std::string_view name) const noexcept {
      for (const Pool& p : pools) {
        if (p.info.name == name) return &p;
      }
      return nullptr;
    }
    const Pool* find_pool_id(uint32_t id) const noexcept {
      for (const Pool& p : pools) {
        if (p.id == id) return &p;
      }
      return nullptr;
    }
  };

  // A catalog of the pools and ops a Welcome or CatalogReply gave (decode_welcome and
  // decode_catalog_reply checked them: unique ids, each unavailable pool's fallback available).
  static std::unique_ptr<Catalog> make_catalog(uint32_t generation,
                                               std::vector<WelcomePool> welcome_pools,
                                               std::vector<WelcomeOp> welcome_ops) {
    auto c = std::make_unique<Catalog>();
    c->generation = generation;
    for (WelcomePool& p : welcome_pools) {
      Pool pool;
      pool.id = p.id;
      pool.info.name = std::move(p.name);
      pool.info.kind = std::move(p.kind);
      pool.info.capacity = p.capacity;
      pool.info.client_share = p.client_share;
      pool.info.available = p.available;
      pool.info.unavailable_reason = std::move(p.reason);
      if (!pool.info.available) pool.fallback = p.fallback;
      c->pools.push_back(std::move(pool));
    }
    for (Pool& pool : c->pools) {
      const Pool* to =
          pool.info.available ? nullptr : c->find_pool_id(static_cast<uint32_t>(pool.fallback));
      pool.info.runs_on = pool.info.available ? pool.info.name
                          : to != nullptr     ? to->info.name
                                              : std::string();
      c->infos.push_back(pool.info);
    }
    std::vector<std::pair<std::string, uint32_t>> ops;
    for (WelcomeOp& o : welcome_ops) ops.emplace_back(std::move(o.name), o.id);
    c->ops = OpTable(std::move(ops));
    return c;
  }

  // Whether every pool of `c` has a record in the queue segment as this client mapped it.
  bool fits_queue(const Catalog& c) const noexcept {
    return !c.pools.empty() && std::all_of(c.pools.begin(), c.pools.end(), [&](const Pool& p) {
      return p.id < queue_.layout().pool_count;
    });
  }

  ~ClientImpl() = default;  // members unmap and close; the daemon sees the socket close

  bool forked() const noexcept {
    return g_fork_generation.load(std::memory_order_relaxed) != fork_generation_;
  }

  // False once the daemon has gone (socket closed, or a new daemon replaced the segment).
  bool daemon_alive() {
    if (disconnected_.load(std::memory_order_relaxed)) return false;
    pollfd p{socket_.get(), POLLRDHUP, 0};
    // A failed poll (EINTR aside, only a bad descriptor) says nothing either way: alive until
    // a call on the socket itself fails.
    auto ready = GPUQ_POSIX_CALL(::poll, &p, 1, 0);
    if (ready && *ready > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0) {
      disconnected_.store(true, std::memory_order_relaxed);
      return false;
    }
    return true;
  }

  Error disconnected_error() const {
    return Error(ErrorCode::kDisconnected,
                 "the daemon (epoch " + std::to_string(epoch_) + ") has gone; reconnect");
  }

  const ConnectOptions& options() const noexcept { return options_; }

  // Makes every later call on this connection (and on its Jobs) fail with Disconnected.
  void mark_disconnected() noexcept { disconnected_.store(true, std::memory_order_relaxed); }

  Result<void> connect(const ConnectOptions& options) {
    options_ = options;
    fork_generation_ = g_fork_generation.load(std::memory_order_relaxed);
    spin_ns_ = options.spin.count() < 0 ? 0 : static_cast<uint64_t>(options.spin.count());
    wait_spin_ns_.store(spin_ns_, std::memory_order_relaxed);
    auto fd = channel::connect_socket(options.runtime_dir);
    if (!fd) return fd.error();
    socket_ = std::move(*fd);
    HelloMessage hello;
    hello.pid = getpid();
    hello.name = options.name.empty() ? program_invocation_short_name : options.name;
    if (hello.name.size() > kMaxClientNameBytes) {
      // Cut at a character boundary: a split UTF-8 sequence would not be valid JSON text.
      size_t cut = kMaxClientNameBytes;
      while (cut > 0 && (static_cast<unsigned char>(hello.name[cut]) & 0xC0) == 0x80) --cut;
      hello.name.resize(cut);
    }
    hello.arena_bytes = options.segment_bytes;
    hello.keep_running_jobs = options.keep_running_jobs;
    if (auto r = channel::send_request(socket_.get(), HelloMessage::kType, encode(hello)); !r) {
      return r;
    }
    auto m = channel::receive_reply(socket_.get());
    if (!m) {
      if (m.error().code() == ErrorCode::kTimeout) {
        return Error(ErrorCode::kTimeout, "the daemon did not answer the handshake within 10 s");
      }
      return m.error();
    }
    if (m->type == MessageType::kError) return error_from_body(m->body);
    if (m->type != WelcomeMessage::kType || m->fds.size() != 1) {
      return Error(ErrorCode::kProtocolMismatch, "the daemon's handshake reply is malformed");
    }
    // decode_welcome checks the fields, the geometry, the job clock and the pools' fallbacks.
    auto welcome = decode_welcome(m->body);
    if (!welcome) {
      return Error(ErrorCode::kProtocolMismatch,
                   "the daemon's handshake reply is malformed: " + welcome.error().message());
    }
    WelcomeMessage& w = *welcome;
    index_ = w.client;
    session_ = w.session;
    epoch_ = w.epoch;
    slot_count_ = w.slot_count;
    const ClientSegmentGeometry g = w.geometry;
    auto catalog = make_catalog(w.catalog, std::move(w.pools), std::move(w.ops));
    // What the job stamps count in (clock.hpp, "Job stamps").
    stamps_.clock = w.job_clock;
    if (stamps_.clock == StampClock::kTsc) stamps_.ns_per_tick = w.tsc_ns_per_tick;
    auto qs = QueueSegment::open(w.queue_segment);
    if (!qs) return qs.error();
    queue_segment_ = std::move(*qs);
    auto view = QueueView::attach(queue_segment_.address(), queue_segment_.size());
    if (!view) return view.error();
    queue_ = *view;
    const QueueHeader& h = queue_.header();
    if (h.epoch != epoch_ || index_ >= queue_.layout().max_clients ||
        slot_count_ > kMaxSlotsPerClient || !fits_queue(*catalog)) {
      return Error(ErrorCode::kProtocolMismatch,
                   "the daemon's queue segment does not match its handshake");
    }
    catalog_.store(catalog.get(), std::memory_order_release);
    catalogs_.push_back(std::move(catalog));
    auto seg = MemfdSegment::map(std::move(m->fds[0]), g.segment_bytes);
    if (!seg) return seg.error();
    segment_ = std::move(*seg);
    view_ = ClientSegmentView(segment_.address(), g, slot_count_);
    for (uint32_t s = 0; s < slot_count_; ++s) free_slots_.push_back(s);
    in_ring_ = std::make_unique<uint8_t[]>(slot_count_);
    readers_ = std::make_unique<std::atomic<uint32_t>[]>(slot_count_);
    arena_.reset(view_.arena_bytes());
    return {};
  }

  // ---- The catalog: pools and ops ----

  // The catalog held now. Each one stays until the client is destroyed (a reference from
  // pools() or a Pool* of a submit in flight stays valid); they are few (one per change of the
  // daemon's pools or ops that this client looked at).
  const Catalog& catalog() const noexcept { return *catalog_.load(std::memory_order_acquire); }

  // The catalog, asked of the daemon again first when the queue header's generation says it
  // changed since (docs/design/live_changes.md, "Clients see it without reconnecting"): on a
  // name that does not resolve, and in pools()/ops(). One relaxed load when nothing changed.
  // A failed request keeps the catalog held (the error is the caller's, when it needs one).
  const Catalog& fresh_catalog() {
    const Catalog* held = catalog_.load(std::memory_order_acquire);
    if (forked() ||
        queue_.header().catalog_generation.load(std::memory_order_relaxed) == held->generation) {
      return *held;
    }
    std::lock_guard lock(catalog_mutex_);
    held = catalog_.load(std::memory_order_relaxed);
    if (queue_.header().catalog_generation.load(std::memory_order_acquire) == held->generation) {
      return *held;
    }
    // On this client's own connection: the daemon that registered it answers (a fresh
    // connection might reach a daemon started since). Nothing else reads the socket after
    // Welcome; the mutex keeps two requests from crossing.
    auto sent = channel::send_request(socket_.get(), CatalogRequestMessage::kType,
                                      encode(CatalogRequestMessage{}));
    auto m = sent ? channel::receive_reply(socket_.get()) : Result<Message>(sent.error());
    if (!m || m->type != CatalogReplyMessage::kType) return *held;
    auto reply = decode_catalog_reply(m->body);
    if (!reply || reply->catalog == held->generation) return *held;
    auto next = make_catalog(reply->catalog, std::move(reply->pools), std::move(reply->ops));
    if (!fits_queue(*next)) return *held;  // a pool this client's layout has no record of
    catalog_.store(next.get(), std::memory_order_release);
    catalogs_.push_back(std::move(next));
    return *catalogs_.back();
  }

  // ---- Buffers ----

  Result<Buffer> allocate(uint64_t size) {
    if (forked()) return forked_error();
    if (size == 0) return Error(ErrorCode::kInvalidArgument, "allocate: size must be > 0");
    auto offset = arena_.allocate(size);
    if (!offset) return std::move(offset).error();
    return Buffer{*offset, size, reinterpret_cast<std::byte*>(view_.arena() + *offset)};
  }

  void release(const Buffer& b) {
    if (forked()) return;
    arena_.release(b.offset);  // not ours, or released twice: ignored
  }

  // ---- Slots ----

  JobSlot& slot(uint32_t s) const { return view_.slot(s); }

  // Takes a free slot for a job for `pool`, which counts against this client's share from now
  // on (see "This client's share of each ring" below), and as a live Job ("Jobs keep their
  // connection alive"); reaps abandoned jobs that have finished meanwhile.
  // With every slot taken, finished jobs give theirs back (detach_finished_locked); with none
  // finished, a blocking submit waits for one, up to `timeout_ns` (negative: no limit), and a
  // non-blocking one fails with QueueFull: slots are not a limit a user meets.
  Result<std::pair<uint32_t, uint32_t>> acquire_slot(uint32_t pool, int64_t timeout_ns,
                                                     bool blocking) {
    std::unique_lock lock(slot_mutex_);
    if (free_slots_.empty()) reap_abandoned_locked();
    if (free_slots_.empty()) detach_finished_locked();
    uint64_t deadline = 0;
    while (free_slots_.empty()) {
      if (!blocking) {
        return Error(ErrorCode::kQueueFull,
                     "all " + std::to_string(slot_count_) +
                         " job slots of this client hold unfinished jobs (max_jobs_per_client)");
      }
      const uint64_t now = monotonic_ns();
      if (deadline == 0) {
        deadline = timeout_ns < 0 ? kNoDeadline : now + static_cast<uint64_t>(timeout_ns);
      }
      if (now >= deadline) {
        return Error(ErrorCode::kTimeout,
                     "no job slot of this client became free before the deadline (all " +
                         std::to_string(slot_count_) + " hold unfinished jobs)");
      }
      if (!daemon_alive()) return disconnected_error();
      // Sleep on the end of one of the unfinished jobs (each taken slot in turn), then look
      // again: any job's end frees a slot at the next detach.
      const uint32_t s = wait_cursor_++ % slot_count_;
      JobSlot& js = slot(s);
      EventCount::Key key = js.done.prepare_wait();
      if (const JobState st = SlotWord::unpack(js.state.load(std::memory_order_acquire)).state;
          is_terminal(st) || st == JobState::kFree) {
        js.done.cancel_wait();
      } else {
        lock.unlock();
        js.done.wait(key, std::min({deadline, now + kSlotWaitSliceNs}));
        lock.lock();
      }
      reap_abandoned_locked();
      detach_finished_locked();
    }
    uint32_t s = free_slots_.front();
    free_slots_.pop_front();
    if (live_jobs_++ == 0) keep_alive_ = shared_from_this();
    in_ring_[s] = static_cast<uint8_t>(pool + 1);
    counted_[pool].store(counted_[pool].load(std::memory_order_relaxed) + 1,
                         std::memory_order_relaxed);
    // The next submit's slot: a worker read its lines when it last ran (they sit shared in its
    // core's cache), so writing its descriptor would wait for that copy to be invalidated.
    // Fetching them for writing now, one job ahead, takes that wait off the next submit.
    if (!free_slots_.empty()) {
      JobSlot& next = slot(free_slots_.front());
      prefetch_for_write(&next.state);
      prefetch_for_write(&next.desc);
    }
    SlotWord w = SlotWord::unpack(slot(s).state.load(std::memory_order_acquire));
    return std::make_pair(s, w.generation);
  }

  // Returns a slot to the free list, bumping its generation so stale references miss it, and
  // ends its live Job. Returns what may be the last reference to this object: the caller drops
  // it after its last use of `this` ("Jobs keep their connection alive").
  [[nodiscard]] std::shared_ptr<ClientImpl> free_slot(uint32_t s, uint32_t generation) {
    JobSlot& js = slot(s);
    std::lock_guard lock(slot_mutex_);
    // Under the mutex, as detach_finished_locked: a job whose slot went back while it was
    // finished has its result here now, and the slot may hold another job.
    if (SlotWord::unpack(js.state.load(std::memory_order_acquire)).generation != generation) {
      detached_.erase(detached_key(s, generation));
      return end_job_locked();
    }
    // FREE, then the flag's reset, both release: a supervisor whose time-limit bit lands after
    // the reset then sees the slot's word moved on, and takes its bit back (docs/design/
    // faults.md, "Jobs that do not end"). No Job can take the slot before both are done.
    js.state.store(SlotWord{generation + 1, JobState::kFree, 0}.pack(), std::memory_order_release);
    js.cancel_requested.store(0, std::memory_order_release);
    uncount_locked(s, false);
    free_slots_.push_back(s);  // FIFO: a slot is reused as late as possible
    return end_job_locked();
  }

  // ---- Finished jobs give their slots back ----
  //
  // A Job whose job has finished keeps its slot until the Job is read and dropped; with every
  // slot taken that way, a submit would have none. So when no slot is free, each finished
  // job's result is copied out of its slot into `detached_` (keyed by slot and generation) and
  // the slot is freed; its Job finds its result there (detached_result) and erases it when it goes.
  // Both this and free_slot run under slot_mutex_ and look at the slot's generation, so a slot
  // is freed once, and a Job never frees a slot that holds another job by then.
  static uint64_t detached_key(uint32_t s, uint32_t generation) {
    return uint64_t{s} << 32 | generation;
  }

  void detach_finished_locked() {
    for (uint32_t s = 0; s < slot_count_; ++s) {
      JobSlot& js = slot(s);
      const SlotWord w = SlotWord::unpack(js.state.load(std::memory_order_acquire));
      if (!is_terminal(w.state) || in_free_list_locked(s) || is_abandoned_locked(s)) continue;
      // A stream's unread parts live in its slot's output cells: its slot stays its Job's.
      if (flags_stream_window(js.desc.flags) != 0) continue;
      detached_.emplace(detached_key(s, w.generation), read_result(js, w));
      // seq_cst: a wait that counts itself in readers_ after this sees the new generation
      // (and takes the kept copy); one counted before holds off the submit that reuses s.
      js.state.store(SlotWord{w.generation + 1, JobState::kFree, 0}.pack(),
                     std::memory_order_seq_cst);
      js.cancel_requested.store(0, std::memory_order_release);  // after FREE: see free_slot
      uncount_locked(s, false);
      free_slots_.push_back(s);
    }
  }

  bool in_free_list_locked(uint32_t s) const {
    return std::find(free_slots_.begin(), free_slots_.end(), s) != free_slots_.end();
  }
  bool is_abandoned_locked(uint32_t s) const {
    return std::any_of(abandoned_.begin(), abandoned_.end(),
                       [&](const auto& a) { return a.first == s; });
  }

  // A detached job's result, if the Job of (s, generation) has one.
  std::optional<JobResult> detached_result(uint32_t s, uint32_t generation) {
    std::lock_guard lock(slot_mutex_);
    auto it = detached_.find(detached_key(s, generation));
    if (it == detached_.end()) return std::nullopt;
    return it->second;
  }

  // The Job of a running slot went away: the slot is freed once its job finishes.
  [[nodiscard]] std::shared_ptr<ClientImpl> abandon(uint32_t s, uint32_t generation) {
    std::lock_guard lock(slot_mutex_);
    if (SlotWord::unpack(slot(s).state.load(std::memory_order_acquire)).generation != generation) {
      detached_.erase(detached_key(s, generation));  // it finished, and its slot went back
    } else {
      abandoned_.emplace_back(s, generation);
    }
    return end_job_locked();
  }

  // ---- Jobs keep their connection alive ----
  //
  // A Job points at this object with a plain pointer, and the live Jobs are counted here under
  // slot_mutex_, which taking a slot and ending a Job lock anyway. While any lives,
  // `keep_alive_` holds a reference to this object, so it outlives a Client dropped before its
  // Jobs. A shared_ptr in each Job cost two locked instructions per job (its count's increment
  // and decrement); this costs them only when the count leaves or returns to zero. In a forked
  // child, a Job inherited from the parent only ends its count (the slot is the parent's), if
  // the child's copy of the slot mutex is free: one copied while another of the parent's
  // threads held it stays locked, and then the child's copy of this object is never freed.
  std::shared_ptr<ClientImpl> end_job_locked() {
    return --live_jobs_ == 0 ? std::move(keep_alive_) : nullptr;
  }

  void reap_abandoned_locked() {
    std::erase_if(abandoned_, [&](const std::pair<uint32_t, uint32_t>& a) {
      JobSlot& js = slot(a.first);
      SlotWord w = SlotWord::unpack(js.state.load(std::memory_order_acquire));
      if (w.generation != a.second) return true;  // freed already (abandon() saw it first)
      if (!is_terminal(w.state)) return false;
      uncount_locked(a.first, false);
      js.state.store(SlotWord{a.second + 1, JobState::kFree, 0}.pack(), std::memory_order_release);
      js.cancel_requested.store(0, std::memory_order_release);  // after FREE: see free_slot
      free_slots_.push_back(a.first);
      return true;
    });
  }

  // ---- This client's share of each ring (docs/design/ring.md, "Shares") ----
  //
  // The ring cells this client holds are counted here, in the client, not in shared memory,
  // and under slot_mutex_, which taking and freeing a slot lock anyway: so the count costs a
  // job no atomic instruction and no cache line another core writes. A job counts from when
  // its slot is taken until its slot is freed, or until a recount finds it has left the ring;
  // a job the client ended itself while queued (cancel, expiry, a dropped Job) leaves its
  // entry behind, counted as stale. The count errs high (a job a worker has taken still
  // counts); when it passes the share, recount() makes it exact from the slots' states and
  // this client's entries in the ring. The share is cooperative, as a count in shared memory
  // was too: any process that maps the queue segment can push.

  // Under slot_mutex_: slot `s`'s job no longer counts; `stale`: its entry stays in the ring.
  void uncount_locked(uint32_t s, bool stale) {
    if (const uint8_t p = in_ring_[s]; p != 0) {
      in_ring_[s] = 0;
      counted_[p - 1].store(counted_[p - 1].load(std::memory_order_relaxed) - 1,
                            std::memory_order_relaxed);
      if (stale) {
        stale_[p - 1].store(stale_[p - 1].load(std::memory_order_relaxed) + 1,
                            std::memory_order_relaxed);
      }
    }
  }
  // Ring cells of `pool` this client may hold (at least as many as it does). Lock-free.
  uint32_t held(uint32_t pool) const {
    return counted_[pool].load(std::memory_order_relaxed) +
           stale_[pool].load(std::memory_order_relaxed);
  }
  // Makes held(pool) exact, or as good as concurrent submits allow: a counted job whose slot
  // has left SUBMITTED no longer counts, and each of this client's entries in its lanes that is
  // not a counted job's (a job it ended while queued, or an entry someone forged) is stale.
  // Reads lines a worker wrote: only when held() passes the share.
  uint32_t recount(uint32_t pool) {
    std::lock_guard lock(slot_mutex_);
    auto submitted = [&](uint32_t s, uint32_t generation_bits) {
      const SlotWord w = SlotWord::unpack(slot(s).state.load(std::memory_order_acquire));
      return w.state == JobState::kSubmitted &&
             (w.generation & JobRef::kGenerationMask) == generation_bits;
    };
    for (uint32_t s = 0; s < slot_count_; ++s) {
      if (in_ring_[s] != pool + 1) continue;
      const SlotWord w = SlotWord::unpack(slot(s).state.load(std::memory_order_acquire));
      // A slot taken but not yet SUBMITTED is about to be pushed: it keeps counting.
      if (is_terminal(w.state) || w.state == JobState::kRunning) uncount_locked(s, false);
    }
    uint32_t stale = 0;
    queue_.queue(pool).for_each_value_of(index_, [&](uint32_t v) {
      const JobRef ref = JobRef::unpack(v);
      if (ref.client != index_) return;
      const bool counted = ref.slot < slot_count_ && in_ring_[ref.slot] == pool + 1 &&
                           submitted(ref.slot, ref.generation);
      if (!counted) ++stale;
    });
    stale_[pool].store(stale, std::memory_order_relaxed);
    return held(pool);
  }

  // ---- Submit ----

  Result<Job> submit(const JobSpec& spec, int64_t timeout_ns, bool blocking) {
    // Only a job for the default pool may be tried twice: only it reads the clock.
    const uint64_t start = timeout_ns > 0 && spec.pool.empty() ? monotonic_ns() : 0;
    bool gone = false;
    Result<Job> r = submit_once(spec, timeout_ns, blocking, &gone);
    if (r || !gone) return r;
    // The default pool (none named) was removed by a config reload during this submit: once
    // more, to the default of the daemon's catalog now, within the time left.
    int64_t left = timeout_ns;
    if (timeout_ns > 0) {
      left = std::max<int64_t>(0, timeout_ns - static_cast<int64_t>(monotonic_ns() - start));
    }
    return submit_once(spec, left, blocking, nullptr);
  }

  // `default_gone` (when not null): set when the job named no pool and the pool it went to
  // was found removed by a config reload as it was pushed.
  Result<Job> submit_once(const JobSpec& spec, int64_t timeout_ns, bool blocking,
                          bool* default_gone) {
    if (forked()) return forked_error();
    const Catalog* cat = &catalog();
    // The first pool the catalog offers is the default; none while a reload adds every pool.
    auto choose = [&](const Catalog* c) -> const Pool* {
      if (!spec.pool.empty()) return c->find_pool(spec.pool);
      return c->pools.empty() ? nullptr : &c->pools.front();
    };
    const uint32_t* op = cat->ops.find(spec.op);
    const Pool* pool = choose(cat);
    // A removed default pool (a relaxed load: the push below looks again, seq_cst).
    const bool gone =
        spec.pool.empty() && pool != nullptr &&
        queue_.pool(pool->id).accepting.load(std::memory_order_relaxed) == kPoolRemoved;
    if (op == nullptr || pool == nullptr || gone) {
      // A name this catalog does not have: the daemon's may have it since.
      cat = &fresh_catalog();
      op = cat->ops.find(spec.op);
      pool = choose(cat);
    }
    if (op == nullptr) {
      std::string known;
      for (const auto& [name, id] : cat->ops.entries()) known += (known.empty() ? "" : ", ") + name;
      return Error(
          ErrorCode::kUnknownOp,
          "op '" + spec.op + "' is not registered with the daemon (registered: " + known + ")");
    }
    if (pool == nullptr) {
      return Error(ErrorCode::kUnknownPool,
                   spec.pool.empty()
                       ? std::string("the daemon offers no pool now (a config reload is adding "
                                     "them); try again once it has")
                       : "no pool named '" + spec.pool + "'");
    }
    if (!pool->info.available) {
      // An unavailable pool has no worker: its jobs go to its fallback pool, or fail here, at
      // once, rather than wait in a ring nothing empties.
      if (pool->fallback < 0) {
        return Error(ErrorCode::kNoDevice, "pool '" + pool->info.name + "' is unavailable: " +
                                               pool->info.unavailable_reason);
      }
      pool = cat->find_pool_id(static_cast<uint32_t>(pool->fallback));
    }
    if (static_cast<uint32_t>(spec.priority) >= kPriorityLevels) {
      return Error(ErrorCode::kInvalidArgument,
                   "priority: " + std::to_string(static_cast<uint32_t>(spec.priority)) +
                       " is not a level (Priority::kHigh, kNormal or kLow)");
    }
    if (spec.stream_window > kMaxStreamWindow) {
      return Error(ErrorCode::kInvalidArgument,
                   "stream_window: " + std::to_string(spec.stream_window) + " is more than " +
                       std::to_string(kMaxStreamWindow) + " parts (0: not a stream)");
    }
    if (spec.stream_window > 0 && spec.retryable) {
      return Error(ErrorCode::kInvalidArgument,
                   "stream_window: a stream cannot be retryable (a second run would make its "
                   "parts again); submit it with retryable false");
    }
    if (spec.stream_window > 0 && stream_cell_bytes(spec.output.size, spec.stream_window) == 0) {
      return Error(ErrorCode::kInvalidArgument,
                   "stream_window: " + std::to_string(spec.stream_window) +
                       " parts need an output buffer of " +
                       std::to_string(64 * spec.stream_window) + " bytes or more (it has " +
                       std::to_string(spec.output.size) + "); each part takes an equal share");
    }
    if (spec.time_limit.count() < 0 || spec.time_limit.count() > UINT32_MAX) {
      return Error(ErrorCode::kInvalidArgument,
                   "time_limit: " + std::to_string(spec.time_limit.count()) +
                       " ms is out of range (0: none, else 1 to 4294967295 ms)");
    }
    ParamWriter params;
    for (const auto& p : spec.params) {
      ParamValue v;
      switch (p.type) {
        case JobParam::Type::kInt:
          v = p.int_value;
          break;
        case JobParam::Type::kFloat:
          v = p.float_value;
          break;
        case JobParam::Type::kString:
          v = p.string_value;
          break;
      }
      if (auto r = params.add(p.key, v); !r) return r.error();
    }
    // No system call on this path: a daemon that stopped says so in the queue header; one that
    // was killed is noticed by the waits, which check the control socket.
    if (disconnected_.load(std::memory_order_relaxed) ||
        queue_.header().daemon_state.load(std::memory_order_relaxed) ==
            static_cast<uint32_t>(DaemonState::kStopped)) {
      return disconnected_error();
    }

    auto acquired = acquire_slot(pool->id, timeout_ns, blocking);
    if (!acquired) return acquired.error();
    const auto [s, generation] = *acquired;
    GPUQ_FAULT_POINT("client.submit.slot_acquired");
    // A wait of the slot's previous job (given back while it was not yet read) may still be
    // reading it: let it finish first (readers_). Never on a slot freed by its own Job.
    while (readers_[s].load(std::memory_order_seq_cst) != 0) sched_yield();
    JobSlot& js = slot(s);
    ClientShm& cs = queue_.client(index_);
    const PoolQueue queue = queue_.queue(pool->id);
    // Its own lane of the job's level, or the level's fresh lane if it is the only job this
    // client has in the pool (docs/design/ring.md, "Lanes").
    const uint32_t lane = queue.lane_for(index_, spec.priority, held(pool->id) == 1);
    // Lines a worker wrote last (the slot's two, the lane's cell at the tail): fetch them
    // together before the locked steps below wait for each in turn.
    prefetch_for_write(&js.state);
    prefetch_for_write(&js.desc);
    queue.lane(lane).prefetch_push();
    JobDescriptor& d = js.desc;
    d.op_id = *op;
    d.pool_id = pool->id;
    d.flags = (spec.retryable ? kJobFlagRetryable : 0) | priority_flags(spec.priority) |
              stream_flags(spec.stream_window);
    d.params_bytes = static_cast<uint32_t>(params.size());
    GPUQ_FAULT_POINT("client.submit.mid_descriptor");
    d.input_offset = spec.input.offset;
    d.input_bytes = spec.input.size;
    d.output_offset = spec.output.offset;
    d.output_capacity = spec.output.size;
    d.submit_stamp = read_stamp(stamps_.clock);
    // CLOCK_MONOTONIC, read only for a job that expires (stamps may count something else).
    d.deadline_ns = spec.expire_after.count() < 0
                        ? kNoDeadline
                        : monotonic_ns() + static_cast<uint64_t>(spec.expire_after.count());
    if (params.size() > 0) std::memcpy(d.params, params.data(), params.size());
    js.time_limit_ms = static_cast<uint32_t>(spec.time_limit.count());
    if (spec.stream_window > 0) {  // the slot is this client's (FREE): no worker reads these
      js.stream.written.store(0, std::memory_order_relaxed);
      js.stream.read.store(0, std::memory_order_relaxed);
    }
    // `submitting` is up from before the slot turns SUBMITTED until its reference is in the
    // ring (or the slot is free again): the supervisor's drain handshake waits for it, and its
    // audit does not take a SUBMITTED job in no ring for one whose entry was lost meanwhile.
    cs.submitting.fetch_add(1, std::memory_order_seq_cst);
    struct Lower {
      ClientShm& cs;
      ~Lower() { cs.submitting.fetch_sub(1, std::memory_order_seq_cst); }
    } lower{cs};
    js.state.store(SlotWord{generation, JobState::kSubmitted, 0}.pack(), std::memory_order_release);
    GPUQ_FAULT_POINT("client.submit.before_push");

    const uint32_t ref = JobRef{index_, s, generation}.pack();
    PoolShm& ps = queue_.pool(pool->id);
    Result<void> pushed = push(ps, queue, lane, *pool, ref, timeout_ns, blocking);
    if (!pushed) {
      // Not the last reference: the caller's Client holds one.
      std::shared_ptr<ClientImpl> ended = free_slot(s, generation);
      if (default_gone != nullptr && spec.pool.empty() &&
          ps.accepting.load(std::memory_order_seq_cst) == kPoolRemoved) {
        *default_gone = true;  // removed since the look above: submit() tries once more
      }
      return pushed.error();
    }
    // This client's own counter (its own cache line); only this client writes it.
    std::atomic<uint64_t>& submitted = cs.submitted[pool->id];
    submitted.store(submitted.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    GPUQ_FAULT_POINT("client.submit.after_push");
    queue_.wake_worker_after_push(pool->id);  // the push was seq_cst: no fence needed
    return Job(this, s, generation);
  }

  // Pushes `ref` into `lane` of the pool's queue within this client's share, waiting for room
  // if `blocking`, for at most `timeout_ns` (negative: no limit) from the first look that finds
  // none. The caller has raised `submitting` (see Supervisor::check_drain); its job counts
  // against the share already, so the share has room while held() is at most the share.
  Result<void> push(PoolShm& ps, const PoolQueue& queue, uint32_t lane, const Pool& pool,
                    uint32_t ref, int64_t timeout_ns, bool blocking) {
    uint64_t deadline = 0;  // set at the first look that finds no room
    JobRing ring = queue.lane(lane);
    // A recount takes the slot mutex and reads this client's slots and the whole queue: while
    // spinning for room, at most every 16th look does one (`force`: this look does).
    uint32_t looks = 0;
    const uint32_t share = pool.info.client_share;
    auto share_has_room = [&](bool force) {
      if (held(pool.id) <= share) return true;
      return (force || looks++ % 16 == 0) && recount(pool.id) <= share;
    };
    // 1 pushed, 0 no room, -1 not accepting (draining), -2 the pool is down, -3 removed.
    auto try_once = [&]() -> int {
      const uint32_t accepting = ps.accepting.load(std::memory_order_seq_cst);
      if (accepting != kPoolAccepting) {
        return accepting == kPoolDown ? -2 : accepting == kPoolRemoved ? -3 : -1;
      }
      if (!share_has_room(true)) return 0;
      if (!ring.try_push(ref)) return 0;
      // In the lane, its bit maybe not set yet: workers busy with other lanes do not see it
      // until one about to sleep looks at every lane, or the audit settles the bits.
      GPUQ_FAULT_POINT("client.submit.before_mark");
      queue.mark(lane);
      return 1;
    };
    for (;;) {
      int r = try_once();
      if (r == 1) return {};
      if (r == -2) {
        // The supervisor's words: the pool, how long, its last worker's exit.
        std::string why = pool_down_reason(ps);
        if (why.empty()) why = "pool '" + pool.info.name + "' has no ready worker";
        return Error(ErrorCode::kPoolDown, std::move(why));
      }
      if (r == -3) {
        return Error(ErrorCode::kUnknownPool,
                     "pool '" + pool.info.name +
                         "' was removed by a config reload (gpuqctl status lists the pools)");
      }
      if (r < 0) {
        return Error(
            ErrorCode::kShuttingDown,
            "the daemon is draining and accepts no new jobs on pool '" + pool.info.name + "'");
      }
      if (!blocking) return queue_full_error(pool, queue);
      const uint64_t now = monotonic_ns();
      if (deadline == 0) {
        deadline = timeout_ns < 0 ? kNoDeadline : now + static_cast<uint64_t>(timeout_ns);
      }
      if (now >= deadline) {
        return Error(ErrorCode::kTimeout,
                     "pool '" + pool.info.name + "' had no room for the job before the deadline");
      }
      auto has_room = [&](bool force) {
        return ps.accepting.load(std::memory_order_seq_cst) != kPoolAccepting ||
               (ring.size() < ring.capacity() && share_has_room(force));
      };
      // Room comes back as soon as a worker pops: spin first, as wait() does, so that a
      // client with more jobs in flight than its share does not pay a futex sleep and wakeup
      // per job.
      if (spin_until([&] { return has_room(false); }, spin_ns_)) continue;
      // About to sleep: a daemon that has died frees no room (checked here, not on every
      // retry: with more jobs in flight than ring cells, a client finds the ring full for
      // most jobs, and the check is a system call).
      if (!daemon_alive()) return disconnected_error();
      EventCount::Key key = ps.space.prepare_wait();
      if (has_room(true)) {  // a real look: a skipped recount here could sleep past the room
        ps.space.cancel_wait();
        continue;
      }
      ps.space.wait(key, std::min(deadline, now + kLivenessCheckNs));
    }
  }

  Error queue_full_error(const Pool& pool, const PoolQueue& queue) {
    // held() counts the job being submitted too.
    if (const uint32_t h = held(pool.id); h > pool.info.client_share) {
      return Error(ErrorCode::kQueueFull, "this client already holds its share of pool '" +
                                              pool.info.name + "' (" + std::to_string(h - 1) +
                                              " of " + std::to_string(queue.capacity()) +
                                              " cells: client_queue_share)");
    }
    return Error(ErrorCode::kQueueFull, "pool '" + pool.info.name + "' is full for this client (" +
                                            std::to_string(queue.capacity()) +
                                            " jobs queued in its lane)");
  }

  // ---- Wait / poll / cancel ----

  // How long the next wait spins: spin_ns_ (ConnectOptions::spin) at most. Doubled (from 1 µs)
  // after a wait that the spin ended, or that ended within spin_ns_ of its sleep; halved after
  // one that slept longer. So a client whose jobs take long (a batched or busy pool, a slow
  // op) stops burning its CPU for spins that never catch a job, which on a machine with more
  // clients than cores is CPU the workers and other clients need, and one whose jobs end
  // within the spin keeps the microsecond round trip. Racy between threads by design: a hint.
  void adapt_wait_spin(bool longer) noexcept {
    const uint64_t now = wait_spin_ns_.load(std::memory_order_relaxed);
    const uint64_t next = longer ? std::min(spin_ns_, std::max<uint64_t>(2 * now, 1000))
                                 : (now / 2 < 500 ? 0 : now / 2);
    wait_spin_ns_.store(next, std::memory_order_relaxed);
  }

  Result<JobResult> wait(uint32_t s, uint32_t generation, int64_t timeout_ns) {
    if (forked()) return forked_error();
    JobSlot& js = slot(s);
    // Counted as reading the slot until this returns: a submit does not write another job
    // into it meanwhile (readers_). Past the count, a slot already given back shows a later
    // generation, and the result comes from the copy kept for this Job.
    readers_[s].fetch_add(1, std::memory_order_seq_cst);
    struct Uncount {
      std::atomic<uint32_t>& n;
      ~Uncount() { n.fetch_sub(1, std::memory_order_release); }
    } uncount{readers_[s]};
    // Finished, or finished and its slot given back (a later generation: see detached_).
    auto finished = [&] {
      const SlotWord w = SlotWord::unpack(js.state.load(std::memory_order_acquire));
      return is_terminal(w.state) || w.generation != generation;
    };
    const uint64_t spin_ns = wait_spin_ns_.load(std::memory_order_relaxed);
    if (spin_until(finished, spin_ns)) {
      if (spin_ns < spin_ns_) adapt_wait_spin(true);
    } else {
      const uint64_t slept_from = monotonic_ns();
      const uint64_t deadline = deadline_after_ns(timeout_ns);
      // The job's own deadline fires here whether or not a worker is free: a job still queued
      // at its deadline is expired by its waiter, as the worker would if it popped it.
      const uint64_t job_deadline = js.desc.deadline_ns;
      for (;;) {
        EventCount::Key key = js.done.prepare_wait();
        GPUQ_FAULT_POINT("client.wait.sleeping");
        if (finished()) {
          js.done.cancel_wait();
          break;
        }
        const uint64_t now = monotonic_ns();
        if (now >= job_deadline && expire_if_queued(js, generation)) {
          js.done.cancel_wait();
          break;
        }
        js.done.wait(key, std::min({deadline, now + kLivenessCheckNs, job_deadline}));
        if (finished()) break;
        if (!daemon_alive()) return disconnected_error();
        if (monotonic_ns() >= deadline) {
          return Error(ErrorCode::kTimeout, "the job has not finished yet");
        }
      }
      // A job that ended soon after the spin gave up: a longer spin would have caught it.
      adapt_wait_spin(monotonic_ns() - slept_from < spin_ns_);
    }
    const SlotWord w = SlotWord::unpack(js.state.load(std::memory_order_seq_cst));
    if (w.generation != generation) {
      if (auto r = detached_result(s, generation)) return *r;
      return Error(ErrorCode::kInternal, "job slot was reused while a Job still held it");
    }
    // Given back while it is read (detach_finished_locked under another thread's submit)? The
    // slot keeps this job's outcome until this wait is done (readers_), and the kept copy is
    // the same.
    return read_result(js, w);
  }

  // The result of the finished job in `js`, whose state word is `w`.
  JobResult read_result(const JobSlot& js, const SlotWord& w) const {
    JobOutcome out;
    std::memcpy(&out, &js.outcome, sizeof out);
    JobResult r;
    // The message only for a job that failed (a successful job's is never written): read up to
    // its NUL, and never past the slot's buffer (the memory is the client's to scribble on).
    if (out.code != 0) r.message.assign(js.message, ::strnlen(js.message, kMessageBytes - 1));
    switch (w.state) {
      case JobState::kDone:
        r.status = JobStatus::kDone;
        break;
      case JobState::kCancelled:
        r.status = JobStatus::kCancelled;
        break;
      case JobState::kExpired:
        r.status = JobStatus::kExpired;
        break;
      default:
        r.status = JobStatus::kFailed;
        break;
    }
    int32_t code = out.code;
    if (code < 0 || code > kMaxErrorCode) code = static_cast<int32_t>(ErrorCode::kInternal);
    r.code = static_cast<ErrorCode>(code);
    if (r.status == JobStatus::kFailed && r.code == ErrorCode::kOk) r.code = ErrorCode::kInternal;
    r.output_size = out.output_bytes;
    r.value = out.value;
    r.worker_id = out.worker_id;
    // From stamps (clock.hpp): a job that never started (cancelled, expired or failed while
    // queued, or failed by the supervisor) was queued until it ended and ran for no time.
    const uint64_t submitted = js.desc.submit_stamp;
    const uint64_t started = out.started_stamp != 0 ? out.started_stamp : out.finished_stamp;
    r.queued_ns = started > submitted ? stamps_.to_ns(started - submitted) : 0;
    r.run_ns = out.started_stamp != 0 && out.finished_stamp > out.started_stamp
                   ? stamps_.to_ns(out.finished_stamp - out.started_stamp)
                   : 0;
    return r;
  }

  // Job::next_part: `*read` is the Job's count of parts it has read (the next part's index).
  Result<std::optional<JobPart>> next_part(uint32_t s, uint32_t generation, uint32_t* read,
                                           int64_t timeout_ns) {
    if (forked()) return forked_error();
    JobSlot& js = slot(s);
    // A stream's slot is never given back while its Job lives (detach_finished_locked).
    if (SlotWord::unpack(js.state.load(std::memory_order_acquire)).generation != generation) {
      return Error(ErrorCode::kInvalidArgument,
                   "next_part: the job was not submitted as a stream (JobSpec::stream_window)");
    }
    const uint32_t window = flags_stream_window(js.desc.flags);
    if (window == 0) {
      return Error(ErrorCode::kInvalidArgument,
                   "next_part: the job was not submitted as a stream (JobSpec::stream_window)");
    }
    // The cell of the part read last goes back to the worker (which may wait for it).
    if (*read > 0 && js.stream.read.load(std::memory_order_relaxed) != *read) {
      js.stream.read.exchange(*read, std::memory_order_seq_cst);
      js.stream.room.notify_all_after_rmw();
    }
    // The state first, then `written`: a worker publishes every part before its terminal
    // store, so once the state is terminal `written` counts them all.
    SlotWord w{};
    uint32_t written = 0;
    auto ready = [&] {
      w = SlotWord::unpack(js.state.load(std::memory_order_acquire));
      written = js.stream.written.load(std::memory_order_acquire);
      return written > *read || is_terminal(w.state);
    };
    if (!spin_until(ready, wait_spin_ns_.load(std::memory_order_relaxed))) {
      const uint64_t deadline = deadline_after_ns(timeout_ns);
      const uint64_t job_deadline = js.desc.deadline_ns;
      for (;;) {
        EventCount::Key key = js.done.prepare_wait();
        if (ready()) {
          js.done.cancel_wait();
          break;
        }
        const uint64_t now = monotonic_ns();
        if (now >= job_deadline && expire_if_queued(js, generation)) {
          js.done.cancel_wait();
          continue;
        }
        js.done.wait(key, std::min({deadline, now + kLivenessCheckNs, job_deadline}));
        if (ready()) break;
        if (!daemon_alive()) return disconnected_error();
        if (monotonic_ns() >= deadline) {
          return Error(ErrorCode::kTimeout, "no part of the stream has come yet");
        }
      }
    }
    if (written > *read) {
      const uint32_t i = (*read)++;
      const uint64_t cell = stream_cell_bytes(js.desc.output_capacity, window);
      const uint64_t bytes = std::min<uint64_t>(js.stream.part_bytes[i % window], cell);
      const char* data = view_.arena() + js.desc.output_offset + uint64_t{i % window} * cell;
      return std::optional<JobPart>(JobPart{i, data, bytes});
    }
    if (w.state == JobState::kDone) return std::optional<JobPart>();
    const JobResult r = read_result(js, w);
    return Error(r.code, r.message.empty() ? std::string(job_status_name(r.status)) : r.message);
  }

  Result<JobStatus> poll(uint32_t s, uint32_t generation) {
    if (forked()) return forked_error();
    JobSlot& js = slot(s);
    if (SlotWord::unpack(js.state.load(std::memory_order_acquire)).generation != generation) {
      if (auto r = detached_result(s, generation)) return r->status;
      return Error(ErrorCode::kInternal, "job slot was reused while a Job still held it");
    }
    if (js.desc.deadline_ns != kNoDeadline && monotonic_ns() >= js.desc.deadline_ns) {
      expire_if_queued(js, generation);
    }
    switch (SlotWord::unpack(js.state.load(std::memory_order_acquire)).state) {
      case JobState::kSubmitted:
        return JobStatus::kQueued;
      case JobState::kRunning:
        return JobStatus::kRunning;
      case JobState::kDone:
        return JobStatus::kDone;
      case JobState::kCancelled:
        return JobStatus::kCancelled;
      case JobState::kExpired:
        return JobStatus::kExpired;
      case JobState::kFailed:
        return JobStatus::kFailed;
      default:
        return Error(ErrorCode::kInternal, "job slot is not in use");
    }
  }

  // Job::wait_any: `jobs` are this connection's (checked by the caller).
  Result<std::vector<size_t>> wait_any(std::span<const Job* const> jobs, int64_t timeout_ns) {
    if (forked()) return forked_error();
    std::vector<size_t> ended;
    uint64_t wake_at = 0;
    // The ended ones into `ended`; `wake_at` lowered to the earliest deadline of a queued one.
    auto collect = [&] {
      for (size_t i = 0; i < jobs.size(); ++i) {
        const Job* j = jobs[i];
        if (j == nullptr || j->impl_ == nullptr) {
          ended.push_back(i);
          continue;
        }
        Result<JobStatus> st = poll(j->slot_, j->generation_);
        if (!st || (*st != JobStatus::kQueued && *st != JobStatus::kRunning)) {
          ended.push_back(i);  // an error too: the caller's wait() or poll() reports it
        } else if (*st == JobStatus::kQueued) {
          // Read as poll() reads it: a slot given back since shows the next job's, and only
          // moves this wake earlier.
          wake_at = std::min(wake_at, slot(j->slot_).desc.deadline_ns);
        }
      }
      return !ended.empty();
    };
    const uint64_t deadline = deadline_after_ns(timeout_ns);
    const uint64_t wakes = wake_requests_.load(std::memory_order_seq_cst);
    wake_at = deadline;
    if (collect()) return ended;
    EventCount& event = view_.events().ended;
    for (;;) {
      const uint64_t now = monotonic_ns();
      wake_at = std::min(deadline, now + kWatchLivenessCheckNs);
      const EventCount::Key key = event.prepare_wait();
      // After the registration: an end or a wake_waiters() from now on wakes the sleep below.
      if (collect() || wake_requests_.load(std::memory_order_seq_cst) != wakes) {
        event.cancel_wait();
        return ended;
      }
      if (now >= deadline) {
        event.cancel_wait();
        return ended;
      }
      if (!event.wait(key, wake_at) && !daemon_alive()) return disconnected_error();
    }
  }

  void wake_waiters() noexcept {
    wake_requests_.fetch_add(1, std::memory_order_seq_cst);
    view_.events().ended.notify_all_after_rmw();
  }

  // Ends a job that no worker has started: SUBMITTED -> `state`, with `code` and `message`.
  // Races the worker's SUBMITTED -> RUNNING CAS on the same word: exactly one wins. False if
  // the job was not (or no longer) queued; `*seen` then holds the state word that won.
  bool finish_unstarted(JobSlot& js, uint32_t generation, JobState state, ErrorCode code,
                        const char* message, uint64_t* seen = nullptr) {
    uint64_t word = SlotWord{generation, JobState::kSubmitted, 0}.pack();
    const uint64_t final_word = SlotWord{generation, state, 0}.pack();
    {
      // Under slot_mutex_ from the CAS to the outcome: a submit that gives finished jobs'
      // slots back (detach_finished_locked) copies this outcome only once it is written.
      std::lock_guard lock(slot_mutex_);
      if (!js.state.compare_exchange_strong(word, final_word, std::memory_order_acq_rel,
                                            std::memory_order_acquire)) {
        if (seen != nullptr) *seen = word;
        return false;
      }
      uncount_locked(static_cast<uint32_t>(&js - &slot(0)), true);  // its entry stays in the ring
      // Written after the CAS: the readers of this outcome are this client's own wait() and
      // poll(), which see the terminal state first (job_states.md, "Cancel against start").
      JobOutcome out{};
      out.code = static_cast<int32_t>(code);
      set_slot_message(js, message);
      out.finished_stamp = read_stamp(stamps_.clock);
      std::memcpy(&js.outcome, &out, sizeof out);
    }
    view_.announce_end(js, false);  // another thread may be waiting on or watching this job
    return true;
  }

  bool expire_if_queued(JobSlot& js, uint32_t generation) {
    return finish_unstarted(js, generation, JobState::kExpired, ErrorCode::kExpired,
                            "deadline passed while the job was queued");
  }

  // A queued job ends CANCELLED at once. A running one is asked to stop: its op sees
  // `cancel_requested` (ops that loop poll it) and the job ends CANCELLED, or the op finishes
  // first and the job ends with its result. Either way it reaches exactly one terminal state,
  // set by the worker's single store; wait() tells which.
  Result<void> cancel(uint32_t s, uint32_t generation) {
    if (forked()) return forked_error();
    JobSlot& js = slot(s);
    uint64_t word = 0;
    if (finish_unstarted(js, generation, JobState::kCancelled, ErrorCode::kCancelled,
                         "cancelled by the client before it started", &word)) {
      return {};
    }
    SlotWord w = SlotWord::unpack(word);
    if (w.generation == generation && w.state == JobState::kRunning) {
      // An or, not a store: the supervisor's time-limit bit may be up already.
      js.cancel_requested.fetch_or(kCancelByClient, std::memory_order_relaxed);
      return {};
    }
    return Error(ErrorCode::kNotCancellable, "the job has already finished");
  }

  Result<bool> cancel_queued(uint32_t s, uint32_t generation) {
    if (forked()) return forked_error();
    return finish_unstarted(slot(s), generation, JobState::kCancelled, ErrorCode::kCancelled,
                            "cancelled by the client before it started");
  }

  // Called when a Job handle goes away. May destroy this object (its last reference, once
  // the Client is gone, is the one the last Job's end releases).
  void drop_job(uint32_t s, uint32_t generation) {
    std::shared_ptr<ClientImpl> last;  // declared first, so released after every use of `this`
    if (forked()) {  // the parent owns the slot; only the count of live Jobs is this copy's
      if (slot_mutex_.try_lock()) {
        last = end_job_locked();
        slot_mutex_.unlock();
      }
      return;
    }
    JobSlot& js = slot(s);
    uint64_t word = js.state.load(std::memory_order_acquire);
    SlotWord w = SlotWord::unpack(word);
    if (w.generation != generation) {  // finished, and its slot given back: its result goes
      last = free_slot(s, generation);
      return;
    }
    if (w.state == JobState::kSubmitted) {
      const uint64_t cancelled = SlotWord{generation, JobState::kCancelled, 0}.pack();
      std::unique_lock lock(slot_mutex_);  // against detach_finished_locked, as in free_slot
      if (js.state.compare_exchange_strong(word, cancelled, std::memory_order_acq_rel)) {
        uncount_locked(s, true);  // its entry stays in the ring until a worker drops it
        lock.unlock();
        last = free_slot(s, generation);
        return;
      }
      lock.unlock();
      w = SlotWord::unpack(word);
    }
    if (is_terminal(w.state)) {
      last = free_slot(s, generation);
    } else {
      // Running, and nobody will read its result: ask its op to stop early.
      js.cancel_requested.fetch_or(kCancelByClient, std::memory_order_relaxed);
      last = abandon(s, generation);  // freed once it finishes
    }
  }

  uint64_t epoch_ = 0;
  uint32_t slot_count_ = 0;
  uint64_t segment_bytes() const { return segment_.size(); }
  // The payload arena: where Buffer offsets count from, and its size.
  std::byte* arena() const { return reinterpret_cast<std::byte*>(view_.arena()); }
  uint64_t arena_bytes() const { return view_.arena_bytes(); }

 private:
  uint64_t fork_generation_ = 0;
  uint64_t spin_ns_ = 0;
  std::atomic<uint64_t> wait_spin_ns_{0};  // the next wait's spin (adapt_wait_spin)
  StampScale stamps_;                      // what the job stamps count in, from Welcome
  UniqueFd socket_;
  QueueSegment queue_segment_;
  QueueView queue_;
  MemfdSegment segment_;
  ClientSegmentView view_;
  uint32_t index_ = 0;
  uint64_t session_ = 0;
  // The catalog held (catalog()), and every one this client has held: none is freed before the
  // client (catalog_mutex_ guards catalogs_ and the request for a new one).
  std::atomic<const Catalog*> catalog_{nullptr};
  std::mutex catalog_mutex_;
  std::vector<std::unique_ptr<const Catalog>> catalogs_;
  std::atomic<bool> disconnected_{false};
  std::atomic<uint64_t> wake_requests_{0};  // wake_waiters() calls, for wait_any()
  ConnectOptions options_;                  // as given to connect(), for Client::reconnect

  std::mutex slot_mutex_;  // process-local; never in shared memory
  // The share count ("This client's share of each ring" above), written under slot_mutex_, read by
  // held() without it: per slot, the pool + 1 while its job counts, else 0; per pool, the jobs
  // counted and this client's entries left behind by jobs it ended while queued.
  std::unique_ptr<uint8_t[]> in_ring_;
  // Per slot, the wait() calls in progress on it. A submit that takes a slot given back by
  // detach_finished_locked writes its descriptor only once none is left: a wait reads the
  // slot (the outcome, the descriptor) without a lock, and must never read it while another
  // job is written there.
  std::unique_ptr<std::atomic<uint32_t>[]> readers_;
  std::atomic<uint32_t> counted_[kMaxPools] = {};
  std::atomic<uint32_t> stale_[kMaxPools] = {};
  std::deque<uint32_t> free_slots_;
  std::vector<std::pair<uint32_t, uint32_t>> abandoned_;
  // Results of finished jobs whose slots went back before their Jobs were dropped
  // ("Finished jobs give their slots back"), by detached_key.
  std::unordered_map<uint64_t, JobResult> detached_;
  uint32_t wait_cursor_ = 0;  // the slot whose end a submit waiting for a slot sleeps on next
  // Live Jobs, and this object's own reference while there are any (under slot_mutex_; see
  // "Jobs keep their connection alive").
  uint32_t live_jobs_ = 0;
  std::shared_ptr<ClientImpl> keep_alive_;

  PayloadArena arena_;  // where the blocks of allocate() lie
};

// ---- Job ----

Job::Job(Job&& o) noexcept
    : impl_(std::exchange(o.impl_, nullptr)),
      slot_(o.slot_),
      generation_(o.generation_),
      parts_read_(o.parts_read_) {}

Job& Job::operator=(Job&& o) noexcept {
  if (this != &o) {
    reset();
    impl_ = std::exchange(o.impl_, nullptr);
    slot_ = o.slot_;
    generation_ = o.generation_;
    parts_read_ = o.parts_read_;
  }
  return *this;
}

Job::~Job() {
  reset();
}

void Job::reset() noexcept {
  // drop_job may destroy the ClientImpl (this Job's end releases its last reference).
  if (ClientImpl* impl = std::exchange(impl_, nullptr)) impl->drop_job(slot_, generation_);
}

Result<JobResult> Job::wait(std::chrono::nanoseconds timeout) {
  if (!impl_) return Error(ErrorCode::kNotFound, "empty Job handle");
  auto r = impl_->wait(slot_, generation_, timeout.count());

  return r;
}

Result<std::optional<JobPart>> Job::next_part(std::chrono::nanoseconds timeout) {
  if (!impl_) return Error(ErrorCode::kNotFound, "empty Job handle");
  return impl_->next_part(slot_, generation_, &parts_read_, timeout.count());
}

Result<JobStatus> Job::poll() const {
  if (!impl_) return Error(ErrorCode::kNotFound, "empty Job handle");
  return impl_->poll(slot_, generation_);
}

Result<std::vector<size_t>> Job::wait_any(const std::vector<const Job*>& jobs,
                                          std::chrono::nanoseconds timeout) {
  ClientImpl* impl = nullptr;
  for (const Job* j : jobs) {
    if (j == nullptr || j->impl_ == nullptr) continue;
    if (impl != nullptr && j->impl_ != impl) {
      return Error(ErrorCode::kInvalidArgument, "wait_any: the jobs are of two connections");
    }
    impl = j->impl_;
  }
  if (impl == nullptr) {  // all empty: all ended
    std::vector<size_t> all(jobs.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    return all;
  }
  return impl->wait_any(jobs, timeout.count());
}

void Job::wake_waiters() const noexcept {
  if (impl_ != nullptr) impl_->wake_waiters();
}

Result<void> Job::cancel() {
  if (!impl_) return Error(ErrorCode::kNotFound, "empty Job handle");
  return impl_->cancel(slot_, generation_);
}

Result<bool> Job::cancel_queued() {
  if (!impl_) return Error(ErrorCode::kNotFound, "empty Job handle");
  return impl_->cancel_queued(slot_, generation_);
}

// ---- Client ----

Result<Client> Client::connect(const ConnectOptions& options) {
  static std::once_flag atfork_once;
  static Result<void> atfork;
  std::call_once(atfork_once, [] {
    atfork = GPUQ_ERRNUM_CALL(::pthread_atfork, nullptr, nullptr, on_fork_child);
  });
  // Without the handler a forked child could not tell its parent's connection from its own.
  if (!atfork) return atfork.error();
  auto impl = std::make_shared<ClientImpl>();
  if (auto r = impl->connect(options); !r) return r.error();
  return Client(std::move(impl));
}

Result<void> Client::reconnect() {
  if (!impl_) return Error(ErrorCode::kNotFound, "empty Client handle");
  auto impl = std::make_shared<ClientImpl>();
  if (auto r = impl->connect(impl_->options()); !r) return r.error();
  // The old connection stays mapped while its Jobs live (they now return Disconnected) and is
  // closed with the last of them; its Buffers must not be used with the new connection.
  if (!impl_->forked()) impl_->mark_disconnected();
  impl_ = std::move(impl);
  return {};
}

Client::Client(std::shared_ptr<ClientImpl> impl) noexcept : impl_(std::move(impl)) {}
Client::Client(Client&&) noexcept = default;
Client& Client::operator=(Client&&) noexcept = default;
Client::~Client() = default;

Result<Buffer> Client::allocate(uint64_t size) {
  return impl_->allocate(size);
}
void Client::release(const Buffer& buffer) {
  impl_->release(buffer);
}

Result<Job> Client::submit(const JobSpec& spec, std::chrono::nanoseconds timeout) {
  return impl_->submit(spec, timeout.count(), true);
}
Result<Job> Client::try_submit(const JobSpec& spec) {
  return impl_->submit(spec, 0, false);
}

const std::vector<PoolInfo>& Client::pools() const noexcept {
  return impl_->fresh_catalog().infos;
}
std::vector<std::string> Client::ops() const {
  std::vector<std::string> names;
  for (const auto& [name, id] : impl_->fresh_catalog().ops.entries()) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}
uint64_t Client::segment_bytes() const noexcept {
  return impl_->segment_bytes();
}
uint32_t Client::slot_count() const noexcept {
  return impl_->slot_count_;
}
std::byte* Client::arena() const noexcept {
  return impl_->arena();
}
uint64_t Client::arena_bytes() const noexcept {
  return impl_->arena_bytes();
}
uint64_t Client::daemon_epoch() const noexcept {
  return impl_->epoch_;
}

// ---- Free functions ----

std::string_view job_status_name(JobStatus s) noexcept {
  switch (s) {
    case JobStatus::kQueued:
      return "queued";
    case JobStatus::kRunning:
      return "running";
    case JobStatus::kDone:
      return "done";
    case JobStatus::kFailed:
      return "failed";
    case JobStatus::kCancelled:
      return "cancelled";
    case JobStatus::kExpired:
      return "expired";
  }
  return "unknown";
}

std::string default_runtime_dir() {
  return resolve_client_runtime_dir({});
}

std::string_view version() noexcept {
  return GPUQ_VERSION;
}

}  // namespace gpuq
