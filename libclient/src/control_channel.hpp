// A connection to the daemon's control socket, and the requests on one that register no client
// (daemon_status_json, daemon_metrics_text, daemon_stop). ClientImpl::connect opens its own
// connection with the same calls.
#pragma once

#include <string>

#include "gpuq/common/protocol.hpp"
#include "gpuq/common/unique_fd.hpp"
#include "gpuq/error.hpp"

namespace gpuq::channel {

// Connects to the socket in `runtime_dir` (resolved as a client resolves it), with a 10 s
// receive timeout. Errors: Disconnected (no daemon), PermissionDenied, InvalidArgument (a path
// too long for a socket).
Result<UniqueFd> connect_socket(const std::string& runtime_dir);

// Receives the daemon's reply to the first request on a fresh connection.
Result<Message> receive_reply(int fd);

// Sends the first request on a fresh connection (the daemon's own error when it refused it).
Result<void> send_request(int fd, MessageType type, const std::string& body);

// One request, one reply of `reply_type`, on a fresh connection that registers no client.
// `reply_timeout_s`: how long the reply may take (a daemon that says nothing for that long is
// wedged; a rolling restart's reply comes when the rollout ends); 0: no limit.
Result<Message> control_request(const std::string& runtime_dir, MessageType type,
                                const std::string& body, MessageType reply_type,
                                uint32_t reply_timeout_s = 10);

}  // namespace gpuq::channel
