// OpTable: the daemon's op names -> ids, as a client looks them up on every submit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace gpuq {

// The daemon's ops, name -> id, looked up on every submit: open addressing in a power-of-two
// table, so a lookup is a short hash (FNV-1a), a mask and one comparison. (std::unordered_map
// took a division per lookup, or, in libstdc++ for a table this small, a comparison with
// every entry.) Filled once, at connect.
class OpTable {
 public:
  OpTable() = default;
  explicit OpTable(std::vector<std::pair<std::string, uint32_t>> entries)
      : entries_(std::move(entries)) {
    size_t size = 16;
    while (size < 2 * entries_.size()) size *= 2;
    slots_.assign(size, -1);
    for (size_t i = 0; i < entries_.size(); ++i) {
      size_t at = hash(entries_[i].first) & (size - 1);
      while (slots_[at] >= 0 && !(entry(at).first == entries_[i].first)) at = (at + 1) & (size - 1);
      if (slots_[at] < 0) slots_[at] = static_cast<int32_t>(i);  // a repeated name: the first
    }
  }
  const uint32_t* find(std::string_view name) const noexcept {
    if (slots_.empty()) return nullptr;
    const size_t mask = slots_.size() - 1;
    for (size_t at = hash(name) & mask;; at = (at + 1) & mask) {
      if (slots_[at] < 0) return nullptr;
      if (entry(at).first == name) return &entry(at).second;
    }
  }
  const std::vector<std::pair<std::string, uint32_t>>& entries() const noexcept { return entries_; }

 private:
  const std::pair<std::string, uint32_t>& entry(size_t at) const noexcept {
    return entries_[static_cast<size_t>(slots_[at])];
  }
  static uint64_t hash(std::string_view name) noexcept {
    uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
    return h ^ (h >> 29);
  }
  std::vector<std::pair<std::string, uint32_t>> entries_;  // in the daemon's order
  std::vector<int32_t> slots_;                             // index into entries_, -1: empty
};

}  // namespace gpuq
