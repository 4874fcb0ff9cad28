#include "fault/fault_support.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <doctest/doctest.h>
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>

#include "gpuq/common/crc32c.hpp"
#include "gpuq/common/fault_point.hpp"

namespace gpuq::test::fault {

using namespace std::chrono_literals;
using nlohmann::json;

// ---- Seeds and counts ------------------------------------------------------------------------

uint64_t suite_seed() {
  static const uint64_t seed = [] {
    uint64_t s = fresh_seed();
    if (const char* e = std::getenv("GPUQ_FAULT_SEED"); e != nullptr && *e != '\0') {
      s = std::strtoull(e, nullptr, 0);
    }
    std::printf("fault suite seed: %" PRIu64 " (replay: GPUQ_FAULT_SEED=%" PRIu64 ")\n", s, s);
    std::fflush(stdout);
    return s;
  }();
  return seed;
}

uint32_t iterations(uint32_t n) {
  double factor = 1.0;
  if (const char* e = std::getenv("GPUQ_FAULT_ITERATIONS"); e != nullptr && *e != '\0') {
    factor = std::strtod(e, nullptr);
    if (!(factor > 0)) factor = 1.0;
  }
  const double scaled_n = static_cast<double>(scaled(n)) * factor;
  return std::max<uint32_t>(1, static_cast<uint32_t>(scaled_n));
}

uint64_t derive_seed(std::string_view what, uint64_t index) {
  uint64_t h = suite_seed() ^ 0x9E3779B97F4A7C15ull;
  for (char c : what) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001B3ull;
  h ^= index * 0xBF58476D1CE4E5B9ull;
  h ^= h >> 31;
  return h;
}

// ---- Daemon configs and status ---------------------------------------------------------------

std::string fault_config(uint32_t workers, json extra) {
  json c = {{"restart_backoff_initial_ms", 1},
            {"restart_backoff_max_ms", 8},
            {"max_start_failures", 1000},
            {"pools", json::array({{{"name", "cpu"}, {"kind", "cpu"}, {"workers", workers}}})}};
  for (auto& [key, value] : extra.items()) c[key] = value;
  return c.dump();
}

json try_status(const std::string& runtime_dir) {
  auto text = gpuq::daemon_status_json(runtime_dir);
  if (!text) return nullptr;
  json doc = json::parse(text.value(), nullptr, false);
  if (doc.is_discarded()) return nullptr;
  return doc;
}

std::string map_queue_segment(const std::string& runtime_dir, QueueMapping* out) {
  std::ifstream f(runtime_dir + "/queue-segment");
  std::string name;
  if (!f || !std::getline(f, name) || name.rfind("gpuq-", 0) != 0) {
    return "no queue segment named in " + runtime_dir + "/queue-segment";
  }
  auto seg = QueueSegment::open(name);
  if (!seg) return "open queue segment " + name + ": " + seg.error().to_string();
  QueueView view(seg->address());
  if (view.header().magic != kQueueMagic || view.header().layout_version != kLayoutVersion) {
    return "queue segment " + name + " has a bad header";
  }
  out->name = name;
  out->segment = std::move(*seg);
  out->view = QueueView(out->segment.address());
  return {};
}

// ---- /proc -----------------------------------------------------------------------------------

namespace {

constexpr std::string_view kClientMemfdName = "memfd:gpuq-client-";

// fn(fd number, link target) for each descriptor of `pid`.
template <typename Fn>
void for_each_fd(pid_t pid, Fn&& fn) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    char target[256];
    const std::string link = dir + "/" + e->d_name;
    const ssize_t n = ::readlink(link.c_str(), target, sizeof target - 1);
    if (n <= 0) continue;
    fn(std::atoi(e->d_name), std::string_view(target, static_cast<size_t>(n)));
  }
  ::closedir(d);
}

}  // namespace

int count_client_memfd_fds(pid_t pid) {
  int n = 0;
  for_each_fd(pid, [&](int, std::string_view target) {
    if (target.find(kClientMemfdName) != std::string_view::npos) ++n;
  });
  return n;
}

int count_client_memfd_mappings(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/maps");
  std::set<std::string> inodes;
  std::string line;
  while (std::getline(in, line)) {
    if (line.find(kClientMemfdName) == std::string::npos) continue;
    std::istringstream fields(line);
    std::string range, perms, offset, dev, inode;
    fields >> range >> perms >> offset >> dev >> inode;
    inodes.insert(inode);
  }
  return static_cast<int>(inodes.size());
}

int own_client_memfd_fd() {
  int found = -1;
  for_each_fd(::getpid(), [&](int fd, std::string_view target) {
    if (target.find(kClientMemfdName) != std::string_view::npos) found = fd;
  });
  return found;
}

bool process_gone(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  if (text.empty() || paren == std::string::npos || paren + 2 >= text.size()) return true;
  const char state = text[paren + 2];
  return state == 'Z' || state == 'X';
}

void become_subreaper() {
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
}

void reap_if_child(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == -1 && errno == EINTR) {
  }
}

// ---- Another process's client segment ---------------------------------------------------------

ForeignSegment::~ForeignSegment() {
  close();
}

std::string ForeignSegment::open(pid_t pid, int fd) {
  close();
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int f = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f < 0) return "open " + path + ": " + std::strerror(errno);
  struct stat st {};
  if (::fstat(f, &st) != 0 || st.st_size < static_cast<off_t>(sizeof(ClientSegmentHeader))) {
    ::close(f);
    return "fstat " + path + ": too small or failed";
  }
  void* p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, f, 0);
  ::close(f);
  if (p == MAP_FAILED) return "mmap " + path + ": " + std::strerror(errno);
  base_ = p;
  bytes_ = static_cast<uint64_t>(st.st_size);
  const auto* h = static_cast<const ClientSegmentHeader*>(p);
  if (h->magic != kClientMagic || h->slot_count > kMaxSlotsPerClient ||
      h->slots_offset + uint64_t{h->slot_count} * sizeof(JobSlot) > bytes_) {
    close();
    return "the segment of pid " + std::to_string(pid) + " has a bad header";
  }
  slots_offset_ = h->slots_offset;
  slot_count_ = h->slot_count;
  return {};
}

void ForeignSegment::close() {
  if (base_ != nullptr) ::munmap(base_, bytes_);
  base_ = nullptr;
  bytes_ = 0;
  slot_count_ = 0;
}

uint32_t ForeignSegment::client_index() const noexcept {
  return static_cast<const ClientSegmentHeader*>(base_)->client_index;
}

JobSlot& ForeignSegment::slot(uint32_t i) const noexcept {
  return reinterpret_cast<JobSlot*>(static_cast<char*>(base_) + slots_offset_)[i];
}

const char* job_state_name(JobState s) {
  switch (s) {
    case JobState::kFree:
      return "Free";
    case JobState::kClaimed:
      return "Claimed";
    case JobState::kSubmitted:
      return "Submitted";
    case JobState::kRunning:
      return "Running";
    case JobState::kDone:
      return "Done";
    case JobState::kFailed:
      return "Failed";
    case JobState::kCancelled:
      return "Cancelled";
    case JobState::kExpired:
      return "Expired";
  }
  return "garbage";
}

std::string ForeignSegment::describe() const {
  std::ostringstream s;
  for (uint32_t i = 0; i < slot_count_; ++i) {
    const SlotWord w = word(i);
    if (w.state == JobState::kFree) continue;
    s << "slot " << i << ": " << job_state_name(w.state) << " gen " << w.generation;
    if (w.worker_plus_one != 0) s << " worker " << w.worker_plus_one - 1;
    s << " input@" << slot(i).desc.input_offset << "; ";
  }
  return s.str();
}

std::string victim_slots_settled(const ForeignSegment& segment, const VictimState& state) {
  for (uint32_t i = 0; i < segment.slot_count(); ++i) {
    const SlotWord w = segment.word(i);
    if (static_cast<uint8_t>(w.state) > static_cast<uint8_t>(JobState::kExpired)) {
      return "slot " + std::to_string(i) + " holds a state that does not exist";
    }
    if (w.state != JobState::kFree && !is_terminal(w.state)) {
      return "slot " + std::to_string(i) + " is still " + job_state_name(w.state) +
             " (every job of a dead client must reach a terminal state)";
    }
  }
  for (int h = 0; h < VictimState::kMaxHeld; ++h) {
    const uint64_t entry = state.held[h].load(std::memory_order_acquire);
    if (entry == 0) continue;
    const uint64_t offset = entry - 1;
    int matches = 0;
    for (uint32_t i = 0; i < segment.slot_count(); ++i) {
      if (segment.word(i).state != JobState::kFree && segment.slot(i).desc.input_offset == offset) {
        ++matches;
      }
    }
    if (matches != 1) {
      return "the job with input@" + std::to_string(offset) +
             ", accepted and held by the victim, is in " + std::to_string(matches) +
             " slots in a terminal state, not exactly 1";
    }
  }
  return {};
}

// ---- Bystanders ------------------------------------------------------------------------------

struct Bystanders::State {
  std::atomic<uint32_t> phase;    // 0 starting, 1 running, 2 drained, 9 could not connect
  std::atomic<int32_t> memfd_fd;  // its client segment's descriptor number
  std::atomic<uint32_t> command;  // 0 run, 1 drain, 2 exit
  std::atomic<uint64_t> submitted;
  std::atomic<uint64_t> done;
  std::atomic<uint64_t> worker_died;
  std::atomic<uint64_t> failures;
  std::atomic<uint32_t> has_error;
  char first_error[512];
};

namespace {

using State = Bystanders::State;

constexpr uint64_t kBystanderMaxJob = 64 * 1024;

void record_error(State& s, const std::string& text) {
  s.failures.fetch_add(1, std::memory_order_relaxed);
  uint32_t expected = 0;
  if (s.has_error.compare_exchange_strong(expected, 1)) {
    std::snprintf(s.first_error, sizeof s.first_error, "%s", text.c_str());
  }
}

void nap_us(uint32_t us) {
  if (us == 0) return;
  timespec ts{static_cast<time_t>(us / 1'000'000), static_cast<long>(us % 1'000'000) * 1000};
  nanosleep(&ts, nullptr);
}

struct BystanderJob {
  Job job;
  bool active = false;
  std::string op;
  Buffer in, out;
  uint64_t size = 0;
  uint32_t us = 0;
  uint32_t crc = 0;
  uint64_t submitted_ns = 0;
};

int bystander_main(State& st, const BystanderOptions& o, int index) {
  Rng rng(o.seed + static_cast<uint64_t>(index) * 0x9E3779B97F4A7C15ull);
  ConnectOptions co;
  co.runtime_dir = o.runtime_dir;
  co.segment_bytes = 8ull << 20;
  co.name = "bystander-" + std::to_string(index);
  auto connected = Client::connect(co);
  if (!connected) {
    record_error(
        st, "bystander " + std::to_string(index) + " connect: " + connected.error().to_string());
    st.phase.store(9, std::memory_order_release);
    return 1;
  }
  Client client = std::move(connected).value();
  st.memfd_fd.store(own_client_memfd_fd());
  std::vector<BystanderJob> jobs(static_cast<size_t>(o.in_flight));
  for (auto& j : jobs) {
    auto in = client.allocate(kBystanderMaxJob);
    auto out = client.allocate(kBystanderMaxJob);
    if (!in || !out) {
      record_error(st, "bystander allocate failed");
      st.phase.store(9, std::memory_order_release);
      return 1;
    }
    j.in = *in;
    j.out = *out;
  }
  const std::string who =
      "bystander " + std::to_string(index) + " (pid " + std::to_string(::getpid()) + "): ";

  auto submit_one = [&](BystanderJob& j) {
    JobSpec spec;
    const uint64_t r = rng.between(0, 999);
    j.size = 0;
    if (static_cast<double>(r) < o.sleep_share * 1000) {
      j.op = "sleep";
      j.us = static_cast<uint32_t>(rng.between(o.sleep_us_min, o.sleep_us_max));
      spec.params.push_back(JobParam::integer("us", j.us));
    } else {
      const uint64_t k = rng.between(0, 99);
      j.op = k < 45 ? "echo" : (k < 75 ? "checksum" : "noop");
    }
    spec.op = j.op;
    if (j.op == "echo" || j.op == "checksum") {
      j.size = log_uniform_size(rng, kBystanderMaxJob);
      rng.fill(j.in.data(), j.size);
      spec.input = j.in.slice(0, j.size);
      if (j.op == "echo") {
        for (uint64_t i = 0; i < j.size; ++i) j.out.data()[i] = ~j.in.data()[i];
        spec.output = j.out.slice(0, j.size);
      } else {
        j.crc = crc32c(j.in.data(), j.size);
        std::memset(j.out.data(), 0, 64);
        spec.output = j.out.slice(0, 64);
      }
    }
    spec.retryable = rng.chance(o.retryable_share);
    auto submitted = client.submit(spec, 30s);
    if (!submitted) {
      record_error(st, who + "submit " + j.op + ": " + submitted.error().to_string());
      nap_us(1000);
      return;
    }
    st.submitted.fetch_add(1, std::memory_order_relaxed);
    j.job = std::move(submitted).value();
    j.submitted_ns = monotonic_ns();
    j.active = true;
  };

  std::vector<Job> stuck;
  auto finish_one = [&](BystanderJob& j) {
    j.active = false;
    auto r = j.job.wait(o.wait_timeout);
    const std::string what = j.op + " job (" + std::to_string(j.size) + " bytes)";
    if (!r) {
      auto polled = j.job.poll();
      record_error(
          st, who + what + ": wait: " + r.error().to_string() + " after " +
                  std::to_string((monotonic_ns() - j.submitted_ns) / kMillisecond) +
                  " ms; status " +
                  (polled ? std::string(job_status_name(*polled)) : polled.error().to_string()) +
                  " (stuck)");
      stuck.push_back(std::move(j.job));  // kept, so that its slot shows what happened
      return;
    }
    j.job = Job();
    const JobResult& res = *r;
    if (res.status == JobStatus::kFailed && res.code == ErrorCode::kWorkerDied) {
      st.worker_died.fetch_add(1, std::memory_order_relaxed);
      if (!o.allow_worker_died)
        record_error(st, who + what + " failed: WorkerDied: " + res.message);
      return;
    }
    if (res.status != JobStatus::kDone) {
      record_error(st, who + what + " ended " + std::string(job_status_name(res.status)) + " (" +
                           std::string(error_code_name(res.code)) + "): " + res.message);
      return;
    }
    if (j.op == "echo") {
      if (res.output_size != j.size || std::memcmp(j.in.data(), j.out.data(), j.size) != 0) {
        record_error(st, who + what + ": output differs from the input (output_size " +
                             std::to_string(res.output_size) + ")");
        return;
      }
    } else if (j.op == "checksum") {
      uint32_t written = 0;
      std::memcpy(&written, j.out.data(), 4);
      if (res.value != j.crc || res.output_size != 4 || written != j.crc) {
        record_error(st, who + what + ": wrong CRC32C " + std::to_string(res.value) +
                             ", expected " + std::to_string(j.crc));
        return;
      }
    } else if (j.op == "sleep") {
      if (res.run_ns < uint64_t{j.us} * 1000) {
        record_error(st, who + "sleep job ran " + std::to_string(res.run_ns) + " ns, not " +
                             std::to_string(j.us) + " us");
        return;
      }
    }
    st.done.fetch_add(1, std::memory_order_relaxed);
  };

  size_t next = 0;
  const uint64_t deadline = monotonic_ns() + 600 * kSecond;
  for (;;) {
    st.phase.store(1, std::memory_order_release);
    while (st.command.load(std::memory_order_acquire) == 0) {
      BystanderJob& j = jobs[next];
      next = (next + 1) % jobs.size();
      if (j.active) finish_one(j);
      submit_one(j);
      nap_us(o.pace_us);
    }
    for (auto& j : jobs) {
      if (j.active) finish_one(j);
    }
    st.phase.store(2, std::memory_order_release);
    uint32_t command;
    while ((command = st.command.load(std::memory_order_acquire)) == 1) {
      if (monotonic_ns() > deadline) return 3;
      nap_us(1000);
    }
    if (command == 2) return 0;  // else 0 again: resume()
  }
}

}  // namespace

std::string BystanderTotals::describe() const {
  std::ostringstream s;
  s << "bystanders: " << submitted << " submitted, " << done << " done, " << worker_died
    << " WorkerDied, " << failures << " failures";
  if (!first_error.empty()) s << "; first error: " << first_error;
  return s.str();
}

Bystanders::Bystanders(BystanderOptions options) : options_(std::move(options)) {
  memory_ =
      std::make_unique<SharedMemory>(sizeof(State) * static_cast<size_t>(options_.count) + 4096);
  SharedArena arena(*memory_);
  states_ = arena.make_array<State>(static_cast<size_t>(options_.count));
  for (int i = 0; i < options_.count; ++i) {
    State& st = states_[i];
    const pid_t pid = fork_child([&]() -> int { return bystander_main(st, options_, i); });
    REQUIRE_MESSAGE(pid > 0, "fork: " << std::strerror(errno));
    pids_.push_back(pid);
  }
}

Bystanders::~Bystanders() {
  for (pid_t pid : pids_) {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      wait_child(pid, 10 * kSecond);
    }
  }
}

void Bystanders::wait_connected() {
  const bool up = wait_until(
      [&] {
        for (int i = 0; i < options_.count; ++i) {
          if (states_[i].phase.load(std::memory_order_acquire) == 0) return false;
        }
        return true;
      },
      10 * kSecond);
  for (int i = 0; i < options_.count; ++i) {
    const uint32_t phase = states_[i].phase.load(std::memory_order_acquire);
    if (!up || phase != 1) {
      FAIL("bystander " << i << " did not start (phase " << phase << "): " << totals().describe());
    }
  }
}

BystanderTotals Bystanders::totals() const {
  BystanderTotals t;
  for (int i = 0; i < options_.count; ++i) {
    const State& st = states_[i];
    t.submitted += st.submitted.load(std::memory_order_relaxed);
    t.done += st.done.load(std::memory_order_relaxed);
    t.worker_died += st.worker_died.load(std::memory_order_relaxed);
    t.failures += st.failures.load(std::memory_order_relaxed);
    if (t.first_error.empty() && st.has_error.load(std::memory_order_acquire) != 0) {
      t.first_error = st.first_error;
    }
  }
  return t;
}

std::string Bystanders::diagnose() const {
  std::ostringstream s;
  QueueMapping queue;
  const std::string problem = map_queue_segment(options_.runtime_dir, &queue);
  if (!problem.empty()) return problem;
  std::vector<uint32_t> in_rings;
  for (uint32_t p = 0; p < queue.view.header().pool_count; ++p) {
    queue.view.queue(p).for_each_value([&](uint32_t v) { in_rings.push_back(v); });
  }
  for (int i = 0; i < options_.count; ++i) {
    ForeignSegment segment;
    const std::string opened = segment.open(pids_[i], states_[i].memfd_fd.load());
    if (!opened.empty()) {
      s << "bystander " << i << ": " << opened << "; ";
      continue;
    }
    const ForeignSegment& seg = segment;
    const uint32_t index = seg.client_index();
    s << "bystander " << i << " (client " << index << "):";
    int unfinished = 0;
    for (uint32_t slot = 0; slot < seg.slot_count(); ++slot) {
      const SlotWord w = seg.word(slot);
      if (w.state != JobState::kSubmitted && w.state != JobState::kRunning) continue;
      ++unfinished;
      s << " slot " << slot << " " << job_state_name(w.state) << " gen " << w.generation;
      if (w.state == JobState::kRunning) {
        s << " on worker " << w.worker_plus_one - 1;
      } else {
        const uint32_t ref = JobRef{index, slot, w.generation}.pack();
        const bool referenced = std::find(in_rings.begin(), in_rings.end(), ref) != in_rings.end();
        s << (referenced ? " (referenced in a ring)" : " (NO reference in any ring: lost)");
      }
      s << ";";
    }
    if (unfinished == 0) s << " nothing queued or running;";
    // Its entries in each pool's ring (what its share counts).
    const ClientShm& cs = queue.view.client(index);
    s << " submitting " << cs.submitting.load() << ", entries in the rings:";
    for (uint32_t p = 0; p < queue.view.header().pool_count; ++p) {
      uint32_t mine = 0;
      queue.view.queue(p).for_each_value(
          [&](uint32_t v) { mine += JobRef::unpack(v).client == index; });
      s << " " << mine;
    }
    s << "; ";
  }
  return s.str();
}

std::string describe_ring(const std::string& runtime_dir, uint32_t pool) {
  QueueMapping q;
  if (auto problem = map_queue_segment(runtime_dir, &q); !problem.empty()) return problem;
  const PoolQueue queue = q.view.queue(pool);
  std::ostringstream s;
  s << "lanes of pool " << pool << " (active 0x" << std::hex << queue.active() << std::dec << "):";
  for (uint32_t lane = 0; lane < queue.lane_count(); ++lane) {
    JobRing ring = queue.lane(lane);
    RingHeader& header = ring.header();
    auto* cells = reinterpret_cast<RingCell*>(&header + 1);
    const uint32_t cap = ring.capacity();
    const uint64_t head = header.head.load(), tail = header.tail.load();
    if (head == 0 && tail == 0) continue;  // never used
    s << " lane " << lane << ": capacity " << cap << ", head " << head << ", tail " << tail
      << "; cells from the head:";
    for (uint64_t p = head; p < head + cap; ++p) {
      const uint64_t c = cells[p % cap].word.load();
      s << " [" << p % cap << "] tag " << static_cast<uint32_t>(c >> 32) << " (expect "
        << static_cast<uint32_t>(p) << ") ";
      if (static_cast<uint32_t>(c) == JobRing::kEmptyValue) {
        s << "EMPTY";
      } else {
        const JobRef r = JobRef::unpack(static_cast<uint32_t>(c));
        s << r.client << "/" << r.slot << "/" << r.generation;
      }
    }
    s << ";";
  }
  return s.str();
}

uint64_t Bystanders::finished_by(int i) const {
  return states_[i].done.load(std::memory_order_relaxed) +
         states_[i].worker_died.load(std::memory_order_relaxed);
}

uint64_t Bystanders::finished() const {
  const BystanderTotals t = totals();
  return t.done + t.worker_died;
}

bool Bystanders::drain(std::chrono::nanoseconds timeout) {
  for (int i = 0; i < options_.count; ++i) states_[i].command.store(1, std::memory_order_release);
  return wait_until(
      [&] {
        for (int i = 0; i < options_.count; ++i) {
          if (states_[i].phase.load(std::memory_order_acquire) < 2) return false;
        }
        return true;
      },
      static_cast<uint64_t>(timeout.count()));
}

bool Bystanders::resume() {
  for (int i = 0; i < options_.count; ++i) {
    if (states_[i].phase.load(std::memory_order_acquire) != 2) return false;
  }
  for (int i = 0; i < options_.count; ++i) states_[i].command.store(0, std::memory_order_release);
  return wait_until(
      [&] {
        for (int i = 0; i < options_.count; ++i) {
          if (states_[i].phase.load(std::memory_order_acquire) != 1) return false;
        }
        return true;
      },
      10 * kSecond);
}

bool Bystanders::release(std::chrono::nanoseconds timeout) {
  for (int i = 0; i < options_.count; ++i) states_[i].command.store(2, std::memory_order_release);
  bool all_ok = true;
  for (pid_t& pid : pids_) {
    const ChildExit exit = wait_child(pid, static_cast<uint64_t>(timeout.count()));
    if (!exit.ok()) {
      all_ok = false;
      MESSAGE("bystander pid " << pid << " " << exit.describe());
    }
    pid = 0;
  }
  return all_ok;
}

// ---- Victims -----------------------------------------------------------------------------------

void VictimState::reset() {
  memfd_fd.store(-1);
  phase.store(0);
  accepted.store(0);
  for (auto& h : held) h.store(0);
  has_error.store(0);
  error[0] = '\0';
}

namespace {

int victim_error(VictimState& st, int code, const std::string& text) {
  uint32_t expected = 0;
  if (st.has_error.compare_exchange_strong(expected, 1)) {
    std::snprintf(st.error, sizeof st.error, "%s", text.c_str());
  }
  return code;
}

constexpr uint32_t kVictimSteps = 4000;
constexpr uint64_t kVictimMaxJob = 16 * 1024;

struct VictimJob {
  Job job;
  Buffer in, out;
  std::string op;
  uint64_t size = 0;
  int held_index = -1;
  bool cancelled = false;
};

class Victim {
 public:
  Victim(VictimState& st, Client& client, Rng& rng) : st_(st), client_(client), rng_(rng) {}

  // 0: go on; else an exit code.
  int submit_new(const std::string& op, uint64_t size, uint32_t us, bool try_only) {
    auto in = client_.allocate(std::max<uint64_t>(size, 64));
    if (!in) return wait_one();  // the arena is full of dropped jobs' buffers: make room
    auto out = client_.allocate(std::max<uint64_t>(size, 64));
    if (!out) {
      client_.release(*in);
      return wait_one();
    }
    VictimJob j;
    j.in = *in;
    j.out = *out;
    j.op = op;
    j.size = size;
    JobSpec spec;
    spec.op = op;
    // Every job names its own input buffer, so that its slot can be told apart after a death.
    spec.input = j.in.slice(0, size);
    if (op == "echo") {
      rng_.fill(j.in.data(), size);
      std::memset(j.out.data(), 0, size);
      spec.output = j.out.slice(0, size);
    } else if (op == "checksum") {
      rng_.fill(j.in.data(), size);
      spec.output = j.out.slice(0, 4);
    } else if (op == "sleep") {
      spec.params.push_back(JobParam::integer("us", us));
    }
    auto r = try_only ? client_.try_submit(spec) : client_.submit(spec, 5s);
    if (!r) {
      client_.release(j.in);
      client_.release(j.out);
      const ErrorCode c = r.error().code();
      if (c == ErrorCode::kQueueFull || c == ErrorCode::kTimeout || c == ErrorCode::kOutOfMemory) {
        return held_.empty() ? 0 : wait_one();
      }
      return victim_error(st_, 30, "submit " + op + ": " + r.error().to_string());
    }
    j.job = std::move(r).value();
    st_.accepted.fetch_add(1, std::memory_order_relaxed);
    for (int h = 0; h < VictimState::kMaxHeld; ++h) {
      if (st_.held[h].load(std::memory_order_relaxed) == 0) {
        j.held_index = h;
        st_.held[h].store(j.in.offset + 1, std::memory_order_release);
        break;
      }
    }
    held_.push_back(std::move(j));
    return 0;
  }

  int wait_one() {
    if (held_.empty()) return 0;
    const size_t i = static_cast<size_t>(rng_.between(0, held_.size() - 1));
    VictimJob& j = held_[i];
    auto r = j.job.wait(10s);
    if (!r) return victim_error(st_, 31, "wait " + j.op + ": " + r.error().to_string());
    const bool ok =
        r->status == JobStatus::kDone || (j.cancelled && r->status == JobStatus::kCancelled);
    if (!ok) {
      return victim_error(
          st_, 32, j.op + " ended " + std::string(job_status_name(r->status)) + ": " + r->message);
    }
    if (j.op == "echo" && r->status == JobStatus::kDone &&
        std::memcmp(j.in.data(), j.out.data(), j.size) != 0) {
      return victim_error(st_, 33, "echo output differs");
    }
    forget(i, true);
    return 0;
  }

  void cancel_one() {
    if (held_.empty()) return;
    VictimJob& j = held_[static_cast<size_t>(rng_.between(0, held_.size() - 1))];
    (void)j.job.cancel();
    j.cancelled = true;
  }

  // Drops a job without waiting: its Job handle goes (cancel or abandon). Its buffers are
  // never released: the job may still run.
  void drop_one() {
    if (held_.empty()) return;
    forget(static_cast<size_t>(rng_.between(0, held_.size() - 1)), false);
  }

  size_t held() const { return held_.size(); }

 private:
  void forget(size_t i, bool release_buffers) {
    VictimJob& j = held_[i];
    if (j.held_index >= 0) st_.held[j.held_index].store(0, std::memory_order_release);
    j.job = Job();
    if (release_buffers) {
      client_.release(j.in);
      client_.release(j.out);
    }
    held_.erase(held_.begin() + static_cast<std::ptrdiff_t>(i));
  }

  VictimState& st_;
  Client& client_;
  Rng& rng_;
  std::vector<VictimJob> held_;
};

int mixed_workload(Victim& v, Rng& rng) {
  for (uint32_t step = 0; step < kVictimSteps; ++step) {
    const uint64_t r = rng.between(0, 99);
    int rc = 0;
    if (v.held() == 0 || (v.held() < 8 && r < 55)) {
      const uint64_t k = rng.between(0, 99);
      const std::string op = k < 40 ? "echo" : (k < 60 ? "checksum" : (k < 80 ? "sleep" : "noop"));
      rc = v.submit_new(op, log_uniform_size(rng, kVictimMaxJob),
                        static_cast<uint32_t>(rng.between(50, 800)), rng.chance(0.2));
    } else if (r < 85) {
      rc = v.wait_one();
    } else if (r < 93) {
      v.cancel_one();
    } else {
      v.drop_one();
    }
    if (rc != 0) return rc;
  }
  return 0;
}

int waiting_workload(Victim& v, Rng& rng) {
  for (uint32_t step = 0; step < kVictimSteps; ++step) {
    const int n = rng.chance(0.3) ? 2 : 1;
    for (int i = 0; i < n; ++i) {
      if (int rc = v.submit_new("sleep", 64, static_cast<uint32_t>(rng.between(300, 3000)), false);
          rc != 0) {
        return rc;
      }
    }
    while (v.held() > 0) {
      if (int rc = v.wait_one(); rc != 0) return rc;
    }
  }
  return 0;
}

int copying_workload(Client& client, VictimState& st, Rng& rng) {
  constexpr uint64_t kBytes = 512 * 1024;
  std::vector<std::byte> source(kBytes);
  rng.fill(source.data(), kBytes);
  Buffer in[2], out[2];
  for (int k = 0; k < 2; ++k) {
    auto a = client.allocate(kBytes);
    auto b = client.allocate(kBytes);
    if (!a || !b) return victim_error(st, 40, "allocate 512 KiB failed");
    in[k] = *a;
    out[k] = *b;
  }
  Job pending[2];
  for (uint32_t step = 0; step < kVictimSteps; ++step) {
    const int k = static_cast<int>(step % 2);
    if (pending[k].valid()) {
      auto r = pending[k].wait(10s);
      if (!r || r->status != JobStatus::kDone) {
        return victim_error(st, 41,
                            "echo of 512 KiB: " + (r ? std::string(job_status_name(r->status))
                                                     : r.error().to_string()));
      }
      st.held[k].store(0, std::memory_order_release);
      pending[k] = Job();
    }
    // The copy into the payload buffer: what a kill "mid-copy" interrupts.
    source[step % kBytes] = static_cast<std::byte>(step);
    std::memcpy(in[k].data(), source.data(), kBytes);
    JobSpec spec;
    spec.op = "echo";
    spec.input = in[k];
    spec.output = out[k];
    auto j = client.submit(spec, 5s);
    if (!j) return victim_error(st, 42, "submit echo: " + j.error().to_string());
    st.accepted.fetch_add(1, std::memory_order_relaxed);
    st.held[k].store(in[k].offset + 1, std::memory_order_release);
    pending[k] = std::move(j).value();
  }
  return 0;
}

}  // namespace

int run_victim(VictimState& st, const VictimPlan& plan) {
  Rng rng(plan.seed);
  ConnectOptions o;
  o.runtime_dir = plan.runtime_dir;
  o.segment_bytes = 4ull << 20;
  o.name = "victim";
  o.spin = plan.spin ? std::chrono::nanoseconds(50'000) : std::chrono::nanoseconds(0);
  auto connected = Client::connect(o);
  if (!connected) return victim_error(st, 20, "connect: " + connected.error().to_string());
  Client client = std::move(connected).value();
  const int fd = own_client_memfd_fd();
  if (fd < 0) return victim_error(st, 21, "no client memfd in /proc/self/fd");
  st.memfd_fd.store(fd, std::memory_order_relaxed);
  st.phase.store(1, std::memory_order_release);
  if (!wait_until([&] { return st.phase.load(std::memory_order_acquire) == 2; }, 10 * kSecond)) {
    return victim_error(st, 22, "the test did not say go within 10 s");
  }
  if (!plan.fault_point.empty()) {
    const std::string spec = plan.fault_point + ":" + std::to_string(plan.fault_hit);
    ::setenv("GPUQ_FAULT_POINT", spec.c_str(), 1);
    ::unsetenv("GPUQ_FAULT_ONCE");
    gpuq::fault::configure_from_env();
  }
  st.phase.store(3, std::memory_order_release);
  Victim v(st, client, rng);
  switch (plan.workload) {
    case VictimWorkload::kMixed:
      return mixed_workload(v, rng);
    case VictimWorkload::kWaiting:
      return waiting_workload(v, rng);
    case VictimWorkload::kCopying:
      return copying_workload(client, st, rng);
  }
  return 0;
}

// ---- Idle checks -------------------------------------------------------------------------------

bool daemon_idle(const std::string& runtime_dir, pid_t gpuqd, const IdleExpectations& e,
                 std::string* why, json* status_out) {
  const json s = try_status(runtime_dir);
  if (status_out != nullptr) *status_out = s;
  if (s.is_null()) {
    *why = "the daemon does not answer status requests";
    return false;
  }
  if (s.value("clients", -1) != e.live_clients) {
    *why = "clients = " + s.value("clients", json()).dump() + ", expected " +
           std::to_string(e.live_clients);
    return false;
  }
  if (e.no_retiring && s.value("client_indexes_retiring", -1) != 0) {
    *why = "client_indexes_retiring = " + s.value("client_indexes_retiring", json()).dump();
    return false;
  }
  std::vector<pid_t> workers;
  for (const auto& pool : s.at("pools")) {
    const std::string name = pool.value("name", std::string("?"));
    if (e.queues_empty &&
        (pool.value("queue_depth", -1) != 0 || pool.value("cells_held", -1) != 0)) {
      *why = "pool " + name + ": queue_depth " + pool.value("queue_depth", json()).dump() +
             ", cells_held " + pool.value("cells_held", json()).dump();
      return false;
    }
    for (const auto& w : pool.at("workers")) {
      workers.push_back(w.value("pid", 0));
      if (e.workers_ready && w.value("state", std::string()) != "ready") {
        *why = "pool " + name + " worker " + w.value("id", json()).dump() + " is " +
               w.value("state", std::string("?"));
        return false;
      }
      if (e.workers_idle && w.value("busy", true)) {
        *why = "pool " + name + " worker " + w.value("id", json()).dump() + " is busy";
        return false;
      }
    }
  }
  if (e.workers_ready && s.value("ready", false) != true) {
    *why = "status says ready: false";
    return false;
  }
  if (e.check_proc) {
    const int fds = count_client_memfd_fds(gpuqd);
    if (fds != e.live_clients) {
      *why = "gpuqd holds " + std::to_string(fds) + " client segment descriptors, expected " +
             std::to_string(e.live_clients);
      return false;
    }
    for (pid_t w : workers) {
      if (w <= 0) continue;
      const int maps = count_client_memfd_mappings(w);
      if (maps != e.live_clients) {
        *why = "worker pid " + std::to_string(w) + " maps " + std::to_string(maps) +
               " client segments, expected " + std::to_string(e.live_clients);
        return false;
      }
    }
  }
  return true;
}

json release_and_expect_empty(Bystanders& bystanders, const std::string& runtime_dir, pid_t gpuqd) {
  REQUIRE(bystanders.release());
  IdleExpectations alone;
  alone.no_retiring = true;
  std::string why;
  json status;
  const bool empty =
      poll_until([&] { return daemon_idle(runtime_dir, gpuqd, alone, &why, &status); }, 10s, 1ms);
  CHECK_MESSAGE(empty, "not idle after every client left: " << why << "\n" << status.dump());
  return status;
}

}  // namespace gpuq::test::fault
