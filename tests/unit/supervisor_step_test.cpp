// Unit tests of the supervisor's recovery decisions, stepped one event-loop round at a time with
// a fake ProcessLauncher: no worker process exists; the test plays each worker on the control
// socket the supervisor made for it (WorkerReady), decides when a "worker" exits (the launcher
// queues the exit and raises SIGCHLD, which the supervisor reads from its signalfd as it would
// a real one), and plays a client on the real control socket (Hello, Welcome, the client
// segment mapped from the descriptor it brings). Everything but the processes is real: the
// runtime directory, the queue segment, the rings, the client segment, epoll and signalfd.
// The kill -9 runs of whole processes stay in tests/fault.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "doctest/doctest.h"
#include "gpuq/common/protocol.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "gpuq/common/unique_fd.hpp"
#include "ops.hpp"
#include "supervisor.hpp"

namespace gpuq::daemon {
namespace {

using nlohmann::json;

// Starts nothing. Each "process" keeps the supervisor's control socket end the child would
// have had as fd 3, so the test can speak for the worker.
class FakeLauncher final : public ProcessLauncher {
 public:
  struct Proc {
    uint32_t worker = 0;
    UniqueFd control;
    UniqueFd private_page;  // the worker's private memfd (WorkerPrivate, then WorkerMetrics)
    bool exited = false;
  };

  Result<pid_t> launch(const LaunchSpec& spec) override {
    const pid_t pid = next_pid_++;
    Proc p;
    for (size_t i = 0; i + 1 < spec.argv.size(); ++i) {
      if (spec.argv[i] == "--worker-id")
        p.worker = static_cast<uint32_t>(std::stoul(spec.argv[i + 1]));
    }
    p.control.reset(::fcntl(spec.control_fd, F_DUPFD_CLOEXEC, 0));
    if (spec.private_fd >= 0) p.private_page.reset(::fcntl(spec.private_fd, F_DUPFD_CLOEXEC, 0));
    // Its own file description: non-blocking, so reading an empty queue returns Timeout.
    ::fcntl(p.control.get(), F_SETFL, O_NONBLOCK);
    procs_.emplace(pid, std::move(p));
    launches_.push_back(pid);
    return pid;
  }
  void kill(pid_t pid) override {
    killed_.push_back(pid);
    if (!hold_kills) exit(pid, SIGKILL);
  }
  // True: a kill is only recorded; the test ends the process with exit() when it wants (a
  // process whose teardown takes a while).
  bool hold_kills = false;
  std::optional<ChildExit> reap() override {
    if (exits_.empty()) return std::nullopt;
    ChildExit e = exits_.front();
    exits_.pop_front();
    return e;
  }
  Result<void> set_affinity(pid_t pid, const std::vector<int>& cpus) override {
    pinned_.emplace_back(pid, cpus);
    return {};
  }

  // The process ends: killed by `signal`, or exits with `code` (signal 0).
  void exit(pid_t pid, int signal, int code = 0) {
    Proc& p = procs_.at(pid);
    if (p.exited) return;
    p.exited = true;
    p.control.reset();
    // waitpid's encoding: a signal in the low 7 bits, else the status in bits 8-15.
    exits_.push_back({pid, signal != 0 ? signal : (code & 0xFF) << 8});
    ::raise(SIGCHLD);  // blocked by the supervisor: pending for its signalfd
  }

  // The newest process of worker `id` (0 if none).
  pid_t pid_of(uint32_t id) const {
    for (auto it = launches_.rbegin(); it != launches_.rend(); ++it) {
      if (procs_.at(*it).worker == id) return *it;
    }
    return 0;
  }
  size_t launches_of(uint32_t id) const {
    size_t n = 0;
    for (pid_t pid : launches_) n += procs_.at(pid).worker == id ? 1 : 0;
    return n;
  }
  Proc& proc(pid_t pid) { return procs_.at(pid); }
  const std::vector<pid_t>& killed() const { return killed_; }
  // set_affinity's calls: {pid, cpus}.
  const std::vector<std::pair<pid_t, std::vector<int>>>& pinned() const { return pinned_; }

 private:
  pid_t next_pid_ = 4'000'000;  // above pid_max: never a real process
  std::map<pid_t, Proc> procs_;
  std::vector<pid_t> launches_;
  std::vector<pid_t> killed_;
  std::vector<std::pair<pid_t, std::vector<int>>> pinned_;
  std::deque<ChildExit> exits_;
};

struct Harness {
  std::string dir;
  std::shared_ptr<FakeLauncher> launcher = std::make_shared<FakeLauncher>();
  std::unique_ptr<Supervisor> sup;

  explicit Harness(uint32_t workers, uint32_t max_start_failures = 5,
                   const std::function<void(Config&)>& tweak = {}) {
    char tmpl[] = "/tmp/gpuq-step-XXXXXX";
    REQUIRE(::mkdtemp(tmpl) != nullptr);
    dir = tmpl;
    SupervisorOptions o;
    o.runtime_dir = dir + "/run";
    o.executables.worker = "/nonexistent/gpuq-worker";  // never executed: the launcher is fake
    PoolConfig pool;
    pool.name = "cpu";
    pool.workers = workers;
    for (uint32_t i = 0; i < workers; ++i) pool.cpus.push_back(0);
    o.config.pools.push_back(pool);
    o.config.max_clients = 4;
    o.config.max_jobs_per_client = 8;
    o.config.client_segment_bytes = 1 << 20;
    o.config.restart_backoff_initial_ms = 1;
    o.config.restart_backoff_max_ms = 1;
    o.config.max_start_failures = max_start_failures;
    o.config.job_clock = StampClock::kMonotonic;
    if (tweak) tweak(o.config);
    o.launcher = launcher;
    sup = std::make_unique<Supervisor>(std::move(o));
    auto r = sup->start();
    REQUIRE_MESSAGE(static_cast<bool>(r), (r ? std::string() : r.error().to_string()));
  }
  ~Harness() {
    sup.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }

  // Steps the loop until `done()` holds (at most ~2 s of rounds).
  template <typename Fn>
  bool step_until(Fn&& done) {
    for (int i = 0; i < 400; ++i) {
      if (done()) return true;
      auto r = sup->step(5);
      REQUIRE(static_cast<bool>(r));
    }
    return done();
  }

  json status() const { return json::parse(sup->status_json()); }
  std::string worker_state(uint32_t id) const { return worker(id)["state"]; }
  json worker(uint32_t id) const {
    const json s = status();
    for (const auto& w : s["pools"][0]["workers"]) {
      if (w["id"] == id) return w;
    }
    return json{{"state", "?"}, {"role", "?"}};
  }

  // The worker's side: WorkerReady on its control socket.
  void report_ready(uint32_t id) {
    FakeLauncher::Proc& p = launcher->proc(launcher->pid_of(id));
    REQUIRE(send_message(p.control.get(), MessageType::kWorkerReady,
                         json{{"worker", id}, {"plugin_ops", json::array()}}.dump()));
    REQUIRE(step_until([&] { return worker_state(id) == "ready"; }));
  }
};

// A client on the real socket: Hello, Welcome, its segment mapped.
struct TestClient {
  UniqueFd fd;
  void* base = nullptr;
  size_t bytes = 0;
  ClientSegmentView view;
  uint32_t index = 0;
  uint64_t session = 0;

  explicit TestClient(Harness& h) {
    fd.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    REQUIRE(fd.valid());
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, h.sup->socket_path().c_str(), sizeof addr.sun_path - 1);
    REQUIRE(::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    REQUIRE(send_message(fd.get(), MessageType::kHello, R"({"name":"step-test"})"));
    REQUIRE(h.step_until([&] { return h.status()["clients"] == 1; }));
    auto m = receive_message(fd.get());
    REQUIRE(static_cast<bool>(m));
    REQUIRE(m->type == MessageType::kWelcome);
    REQUIRE(m->fds.size() == 1);
    const json w = json::parse(m->body);
    ClientSegmentGeometry g{};
    g.slots_offset = w["slots_offset"];
    g.arena_offset = w["arena_offset"];
    g.arena_bytes = w["arena_bytes"];
    g.segment_bytes = w["segment_bytes"];
    index = w["client"];
    session = w["session"];
    bytes = g.segment_bytes;
    base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, m->fds[0].get(), 0);
    REQUIRE(base != MAP_FAILED);
    view = ClientSegmentView(base, g, w["slot_count"]);
  }
  ~TestClient() {
    if (base != nullptr && base != MAP_FAILED) ::munmap(base, bytes);
  }

  // Puts slot `s` in `state` (generation 1) as a job of pool 0, owned by `worker` if running.
  void set_job(uint32_t s, JobState state, int worker, bool retryable) {
    JobSlot& slot = view.slot(s);
    slot.desc.pool_id = 0;
    slot.desc.flags = retryable ? kJobFlagRetryable : 0;
    slot.state.store(
        SlotWord{1, state, worker >= 0 ? static_cast<uint32_t>(worker) + 1 : 0}.pack());
  }
  SlotWord word(uint32_t s) const { return SlotWord::unpack(view.slot(s).state.load()); }
  uint32_t ref(uint32_t s) const { return JobRef{index, s, 1}.pack(); }
};

// Pushes `ref` into pool 0's lane of its client, as the client would a normal-priority job.
bool push_ref(const Harness& h, uint32_t ref) {
  const PoolQueue q = h.sup->queue().queue(0);
  return q.try_push(q.lane_for(JobRef::unpack(ref).client, Priority::kNormal, false), ref);
}

bool ring_holds(const Harness& h, uint32_t ref) {
  bool found = false;
  h.sup->queue().queue(0).for_each_value([&](uint32_t v) { found = found || v == ref; });
  return found;
}

TEST_CASE("supervisor step: a worker's death retries a retryable job once, then fails it") {
  Harness h(2);
  h.report_ready(0);
  h.report_ready(1);
  TestClient c(h);

  c.set_job(0, JobState::kRunning, 0, /*retryable=*/true);
  h.launcher->exit(h.launcher->pid_of(0), SIGKILL);
  REQUIRE(h.step_until([&] { return c.word(0).state != JobState::kRunning; }));
  // Retried: SUBMITTED again (same generation, no worker) and its reference back in the ring.
  CHECK(c.word(0).state == JobState::kSubmitted);
  CHECK(c.word(0).generation == 1);
  CHECK(c.word(0).worker_plus_one == 0);
  CHECK(ring_holds(h, c.ref(0)));
  // The worker is restarted after its back-off: a second launch of worker 0.
  REQUIRE(h.step_until([&] { return h.launcher->launches_of(0) == 2; }));
  CHECK(h.worker_state(0) == "starting");
  h.report_ready(0);

  // The same job dies with its worker again: retried once already, so it fails.
  c.set_job(0, JobState::kRunning, 0, true);
  h.launcher->exit(h.launcher->pid_of(0), SIGKILL);
  REQUIRE(h.step_until([&] { return c.word(0).state != JobState::kRunning; }));
  CHECK(c.word(0).state == JobState::kFailed);
  CHECK(c.view.slot(0).outcome.code == static_cast<int32_t>(ErrorCode::kWorkerDied));
  CHECK(c.view.slot(0).outcome.worker_id == 0);
  CHECK(std::string(c.view.slot(0).message).find("worker 0") != std::string::npos);
  CHECK(std::string(c.view.slot(0).message).find("killed by signal 9") != std::string::npos);
}

TEST_CASE(
    "supervisor step: a job that is not retryable fails with WorkerDied; others are untouched") {
  Harness h(2);
  h.report_ready(0);
  h.report_ready(1);
  TestClient c(h);

  c.set_job(1, JobState::kRunning, 1, /*retryable=*/false);
  c.set_job(2, JobState::kRunning, 0, false);  // worker 0's job: worker 0 lives on
  h.launcher->exit(h.launcher->pid_of(1), 0, /*code=*/3);
  REQUIRE(h.step_until([&] { return c.word(1).state != JobState::kRunning; }));
  CHECK(c.word(1).state == JobState::kFailed);
  CHECK(c.view.slot(1).outcome.code == static_cast<int32_t>(ErrorCode::kWorkerDied));
  CHECK(std::string(c.view.slot(1).message).find("exited with status 3") != std::string::npos);
  CHECK(c.word(2).state == JobState::kRunning);
  CHECK(c.word(2).worker_plus_one == 1);
  CHECK_FALSE(ring_holds(h, c.ref(1)));
  CHECK(h.status()["pools"][0]["workers"][1]["restarts"] == 1);
}

TEST_CASE("supervisor step: a reference a dying worker took is pushed again") {
  Harness h(1);
  h.report_ready(0);
  TestClient c(h);

  // SUBMITTED but in no ring: the worker popped the reference and died before claiming it.
  c.set_job(3, JobState::kSubmitted, -1, false);
  REQUIRE_FALSE(ring_holds(h, c.ref(3)));
  h.launcher->exit(h.launcher->pid_of(0), SIGKILL);
  REQUIRE(h.step_until([&] { return ring_holds(h, c.ref(3)); }));
  CHECK(c.word(3).state == JobState::kSubmitted);
}

TEST_CASE(
    "supervisor step: a worker that fails to start max_start_failures times is failed, tried "
    "again after the start back-off, and comes back") {
  Harness h(1, /*max_start_failures=*/3, [](Config& c) {
    c.start_backoff_initial_ms = 300;
    c.start_backoff_max_ms = 300;
  });
  for (size_t launch = 1; launch <= 3; ++launch) {
    REQUIRE(h.step_until([&] { return h.launcher->launches_of(0) == launch; }));
    h.launcher->exit(h.launcher->pid_of(0), 0, /*code=*/3);
  }
  REQUIRE(h.step_until([&] { return h.worker_state(0) == "failed"; }));
  const auto failed_at = std::chrono::steady_clock::now();
  json s = h.status();
  INFO("status: " << s.dump());
  const json& w = s["pools"][0]["workers"][0];
  CHECK(w["start_failures"] == 3);
  CHECK(w["last_exit"] == "exited with status 3 before it was ready");
  REQUIRE(w["next_start_ms"].is_number());
  CHECK(w["next_start_ms"].get<double>() > 100);
  CHECK(w["next_start_ms"].get<double>() <= 300);
  CHECK(s["pools"][0]["status"] == "down");
  CHECK(s["ready"] == false);
  const std::string metrics = h.sup->metrics_text();
  CHECK_MESSAGE(
      metrics.find("gpuq_worker_consecutive_start_failures{pool=\"cpu\",worker=\"0\",last_exit="
                   "\"exited with status 3 before it was ready\"} 3") != std::string::npos,
      metrics);
  CHECK_MESSAGE(metrics.find("gpuq_worker_next_start_seconds{pool=\"cpu\",worker=\"0\"} ") !=
                    std::string::npos,
                metrics);

  // Not before its back-off, but then: a fourth start, and a fifth after another failure.
  REQUIRE(h.step_until([&] { return h.launcher->launches_of(0) == 4; }));
  CHECK(std::chrono::steady_clock::now() - failed_at >= std::chrono::milliseconds(250));
  h.launcher->exit(h.launcher->pid_of(0), 0, /*code=*/3);
  REQUIRE(h.step_until([&] { return h.worker_state(0) == "failed"; }));
  CHECK(h.status()["pools"][0]["workers"][0]["start_failures"] == 4);
  REQUIRE(h.step_until([&] { return h.launcher->launches_of(0) == 5; }));
  h.report_ready(0);
  s = h.status();
  CHECK(s["pools"][0]["workers"][0]["start_failures"] == 0);
  CHECK(s["pools"][0]["workers"][0]["next_start_ms"].is_null());
  CHECK(s["pools"][0]["status"] == "ready");
  CHECK(s["ready"] == true);
  CHECK(h.sup->metrics_text().find("gpuq_worker_consecutive_start_failures{") == std::string::npos);
}

// A pool's workers fail to start (exit 3 before ready, retried after a long back-off): after
// pool_down_fail_ms the pool is down.
Harness failing_pool(uint32_t workers, uint32_t down_ms) {
  return Harness(workers, /*max_start_failures=*/1, [down_ms](Config& c) {
    c.start_backoff_initial_ms = 60000;
    c.start_backoff_max_ms = 60000;
    c.pool_down_fail_ms = down_ms;
  });
}

TEST_CASE(
    "supervisor step: a pool with no ready worker for pool_down_fail_ms fails its queued jobs "
    "with PoolDown, refuses new ones, and takes them again once a worker is ready") {
  Harness h(1, /*max_start_failures=*/1, [](Config& c) {
    c.start_backoff_initial_ms = 400;
    c.start_backoff_max_ms = 400;
    c.pool_down_fail_ms = 150;
  });
  TestClient c(h);
  PoolShm& ps = h.sup->queue().pool(0);
  c.set_job(0, JobState::kSubmitted, -1, /*retryable=*/true);  // retryable changes nothing
  REQUIRE(push_ref(h, c.ref(0)));
  c.set_job(1, JobState::kSubmitted, -1, false);
  REQUIRE(push_ref(h, c.ref(1)));
  c.set_job(2, JobState::kCancelled, -1, false);  // cancelled while queued: its entry is stale
  REQUIRE(push_ref(h, c.ref(2)));

  h.launcher->exit(h.launcher->pid_of(0), 0, /*code=*/3);
  const auto failed_at = std::chrono::steady_clock::now();
  REQUIRE(h.step_until([&] { return c.word(0).state != JobState::kSubmitted; }));
  CHECK(std::chrono::steady_clock::now() - failed_at >= std::chrono::milliseconds(140));
  for (uint32_t s : {0u, 1u}) {
    CAPTURE(s);
    CHECK(c.word(s).state == JobState::kFailed);
    CHECK(c.view.slot(s).outcome.code == static_cast<int32_t>(ErrorCode::kPoolDown));
    const std::string message = c.view.slot(s).message;
    CHECK_MESSAGE(message.find("pool 'cpu' is down (no ready worker for 150 ms): ") == 0, message);
    CHECK_MESSAGE(
        message.find("worker 0 exited with status 3 before it was ready") != std::string::npos,
        message);
  }
  CHECK(c.word(2).state == JobState::kCancelled);  // left as it was
  CHECK(h.sup->queue().queue(0).size() == 0);      // every entry taken out
  // New jobs: the client sees the pool down, and why.
  CHECK(ps.accepting.load() == kPoolDown);
  CHECK(pool_down_reason(ps).find("pool 'cpu' is down (no ready worker for 150 ms): worker 0 "
                                  "exited with status 3 before it was ready") == 0);
  json s = h.status();
  INFO("status: " << s.dump());
  CHECK(s["pools"][0]["failing_jobs"] == true);
  CHECK(s["pools"][0]["accepting"] == false);
  CHECK(s["pools"][0]["failing_jobs_error"].get<std::string>().find("exited with status 3") !=
        std::string::npos);
  CHECK(s["pools"][0]["unserved_ms"].get<double>() >= 140);
  CHECK(h.sup->metrics_text().find("gpuq_pool_down{pool=\"cpu\"} 1") != std::string::npos);

  // A job pushed anyway (by a client that looked just before): failed on a later round.
  c.set_job(3, JobState::kSubmitted, -1, false);
  REQUIRE(push_ref(h, c.ref(3)));
  REQUIRE(h.step_until([&] { return c.word(3).state == JobState::kFailed; }));

  // The worker is started again after its back-off and is ready: the pool takes jobs again.
  REQUIRE(h.step_until([&] { return h.launcher->launches_of(0) == 2; }));
  h.report_ready(0);
  REQUIRE(h.step_until([&] { return ps.accepting.load() == kPoolAccepting; }));
  s = h.status();
  CHECK(s["pools"][0]["failing_jobs"] == false);
  CHECK(s["pools"][0]["failing_jobs_error"].is_null());
  CHECK(s["pools"][0]["unserved_ms"].is_null());
  c.set_job(4, JobState::kSubmitted, -1, false);
  REQUIRE(push_ref(h, c.ref(4)));
  for (int i = 0; i < 10; ++i) REQUIRE(static_cast<bool>(h.sup->step(5)));
  CHECK(c.word(4).state == JobState::kSubmitted);  // queued for the worker, not failed
}

TEST_CASE("supervisor step: pool_down_fail_ms 0 lets a pool's jobs wait however long") {
  Harness h = failing_pool(1, 0);
  TestClient c(h);
  c.set_job(0, JobState::kSubmitted, -1, false);
  REQUIRE(push_ref(h, c.ref(0)));
  h.launcher->exit(h.launcher->pid_of(0), 0, /*code=*/3);
  REQUIRE(h.step_until([&] { return h.worker_state(0) == "failed"; }));
  for (int i = 0; i < 60; ++i) REQUIRE(static_cast<bool>(h.sup->step(5)));
  CHECK(c.word(0).state == JobState::kSubmitted);
  CHECK(h.sup->queue().pool(0).accepting.load() == kPoolAccepting);
  CHECK(h.status()["pools"][0]["failing_jobs"] == false);
}

TEST_CASE("supervisor step: a pool in its first start, or whose workers are busy, is not down") {
  Harness h = failing_pool(2, 50);
  TestClient c(h);
  c.set_job(0, JobState::kSubmitted, -1, false);
  REQUIRE(push_ref(h, c.ref(0)));
  // Neither worker has reported ready or failed: a slow first start.
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
  while (std::chrono::steady_clock::now() < until) REQUIRE(static_cast<bool>(h.sup->step(5)));
  CHECK(c.word(0).state == JobState::kSubmitted);
  CHECK(h.sup->queue().pool(0).accepting.load() == kPoolAccepting);
  CHECK(h.status()["pools"][0]["unserved_ms"].is_null());

  // Both ready, and both busy for longer than pool_down_fail_ms.
  h.report_ready(0);
  h.report_ready(1);
  c.set_job(1, JobState::kRunning, 0, false);
  c.set_job(2, JobState::kRunning, 1, false);
  const auto busy_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
  while (std::chrono::steady_clock::now() < busy_until) {
    REQUIRE(static_cast<bool>(h.sup->step(5)));
  }
  CHECK(c.word(0).state == JobState::kSubmitted);
  CHECK(h.sup->queue().pool(0).accepting.load() == kPoolAccepting);
}

TEST_CASE("supervisor step: a worker that loaded other plug-in ops is stopped") {
  Harness h(1);
  const pid_t first = h.launcher->pid_of(0);
  FakeLauncher::Proc& p = h.launcher->proc(first);
  // A well-formed list that differs from gpuqd's (none): its op ids would mean other ops.
  REQUIRE(send_message(p.control.get(), MessageType::kWorkerReady,
                       R"({"worker":0,"plugin_ops":[[7,"surprise"]]})"));
  REQUIRE(h.step_until([&] { return h.launcher->launches_of(0) == 2; }));
  CHECK(h.launcher->killed() == std::vector<pid_t>{first});
  CHECK(h.worker_state(0) == "starting");  // never "ready"; started again after its back-off
}

TEST_CASE("supervisor step: a stop request drains, stops the workers and ends the loop") {
  Harness h(2);
  h.report_ready(0);
  h.report_ready(1);
  TestClient c(h);
  REQUIRE(send_message(c.fd.get(), MessageType::kStopRequest, "{}"));
  // Idle: the workers are told to stop (WorkerStop on their control sockets).
  for (uint32_t id : {0u, 1u}) {
    FakeLauncher::Proc& p = h.launcher->proc(h.launcher->pid_of(id));
    bool stop = false;
    REQUIRE(h.step_until([&] {
      auto m = receive_message(p.control.get());
      while (m && !stop) {
        stop = m->type == MessageType::kWorkerStop;
        if (!stop) m = receive_message(p.control.get());
      }
      return stop;
    }));
  }
  h.launcher->exit(h.launcher->pid_of(0), 0, 0);
  h.launcher->exit(h.launcher->pid_of(1), 0, 0);
  bool more = true;
  for (int i = 0; i < 100 && more; ++i) {
    auto r = h.sup->step(5);
    REQUIRE(static_cast<bool>(r));
    more = *r;
  }
  CHECK_FALSE(more);
  CHECK(h.worker_state(0) == "stopped");
}

// The metrics text from what a worker wrote on its metrics page (job_metrics.hpp), written here
// as a GPU worker would: job counts by op, and its device memory (which CI, without a GPU,
// cannot get from a real gpuq-gpu-worker; python/tests/test_metrics.py covers the rest with
// real workers).
TEST_CASE("supervisor step: metrics from a worker's page, device memory and unknown op ids") {
  Harness h(1);
  h.report_ready(0);
  FakeLauncher::Proc& p = h.launcher->proc(h.launcher->pid_of(0));
  REQUIRE(p.private_page.valid());
  void* base = ::mmap(nullptr, kWorkerPrivateBytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                      p.private_page.get(), 0);
  REQUIRE(base != MAP_FAILED);
  auto& m = *reinterpret_cast<WorkerMetrics*>(static_cast<char*>(base) + kWorkerMetricsOffset);
  CHECK(m.enabled == 1);
  CHECK(m.bound_ticks[0] > 0);  // 5 us in the daemon's job stamp ticks
  m.device_memory_budget.store(1ull << 30);
  m.device_memory_used.store(3ull << 20);
  uint32_t noop = 0;
  for (const OpInfo& op : op_registry()) {
    if (std::string(op.name) == "noop") noop = op.id;
  }
  m.ops[0].op_id = noop;
  m.ops[0].outcomes[static_cast<uint32_t>(MetricOutcome::kOk)].store(7);
  m.ops[0].outcomes[static_cast<uint32_t>(MetricOutcome::kFailed)].store(2);
  m.ops[0].buckets[0][kRun].store(8);
  m.ops[0].buckets[kMetricBounds][kRun].store(1);  // one past a minute
  m.ops[0].sum_ticks[kRun].store(0);
  m.ops[0].buckets[1][kQueueWait].store(9);
  // Two ids no op has (a scribbled page): one `other` series, not two with the same labels.
  m.ops[1].op_id = 4'000'000;
  m.ops[1].outcomes[0].store(1);
  m.ops[2].op_id = kMetricOtherOp;
  m.ops[2].outcomes[0].store(2);
  m.op_count.store(3);

  const std::string text = h.sup->metrics_text();
  auto has = [&](const std::string& line) {
    INFO(line);
    CHECK(text.find("\n" + line + "\n") != std::string::npos);
  };
  has(R"(gpuq_worker_gpu_memory_budget_bytes{pool="cpu",worker="0",gpu=""} 1073741824)");
  has(R"(gpuq_worker_gpu_memory_used_bytes{pool="cpu",worker="0",gpu=""} 3145728)");
  has(R"(gpuq_jobs_total{pool="cpu",op="noop",outcome="ok"} 7)");
  has(R"(gpuq_jobs_total{pool="cpu",op="noop",outcome="failed"} 2)");
  has(R"(gpuq_job_run_seconds_bucket{pool="cpu",op="noop",le="5e-06"} 8)");
  has(R"(gpuq_job_run_seconds_bucket{pool="cpu",op="noop",le="60"} 8)");
  has(R"(gpuq_job_run_seconds_bucket{pool="cpu",op="noop",le="+Inf"} 9)");
  has(R"(gpuq_job_run_seconds_count{pool="cpu",op="noop"} 9)");
  has(R"(gpuq_job_queue_wait_seconds_bucket{pool="cpu",op="noop",le="5e-06"} 0)");
  has(R"(gpuq_job_queue_wait_seconds_bucket{pool="cpu",op="noop",le="1e-05"} 9)");
  has(R"(gpuq_jobs_total{pool="cpu",op="other",outcome="ok"} 3)");
  size_t others = 0;
  for (size_t at = 0; (at = text.find(R"(op="other",outcome="ok")", at)) != std::string::npos;
       ++at) {
    ++others;
  }
  CHECK(others == 1);
  CHECK(::munmap(base, kWorkerPrivateBytes) == 0);
}

// A batched Python op's histograms (gpuq_batch_rows, gpuq_batch_gather_seconds) from what two
// workers wrote on their metrics pages, summed by pool and op; an op that is batched on the pool
// but has not run yet shows zeros, and an op that is not batched shows none. Last in the file:
// the op it registers stays in this process's registry.
TEST_CASE("supervisor step: batched ops' rows and gather histograms from the workers' pages") {
  const BatchSettings settings{64, 500};
  const auto classify = add_python_op("batch_classify", "a batched op", 0, std::nullopt, settings);
  REQUIRE(classify.ok());
  const auto idle = add_python_op("batch_idle", "batched, never run", 0, std::nullopt, {8, 100});
  REQUIRE(idle.ok());
  const auto single = add_python_op("batch_single", "not batched", 0);
  REQUIRE(single.ok());
  Harness h(2);
  h.report_ready(0);
  h.report_ready(1);
  std::vector<void*> pages;
  std::vector<WorkerMetrics*> metrics;
  for (uint32_t id = 0; id < 2; ++id) {
    FakeLauncher::Proc& p = h.launcher->proc(h.launcher->pid_of(id));
    REQUIRE(p.private_page.valid());
    void* base = ::mmap(nullptr, kWorkerPrivateBytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                        p.private_page.get(), 0);
    REQUIRE(base != MAP_FAILED);
    pages.push_back(base);
    metrics.push_back(
        reinterpret_cast<WorkerMetrics*>(static_cast<char*>(base) + kWorkerMetricsOffset));
  }
  // Worker 0: classify in slot 1 (after a noop in slot 0), calls of 1, 3 and 64 rows; two
  // gatherings, one of exactly the first time bound (5 us), one of 1 ms.
  WorkerMetrics& m0 = *metrics[0];
  CHECK(m0.bound_ticks[0] == 5000);  // job_clock monotonic: a tick is a nanosecond
  for (const OpInfo& op : op_registry()) {
    if (std::string(op.name) == "noop") m0.ops[0].op_id = op.id;
  }
  m0.ops[0].outcomes[0].store(1);
  m0.ops[1].op_id = classify.value();
  m0.ops[1].outcomes[0].store(68);
  observe_batch_call(m0.batch[1], 1);
  observe_batch_call(m0.batch[1], 3);
  observe_batch_call(m0.batch[1], 64);
  observe_gather(m0.batch[1], m0.bound_ticks, m0.bound_ticks[0]);
  observe_gather(m0.batch[1], m0.bound_ticks, m0.bound_ticks[7]);
  m0.ops[2].op_id = single.value();
  m0.ops[2].outcomes[0].store(5);
  m0.op_count.store(3);
  // Worker 1: classify in slot 0, one call of 100 000 rows (past the last bound), one
  // gathering of two minutes (+Inf).
  WorkerMetrics& m1 = *metrics[1];
  m1.ops[0].op_id = classify.value();
  m1.ops[0].outcomes[0].store(100'000);
  observe_batch_call(m1.batch[0], 100'000);
  observe_gather(m1.batch[0], m1.bound_ticks, m1.bound_ticks[kMetricBounds - 1] * 2);
  m1.op_count.store(1);

  const std::string text = h.sup->metrics_text();
  INFO(text);
  auto has = [&](const std::string& line) {
    INFO(line);
    CHECK(text.find("\n" + line + "\n") != std::string::npos);
  };
  const std::string c = R"(pool="cpu",op="batch_classify")";
  has("# TYPE gpuq_batch_rows histogram");
  has("# TYPE gpuq_batch_gather_seconds histogram");
  // Rows: cumulative buckets over both workers.
  has("gpuq_batch_rows_bucket{" + c + R"(,le="1"} 1)");
  has("gpuq_batch_rows_bucket{" + c + R"(,le="2"} 1)");
  has("gpuq_batch_rows_bucket{" + c + R"(,le="4"} 2)");
  has("gpuq_batch_rows_bucket{" + c + R"(,le="32"} 2)");
  has("gpuq_batch_rows_bucket{" + c + R"(,le="64"} 3)");
  has("gpuq_batch_rows_bucket{" + c + R"(,le="65536"} 3)");
  has("gpuq_batch_rows_bucket{" + c + R"(,le="+Inf"} 4)");
  has("gpuq_batch_rows_sum{" + c + "} 100068");
  has("gpuq_batch_rows_count{" + c + "} 4");
  // Gathering: 5 us, 1 ms and two minutes; the sum in seconds (job_clock monotonic: 1 ns a
  // tick).
  has("gpuq_batch_gather_seconds_bucket{" + c + R"(,le="5e-06"} 1)");
  has("gpuq_batch_gather_seconds_bucket{" + c + R"(,le="0.0005"} 1)");
  has("gpuq_batch_gather_seconds_bucket{" + c + R"(,le="0.001"} 2)");
  has("gpuq_batch_gather_seconds_bucket{" + c + R"(,le="60"} 2)");
  has("gpuq_batch_gather_seconds_bucket{" + c + R"(,le="+Inf"} 3)");
  has("gpuq_batch_gather_seconds_sum{" + c + "} 120.001005");
  has("gpuq_batch_gather_seconds_count{" + c + "} 3");
  // Batched on the pool but not run yet: all zero.
  const std::string i = R"(pool="cpu",op="batch_idle")";
  has("gpuq_batch_rows_bucket{" + i + R"(,le="+Inf"} 0)");
  has("gpuq_batch_rows_sum{" + i + "} 0");
  has("gpuq_batch_rows_count{" + i + "} 0");
  has("gpuq_batch_gather_seconds_count{" + i + "} 0");
  // Not batched: its jobs count, but no batch series (nor for the built-in noop).
  has(R"(gpuq_jobs_total{pool="cpu",op="batch_single",outcome="ok"} 5)");
  CHECK(text.find(R"(gpuq_batch_rows_count{pool="cpu",op="batch_single"})") == std::string::npos);
  CHECK(text.find(R"(gpuq_batch_rows_count{pool="cpu",op="noop"})") == std::string::npos);
  // One series per pool and op, however many workers have it.
  size_t series = 0;
  for (size_t at = 0; (at = text.find("gpuq_batch_rows_count{" + c, at)) != std::string::npos;
       ++at) {
    ++series;
  }
  CHECK(series == 1);
  for (void* base : pages) CHECK(::munmap(base, kWorkerPrivateBytes) == 0);
}

// ---- Spare workers (spare_pool.hpp) -----------------------------------------------------------

// The newest process of worker `id`'s private page (WorkerPrivate), mapped for the test.
struct PrivatePage {
  void* base = MAP_FAILED;
  PrivatePage(Harness& h, uint32_t id) {
    FakeLauncher::Proc& p = h.launcher->proc(h.launcher->pid_of(id));
    REQUIRE(p.private_page.valid());
    base = ::mmap(nullptr, kWorkerPrivateBytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                  p.private_page.get(), 0);
    REQUIRE(base != MAP_FAILED);
  }
  ~PrivatePage() {
    if (base != MAP_FAILED) ::munmap(base, kWorkerPrivateBytes);
  }
  uint32_t hold() const { return static_cast<WorkerPrivate*>(base)->hold.load(); }
};

// Reads worker `id`'s control socket (as the worker would) until a message of `type` came.
bool got_message(Harness& h, uint32_t id, MessageType type) {
  FakeLauncher::Proc& p = h.launcher->proc(h.launcher->pid_of(id));
  bool found = false;
  return h.step_until([&] {
    for (auto m = receive_message(p.control.get()); m && !found;
         m = receive_message(p.control.get())) {
      found = m->type == type;
    }
    return found;
  });
}

void with_spare(Config& c) {
  c.pools[0].cpus = {0, 1};
  c.pools[0].spare_workers = 1;
}

TEST_CASE(
    "supervisor step: a spare is held from its start, and takes a dead worker's place with its "
    "CPUs; the dead entry comes back as the spare") {
  Harness h(2, 5, with_spare);
  REQUIRE(h.sup->queue().layout().pools[0].worker_count == 3);
  CHECK(h.sup->queue().layout().pools[0].capacity == 20);  // queue_factor x 2 active
  CHECK(PrivatePage(h, 2).hold() == kHoldSpare);           // before it could take a job
  CHECK(PrivatePage(h, 0).hold() == 0);
  h.report_ready(0);
  h.report_ready(1);
  h.report_ready(2);
  json pool = h.status()["pools"][0];
  CHECK(pool["workers_total"] == 2);
  CHECK(pool["workers_ready"] == 2);
  CHECK(pool["spares_total"] == 1);
  CHECK(pool["spares_ready"] == 1);
  CHECK(pool["status"] == "ready");
  CHECK(h.worker(2)["role"] == "spare");
  CHECK(h.worker(2)["cpus"] == json::array({0}));  // round robin after the active workers
  TestClient c(h);

  // Worker 1 (cpu 1) dies running a retryable job: the spare takes its place at once.
  c.set_job(0, JobState::kRunning, 1, /*retryable=*/true);
  const pid_t spare_pid = h.launcher->pid_of(2);
  h.launcher->exit(h.launcher->pid_of(1), SIGKILL);
  REQUIRE(h.step_until([&] { return h.worker(2)["role"] == "active"; }));
  CHECK(PrivatePage(h, 2).hold() == 0);
  CHECK(got_message(h, 2, MessageType::kWorkerPromote));
  REQUIRE(h.launcher->pinned().size() == 1);
  CHECK(h.launcher->pinned()[0].first == spare_pid);
  CHECK(h.launcher->pinned()[0].second == std::vector<int>{1});
  CHECK(h.worker(2)["cpus"] == json::array({1}));
  CHECK(h.sup->queue().worker(2).cpu == 1);  // what wake_worker prefers by
  CHECK(h.worker(2)["state"] == "ready");
  CHECK(h.worker(2)["pid"] == spare_pid);  // the same process: no start
  // The job is retried as before, and the pool serves with both places taken.
  REQUIRE(h.step_until([&] { return c.word(0).state == JobState::kSubmitted; }));
  CHECK(ring_holds(h, c.ref(0)));
  pool = h.status()["pools"][0];
  CHECK(pool["workers_ready"] == 2);
  CHECK(pool["spare_promotions"] == 1);
  CHECK(pool["status"] == "ready");
  // Worker 1's entry is the spare now, started again on the spare's old CPU, held.
  REQUIRE(h.step_until([&] { return h.launcher->launches_of(1) == 2; }));
  CHECK(h.worker(1)["role"] == "spare");
  CHECK(h.worker(1)["cpus"] == json::array({0}));
  CHECK(PrivatePage(h, 1).hold() == kHoldSpare);
  CHECK(h.sup->queue().worker(1).cpu == 0);
  h.report_ready(1);
  CHECK(h.status()["pools"][0]["spares_ready"] == 1);
  CHECK(h.sup->metrics_text().find("gpuq_spare_promotions_total{pool=\"cpu\"} 1") !=
        std::string::npos);
  CHECK(h.sup->metrics_text().find("gpuq_workers{pool=\"cpu\",state=\"spare\"} 1") !=
        std::string::npos);

  // The spare's own death promotes nothing: it comes back as a spare.
  h.launcher->exit(h.launcher->pid_of(1), SIGKILL);
  REQUIRE(h.step_until([&] { return h.launcher->launches_of(1) == 3; }));
  CHECK(h.worker(1)["role"] == "spare");
  CHECK(h.status()["pools"][0]["spare_promotions"] == 1);
  CHECK(h.status()["pools"][0]["workers_ready"] == 2);
}

TEST_CASE(
    "supervisor step: a spare that becomes ready takes the place of a worker waiting out its "
    "back-off; only active workers count as ready") {
  Harness h(2, 5, [](Config& c) {
    with_spare(c);
    c.restart_backoff_initial_ms = 60000;  // the dead worker waits: the spare must not
    c.restart_backoff_max_ms = 60000;
  });
  h.report_ready(0);
  h.report_ready(1);
  // Worker 0 dies while the spare is still starting: no promotion, it waits its back-off.
  h.launcher->exit(h.launcher->pid_of(0), SIGKILL);
  REQUIRE(h.step_until([&] { return h.worker_state(0) == "restarting"; }));
  CHECK(h.worker(0)["role"] == "active");
  json pool = h.status()["pools"][0];
  CHECK(pool["workers_ready"] == 1);
  CHECK(pool["status"] == "degraded");
  // The spare is ready: it takes worker 0's place, which waits on as the spare.
  h.report_ready(2);
  CHECK(h.worker(2)["role"] == "active");
  CHECK(h.worker(0)["role"] == "spare");
  CHECK(h.worker_state(0) == "restarting");
  CHECK(got_message(h, 2, MessageType::kWorkerPromote));
  pool = h.status()["pools"][0];
  CHECK(pool["workers_ready"] == 2);
  CHECK(pool["spares_ready"] == 0);
  CHECK(pool["status"] == "ready");
  CHECK(pool["spare_promotions"] == 1);
}

TEST_CASE(
    "supervisor step: a worker stopped for a job that did not end gives its place to the spare "
    "as it is killed, before its exit") {
  Harness h(1, 5, [](Config& c) {
    c.pools[0].cpus = {0, 1};  // worker 0 on cpu 0, the spare on cpu 1
    c.pools[0].spare_workers = 1;
    c.pools[0].job_time_limit_ms = 1;
    c.cancel_grace_ms = 0;
  });
  h.report_ready(0);
  h.report_ready(1);
  TestClient c(h);
  // Worker 0 runs job 0 of the client (its slot, and its private page, say so).
  c.set_job(0, JobState::kRunning, 0, false);
  const PrivatePage page(h, 0);
  auto& priv = *static_cast<WorkerPrivate*>(page.base);
  priv.job.store(c.ref(0));
  priv.session.store(c.session);
  priv.job_started.store(read_stamp(StampClock::kMonotonic));
  priv.job_seq.store(1);
  h.launcher->hold_kills = true;  // it takes its time to die
  const pid_t stopped = h.launcher->pid_of(0);
  REQUIRE(h.step_until([&] { return !h.launcher->killed().empty(); }));
  CHECK(h.launcher->killed() == std::vector<pid_t>{stopped});
  CHECK(priv.hold.load() == kHoldStop);
  // The spare serves already, while the stopped process is not reaped yet; the stopped one
  // counts as no ready spare.
  CHECK(h.worker(1)["role"] == "active");
  CHECK(h.worker(0)["role"] == "spare");
  CHECK(got_message(h, 1, MessageType::kWorkerPromote));
  // Until the stopped process is gone, the spare may run on any CPU of the pool: the kernel
  // tears the stopped one down on cpu 0.
  const pid_t spare_pid = h.launcher->pid_of(1);
  REQUIRE(h.launcher->pinned().size() == 1);
  CHECK(h.launcher->pinned()[0] == std::pair{spare_pid, std::vector<int>{0, 1}});
  CHECK(h.worker(1)["cpus"] == json::array({0}));
  json pool = h.status()["pools"][0];
  CHECK(pool["workers_ready"] == 1);
  CHECK(pool["spares_ready"] == 0);
  CHECK(pool["spare_promotions"] == 1);
  CHECK(c.word(0).state == JobState::kRunning);  // its end is written at the reap
  // The exit: the job ends TimedOut, and the entry is started again at once, as a spare.
  h.launcher->exit(stopped, SIGKILL);
  REQUIRE(h.step_until([&] { return h.launcher->launches_of(0) == 2; }));
  CHECK(c.word(0).state == JobState::kFailed);
  CHECK(c.view.slot(0).outcome.code == static_cast<int32_t>(ErrorCode::kTimedOut));
  REQUIRE(h.launcher->pinned().size() == 2);  // and now on the stopped worker's CPU
  CHECK(h.launcher->pinned()[1] == std::pair{spare_pid, std::vector<int>{0}});
  CHECK(PrivatePage(h, 0).hold() == kHoldSpare);
  h.report_ready(0);
  pool = h.status()["pools"][0];
  CHECK(pool["spare_promotions"] == 1);  // the reap promoted nothing more
  CHECK(pool["spares_ready"] == 1);
  CHECK(pool["workers_ready"] == 1);
  CHECK(pool["stops_forced"] == 1);
}

TEST_CASE("supervisor step: a drain stops the spares too, and promotes nothing") {
  Harness h(1, 5, [](Config& c) { c.pools[0].spare_workers = 1; });
  h.report_ready(0);
  h.report_ready(1);
  TestClient c(h);
  REQUIRE(send_message(c.fd.get(), MessageType::kStopRequest, "{}"));
  CHECK(got_message(h, 1, MessageType::kWorkerStop));
  h.launcher->exit(h.launcher->pid_of(0), 0, 0);
  h.launcher->exit(h.launcher->pid_of(1), 0, 0);
  bool more = true;
  for (int i = 0; i < 100 && more; ++i) {
    auto r = h.sup->step(5);
    REQUIRE(static_cast<bool>(r));
    more = *r;
  }
  CHECK_FALSE(more);
  CHECK(h.worker(1)["role"] == "spare");
  CHECK(h.status()["pools"][0]["spare_promotions"] == 0);
}

}  // namespace
}  // namespace gpuq::daemon
