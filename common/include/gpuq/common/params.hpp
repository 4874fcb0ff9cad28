// ParamBlock: the small key/value parameters of a job, in at most kMaxParamBytes bytes.
//
// Encoding (little-endian), one entry after another:
//   u8 key_len (1..32) | key bytes ([a-z0-9_.]) | u8 type | value
//   type 1 = int64 (8 bytes), 2 = float64 (8 bytes), 3 = string (u8 len, then len bytes <= 64)
// The block is untrusted when a worker reads it: parse() checks every length against the block
// and the limits above and names the entry at fault.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "gpuq/error.hpp"

namespace gpuq {

inline constexpr size_t kMaxParamKeyBytes = 32;
inline constexpr size_t kMaxParamStringBytes = 64;

using ParamValue = std::variant<int64_t, double, std::string>;

struct Param {
  std::string key;
  ParamValue value;
};

// Appends encoded entries. Not thread-safe (a value type).
class ParamWriter {
 public:
  Result<void> add(std::string_view key, const ParamValue& value);
  const uint8_t* data() const noexcept { return bytes_.data(); }
  size_t size() const noexcept { return bytes_.size(); }

 private:
  std::vector<uint8_t> bytes_;
};

// Decoded parameters, with typed lookups. parse() validates the whole block.
class ParamBlock {
 public:
  static Result<ParamBlock> parse(const uint8_t* data, size_t size);

  const std::vector<Param>& entries() const noexcept { return entries_; }
  const ParamValue* find(std::string_view key) const noexcept;

  // Integer parameter `key`, or `fallback` when absent. Error (InvalidArgument naming the key)
  // if present with another type or outside [min, max].
  Result<int64_t> get_int(std::string_view key, int64_t fallback, int64_t min, int64_t max) const;

 private:
  std::vector<Param> entries_;
};

// Parses "key=value" from the command line: integers and floats by their syntax, else a string.
Result<Param> parse_param_assignment(std::string_view text);

}  // namespace gpuq
