// Unit tests of the shared-memory segments (common/include/gpuq/common/shm.hpp) and of the
// packed words of the layout (common/include/gpuq/common/shm_layout.hpp).
#include "gpuq/common/shm.hpp"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gpuq/common/job_ring.hpp"
#include "gpuq/common/shm_layout.hpp"

namespace gpuq {
namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

bool all_zero(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) {
    if (b[i] != 0) return false;
  }
  return true;
}

// A segment name unique to this process and test, removed again at the end of the scope.
struct UniqueSegmentName {
  explicit UniqueSegmentName(const char* what)
      : name("gpuq_test_" + std::string(what) + "_" + std::to_string(::getpid())) {
    QueueSegment::remove(name);
  }
  ~UniqueSegmentName() { QueueSegment::remove(name); }
  std::string name;
};

// ---- MemfdSegment -----------------------------------------------------------------------------

TEST_CASE("MemfdSegment::create maps a zero-filled, size-sealed memfd") {
  const uint64_t bytes = 3 * 4096 + 100;

  auto seg = MemfdSegment::create("gpuq-test", bytes);

  REQUIRE_MESSAGE(seg.ok(), seg.error().to_string());
  CHECK(seg->address() != nullptr);
  CHECK(seg->size() == bytes);
  CHECK(seg->fd() >= 0);
  CHECK(all_zero(seg->address(), bytes));
  const int seals = ::fcntl(seg->fd(), F_GET_SEALS);
  CHECK((seals & F_SEAL_SHRINK) != 0);
  CHECK((seals & F_SEAL_GROW) != 0);
  CHECK((seals & F_SEAL_SEAL) != 0);
  CHECK(::ftruncate(seg->fd(), 4096) == -1);  // nobody can shrink it under a reader
  CHECK(errno == EPERM);
  CHECK((::fcntl(seg->fd(), F_GETFD) & FD_CLOEXEC) != 0);
}

TEST_CASE("MemfdSegment::map of the fd shows the same memory at another address") {
  auto created = MemfdSegment::create("gpuq-test", 8192);
  REQUIRE(created.ok());
  std::memcpy(created->address(), "hello", 6);

  auto mapped = MemfdSegment::map(UniqueFd(::dup(created->fd())), 8192);

  REQUIRE_MESSAGE(mapped.ok(), mapped.error().to_string());
  CHECK(mapped->address() != created->address());
  CHECK(mapped->size() == 8192);
  CHECK(std::memcmp(mapped->address(), "hello", 6) == 0);
  static_cast<char*>(mapped->address())[8191] = 'z';
  CHECK(static_cast<char*>(created->address())[8191] == 'z');
}

TEST_CASE("MemfdSegment::map may map a prefix of a longer segment") {
  auto created = MemfdSegment::create("gpuq-test", 8192);
  REQUIRE(created.ok());

  auto mapped = MemfdSegment::map(UniqueFd(::dup(created->fd())), 4096);

  REQUIRE(mapped.ok());
  CHECK(mapped->size() == 4096);
}

TEST_CASE("MemfdSegment::map rejects a memfd that is not sealed against shrinking") {
  for (unsigned flags : {MFD_CLOEXEC | MFD_ALLOW_SEALING, unsigned{MFD_CLOEXEC}}) {
    CAPTURE(flags);
    UniqueFd fd(::memfd_create("gpuq-test-unsealed", flags));
    REQUIRE(fd.valid());
    REQUIRE(::ftruncate(fd.get(), 4096) == 0);

    auto r = MemfdSegment::map(std::move(fd), 4096);

    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == ErrorCode::kInvalidArgument);
    CHECK(contains(r.error().message(), "not sealed"));
  }
}

TEST_CASE("MemfdSegment::map rejects a memfd shorter than expected") {
  auto created = MemfdSegment::create("gpuq-test", 4096);
  REQUIRE(created.ok());

  auto r = MemfdSegment::map(UniqueFd(::dup(created->fd())), 8192);

  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code() == ErrorCode::kInvalidArgument);
  CHECK(contains(r.error().message(), "4096 bytes, expected 8192"));
}

TEST_CASE("MemfdSegment::map rejects a descriptor that is not a memfd") {
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  UniqueFd read_end(p[0]);

  auto r = MemfdSegment::map(UniqueFd(p[1]), 0);

  CHECK_FALSE(r.ok());
}

TEST_CASE("MemfdSegment moves its mapping and descriptor") {
  auto created = MemfdSegment::create("gpuq-test", 4096);
  REQUIRE(created.ok());
  void* address = created->address();
  const int fd = created->fd();

  MemfdSegment moved = std::move(*created);

  CHECK(moved.address() == address);
  CHECK(moved.fd() == fd);
  CHECK(created->address() == nullptr);  // NOLINT(bugprone-use-after-move): checked on purpose
  CHECK(created->fd() == -1);
  CHECK(created->size() == 0);
}

// ---- QueueSegment -----------------------------------------------------------------------------

TEST_CASE("QueueSegment create, open and remove") {
  UniqueSegmentName seg("queue");
  const uint64_t bytes = 64 * 1024;

  auto created = QueueSegment::create(seg.name, bytes, 0600);
  REQUIRE_MESSAGE(created.ok(), created.error().to_string());
  CHECK(created->address() != nullptr);
  CHECK(created->size() == bytes);
  CHECK(all_zero(created->address(), bytes));
  std::memcpy(static_cast<char*>(created->address()) + 1000, "ring", 5);

  auto opened = QueueSegment::open(seg.name);
  REQUIRE_MESSAGE(opened.ok(), opened.error().to_string());
  CHECK(opened->address() != created->address());
  CHECK(opened->size() == bytes);
  CHECK(std::memcmp(static_cast<char*>(opened->address()) + 1000, "ring", 5) == 0);

  CHECK(QueueSegment::remove(seg.name));
  CHECK_FALSE(QueueSegment::remove(seg.name));
  auto gone = QueueSegment::open(seg.name);
  REQUIRE_FALSE(gone.ok());
  CHECK(gone.error().code() == ErrorCode::kDisconnected);
  // Existing mappings outlive the name.
  CHECK(std::memcmp(static_cast<char*>(opened->address()) + 1000, "ring", 5) == 0);
}

TEST_CASE("QueueSegment::create fails if the name exists") {
  UniqueSegmentName seg("exists");
  auto first = QueueSegment::create(seg.name, 4096, 0600);
  REQUIRE(first.ok());

  auto second = QueueSegment::create(seg.name, 4096, 0600);

  REQUIRE_FALSE(second.ok());
  CHECK(second.error().code() == ErrorCode::kSystemError);
  CHECK(contains(second.error().message(), seg.name));
  CHECK(static_cast<char*>(first->address())[0] == 0);  // the first one is untouched
}

TEST_CASE("QueueSegment::create sets exactly the requested mode whatever the umask") {
  UniqueSegmentName seg("mode");
  const mode_t old_umask = ::umask(077);

  auto created = QueueSegment::create(seg.name, 4096, 0660);
  ::umask(old_umask);

  REQUIRE(created.ok());
  struct stat st {};
  REQUIRE(::stat(("/dev/shm/" + seg.name).c_str(), &st) == 0);
  CHECK((st.st_mode & 07777) == 0660);
}

TEST_CASE("QueueSegment::open of a missing name fails") {
  UniqueSegmentName seg("missing");

  auto r = QueueSegment::open(seg.name);

  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code() == ErrorCode::kDisconnected);
  CHECK(contains(r.error().message(), seg.name));
}

TEST_CASE("A default QueueSegment maps nothing") {
  QueueSegment seg;
  CHECK(seg.address() == nullptr);
  CHECK(seg.size() == 0);
}

// ---- Packed words -------------------------------------------------------------------------------

TEST_CASE("fit_message: whole when it fits, else its beginning and its end") {
  char out[32];
  CHECK(fit_message(out, sizeof out, "short") == 5);
  CHECK(std::string(out) == "short");
  const std::string exact(31, 'x');
  CHECK(fit_message(out, sizeof out, exact) == 31);
  CHECK(std::string(out) == exact);
  CHECK(fit_message(out, sizeof out, "pool 'p' is down: worker 1 exited: RuntimeError: no model") ==
        31);
  CHECK(std::string(out) == "pool 'p' is d ... ror: no model");
  CHECK(fit_message(out, 1, "anything") == 0);
  CHECK(out[0] == '\0');
}

TEST_CASE("a job slot's message holds 2047 bytes; a longer one keeps both ends") {
  static JobSlot slot;  // 2 KiB and more: not on the stack
  std::string text(2000, 'm');
  text += "the cause";
  set_slot_message(slot, text);
  CHECK(std::string(slot.message) == text);
  text = "what failed: " + std::string(5000, '.') + " the cause";
  set_slot_message(slot, text);
  const std::string kept(slot.message);
  CHECK(kept.size() == kMessageBytes - 1);
  CHECK(kept.rfind("what failed: ", 0) == 0);
  CHECK(kept.substr(kept.size() - 10) == " the cause");
}

TEST_CASE("a pool's down_reason holds a message of kMessageBytes, read back whole") {
  static PoolShm pool;
  const std::string reason =
      "pool 'py' is down (no ready worker for 10000 ms): worker 1 exited "
      "with status 1 before it was ready: " +
      std::string(1500, 'e') + " FileNotFoundError: /models/x.pt";
  set_pool_down_reason(pool, reason);
  CHECK(pool_down_reason(pool) == reason);
}

TEST_CASE("JobRef packs into 32 bits and unpacks to the same fields") {
  for (uint32_t client : {0u, 1u, 511u, kMaxClients - 1}) {
    for (uint32_t slot : {0u, 1u, 128u, kMaxSlotsPerClient - 1}) {
      for (uint32_t generation : {0u, 1u, 0x1555u, JobRef::kGenerationMask}) {
        CAPTURE(client);
        CAPTURE(slot);
        CAPTURE(generation);
        const JobRef ref{client, slot, generation};

        const JobRef back = JobRef::unpack(ref.pack());

        CHECK(back.client == client);
        CHECK(back.slot == slot);
        CHECK(back.generation == generation);
      }
    }
  }
}

TEST_CASE("JobRef keeps only the low 14 bits of the generation") {
  const JobRef ref{5, 6, 0x12345678u};

  const JobRef back = JobRef::unpack(ref.pack());

  CHECK(back.client == 5);
  CHECK(back.slot == 6);
  CHECK(back.generation == (0x12345678u & JobRef::kGenerationMask));
}

TEST_CASE("No valid JobRef equals JobRing::kEmptyValue") {
  const JobRef largest{kMaxClients - 1, kMaxSlotsPerClient - 1, JobRef::kGenerationMask};
  CHECK(largest.pack() != JobRing::kEmptyValue);
  // Client index 1023 is never handed out precisely because its last slot would collide.
  const JobRef reserved{kMaxClients, kMaxSlotsPerClient - 1, JobRef::kGenerationMask};
  CHECK(reserved.pack() == JobRing::kEmptyValue);
  // Distinct references give distinct words (the fields do not overlap).
  CHECK(JobRef{1, 0, 0}.pack() != JobRef{0, 255, JobRef::kGenerationMask}.pack());
  CHECK(JobRef{0, 1, 0}.pack() != JobRef{0, 0, JobRef::kGenerationMask}.pack());
}

TEST_CASE("SlotWord packs into 64 bits and unpacks to the same fields") {
  const JobState states[] = {JobState::kFree,      JobState::kClaimed, JobState::kSubmitted,
                             JobState::kRunning,   JobState::kDone,    JobState::kFailed,
                             JobState::kCancelled, JobState::kExpired};
  for (JobState state : states) {
    for (uint32_t generation : {0u, 1u, 0x80000000u, 0xFFFFFFFFu}) {
      for (uint32_t worker : {0u, 1u, kMaxWorkers, 0xFFFFFFu}) {
        CAPTURE(static_cast<int>(state));
        CAPTURE(generation);
        CAPTURE(worker);
        const SlotWord w{generation, state, worker};

        const SlotWord back = SlotWord::unpack(w.pack());

        CHECK(back.generation == generation);
        CHECK(back.state == state);
        CHECK(back.worker_plus_one == worker);
      }
    }
  }
}

TEST_CASE("SlotWord distinguishes words that differ only in generation") {
  const SlotWord a{7, JobState::kSubmitted, 0};
  const SlotWord b{8, JobState::kSubmitted, 0};

  CHECK(a.pack() != b.pack());
  CHECK(is_terminal(JobState::kDone));
  CHECK(is_terminal(JobState::kExpired));
  CHECK_FALSE(is_terminal(JobState::kRunning));
}

}  // namespace
}  // namespace gpuq

namespace gpuq {
namespace {

// A queue segment laid out in ordinary memory: one pool of `capacity` cells with 2 workers,
// 4 clients, as the supervisor lays it out.
struct LaidOutQueue {
  static constexpr uint32_t kCapacity = 20;
  static constexpr uint32_t kLanes = 4;
  static constexpr uint32_t kWorkers = 2;
  static constexpr uint32_t kClients = 4;
  std::vector<char> storage;
  char* base = nullptr;
  uint64_t bytes = 0;

  LaidOutQueue() {
    const uint64_t pools_off = sizeof(QueueHeader);
    const uint64_t workers_off = pools_off + sizeof(PoolShm);
    const uint64_t clients_off = workers_off + kWorkers * sizeof(WorkerShm);
    const uint64_t queue_off = clients_off + kClients * sizeof(ClientShm);
    bytes = queue_off + PoolQueue::bytes_for(kCapacity, kLanes);
    storage.assign(bytes + 64, 0);
    base = storage.data() + (64 - reinterpret_cast<uintptr_t>(storage.data()) % 64) % 64;
    auto& h = *reinterpret_cast<QueueHeader*>(base);
    h.magic = kQueueMagic;
    h.layout_version = kLayoutVersion;
    h.pool_count = 1;
    h.worker_count = kWorkers;
    h.max_clients = kClients;
    h.pools_offset = pools_off;
    h.workers_offset = workers_off;
    h.clients_offset = clients_off;
    auto& p = *reinterpret_cast<PoolShm*>(base + pools_off);
    p.capacity = kCapacity;
    p.worker_count = kWorkers;
    p.first_worker = 0;
    p.queue_offset = queue_off;
    p.client_lanes = kLanes;
    PoolQueue::create(base + queue_off, kCapacity, kLanes);
  }
  QueueHeader& header() { return *reinterpret_cast<QueueHeader*>(base); }
  PoolShm& pool() { return *reinterpret_cast<PoolShm*>(base + header().pools_offset); }
};

TEST_CASE("QueueView::attach accepts a well-formed layout") {
  LaidOutQueue q;
  auto v = QueueView::attach(q.base, q.bytes);
  REQUIRE_MESSAGE(v.ok(), v.error().to_string());
  CHECK(v->layout().pool_count == 1);
  CHECK(v->queue(0).capacity() == LaidOutQueue::kCapacity);
  CHECK(v->queue(0).lane_count() == 3 * (LaidOutQueue::kLanes + 1));
}

TEST_CASE("QueueView::attach rejects every layout field that points outside the segment") {
  auto rejected = [](auto scribble) {
    LaidOutQueue q;
    scribble(q);
    return !QueueView::attach(q.base, q.bytes).ok();
  };
  CHECK(rejected([](LaidOutQueue& q) { q.header().magic = 0; }));
  CHECK(rejected([](LaidOutQueue& q) { q.header().layout_version = kLayoutVersion + 1; }));
  CHECK(rejected([](LaidOutQueue& q) { q.header().pool_count = 0; }));
  CHECK(rejected([](LaidOutQueue& q) { q.header().pool_count = kMaxPools + 1; }));
  CHECK(rejected([](LaidOutQueue& q) { q.header().pools_offset = q.bytes; }));
  CHECK(rejected([](LaidOutQueue& q) { q.header().pools_offset = ~uint64_t{0} - 63; }));
  CHECK(rejected([](LaidOutQueue& q) { q.header().workers_offset += 8; }));  // misaligned
  CHECK(rejected([](LaidOutQueue& q) { q.header().max_clients = kMaxClients; }));
  CHECK(rejected([](LaidOutQueue& q) { q.header().worker_count = 1'000'000; }));
  CHECK(rejected([](LaidOutQueue& q) { q.pool().queue_offset = q.bytes - 64; }));
  CHECK(rejected([](LaidOutQueue& q) { q.pool().capacity = 0; }));
  CHECK(rejected([](LaidOutQueue& q) { q.pool().capacity = 21; }));  // the lanes say 20
  CHECK(rejected([](LaidOutQueue& q) { q.pool().client_lanes = 0; }));
  CHECK(rejected([](LaidOutQueue& q) { q.pool().client_lanes = PoolQueue::kMaxClientLanes + 1; }));
  CHECK(rejected([](LaidOutQueue& q) { q.pool().client_lanes = LaidOutQueue::kLanes - 1; }));
  CHECK(rejected([](LaidOutQueue& q) { q.pool().client_lanes = LaidOutQueue::kLanes / 2; }));
  CHECK(rejected([](LaidOutQueue& q) {  // the last lane's own header
    q.pool().capacity = LaidOutQueue::kCapacity;
    PoolQueue pq(q.base + q.pool().queue_offset, LaidOutQueue::kCapacity, LaidOutQueue::kLanes);
    pq.lane(pq.lane_count() - 1).header().capacity = 19;
  }));
  CHECK(rejected([](LaidOutQueue& q) { q.pool().first_worker = 2; }));
  CHECK(rejected([](LaidOutQueue& q) { q.pool().worker_count = 3; }));
}

TEST_CASE("a QueueView indexes with its own copy of the layout; restore writes it back") {
  LaidOutQueue q;
  auto v = QueueView::attach(q.base, q.bytes);
  REQUIRE(v.ok());
  const uint64_t queue_offset = q.pool().queue_offset;
  // A client scribbles over the shared layout after the view was taken.
  q.pool().queue_offset = 1 << 30;
  q.pool().client_lanes = 1;
  q.pool().capacity = 1 << 20;
  q.header().pools_offset = 1 << 30;
  CHECK(reinterpret_cast<char*>(&v->pool(0)) == q.base + sizeof(QueueHeader));
  const PoolQueue queue = v->queue(0);
  CHECK(queue.capacity() == LaidOutQueue::kCapacity);
  CHECK(queue.client_lanes() == LaidOutQueue::kLanes);
  const uint32_t lane = queue.lane_for(3, Priority::kNormal, false);
  CHECK(queue.try_push(lane, 7));
  uint32_t value = 0;
  CHECK(queue.lane(lane).try_pop(&value));
  CHECK(value == 7);
  CHECK_FALSE(QueueView::attach(q.base, q.bytes).ok());
  v->restore_shared_layout();
  CHECK(q.header().pools_offset == sizeof(QueueHeader));
  CHECK(q.pool().queue_offset == queue_offset);
  CHECK(q.pool().client_lanes == LaidOutQueue::kLanes);
  CHECK(QueueView::attach(q.base, q.bytes).ok());
}

}  // namespace
}  // namespace gpuq
