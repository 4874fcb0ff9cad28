// gpuq::Buffer: a span of a client's payload segment. Part of the C++ API (gpuq/client.hpp
// includes it); a header of its own so that gpuq/tensor.hpp can use it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gpuq {

// A buffer in the client's payload segment: the memory workers read inputs from and write
// outputs to, in place. Valid while the Client lives and until release().
struct Buffer {
  uint64_t offset = 0;  // from the start of the payload arena
  uint64_t size = 0;
  std::byte* ptr = nullptr;  // this process's address of the first byte (null for a raw view)

  std::byte* data() const noexcept { return ptr; }
  // A part of this buffer: [offset + from, offset + from + length).
  Buffer slice(uint64_t from, uint64_t length) const noexcept {
    return Buffer{offset + from, length, ptr == nullptr ? nullptr : ptr + from};
  }
  bool empty() const noexcept { return size == 0; }
};

}  // namespace gpuq
