// Validation of a job descriptor copied out of a client's segment. Every field is untrusted:
// op id, pool, buffer offsets and lengths (checked without overflow against the arena size the
// supervisor gave the worker, never a size read from the segment), parameter block.
#pragma once

#include <cstdint>

#include "gpuq/common/params.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "ops.hpp"

namespace gpuq::daemon {

struct ValidatedJob {
  const OpInfo* op;
  uint64_t input_offset, input_bytes;
  uint64_t output_offset, output_capacity;
  ParamBlock params;
  uint32_t stream_window = 0;  // parts that may wait unread; 0: not a stream
};

// Errors: UnknownOp (op_id), InvalidArgument naming the field (pool_id, input/output range,
// the stream window and its cells, params). Pure function; thread-safe.
Result<ValidatedJob> validate_descriptor(const JobDescriptor& d, uint64_t arena_bytes,
                                         uint32_t expected_pool);

}  // namespace gpuq::daemon
