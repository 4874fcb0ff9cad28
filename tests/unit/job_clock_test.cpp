// Unit tests of job stamps (gpuq/common/clock.hpp, "Job stamps"): the clock's names, the choice
// between the TSC and CLOCK_MONOTONIC, the TSC's measured rate, the conversion to nanoseconds,
// and the config key `job_clock`.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include "config.hpp"
#include "gpuq/common/clock.hpp"

namespace gpuq {
namespace {

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// A file holding `text`, removed with the object.
struct TempFile {
  explicit TempFile(const std::string& text) {
    char name[] = "/tmp/gpuq-clocksource-XXXXXX";
    const int fd = ::mkstemp(name);
    REQUIRE(fd >= 0);
    ::close(fd);
    path = name;
    std::ofstream(path) << text;
  }
  ~TempFile() { ::unlink(path.c_str()); }
  std::string path;
};

TEST_CASE("job clock names: tsc and monotonic, nothing else") {
  for (StampClock c : {StampClock::kTsc, StampClock::kMonotonic}) {
    auto back = parse_stamp_clock(stamp_clock_name(c));
    REQUIRE(back.ok());
    CHECK(*back == c);
  }
  for (const char* bad : {"", "TSC", "hpet", "auto", "monotonic "}) {
    CAPTURE(bad);
    auto r = parse_stamp_clock(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == ErrorCode::kInvalidArgument);
    CHECK(contains(r.error().message(), "tsc"));
  }
}

TEST_CASE("the TSC is used only where the kernel keeps time with it") {
#if defined(__x86_64__)
  CHECK(tsc_unusable_reason(TempFile("tsc\n").path.c_str()).empty());
  const std::string kvm = tsc_unusable_reason(TempFile("kvm-clock\n").path.c_str());
  CHECK_MESSAGE(contains(kvm, "'kvm-clock'"), kvm);
  const std::string hpet = tsc_unusable_reason(TempFile("hpet").path.c_str());
  CHECK_MESSAGE(contains(hpet, "'hpet'"), hpet);
  const std::string empty = tsc_unusable_reason(TempFile("").path.c_str());
  CHECK_MESSAGE(contains(empty, "cannot read"), empty);
  const std::string missing = tsc_unusable_reason("/nonexistent/current_clocksource");
  CHECK_MESSAGE(contains(missing, "cannot read /nonexistent/current_clocksource"), missing);
#else
  CHECK_FALSE(tsc_unusable_reason(TempFile("tsc\n").path.c_str()).empty());
#endif
}

TEST_CASE("stamp differences convert to nanoseconds") {
  StampScale mono;
  CHECK(mono.to_ns(0) == 0);
  CHECK(mono.to_ns(123456789) == 123456789);
  StampScale tsc{StampClock::kTsc, 0.25};  // a 4 GHz counter
  CHECK(tsc.to_ns(4000) == 1000);
  CHECK(tsc.to_ns(6) == 2);  // 1.5 rounds to 2
  CHECK(tsc.to_ns(0) == 0);
}

TEST_CASE("the TSC's measured rate turns TSC differences into CLOCK_MONOTONIC time") {
  const std::string why = tsc_unusable_reason();
  if (!why.empty()) {
    MESSAGE("skipped: " << why);
    return;
  }
  TscRate rate;
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const StampScale scale{StampClock::kTsc, rate.ns_per_tick()};
  CHECK(scale.ns_per_tick > 0.01);
  CHECK(scale.ns_per_tick < 100.0);
  // Then a fresh interval, measured both ways.
  const uint64_t t0 = read_stamp(StampClock::kTsc);
  const uint64_t n0 = monotonic_ns();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const uint64_t t1 = read_stamp(StampClock::kTsc);
  const uint64_t n1 = monotonic_ns();
  const double by_tsc = static_cast<double>(scale.to_ns(t1 - t0));
  const double by_clock = static_cast<double>(n1 - n0);
  // Within 1 %: the rate is good to parts per million; the rest is the reads' own spacing.
  CHECK(by_tsc > by_clock * 0.99);
  CHECK(by_tsc < by_clock * 1.01);
}

TEST_CASE("monotonic stamps are CLOCK_MONOTONIC nanoseconds") {
  const uint64_t before = monotonic_ns();
  const uint64_t stamp = read_stamp(StampClock::kMonotonic);
  const uint64_t after = monotonic_ns();
  CHECK(stamp >= before);
  CHECK(stamp <= after);
}

TEST_CASE("config: job_clock is auto, tsc or monotonic") {
  const std::vector<int> cpus = {0};
  auto parse = [&](const std::string& value) {
    return daemon::parse_config(R"({"job_clock":)" + value + "}", cpus);
  };
  auto defaulted = daemon::parse_config("{}", cpus);
  REQUIRE(defaulted.ok());
  CHECK_FALSE(defaulted->job_clock.has_value());
  auto automatic = parse(R"("auto")");
  REQUIRE(automatic.ok());
  CHECK_FALSE(automatic->job_clock.has_value());
  auto tsc = parse(R"("tsc")");
  REQUIRE(tsc.ok());
  CHECK(tsc->job_clock == StampClock::kTsc);
  auto mono = parse(R"("monotonic")");
  REQUIRE(mono.ok());
  CHECK(mono->job_clock == StampClock::kMonotonic);
  for (const char* bad : {R"("hpet")", "1", "null", "true", R"(["tsc"])"}) {
    CAPTURE(bad);
    auto r = parse(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == ErrorCode::kInvalidArgument);
    CHECK_MESSAGE(contains(r.error().message(), "job_clock"), r.error().message());
  }
}

// Not a clock key, but the same parser: the time-limit keys (docs/config.md).
TEST_CASE("config: job_time_limit_ms per pool and cancel_grace_ms, with their ranges") {
  const std::vector<int> cpus = {0};
  auto defaulted = daemon::parse_config("{}", cpus);
  REQUIRE(defaulted.ok());
  CHECK(defaulted->cancel_grace_ms == 1000);
  CHECK(defaulted->pools.at(0).job_time_limit_ms == 0);
  auto set = daemon::parse_config(
      R"({"cancel_grace_ms":0,"pools":[{"name":"a","job_time_limit_ms":4294967295},)"
      R"({"name":"g","kind":"gpu","job_time_limit_ms":250}]})",
      cpus);
  REQUIRE_MESSAGE(set.ok(), (set.ok() ? "" : set.error().message()));
  CHECK(set->cancel_grace_ms == 0);
  CHECK(set->pools.at(0).job_time_limit_ms == 4294967295u);
  CHECK(set->pools.at(1).job_time_limit_ms == 250);
  for (const char* bad :
       {R"({"cancel_grace_ms":600001})", R"({"cancel_grace_ms":-1})", R"({"cancel_grace_ms":"1s"})",
        R"({"pools":[{"name":"a","job_time_limit_ms":-5}]})",
        R"({"pools":[{"name":"a","job_time_limit_ms":4294967296}]})",
        R"({"pools":[{"name":"a","job_time_limit_ms":1.5}]})"}) {
    CAPTURE(bad);
    auto r = daemon::parse_config(bad, cpus);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == ErrorCode::kInvalidArgument);
    const std::string& m = r.error().message();
    CHECK_MESSAGE((contains(m, "cancel_grace_ms") || contains(m, "pools[0].job_time_limit_ms")), m);
  }
}

}  // namespace
}  // namespace gpuq
