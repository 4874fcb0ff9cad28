// PayloadArena: where a client's blocks lie in its payload segment (Client::allocate and
// release). Offsets only: it never touches the segment's memory. Blocks are 64-byte aligned;
// those of 4 MiB or more are placed from the top of the highest free run that fits, smaller
// ones from the bottom of the lowest, so that small blocks (which come and go often, or are
// kept) do not split the room large ones need. A released block merges with its free
// neighbours. Thread-safe (one process-local mutex).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>

#include "gpuq/error.hpp"

namespace gpuq {

class PayloadArena {
 public:
  static constexpr uint64_t kAlignment = 64;
  static constexpr uint64_t kLargeBlockBytes = 4ull << 20;

  explicit PayloadArena(uint64_t bytes = 0) { reset(bytes); }

  // Forgets every block: the whole `bytes` is one free run.
  void reset(uint64_t bytes);

  // The offset of a new block of `size` bytes (> 0; rounded up to kAlignment). Errors:
  // OutOfMemory, naming the size asked, the arena's, the bytes free, the largest free run and
  // the blocks in use.
  Result<uint64_t> allocate(uint64_t size);

  // Frees the block at `offset`. One that is not a block's start (or was freed already) is
  // ignored: a caller's double release must not corrupt the map.
  void release(uint64_t offset);

  uint64_t bytes() const noexcept { return bytes_; }
  uint64_t blocks_in_use() const;

 private:
  uint64_t bytes_ = 0;
  mutable std::mutex mutex_;
  std::map<uint64_t, uint64_t> free_;  // offset -> size
  std::map<uint64_t, uint64_t> used_;  // offset -> size
};

}  // namespace gpuq
