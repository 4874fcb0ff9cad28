// The control protocol: framed messages over a Unix SOCK_SEQPACKET socket (client <-> supervisor,
// supervisor <-> worker). Control traffic only: connect, status, stop, segment hand-over. Jobs
// never travel here; they go through shared memory.
//
// Frame: MessageHeader (16 bytes, little-endian) followed by `body_bytes` of UTF-8 JSON, in one
// datagram, optionally with file descriptors (SCM_RIGHTS). docs/design/protocol.md lists the
// messages and their fields.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpuq/common/unique_fd.hpp"
#include "gpuq/error.hpp"

namespace gpuq {

inline constexpr uint32_t kMessageMagic = 0x4D515047;  // "GPQM"
inline constexpr uint16_t kProtocolVersion = 1;
inline constexpr uint32_t kMaxMessageBody = 64 * 1024;
inline constexpr uint32_t kMaxMessageFds = 4;

enum class MessageType : uint16_t {
  // client <-> supervisor
  kHello = 1,            // client: {"pid", "name", "arena_bytes"}
  kWelcome = 2,          // daemon: geometry, pools, ops; fd: the client segment
  kError = 3,            // daemon: {"code", "message"}
  kStatusRequest = 4,    // client: {}
  kStatusReply = 5,      // daemon: the status document (gpuqctl status --json)
  kStopRequest = 6,      // client: {} - drain and exit
  kStopReply = 7,        // daemon: {"draining": true}
  kMetricsRequest = 8,   // client: {}
  kMetricsReply = 9,     // daemon: {"bytes": N}; fd: a sealed memfd holding the metrics text
  kRestartRequest = 10,  // client: {"pool"} - a rolling restart of the pool
  kRestartReply = 11,    // daemon: {"pool", "generation"} once the rollout has completed
  kCatalogRequest = 12,  // client: {} - the pools and ops as they are now
  kCatalogReply = 13,    // daemon: {"catalog", "pools", "ops"}
  kReloadRequest = 14,   // client: {} - read the config file again and apply it
  kReloadReply = 15,     // daemon: {"changes": ["..."]} once applied (and its rollouts ended)
  // supervisor <-> worker
  kWorkerReady = 16,    // worker: {"worker": id, "plugin_ops": [...], "backend": {...}}
  kMapClient = 17,      // supervisor: {"client", "session", geometry}; fd: the client segment
  kUnmapClient = 18,    // supervisor: {"client", "session"}
  kWorkerStop = 19,     // supervisor: {} - finish the ring and exit
  kWorkerPromote = 20,  // supervisor: {} - a spare's `hold` was lowered: take jobs now
};

struct MessageHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  uint32_t body_bytes;
  uint32_t reserved;
};
static_assert(sizeof(MessageHeader) == 16);

struct Message {
  uint16_t version = kProtocolVersion;
  MessageType type = MessageType::kError;
  std::string body;           // JSON text
  std::vector<UniqueFd> fds;  // received descriptors (owned)
};

// Validates a received datagram and splits it into a Message. Untrusted input: every size and
// field is checked; errors are InvalidArgument (malformed) or ProtocolMismatch (other version,
// reported only after the frame itself is well-formed). Does not parse the JSON body.
Result<Message> decode_message(const uint8_t* data, size_t size);

// Sends one framed message (and `fds`, which stay owned by the caller). Blocking; retries EINTR.
// Errors: SystemError (EPIPE etc. map to Disconnected).
Result<void> send_message(int socket, MessageType type, const std::string& body,
                          const std::vector<int>& fds = {}, uint16_t version = kProtocolVersion);

// Receives one message. Blocking unless the socket is non-blocking (then Timeout if none is
// waiting). Disconnected when the peer closed. Truncated or oversized datagrams are rejected.
Result<Message> receive_message(int socket);

// {"code": <int>, "message": "..."} for a kError body, and back.
std::string error_body(const Error& error);
Error error_from_body(const std::string& body);

}  // namespace gpuq
