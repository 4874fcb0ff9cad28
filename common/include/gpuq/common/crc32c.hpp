// CRC32C (Castagnoli), as used by iSCSI, ext4 and many storage formats. Uses the SSE4.2 crc32
// instruction when the CPU has it, a table otherwise; both give the same value.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gpuq {

// CRC32C of `size` bytes at `data`, continuing from `crc` (0 to start). Thread-safe.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0) noexcept;

}  // namespace gpuq
