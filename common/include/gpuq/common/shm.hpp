// Shared-memory segments.
//   - QueueSegment: the daemon's queue segment, a named POSIX shared-memory object created,
//     sized, mapped and removed with Boost.Interprocess.
//   - MemfdSegment: a client's payload segment, an anonymous memfd sealed against resizing (so
//     a client cannot shrink it under a worker and make it fault), passed by SCM_RIGHTS.
// Neither type uses a lock in shared memory.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "gpuq/common/unique_fd.hpp"
#include "gpuq/error.hpp"

namespace gpuq {

class QueueSegment {
 public:
  QueueSegment();
  QueueSegment(QueueSegment&&) noexcept;
  QueueSegment& operator=(QueueSegment&&) noexcept;
  ~QueueSegment();

  // Creates `name` (fails if it exists) with permission bits `mode`, sizes it to `bytes`
  // (zero-filled) and maps it read-write.
  static Result<QueueSegment> create(const std::string& name, uint64_t bytes, unsigned mode);
  // Opens and maps an existing segment read-write.
  static Result<QueueSegment> open(const std::string& name);
  // Removes the name (mappings stay valid). True if it existed.
  static bool remove(const std::string& name);

  void* address() const noexcept;
  uint64_t size() const noexcept;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

class MemfdSegment {
 public:
  MemfdSegment() = default;
  MemfdSegment(MemfdSegment&&) noexcept;
  MemfdSegment& operator=(MemfdSegment&&) noexcept;
  MemfdSegment(const MemfdSegment&) = delete;
  MemfdSegment& operator=(const MemfdSegment&) = delete;
  ~MemfdSegment();

  // Creates a zero-filled memfd of `bytes`, seals its size, and maps it.
  static Result<MemfdSegment> create(const std::string& debug_name, uint64_t bytes);
  // Maps a received memfd; checks that it is at least `expected_bytes` long and sealed.
  static Result<MemfdSegment> map(UniqueFd fd, uint64_t expected_bytes);

  void* address() const noexcept { return address_; }
  uint64_t size() const noexcept { return size_; }
  int fd() const noexcept { return fd_.get(); }

 private:
  UniqueFd fd_;
  void* address_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace gpuq
