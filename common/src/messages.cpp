#include "gpuq/common/messages.hpp"

#include <algorithm>
#include <exception>
#include <limits>
#include <nlohmann/json.hpp>

#include "gpuq/common/assert.hpp"

namespace gpuq {
namespace {

using nlohmann::json;

constexpr uint64_t kU32 = std::numeric_limits<uint32_t>::max();
constexpr uint64_t kU64 = std::numeric_limits<uint64_t>::max();

Error bad(const std::string& what) {
  return Error(ErrorCode::kInvalidArgument, what);
}

// Compact JSON text; bytes that are not UTF-8 become U+FFFD instead of an exception.
std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
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

// The unsigned integer field `key` of object `j`, at most `max`; `where` names `j` in errors
// ("MapClient", "Welcome.pools[1]").
Result<uint64_t> get_unsigned(const json& j, const std::string& where, const char* key,
                              uint64_t max) {
  auto it = j.find(key);
  if (it == j.end()) return bad(where + "." + key + " is missing");
  if (!it->is_number_unsigned() || it->get<uint64_t>() > max) {
    return bad(where + "." + key + " must be an integer in [0, " + std::to_string(max) + "]");
  }
  return it->get<uint64_t>();
}

// The string field `key` of object `j`, or `absent` when the field is missing and `absent` is
// non-null.
Result<std::string> get_string(const json& j, const std::string& where, const char* key,
                               const char* absent = nullptr) {
  auto it = j.find(key);
  if (it == j.end()) {
    if (absent != nullptr) return std::string(absent);
    return bad(where + "." + key + " is missing");
  }
  if (!it->is_string()) return bad(where + "." + key + " must be a string");
  return it->get<std::string>();
}

// The boolean field `key` of object `j`, `absent` when it is missing.
Result<bool> get_bool(const json& j, const std::string& where, const char* key, bool absent) {
  auto it = j.find(key);
  if (it == j.end()) return absent;
  if (!it->is_boolean()) return bad(where + "." + key + " must be true or false");
  return it->get<bool>();
}

// header | events | slots | arena, in this order, inside the segment. slot_count <=
// kMaxSlotsPerClient (checked by the caller), so the slots' size cannot overflow; each comparison
// below is arranged so that no sum can either.
Result<void> check_geometry(const char* message, uint32_t slot_count,
                            const ClientSegmentGeometry& g) {
  const uint64_t slots_size = uint64_t{slot_count} * sizeof(JobSlot);
  if (g.slots_offset < kClientSlotsMinOffset || g.slots_offset % alignof(JobSlot) != 0 ||
      g.slots_offset > g.segment_bytes || slots_size > g.segment_bytes - g.slots_offset ||
      g.arena_offset < g.slots_offset + slots_size || g.arena_offset > g.segment_bytes ||
      g.arena_bytes > g.segment_bytes - g.arena_offset) {
    return bad(std::string(message) + " geometry is inconsistent: " + std::to_string(slot_count) +
               " slots at " + std::to_string(g.slots_offset) + ", arena of " +
               std::to_string(g.arena_bytes) + " bytes at " + std::to_string(g.arena_offset) +
               ", segment of " + std::to_string(g.segment_bytes) + " bytes");
  }
  return {};
}

// The segment fields MapClient and Welcome share, written into `j`.
void put_segment(json& j, uint32_t client, uint64_t session, uint32_t slot_count,
                 const ClientSegmentGeometry& g) {
  j["client"] = client;
  j["session"] = session;
  j["slot_count"] = slot_count;
  j["slots_offset"] = g.slots_offset;
  j["arena_offset"] = g.arena_offset;
  j["arena_bytes"] = g.arena_bytes;
  j["segment_bytes"] = g.segment_bytes;
}

// Reads the segment fields MapClient and Welcome share from `j` and checks the geometry.
Result<void> get_segment(const json& j, const char* message, uint32_t& client, uint64_t& session,
                         uint32_t& slot_count, ClientSegmentGeometry& g) {
  const std::string where = message;
  auto c = get_unsigned(j, where, "client", kU32);
  if (!c) return c.error();
  auto s = get_unsigned(j, where, "session", kU64);
  if (!s) return s.error();
  auto slots = get_unsigned(j, where, "slot_count", kMaxSlotsPerClient);
  if (!slots) return slots.error();
  auto slots_offset = get_unsigned(j, where, "slots_offset", kU64);
  if (!slots_offset) return slots_offset.error();
  auto arena_offset = get_unsigned(j, where, "arena_offset", kU64);
  if (!arena_offset) return arena_offset.error();
  auto arena_bytes = get_unsigned(j, where, "arena_bytes", kU64);
  if (!arena_bytes) return arena_bytes.error();
  auto segment_bytes = get_unsigned(j, where, "segment_bytes", kU64);
  if (!segment_bytes) return segment_bytes.error();
  client = static_cast<uint32_t>(*c);
  session = *s;
  slot_count = static_cast<uint32_t>(*slots);
  g = {*slots_offset, *arena_offset, *arena_bytes, *segment_bytes};
  return check_geometry(message, slot_count, g);
}

bool same_geometry(const ClientSegmentGeometry& a, const ClientSegmentGeometry& b) {
  return a.slots_offset == b.slots_offset && a.arena_offset == b.arena_offset &&
         a.arena_bytes == b.arena_bytes && a.segment_bytes == b.segment_bytes;
}

// A body that is an object and carries nothing else: StatusRequest, StopRequest, WorkerStop,
// WorkerPromote.
template <typename T>
Result<T> decode_empty(std::string_view body, const char* message) {
  json j;
  if (auto r = parse_object(body, message, j); !r) return r.error();
  return T{};
}

Result<WelcomePool> decode_pool(const json& p, const std::string& where) {
  if (!p.is_object()) return bad(where + " must be an object");
  WelcomePool pool;
  auto name = get_string(p, where, "name");
  if (!name) return name.error();
  auto id = get_unsigned(p, where, "id", kMaxPools - 1);
  if (!id) return id.error();
  auto kind = get_string(p, where, "kind");
  if (!kind) return kind.error();
  auto capacity = get_unsigned(p, where, "capacity", kU32);
  if (!capacity) return capacity.error();
  auto share = get_unsigned(p, where, "client_share", kU32);
  if (!share) return share.error();
  auto available = get_bool(p, where, "available", true);
  if (!available) return available.error();
  auto reason = get_string(p, where, "reason", "");
  if (!reason) return reason.error();
  pool.name = std::move(*name);
  pool.id = static_cast<uint32_t>(*id);
  pool.kind = std::move(*kind);
  pool.capacity = static_cast<uint32_t>(*capacity);
  pool.client_share = static_cast<uint32_t>(*share);
  pool.available = *available;
  pool.reason = std::move(*reason);
  if (auto it = p.find("fallback"); it != p.end()) {
    if (!it->is_number_integer() ||
        (it->is_number_unsigned() && it->get<uint64_t>() >= kMaxPools) ||
        (!it->is_number_unsigned() && it->get<int64_t>() < -1)) {
      return bad(where + ".fallback must be -1 or a pool id below " + std::to_string(kMaxPools));
    }
    pool.fallback = static_cast<int32_t>(it->get<int64_t>());
  }
  return pool;
}

}  // namespace

// ---- Hello ------------------------------------------------------------------------------------

std::string encode(const HelloMessage& m) {
  json j{{"pid", m.pid}, {"name", m.name}, {"arena_bytes", m.arena_bytes}};
  if (m.keep_running_jobs) j["keep_running_jobs"] = true;  // absent: false (older daemons)
  return dump(j);
}

Result<HelloMessage> decode_hello(std::string_view body, uint64_t max_arena_bytes) {
  json j;
  if (auto r = parse_object(body, "Hello", j); !r) return r.error();
  HelloMessage hello;
  if (auto it = j.find("pid"); it != j.end() && it->is_number_integer()) {
    // Informational only: a pid that does not fit is read as 0, never refused.
    const bool fits = it->is_number_unsigned()
                          ? it->get<uint64_t>() <= uint64_t{std::numeric_limits<int32_t>::max()}
                          : it->get<int64_t>() >= std::numeric_limits<int32_t>::min();
    if (fits) hello.pid = static_cast<int32_t>(it->get<int64_t>());
  }
  if (auto it = j.find("name"); it != j.end()) {
    if (!it->is_string() || it->get_ref<const std::string&>().size() > kMaxClientNameBytes) {
      return bad("Hello.name must be a string of at most " + std::to_string(kMaxClientNameBytes) +
                 " bytes");
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
  if (auto it = j.find("keep_running_jobs"); it != j.end()) {
    if (!it->is_boolean()) return bad("Hello.keep_running_jobs must be true or false");
    hello.keep_running_jobs = it->get<bool>();
  }
  return hello;
}

// ---- StatusRequest, StopRequest, WorkerStop ---------------------------------------------------

std::string encode(const StatusRequestMessage&) {
  return "{}";
}
Result<StatusRequestMessage> decode_status_request(std::string_view body) {
  return decode_empty<StatusRequestMessage>(body, "StatusRequest");
}

std::string encode(const StopRequestMessage&) {
  return "{}";
}
Result<StopRequestMessage> decode_stop_request(std::string_view body) {
  return decode_empty<StopRequestMessage>(body, "StopRequest");
}

std::string encode(const MetricsRequestMessage&) {
  return "{}";
}
Result<MetricsRequestMessage> decode_metrics_request(std::string_view body) {
  return decode_empty<MetricsRequestMessage>(body, "MetricsRequest");
}

std::string encode(const WorkerStopMessage&) {
  return "{}";
}
Result<WorkerStopMessage> decode_worker_stop(std::string_view body) {
  return decode_empty<WorkerStopMessage>(body, "WorkerStop");
}

std::string encode(const WorkerPromoteMessage&) {
  return "{}";
}
Result<WorkerPromoteMessage> decode_worker_promote(std::string_view body) {
  return decode_empty<WorkerPromoteMessage>(body, "WorkerPromote");
}

// ---- The catalog: pools and ops (Welcome, CatalogReply) ----------------------------------------

namespace {

void put_catalog(json& j, const std::vector<WelcomePool>& pool_list,
                 const std::vector<WelcomeOp>& op_list) {
  json pools = json::array();
  for (const WelcomePool& p : pool_list) {
    pools.push_back({{"name", p.name},
                     {"id", p.id},
                     {"kind", p.kind},
                     {"capacity", p.capacity},
                     {"client_share", p.client_share},
                     {"available", p.available},
                     {"reason", p.reason},
                     {"fallback", p.fallback}});
  }
  j["pools"] = std::move(pools);
  json ops = json::array();
  for (const WelcomeOp& o : op_list) ops.push_back({{"name", o.name}, {"id", o.id}});
  j["ops"] = std::move(ops);
}

// Reads "pools" and "ops" of `j` (`what`: "Welcome" or "CatalogReply") and checks them: pool ids
// unique, each unavailable pool's fallback an available pool of the list.
Result<void> get_catalog(const json& j, const std::string& what,
                         std::vector<WelcomePool>& out_pools, std::vector<WelcomeOp>& out_ops) {
  auto pools = j.find("pools");
  if (pools == j.end()) return bad(what + ".pools is missing");
  if (!pools->is_array()) return bad(what + ".pools must be an array");
  for (size_t i = 0; i < pools->size(); ++i) {
    const std::string where = what + ".pools[" + std::to_string(i) + "]";
    auto pool = decode_pool((*pools)[i], where);
    if (!pool) return pool.error();
    const uint32_t id = pool->id;
    if (std::any_of(out_pools.begin(), out_pools.end(),
                    [&](const auto& p) { return p.id == id; })) {
      return bad(where + ".id " + std::to_string(id) + " is given to another pool as well");
    }
    out_pools.push_back(std::move(*pool));
  }
  for (size_t i = 0; i < out_pools.size(); ++i) {
    const WelcomePool& pool = out_pools[i];
    if (pool.available || pool.fallback < 0) continue;
    auto to = std::find_if(out_pools.begin(), out_pools.end(), [&](const WelcomePool& q) {
      return static_cast<int64_t>(q.id) == pool.fallback;
    });
    if (to == out_pools.end() || !to->available) {
      return bad(what + ".pools[" + std::to_string(i) + "].fallback of pool '" + pool.name +
                 "' is " + std::to_string(pool.fallback) + ", which is no available pool");
    }
  }

  auto ops = j.find("ops");
  if (ops == j.end()) return bad(what + ".ops is missing");
  if (!ops->is_array()) return bad(what + ".ops must be an array");
  for (size_t i = 0; i < ops->size(); ++i) {
    const std::string where = what + ".ops[" + std::to_string(i) + "]";
    const json& o = (*ops)[i];
    if (!o.is_object()) return bad(where + " must be an object");
    auto name = get_string(o, where, "name");
    if (!name) return name.error();
    auto id = get_unsigned(o, where, "id", kU32);
    if (!id) return id.error();
    out_ops.push_back({std::move(*name), static_cast<uint32_t>(*id)});
  }
  return {};
}

}  // namespace

// ---- Welcome ----------------------------------------------------------------------------------

bool operator==(const WelcomeMessage& a, const WelcomeMessage& b) {
  return a.client == b.client && a.session == b.session && a.slot_count == b.slot_count &&
         same_geometry(a.geometry, b.geometry) && a.epoch == b.epoch &&
         a.queue_segment == b.queue_segment && a.daemon_version == b.daemon_version &&
         a.job_clock == b.job_clock && a.tsc_ns_per_tick == b.tsc_ns_per_tick &&
         a.catalog == b.catalog && a.pools == b.pools && a.ops == b.ops;
}

std::string encode(const WelcomeMessage& m) {
  json j = json::object();
  put_segment(j, m.client, m.session, m.slot_count, m.geometry);
  j["epoch"] = m.epoch;
  j["queue_segment"] = m.queue_segment;
  j["daemon_version"] = m.daemon_version;
  j["job_clock"] = stamp_clock_name(m.job_clock);
  if (m.job_clock == StampClock::kTsc) j["tsc_ns_per_tick"] = m.tsc_ns_per_tick;
  j["catalog"] = m.catalog;
  put_catalog(j, m.pools, m.ops);
  return dump(j);
}

Result<WelcomeMessage> decode_welcome(std::string_view body) {
  json j;
  if (auto r = parse_object(body, "Welcome", j); !r) return r.error();
  WelcomeMessage w;
  if (auto r = get_segment(j, "Welcome", w.client, w.session, w.slot_count, w.geometry); !r) {
    return r.error();
  }
  auto epoch = get_unsigned(j, "Welcome", "epoch", kU64);
  if (!epoch) return epoch.error();
  w.epoch = *epoch;
  auto queue_segment = get_string(j, "Welcome", "queue_segment");
  if (!queue_segment) return queue_segment.error();
  w.queue_segment = std::move(*queue_segment);
  auto version = get_string(j, "Welcome", "daemon_version", "");
  if (!version) return version.error();
  w.daemon_version = std::move(*version);

  // What the job stamps count in (clock.hpp, "Job stamps"); a daemon that does not say uses
  // CLOCK_MONOTONIC.
  auto clock_name = get_string(j, "Welcome", "job_clock", "monotonic");
  if (!clock_name) return clock_name.error();
  auto clock = parse_stamp_clock(*clock_name);
  if (!clock) return bad("Welcome.job_clock names an " + clock.error().message());
  w.job_clock = *clock;
  if (w.job_clock == StampClock::kTsc) {
    auto it = j.find("tsc_ns_per_tick");
    if (it == j.end()) return bad("Welcome.tsc_ns_per_tick is missing");
    if (!it->is_number()) return bad("Welcome.tsc_ns_per_tick must be a number");
    w.tsc_ns_per_tick = it->get<double>();
    // Any TSC ticks between 0.01 GHz and 100 GHz.
    if (!(w.tsc_ns_per_tick > 0.01 && w.tsc_ns_per_tick < 100.0)) {
      return bad("Welcome.tsc_ns_per_tick gives a bad TSC rate (" +
                 std::to_string(w.tsc_ns_per_tick) + " ns per tick)");
    }
  }

  if (j.contains("catalog")) {  // absent: a daemon from before live changes, generation 0
    auto catalog = get_unsigned(j, "Welcome", "catalog", kU32);
    if (!catalog) return catalog.error();
    w.catalog = static_cast<uint32_t>(*catalog);
  }
  if (auto r = get_catalog(j, "Welcome", w.pools, w.ops); !r) return r.error();
  return w;
}

// ---- StopReply --------------------------------------------------------------------------------

std::string encode(const StopReplyMessage& m) {
  return dump(json{{"draining", m.draining}});
}

Result<StopReplyMessage> decode_stop_reply(std::string_view body) {
  json j;
  if (auto r = parse_object(body, "StopReply", j); !r) return r.error();
  auto draining = get_bool(j, "StopReply", "draining", true);
  if (!draining) return draining.error();
  return StopReplyMessage{*draining};
}

// ---- RestartRequest, RestartReply -------------------------------------------------------------

std::string encode(const RestartRequestMessage& m) {
  return dump(json{{"pool", m.pool}});
}

Result<RestartRequestMessage> decode_restart_request(std::string_view body) {
  json j;
  if (auto r = parse_object(body, "RestartRequest", j); !r) return r.error();
  auto pool = get_string(j, "RestartRequest", "pool");
  if (!pool) return pool.error();
  return RestartRequestMessage{std::move(*pool)};
}

std::string encode(const RestartReplyMessage& m) {
  return dump(json{{"pool", m.pool}, {"generation", m.generation}});
}

Result<RestartReplyMessage> decode_restart_reply(std::string_view body) {
  json j;
  if (auto r = parse_object(body, "RestartReply", j); !r) return r.error();
  auto pool = get_string(j, "RestartReply", "pool");
  if (!pool) return pool.error();
  auto generation = get_unsigned(j, "RestartReply", "generation", UINT32_MAX);
  if (!generation) return generation.error();
  return RestartReplyMessage{std::move(*pool), static_cast<uint32_t>(*generation)};
}

// ---- MetricsReply -----------------------------------------------------------------------------

std::string encode(const MetricsReplyMessage& m) {
  return dump(json{{"bytes", m.bytes}});
}

Result<MetricsReplyMessage> decode_metrics_reply(std::string_view body) {
  json j;
  if (auto r = parse_object(body, "MetricsReply", j); !r) return r.error();
  auto it = j.find("bytes");
  if (it == j.end() || !it->is_number_unsigned() || it->get<uint64_t>() > kMaxMetricsBytes) {
    return bad("MetricsReply.bytes must be an unsigned integer of at most " +
               std::to_string(kMaxMetricsBytes));
  }
  return MetricsReplyMessage{it->get<uint64_t>()};
}

// ---- WorkerReady ------------------------------------------------------------------------------

std::string encode(const WorkerReadyMessage& m) {
  json backend = m.backend.empty() ? json::object() : json::parse(m.backend, nullptr, false);
  json plugin_ops = json::parse(m.plugin_ops, nullptr, false);
  GPUQ_ASSERT(backend.is_object());
  GPUQ_ASSERT(plugin_ops.is_array());
  return dump(json{{"worker", m.worker}, {"backend", backend}, {"plugin_ops", plugin_ops}});
}

Result<WorkerReadyMessage> decode_worker_ready(std::string_view body) {
  json j;
  if (auto r = parse_object(body, "WorkerReady", j); !r) return r.error();
  WorkerReadyMessage m;
  auto worker = get_unsigned(j, "WorkerReady", "worker", kU32);
  if (!worker) return worker.error();
  m.worker = static_cast<uint32_t>(*worker);
  if (auto it = j.find("backend"); it != j.end()) {
    if (!it->is_object()) return bad("WorkerReady.backend must be a JSON object");
    if (!it->empty()) m.backend = dump(*it);
  }
  if (auto it = j.find("plugin_ops"); it != j.end()) {
    const bool pairs = it->is_array() && std::all_of(it->begin(), it->end(), [](const json& e) {
                         return e.is_array() && e.size() == 2 && e[0].is_number_unsigned() &&
                                e[0].get<uint64_t>() <= kU32 && e[1].is_string();
                       });
    if (!pairs) return bad("WorkerReady.plugin_ops must be an array of [id, name] pairs");
    m.plugin_ops = dump(*it);
  }
  return m;
}

// ---- MapClient, UnmapClient -------------------------------------------------------------------

bool operator==(const MapClientMessage& a, const MapClientMessage& b) {
  return a.client == b.client && a.session == b.session && a.slot_count == b.slot_count &&
         same_geometry(a.geometry, b.geometry);
}

std::string encode(const MapClientMessage& m) {
  json j = json::object();
  put_segment(j, m.client, m.session, m.slot_count, m.geometry);
  return dump(j);
}

Result<MapClientMessage> decode_map_client(std::string_view body) {
  json j;
  if (auto r = parse_object(body, "MapClient", j); !r) return r.error();
  MapClientMessage m;
  if (auto r = get_segment(j, "MapClient", m.client, m.session, m.slot_count, m.geometry); !r) {
    return r.error();
  }
  return m;
}

std::string encode(const UnmapClientMessage& m) {
  return dump(json{{"client", m.client}, {"session", m.session}});
}

Result<UnmapClientMessage> decode_unmap_client(std::string_view body) {
  json j;
  if (auto r = parse_object(body, "UnmapClient", j); !r) return r.error();
  auto client = get_unsigned(j, "UnmapClient", "client", kU32);
  if (!client) return client.error();
  auto session = get_unsigned(j, "UnmapClient", "session", kU64);
  if (!session) return session.error();
  return UnmapClientMessage{static_cast<uint32_t>(*client), *session};
}

// ---- CatalogRequest, CatalogReply --------------------------------------------------------------

std::string encode(const CatalogRequestMessage&) {
  return "{}";
}

Result<CatalogRequestMessage> decode_catalog_request(std::string_view body) {
  return decode_empty<CatalogRequestMessage>(body, "CatalogRequest");
}

std::string encode(const CatalogReplyMessage& m) {
  json j = json::object();
  j["catalog"] = m.catalog;
  put_catalog(j, m.pools, m.ops);
  return dump(j);
}

Result<CatalogReplyMessage> decode_catalog_reply(std::string_view body) {
  json j;
  if (auto r = parse_object(body, "CatalogReply", j); !r) return r.error();
  CatalogReplyMessage m;
  auto catalog = get_unsigned(j, "CatalogReply", "catalog", kU32);
  if (!catalog) return catalog.error();
  m.catalog = static_cast<uint32_t>(*catalog);
  if (auto r = get_catalog(j, "CatalogReply", m.pools, m.ops); !r) return r.error();
  return m;
}

// ---- ReloadRequest, ReloadReply ---------------------------------------------------------------

std::string encode(const ReloadRequestMessage&) {
  return "{}";
}

Result<ReloadRequestMessage> decode_reload_request(std::string_view body) {
  return decode_empty<ReloadRequestMessage>(body, "ReloadRequest");
}

std::string encode(const ReloadReplyMessage& m) {
  return dump(json{{"changes", m.changes}});
}

Result<ReloadReplyMessage> decode_reload_reply(std::string_view body) {
  json j;
  if (auto r = parse_object(body, "ReloadReply", j); !r) return r.error();
  auto it = j.find("changes");
  if (it == j.end()) return bad("ReloadReply.changes is missing");
  if (!it->is_array()) return bad("ReloadReply.changes must be an array");
  ReloadReplyMessage m;
  for (size_t i = 0; i < it->size(); ++i) {
    if (!(*it)[i].is_string()) {
      return bad("ReloadReply.changes[" + std::to_string(i) + "] must be a string");
    }
    m.changes.push_back((*it)[i].get<std::string>());
  }
  return m;
}

}  // namespace gpuq
