// Unit tests of the job parameter block (common/include/gpuq/common/params.hpp): encoding,
// decoding of untrusted bytes, typed lookups and command-line assignments.
#include "gpuq/common/params.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gpuq/common/shm_layout.hpp"
#include "support/test_support.hpp"

namespace gpuq {
namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

Result<ParamBlock> parse(const std::vector<uint8_t>& bytes) {
  return ParamBlock::parse(bytes.data(), bytes.size());
}

std::vector<uint8_t> bytes_of(const ParamWriter& w) {
  return std::vector<uint8_t>(w.data(), w.data() + w.size());
}

TEST_CASE("ParamWriter and ParamBlock round-trip int, float and string values") {
  ParamWriter w;
  REQUIRE(w.add("n", int64_t{42}).ok());
  REQUIRE(w.add("neg", int64_t{INT64_MIN}).ok());
  REQUIRE(w.add("scale", 0.25).ok());
  REQUIRE(w.add("model.name", std::string("resnet_50")).ok());
  REQUIRE(w.add("empty", std::string()).ok());

  auto block = ParamBlock::parse(w.data(), w.size());

  REQUIRE_MESSAGE(block.ok(), block.error().to_string());
  REQUIRE(block->entries().size() == 5);
  CHECK(block->entries()[0].key == "n");
  CHECK(std::get<int64_t>(*block->find("n")) == 42);
  CHECK(std::get<int64_t>(*block->find("neg")) == INT64_MIN);
  CHECK(std::get<double>(*block->find("scale")) == 0.25);
  CHECK(std::get<std::string>(*block->find("model.name")) == "resnet_50");
  CHECK(std::get<std::string>(*block->find("empty")).empty());
  CHECK(block->find("absent") == nullptr);
}

TEST_CASE("ParamBlock::parse of an empty block has no entries") {
  auto block = ParamBlock::parse(nullptr, 0);
  REQUIRE(block.ok());
  CHECK(block->entries().empty());
}

TEST_CASE("ParamWriter accepts the longest key and string, rejects one byte more") {
  ParamWriter w;
  const std::string key32(kMaxParamKeyBytes, 'k');
  const std::string str64(kMaxParamStringBytes, 's');

  CHECK(w.add(key32, int64_t{1}).ok());
  CHECK(w.add("s", str64).ok());
  auto long_key = w.add(key32 + "k", int64_t{1});
  auto long_str = w.add("t", str64 + "s");

  REQUIRE_FALSE(long_key.ok());
  CHECK(long_key.error().code() == ErrorCode::kInvalidArgument);
  REQUIRE_FALSE(long_str.ok());
  CHECK(long_str.error().code() == ErrorCode::kInvalidArgument);
  CHECK(contains(long_str.error().message(), "'t'"));
  CHECK(contains(long_str.error().message(), "65 bytes"));
  auto block = ParamBlock::parse(w.data(), w.size());
  REQUIRE(block.ok());
  CHECK(block->entries().size() == 2);  // rejected entries left nothing behind
}

TEST_CASE("ParamWriter rejects bad keys") {
  for (const char* key : {"", "Upper", "dash-key", "space key", "slash/key", "tab\t", "é"}) {
    CAPTURE(key);
    ParamWriter w;

    auto r = w.add(key, int64_t{1});

    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == ErrorCode::kInvalidArgument);
    CHECK(contains(r.error().message(), "[a-z0-9_.]"));
    CHECK(w.size() == 0);
  }
}

TEST_CASE("ParamWriter rejects an entry that would make the block exceed kMaxParamBytes") {
  ParamWriter w;
  const std::string value(kMaxParamStringBytes, 'v');
  int added = 0;
  Result<void> last;
  for (int i = 0; i < 10 && last.ok(); ++i) {
    last = w.add("key" + std::to_string(i), value);
    if (last.ok()) ++added;
  }

  REQUIRE_FALSE(last.ok());
  CHECK(last.error().code() == ErrorCode::kInvalidArgument);
  CHECK(contains(last.error().message(), "key" + std::to_string(added)));
  CHECK(w.size() <= kMaxParamBytes);
  CHECK(w.size() + 4 + 1 + 2 + kMaxParamStringBytes > kMaxParamBytes);  // it really was full
  CHECK(ParamBlock::parse(w.data(), w.size()).ok());
}

TEST_CASE("ParamBlock::parse rejects a block longer than kMaxParamBytes") {
  std::vector<uint8_t> bytes(kMaxParamBytes + 1, 0);

  auto r = parse(bytes);

  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code() == ErrorCode::kInvalidArgument);
  CHECK(contains(r.error().message(), "params_bytes"));
}

TEST_CASE("ParamBlock::parse of every truncation names the entry that was cut") {
  ParamWriter w;
  REQUIRE(w.add("alpha", int64_t{7}).ok());
  REQUIRE(w.add("beta", 1.5).ok());
  REQUIRE(w.add("gamma", std::string("hello")).ok());
  const std::vector<uint8_t> full = bytes_of(w);
  // Entry boundaries: 1+5+1+8, then 1+4+1+8, then 1+5+1+1+5.
  const std::vector<size_t> ends = {15, 29, 42};
  REQUIRE(full.size() == ends.back());

  for (size_t len = 0; len < full.size(); ++len) {
    CAPTURE(len);
    std::vector<uint8_t> cut(full.begin(), full.begin() + static_cast<long>(len));
    size_t entry = 0;
    while (len >= ends[entry]) ++entry;
    const bool at_boundary = entry == 0 ? len == 0 : len == ends[entry - 1];

    auto r = parse(cut);

    if (at_boundary) {
      REQUIRE(r.ok());
      CHECK(r->entries().size() == entry);
    } else {
      REQUIRE_FALSE(r.ok());
      CHECK(r.error().code() == ErrorCode::kInvalidArgument);
      CHECK(contains(r.error().message(), "params entry " + std::to_string(entry)));
    }
  }
}

TEST_CASE("ParamBlock::parse rejects malformed entries with a message naming them") {
  struct Case {
    const char* what;
    std::vector<uint8_t> bytes;
    const char* message_part;
  };
  const std::vector<Case> cases = {
      {"zero key length", {0, 1}, "params entry 0: key length 0"},
      {"key length 33", std::vector<uint8_t>(40, 33), "params entry 0: key length 33"},
      {"upper-case key", {1, 'A', 1, 0, 0, 0, 0, 0, 0, 0, 0}, "outside [a-z0-9_.]"},
      {"unknown type", {1, 'a', 9, 0}, "params entry 0 ('a'): unknown type 9"},
      {"type 0", {1, 'a', 0}, "unknown type 0"},
      {"string too long", {1, 'a', 3, 65}, "string length 65"},
      {"string past the end", {1, 'a', 3, 5, 'x'}, "string length 5"},
      {"second entry bad", {1, 'a', 3, 0, 1, 'b', 7}, "params entry 1 ('b')"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);

    auto r = parse(c.bytes);

    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == ErrorCode::kInvalidArgument);
    INFO("message: " << r.error().message());
    CHECK(contains(r.error().message(), c.message_part));
  }
}

TEST_CASE("ParamBlock::parse survives random bytes") {
  const uint64_t seed = test::test_seed(0x9A7A3);
  MESSAGE("seed " << seed << " (GPUQ_TEST_SEED replays it)");
  std::mt19937_64 rng(seed);
  const int iterations = static_cast<int>(test::scaled(20'000));
  int accepted = 0;
  int rejected_well = 0;

  for (int i = 0; i < iterations; ++i) {
    const size_t size = std::uniform_int_distribution<size_t>(0, kMaxParamBytes + 8)(rng);
    // Exactly `size` bytes on the heap, so ASan sees any read past the end.
    std::vector<uint8_t> bytes(size);
    const bool plausible = i % 2 == 0;  // half the time, bias towards valid-looking entries
    for (size_t k = 0; k < size; ++k) {
      uint8_t b = static_cast<uint8_t>(rng());
      if (plausible) {
        const uint8_t small[] = {0, 1, 2, 3, 4, 8, 'a', 'z', '_', '.', '0'};
        b = small[rng() % sizeof small];
      }
      bytes[k] = b;
    }

    auto r = parse(bytes);

    if (r.ok()) {
      ++accepted;
    } else if (r.error().code() == ErrorCode::kInvalidArgument &&
               (contains(r.error().message(), "params entry ") ||
                contains(r.error().message(), "params_bytes"))) {
      ++rejected_well;
    }
  }
  CHECK(accepted + rejected_well == iterations);
  CHECK(rejected_well > 0);
}

TEST_CASE("ParamBlock::get_int checks presence, type and range") {
  ParamWriter w;
  REQUIRE(w.add("n", int64_t{10}).ok());
  REQUIRE(w.add("f", 2.5).ok());
  REQUIRE(w.add("s", std::string("x")).ok());
  auto block = ParamBlock::parse(w.data(), w.size());
  REQUIRE(block.ok());

  SUBCASE("present and in range") {
    auto r = block->get_int("n", 0, 1, 10);
    REQUIRE(r.ok());
    CHECK(*r == 10);
  }
  SUBCASE("absent: the fallback") {
    auto r = block->get_int("absent", -3, 0, 1);  // the fallback is not range-checked
    REQUIRE(r.ok());
    CHECK(*r == -3);
  }
  SUBCASE("above the range") {
    auto r = block->get_int("n", 0, 0, 9);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == ErrorCode::kInvalidArgument);
    CHECK(contains(r.error().message(), "'n' is 10, must be in [0, 9]"));
  }
  SUBCASE("below the range") {
    auto r = block->get_int("n", 0, 11, 20);
    REQUIRE_FALSE(r.ok());
    CHECK(contains(r.error().message(), "[11, 20]"));
  }
  SUBCASE("a float is not an integer") {
    auto r = block->get_int("f", 0, 0, 100);
    REQUIRE_FALSE(r.ok());
    CHECK(contains(r.error().message(), "'f' must be an integer"));
  }
  SUBCASE("a string is not an integer") {
    auto r = block->get_int("s", 0, 0, 100);
    REQUIRE_FALSE(r.ok());
    CHECK(contains(r.error().message(), "'s' must be an integer"));
  }
}

TEST_CASE("parse_param_assignment types values by their syntax") {
  struct Case {
    const char* text;
    const char* key;
    ParamValue value;
  };
  const Case cases[] = {
      {"n=42", "n", int64_t{42}},
      {"n=-7", "n", int64_t{-7}},
      {"x=1.5", "x", 1.5},
      {"x=1e3", "x", 1000.0},
      {"name=resnet", "name", std::string("resnet")},
      {"hex=0x10", "hex", std::string("0x10")},
      {"empty=", "empty", std::string()},
      {"eq=a=b", "eq", std::string("a=b")},
      {"big=99999999999999999999", "big", 99999999999999999999.0},  // beyond int64: a float
  };
  for (const Case& c : cases) {
    CAPTURE(c.text);

    auto r = parse_param_assignment(c.text);

    REQUIRE_MESSAGE(r.ok(), r.error().to_string());
    CHECK(r->key == c.key);
    CHECK(r->value.index() == c.value.index());
    CHECK(r->value == c.value);
  }
}

TEST_CASE("parse_param_assignment rejects malformed assignments") {
  const std::string long_value(kMaxParamStringBytes + 1, 'v');
  for (const std::string& text : {std::string("novalue"), std::string("=1"), std::string("Bad=1"),
                                  std::string("k-y=1"), "s=" + long_value}) {
    CAPTURE(text);

    auto r = parse_param_assignment(text);

    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == ErrorCode::kInvalidArgument);
    CHECK(contains(r.error().message(), "--param"));
  }
}

}  // namespace
}  // namespace gpuq
