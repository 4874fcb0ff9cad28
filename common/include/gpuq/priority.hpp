// gpuq public vocabulary: a job's priority level. Like error.hpp it lives in common/ and is
// installed with the client's public headers (<prefix>/include/gpuq/priority.hpp): the client's
// JobSpec, the shared-memory descriptor and the daemon's pools all speak in these levels.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace gpuq {

// Higher levels are taken first; a lower level that waits still gets at least a tenth of a
// pool's starts (docs/design/ring.md, "Lanes"). The values are part of the C ABI (gpuq.h's
// GPUQ_PRIORITY_*) and of the job descriptor: append, never renumber.
enum class Priority : uint8_t {
  kNormal = 0,
  kHigh = 1,
  kLow = 2,
};
inline constexpr uint32_t kPriorityLevels = 3;

// Where a level is served: 0 first (high), then normal, then low.
constexpr uint32_t priority_rank(Priority p) noexcept {
  switch (p) {
    case Priority::kHigh:
      return 0;
    case Priority::kNormal:
      return 1;
    case Priority::kLow:
      return 2;
  }
  return 1;
}
constexpr Priority priority_at_rank(uint32_t rank) noexcept {
  return rank == 0 ? Priority::kHigh : rank == 2 ? Priority::kLow : Priority::kNormal;
}

constexpr std::string_view priority_name(Priority p) noexcept {
  switch (p) {
    case Priority::kHigh:
      return "high";
    case Priority::kNormal:
      return "normal";
    case Priority::kLow:
      return "low";
  }
  return "normal";
}

// "high", "normal" or "low"; nullopt for anything else.
constexpr std::optional<Priority> parse_priority(std::string_view s) noexcept {
  if (s == "high") return Priority::kHigh;
  if (s == "normal") return Priority::kNormal;
  if (s == "low") return Priority::kLow;
  return std::nullopt;
}

}  // namespace gpuq
