// BatchRunner (daemon/worker/batch_runner.hpp): a batched op's jobs in a worker, on real parts
// (support/worker_rig.hpp: a pool's lanes, a client segment in a memfd with real slots and
// descriptors, the worker's pages), ops in the real registry. Only the backend is
// the test's: its run_batch does arithmetic on the jobs' inputs (the Python backend's, which
// calls the pool's function, runs in python/tests/test_batching.py), records what the worker's
// private page said during each call, and can end a call's jobs Cancelled, as a call stopped
// at a time limit does. Each case does first what the worker loop does before it hands a
// batched op's job over (worker_loop.cpp, handle_one): pop, claim, copy, check, publish.
#include "batch_runner.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gpuq/common/clock.hpp"
#include "gpuq/common/params.hpp"
#include "gpuq/common/shm.hpp"
#include "support/worker_rig.hpp"

namespace gpuq::daemon {
namespace {

using namespace test_rig;

// Two batched Python ops of pool 0 (the registry is this process's; the settings a batch
// runs with are run()'s argument, as the loop passes them).
uint32_t python_op(const char* name) {
  auto id = add_python_op(name, "", kPool, std::nullopt, BatchSettings{8, 0});
  REQUIRE(id);
  return *id;
}
uint32_t op_a() {
  static const uint32_t id = python_op("batch_runner_test_a");
  return id;
}
uint32_t op_b() {
  static const uint32_t id = python_op("batch_runner_test_b");
  return id;
}

// Each job's input is one uint64_t tag; the backend writes the tag doubled to its output.
class TestBackend : public OpBackend {
 public:
  struct Call {
    std::vector<uint64_t> tags;
    uint32_t published_job = 0;  // the private page during the call
    uint32_t batch_jobs = 0;
    uint64_t job_seq = 0;
  };

  explicit TestBackend(const WorkerPrivate& priv) : priv_(priv) {}

  Result<OpOutput> run(const OpInfo&, const OpContext& ctx) override { return answer(ctx, 1); }

  void run_batch(const OpInfo&, std::span<const OpContext* const> jobs,
                 std::vector<Result<OpOutput>>& results,
                 std::vector<uint32_t>& call_rows) override {
    Call call;
    call.published_job = priv_.job.load();
    call.batch_jobs = priv_.batch_jobs.load();
    call.job_seq = priv_.job_seq.load();
    for (const OpContext* ctx : jobs) call.tags.push_back(tag_of(*ctx));
    calls.push_back(call);
    if (during_call) during_call(calls.size() - 1);
    const size_t answered = jobs.size() - std::min(jobs.size(), lose_results);
    for (size_t i = 0; i < answered; ++i) {
      const OpContext& ctx = *jobs[i];
      if (stop_call && stop_call(calls.size() - 1)) {
        results.push_back(Error(ErrorCode::kCancelled, "stopped"));
      } else if (fail_tag == tag_of(ctx)) {
        ctx.failure_output_bytes = 5;
        results.push_back(Error(ErrorCode::kOpFailed, "the op raised"));
      } else {
        results.push_back(answer(ctx, jobs.size()));
      }
    }
    call_rows.push_back(static_cast<uint32_t>(jobs.size()));
  }

  static uint64_t tag_of(const OpContext& ctx) {
    uint64_t tag = 0;
    std::memcpy(&tag, ctx.input, sizeof tag);
    return tag;
  }

  std::vector<Call> calls;
  std::function<void(size_t call)> during_call;  // what happens elsewhere while call N runs
  std::function<bool(size_t call)> stop_call;    // call N ends its jobs Cancelled
  uint64_t fail_tag = UINT64_MAX;                // the job the op fails
  size_t lose_results = 0;                       // results the backend leaves out, from the end

 private:
  static Result<OpOutput> answer(const OpContext& ctx, size_t jobs) {
    const uint64_t doubled = tag_of(ctx) * 2;
    std::memcpy(ctx.output, &doubled, sizeof doubled);
    return OpOutput{sizeof doubled, jobs};
  }

  const WorkerPrivate& priv_;
};

// The worker's parts, a client and a runner over them.
struct Rig : WorkerRig {
  explicit Rig(uint32_t pool_limit_ms = 0)
      : WorkerRig(op_a(), pool_limit_ms), runner(std::make_unique<BatchRunner>(parts(backend))) {}

  // The loop's call: the first queued job and its batch.
  std::optional<uint32_t> run(BatchSettings settings = {8, 0}) {
    return runner->run(first(), settings);
  }

  // The ops counts of op_a() on the metrics page.
  const OpMetrics& op_metrics() { return metrics_page->ops[metrics.slot(op_a())]; }
  const OpBatchMetrics& batch_metrics() { return metrics.batch(op_a()); }

  TestBackend backend{*priv};
  std::unique_ptr<BatchRunner> runner;
};

TEST_CASE("BatchRunner: the op's queued jobs join one call, and each job ends on its own") {
  Rig rig;
  for (uint32_t s = 0; s < 4; ++s) rig.queue(s, 10 + s);
  CHECK_FALSE(rig.run());
  REQUIRE(rig.backend.calls.size() == 1);
  CHECK(rig.backend.calls[0].tags == std::vector<uint64_t>{10, 11, 12, 13});
  for (uint32_t s = 0; s < 4; ++s) {
    CAPTURE(s);
    CHECK(rig.word(s).state == JobState::kDone);
    CHECK(rig.word(s).worker_plus_one == kWorker + 1);
    CHECK(rig.output(s) == (10 + s) * 2);
    const JobOutcome& out = rig.slot(s).outcome;
    CHECK(out.code == 0);
    CHECK(out.worker_id == kWorker);
    CHECK(out.output_bytes == 8);
    CHECK(out.value == 4);  // the jobs of its call
    CHECK(out.started_stamp != 0);
    CHECK(out.finished_stamp >= out.started_stamp);
  }
  CHECK(rig.pool_queue.size() == 0);
  CHECK(rig.self->jobs_done.load() == 4);
  CHECK(rig.self->jobs_failed.load() == 0);
  CHECK(rig.self->busy.load() == 0);
  // While the call ran the page said so; afterwards it names no job, and no batch.
  CHECK(rig.backend.calls[0].batch_jobs == 4);
  CHECK(rig.backend.calls[0].job_seq % 2 == 1);
  CHECK(rig.priv->job_seq.load() % 2 == 0);
  CHECK(rig.priv->job_seq.load() == rig.job_seq);
  CHECK(rig.priv->batch_jobs.load() == 1);
  CHECK(rig.went_on == rig.slot(3).outcome.finished_stamp);
  CHECK(rig.op_metrics().outcomes[static_cast<uint32_t>(MetricOutcome::kOk)].load() == 4);
  CHECK(rig.batch_metrics().calls.load() == 1);
  CHECK(rig.batch_metrics().rows_sum.load() == 4);
  CHECK(rig.batch_metrics().gathers.load() == 1);
  CHECK(rig.runner->gatherer().expected(op_a()) == 4);  // what its next batch waits for
}

TEST_CASE("BatchRunner: a batch takes max_batch_size rows at most; the rest stay queued") {
  Rig rig;
  for (uint32_t s = 0; s < 4; ++s) rig.queue(s, s, JobShape{.rows = 2});
  CHECK_FALSE(rig.run(BatchSettings{4, 0}));
  REQUIRE(rig.backend.calls.size() == 1);
  CHECK(rig.backend.calls[0].tags == std::vector<uint64_t>{0, 1});
  CHECK(rig.pool_queue.size() == 2);
  CHECK(rig.word(2).state == JobState::kSubmitted);
  CHECK(rig.word(3).state == JobState::kSubmitted);
}

TEST_CASE("BatchRunner: a queued job whose rows would not fit stays queued for the next batch") {
  Rig rig;
  rig.queue(0, 0, JobShape{.rows = 3});
  rig.queue(1, 1, JobShape{.rows = 2});
  rig.queue(2, 2, JobShape{.rows = 1});
  CHECK_FALSE(rig.run(BatchSettings{4, 0}));
  REQUIRE(rig.backend.calls.size() == 1);
  CHECK(rig.backend.calls[0].tags == std::vector<uint64_t>{0});  // 3 + 2 rows: past 4
  CHECK(rig.pool_queue.size() == 2);
  CHECK(rig.word(1).state == JobState::kSubmitted);
  CHECK_FALSE(rig.run(BatchSettings{4, 0}));
  REQUIRE(rig.backend.calls.size() == 2);
  CHECK(rig.backend.calls[1].tags == std::vector<uint64_t>{1, 2});
}

TEST_CASE("BatchRunner: a job that must run alone (py.r 0) gathers no company") {
  Rig rig;
  rig.queue(0, 5, JobShape{.rows = 0});
  rig.queue(1, 6);
  CHECK_FALSE(rig.run());
  REQUIRE(rig.backend.calls.size() == 1);
  CHECK(rig.backend.calls[0].tags == std::vector<uint64_t>{5});
  CHECK(rig.pool_queue.size() == 1);
}

TEST_CASE("BatchRunner: another op's job at the head ends the gathering, and stays queued") {
  Rig rig;
  rig.queue(0, 1);
  rig.queue(1, 2);
  rig.queue(2, 3, JobShape{.op_id = op_b()});
  rig.queue(3, 4);
  CHECK_FALSE(rig.run());
  REQUIRE(rig.backend.calls.size() == 1);
  CHECK(rig.backend.calls[0].tags == std::vector<uint64_t>{1, 2});
  CHECK(rig.pool_queue.size() == 2);
  CHECK(rig.word(2).state == JobState::kSubmitted);
}

TEST_CASE("BatchRunner: a job of a client not mapped here yet goes back to the loop") {
  Rig rig;
  rig.queue(0, 1);
  // Client 2 holds its index (its MapClient is on the way); client 3 has gone.
  rig.records[2].session.store(99);
  REQUIRE(rig.push_ref(JobRef{3, 0, 1}.pack()));  // dropped: gathering goes on
  rig.queue(1, 2);
  const uint32_t unmapped = JobRef{2, 0, 1}.pack();
  REQUIRE(rig.push_ref(unmapped));
  rig.queue(2, 3);
  CHECK(rig.run() == unmapped);
  REQUIRE(rig.backend.calls.size() == 1);
  CHECK(rig.backend.calls[0].tags == std::vector<uint64_t>{1, 2});
  CHECK(rig.pool_queue.size() == 1);  // the job after it
}

TEST_CASE("BatchRunner: queued jobs that fail their checks end on their own, at once") {
  Rig rig;
  rig.queue(0, 1);
  rig.queue(1, 2, JobShape{.deadline_ns = 1});                           // long past
  rig.queue(2, 3, JobShape{.input_offset = kSlotArena * kSlots * 100});  // outside the arena
  rig.queue(3, 4);
  // A job its client cancelled while queued: its reference stays in the ring, and is dropped.
  rig.queue(4, 5);
  rig.slot(4).state.store(SlotWord{rig.generations[4], JobState::kCancelled, 0}.pack());
  rig.queue(5, 6);
  CHECK_FALSE(rig.run());
  REQUIRE(rig.backend.calls.size() == 1);
  CHECK(rig.backend.calls[0].tags == std::vector<uint64_t>{1, 4, 6});
  CHECK(rig.word(1).state == JobState::kExpired);
  CHECK(rig.slot(1).outcome.code == static_cast<int32_t>(ErrorCode::kExpired));
  CHECK(rig.message(1) == "deadline passed while the job was queued");
  CHECK(rig.word(2).state == JobState::kFailed);
  CHECK(rig.slot(2).outcome.code == static_cast<int32_t>(ErrorCode::kInvalidArgument));
  CHECK(rig.message(2).find("input buffer") != std::string::npos);
  CHECK(rig.word(4).state == JobState::kCancelled);
  CHECK(rig.word(4).worker_plus_one == 0);  // never this worker's
  CHECK(rig.self->jobs_done.load() == 3);
  CHECK(rig.self->jobs_failed.load() == 2);
  const OpMetrics& m = rig.op_metrics();
  CHECK(m.outcomes[static_cast<uint32_t>(MetricOutcome::kExpired)].load() == 1);
  CHECK(m.outcomes[static_cast<uint32_t>(MetricOutcome::kFailed)].load() == 1);
}

TEST_CASE("BatchRunner: a job cancelled by its client while the batch gathered leaves it") {
  Rig rig;
  rig.queue(0, 1);
  rig.queue(1, 2, JobShape{.cancel = kCancelByClient});
  rig.queue(2, 3);
  CHECK_FALSE(rig.run());
  REQUIRE(rig.backend.calls.size() == 1);
  CHECK(rig.backend.calls[0].tags == std::vector<uint64_t>{1, 3});
  CHECK(rig.word(1).state == JobState::kCancelled);
  CHECK(rig.word(1).worker_plus_one == kWorker + 1);
  CHECK(rig.message(1) == "batch_runner_test_a: cancelled while its batch was gathered");
}

TEST_CASE("BatchRunner: a job whose deadline passed while the batch gathered leaves it") {
  Rig rig;
  rig.runner->gatherer().set_quiet_ns(UINT64_MAX);  // it waits the whole delay
  for (uint32_t s = 0; s < 3; ++s) rig.queue(s, s);
  CHECK_FALSE(rig.run(BatchSettings{8, 5000}));  // the next batch of the op waits for 3 jobs
  rig.queue(3, 3);
  rig.queue(4, 4, JobShape{.deadline_ns = monotonic_ns() + 1'000'000});
  CHECK_FALSE(rig.run(BatchSettings{8, 5000}));  // it waits 5 ms for a third
  REQUIRE(rig.backend.calls.size() == 2);
  CHECK(rig.backend.calls[1].tags == std::vector<uint64_t>{3});
  CHECK(rig.word(4).state == JobState::kExpired);
  CHECK(rig.message(4) == "deadline passed while the job's batch was gathered");
  CHECK(rig.op_metrics().outcomes[static_cast<uint32_t>(MetricOutcome::kExpired)].load() == 1);
}

TEST_CASE("BatchRunner: a batch stops waiting once no job has come for its quiet gap") {
  Rig rig;
  rig.queue(0, 1);
  rig.queue(1, 2);
  CHECK_FALSE(rig.run(BatchSettings{8, 1'000'000}));  // the next batch of the op waits for 2
  rig.queue(2, 3);
  const uint64_t t0 = monotonic_ns();
  CHECK_FALSE(rig.run(BatchSettings{8, 1'000'000}));
  const uint64_t took = monotonic_ns() - t0;
  CHECK(took >= BatchGatherer::kMinQuietNs);
  CHECK(took < 500'000'000);  // far from the 1 s delay
  CHECK(rig.backend.calls[1].tags == std::vector<uint64_t>{3});
}

TEST_CASE("BatchRunner: a time-limit bit left from a slot's previous job is not the new one's") {
  Rig rig;
  rig.queue(0, 1);
  rig.queue(1, 2, JobShape{.cancel = kCancelByTimeLimit});
  CHECK_FALSE(rig.run());
  REQUIRE(rig.backend.calls.size() == 1);
  CHECK(rig.backend.calls[0].tags == std::vector<uint64_t>{1, 2});
  CHECK(rig.word(1).state == JobState::kDone);
  CHECK(rig.slot(1).cancel_requested.load() == 0);
}

TEST_CASE("BatchRunner: the page names the job whose time limit passes first") {
  SUBCASE("the jobs' own limits") {
    Rig rig;
    const uint32_t none = rig.queue(0, 1);
    rig.queue(1, 2, JobShape{.own_limit_ms = 5000});
    const uint32_t soonest = rig.queue(2, 3, JobShape{.own_limit_ms = 2000});
    CHECK_FALSE(rig.run());
    REQUIRE(rig.backend.calls.size() == 1);
    CHECK(rig.backend.calls[0].published_job == soonest);
    CHECK(rig.backend.calls[0].published_job != none);
    CHECK(rig.backend.calls[0].batch_jobs == 3);
  }
  SUBCASE("the pool's limit caps a longer own one; with the same limits, the first claimed") {
    Rig rig(3000);
    const uint32_t first = rig.queue(0, 1, JobShape{.own_limit_ms = 60'000});
    rig.queue(1, 2);
    CHECK_FALSE(rig.run());
    REQUIRE(rig.backend.calls.size() == 1);
    CHECK(rig.backend.calls[0].published_job == first);
  }
  SUBCASE("no limit anywhere: the first job") {
    Rig rig;
    const uint32_t first = rig.queue(0, 1);
    rig.queue(1, 2);
    CHECK_FALSE(rig.run());
    REQUIRE(rig.backend.calls.size() == 1);
    CHECK(rig.backend.calls[0].published_job == first);
  }
}

TEST_CASE("BatchRunner: a call stopped at one job's limit ends it TimedOut, runs the rest again") {
  Rig rig;
  rig.queue(0, 1);
  rig.queue(1, 2, JobShape{.own_limit_ms = 2000});
  rig.queue(2, 3);
  rig.queue(3, 4);
  // The supervisor raises the watched job's bit while the first call runs, and its client
  // cancels job 3; the call ends every job Cancelled.
  rig.backend.during_call = [&](size_t call) {
    if (call != 0) return;
    rig.slot(1).cancel_requested.fetch_or(kCancelByTimeLimit);
    rig.slot(3).cancel_requested.fetch_or(kCancelByClient);
  };
  rig.backend.stop_call = [](size_t call) { return call == 0; };
  CHECK_FALSE(rig.run());
  REQUIRE(rig.backend.calls.size() == 2);
  CHECK(rig.backend.calls[0].tags == std::vector<uint64_t>{1, 2, 3, 4});
  CHECK(rig.backend.calls[0].published_job == JobRef{kClient, 1, rig.generations[1]}.pack());
  CHECK(rig.backend.calls[1].tags == std::vector<uint64_t>{1, 3});  // in a call of their own
  CHECK(rig.backend.calls[1].batch_jobs == 2);
  CHECK(rig.word(1).state == JobState::kFailed);
  CHECK(rig.slot(1).outcome.code == static_cast<int32_t>(ErrorCode::kTimedOut));
  CHECK(rig.message(1) == "batch_runner_test_a: stopped at the job's time limit (2000 ms)");
  CHECK(rig.word(3).state == JobState::kCancelled);
  CHECK(rig.word(0).state == JobState::kDone);
  CHECK(rig.word(2).state == JobState::kDone);
  CHECK(rig.output(2) == 6);
  CHECK(rig.op_metrics().outcomes[static_cast<uint32_t>(MetricOutcome::kTimedOut)].load() == 1);
  CHECK(rig.batch_metrics().calls.load() == 2);
  CHECK(rig.priv->job_seq.load() % 2 == 0);
}

TEST_CASE("BatchRunner: a job whose own limit passed during a stopped call ends TimedOut too") {
  Rig rig(1);  // the pool's limit, 1 ms: past for every job by the time the call returns
  rig.queue(0, 1);
  rig.queue(1, 2);
  rig.backend.during_call = [](size_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  };
  rig.backend.stop_call = [](size_t) { return true; };
  CHECK_FALSE(rig.run());
  REQUIRE(rig.backend.calls.size() == 1);
  for (uint32_t s = 0; s < 2; ++s) {
    CHECK(rig.word(s).state == JobState::kFailed);
    CHECK(rig.message(s) == "batch_runner_test_a: stopped at the job's time limit (1 ms)");
  }
}

TEST_CASE("BatchRunner: a call that stopped for none of its jobs ends them Cancelled") {
  Rig rig;
  rig.queue(0, 1);
  rig.queue(1, 2);
  rig.backend.stop_call = [](size_t) { return true; };  // the op raised Cancelled by itself
  CHECK_FALSE(rig.run());
  REQUIRE(rig.backend.calls.size() == 1);
  CHECK(rig.word(0).state == JobState::kCancelled);
  CHECK(rig.word(1).state == JobState::kCancelled);
  CHECK(rig.self->jobs_failed.load() == 2);
}

TEST_CASE("BatchRunner: a job the op failed, or whose result the backend lost, fails alone") {
  Rig rig;
  rig.queue(0, 1);
  rig.queue(1, 2);
  rig.queue(2, 3);
  rig.backend.fail_tag = 2;
  rig.backend.lose_results = 1;  // the last job's
  CHECK_FALSE(rig.run());
  CHECK(rig.word(0).state == JobState::kDone);
  CHECK(rig.word(1).state == JobState::kFailed);
  CHECK(rig.message(1) == "the op raised");
  CHECK(rig.slot(1).outcome.output_bytes == 5);  // its failure record
  CHECK(rig.word(2).state == JobState::kFailed);
  CHECK(rig.slot(2).outcome.code == static_cast<int32_t>(ErrorCode::kInternal));
  CHECK(rig.message(2) == "batch_runner_test_a: the batch lost this job");
}

TEST_CASE("BatchRunner: with the worker held, the batch gathers nothing more") {
  Rig rig;
  rig.queue(0, 1);
  rig.queue(1, 2);
  rig.priv->hold.store(kHoldStop);
  CHECK_FALSE(rig.run());
  REQUIRE(rig.backend.calls.size() == 1);
  CHECK(rig.backend.calls[0].tags == std::vector<uint64_t>{1});
  CHECK(rig.pool_queue.size() == 1);
}

TEST_CASE(
    "BatchRunner: after a batch of several jobs, the next waits for company up to the delay") {
  Rig rig;
  rig.runner->gatherer().set_quiet_ns(UINT64_MAX);  // no quiet gap: the delay alone
  rig.queue(0, 1);
  rig.queue(1, 2);
  CHECK_FALSE(rig.run(BatchSettings{8, 3000}));
  rig.queue(2, 3);
  const uint64_t t0 = monotonic_ns();
  CHECK_FALSE(rig.run(BatchSettings{8, 3000}));
  CHECK(monotonic_ns() - t0 >= 3'000'000);  // no one came: it waited out the delay
  REQUIRE(rig.backend.calls.size() == 2);
  CHECK(rig.backend.calls[1].tags == std::vector<uint64_t>{3});
  CHECK(rig.word(2).state == JobState::kDone);
}

}  // namespace
}  // namespace gpuq::daemon
