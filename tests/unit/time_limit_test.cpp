// effective_time_limit_ms (common/include/gpuq/common/time_limit.hpp): the limit a job is held
// to, the smaller of its pool's and its own, where 0 is none.
#include "gpuq/common/time_limit.hpp"

#include <doctest/doctest.h>

#include <cstdint>

namespace gpuq {
namespace {

TEST_CASE("effective_time_limit_ms: no limit on either side is none") {
  CHECK(effective_time_limit_ms(0, 0) == 0);
}

TEST_CASE("effective_time_limit_ms: one side's limit applies when the other has none") {
  CHECK(effective_time_limit_ms(300, 0) == 300);  // the pool's
  CHECK(effective_time_limit_ms(0, 250) == 250);  // the job's own
}

TEST_CASE("effective_time_limit_ms: a job's own limit shortens its pool's, never lengthens it") {
  CHECK(effective_time_limit_ms(300, 100) == 100);
  CHECK(effective_time_limit_ms(300, 5000) == 300);
  CHECK(effective_time_limit_ms(300, 300) == 300);
  CHECK(effective_time_limit_ms(UINT32_MAX, 1) == 1);
  CHECK(effective_time_limit_ms(1, UINT32_MAX) == 1);
}

// Usable where a constant is needed.
static_assert(effective_time_limit_ms(300, 100) == 100);
static_assert(effective_time_limit_ms(0, 0) == 0);

}  // namespace
}  // namespace gpuq
