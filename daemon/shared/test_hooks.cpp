#include "test_hooks.hpp"

#include <time.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <string>
#include <string_view>

#include "gpuq/common/log.hpp"
#include "gpuq/common/posix_call.hpp"

namespace gpuq::daemon {
namespace {

Error bad_variable(const char* name, std::string_view value, const std::string& what) {
  return Error(ErrorCode::kInvalidArgument,
               std::string(name) + "='" + std::string(value) + "': " + what);
}

Result<uint32_t> parse_u32(const char* name, std::string_view v, uint32_t min, uint32_t max) {
  uint32_t x = 0;
  auto r = std::from_chars(v.data(), v.data() + v.size(), x);
  if (v.empty() || r.ec != std::errc() || r.ptr != v.data() + v.size() || x < min || x > max) {
    return bad_variable(
        name, v,
        "must be an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
  }
  return x;
}

// Reads `name` into `out` if it is set.
Result<void> read_u32(const char* name, uint32_t min, uint32_t max, uint32_t& out) {
  const char* v = std::getenv(name);
  if (v == nullptr) return {};
  auto x = parse_u32(name, v, min, max);
  if (!x) return x.error();
  out = *x;
  return {};
}

void sleep_ms(uint32_t ms) {
  timespec t{static_cast<time_t>(ms / 1000), static_cast<long>(ms % 1000) * 1'000'000};
  // After EINTR the wrapper sleeps again for what is left (nanosleep wrote it to t). The only
  // other failure, EINVAL, cannot happen with the value built above.
  (void)GPUQ_POSIX_CALL(::nanosleep, &t, &t);
}

}  // namespace

Result<TestHooks> read_test_hooks() {
  TestHooks h;
  const char* on = std::getenv("GPUQ_TEST_HOOKS");
  if (on == nullptr || std::string_view(on) != "1") return h;
  h.enabled = true;
  if (auto r = read_u32("GPUQ_TEST_STALL_MS", 1, 600000, h.stall_ms); !r) return r.error();
  if (auto r = read_u32("GPUQ_TEST_WORKER_START_DELAY_MS", 0, 600000, h.worker_start_delay_ms);
      !r) {
    return r.error();
  }
  if (const char* v = std::getenv("GPUQ_TEST_WORKER_FAIL"); v != nullptr) {
    std::string_view list(v);
    for (;;) {
      const size_t comma = list.find(',');
      auto id = parse_u32("GPUQ_TEST_WORKER_FAIL", list.substr(0, comma), 0, 1u << 20);
      if (!id) {
        return bad_variable("GPUQ_TEST_WORKER_FAIL", v,
                            "must be a comma-separated list of worker ids");
      }
      h.failing_workers.push_back(*id);
      if (comma == std::string_view::npos) break;
      list.remove_prefix(comma + 1);
    }
  }
  if (const char* v = std::getenv("GPUQ_TEST_GPU_WORKER"); v != nullptr) {
    if (std::string_view(v) != "real") {
      return bad_variable("GPUQ_TEST_GPU_WORKER", v,
                          "must be 'real' (gpu pools on fake GPUs run the program they would "
                          "run without hooks), or unset");
    }
    h.real_gpu_worker = true;
  }
  return h;
}

int run_worker_test_hooks(uint32_t worker_id) {
  auto hooks = read_test_hooks();
  if (!hooks) {
    GPUQ_LOG_ERROR("test hooks: %s", hooks.error().message().c_str());
    return 2;
  }
  if (!hooks->enabled) return -1;
  if (hooks->worker_start_delay_ms > 0) {
    GPUQ_LOG_WARN("test hook: delaying start-up by %u ms", hooks->worker_start_delay_ms);
    sleep_ms(hooks->worker_start_delay_ms);
  }
  const auto& fail = hooks->failing_workers;
  if (std::find(fail.begin(), fail.end(), worker_id) != fail.end()) {
    GPUQ_LOG_WARN("test hook: GPUQ_TEST_WORKER_FAIL names worker %u: exiting with status 3",
                  worker_id);
    return 3;
  }
  return -1;
}

}  // namespace gpuq::daemon
