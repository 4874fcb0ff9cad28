// The input formats of the fuzz targets in tests/fuzz, shared by the targets and by
// make_seed_corpus.cpp, which writes the seed corpus in these formats.
//
// fuzz_descriptor: one input is
//   [0, 256)    a JobDescriptor, byte for byte as a client writes it into its slot (a shorter
//               input is zero-filled)
//   [256, 264)  u64 arena word: the payload arena size for a bounds-only validation (any value);
//               the arena the op really runs on holds (arena word % (kMaxFuzzArenaBytes + 1))
//               bytes
//   [264]       u8 the pool whose ring carried the job (the worker's own pool)
//   [265, ...)  the first bytes of the arena (the rest of it is zero)
// fuzz_params: the bytes are a ParamBlock encoding (params.hpp), of any length.
// fuzz_protocol: the bytes are one datagram received on a control socket (protocol.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "gpuq/common/shm_layout.hpp"

namespace gpuq::fuzz {

inline constexpr size_t kDescriptorBytes = sizeof(JobDescriptor);
inline constexpr size_t kArenaWordAt = kDescriptorBytes;
inline constexpr size_t kPoolAt = kArenaWordAt + sizeof(uint64_t);
inline constexpr size_t kArenaContentAt = kPoolAt + 1;
inline constexpr uint64_t kMaxFuzzArenaBytes = 64 * 1024;

// The most a fuzzed Hello may ask for (the daemon's max_client_segment_bytes).
inline constexpr uint64_t kFuzzMaxClientSegmentBytes = uint64_t{1} << 30;

}  // namespace gpuq::fuzz
