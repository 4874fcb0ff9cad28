// A worker's restart and start back-off (daemon/supervisor/start_backoff.hpp), played as a
// sequence of deaths with made-up times, and its config keys (docs/config.md).
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "config.hpp"
#include "start_backoff.hpp"

namespace gpuq::daemon {
namespace {

constexpr uint64_t kMs = 1'000'000;
constexpr uint64_t kSecond = 1000 * kMs;

BackoffSettings settings() {
  BackoffSettings s;
  s.restart_initial_ms = 100;
  s.restart_max_ms = 1000;
  s.start_initial_ms = 500;
  s.start_max_ms = 4000;
  s.max_start_failures = 3;
  return s;
}

TEST_CASE("start back-off: deaths after ready double the restart delay up to its max") {
  StartBackoff b(settings());
  uint64_t now = kSecond;
  std::vector<uint32_t> delays;
  for (int i = 0; i < 6; ++i) {
    b.ready(now);
    now += kSecond;  // ran ready for a second: not long enough to reset the back-off
    const StartBackoff::Next next = b.exited(/*was_ready=*/true, now);
    CHECK_FALSE(next.failed);
    delays.push_back(next.delay_ms);
  }
  CHECK(delays == std::vector<uint32_t>{100, 200, 400, 800, 1000, 1000});
  CHECK(b.start_failures() == 0);
  CHECK_FALSE(b.failing());

  // Ready for longer than kStableRunNs: the next death starts from the initial delay again.
  b.ready(now);
  now += StartBackoff::kStableRunNs + kMs;
  CHECK(b.exited(true, now).delay_ms == 100);
  b.ready(now);
  now += kSecond;
  CHECK(b.exited(true, now).delay_ms == 200);  // and doubles from there
}

TEST_CASE(
    "start back-off: failed starts are failed from max_start_failures on, and never "
    "given up on") {
  StartBackoff b(settings());
  const uint64_t now = kSecond;
  std::vector<uint32_t> delays;
  std::vector<bool> failed;
  for (int i = 0; i < 40; ++i) {
    const StartBackoff::Next next = b.exited(/*was_ready=*/false, now);
    delays.push_back(next.delay_ms);
    failed.push_back(next.failed);
  }
  // Two quick restarts on the restart back-off, then the start back-off from the third
  // failure: 500 ms doubling to 4 s, and 4 s for good (no overflow however many there are).
  CHECK(std::vector<uint32_t>(delays.begin(), delays.begin() + 7) ==
        std::vector<uint32_t>{100, 200, 500, 1000, 2000, 4000, 4000});
  CHECK(delays.back() == 4000);
  CHECK(std::vector<bool>(failed.begin(), failed.begin() + 4) ==
        std::vector<bool>{false, false, true, true});
  CHECK(failed.back());
  CHECK(b.start_failures() == 40);
  CHECK(b.failing());

  // It comes back: ready ends the run of failures.
  b.ready(now);
  CHECK(b.start_failures() == 0);
  CHECK_FALSE(b.failing());
  const StartBackoff::Next after = b.exited(false, now + kMs);
  CHECK_FALSE(after.failed);
  CHECK(b.start_failures() == 1);
}

TEST_CASE("start back-off: max_start_failures 1 makes the first failed start failed") {
  BackoffSettings s = settings();
  s.max_start_failures = 1;
  StartBackoff b(s);
  const StartBackoff::Next next = b.exited(false, kSecond);
  CHECK(next.failed);
  CHECK(next.delay_ms == 500);
}

TEST_CASE("start back-off: the settings come from the config's keys") {
  Config c;
  c.restart_backoff_initial_ms = 7;
  c.restart_backoff_max_ms = 70;
  c.start_backoff_initial_ms = 9;
  c.start_backoff_max_ms = 90;
  c.max_start_failures = 2;
  const BackoffSettings s = BackoffSettings::of(c);
  CHECK(s.restart_initial_ms == 7);
  CHECK(s.restart_max_ms == 70);
  CHECK(s.start_initial_ms == 9);
  CHECK(s.start_max_ms == 90);
  CHECK(s.max_start_failures == 2);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST_CASE(
    "config: start_backoff_initial_ms, start_backoff_max_ms, start_timeout_ms and "
    "pool_down_fail_ms") {
  const std::vector<int> cpus = {0};
  auto defaulted = parse_config("{}", cpus);
  REQUIRE(defaulted.ok());
  CHECK(defaulted->start_timeout_ms == 600000);
  CHECK(defaulted->start_backoff_initial_ms == 1000);
  CHECK(defaulted->start_backoff_max_ms == 60000);
  CHECK(defaulted->pool_down_fail_ms == 10000);
  CHECK(defaulted->max_start_failures == 5);

  auto set = parse_config(
      R"({"start_backoff_initial_ms":50,"start_backoff_max_ms":50,"pool_down_fail_ms":0,)"
      R"("start_timeout_ms":0})",
      cpus);
  REQUIRE_MESSAGE(set.ok(), (set.ok() ? "" : set.error().message()));
  CHECK(set->start_backoff_initial_ms == 50);
  CHECK(set->start_backoff_max_ms == 50);
  CHECK(set->pool_down_fail_ms == 0);  // 0: jobs wait, the pool is never down
  CHECK(set->start_timeout_ms == 0);   // 0: a start may take as long as it takes

  struct Bad {
    const char* config;
    const char* names;
  };
  for (const Bad& bad : {
           Bad{R"({"start_backoff_initial_ms":0})", "start_backoff_initial_ms"},
           Bad{R"({"start_backoff_initial_ms":"1s"})", "start_backoff_initial_ms"},
           Bad{R"({"start_backoff_max_ms":86400001})", "start_backoff_max_ms"},
           Bad{R"({"start_backoff_initial_ms":2000,"start_backoff_max_ms":1000})",
               "start_backoff_initial_ms: exceeds start_backoff_max_ms"},
           Bad{R"({"pool_down_fail_ms":-1})", "pool_down_fail_ms"},
           Bad{R"({"pool_down_fail_ms":1.5})", "pool_down_fail_ms"},
           Bad{R"({"pool_down_fail_ms":86400001})", "pool_down_fail_ms"},
           Bad{R"({"start_timeout_ms":-5})", "start_timeout_ms"},
           Bad{R"({"start_timeout_ms":"10m"})", "start_timeout_ms"},
       }) {
    CAPTURE(bad.config);
    auto r = parse_config(bad.config, cpus);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == ErrorCode::kInvalidArgument);
    CHECK_MESSAGE(contains(r.error().message(), bad.names), r.error().message());
  }
}

}  // namespace
}  // namespace gpuq::daemon
