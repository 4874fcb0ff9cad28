// StepRunner (daemon/worker/step_runner.hpp): a step op's sequences in a worker, on real parts
// (support/worker_rig.hpp: a pool's lanes, a client segment in a memfd with real slots,
// descriptors and stream cells, the worker's pages), ops in the real registry. Only the backend
// is the test's: a job's input is its tag, a sequence of tag % 100 steps whose part i is
// tag * 100 + i (the Python backend's, which calls the pool's step function, runs in
// python/tests/test_steps.py). It records each step's sequences and what the worker's private
// page said meanwhile, and can fail a start or a step. Each case does first what the worker loop
// does before it hands a step op's job over (worker_loop.cpp, handle_one).
#include "step_runner.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "support/worker_rig.hpp"

namespace gpuq::daemon {
namespace {

using namespace test_rig;

uint32_t step_op(const char* name) {
  auto id = add_python_op(name, "", kPool, std::nullopt, BatchSettings{8, 0, true});
  REQUIRE(id);
  return *id;
}
uint32_t op_s() {
  static const uint32_t id = step_op("step_runner_test_s");
  return id;
}
uint32_t op_t() {
  static const uint32_t id = step_op("step_runner_test_t");
  return id;
}

class StepBackend : public OpBackend {
 public:
  struct Step {
    std::vector<uint64_t> tags;  // its sequences', in the order they were given
    uint32_t batch_jobs = 0;     // the private page during the step
    uint64_t job_seq = 0;
  };

  explicit StepBackend(const WorkerPrivate& priv) : priv_(priv) {}

  Result<OpOutput> run(const OpInfo&, const OpContext&) override {
    return Error(ErrorCode::kInternal, "a step op's job ran alone");
  }

  Result<void> step_start(const OpInfo&, const OpContext& ctx, uint64_t key) override {
    uint64_t tag = 0;
    std::memcpy(&tag, ctx.input, sizeof tag);
    if (tag == fail_start_tag) {
      const char record[] = "start failed";
      std::memcpy(ctx.output, record, sizeof record);
      ctx.failure_output_bytes = sizeof record;
      return Error(ErrorCode::kOpFailed, "start raised");
    }
    states[key] = State{tag, {}};
    return {};
  }

  void step(const OpInfo&, std::span<const StepJob> jobs,
            std::vector<Result<StepOutput>>& results) override {
    Step st;
    st.batch_jobs = priv_.batch_jobs.load();
    st.job_seq = priv_.job_seq.load();
    for (const StepJob& j : jobs) st.tags.push_back(states.at(j.key).tag);
    steps.push_back(st);
    if (during_step) during_step(steps.size() - 1);
    for (const StepJob& j : jobs) {
      State& s = states.at(j.key);
      const uint64_t part = s.tag * 100 + s.parts.size();
      s.parts.push_back(part);
      if (s.tag == fail_tag && s.parts.size() == 2) {
        j.ctx->failure_output_bytes = 3;
        results.push_back(Error(ErrorCode::kOpFailed, "the step raised"));
        continue;
      }
      const bool done = s.parts.size() == s.tag % 100;
      if (j.streams) {
        std::memcpy(j.cell.data(), &part, sizeof part);
        results.emplace_back(StepOutput{sizeof part, done});
      } else if (done) {
        const uint64_t bytes = s.parts.size() * sizeof(uint64_t);
        REQUIRE(bytes <= j.cell.size());
        std::memcpy(j.cell.data(), s.parts.data(), bytes);
        results.emplace_back(StepOutput{bytes, true});
      } else {
        results.emplace_back(StepOutput{0, false});
      }
    }
  }

  void step_end(const OpInfo&, uint64_t key) override {
    ended_keys.push_back(key);
    states.erase(key);
  }

  struct State {
    uint64_t tag = 0;
    std::vector<uint64_t> parts;
  };
  std::map<uint64_t, State> states;  // the live sequences' (step_end drops them)
  std::vector<Step> steps;
  std::vector<uint64_t> ended_keys;
  std::function<void(size_t step)> during_step;  // what happens elsewhere while step N runs
  uint64_t fail_start_tag = UINT64_MAX;
  uint64_t fail_tag = UINT64_MAX;  // its sequence's second step fails

 private:
  const WorkerPrivate& priv_;
};

struct Rig : WorkerRig {
  explicit Rig(uint32_t pool_limit_ms = 0)
      : WorkerRig(op_s(), pool_limit_ms), runner(std::make_unique<StepRunner>(parts(backend))) {}

  std::optional<uint32_t> run(BatchSettings settings = {8, 0, true}) {
    return runner->run(first(), settings);
  }
  // Queues a job that answers once with its parts: room for all of them.
  uint32_t queue_call(uint32_t s, uint64_t tag, JobShape shape = {}) {
    shape.output_capacity = kMaxOutput;
    return queue(s, tag, shape);
  }
  std::vector<uint64_t> parts_of(uint32_t s) const {
    std::vector<uint64_t> v(slot(s).outcome.output_bytes / sizeof(uint64_t));
    std::memcpy(v.data(), output_at(s), v.size() * sizeof(uint64_t));
    return v;
  }
  const OpBatchMetrics& batch_metrics() { return metrics.batch(op_s()); }

  StepBackend backend{*priv};
  std::unique_ptr<StepRunner> runner;
};

std::vector<uint64_t> tags(std::initializer_list<uint64_t> t) {
  return t;
}

TEST_CASE("StepRunner: one call per step for every live sequence; each ends when it says so") {
  Rig rig;
  rig.queue_call(0, 1);  // one step
  rig.queue_call(1, 3);
  rig.queue_call(2, 2);
  rig.queue_call(3, 5);
  CHECK_FALSE(rig.run());
  REQUIRE(rig.backend.steps.size() == 5);
  CHECK(rig.backend.steps[0].tags == tags({1, 3, 2, 5}));
  CHECK(rig.backend.steps[1].tags == tags({3, 2, 5}));
  CHECK(rig.backend.steps[2].tags == tags({3, 5}));
  CHECK(rig.backend.steps[3].tags == tags({5}));
  CHECK(rig.backend.steps[4].tags == tags({5}));
  for (uint32_t s = 0; s < 4; ++s) {
    CAPTURE(s);
    CHECK(rig.word(s).state == JobState::kDone);
    CHECK(rig.slot(s).outcome.code == 0);
  }
  CHECK(rig.parts_of(0) == tags({100}));
  CHECK(rig.parts_of(1) == tags({300, 301, 302}));
  CHECK(rig.parts_of(3) == tags({500, 501, 502, 503, 504}));
  // The page said how many jobs each step served, with an odd job_seq; now none, and one.
  CHECK(rig.backend.steps[0].batch_jobs == 4);
  CHECK(rig.backend.steps[3].batch_jobs == 1);
  CHECK(rig.backend.steps[0].job_seq % 2 == 1);
  CHECK(rig.priv->job_seq.load() % 2 == 0);
  CHECK(rig.priv->batch_jobs.load() == 1);
  CHECK(rig.self->busy.load() == 0);
  CHECK(rig.self->jobs_done.load() == 4);
  CHECK(rig.backend.states.empty());  // every state forgotten
  CHECK(rig.backend.ended_keys.size() == 4);
  CHECK(rig.batch_metrics().calls.load() == 5);
  CHECK(rig.batch_metrics().rows_sum.load() == 11);
}

TEST_CASE("StepRunner: a job queued during a step joins at the next one") {
  Rig rig;
  rig.queue_call(0, 4);
  rig.backend.during_step = [&](size_t step) {
    if (step == 1) rig.queue_call(1, 2);
  };
  CHECK_FALSE(rig.run());
  REQUIRE(rig.backend.steps.size() == 4);
  CHECK(rig.backend.steps[1].tags == tags({4}));
  CHECK(rig.backend.steps[2].tags == tags({4, 2}));
  CHECK(rig.backend.steps[3].tags == tags({4, 2}));
  CHECK(rig.parts_of(1) == tags({200, 201}));
}

TEST_CASE("StepRunner: at most max_batch_size live sequences; a queued one joins as one ends") {
  Rig rig;
  rig.queue_call(0, 1);
  rig.queue_call(1, 3);
  rig.queue_call(2, 2);
  CHECK_FALSE(rig.run(BatchSettings{2, 0, true}));
  REQUIRE(rig.backend.steps.size() == 3);
  CHECK(rig.backend.steps[0].tags == tags({1, 3}));
  CHECK(rig.backend.steps[1].tags == tags({3, 2}));
  CHECK(rig.backend.steps[2].tags == tags({3, 2}));
  CHECK(rig.word(2).state == JobState::kDone);
}

TEST_CASE("StepRunner: another op's job at the head stays queued; a hold admits none") {
  SUBCASE("another op") {
    Rig rig;
    rig.queue_call(0, 2);
    rig.queue_call(1, 2, JobShape{.op_id = op_t()});
    rig.queue_call(2, 2);
    CHECK_FALSE(rig.run());
    CHECK(rig.backend.steps[0].tags == tags({2}));
    CHECK(rig.word(1).state == JobState::kSubmitted);
    CHECK(rig.word(2).state == JobState::kSubmitted);
    CHECK(rig.pool_queue.size() == 2);
  }
  SUBCASE("hold") {
    Rig rig;
    rig.queue_call(0, 2);
    rig.queue_call(1, 2);
    rig.priv->hold.store(1);
    CHECK_FALSE(rig.run());
    CHECK(rig.backend.steps.size() == 2);
    CHECK(rig.word(1).state == JobState::kSubmitted);
  }
}

TEST_CASE("StepRunner: a cancelled sequence leaves at the next step; the others go on") {
  Rig rig;
  rig.queue_call(0, 4);
  rig.queue_call(1, 4);
  rig.backend.during_step = [&](size_t step) {
    if (step == 1) rig.slot(1).cancel_requested.fetch_or(kCancelByClient);
  };
  CHECK_FALSE(rig.run());
  REQUIRE(rig.backend.steps.size() == 4);
  CHECK(rig.backend.steps[1].tags == tags({4, 4}));
  CHECK(rig.backend.steps[2].tags == tags({4}));
  CHECK(rig.word(1).state == JobState::kCancelled);
  CHECK(rig.slot(1).outcome.code == static_cast<int32_t>(ErrorCode::kCancelled));
  CHECK(rig.word(0).state == JobState::kDone);
  CHECK(rig.parts_of(0) == tags({400, 401, 402, 403}));
  CHECK(rig.backend.states.empty());
}

TEST_CASE("StepRunner: the sequences of a client that left end at the next step") {
  Rig rig;
  rig.queue_call(0, 50);
  rig.queue(1, 50, JobShape{.output_capacity = 128, .stream_window = 2});
  rig.backend.during_step = [&](size_t step) {
    if (step == 1) rig.records[kClient].session.store(0);  // the supervisor saw it go
  };
  CHECK_FALSE(rig.run());
  CHECK(rig.backend.steps.size() == 2);
  for (uint32_t s = 0; s < 2; ++s) {
    CAPTURE(s);
    CHECK(rig.word(s).state == JobState::kCancelled);
    CHECK(rig.message(s).find("its client left") != std::string::npos);
  }
  CHECK(rig.backend.states.empty());
}

TEST_CASE("StepRunner: a sequence past its own time limit ends TimedOut; the others go on") {
  Rig rig;
  rig.queue_call(0, 6);
  rig.queue_call(1, 6, JobShape{.own_limit_ms = 5});
  rig.backend.during_step = [&](size_t step) {
    if (step == 1) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  };
  CHECK_FALSE(rig.run());
  CHECK(rig.backend.steps[2].tags == tags({6}));
  CHECK(rig.word(1).state == JobState::kFailed);
  CHECK(rig.slot(1).outcome.code == static_cast<int32_t>(ErrorCode::kTimedOut));
  CHECK(rig.message(1).find("time limit (5 ms)") != std::string::npos);
  CHECK(rig.word(0).state == JobState::kDone);
  CHECK(rig.parts_of(0).size() == 6);
}

TEST_CASE("StepRunner: a failed start or step fails its own sequence only, with its record") {
  Rig rig;
  rig.backend.fail_start_tag = 3;
  rig.backend.fail_tag = 4;
  rig.queue_call(0, 3);
  rig.queue_call(1, 4);
  rig.queue_call(2, 5);
  CHECK_FALSE(rig.run());
  CHECK(rig.word(0).state == JobState::kFailed);
  CHECK(rig.message(0) == "start raised");
  CHECK(rig.slot(0).outcome.output_bytes == 13);  // its record
  CHECK(rig.word(1).state == JobState::kFailed);
  CHECK(rig.message(1) == "the step raised");
  CHECK(rig.slot(1).outcome.output_bytes == 3);
  CHECK(rig.backend.steps[0].tags == tags({4, 5}));
  CHECK(rig.backend.steps[2].tags == tags({5}));
  CHECK(rig.word(2).state == JobState::kDone);
  CHECK(rig.self->jobs_failed.load() == 2);
  CHECK(rig.self->jobs_done.load() == 1);
  CHECK(rig.backend.states.empty());
}

TEST_CASE(
    "StepRunner: a stream's parts are published at each step; a slow reader pauses only "
    "its own sequence") {
  Rig rig;
  // Two cells of 64 bytes: two parts may wait unread.
  rig.queue(0, 5, JobShape{.output_capacity = 128, .stream_window = 2});
  rig.queue_call(1, 6);
  JobStream& st = rig.slot(0).stream;
  std::vector<uint64_t> read;
  rig.backend.during_step = [&](size_t step) {
    // The reader reads what is published, but only from step 3 on.
    if (step < 3) return;
    const uint32_t written = st.written.load();
    for (uint32_t i = st.read.load(); i < written; ++i) {
      uint64_t v = 0;
      std::memcpy(&v, rig.output_at(0) + (i % 2) * 64, sizeof v);
      CHECK(st.part_bytes[i % 2] == 8);
      read.push_back(v);
    }
    st.read.store(written);
  };
  CHECK_FALSE(rig.run());
  // Steps 0 and 1 made its two parts; step 2 went on without it (both cells unread).
  CHECK(rig.backend.steps[1].tags == tags({5, 6}));
  CHECK(rig.backend.steps[2].tags == tags({6}));
  CHECK(rig.backend.steps[3].tags == tags({6}));  // read during this step: back at the next
  CHECK(rig.backend.steps[4].tags == tags({5, 6}));
  CHECK(rig.word(0).state == JobState::kDone);
  CHECK(rig.slot(0).outcome.value == 5);  // its parts
  CHECK(st.written.load() == 5);
  CHECK(rig.word(1).state == JobState::kDone);
  CHECK(rig.parts_of(1).size() == 6);
  // What it read during the steps, in order (the last parts after them).
  REQUIRE(read.size() >= 2);
  for (size_t i = 0; i < read.size(); ++i) CHECK(read[i] == 500 + i);
}

TEST_CASE("StepRunner: the page never names an ended job while others live") {
  Rig rig;
  rig.queue_call(0, 1);  // ends after the first step
  rig.queue(1, 50, JobShape{.output_capacity = 64, .stream_window = 1});
  rig.options.stream_reader_timeout_ms = 20;
  const uint32_t ended_ref = JobRef{kClient, 0, rig.generations[0]}.pack();
  bool named_ended = false;
  std::thread look([&] {
    // While the stream waits for its reader (about 20 ms), the page must not go on naming job
    // 0 once it has ended (the runner republishes right after the ends it writes).
    const auto never = std::chrono::steady_clock::time_point::max();
    auto ended_at = never;
    for (int i = 0; i < 200; ++i) {
      const auto now = std::chrono::steady_clock::now();
      if (rig.word(0).state == JobState::kDone && ended_at == never) ended_at = now;
      if (rig.priv->job_seq.load() % 2 == 1 && rig.priv->job.load() == ended_ref &&
          now - ended_at > std::chrono::milliseconds(3)) {
        named_ended = true;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  });
  CHECK_FALSE(rig.run());
  look.join();
  CHECK_FALSE(named_ended);
  CHECK(rig.word(0).state == JobState::kDone);
  CHECK(rig.word(1).state == JobState::kCancelled);
}

TEST_CASE("StepRunner: a stream whose reader reads nothing stops at the reader's timeout") {
  Rig rig;
  rig.options.stream_reader_timeout_ms = 20;
  rig.queue(0, 50, JobShape{.output_capacity = 64, .stream_window = 1});
  rig.queue_call(1, 3);
  const auto began = std::chrono::steady_clock::now();
  CHECK_FALSE(rig.run());
  CHECK(std::chrono::steady_clock::now() - began >= std::chrono::milliseconds(20));
  CHECK(rig.word(1).state == JobState::kDone);
  CHECK(rig.word(0).state == JobState::kCancelled);
  CHECK(rig.message(0).find("read no part for 20 ms") != std::string::npos);
  CHECK(rig.slot(0).stream.written.load() == 1);
  CHECK(rig.backend.states.empty());
}

}  // namespace
}  // namespace gpuq::daemon
