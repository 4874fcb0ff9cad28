// Unit tests of the control messages' bodies (gpuq/common/messages.hpp): every message encoded
// and decoded back, the exact JSON each encoder puts on the wire (older peers read it), and the
// decoders' rejections, each naming the message and the field.
#include "gpuq/common/messages.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

namespace gpuq {
namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Decodes `body` with `decode` and checks that it is refused with InvalidArgument naming `names`.
template <typename Decode>
void check_rejected(Decode decode, const std::string& body, const std::string& names) {
  CAPTURE(body);
  auto r = decode(body);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code() == ErrorCode::kInvalidArgument);
  CHECK_MESSAGE(contains(r.error().message(), names), r.error().message());
}

WelcomeMessage sample_welcome() {
  WelcomeMessage w;
  w.client = 3;
  w.session = 7;
  w.slot_count = 8;
  w.geometry = ClientSegmentGeometry::compute(8, 65536);
  w.epoch = 0x1234567890abcdefull;
  w.queue_segment = "/gpuq-queue-1000";
  w.daemon_version = "0.1.0";
  w.pools = {{"cpu", 0, "cpu", 40, 10, true, "", -1},
             {"gpu", 1, "gpu", 20, 5, false, "no GPU found", 0}};
  w.ops = {{"noop", 1}, {"echo", 2}, {"saxpy", 2000}};
  w.catalog = 2;
  return w;
}

// A Welcome body with `field` replaced by `value` (or removed when value is empty).
std::string welcome_with(const std::string& field, const std::string& value) {
  const auto g = ClientSegmentGeometry::compute(8, 65536);
  std::vector<std::pair<std::string, std::string>> fields = {
      {"client", "3"},
      {"session", "7"},
      {"slot_count", "8"},
      {"slots_offset", std::to_string(g.slots_offset)},
      {"arena_offset", std::to_string(g.arena_offset)},
      {"arena_bytes", std::to_string(g.arena_bytes)},
      {"segment_bytes", std::to_string(g.segment_bytes)},
      {"epoch", "5"},
      {"queue_segment", "\"/q\""},
      {"pools", R"([{"name":"cpu","id":0,"kind":"cpu","capacity":4,"client_share":1}])"},
      {"ops", R"([{"name":"noop","id":1}])"},
  };
  bool replaced = false;
  std::string body = "{";
  for (auto& [key, text] : fields) {
    if (key == field) {
      replaced = true;
      if (value.empty()) continue;
      text = value;
    }
    if (body.size() > 1) body += ",";
    body += "\"" + key + "\":" + text;
  }
  if (!replaced && !value.empty()) body += ",\"" + field + "\":" + value;
  return body + "}";
}

// ---- Hello ------------------------------------------------------------------------------------

TEST_CASE("Hello: encode writes pid, name and arena_bytes, and decode reads them back") {
  const HelloMessage hello{1234, "app", 65536};

  const std::string body = encode(hello);
  auto back = decode_hello(body, 1 << 20);

  CHECK(body == R"({"arena_bytes":65536,"name":"app","pid":1234})");
  REQUIRE(back.ok());
  CHECK(*back == hello);
}

TEST_CASE("Hello: every field is optional, and a pid that is not an int32 is ignored") {
  auto empty = decode_hello("{}", 1 << 20);
  auto odd_pid = decode_hello(R"({"pid":"me","name":"x"})", 1 << 20);
  auto big_pid = decode_hello(R"({"pid":4294967296})", 1 << 20);

  REQUIRE(empty.ok());
  CHECK(*empty == HelloMessage{});
  REQUIRE(odd_pid.ok());
  CHECK(odd_pid->pid == 0);
  CHECK(odd_pid->name == "x");
  REQUIRE(big_pid.ok());
  CHECK(big_pid->pid == 0);
}

TEST_CASE("Hello: decode rejects bad fields, naming them") {
  auto decode = [](const std::string& b) { return decode_hello(b, 1 << 20); };
  check_rejected(decode, "", "Hello body");
  check_rejected(decode, "[1]", "Hello body");
  check_rejected(decode, R"({"name":1})", "Hello.name");
  check_rejected(decode, R"({"name":")" + std::string(kMaxClientNameBytes + 1, 'a') + "\"}",
                 "Hello.name");
  check_rejected(decode, R"({"arena_bytes":-1})", "Hello.arena_bytes");
  check_rejected(decode, R"({"arena_bytes":1.5})", "Hello.arena_bytes");
  check_rejected(decode, R"({"arena_bytes":1048577})", "max_client_segment_bytes");
}

TEST_CASE("Hello: a name of exactly kMaxClientNameBytes is accepted") {
  const HelloMessage hello{1, std::string(kMaxClientNameBytes, 'n'), 0};

  auto back = decode_hello(encode(hello), 0);

  REQUIRE(back.ok());
  CHECK(*back == hello);
}

TEST_CASE("Hello: encode never throws on a name that is not UTF-8") {
  HelloMessage hello{1, "bad\xff", 0};

  const std::string body = encode(hello);
  auto back = decode_hello(body, 0);

  REQUIRE(back.ok());
  CHECK(back->name == "bad\xEF\xBF\xBD");  // U+FFFD
}

// ---- Welcome ----------------------------------------------------------------------------------

TEST_CASE("Welcome: encode then decode gives the same message (monotonic and tsc clocks)") {
  WelcomeMessage monotonic = sample_welcome();
  WelcomeMessage tsc = sample_welcome();
  tsc.job_clock = StampClock::kTsc;
  tsc.tsc_ns_per_tick = 0.3448275862068966;

  auto m = decode_welcome(encode(monotonic));
  auto t = decode_welcome(encode(tsc));

  REQUIRE(m.ok());
  CHECK(*m == monotonic);
  REQUIRE(t.ok());
  CHECK(*t == tsc);
  CHECK_FALSE(contains(encode(monotonic), "tsc_ns_per_tick"));
}

TEST_CASE("Welcome: encode writes the field names and shapes older clients read") {
  WelcomeMessage w = sample_welcome();
  w.pools.resize(1);
  w.ops.resize(1);
  const auto& g = w.geometry;

  const std::string body = encode(w);

  CHECK(body == "{\"arena_bytes\":" + std::to_string(g.arena_bytes) +
                    ",\"arena_offset\":" + std::to_string(g.arena_offset) +
                    ",\"catalog\":2,\"client\":3,\"daemon_version\":\"0.1.0\",\"epoch\":" +
                    std::to_string(w.epoch) +
                    ",\"job_clock\":\"monotonic\",\"ops\":[{\"id\":1,\"name\":\"noop\"}],"
                    "\"pools\":[{\"available\":true,\"capacity\":40,\"client_share\":10,"
                    "\"fallback\":-1,\"id\":0,\"kind\":\"cpu\",\"name\":\"cpu\",\"reason\":\"\"}],"
                    "\"queue_segment\":\"/gpuq-queue-1000\",\"segment_bytes\":" +
                    std::to_string(g.segment_bytes) + ",\"session\":7,\"slot_count\":8," +
                    "\"slots_offset\":" + std::to_string(g.slots_offset) + "}");
}

TEST_CASE("Welcome: an older daemon's reply (no availability, clock or version) is accepted") {
  auto w = decode_welcome(welcome_with("", ""));

  REQUIRE(w.ok());
  CHECK(w->job_clock == StampClock::kMonotonic);
  CHECK(w->daemon_version.empty());
  REQUIRE(w->pools.size() == 1);
  CHECK(w->pools[0].available);
  CHECK(w->pools[0].fallback == -1);
  CHECK(w->pools[0].reason.empty());
  REQUIRE(w->ops.size() == 1);
  CHECK(w->ops[0] == WelcomeOp{"noop", 1});
  CHECK(w->catalog == 0);
}

TEST_CASE("Welcome: decode names each missing or mistyped field") {
  for (const char* field :
       {"client", "session", "slot_count", "slots_offset", "arena_offset", "arena_bytes",
        "segment_bytes", "epoch", "queue_segment", "pools", "ops"}) {
    check_rejected(decode_welcome, welcome_with(field, ""),
                   std::string("Welcome.") + field + " is missing");
    check_rejected(decode_welcome, welcome_with(field, "{}"), std::string("Welcome.") + field);
  }
  check_rejected(decode_welcome, welcome_with("client", "-1"), "Welcome.client");
  check_rejected(decode_welcome, welcome_with("client", "4294967296"), "Welcome.client");
  check_rejected(decode_welcome, welcome_with("daemon_version", "1"), "Welcome.daemon_version");
  check_rejected(decode_welcome, welcome_with("job_clock", "1"), "Welcome.job_clock");
  check_rejected(decode_welcome, welcome_with("catalog", "-1"), "Welcome.catalog");
  check_rejected(decode_welcome, welcome_with("catalog", "\"2\""), "Welcome.catalog");
  check_rejected(decode_welcome, "null", "Welcome body");
  check_rejected(decode_welcome, "{", "Welcome body");
}

TEST_CASE("Welcome: decode checks the segment geometry as MapClient does") {
  const auto g = ClientSegmentGeometry::compute(8, 65536);

  check_rejected(decode_welcome, welcome_with("segment_bytes", std::to_string(g.segment_bytes - 1)),
                 "Welcome geometry is inconsistent");
  check_rejected(decode_welcome, welcome_with("slots_offset", "0"),
                 "Welcome geometry is inconsistent");
  check_rejected(decode_welcome, welcome_with("slot_count", "257"), "Welcome.slot_count");
}

TEST_CASE("Welcome: decode checks the job clock and the TSC rate") {
  check_rejected(decode_welcome, welcome_with("job_clock", R"("sundial")"),
                 "unknown job clock 'sundial'");
  check_rejected(decode_welcome, welcome_with("job_clock", R"("tsc")"),
                 "Welcome.tsc_ns_per_tick is missing");
  const std::string tsc = welcome_with("job_clock", R"("tsc")");
  auto with_rate = [&](const std::string& rate) {
    return tsc.substr(0, tsc.size() - 1) + ",\"tsc_ns_per_tick\":" + rate + "}";
  };
  check_rejected(decode_welcome, with_rate("\"fast\""), "Welcome.tsc_ns_per_tick");
  check_rejected(decode_welcome, with_rate("0.01"), "bad TSC rate");
  check_rejected(decode_welcome, with_rate("100"), "bad TSC rate");
  check_rejected(decode_welcome, with_rate("-1"), "bad TSC rate");

  auto ok = decode_welcome(with_rate("1"));

  REQUIRE(ok.ok());
  CHECK(ok->job_clock == StampClock::kTsc);
  CHECK(ok->tsc_ns_per_tick == 1.0);
}

TEST_CASE("Welcome: decode checks the pools: fields, ids, fallbacks") {
  auto pools = [](const std::string& list) { return welcome_with("pools", list); };
  const std::string cpu = R"({"name":"cpu","id":0,"kind":"cpu","capacity":4,"client_share":1})";

  check_rejected(decode_welcome, pools("[1]"), "Welcome.pools[0] must be an object");
  check_rejected(decode_welcome, pools(R"([{"id":0,"kind":"cpu","capacity":4,"client_share":1}])"),
                 "Welcome.pools[0].name is missing");
  check_rejected(decode_welcome,
                 pools(R"([{"name":"a","id":8,"kind":"cpu","capacity":4,"client_share":1}])"),
                 "Welcome.pools[0].id");
  check_rejected(decode_welcome,
                 pools(R"([{"name":"a","id":0,"kind":"cpu","capacity":-4,"client_share":1}])"),
                 "Welcome.pools[0].capacity");
  check_rejected(decode_welcome,
                 pools(R"([{"name":"a","id":0,"kind":"cpu","capacity":4,"client_share":1.5}])"),
                 "Welcome.pools[0].client_share");
  check_rejected(
      decode_welcome,
      pools(R"([{"name":"a","id":0,"kind":"cpu","capacity":4,"client_share":1,"available":1}])"),
      "Welcome.pools[0].available");
  check_rejected(
      decode_welcome,
      pools(R"([{"name":"a","id":0,"kind":"cpu","capacity":4,"client_share":1,"reason":0}])"),
      "Welcome.pools[0].reason");
  check_rejected(
      decode_welcome,
      pools(R"([{"name":"a","id":0,"kind":"cpu","capacity":4,"client_share":1,"fallback":-2}])"),
      "Welcome.pools[0].fallback");
  check_rejected(decode_welcome, pools("[" + cpu + "," + cpu + "]"),
                 "Welcome.pools[1].id 0 is given to another pool");
  // An unavailable pool falls back to a pool that is missing, unavailable, or itself.
  const std::string gpu_to = R"({"name":"gpu","id":1,"kind":"gpu","capacity":4,"client_share":1,)"
                             R"("available":false,"fallback":)";
  check_rejected(decode_welcome, pools("[" + cpu + "," + gpu_to + "5}]"),
                 "Welcome.pools[1].fallback of pool 'gpu'");
  check_rejected(decode_welcome, pools("[" + cpu + "," + gpu_to + "1}]"),
                 "Welcome.pools[1].fallback of pool 'gpu'");

  auto falls_back = decode_welcome(pools("[" + cpu + "," + gpu_to + "0}]"));
  auto no_fallback = decode_welcome(pools("[" + cpu + "," + gpu_to + "-1}]"));

  REQUIRE(falls_back.ok());
  CHECK(falls_back->pools[1].fallback == 0);
  CHECK_FALSE(falls_back->pools[1].available);
  REQUIRE(no_fallback.ok());
  CHECK(no_fallback->pools[1].fallback == -1);
}

TEST_CASE("Welcome: decode checks the ops") {
  check_rejected(decode_welcome, welcome_with("ops", "[[1]]"), "Welcome.ops[0] must be an object");
  check_rejected(decode_welcome, welcome_with("ops", R"([{"name":"noop"}])"),
                 "Welcome.ops[0].id is missing");
  check_rejected(decode_welcome, welcome_with("ops", R"([{"name":2,"id":1}])"),
                 "Welcome.ops[0].name");
}

// ---- CatalogRequest, CatalogReply -------------------------------------------------------------

TEST_CASE("CatalogReply: the generation, pools and ops, and back; checked as Welcome's") {
  const WelcomeMessage w = sample_welcome();
  const CatalogReplyMessage reply{5, w.pools, w.ops};
  auto back = decode_catalog_reply(encode(reply));
  REQUIRE(back.ok());
  CHECK(*back == reply);
  CHECK(encode(CatalogRequestMessage{}) == "{}");
  CHECK(decode_catalog_request("{}").ok());
  check_rejected(decode_catalog_request, "[]", "CatalogRequest body");
  check_rejected(decode_catalog_reply, R"({"pools":[],"ops":[]})",
                 "CatalogReply.catalog is missing");
  check_rejected(decode_catalog_reply, R"({"catalog":1,"ops":[]})",
                 "CatalogReply.pools is missing");
  check_rejected(decode_catalog_reply, R"({"catalog":1,"pools":[]})",
                 "CatalogReply.ops is missing");
  check_rejected(decode_catalog_reply,
                 R"({"catalog":1,"ops":[],"pools":[)"
                 R"({"name":"a","id":0,"kind":"cpu","capacity":4,"client_share":1},)"
                 R"({"name":"b","id":0,"kind":"cpu","capacity":4,"client_share":1}]})",
                 "CatalogReply.pools[1].id 0 is given to another pool as well");
  check_rejected(decode_catalog_reply, R"({"catalog":1,"pools":[],"ops":[{"id":3}]})",
                 "CatalogReply.ops[0].name is missing");
}

TEST_CASE("ReloadRequest is {}; ReloadReply carries one line per change, and back") {
  CHECK(encode(ReloadRequestMessage{}) == "{}");
  CHECK(decode_reload_request("{}").ok());
  check_rejected(decode_reload_request, "[]", "ReloadRequest body");
  const ReloadReplyMessage reply{{"log_level: changed, in effect now", "pool py: removed"}};
  auto back = decode_reload_reply(encode(reply));
  REQUIRE(back.ok());
  CHECK(*back == reply);
  CHECK(decode_reload_reply(R"({"changes":[]})").ok());
  check_rejected(decode_reload_reply, "{}", "ReloadReply.changes is missing");
  check_rejected(decode_reload_reply, R"({"changes":"x"})", "ReloadReply.changes must be an array");
  check_rejected(decode_reload_reply, R"({"changes":["a",2]})",
                 "ReloadReply.changes[1] must be a string");
}

// ---- StatusRequest, StopRequest, StopReply, WorkerStop ----------------------------------------

TEST_CASE("the bodiless requests encode as {} and decode any JSON object") {
  CHECK(encode(StatusRequestMessage{}) == "{}");
  CHECK(encode(StopRequestMessage{}) == "{}");
  CHECK(encode(WorkerStopMessage{}) == "{}");
  CHECK(encode(WorkerPromoteMessage{}) == "{}");
  CHECK(decode_status_request("{}").ok());
  CHECK(decode_worker_promote("{}").ok());
  CHECK(decode_stop_request(R"({"future":1})").ok());
  CHECK(decode_worker_stop("{}").ok());
  check_rejected(decode_status_request, "[]", "StatusRequest body");
  check_rejected(decode_stop_request, "", "StopRequest body");
  check_rejected(decode_worker_stop, "1", "WorkerStop body");
  check_rejected(decode_worker_promote, "[1]", "WorkerPromote body");
}

TEST_CASE("StopReply: {\"draining\":true} and back") {
  auto back = decode_stop_reply(encode(StopReplyMessage{}));
  auto missing = decode_stop_reply("{}");

  CHECK(encode(StopReplyMessage{}) == R"({"draining":true})");
  REQUIRE(back.ok());
  CHECK(*back == StopReplyMessage{});
  REQUIRE(missing.ok());
  CHECK(missing->draining);
  check_rejected(decode_stop_reply, R"({"draining":"yes"})", "StopReply.draining");
}

TEST_CASE("RestartRequest and RestartReply: the pool, its generation, and back") {
  const RestartRequestMessage req{"py"};
  CHECK(encode(req) == R"({"pool":"py"})");
  auto req_back = decode_restart_request(encode(req));
  REQUIRE(req_back.ok());
  CHECK(*req_back == req);
  check_rejected(decode_restart_request, "{}", "RestartRequest.pool is missing");
  check_rejected(decode_restart_request, R"({"pool":3})", "RestartRequest.pool");
  const RestartReplyMessage reply{"py", 4};
  auto reply_back = decode_restart_reply(encode(reply));
  REQUIRE(reply_back.ok());
  CHECK(*reply_back == reply);
  check_rejected(decode_restart_reply, R"({"pool":"py"})", "RestartReply.generation is missing");
  check_rejected(decode_restart_reply, R"({"pool":"py","generation":-1})",
                 "RestartReply.generation");
}

// ---- MetricsRequest, MetricsReply -------------------------------------------------------------

TEST_CASE("MetricsRequest is {}; MetricsReply carries the text's size, at most 64 MiB") {
  CHECK(encode(MetricsRequestMessage{}) == "{}");
  CHECK(decode_metrics_request(R"({"future":1})").ok());
  check_rejected(decode_metrics_request, "[]", "MetricsRequest body");

  CHECK(encode(MetricsReplyMessage{1234}) == R"({"bytes":1234})");
  auto back = decode_metrics_reply(encode(MetricsReplyMessage{kMaxMetricsBytes}));
  REQUIRE(back.ok());
  CHECK(back->bytes == kMaxMetricsBytes);
  check_rejected(decode_metrics_reply, "{}", "MetricsReply.bytes");
  check_rejected(decode_metrics_reply, R"({"bytes":-1})", "MetricsReply.bytes");
  check_rejected(decode_metrics_reply, R"({"bytes":"12"})", "MetricsReply.bytes");
  check_rejected(decode_metrics_reply, R"({"bytes":67108865})", "MetricsReply.bytes");
  check_rejected(decode_metrics_reply, "[1]", "MetricsReply body");
}

// ---- WorkerReady ------------------------------------------------------------------------------

TEST_CASE("WorkerReady: encode then decode gives the same message") {
  const WorkerReadyMessage plain{4, "", "[]"};
  const WorkerReadyMessage full{5, R"({"device":"GPU-1234","memory_mib":1024})",
                                R"([[2000,"saxpy"],[2001,"scale"]])"};

  auto p = decode_worker_ready(encode(plain));
  auto f = decode_worker_ready(encode(full));

  CHECK(encode(plain) == R"({"backend":{},"plugin_ops":[],"worker":4})");
  REQUIRE(p.ok());
  CHECK(*p == plain);
  REQUIRE(f.ok());
  CHECK(*f == full);
}

TEST_CASE("WorkerReady: plugin_ops comes back compact, so it compares with plugin_op_list()") {
  auto r = decode_worker_ready(R"({"worker":0,"plugin_ops":[ [2000, "saxpy"] ],"backend":{}})");
  auto old = decode_worker_ready(R"({"worker":0})");

  REQUIRE(r.ok());
  CHECK(r->plugin_ops == R"([[2000,"saxpy"]])");
  CHECK(r->backend.empty());
  REQUIRE(old.ok());
  CHECK(old->plugin_ops == "[]");
  CHECK(old->backend.empty());
}

TEST_CASE("WorkerReady: decode rejects bad fields, naming them") {
  check_rejected(decode_worker_ready, "{}", "WorkerReady.worker is missing");
  check_rejected(decode_worker_ready, R"({"worker":-1})", "WorkerReady.worker");
  check_rejected(decode_worker_ready, R"({"worker":0,"backend":[]})", "WorkerReady.backend");
  check_rejected(decode_worker_ready, R"({"worker":0,"plugin_ops":{}})", "WorkerReady.plugin_ops");
  check_rejected(decode_worker_ready, R"({"worker":0,"plugin_ops":[[2000]]})",
                 "WorkerReady.plugin_ops");
  check_rejected(decode_worker_ready, R"({"worker":0,"plugin_ops":[["saxpy",2000]]})",
                 "WorkerReady.plugin_ops");
  check_rejected(decode_worker_ready, "x", "WorkerReady body");
}

// ---- MapClient, UnmapClient -------------------------------------------------------------------

TEST_CASE("MapClient: encode then decode gives the same message, in the old field names") {
  const MapClientMessage m{3, 7, 8, ClientSegmentGeometry::compute(8, 65536)};
  const auto& g = m.geometry;

  const std::string body = encode(m);
  auto back = decode_map_client(body);

  CHECK(body == "{\"arena_bytes\":" + std::to_string(g.arena_bytes) +
                    ",\"arena_offset\":" + std::to_string(g.arena_offset) +
                    ",\"client\":3,\"segment_bytes\":" + std::to_string(g.segment_bytes) +
                    ",\"session\":7,\"slot_count\":8,\"slots_offset\":" +
                    std::to_string(g.slots_offset) + "}");
  REQUIRE(back.ok());
  CHECK(*back == m);
}

TEST_CASE("MapClient: decode names the missing field and rejects a bad geometry") {
  const auto g = ClientSegmentGeometry::compute(8, 65536);
  MapClientMessage wraps{3, 7, 8, g};
  wraps.geometry.arena_offset = 1ull << 63;
  wraps.geometry.arena_bytes = 1ull << 63;
  wraps.geometry.segment_bytes = UINT64_MAX;

  check_rejected(decode_map_client, R"({"client":3,"session":7})", "MapClient.slot_count");
  check_rejected(decode_map_client, R"({"session":7})", "MapClient.client is missing");
  check_rejected(decode_map_client, encode(wraps), "MapClient geometry is inconsistent");
}

TEST_CASE("UnmapClient: encode then decode, and a client index beyond uint32 is refused") {
  const UnmapClientMessage m{3, 7};

  auto back = decode_unmap_client(encode(m));

  CHECK(encode(m) == R"({"client":3,"session":7})");
  REQUIRE(back.ok());
  CHECK(*back == m);
  check_rejected(decode_unmap_client, R"({"client":4294967296,"session":7})", "UnmapClient.client");
  check_rejected(decode_unmap_client, R"({"client":1})", "UnmapClient.session is missing");
}

}  // namespace
}  // namespace gpuq
