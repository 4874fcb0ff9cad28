// Integration: backpressure (a full ring, a client's share of it, a blocking submit's deadline),
// cancelling, and jobs that expire in the queue, on a real daemon with one worker.
#include <algorithm>
#include <atomic>
#include <optional>
#include <thread>
#include <vector>

#include "integration/integration_support.hpp"

namespace gpuq::test {
namespace {

// One worker, ring capacity `queue_factor`, each client allowed `share` of it.
std::string small_ring_config(uint32_t queue_factor, double share) {
  return one_pool_config(1, {{"queue_factor", queue_factor}, {"client_queue_share", share}});
}

// Long enough that the worker stays busy while a test looks at the queue behind it.
constexpr int64_t kOccupyUs = 600'000;

TEST_CASE("a full ring: try_submit returns QueueFull, submit waits for room") {
  DaemonProcess daemon(small_ring_config(2, 1.0));
  CHECK(daemon.status()["pools"][0]["capacity"] == 2);
  Client client = connect_client(daemon);
  REQUIRE(client.pools().size() == 1);
  CHECK(client.pools()[0].capacity == 2);
  CHECK(client.pools()[0].client_share == 2);

  // The worker runs one job; the ring behind it then takes exactly its capacity.
  Job running = submit_ok(client, sleep_spec(kOccupyUs));
  wait_running(running);
  std::vector<Job> queued;
  std::optional<Error> refusal;
  for (int i = 0; i < 10 && !refusal; ++i) {
    auto job = client.try_submit(noop_spec());
    if (job) {
      queued.push_back(std::move(job).value());
    } else {
      refusal = job.error();
    }
  }
  REQUIRE(refusal.has_value());
  CHECK(refusal->code() == ErrorCode::kQueueFull);
  CHECK(queued.size() == 2);
  for (auto& job : queued) CHECK(poll_status(job) == JobStatus::kQueued);
  CHECK(daemon.status()["pools"][0]["queue_depth"] == 2);

  // A blocking submit waits while the ring is full...
  std::atomic<pid_t> tid{0};
  std::atomic<bool> returned{false};
  std::optional<Result<Job>> blocked;
  std::thread submitter([&] {
    tid.store(current_tid());
    auto job = client.submit(noop_spec(), 20s);
    blocked.emplace(std::move(job));
    returned.store(true);
  });
  // ...asleep in the kernel (not spinning) ...
  const bool asleep = wait_until(
      [&] {
        return returned.load() || (tid.load() != 0 && task_state(getpid(), tid.load()) == 'S');
      },
      10s);
  CHECK(asleep);
  // ...and cannot have got in while the running job still holds the worker.
  const bool returned_early = returned.load();
  if (poll_status(running) == JobStatus::kRunning) {
    CHECK_FALSE(returned_early);
  } else {
    MESSAGE("the occupying job ended before the check (a very slow machine); check skipped");
  }

  // Once the running job finishes, the worker takes the next one and the submit gets in.
  wait_done(running);
  submitter.join();
  REQUIRE(blocked.has_value());
  REQUIRE_MESSAGE(blocked->ok(), "blocked submit: " << error_text(*blocked));
  Job late = std::move(*blocked).value();
  for (auto& job : queued) wait_done(job);
  wait_done(late);
}

TEST_CASE("one client's share of a ring leaves room for another client") {
  DaemonProcess daemon(small_ring_config(4, 0.5));
  Client first = connect_client(daemon);
  Client second = connect_client(daemon);
  REQUIRE(first.pools().size() == 1);
  CHECK(first.pools()[0].capacity == 4);
  CHECK(first.pools()[0].client_share == 2);

  Job running = submit_ok(first, sleep_spec(kOccupyUs));
  wait_running(running);
  std::vector<Job> jobs;
  for (int i = 0; i < 2; ++i) {
    auto job = first.try_submit(noop_spec());
    REQUIRE_MESSAGE(job.ok(), "first client, job " << i << ": " << error_text(job));
    jobs.push_back(std::move(job).value());
  }
  auto over = first.try_submit(noop_spec());
  REQUIRE_FALSE(over.ok());
  CHECK(over.error().code() == ErrorCode::kQueueFull);
  CHECK(over.error().message().find("share") != std::string::npos);

  // The ring has 2 free cells: the second client may use them.
  for (int i = 0; i < 2; ++i) {
    auto job = second.try_submit(noop_spec());
    REQUIRE_MESSAGE(job.ok(), "second client, job " << i << ": " << error_text(job));
    jobs.push_back(std::move(job).value());
  }
  auto full = second.try_submit(noop_spec());
  REQUIRE_FALSE(full.ok());
  CHECK(full.error().code() == ErrorCode::kQueueFull);

  wait_done(running);
  for (auto& job : jobs) wait_done(job);
  // Room again for both.
  check_echo_works(first);
  check_echo_works(second);
}

// The share is counted by the client library (docs/design/ring.md, "Shares"): a job counts
// until the client sees a worker took it, so a client that never looks at its finished jobs
// must recount rather than be refused; and the entry of a job it cancelled while queued holds
// a ring cell until a worker pops and drops it.
TEST_CASE("a client's share counts its entries in the ring, not the jobs it has not looked at") {
  DaemonProcess daemon(small_ring_config(4, 0.5));
  Client client = connect_client(daemon);
  REQUIRE(client.pools()[0].client_share == 2);

  // 40 jobs, none waited on while submitting: each submit past the second finds the count at
  // the share and recounts; the worker has taken the earlier jobs by then, or soon does.
  std::vector<Job> unseen;
  for (int i = 0; i < 40; ++i) {
    auto job = client.submit(noop_spec(), 10s);
    REQUIRE_MESSAGE(job.ok(), "job " << i << ": " << error_text(job));
    unseen.push_back(std::move(job).value());
  }
  for (auto& job : unseen) wait_done(job);

  // Cancelled while queued: the two entries stay in the ring behind the busy worker and still
  // count against the share.
  Job running = submit_ok(client, sleep_spec(kOccupyUs));
  wait_running(running);
  std::vector<Job> cancelled;
  for (int i = 0; i < 2; ++i) cancelled.push_back(submit_ok(client, noop_spec()));
  for (auto& job : cancelled) {
    REQUIRE(job.cancel().ok());
    auto r = job.wait(5s);
    REQUIRE_MESSAGE(r.ok(), error_text(r));
    CHECK(r->status == JobStatus::kCancelled);
  }
  CHECK(daemon.status()["pools"][0]["queue_depth"] == 2);
  auto over = client.try_submit(noop_spec());
  REQUIRE_FALSE(over.ok());
  CHECK(over.error().code() == ErrorCode::kQueueFull);
  CHECK(over.error().message().find("share") != std::string::npos);
  // Once the worker is free it pops and drops them, and the client has room again.
  wait_done(running);
  auto after = client.submit(noop_spec(), 10s);
  REQUIRE_MESSAGE(after.ok(), error_text(after));
  wait_done(*after);
  check_echo_works(client);
}

TEST_CASE("a blocking submit on a full ring times out with Timeout") {
  DaemonProcess daemon(small_ring_config(2, 1.0));
  Client client = connect_client(daemon);
  Job running = submit_ok(client, sleep_spec(kOccupyUs));
  wait_running(running);
  std::vector<Job> queued;
  queued.push_back(submit_ok(client, noop_spec()));
  queued.push_back(submit_ok(client, noop_spec()));

  const uint64_t start = monotonic_ns();
  auto job = client.submit(noop_spec(), 50ms);
  const uint64_t elapsed = monotonic_ns() - start;
  REQUIRE_FALSE(job.ok());
  CHECK(job.error().code() == ErrorCode::kTimeout);
  CHECK(elapsed >= 45 * kMillisecond);  // it did wait, about as long as asked
  CHECK(elapsed < 5 * kSecond);

  wait_done(running);
  for (auto& q : queued) wait_done(q);
  check_echo_works(client);
}

TEST_CASE("cancel_queued: a queued job is cancelled, a running one is left to finish") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);

  Job running = submit_ok(client, sleep_spec(200'000));
  wait_running(running);
  Job queued = submit_ok(client, noop_spec());
  REQUIRE(poll_status(queued) == JobStatus::kQueued);

  auto cancelled = queued.cancel_queued();
  REQUIRE_MESSAGE(cancelled.ok(), "cancel_queued: " << error_text(cancelled));
  CHECK(*cancelled);
  CHECK(wait_result(queued).status == JobStatus::kCancelled);

  auto left = running.cancel_queued();
  REQUIRE(left.ok());
  CHECK_FALSE(*left);  // running: not asked to stop
  JobResult r = wait_result(running);
  CHECK(r.status == JobStatus::kDone);
  CHECK(r.run_ns >= 200'000'000);
  auto finished = running.cancel_queued();
  REQUIRE(finished.ok());
  CHECK_FALSE(*finished);
}

TEST_CASE("cancel: a queued job is cancelled at once, a running one is asked to stop") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  Buffer in = allocate(client, 256);
  Buffer out = allocate(client, 256);
  std::memset(in.data(), 0x5A, 256);
  std::memset(out.data(), 0, 256);

  Job running = submit_ok(client, sleep_spec(300'000));
  wait_running(running);
  Job queued = submit_ok(client, job_spec("echo", in, out));
  REQUIRE(poll_status(queued) == JobStatus::kQueued);

  auto cancelled = queued.cancel();
  REQUIRE_MESSAGE(cancelled.ok(), "cancel: " << error_text(cancelled));
  JobResult q = wait_result(queued);
  CHECK(q.status == JobStatus::kCancelled);
  CHECK(q.code == ErrorCode::kCancelled);
  CHECK(q.run_ns == 0);  // it never started: queued until cancelled
  CHECK(q.queued_ns < 300'000'000);
  auto again = queued.cancel();
  REQUIRE_FALSE(again.ok());
  CHECK(again.error().code() == ErrorCode::kNotCancellable);

  // A running job is asked to stop; sleep checks the flag every millisecond.
  auto stop_running = running.cancel();
  REQUIRE_MESSAGE(stop_running.ok(), "cancel of a running job: " << error_text(stop_running));
  JobResult r = wait_result(running);
  CHECK(r.status == JobStatus::kCancelled);
  CHECK(r.code == ErrorCode::kCancelled);
  CHECK(r.run_ns > 0);
  CHECK(r.run_ns < 300'000'000);
  auto finished = running.cancel();
  REQUIRE_FALSE(finished.ok());
  CHECK(finished.error().code() == ErrorCode::kNotCancellable);

  // A job behind the cancelled one completes, so the worker has passed it by: it never ran.
  Job after = submit_ok(client, noop_spec());
  wait_done(after);
  const bool untouched =
      std::all_of(out.data(), out.data() + 256, [](std::byte b) { return b == std::byte{0}; });
  CHECK(untouched);
}

TEST_CASE("one job waited on, polled and cancelled from several threads at once") {
  // client.hpp: a Job's wait(), poll() and cancel() may run in several threads at once (the
  // Python client relies on it: a caller's result() and the watcher thread wait together).
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  for (bool cancel : {false, true}) {
    // The cancelled job would sleep 30 s: it ends only when cancelled below.
    Job job = submit_ok(client, sleep_spec(cancel ? 30'000'000 : 50'000));
    if (cancel) {
      wait_running(job);
      // A waiter with a short timeout gives up alone; the job runs on.
      std::thread quick([&] {
        auto r = job.wait(std::chrono::microseconds(100));
        CHECK((!r && r.error().code() == ErrorCode::kTimeout));
      });
      quick.join();
    }
    std::atomic<int> done{0};
    std::atomic<int> cancelled{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&] {
        (void)job.poll();
        auto r = job.wait(std::chrono::seconds(30));
        if (r && r->status == JobStatus::kDone) done.fetch_add(1);
        if (r && r->status == JobStatus::kCancelled) cancelled.fetch_add(1);
      });
    }
    if (cancel) {
      auto c = job.cancel();
      CHECK_MESSAGE(c.ok(), "cancel: " << error_text(c));
    }
    for (std::thread& t : threads) t.join();
    // Every waiter sees the one end, whether it waited before the end or came after it.
    CHECK(done.load() == (cancel ? 0 : 4));
    CHECK(cancelled.load() == (cancel ? 4 : 0));
  }
}

TEST_CASE("a job whose deadline passes while queued expires without running") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  Buffer in = allocate(client, 256);
  Buffer out_expiring = allocate(client, 256);
  Buffer out_patient = allocate(client, 256);
  std::memset(in.data(), 0x5A, 256);
  std::memset(out_expiring.data(), 0, 256);
  std::memset(out_patient.data(), 0, 256);

  Job running = submit_ok(client, sleep_spec(300'000));
  wait_running(running);
  JobSpec spec = job_spec("echo", in, out_expiring);
  spec.expire_after = 20ms;
  Job expiring = submit_ok(client, spec);
  spec.output = out_patient;
  spec.expire_after = 60s;
  Job patient = submit_ok(client, spec);

  JobResult e = wait_result(expiring);
  CHECK(e.status == JobStatus::kExpired);
  CHECK(e.code == ErrorCode::kExpired);
  CHECK(e.output_size == 0);
  // The deadline fired while the only worker was still busy: no free worker was needed.
  CHECK(poll_status(running) == JobStatus::kRunning);
  wait_done(running);
  // The job behind it, whose deadline is far, runs.
  JobResult p = wait_done(patient);
  CHECK(p.output_size == 256);
  CHECK(std::memcmp(in.data(), out_patient.data(), 256) == 0);
  // The expired one never touched its output, and the worker did not count it as done.
  const bool untouched = std::all_of(out_expiring.data(), out_expiring.data() + 256,
                                     [](std::byte b) { return b == std::byte{0}; });
  CHECK(untouched);
  // The worker counts a job just after publishing its end: wait for the counters to settle.
  nlohmann::json worker;
  const bool counted = wait_until(
      [&] {
        worker = daemon.status()["pools"][0]["workers"][0];
        return worker["jobs_done"].get<uint64_t>() + worker["jobs_failed"].get<uint64_t>() == 2;
      },
      10s);
  INFO("worker: " << worker.dump());
  CHECK(counted);
  // The sleep and the patient job; the expired one was ended by its waiter and skipped by the
  // worker.
  CHECK(worker["jobs_done"] == 2);
}

TEST_CASE("any number of Jobs may be held: finished jobs give their slots back") {
  DaemonProcess daemon(one_pool_config(2, {{"max_jobs_per_client", 8}}));
  Client client = connect_client(daemon);
  CHECK(client.slot_count() == 8);
  // 10,000 jobs submitted and held before any is read: a submit that finds every slot taken
  // takes one whose job has finished (its result kept for its Job), or waits for one.
  std::vector<Job> jobs;
  jobs.reserve(10'000);
  for (int i = 0; i < 10'000; ++i) {
    JobSpec spec = sleep_spec(i % 7);
    jobs.push_back(submit_ok(client, spec));
  }
  for (int i = 0; i < 10'000; ++i) {
    JobResult r = wait_done(jobs[i]);
    CHECK(r.value == static_cast<uint64_t>(i % 7));   // sleep's value: its `us`
    CHECK(poll_status(jobs[i]) == JobStatus::kDone);  // again, from the kept result
  }
  // A kept result is read as often as asked; a finished job can no longer be cancelled.
  CHECK(wait_done(jobs[0]).value == 0);
  auto cancel = jobs[1].cancel();
  REQUIRE_FALSE(cancel.ok());
  CHECK(cancel.error().code() == ErrorCode::kNotCancellable);
  jobs.clear();

  // With every slot held by a job that has not finished: try_submit says QueueFull at once,
  // submit waits, and takes the first slot that comes free.
  std::vector<Job> running;
  for (int i = 0; i < 8; ++i) running.push_back(submit_ok(client, sleep_spec(300'000)));
  auto refused = client.try_submit(noop_spec());
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().code() == ErrorCode::kQueueFull);
  CHECK(refused.error().message().find("job slots") != std::string::npos);
  auto timed_out = client.submit(noop_spec(), 1ms);
  REQUIRE_FALSE(timed_out.ok());
  CHECK(timed_out.error().code() == ErrorCode::kTimeout);
  Job after = submit_ok(client, noop_spec());  // waits for the first sleep to end
  wait_done(after);
  for (auto& j : running) wait_done(j);
}

TEST_CASE("threads that submit, wait, cancel and drop Jobs while slots are scarce") {
  // Four slots, four threads: submits give finished jobs' slots back (or wait for one) while
  // other threads cancel queued jobs, drop unfinished and finished Jobs, and read results
  // kept for their Jobs. Every wait on a kept Job must see its own job's end.
  DaemonProcess daemon(one_pool_config(2, {{"max_jobs_per_client", 4}}));
  Client client = connect_client(daemon);
  std::atomic<int> wrong{0};
  std::atomic<int> waited{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::pair<Job, int64_t>> held;
      for (int i = 0; i < 400; ++i) {
        const int64_t us = (i * 7 + t) % 50;
        auto job = client.submit(sleep_spec(us), 30s);
        if (!job) {
          wrong.fetch_add(1);
          continue;
        }
        held.emplace_back(std::move(job).value(), us);
        switch ((i + t) % 5) {
          case 0:  // cancel it: queued jobs end at once, running ones may finish first
            (void)held.back().first.cancel();
            break;
          case 1:  // drop it unfinished (or finished)
            held.pop_back();
            break;
          default:
            break;
        }
        if (held.size() > 6) {  // read the oldest: its own result, or its own cancellation
          auto r = held.front().first.wait(30s);
          if (!r || (r->status == JobStatus::kDone &&
                     r->value != static_cast<uint64_t>(held.front().second))) {
            wrong.fetch_add(1);
          }
          waited.fetch_add(1);
          held.erase(held.begin());
        }
      }
      for (auto& [job, us] : held) {
        auto r = job.wait(30s);
        if (!r || (r->status == JobStatus::kDone && r->value != static_cast<uint64_t>(us))) {
          wrong.fetch_add(1);
        }
        waited.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(wrong.load() == 0);
  CHECK(waited.load() > 1000);
  check_echo_works(client);
}

}  // namespace
}  // namespace gpuq::test
