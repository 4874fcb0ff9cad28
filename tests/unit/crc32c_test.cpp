// Unit tests of crc32c (common/include/gpuq/common/crc32c.hpp): published check values, and
// that computing in pieces gives the one-shot value whatever the split and the alignment.
#include "gpuq/common/crc32c.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace gpuq {
namespace {

// Bit-at-a-time CRC32C straight from the definition (reflected polynomial 0x82F63B78), to
// check the fast paths against on arbitrary data.
uint32_t reference_crc32c(const uint8_t* p, size_t n) {
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc & 1) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
  }
  return ~crc;
}

TEST_CASE("crc32c matches the published check values") {
  const std::string digits = "123456789";
  std::vector<uint8_t> zeros(32, 0x00), ones(32, 0xFF), up(32), down(32);
  for (int i = 0; i < 32; ++i) {
    up[i] = static_cast<uint8_t>(i);
    down[i] = static_cast<uint8_t>(31 - i);
  }

  CHECK(crc32c(digits.data(), digits.size()) == 0xE3069283u);  // the CRC catalogue's check
  // RFC 3720 (iSCSI), appendix B.4.
  CHECK(crc32c(zeros.data(), zeros.size()) == 0x8A9136AAu);
  CHECK(crc32c(ones.data(), ones.size()) == 0x62A8AB43u);
  CHECK(crc32c(up.data(), up.size()) == 0x46DD794Eu);
  CHECK(crc32c(down.data(), down.size()) == 0x113FDB5Cu);
  CHECK(crc32c(nullptr, 0) == 0u);
}

TEST_CASE("crc32c agrees with a bitwise reference for every length and alignment") {
  std::mt19937 rng(12345);
  std::vector<uint8_t> data(300);
  for (auto& b : data) b = static_cast<uint8_t>(rng());

  for (size_t offset = 0; offset < 8; ++offset) {
    for (size_t len = 0; offset + len <= data.size(); len += (len < 40 ? 1 : 37)) {
      CAPTURE(offset);
      CAPTURE(len);
      CHECK(crc32c(data.data() + offset, len) == reference_crc32c(data.data() + offset, len));
    }
  }
}

TEST_CASE("crc32c computed in pieces equals the one-shot value") {
  std::mt19937 rng(777);
  std::vector<uint8_t> data(1000);
  for (auto& b : data) b = static_cast<uint8_t>(rng());
  const uint32_t whole = crc32c(data.data(), data.size());

  for (size_t split = 0; split <= data.size(); split += (split < 20 ? 1 : 61)) {
    CAPTURE(split);
    const uint32_t first = crc32c(data.data(), split);
    CHECK(crc32c(data.data() + split, data.size() - split, first) == whole);
  }
  uint32_t bytewise = 0;
  for (uint8_t b : data) bytewise = crc32c(&b, 1, bytewise);
  CHECK(bytewise == whole);
}

TEST_CASE("crc32c detects a single flipped bit") {
  std::vector<uint8_t> data(64, 0x5A);
  const uint32_t before = crc32c(data.data(), data.size());

  data[17] ^= 0x04;

  CHECK(crc32c(data.data(), data.size()) != before);
}

}  // namespace
}  // namespace gpuq
