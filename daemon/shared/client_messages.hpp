// Parsing of the JSON bodies of control messages the daemon receives, apart from the sockets and
// the state they act on, so that each parser can be unit tested and fuzzed on its own
// (tests/fuzz/fuzz_protocol.cpp). docs/design/protocol.md lists the fields.
//
//   Hello        client -> supervisor: untrusted (any local user in the allowed set)
//   MapClient    supervisor -> worker: from the worker's parent, but checked all the same so a
//   UnmapClient  slip in the supervisor cannot make a worker map a segment inconsistently
//
// Every function here is pure and thread-safe; none throws (nlohmann_json's exceptions are turned
// into InvalidArgument errors that name the message and, where known, the field).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "gpuq/common/shm_layout.hpp"
#include "gpuq/error.hpp"

namespace gpuq::daemon {

inline constexpr size_t kMaxClientNameBytes = 64;

// Hello: {"pid": <ignored>, "name": "<= 64 bytes", "arena_bytes": <uint64>}; every field optional.
struct HelloRequest {
  std::string name;          // empty when absent
  uint64_t arena_bytes = 0;  // 0 when absent or 0: the daemon's client_segment_bytes
};

// Errors: InvalidArgument naming the field (Hello.name, Hello.arena_bytes) or the body ("Hello
// body: ..." when it is not a JSON object). arena_bytes above `max_arena_bytes` is an error.
Result<HelloRequest> parse_hello(std::string_view body, uint64_t max_arena_bytes);

// MapClient: {"client", "session", "slot_count", "slots_offset", "arena_offset", "arena_bytes",
// "segment_bytes"}. On success the geometry is consistent: slot_count <= kMaxSlotsPerClient, the
// header, the slots and the arena lie in this order inside segment_bytes, without overflow.
struct MapClientMessage {
  uint32_t client = 0;
  uint64_t session = 0;
  uint32_t slot_count = 0;
  ClientSegmentGeometry geometry{};
};

// Errors: InvalidArgument naming the missing or mistyped field, or the inconsistent geometry.
Result<MapClientMessage> parse_map_client(std::string_view body);

// UnmapClient: {"client", "session"}.
struct UnmapClientMessage {
  uint32_t client = 0;
  uint64_t session = 0;
};

// Errors: InvalidArgument naming the missing or mistyped field.
Result<UnmapClientMessage> parse_unmap_client(std::string_view body);

}  // namespace gpuq::daemon
