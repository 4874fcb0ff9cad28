// Unit tests of the worker's descriptor validation (daemon/worker/job_validation.cpp): each bad
// field gets its own error, naming the field; a good descriptor passes.
#include "job_validation.hpp"

#include <doctest/doctest.h>

#include <cstring>
#include <string>

namespace gpuq::daemon {
namespace {

constexpr uint64_t kArena = 1 << 20;
constexpr uint32_t kPool = 0;

JobDescriptor echo_descriptor() {
  JobDescriptor d;
  std::memset(&d, 0, sizeof d);
  d.op_id = 2;  // echo
  d.pool_id = kPool;
  d.input_offset = 0;
  d.input_bytes = 4096;
  d.output_offset = 4096;
  d.output_capacity = 4096;
  d.deadline_ns = kNoDeadline;
  return d;
}

// The error of validating `d`, or "" if it passed.
std::string problem(const JobDescriptor& d) {
  auto v = validate_descriptor(d, kArena, kPool);
  return v ? std::string() : v.error().to_string();
}

TEST_CASE("a well-formed descriptor passes, with or without the retryable flag") {
  JobDescriptor d = echo_descriptor();
  CHECK(problem(d).empty());
  d.flags = kJobFlagRetryable;
  CHECK(problem(d).empty());
}

TEST_CASE("each bad field is rejected with an error that names it") {
  JobDescriptor d = echo_descriptor();
  d.flags = 0x80;
  CHECK(problem(d).find("flags") != std::string::npos);

  d = echo_descriptor();
  d.op_id = 999;
  CHECK(problem(d).find("UnknownOp") != std::string::npos);

  d = echo_descriptor();
  d.pool_id = 3;
  CHECK(problem(d).find("pool_id") != std::string::npos);

  d = echo_descriptor();
  d.input_offset = kArena - 10;  // runs past the arena
  CHECK(problem(d).find("input") != std::string::npos);

  d = echo_descriptor();
  d.output_offset = ~uint64_t{0} - 8;  // offset + length overflows
  CHECK(problem(d).find("output") != std::string::npos);

  d = echo_descriptor();
  d.params_bytes = 4'000'000'000u;  // more than the descriptor holds
  CHECK(problem(d).find("params") != std::string::npos);
}

}  // namespace
}  // namespace gpuq::daemon
