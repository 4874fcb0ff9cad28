#include "job_validation.hpp"

#include <cstdio>
#include <string>

namespace gpuq::daemon {
namespace {

std::string hex32(uint32_t v) {
  char text[9];
  std::snprintf(text, sizeof text, "%08x", v);
  return text;
}

// [offset, offset + length) inside [0, arena) without overflow.
Result<void> check_range(const char* which, uint64_t offset, uint64_t length, uint64_t arena) {
  if (offset > arena || length > arena - offset) {
    return Error(ErrorCode::kInvalidArgument,
                 std::string(which) + " buffer [offset " + std::to_string(offset) + ", length " +
                     std::to_string(length) + ") lies outside the client's " +
                     std::to_string(arena) + "-byte payload segment");
  }
  return {};
}

}  // namespace

Result<ValidatedJob> validate_descriptor(const JobDescriptor& d, uint64_t arena_bytes,
                                         uint32_t expected_pool) {
  const OpInfo* op = find_op(d.op_id);
  if (op == nullptr) {
    return Error(ErrorCode::kUnknownOp,
                 "op_id " + std::to_string(d.op_id) +
                     " is not an op of this worker's pool (a Python op runs only on the Python "
                     "pools whose modules define it)");
  }
  if ((d.flags & ~kJobFlagsKnown) != 0) {
    return Error(ErrorCode::kInvalidArgument,
                 "flags 0x" + hex32(d.flags) + " has bits this worker does not know");
  }
  if ((d.flags & kJobFlagPriorityMask) >> kJobFlagPriorityShift >= kPriorityLevels) {
    return Error(ErrorCode::kInvalidArgument,
                 "flags 0x" + hex32(d.flags) + " name no priority (0 normal, 1 high, 2 low)");
  }
  if (d.pool_id != expected_pool) {
    return Error(ErrorCode::kInvalidArgument,
                 "pool_id " + std::to_string(d.pool_id) + " does not match the pool (" +
                     std::to_string(expected_pool) + ") whose ring carried the job");
  }
  if (auto r = check_range("input", d.input_offset, d.input_bytes, arena_bytes); !r) {
    return r.error();
  }
  if (auto r = check_range("output", d.output_offset, d.output_capacity, arena_bytes); !r) {
    return r.error();
  }
  const uint32_t window = flags_stream_window(d.flags);
  if (window > kMaxStreamWindow) {
    return Error(ErrorCode::kInvalidArgument, "stream window " + std::to_string(window) +
                                                  " is more than " +
                                                  std::to_string(kMaxStreamWindow) + " parts");
  }
  if (window > 0 && (d.flags & kJobFlagRetryable) != 0) {
    return Error(ErrorCode::kInvalidArgument, "a stream cannot be retryable");
  }
  if (window > 0 && stream_cell_bytes(d.output_capacity, window) == 0) {
    return Error(ErrorCode::kInvalidArgument,
                 "a stream of window " + std::to_string(window) + " needs an output buffer of " +
                     std::to_string(window * 64) + " bytes or more (it has " +
                     std::to_string(d.output_capacity) + "): each part's cell is 64 or more");
  }
  if (d.params_bytes > kMaxParamBytes) {
    return Error(ErrorCode::kInvalidArgument, "params_bytes " + std::to_string(d.params_bytes) +
                                                  " exceeds " + std::to_string(kMaxParamBytes));
  }
  auto params = ParamBlock::parse(d.params, d.params_bytes);
  if (!params) return params.error();
  return ValidatedJob{
      op,    d.input_offset, d.input_bytes, d.output_offset, d.output_capacity, std::move(*params),
      window};
}

}  // namespace gpuq::daemon
