#include "client_messages.hpp"

#include <exception>
#include <limits>
#include <nlohmann/json.hpp>

namespace gpuq::daemon {
namespace {

using nlohmann::json;

Error bad(const std::string& what) {
  return Error(ErrorCode::kInvalidArgument, what);
}

// Parses `body` into `j`, which must be a JSON object; `message` names the message in errors.
Result<void> parse_object(std::string_view body, const char* message, json& j) {
  try {
    j = json::parse(body);
  } catch (const std::exception& e) {
    return bad(std::string(message) + " body: " + e.what());
  }
  if (!j.is_object()) return bad(std::string(message) + " body: body is not a JSON object");
  return {};
}

// The unsigned integer field `key` of object `j`, at most `max`.
Result<uint64_t> get_unsigned(const json& j, const char* message, const char* key, uint64_t max) {
  auto it = j.find(key);
  if (it == j.end()) return bad(std::string(message) + "." + key + " is missing");
  if (!it->is_number_unsigned() || it->get<uint64_t>() > max) {
    return bad(std::string(message) + "." + key + " must be an integer in [0, " +
               std::to_string(max) + "]");
  }
  return it->get<uint64_t>();
}

constexpr uint64_t kU32 = std::numeric_limits<uint32_t>::max();
constexpr uint64_t kU64 = std::numeric_limits<uint64_t>::max();

}  // namespace

Result<HelloRequest> parse_hello(std::string_view body, uint64_t max_arena_bytes) {
  json j;
  if (auto r = parse_object(body, "Hello", j); !r) return r.error();
  HelloRequest hello;
  if (auto it = j.find("name"); it != j.end()) {
    if (!it->is_string() || it->get_ref<const std::string&>().size() > kMaxClientNameBytes) {
      return bad("Hello.name must be a string of at most 64 bytes");
    }
    hello.name = it->get<std::string>();
  }
  if (auto it = j.find("arena_bytes"); it != j.end()) {
    if (!it->is_number_unsigned()) return bad("Hello.arena_bytes must be a positive integer");
    const uint64_t a = it->get<uint64_t>();
    if (a > max_arena_bytes) {
      return bad("Hello.arena_bytes " + std::to_string(a) + " exceeds max_client_segment_bytes " +
                 std::to_string(max_arena_bytes));
    }
    hello.arena_bytes = a;
  }
  return hello;
}

Result<MapClientMessage> parse_map_client(std::string_view body) {
  json j;
  if (auto r = parse_object(body, "MapClient", j); !r) return r.error();
  MapClientMessage m;
  constexpr const char* kMessage = "MapClient";
  auto client = get_unsigned(j, kMessage, "client", kU32);
  if (!client) return client.error();
  auto session = get_unsigned(j, kMessage, "session", kU64);
  if (!session) return session.error();
  auto slots = get_unsigned(j, kMessage, "slot_count", kMaxSlotsPerClient);
  if (!slots) return slots.error();
  auto slots_offset = get_unsigned(j, kMessage, "slots_offset", kU64);
  if (!slots_offset) return slots_offset.error();
  auto arena_offset = get_unsigned(j, kMessage, "arena_offset", kU64);
  if (!arena_offset) return arena_offset.error();
  auto arena_bytes = get_unsigned(j, kMessage, "arena_bytes", kU64);
  if (!arena_bytes) return arena_bytes.error();
  auto segment_bytes = get_unsigned(j, kMessage, "segment_bytes", kU64);
  if (!segment_bytes) return segment_bytes.error();
  m.client = static_cast<uint32_t>(*client);
  m.session = *session;
  m.slot_count = static_cast<uint32_t>(*slots);
  m.geometry = {*slots_offset, *arena_offset, *arena_bytes, *segment_bytes};

  // header | slots | arena, in this order, inside the segment. slot_count <= 256, so the slots'
  // size cannot overflow; each comparison below is arranged so that no sum can either.
  const ClientSegmentGeometry& g = m.geometry;
  const uint64_t slots_size = uint64_t{m.slot_count} * sizeof(JobSlot);
  if (g.slots_offset < sizeof(ClientSegmentHeader) || g.slots_offset % alignof(JobSlot) != 0 ||
      g.slots_offset > g.segment_bytes || slots_size > g.segment_bytes - g.slots_offset ||
      g.arena_offset < g.slots_offset + slots_size || g.arena_offset > g.segment_bytes ||
      g.arena_bytes > g.segment_bytes - g.arena_offset) {
    return bad("MapClient geometry is inconsistent: " + std::to_string(m.slot_count) +
               " slots at " + std::to_string(g.slots_offset) + ", arena of " +
               std::to_string(g.arena_bytes) + " bytes at " + std::to_string(g.arena_offset) +
               ", segment of " + std::to_string(g.segment_bytes) + " bytes");
  }
  return m;
}

Result<UnmapClientMessage> parse_unmap_client(std::string_view body) {
  json j;
  if (auto r = parse_object(body, "UnmapClient", j); !r) return r.error();
  auto client = get_unsigned(j, "UnmapClient", "client", kU32);
  if (!client) return client.error();
  auto session = get_unsigned(j, "UnmapClient", "session", kU64);
  if (!session) return session.error();
  return UnmapClientMessage{static_cast<uint32_t>(*client), *session};
}

}  // namespace gpuq::daemon
