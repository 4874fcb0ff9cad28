// Integration: Job::wait_any, one thread watching many jobs on the connection's event (issue 28,
// "completion without polling"), on a real daemon with two workers.
#include <sys/resource.h>

#include <chrono>
#include <thread>
#include <vector>

#include "gpuq/gpuq.h"
#include "integration/integration_support.hpp"

namespace gpuq::test {
namespace {

using Clock = std::chrono::steady_clock;

// Voluntary context switches of the calling thread: one per sleep it woke from.
long voluntary_switches() {
  rusage u{};
  REQUIRE(getrusage(RUSAGE_THREAD, &u) == 0);
  return u.ru_nvcsw;
}

std::vector<size_t> wait_any_ok(std::initializer_list<const Job*> jobs,
                                std::chrono::nanoseconds timeout = kJobTimeout) {
  const std::vector<const Job*> list(jobs);
  auto r = Job::wait_any(list, timeout);
  REQUIRE_MESSAGE(r.ok(), "wait_any: " << error_text(r));
  return std::move(r).value();
}

TEST_CASE("wait_any returns the jobs that ended, woken by their end, not by polling") {
  DaemonProcess daemon(one_pool_config(2));
  Client client = connect_client(daemon);

  Job slow = submit_ok(client, sleep_spec(3'000'000));
  Job soon = submit_ok(client, sleep_spec(1'500'000));
  wait_running(slow);
  wait_running(soon);

  // Asleep for 1.5 s on the connection's event: it wakes for the end of `soon` and at most
  // once a second to check the daemon is there. A waiter polling every 20 ms (as the Python
  // watcher did) would switch out some 75 times.
  const long switches_before = voluntary_switches();
  const auto t0 = Clock::now();
  const std::vector<size_t> ended = wait_any_ok({&slow, &soon});
  const auto waited = Clock::now() - t0;
  const long switches = voluntary_switches() - switches_before;
  CHECK(ended == std::vector<size_t>{1});
  CHECK(waited < 2900ms);  // before `slow` ended
  CHECK(wait_done(soon).status == JobStatus::kDone);
  CHECK_MESSAGE(switches <= 8, "the waiting thread woke " << switches << " times");

  // An ended job is reported at once, with any others that ended.
  CHECK(wait_any_ok({&soon}) == std::vector<size_t>{0});
  wait_done(slow);
  CHECK(wait_any_ok({&slow, &soon}) == std::vector<size_t>{0, 1});
}

TEST_CASE("wait_any: a timeout or wake_waiters returns nothing; cancel and expiry wake it") {
  DaemonProcess daemon(one_pool_config(2));
  Client client = connect_client(daemon);
  Job a = submit_ok(client, sleep_spec(5'000'000));
  Job b = submit_ok(client, sleep_spec(5'000'000));
  wait_running(a);
  wait_running(b);

  const auto t0 = Clock::now();
  CHECK(wait_any_ok({&a, &b}, 100ms).empty());
  CHECK(Clock::now() - t0 >= 100ms);

  // wake_waiters() from another thread, on any job of the connection: the wait returns empty.
  Job queued = submit_ok(client, noop_spec());  // both workers are busy
  CHECK(poll_status(queued) == JobStatus::kQueued);
  std::thread waker([&] {
    std::this_thread::sleep_for(200ms);
    queued.wake_waiters();
  });
  const auto t1 = Clock::now();
  CHECK(wait_any_ok({&a, &b}, 20s).empty());
  CHECK(Clock::now() - t1 < 10s);
  waker.join();

  // The client's own cancel of a queued job ends it: the event wakes the watcher.
  std::thread canceller([&] {
    std::this_thread::sleep_for(200ms);
    CHECK(queued.cancel().ok());
  });
  CHECK(wait_any_ok({&a, &queued}) == std::vector<size_t>{1});
  canceller.join();
  CHECK(wait_result(queued).status == JobStatus::kCancelled);

  // A job still queued at its deadline is expired by wait_any, as by wait().
  JobSpec spec = noop_spec();
  spec.expire_after = 300ms;
  Job expiring = submit_ok(client, spec);
  const auto t2 = Clock::now();
  CHECK(wait_any_ok({&a, &expiring}) == std::vector<size_t>{1});
  CHECK(Clock::now() - t2 >= 250ms);
  CHECK(wait_result(expiring).status == JobStatus::kExpired);
  CHECK(a.cancel().ok());
  CHECK(b.cancel().ok());
}

TEST_CASE("wait_any: empty handles count as ended; jobs of two connections are refused") {
  DaemonProcess daemon(one_pool_config(2));
  Client one = connect_client(daemon);
  Client two = connect_client(daemon);
  Job a = submit_ok(one, sleep_spec(2'000'000));
  Job b = submit_ok(two, sleep_spec(2'000'000));
  Job empty;
  CHECK(wait_any_ok({&a, &empty}) == std::vector<size_t>{1});
  CHECK(wait_any_ok({&empty, nullptr}) == std::vector<size_t>{0, 1});
  const std::vector<const Job*> mixed{&a, &b};
  auto r = Job::wait_any(mixed, 1s);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code() == ErrorCode::kInvalidArgument);
}

TEST_CASE("gpuq_job_wait_any: the C API marks the jobs that ended") {
  DaemonProcess daemon(one_pool_config(2));
  gpuq_connect_options_t options{};
  options.version = GPUQ_CONNECT_OPTIONS_VERSION;
  const std::string& dir = daemon.runtime_dir();
  options.runtime_dir = dir.c_str();
  gpuq_client_t* client = nullptr;
  REQUIRE(gpuq_connect(&options, &client) == GPUQ_OK);
  gpuq_job_spec_t spec{};
  spec.version = GPUQ_JOB_SPEC_VERSION;
  spec.op = "noop";
  gpuq_job_t* jobs[2] = {nullptr, nullptr};
  REQUIRE(gpuq_submit(client, &spec, -1, &jobs[1]) == GPUQ_OK);
  uint8_t ended[2] = {7, 7};
  REQUIRE(gpuq_job_wait_any(jobs, 2, -1, ended) == GPUQ_OK);
  CHECK(ended[0] == 1);  // NULL: ended
  gpuq_job_result_t result{};
  result.version = GPUQ_JOB_RESULT_VERSION;
  REQUIRE(gpuq_job_wait(jobs[1], -1, &result) == GPUQ_OK);
  CHECK(result.status == GPUQ_JOB_DONE);
  REQUIRE(gpuq_job_wait_any(jobs + 1, 1, -1, ended) == GPUQ_OK);
  CHECK(ended[0] == 1);
  CHECK(gpuq_job_wait_any(nullptr, 1, 0, ended) == GPUQ_INVALID_ARGUMENT);
  CHECK(gpuq_job_wake_waiters(jobs[1]) == GPUQ_OK);
  CHECK(gpuq_job_release(jobs[1]) == GPUQ_OK);
  gpuq_disconnect(client);
}

}  // namespace
}  // namespace gpuq::test
