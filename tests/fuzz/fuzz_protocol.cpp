// Fuzz target: one datagram received on a control socket, through the frame decoder that
// receive_message uses (decode_message, common/src/protocol.cpp) and then through the parser of
// its body, as the receiving side parses it:
//   Hello                 the supervisor (parse_hello, daemon/shared/client_messages.cpp)
//   Error                 the client library (error_from_body)
//   MapClient/UnmapClient the worker (parse_map_client, parse_unmap_client)
// StatusRequest, StopRequest and WorkerStop are answered without reading the body.
//
// The body parser also runs on the bytes after the header of a frame that fails to decode, with
// the type its header names: the supervisor never does that, but it lets the fuzzer explore the
// JSON parsers without keeping body_bytes equal to the datagram size.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "client_messages.hpp"
#include "fuzz/fuzz_inputs.hpp"
#include "gpuq/common/assert.hpp"
#include "gpuq/common/protocol.hpp"
#include "gpuq/common/shm_layout.hpp"

namespace gpuq::fuzz {
namespace {

bool add(uint64_t a, uint64_t b, uint64_t* sum) {
  return !__builtin_add_overflow(a, b, sum);
}

void check_rejection(const Error& e) {
  GPUQ_ASSERT(e.code() == ErrorCode::kInvalidArgument);
  GPUQ_ASSERT(!e.message().empty());
}

void parse_body(MessageType type, const std::string& body) {
  switch (type) {
    case MessageType::kHello: {
      auto hello = daemon::parse_hello(body, kFuzzMaxClientSegmentBytes);
      if (!hello) return check_rejection(hello.error());
      GPUQ_ASSERT(hello->name.size() <= daemon::kMaxClientNameBytes);
      GPUQ_ASSERT(hello->arena_bytes <= kFuzzMaxClientSegmentBytes);
      return;
    }
    case MessageType::kError: {
      Error e = error_from_body(body);
      const auto code = static_cast<int32_t>(e.code());
      GPUQ_ASSERT(code > 0 && code <= kMaxErrorCode);
      return;
    }
    case MessageType::kMapClient: {
      auto map = daemon::parse_map_client(body);
      if (!map) return check_rejection(map.error());
      // The worker indexes slots and the arena with this geometry: all of it inside the segment.
      const ClientSegmentGeometry& g = map->geometry;
      uint64_t slots_end = 0, arena_end = 0;
      GPUQ_ASSERT(map->slot_count <= kMaxSlotsPerClient);
      GPUQ_ASSERT(g.slots_offset >= sizeof(ClientSegmentHeader));
      GPUQ_ASSERT(g.slots_offset % alignof(JobSlot) == 0);
      GPUQ_ASSERT(add(g.slots_offset, uint64_t{map->slot_count} * sizeof(JobSlot), &slots_end));
      GPUQ_ASSERT(slots_end <= g.arena_offset);
      GPUQ_ASSERT(add(g.arena_offset, g.arena_bytes, &arena_end));
      GPUQ_ASSERT(arena_end <= g.segment_bytes);
      return;
    }
    case MessageType::kUnmapClient: {
      auto unmap = daemon::parse_unmap_client(body);
      if (!unmap) check_rejection(unmap.error());
      return;
    }
    default:
      return;
  }
}

void run(const uint8_t* data, size_t size) {
  auto m = decode_message(data, size);
  if (m) {
    GPUQ_ASSERT(size >= sizeof(MessageHeader));
    GPUQ_ASSERT(m->body.size() == size - sizeof(MessageHeader));
    GPUQ_ASSERT(m->body.size() <= kMaxMessageBody);
    GPUQ_ASSERT(m->version == kProtocolVersion);
    GPUQ_ASSERT(std::memcmp(m->body.data(), data + sizeof(MessageHeader), m->body.size()) == 0);
    parse_body(m->type, m->body);
    return;
  }
  const ErrorCode code = m.error().code();
  GPUQ_ASSERT(code == ErrorCode::kInvalidArgument || code == ErrorCode::kProtocolMismatch);
  if (size >= sizeof(MessageHeader)) {
    MessageHeader h;
    std::memcpy(&h, data, sizeof h);
    parse_body(static_cast<MessageType>(h.type),
               std::string(reinterpret_cast<const char*>(data) + sizeof h, size - sizeof h));
  }
}

}  // namespace
}  // namespace gpuq::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {  // NOLINT
  gpuq::fuzz::run(data, size);
  return 0;
}
