// Helpers shared by the integration tests (tests/integration): connecting a client to a
// DaemonProcess, building job specs and configs, running a job and checking an echo round trip.
// Every helper that can fail does so through doctest (REQUIRE), so use them from the main thread
// of a test case only, never in a forked child.
#pragma once

#include <sched.h>

#include <doctest/doctest.h>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "gpuq/client.hpp"
#include "support/daemon_fixture.hpp"
#include "support/test_support.hpp"

// Readable names in doctest's failure messages.
template <>
struct doctest::StringMaker<gpuq::ErrorCode> {
  static doctest::String convert(gpuq::ErrorCode code) {
    return std::string(gpuq::error_code_name(code)).c_str();
  }
};
template <>
struct doctest::StringMaker<gpuq::JobStatus> {
  static doctest::String convert(gpuq::JobStatus status) {
    return std::string(gpuq::job_status_name(status)).c_str();
  }
};

namespace gpuq::test {

using namespace std::chrono_literals;

// Generous bound on anything that should take milliseconds (sanitizers, a loaded 2-core VM).
inline constexpr std::chrono::seconds kJobTimeout{30};

// The CPUs this process may run on (what gpuqd's defaults use), ascending.
inline std::vector<int> affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    for (int i = 0; i < CPU_SETSIZE; ++i) {
      if (CPU_ISSET(i, &set)) cpus.push_back(i);
    }
  }
  return cpus;
}

// A config with one cpu pool "cpu" of `workers` workers, plus the keys in `extra`.
inline std::string one_pool_config(uint32_t workers,
                                   nlohmann::json extra = nlohmann::json::object()) {
  extra["pools"] =
      nlohmann::json::array({{{"name", "cpu"}, {"kind", "cpu"}, {"workers", workers}}});
  return extra.dump();
}

// The error of `r` as text, or "ok": safe in a doctest message, which doctest may evaluate even
// when the assertion holds (with --success).
template <typename T>
std::string error_text(const Result<T>& r) {
  return r.ok() ? std::string("ok") : r.error().to_string();
}

inline ConnectOptions connect_options(std::string runtime_dir, uint64_t segment_bytes = 0) {
  ConnectOptions options;
  options.runtime_dir = std::move(runtime_dir);
  options.segment_bytes = segment_bytes;
  return options;
}

// A client of `daemon`, with a payload arena of `segment_bytes` (0: the daemon's default).
inline Client connect_client(const DaemonProcess& daemon, uint64_t segment_bytes = 0) {
  auto client = Client::connect(connect_options(daemon.runtime_dir(), segment_bytes));
  REQUIRE_MESSAGE(client.ok(), "connect: " << error_text(client));
  return std::move(client).value();
}

inline Buffer allocate(Client& client, uint64_t size) {
  auto b = client.allocate(size);
  REQUIRE_MESSAGE(b.ok(), "allocate(" << size << "): " << error_text(b));
  return b.value();
}

inline JobSpec job_spec(std::string op, Buffer input = {}, Buffer output = {},
                        std::string pool = {}) {
  JobSpec spec;
  spec.op = std::move(op);
  spec.pool = std::move(pool);
  spec.input = input;
  spec.output = output;
  return spec;
}

inline JobSpec sleep_spec(int64_t us, std::string pool = {}) {
  JobSpec spec;
  spec.op = "sleep";
  spec.pool = std::move(pool);
  spec.params.push_back(JobParam::integer("us", us));
  return spec;
}

inline JobSpec noop_spec(std::string pool = {}) {
  JobSpec spec;
  spec.op = "noop";
  spec.pool = std::move(pool);
  return spec;
}

inline Job submit_ok(Client& client, const JobSpec& spec) {
  auto job = client.submit(spec, kJobTimeout);
  REQUIRE_MESSAGE(job.ok(), "submit " << spec.op << ": " << error_text(job));
  return std::move(job).value();
}

// Waits for a job; the wait itself must succeed (the job may have failed).
inline JobResult wait_result(Job& job, std::chrono::nanoseconds timeout = kJobTimeout) {
  auto r = job.wait(timeout);
  REQUIRE_MESSAGE(r.ok(), "wait: " << error_text(r));
  return r.value();
}

// Waits for a job that must end kDone.
inline JobResult wait_done(Job& job) {
  JobResult r = wait_result(job);
  REQUIRE_MESSAGE(r.status == JobStatus::kDone, "job ended " << job_status_name(r.status) << " ("
                                                             << error_code_name(r.code)
                                                             << "): " << r.message);
  CHECK(r.code == ErrorCode::kOk);
  return r;
}

inline JobStatus poll_status(const Job& job) {
  auto s = job.poll();
  REQUIRE_MESSAGE(s.ok(), "poll: " << error_text(s));
  return s.value();
}

// Waits until `job` is running on a worker.
inline void wait_running(const Job& job) {
  REQUIRE_MESSAGE(wait_until([&] { return poll_status(job) == JobStatus::kRunning; }, 10s),
                  "the job did not start running within 10 s");
}

inline void fill_random(std::byte* p, uint64_t n, std::mt19937_64& rng) {
  for (uint64_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>(rng());
}

// Runs an echo of `size` random bytes on `client` and checks the output byte for byte: the proof
// that a client (and the daemon behind it) still works.
inline void check_echo_works(Client& client, uint64_t size = 4096, uint64_t seed = 7) {
  INFO("echo of " << size << " bytes");
  Buffer in = allocate(client, size);
  Buffer out = allocate(client, size);
  std::mt19937_64 rng(seed);
  fill_random(in.data(), size, rng);
  std::memset(out.data(), 0, size);
  JobSpec spec;
  spec.op = "echo";
  spec.input = in;
  spec.output = out;
  Job job = submit_ok(client, spec);
  JobResult r = wait_done(job);
  CHECK(r.output_size == size);
  CHECK(std::memcmp(in.data(), out.data(), size) == 0);
  client.release(in);
  client.release(out);
}

}  // namespace gpuq::test
