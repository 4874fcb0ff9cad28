// The bodies of the control messages (protocol.hpp frames them): one struct per message, with its
// encoder and its decoder side by side, so that the side that builds a body and the side that
// parses it share one definition of its fields. docs/design/protocol.md lists the messages.
//
// For every message X (HelloMessage, WelcomeMessage, ...):
//   X::kType                          the MessageType its frame carries
//   std::string encode(const X&)      its JSON body (the exact field names and shapes on the wire)
//   Result<X> decode_<x>(body, ...)   the body parsed and checked
//
// Encoders never fail: a string that is not valid UTF-8 is sent with U+FFFD in place of the bad
// bytes. They abort (GPUQ_ASSERT) when given a JSON-text field (WorkerReadyMessage) that is not
// the JSON value documented for it: that is a bug in the caller.
//
// Decoders treat the body as untrusted. Each is pure, thread-safe and never throws (nlohmann_json's
// exceptions are caught inside); every error is InvalidArgument with a message that names the
// message and the field ("Hello.arena_bytes ...", "Welcome.pools[1].id ...") or the body ("Hello
// body: ..." when it is not a JSON object). A number is checked for its JSON type and range before
// it is read. Fields not listed are ignored, so that a newer peer may add some.
//
// Nothing here touches a socket: the senders and receivers are in daemon/ and libclient/, and
// tests/fuzz/fuzz_protocol.cpp feeds the decoders arbitrary bodies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gpuq/common/clock.hpp"
#include "gpuq/common/protocol.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "gpuq/error.hpp"

namespace gpuq {

// The longest client name a daemon accepts in Hello (bytes of UTF-8).
inline constexpr size_t kMaxClientNameBytes = 64;

// ---- client -> supervisor ---------------------------------------------------------------------

// Hello: {"pid", "name", "arena_bytes"}. Every field is optional on the wire.
struct HelloMessage {
  static constexpr MessageType kType = MessageType::kHello;
  int32_t pid = 0;           // informational (the daemon uses SO_PEERCRED); 0 when absent or bad
  std::string name;          // at most kMaxClientNameBytes; empty when absent
  uint64_t arena_bytes = 0;  // 0 when absent: the daemon's client_segment_bytes
  // True: jobs still running when this client leaves run to their end (results dropped).
  // False (absent): they are cancelled, forced after cancel_grace_ms.
  bool keep_running_jobs = false;
  friend bool operator==(const HelloMessage&, const HelloMessage&) = default;
};
std::string encode(const HelloMessage& m);
// Errors: InvalidArgument naming Hello.name (not a string, or longer than kMaxClientNameBytes),
// Hello.arena_bytes (not an unsigned integer, or above `max_arena_bytes`, the daemon's
// max_client_segment_bytes), Hello.keep_running_jobs (not a boolean) or the body. A pid that is not
// an int32 is ignored (read as 0).
Result<HelloMessage> decode_hello(std::string_view body, uint64_t max_arena_bytes);

// StatusRequest: {}. The daemon answers with the status document (StatusReply), which is the
// output of `gpuqctl status --json` and has no struct here.
struct StatusRequestMessage {
  static constexpr MessageType kType = MessageType::kStatusRequest;
  friend bool operator==(const StatusRequestMessage&, const StatusRequestMessage&) = default;
};
std::string encode(const StatusRequestMessage& m);
// Errors: InvalidArgument when the body is not a JSON object.
Result<StatusRequestMessage> decode_status_request(std::string_view body);

// StopRequest: {}: drain and exit.
struct StopRequestMessage {
  static constexpr MessageType kType = MessageType::kStopRequest;
  friend bool operator==(const StopRequestMessage&, const StopRequestMessage&) = default;
};
std::string encode(const StopRequestMessage& m);
// Errors: InvalidArgument when the body is not a JSON object.
Result<StopRequestMessage> decode_stop_request(std::string_view body);

// MetricsRequest: {}. The daemon answers with MetricsReply: the metrics in the Prometheus text
// format (docs/metrics.md), in a sealed memfd that comes with the reply (the text can outgrow a
// message).
struct MetricsRequestMessage {
  static constexpr MessageType kType = MessageType::kMetricsRequest;
  friend bool operator==(const MetricsRequestMessage&, const MetricsRequestMessage&) = default;
};
std::string encode(const MetricsRequestMessage& m);
// Errors: InvalidArgument when the body is not a JSON object.
Result<MetricsRequestMessage> decode_metrics_request(std::string_view body);

// ---- supervisor -> client ---------------------------------------------------------------------

// MetricsReply: {"bytes": N}, the size of the text in the memfd sent with it.
inline constexpr uint64_t kMaxMetricsBytes = 64ull << 20;
struct MetricsReplyMessage {
  static constexpr MessageType kType = MessageType::kMetricsReply;
  uint64_t bytes = 0;
  friend bool operator==(const MetricsReplyMessage&, const MetricsReplyMessage&) = default;
};
std::string encode(const MetricsReplyMessage& m);
// Errors: InvalidArgument when the body is not an object or bytes is not an unsigned integer
// of at most kMaxMetricsBytes.
Result<MetricsReplyMessage> decode_metrics_reply(std::string_view body);

// One pool of Welcome.pools: {"name", "id", "kind", "capacity", "client_share", "available",
// "reason", "fallback"}.
struct WelcomePool {
  std::string name;
  uint32_t id = 0;   // < kMaxPools, unique in the message
  std::string kind;  // "cpu" or "gpu" today; any string is accepted
  uint32_t capacity = 0;
  uint32_t client_share = 0;
  bool available = true;  // true when absent (a daemon from before GPU pools)
  std::string reason;     // why it is unavailable; empty when absent
  // The id of the pool that runs this pool's jobs while it is unavailable, or -1 (also when
  // absent). For an unavailable pool, a value >= 0 names another pool of the message that is
  // available; for an available one the daemon sends its configured fallback, unchecked.
  int32_t fallback = -1;
  friend bool operator==(const WelcomePool&, const WelcomePool&) = default;
};

// One op of Welcome.ops: {"name", "id"}.
struct WelcomeOp {
  std::string name;
  uint32_t id = 0;
  friend bool operator==(const WelcomeOp&, const WelcomeOp&) = default;
};

// Welcome: the reply to Hello, with the client's segment as its one descriptor. The geometry
// fields are MapClient's ({"client", "session", "slot_count", "slots_offset", "arena_offset",
// "arena_bytes", "segment_bytes"}), then "epoch", "queue_segment", "daemon_version", "job_clock",
// "tsc_ns_per_tick" (only with "tsc"), "catalog", "pools" and "ops".
struct WelcomeMessage {
  static constexpr MessageType kType = MessageType::kWelcome;
  uint32_t client = 0;   // the client's index
  uint64_t session = 0;  // its registration number
  uint32_t slot_count = 0;
  ClientSegmentGeometry geometry{};
  uint64_t epoch = 0;
  std::string queue_segment;   // the POSIX shared-memory name of the queue segment
  std::string daemon_version;  // empty when absent
  StampClock job_clock = StampClock::kMonotonic;  // "monotonic" when absent
  double tsc_ns_per_tick = 0;  // with kTsc: in (0.01, 100); 0 otherwise (not sent)
  // The catalog's generation (QueueHeader::catalog_generation) the pools and ops below are of;
  // 0 when absent.
  uint32_t catalog = 0;
  std::vector<WelcomePool> pools;
  std::vector<WelcomeOp> ops;
};
bool operator==(const WelcomeMessage& a, const WelcomeMessage& b);
std::string encode(const WelcomeMessage& m);
// On success the geometry is consistent as in decode_map_client, job_clock is a known clock, the
// TSC rate lies in (0.01, 100) ns per tick when the clock is "tsc", the pool ids are < kMaxPools
// and unique, and each unavailable pool's fallback is -1 or an available pool of the message.
// Errors: InvalidArgument naming the missing or mistyped field (Welcome.pools[2].capacity), the
// inconsistent geometry, the unknown clock, the bad TSC rate, the duplicate pool id or the bad
// fallback.
Result<WelcomeMessage> decode_welcome(std::string_view body);

// StopReply: {"draining": true}, sent before the drain starts.
struct StopReplyMessage {
  static constexpr MessageType kType = MessageType::kStopReply;
  bool draining = true;
  friend bool operator==(const StopReplyMessage&, const StopReplyMessage&) = default;
};
std::string encode(const StopReplyMessage& m);
// Errors: InvalidArgument when the body is not a JSON object or draining is not a boolean.
// A missing draining reads as true.
Result<StopReplyMessage> decode_stop_reply(std::string_view body);

// RestartRequest: {"pool"}: a rolling restart of that pool (docs/design/live_changes.md). The
// reply comes when the rollout ends: RestartReply, or an Error saying why it stopped.
struct RestartRequestMessage {
  static constexpr MessageType kType = MessageType::kRestartRequest;
  std::string pool;
  friend bool operator==(const RestartRequestMessage&, const RestartRequestMessage&) = default;
};
std::string encode(const RestartRequestMessage& m);
// Errors: InvalidArgument when the body is not a JSON object or pool is not a string.
Result<RestartRequestMessage> decode_restart_request(std::string_view body);

// RestartReply: {"pool", "generation"}: every worker of the pool now runs that generation.
struct RestartReplyMessage {
  static constexpr MessageType kType = MessageType::kRestartReply;
  std::string pool;
  uint32_t generation = 0;
  friend bool operator==(const RestartReplyMessage&, const RestartReplyMessage&) = default;
};
std::string encode(const RestartReplyMessage& m);
// Errors: InvalidArgument when the body is not a JSON object or a field is missing or wrong.
Result<RestartReplyMessage> decode_restart_reply(std::string_view body);

// CatalogRequest: {}: the pools and ops as they are now (docs/design/live_changes.md, "Clients
// see it without reconnecting"). A connected client asks, on a connection of its own, when the
// queue header's catalog generation has moved since its Welcome.
struct CatalogRequestMessage {
  static constexpr MessageType kType = MessageType::kCatalogRequest;
  friend bool operator==(const CatalogRequestMessage&, const CatalogRequestMessage&) = default;
};
std::string encode(const CatalogRequestMessage& m);
// Errors: InvalidArgument when the body is not a JSON object.
Result<CatalogRequestMessage> decode_catalog_request(std::string_view body);

// CatalogReply: {"catalog", "pools", "ops"}, the same pools and ops as Welcome's, of that
// catalog generation.
struct CatalogReplyMessage {
  static constexpr MessageType kType = MessageType::kCatalogReply;
  uint32_t catalog = 0;
  std::vector<WelcomePool> pools;
  std::vector<WelcomeOp> ops;
  friend bool operator==(const CatalogReplyMessage&, const CatalogReplyMessage&) = default;
};
std::string encode(const CatalogReplyMessage& m);
// Checked as Welcome's pools and ops are. Errors: InvalidArgument naming the field
// (CatalogReply.pools[1].id ...).
Result<CatalogReplyMessage> decode_catalog_reply(std::string_view body);

// ReloadRequest: {}: read the config file again and apply what changed
// (docs/design/live_changes.md, "Config reload"). The reply comes when it is applied and the
// rolling restarts it started have ended: ReloadReply, or an Error saying why nothing changed
// (or which rollout failed).
struct ReloadRequestMessage {
  static constexpr MessageType kType = MessageType::kReloadRequest;
  friend bool operator==(const ReloadRequestMessage&, const ReloadRequestMessage&) = default;
};
std::string encode(const ReloadRequestMessage& m);
// Errors: InvalidArgument when the body is not a JSON object.
Result<ReloadRequestMessage> decode_reload_request(std::string_view body);

// ReloadReply: {"changes": ["pool py: python.modules changed: rolling restart", ...]}.
struct ReloadReplyMessage {
  static constexpr MessageType kType = MessageType::kReloadReply;
  std::vector<std::string> changes;
  friend bool operator==(const ReloadReplyMessage&, const ReloadReplyMessage&) = default;
};
std::string encode(const ReloadReplyMessage& m);
// Errors: InvalidArgument when the body is not a JSON object or changes is not an array of
// strings.
Result<ReloadReplyMessage> decode_reload_reply(std::string_view body);

// ---- supervisor <-> worker --------------------------------------------------------------------

// WorkerReady: {"worker", "backend", "plugin_ops"}.
struct WorkerReadyMessage {
  static constexpr MessageType kType = MessageType::kWorkerReady;
  uint32_t worker = 0;
  // What the worker's backend reports about itself: JSON object text, kept as text so that this
  // header needs no JSON library. Empty for none: encode sends {} for it, and decode returns it for
  // {} or a missing field.
  std::string backend;
  // The plug-in ops this worker loaded: JSON array text of [id, name] pairs, as the daemon's
  // plugin_op_list() writes it. Decode returns it in the same compact form (nlohmann_json's
  // dump()), so it equals plugin_op_list()'s text, compared as strings, exactly when the two
  // lists are equal. "[]" when absent.
  std::string plugin_ops = "[]";
  friend bool operator==(const WorkerReadyMessage&, const WorkerReadyMessage&) = default;
};
// Aborts when `backend` is neither empty nor a JSON object, or `plugin_ops` is not a JSON array.
std::string encode(const WorkerReadyMessage& m);
// Errors: InvalidArgument naming WorkerReady.worker (missing, or not a uint32),
// WorkerReady.backend (not an object) or WorkerReady.plugin_ops (not an array of [id, name]
// pairs).
Result<WorkerReadyMessage> decode_worker_ready(std::string_view body);

// MapClient: {"client", "session", "slot_count", "slots_offset", "arena_offset", "arena_bytes",
// "segment_bytes"}, with the client's segment as its one descriptor.
struct MapClientMessage {
  static constexpr MessageType kType = MessageType::kMapClient;
  uint32_t client = 0;
  uint64_t session = 0;
  uint32_t slot_count = 0;
  ClientSegmentGeometry geometry{};
};
bool operator==(const MapClientMessage& a, const MapClientMessage& b);
std::string encode(const MapClientMessage& m);
// On success the geometry is consistent: slot_count <= kMaxSlotsPerClient, the header, the slots
// and the arena lie in this order inside segment_bytes, without overflow.
// Errors: InvalidArgument naming the missing or mistyped field, or the inconsistent geometry.
Result<MapClientMessage> decode_map_client(std::string_view body);

// UnmapClient: {"client", "session"}.
struct UnmapClientMessage {
  static constexpr MessageType kType = MessageType::kUnmapClient;
  uint32_t client = 0;
  uint64_t session = 0;
  friend bool operator==(const UnmapClientMessage&, const UnmapClientMessage&) = default;
};
std::string encode(const UnmapClientMessage& m);
// Errors: InvalidArgument naming the missing or mistyped field.
Result<UnmapClientMessage> decode_unmap_client(std::string_view body);

// WorkerStop: {}: finish the ring and exit.
struct WorkerStopMessage {
  static constexpr MessageType kType = MessageType::kWorkerStop;
  friend bool operator==(const WorkerStopMessage&, const WorkerStopMessage&) = default;
};
std::string encode(const WorkerStopMessage& m);
// Errors: InvalidArgument when the body is not a JSON object.
Result<WorkerStopMessage> decode_worker_stop(std::string_view body);

// WorkerPromote: {}: sent to a spare worker (WorkerPrivate::hold == kHoldSpare) after the
// supervisor lowered its `hold`, to wake it: from now on it takes jobs from its pool's ring.
struct WorkerPromoteMessage {
  static constexpr MessageType kType = MessageType::kWorkerPromote;
  friend bool operator==(const WorkerPromoteMessage&, const WorkerPromoteMessage&) = default;
};
std::string encode(const WorkerPromoteMessage& m);
// Errors: InvalidArgument when the body is not a JSON object.
Result<WorkerPromoteMessage> decode_worker_promote(std::string_view body);

}  // namespace gpuq
