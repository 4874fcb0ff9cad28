// The tests' random numbers: xoshiro256** seeded through splitmix64. Fast enough to fill
// gigabytes of payload, and reproducible from the seed that a failing test prints.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace gpuq::test {

class Rng {
 public:
  explicit Rng(uint64_t seed) noexcept {
    for (auto& word : s_) {
      seed += 0x9E3779B97F4A7C15ull;  // splitmix64
      uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      word = z ^ (z >> 31);
    }
  }

  uint64_t next() noexcept {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }

  // Uniform in [lo, hi].
  uint64_t between(uint64_t lo, uint64_t hi) noexcept { return lo + next() % (hi - lo + 1); }
  bool chance(double p) noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53 < p; }

  void fill(void* p, size_t n) noexcept {
    auto* b = static_cast<unsigned char*>(p);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const uint64_t v = next();
      std::memcpy(b + i, &v, 8);
    }
    if (i < n) {
      const uint64_t v = next();
      std::memcpy(b + i, &v, n - i);
    }
  }

 private:
  static uint64_t rotl(uint64_t x, int k) noexcept { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

// A size from 1 to `max` bytes, uniform over its log2 (most jobs small, a few large): 1 byte,
// then (2^(e-1), 2^e] for e = 1, 2, ... up to `max`.
inline uint64_t log_uniform_size(Rng& rng, uint64_t max) noexcept {
  int max_log2 = 0;
  while ((uint64_t{2} << max_log2) <= max) ++max_log2;
  const int e = static_cast<int>(rng.between(0, static_cast<uint64_t>(max_log2)));
  if (e == 0) return 1;
  const uint64_t lo = (uint64_t{1} << (e - 1)) + 1;
  const uint64_t hi = std::min<uint64_t>(uint64_t{1} << e, max);
  return lo > hi ? hi : rng.between(lo, hi);
}

}  // namespace gpuq::test
