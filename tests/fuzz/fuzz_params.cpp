// Fuzz target: the ParamBlock parser (common/src/params.cpp) on a block of any length, as a worker
// reads it from an untrusted descriptor. A block that parses must encode back, entry by entry
// through ParamWriter, to exactly the same bytes; lookups on every parsed key must not fail
// other than with InvalidArgument.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <variant>

#include "gpuq/common/assert.hpp"
#include "gpuq/common/params.hpp"
#include "gpuq/common/shm_layout.hpp"

namespace gpuq::fuzz {
namespace {

void run(const uint8_t* data, size_t size) {
  auto block = ParamBlock::parse(data, size);
  if (!block) {
    GPUQ_ASSERT(block.error().code() == ErrorCode::kInvalidArgument);
    GPUQ_ASSERT(!block.error().message().empty());
    return;
  }
  GPUQ_ASSERT(size <= kMaxParamBytes);
  ParamWriter writer;
  for (const Param& p : block->entries()) {
    GPUQ_ASSERT(!p.key.empty() && p.key.size() <= kMaxParamKeyBytes);
    auto added = writer.add(p.key, p.value);
    GPUQ_ASSERT(added.ok());
    GPUQ_ASSERT(block->find(p.key) != nullptr);
    auto i = block->get_int(p.key, 0, INT64_MIN, INT64_MAX);
    GPUQ_ASSERT(i.ok() || i.error().code() == ErrorCode::kInvalidArgument);
    if (const auto* s = std::get_if<std::string>(&p.value)) {
      GPUQ_ASSERT(s->size() <= kMaxParamStringBytes);
    }
  }
  GPUQ_ASSERT(writer.size() == size);
  GPUQ_ASSERT(size == 0 || std::memcmp(writer.data(), data, size) == 0);
}

}  // namespace
}  // namespace gpuq::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {  // NOLINT
  gpuq::fuzz::run(data, size);
  return 0;
}
