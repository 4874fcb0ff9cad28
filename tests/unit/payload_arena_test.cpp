// PayloadArena (libclient/src/payload_arena.hpp): where a client's blocks lie in its segment.
#include "payload_arena.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace gpuq {
namespace {

constexpr uint64_t kMiB = 1ull << 20;

uint64_t take(PayloadArena& a, uint64_t size) {
  auto r = a.allocate(size);
  REQUIRE_MESSAGE(r.ok(), "allocate(" << size << "): " << r.error().to_string());
  return *r;
}

TEST_CASE("small blocks from the bottom, large ones from the top, aligned") {
  PayloadArena a(64 * kMiB);
  CHECK(take(a, 1) == 0);
  CHECK(take(a, 100) == 64);  // rounded up to 64
  CHECK(take(a, 8 * kMiB) == 56 * kMiB);
  CHECK(take(a, 4 * kMiB) == 52 * kMiB);
  CHECK(take(a, 64) == 192);
  CHECK(a.blocks_in_use() == 5);
}

TEST_CASE("released blocks merge with their neighbours; double release is ignored") {
  PayloadArena a(16 * kMiB);
  const uint64_t x = take(a, kMiB);
  const uint64_t y = take(a, kMiB);
  const uint64_t z = take(a, kMiB);
  a.release(y);
  a.release(y);
  a.release(12345);  // not a block's start
  CHECK(a.blocks_in_use() == 2);
  a.release(x);
  a.release(z);
  CHECK(a.blocks_in_use() == 0);
  // Everything merged back into one run: the whole arena fits again.
  CHECK(take(a, 16 * kMiB) == 0);
}

TEST_CASE("OutOfMemory names the size, the free bytes, the largest run and the blocks in use") {
  PayloadArena a(16 * kMiB);
  std::vector<uint64_t> blocks;
  blocks.reserve(16);
  for (int i = 0; i < 16; ++i) blocks.push_back(take(a, kMiB));
  for (int i = 0; i < 16; i += 2) a.release(blocks[i]);  // 8 free runs of 1 MiB
  auto r = a.allocate(2 * kMiB);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code() == ErrorCode::kOutOfMemory);
  const std::string m = r.error().message();
  CHECK(m.find("no free run of 2097152 bytes in the 16777216-byte payload segment") !=
        std::string::npos);
  CHECK(m.find("8388608 bytes free, the largest run 1048576, 8 blocks in use") !=
        std::string::npos);
  auto huge = a.allocate(17 * kMiB);
  REQUIRE_FALSE(huge.ok());
  CHECK(huge.error().message().find("exceed the 16777216-byte payload segment") !=
        std::string::npos);
}

TEST_CASE("random sizes and lifetimes: blocks never overlap and all room comes back") {
  PayloadArena a(256 * kMiB);
  std::mt19937_64 rng(42);
  std::vector<std::pair<uint64_t, uint64_t>> live;  // offset, size
  for (int step = 0; step < 20000; ++step) {
    if (!live.empty() && (rng() % 2 == 0 || live.size() > 64)) {
      const size_t i = rng() % live.size();
      a.release(live[i].first);
      live[i] = live.back();
      live.pop_back();
      continue;
    }
    const uint64_t size = rng() % 4 == 0 ? (1 + rng() % 16) * kMiB : 1 + rng() % 65536;
    auto r = a.allocate(size);
    if (!r.ok()) continue;  // full for now
    CHECK(*r % PayloadArena::kAlignment == 0);
    CHECK(*r + size <= a.bytes());
    for (const auto& block : live) {
      const uint64_t off = block.first, len = block.second;
      REQUIRE_MESSAGE((*r + size <= off || off + len <= *r),
                      "block at " << *r << " overlaps the one at " << off);
    }
    live.emplace_back(*r, size);
  }
  for (const auto& [off, len] : live) a.release(off);
  CHECK(a.blocks_in_use() == 0);
  CHECK(take(a, 256 * kMiB) == 0);
}

}  // namespace
}  // namespace gpuq
