// Acceptance test: 100,000 echo jobs from 4 concurrent client processes, random sizes from 1 byte
// to 1 MiB, every output compared byte for byte with its input.
//
// Each client process is forked before it connects (a Client does not survive fork) and keeps
// several jobs in flight; it reports by exit status and writes its counts to a pipe. Sizes are
// uniform over log2(size) in [0, 20], so most jobs are small and a few are large. Before each
// job the output buffer is filled with the complement of the input, so an echo that skips any
// byte is caught. The seed is printed; GPUQ_TEST_SEED=<n> replays a run. Under a sanitizer the
// test runs 4 x 1,000 jobs.
#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cinttypes>
#include <cstdio>

#include "integration/integration_support.hpp"
#include "support/rng.hpp"

namespace gpuq::test {
namespace {

constexpr int kClients = 4;
constexpr uint64_t kJobsPerClient = (kThreadSanitizer || kAddressSanitizer) ? 1'000 : 25'000;
constexpr int kInFlight = 8;
constexpr uint64_t kMaxSize = 1ull << 20;

// What a client process reports through its pipe.
struct ClientReport {
  uint64_t completed = 0;   // jobs done with a byte-exact output
  uint64_t mismatches = 0;  // jobs done whose output differs from the input
  uint64_t failures = 0;    // submits or waits that failed, or jobs not done
  uint64_t bytes = 0;       // input bytes of the completed jobs
  uint64_t max_size = 0;
  uint64_t small_jobs = 0;  // jobs of at most 4 KiB
  char first_error[256] = {};
};

// Random input, and its complement in the output (which a correct echo overwrites entirely).
void fill(std::byte* in, std::byte* out, uint64_t size, Rng& rng) {
  uint64_t i = 0;
  for (; i + 8 <= size; i += 8) {
    const uint64_t w = rng.next();
    const uint64_t c = ~w;
    std::memcpy(in + i, &w, 8);
    std::memcpy(out + i, &c, 8);
  }
  if (i < size) {
    const uint64_t w = rng.next();
    for (uint64_t k = 0; i < size; ++i, ++k) {
      in[i] = static_cast<std::byte>(w >> (8 * k));
      out[i] = ~in[i];
    }
  }
}

void note_error(ClientReport& report, const std::string& what) {
  if (report.first_error[0] == '\0') {
    std::snprintf(report.first_error, sizeof report.first_error, "%s", what.c_str());
  }
}

// The body of one client process: no doctest here, only the report.
ClientReport run_client(int index, uint64_t seed, const std::string& dir, uint64_t jobs) {
  ClientReport report;
  ConnectOptions options = connect_options(dir, 2 * kInFlight * kMaxSize + (1ull << 20));
  options.name = "echo100k-" + std::to_string(index);
  auto client = Client::connect(options);
  if (!client) {
    report.failures = jobs;
    note_error(report, "connect: " + client.error().to_string());
    return report;
  }
  Rng rng(seed ^ (0xA0761D6478BD642Full * static_cast<uint64_t>(index + 1)));
  struct Slot {
    Buffer in, out;
    Job job;
    uint64_t size = 0;
    bool active = false;
  };
  std::array<Slot, kInFlight> slots;
  for (auto& s : slots) {
    auto in = client->allocate(kMaxSize);
    auto out = client->allocate(kMaxSize);
    if (!in || !out) {
      report.failures = jobs;
      note_error(report, "allocate failed");
      return report;
    }
    s.in = *in;
    s.out = *out;
  }
  uint64_t submitted = 0;
  auto submit = [&](Slot& s) {
    s.size = log_uniform_size(rng, kMaxSize);
    fill(s.in.data(), s.out.data(), s.size, rng);
    ++submitted;
    const JobSpec spec = job_spec("echo", s.in.slice(0, s.size), s.out.slice(0, s.size));
    auto job = client->submit(spec, std::chrono::seconds(60));
    if (!job) {
      ++report.failures;
      note_error(report, "submit: " + job.error().to_string());
      return;
    }
    s.job = std::move(job).value();
    s.active = true;
  };
  for (auto& s : slots) {
    if (submitted < jobs) submit(s);
  }
  // Slots were filled in order and are refilled in order, so slot i always holds the oldest job.
  for (size_t i = 0;; i = (i + 1) % kInFlight) {
    Slot& s = slots[i];
    if (!s.active) {
      if (submitted >= jobs) break;  // every slot idle and nothing left: done
      submit(s);
      continue;
    }
    auto r = s.job.wait(std::chrono::seconds(60));
    s.active = false;
    if (!r) {
      ++report.failures;
      note_error(report, "wait: " + r.error().to_string());
    } else if (r->status != JobStatus::kDone || r->output_size != s.size) {
      ++report.failures;
      note_error(report, "job of " + std::to_string(s.size) + " bytes ended " +
                             std::string(job_status_name(r->status)) + " (" +
                             std::string(error_code_name(r->code)) + ") with " +
                             std::to_string(r->output_size) + " bytes: " + r->message);
    } else if (std::memcmp(s.in.data(), s.out.data(), s.size) != 0) {
      ++report.mismatches;
      note_error(report, "output of a " + std::to_string(s.size) + "-byte echo differs");
    } else {
      ++report.completed;
      report.bytes += s.size;
      report.max_size = std::max(report.max_size, s.size);
      if (s.size <= 4096) ++report.small_jobs;
    }
    s.job = Job();
    if (submitted < jobs) submit(s);
  }
  return report;
}

TEST_CASE("100,000 echo jobs from 4 client processes come back byte for byte") {
  const uint64_t seed = test_seed(fresh_seed());
  std::printf("echo_100k: seed %" PRIu64 " (replay with GPUQ_TEST_SEED=%" PRIu64
              "), %d clients x %" PRIu64 " jobs\n",
              seed, seed, kClients, kJobsPerClient);
  std::fflush(stdout);
  INFO("seed " << seed);
  DaemonProcess daemon;  // the defaults: one worker per CPU
  const std::string dir = daemon.runtime_dir();

  const uint64_t start = monotonic_ns();
  std::array<pid_t, kClients> pids{};
  std::array<int, kClients> pipes{};
  for (int k = 0; k < kClients; ++k) {
    int fds[2];
    REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
    pids[k] = fork_child([&]() -> int {
      ::close(fds[0]);
      const ClientReport report = run_client(k, seed, dir, kJobsPerClient);
      const bool ok = ::write(fds[1], &report, sizeof report) == sizeof report;
      return ok && report.completed == kJobsPerClient && report.mismatches == 0 &&
                     report.failures == 0
                 ? 0
                 : 1;
    });
    ::close(fds[1]);
    REQUIRE(pids[k] > 0);
    pipes[k] = fds[0];
  }

  uint64_t completed = 0, bytes = 0, small = 0, largest = 0;
  for (int k = 0; k < kClients; ++k) {
    INFO("client process " << k);
    const ChildExit exit = wait_child(pids[k], 170 * kSecond);
    ClientReport report;
    const bool got = ::read(pipes[k], &report, sizeof report) == sizeof report;
    ::close(pipes[k]);
    CHECK_MESSAGE(exit.ok(), "client " << k << " " << exit.describe());
    REQUIRE_MESSAGE(got, "client " << k << " sent no report");
    INFO("first error: " << report.first_error);
    CHECK(report.completed == kJobsPerClient);
    CHECK(report.mismatches == 0);
    CHECK(report.failures == 0);
    completed += report.completed;
    bytes += report.bytes;
    small += report.small_jobs;
    largest = std::max(largest, report.max_size);
  }
  const double seconds = static_cast<double>(monotonic_ns() - start) / 1e9;
  std::printf("echo_100k: %" PRIu64 " jobs, %.2f GB, in %.1f s (%.0f jobs/s); %" PRIu64
              " of at most 4 KiB, largest %" PRIu64 " bytes\n",
              completed, static_cast<double>(bytes) / 1e9, seconds,
              static_cast<double>(completed) / seconds, small, largest);
  std::fflush(stdout);
  CHECK(completed == kClients * kJobsPerClient);
  // The daemon's own count agrees: every job reached a worker and completed there. (A worker
  // counts a job just after publishing its end: wait for the count to settle.)
  nlohmann::json status;
  const bool counted = wait_until(
      [&] {
        status = daemon.status();
        return status["pools"][0]["jobs_completed"] == kClients * kJobsPerClient;
      },
      10s);
  INFO("status: " << status.dump());
  CHECK(counted);
  for (const auto& w : status["pools"][0]["workers"]) {
    CHECK(w["jobs_failed"] == 0);
    CHECK(w["restarts"] == 0);
  }
  // The audit of overwritten ring cells and lost entries found nothing in honest traffic.
  CHECK(status["pools"][0]["ring_cells_retired"] == 0);
  CHECK(status["pools"][0]["ring_positions_restored"] == 0);
  CHECK(status["pools"][0]["jobs_requeued"] == 0);
}

}  // namespace
}  // namespace gpuq::test
