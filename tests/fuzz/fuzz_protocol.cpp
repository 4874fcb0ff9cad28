// Fuzz target: one datagram received on a control socket, through the frame decoder that
// receive_message uses (decode_message, common/src/protocol.cpp) and then through the decoder of
// its body (gpuq/common/messages.hpp, common/src/messages.cpp), as the receiving side decodes it:
//   Hello, RestartRequest the supervisor (decode_hello, decode_restart_request)
//   RestartReply          the client library (decode_restart_reply)
//   Welcome, StopReply    the client library (decode_welcome, decode_stop_reply)
//   MetricsReply          the client library (decode_metrics_reply)
//   Error                 the client library (error_from_body)
//   WorkerReady           the supervisor (decode_worker_ready)
//   MapClient/UnmapClient the worker (decode_map_client, decode_unmap_client)
// StatusRequest, StopRequest and WorkerStop are answered without reading the body; their
// decoders run all the same. Every body a decoder accepts is encoded again, and must decode to
// the same message: the two halves of each message agree.
//
// The body decoder also runs on the bytes after the header of a frame that fails to decode, with
// the type its header names: the supervisor never does that, but it lets the fuzzer explore the
// JSON parsers without keeping body_bytes equal to the datagram size.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "fuzz/fuzz_inputs.hpp"
#include "gpuq/common/assert.hpp"
#include "gpuq/common/messages.hpp"
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

// The worker and the client index slots and the arena with this geometry: all of it inside the
// segment.
void check_geometry(uint32_t slot_count, const ClientSegmentGeometry& g) {
  uint64_t slots_end = 0, arena_end = 0;
  GPUQ_ASSERT(slot_count <= kMaxSlotsPerClient);
  GPUQ_ASSERT(g.slots_offset >= kClientSlotsMinOffset);
  GPUQ_ASSERT(g.slots_offset % alignof(JobSlot) == 0);
  GPUQ_ASSERT(add(g.slots_offset, uint64_t{slot_count} * sizeof(JobSlot), &slots_end));
  GPUQ_ASSERT(slots_end <= g.arena_offset);
  GPUQ_ASSERT(add(g.arena_offset, g.arena_bytes, &arena_end));
  GPUQ_ASSERT(arena_end <= g.segment_bytes);
}

// Decodes `body` with `decode`; a rejection must be InvalidArgument, and an accepted message must
// pass `check` and come back unchanged from encode() and decode().
template <typename Decode, typename Check>
void decode_and_check(const std::string& body, Decode decode, Check check) {
  auto m = decode(body);
  if (!m) return check_rejection(m.error());
  check(*m);
  auto again = decode(encode(*m));
  GPUQ_ASSERT(again.ok());
  GPUQ_ASSERT(*again == *m);
}

// What decode_welcome and decode_catalog_reply promise of the pools.
void check_pools(const std::vector<WelcomePool>& pools) {
  for (const WelcomePool& p : pools) {
    GPUQ_ASSERT(p.id < kMaxPools);
    GPUQ_ASSERT(std::count_if(pools.begin(), pools.end(),
                              [&](const WelcomePool& q) { return q.id == p.id; }) == 1);
    if (p.available || p.fallback < 0) continue;
    GPUQ_ASSERT(std::any_of(pools.begin(), pools.end(), [&](const WelcomePool& q) {
      return static_cast<int64_t>(q.id) == p.fallback && q.available;
    }));
  }
}

void parse_body(MessageType type, const std::string& body) {
  auto none = [](const auto&) {};
  switch (type) {
    case MessageType::kHello:
      return decode_and_check(
          body, [](const std::string& b) { return decode_hello(b, kFuzzMaxClientSegmentBytes); },
          [](const HelloMessage& hello) {
            GPUQ_ASSERT(hello.name.size() <= kMaxClientNameBytes);
            GPUQ_ASSERT(hello.arena_bytes <= kFuzzMaxClientSegmentBytes);
          });
    case MessageType::kWelcome:
      return decode_and_check(body, decode_welcome, [](const WelcomeMessage& w) {
        check_geometry(w.slot_count, w.geometry);
        if (w.job_clock == StampClock::kTsc) {
          GPUQ_ASSERT(w.tsc_ns_per_tick > 0.01 && w.tsc_ns_per_tick < 100.0);
        }
        check_pools(w.pools);
      });
    case MessageType::kCatalogReply:
      return decode_and_check(body, decode_catalog_reply,
                              [](const CatalogReplyMessage& c) { check_pools(c.pools); });
    case MessageType::kError: {
      Error e = error_from_body(body);
      const auto code = static_cast<int32_t>(e.code());
      GPUQ_ASSERT(code > 0 && code <= kMaxErrorCode);
      return;
    }
    case MessageType::kStatusRequest:
      return decode_and_check(body, decode_status_request, none);
    case MessageType::kStopRequest:
      return decode_and_check(body, decode_stop_request, none);
    case MessageType::kStopReply:
      return decode_and_check(body, decode_stop_reply, none);
    case MessageType::kRestartRequest:
      return decode_and_check(body, decode_restart_request, none);
    case MessageType::kRestartReply:
      return decode_and_check(body, decode_restart_reply, none);
    case MessageType::kReloadRequest:
      return decode_and_check(body, decode_reload_request, none);
    case MessageType::kReloadReply:
      return decode_and_check(body, decode_reload_reply, none);
    case MessageType::kCatalogRequest:
      return decode_and_check(body, decode_catalog_request, none);
    case MessageType::kMetricsRequest:
      return decode_and_check(body, decode_metrics_request, none);
    case MessageType::kMetricsReply:
      return decode_and_check(body, decode_metrics_reply, [](const MetricsReplyMessage& m) {
        GPUQ_ASSERT(m.bytes <= kMaxMetricsBytes);
      });
    case MessageType::kWorkerReady:
      return decode_and_check(body, decode_worker_ready, [](const WorkerReadyMessage& r) {
        GPUQ_ASSERT(r.backend.empty() || r.backend.front() == '{');
        GPUQ_ASSERT(!r.plugin_ops.empty() && r.plugin_ops.front() == '[');
      });
    case MessageType::kMapClient:
      return decode_and_check(body, decode_map_client, [](const MapClientMessage& map) {
        check_geometry(map.slot_count, map.geometry);
      });
    case MessageType::kUnmapClient:
      return decode_and_check(body, decode_unmap_client, none);
    case MessageType::kWorkerStop:
      return decode_and_check(body, decode_worker_stop, none);
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
