// Integration: streaming jobs (docs/design/streams.md) on a real gpuqd, with the built-in
// `count` op (a part every `us` microseconds):
//   - parts arrive in order, each before the stream ends; a stream that ends well ends DONE;
//   - at most `stream_window` parts wait unread: the op waits for its reader (backpressure);
//   - a cancel, the job's time limit, a worker killed and a client killed mid-stream each end
//     the stream, and the worker (or its replacement) serves the next job;
//   - a reader that stops reading frees its worker after stream_reader_timeout_ms;
//   - bad input: a window too large, an output too small for its cells, next_part on a job
//     that is not a stream, each refused with a message that names it.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "integration/integration_support.hpp"

namespace gpuq::test {
namespace {

using nlohmann::json;

// `count` of n numbers, us apart, as a stream of `window` parts in a buffer of window x 64.
JobSpec count_spec(Client& client, int64_t n, int64_t us, uint32_t window) {
  JobSpec spec = job_spec("count", {}, allocate(client, uint64_t{window} * 64));
  spec.params = {JobParam::integer("n", n), JobParam::integer("us", us)};
  spec.stream_window = window;
  return spec;
}

// The next part, which must come: its index and the number in it.
std::pair<uint32_t, uint64_t> next_number(Job& job) {
  auto part = job.next_part(kJobTimeout);
  REQUIRE_MESSAGE(part.ok(), "next_part: " << error_text(part));
  REQUIRE_MESSAGE(part->has_value(), "the stream ended early");
  REQUIRE((*part)->size == 8);
  uint64_t v = 0;
  std::memcpy(&v, (*part)->data, 8);
  return {(*part)->index, v};
}

// Reads parts until the stream ends; the error that ended it (kOk: it ended well).
ErrorCode read_to_end(Job& job, uint32_t* parts = nullptr) {
  for (uint32_t n = 0;; ++n) {
    auto part = job.next_part(kJobTimeout);
    if (!part) {
      REQUIRE_MESSAGE(part.error().code() != ErrorCode::kTimeout, "no part within 30 s");
      if (parts != nullptr) *parts = n;
      return part.error().code();
    }
    if (!part->has_value()) {
      if (parts != nullptr) *parts = n;
      return ErrorCode::kOk;
    }
  }
}

TEST_CASE("a stream's parts arrive in order, each before the stream ends") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  Job job = submit_ok(client, count_spec(client, 5, 100'000, 2));
  for (uint64_t i = 0; i < 5; ++i) {
    const auto [index, value] = next_number(job);
    CHECK(index == i);
    CHECK(value == i);
    // Part i came while parts i + 1 ... were still being made, 100 ms apart.
    if (i < 4) CHECK(poll_status(job) == JobStatus::kRunning);
  }
  auto end = job.next_part(kJobTimeout);
  REQUIRE_MESSAGE(end.ok(), error_text(end));
  CHECK_FALSE(end->has_value());
  CHECK_FALSE(job.next_part(kJobTimeout)->has_value());  // and stays ended
  const JobResult r = wait_done(job);
  CHECK(r.value == 5);
  CHECK(r.output_size == 0);

  SUBCASE("the same op answers once, all numbers in its output, when not streamed") {
    JobSpec spec = job_spec("count", {}, allocate(client, 5 * 8));
    spec.params = {JobParam::integer("n", 5)};
    Job once = submit_ok(client, spec);
    const JobResult all = wait_done(once);
    REQUIRE(all.output_size == 40);
    for (uint64_t i = 0; i < 5; ++i) {
      uint64_t v = 0;
      std::memcpy(&v, spec.output.data() + i * 8, 8);
      CHECK(v == i);
    }
    auto part = once.next_part(kJobTimeout);
    REQUIRE_FALSE(part.ok());
    CHECK(part.error().code() == ErrorCode::kInvalidArgument);
    CHECK(part.error().message().find("not submitted as a stream") != std::string::npos);
  }
}

TEST_CASE("at most stream_window parts wait unread: the op waits for its reader") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  // 50 numbers with no pause would take microseconds; unread, the op stops at the third.
  Job job = submit_ok(client, count_spec(client, 50, 0, 3));
  wait_running(job);
  std::this_thread::sleep_for(300ms);
  CHECK(poll_status(job) == JobStatus::kRunning);
  for (uint64_t i = 0; i < 50; ++i) {
    const auto [index, value] = next_number(job);
    CHECK(index == i);
    CHECK(value == i);
  }
  CHECK(read_to_end(job) == ErrorCode::kOk);
  CHECK(wait_done(job).value == 50);
}

TEST_CASE("a cancel ends a stream mid-way; the worker serves on") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  Job job = submit_ok(client, count_spec(client, 1'000'000, 1000, 2));
  for (uint64_t i = 0; i < 3; ++i) CHECK(next_number(job).second == i);
  REQUIRE(job.cancel().ok());
  CHECK(read_to_end(job) == ErrorCode::kCancelled);
  CHECK(wait_result(job).status == JobStatus::kCancelled);
  check_echo_works(client);
}

TEST_CASE("the job's time limit covers the whole stream") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  JobSpec spec = count_spec(client, 1'000'000, 1000, 2);
  spec.time_limit = 300ms;
  Job job = submit_ok(client, spec);
  uint32_t parts = 0;
  CHECK(read_to_end(job, &parts) == ErrorCode::kTimedOut);
  CHECK(parts > 10);  // it streamed until the limit
  const JobResult r = wait_result(job);
  CHECK(r.status == JobStatus::kFailed);
  CHECK(r.code == ErrorCode::kTimedOut);
  check_echo_works(client);
}

TEST_CASE("a reader that stops reading frees its worker after stream_reader_timeout_ms") {
  DaemonProcess daemon(one_pool_config(1, {{"stream_reader_timeout_ms", 300}}));
  Client client = connect_client(daemon);
  Job job = submit_ok(client, count_spec(client, 100, 0, 2));
  CHECK(next_number(job).second == 0);
  std::this_thread::sleep_for(1s);  // reads nothing more
  check_echo_works(client);         // the worker is free again
  CHECK(poll_status(job) == JobStatus::kCancelled);
  // The part it made before it stopped waiting (2 unread: parts 0 and 1) is still there, then
  // the reason.
  CHECK(next_number(job).second == 1);
  auto end = job.next_part(kJobTimeout);
  REQUIRE_FALSE(end.ok());
  CHECK(end.error().code() == ErrorCode::kCancelled);
  CHECK_MESSAGE(end.error().message().find("stream_reader_timeout_ms") != std::string::npos,
                end.error().message());
}

TEST_CASE("a worker killed mid-stream: the parts made come, then WorkerDied") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  Job job = submit_ok(client, count_spec(client, 1'000'000, 1000, 2));
  CHECK(next_number(job).second == 0);
  CHECK(next_number(job).second == 1);
  REQUIRE(::kill(daemon.worker_pids().at(0), SIGKILL) == 0);
  CHECK(read_to_end(job) == ErrorCode::kWorkerDied);
  CHECK(wait_result(job).code == ErrorCode::kWorkerDied);
  check_echo_works(client);  // the replacement serves
}

TEST_CASE("a worker killed as it publishes a part: the published parts come, then WorkerDied") {
  // Its third part written into its cell, `written` not raised: the part is never seen.
  const std::string marker = "/tmp/gpuqt-stream-fault-" + std::to_string(::getpid());
  ::unlink(marker.c_str());
  DaemonOptions options{
      one_pool_config(1),
      DaemonOptions::Readiness::kWorkersReady,
      {"GPUQ_FAULT_POINT=worker.stream.before_publish:3", "GPUQ_FAULT_ONCE=" + marker}};
  DaemonProcess daemon(options);
  Client client = connect_client(daemon);
  Job job = submit_ok(client, count_spec(client, 10, 0, 4));
  CHECK(next_number(job).second == 0);
  CHECK(next_number(job).second == 1);
  uint32_t more = 0;
  CHECK(read_to_end(job, &more) == ErrorCode::kWorkerDied);
  CHECK(more == 0);
  CHECK(::access(marker.c_str(), F_OK) == 0);  // it died there
  ::unlink(marker.c_str());
  check_echo_works(client);  // the replacement serves
}

TEST_CASE("a client killed mid-stream frees its worker") {
  DaemonProcess daemon(one_pool_config(1));
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    auto c = Client::connect(connect_options(daemon.runtime_dir()));
    if (!c) ::_exit(2);
    auto out = c->allocate(128);
    if (!out) ::_exit(3);
    JobSpec spec = job_spec("count", {}, *out);
    spec.params = {JobParam::integer("n", 1'000'000), JobParam::integer("us", 1000)};
    spec.stream_window = 2;
    auto job = c->submit(spec);
    if (!job) ::_exit(4);
    for (int i = 0; i < 3; ++i) {
      auto part = job->next_part(std::chrono::seconds(30));
      if (!part || !part->has_value()) ::_exit(5);
    }
    ::_exit(0);  // no destructors: as if it crashed, mid-stream
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE_MESSAGE((WIFEXITED(status) && WEXITSTATUS(status) == 0), "child status " << status);
  Client client = connect_client(daemon);
  check_echo_works(client);                                 // the only worker is free
  CHECK(daemon.status()["pools"][0]["stops_forced"] == 0);  // the stream stopped by itself
}

TEST_CASE("bad stream input is refused, naming what is wrong") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  JobSpec spec = count_spec(client, 3, 0, 2);
  spec.stream_window = 9;
  auto too_wide = client.submit(spec);
  REQUIRE_FALSE(too_wide.ok());
  CHECK(too_wide.error().code() == ErrorCode::kInvalidArgument);
  CHECK(too_wide.error().message().find("stream_window: 9") != std::string::npos);

  spec.stream_window = 2;
  spec.retryable = true;
  auto retried = client.submit(spec);
  REQUIRE_FALSE(retried.ok());
  CHECK(retried.error().code() == ErrorCode::kInvalidArgument);
  CHECK(retried.error().message().find("cannot be retryable") != std::string::npos);
  spec.retryable = false;

  spec.stream_window = 4;
  spec.output = allocate(client, 200);  // 50 bytes a cell
  auto too_small = client.submit(spec);
  REQUIRE_FALSE(too_small.ok());
  CHECK(too_small.error().code() == ErrorCode::kInvalidArgument);
  CHECK(too_small.error().message().find("256 bytes or more") != std::string::npos);

  // The op's own refusal of its params, after no part.
  spec = count_spec(client, -1, 0, 2);
  Job bad = submit_ok(client, spec);
  auto end = bad.next_part(kJobTimeout);
  REQUIRE_FALSE(end.ok());
  CHECK(end.error().code() == ErrorCode::kInvalidArgument);
  check_echo_works(client);
}

}  // namespace
}  // namespace gpuq::test
