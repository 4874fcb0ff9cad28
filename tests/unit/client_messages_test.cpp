// Unit tests of the control-message body parsers (gpuq/common/messages.hpp): Hello as the
// supervisor reads it from an untrusted client, MapClient and UnmapClient as a worker reads them.
#include "gpuq/common/messages.hpp"

#include <doctest/doctest.h>

#include <string>

namespace gpuq::daemon {
namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string map_body(uint64_t slots_offset, uint64_t arena_offset, uint64_t arena_bytes,
                     uint64_t segment_bytes, uint32_t slot_count = 8) {
  return "{\"client\":3,\"session\":7,\"slot_count\":" + std::to_string(slot_count) +
         ",\"slots_offset\":" + std::to_string(slots_offset) +
         ",\"arena_offset\":" + std::to_string(arena_offset) +
         ",\"arena_bytes\":" + std::to_string(arena_bytes) +
         ",\"segment_bytes\":" + std::to_string(segment_bytes) + "}";
}

TEST_CASE("decode_hello reads name and arena_bytes, both optional") {
  auto full = decode_hello(R"({"pid":12,"name":"app","arena_bytes":65536})", 1 << 20);
  auto empty = decode_hello("{}", 1 << 20);

  REQUIRE(full.ok());
  CHECK(full->name == "app");
  CHECK(full->arena_bytes == 65536);
  REQUIRE(empty.ok());
  CHECK(empty->name.empty());
  CHECK(empty->arena_bytes == 0);
}

TEST_CASE("decode_hello rejects bad fields with InvalidArgument naming the field") {
  struct Case {
    const char* body;
    const char* names;
  };
  const Case cases[] = {
      {"", "Hello body"},
      {"[1]", "Hello body"},
      {"{\"name\":1}", "Hello.name"},
      {R"({"name":"01234567890123456789012345678901234567890123456789012345678901234"})",
       "Hello.name"},
      {R"({"arena_bytes":-1})", "Hello.arena_bytes"},
      {R"({"arena_bytes":1e300})", "Hello.arena_bytes"},
      {R"({"arena_bytes":"big"})", "Hello.arena_bytes"},
      {R"({"arena_bytes":1048577})", "max_client_segment_bytes"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.body);

    auto r = decode_hello(c.body, 1 << 20);

    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == ErrorCode::kInvalidArgument);
    CHECK(contains(r.error().message(), c.names));
  }
}

TEST_CASE("decode_map_client accepts the geometry the supervisor computes") {
  const auto g = ClientSegmentGeometry::compute(8, 65536);

  auto m =
      decode_map_client(map_body(g.slots_offset, g.arena_offset, g.arena_bytes, g.segment_bytes));

  REQUIRE(m.ok());
  CHECK(m->client == 3);
  CHECK(m->session == 7);
  CHECK(m->slot_count == 8);
  CHECK(m->geometry.arena_offset == g.arena_offset);
  CHECK(m->geometry.arena_bytes == g.arena_bytes);
  CHECK(m->geometry.segment_bytes == g.segment_bytes);
}

TEST_CASE("decode_map_client rejects an inconsistent geometry") {
  const auto g = ClientSegmentGeometry::compute(8, 65536);
  const std::string bodies[] = {
      map_body(g.slots_offset, g.arena_offset, g.arena_bytes, g.segment_bytes - 1),  // too small
      map_body(0, g.arena_offset, g.arena_bytes, g.segment_bytes),  // slots over the header
      map_body(g.slots_offset + 1, g.arena_offset, g.arena_bytes, g.segment_bytes),  // unaligned
      map_body(g.slots_offset, g.slots_offset, g.arena_bytes, g.segment_bytes),  // arena on slots
      map_body(g.slots_offset, 1ull << 63, 1ull << 63, UINT64_MAX),              // wraps
      map_body(g.slots_offset, g.arena_offset, g.arena_bytes, g.segment_bytes, 257),
      R"({"client":3,"session":7})",
      R"({"client":-3,"session":7,"slot_count":1})",
  };
  for (const auto& body : bodies) {
    CAPTURE(body);

    auto m = decode_map_client(body);

    REQUIRE_FALSE(m.ok());
    CHECK(m.error().code() == ErrorCode::kInvalidArgument);
    CHECK(contains(m.error().message(), "MapClient"));
  }
}

TEST_CASE("decode_unmap_client reads client and session") {
  auto ok = decode_unmap_client(R"({"client":3,"session":7})");
  auto bad = decode_unmap_client(R"({"client":4294967296,"session":7})");

  REQUIRE(ok.ok());
  CHECK(ok->client == 3);
  CHECK(ok->session == 7);
  REQUIRE_FALSE(bad.ok());
  CHECK(contains(bad.error().message(), "UnmapClient.client"));
}

}  // namespace
}  // namespace gpuq::daemon
