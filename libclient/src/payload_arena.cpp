#include "payload_arena.hpp"

#include <algorithm>
#include <iterator>
#include <string>

namespace gpuq {

void PayloadArena::reset(uint64_t bytes) {
  std::lock_guard lock(mutex_);
  bytes_ = bytes;
  free_.clear();
  used_.clear();
  if (bytes > 0) free_.emplace(0, bytes);
}

Result<uint64_t> PayloadArena::allocate(uint64_t size) {
  if (size > bytes_) {
    return Error(ErrorCode::kOutOfMemory, "allocate: " + std::to_string(size) +
                                              " bytes exceed the " + std::to_string(bytes_) +
                                              "-byte payload segment");
  }
  const uint64_t rounded = (size + kAlignment - 1) & ~(kAlignment - 1);
  std::lock_guard lock(mutex_);
  auto give = [&](uint64_t offset) {
    used_.emplace(offset, rounded);
    return offset;
  };
  if (rounded >= kLargeBlockBytes) {
    for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
      if (it->second < rounded) continue;
      const uint64_t offset = it->first + it->second - rounded;
      if (it->second == rounded) {
        free_.erase(std::next(it).base());
      } else {
        it->second -= rounded;
      }
      return give(offset);
    }
  } else {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < rounded) continue;
      const uint64_t offset = it->first;
      const uint64_t remaining = it->second - rounded;
      free_.erase(it);
      if (remaining > 0) free_.emplace(offset + rounded, remaining);
      return give(offset);
    }
  }
  uint64_t free_bytes = 0, largest = 0;
  for (const auto& [offset, run] : free_) {
    free_bytes += run;
    largest = std::max(largest, run);
  }
  return Error(ErrorCode::kOutOfMemory,
               "allocate: no free run of " + std::to_string(rounded) + " bytes in the " +
                   std::to_string(bytes_) + "-byte payload segment (" + std::to_string(free_bytes) +
                   " bytes free, the largest run " + std::to_string(largest) + ", " +
                   std::to_string(used_.size()) + " blocks in use)");
}

void PayloadArena::release(uint64_t offset) {
  std::lock_guard lock(mutex_);
  auto used = used_.find(offset);
  if (used == used_.end()) return;
  uint64_t size = used->second;
  used_.erase(used);
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && offset + size == next->first) {
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += size;
      return;
    }
  }
  free_.emplace(offset, size);
}

uint64_t PayloadArena::blocks_in_use() const {
  std::lock_guard lock(mutex_);
  return used_.size();
}

}  // namespace gpuq
