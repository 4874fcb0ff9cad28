// The daemon's control socket for clients (control_channel.hpp).
#include "control_channel.hpp"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "gpuq/client.hpp"
#include "gpuq/common/messages.hpp"
#include "gpuq/common/posix_call.hpp"
#include "gpuq/common/runtime_dir.hpp"

namespace gpuq {
namespace channel {

Result<UniqueFd> connect_socket(const std::string& runtime_dir) {
  const std::string path = resolve_client_runtime_dir(runtime_dir) + "/" + kSocketName;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) {
    return Error(ErrorCode::kInvalidArgument, "socket path '" + path + "' is too long");
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  auto sock = GPUQ_POSIX_CALL(::socket, AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (!sock) return sock.error();
  UniqueFd fd(static_cast<int>(*sock));
  // Failures get their own messages (no daemon, no permission); errno is the call's own.
  if (!GPUQ_POSIX_CALL(::connect, fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr)) {
    if (errno == EACCES || errno == EPERM) {
      return Error(ErrorCode::kPermissionDenied, "no permission to connect to " + path +
                                                     " (is your user in the daemon's group?)");
    }
    return Error(ErrorCode::kDisconnected, "no gpuqd is listening at " + path + " (" +
                                               strerror(errno) +
                                               "); start gpuqd or set GPUQ_RUNTIME_DIR");
  }
  // Replies come within milliseconds; a daemon that says nothing for 10 s is wedged.
  timeval tv{10, 0};
  if (auto r = GPUQ_POSIX_CALL(::setsockopt, fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
      !r) {
    return r.error();
  }
  return fd;
}

// Receives the daemon's reply to the first request on a fresh connection. A daemon that refuses
// the peer (PermissionDenied at accept) sends its Error and closes at once; if the request was
// still unread then, the kernel reports the close as ECONNRESET on the first read (Disconnected)
// although the Error is still queued behind it: read once more.
Result<Message> receive_reply(int fd) {
  auto m = receive_message(fd);
  if (m || m.error().code() != ErrorCode::kDisconnected) return m;
  auto again = receive_message(fd);
  if (again && again->type == MessageType::kError) return again;
  return m;
}

// Sends the first request on a fresh connection. If the daemon closed the connection before the
// request went out (EPIPE: Disconnected), it may have said why first: return that error instead.
Result<void> send_request(int fd, MessageType type, const std::string& body) {
  auto sent = send_message(fd, type, body);
  if (sent || sent.error().code() != ErrorCode::kDisconnected) return sent;
  auto m = receive_reply(fd);
  if (m && m->type == MessageType::kError) return error_from_body(m->body);
  return sent;
}

// One request, one reply, on a fresh connection that registers no client.
Result<Message> control_request(const std::string& runtime_dir, MessageType type,
                                const std::string& body, MessageType reply_type,
                                uint32_t reply_timeout_s) {
  auto fd = connect_socket(runtime_dir);
  if (!fd) return fd.error();
  if (reply_timeout_s != 10) {
    timeval tv{static_cast<time_t>(reply_timeout_s), 0};
    if (auto r = GPUQ_POSIX_CALL(::setsockopt, fd->get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        !r) {
      return r.error();
    }
  }
  if (auto r = send_request(fd->get(), type, body); !r) return r.error();
  auto m = receive_reply(fd->get());
  if (!m) {
    if (m.error().code() == ErrorCode::kTimeout) {
      return Error(ErrorCode::kTimeout,
                   "the daemon did not answer within " + std::to_string(reply_timeout_s) + " s");
    }
    return m.error();
  }
  if (m->type == MessageType::kError) return error_from_body(m->body);
  if (m->type != reply_type) {
    return Error(ErrorCode::kProtocolMismatch,
                 "unexpected reply type " + std::to_string(static_cast<int>(m->type)));
  }
  return m;
}

}  // namespace channel

using channel::control_request;

Result<std::string> daemon_status_json(const std::string& runtime_dir) {
  auto m = control_request(runtime_dir, StatusRequestMessage::kType, encode(StatusRequestMessage{}),
                           MessageType::kStatusReply);
  if (!m) return m.error();
  return std::move(m->body);
}

Result<std::string> daemon_metrics_text(const std::string& runtime_dir) {
  auto m = control_request(runtime_dir, MetricsRequestMessage::kType,
                           encode(MetricsRequestMessage{}), MetricsReplyMessage::kType);
  if (!m) return m.error();
  auto reply = decode_metrics_reply(m->body);
  if (!reply) return Error(ErrorCode::kProtocolMismatch, reply.error().message());
  if (m->fds.size() != 1) {
    return Error(ErrorCode::kProtocolMismatch, "MetricsReply came without its memfd");
  }
  // The text is in the memfd: exactly `bytes` of it, or the reply is not one we understand.
  struct stat st {};
  if (auto r = GPUQ_POSIX_CALL(::fstat, m->fds[0].get(), &st); !r) return r.error();
  if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) != reply->bytes) {
    return Error(ErrorCode::kProtocolMismatch, "MetricsReply: the memfd does not hold " +
                                                   std::to_string(reply->bytes) + " bytes");
  }
  std::string text(reply->bytes, '\0');
  size_t done = 0;
  while (done < text.size()) {
    auto n = GPUQ_POSIX_CALL(::pread, m->fds[0].get(), text.data() + done, text.size() - done,
                             static_cast<off_t>(done));
    if (!n) return n.error();
    if (*n == 0) return Error(ErrorCode::kProtocolMismatch, "MetricsReply: the memfd is short");
    done += static_cast<size_t>(*n);
  }
  return text;
}

Result<uint32_t> daemon_restart_pool(const std::string& pool, const std::string& runtime_dir,
                                     uint32_t timeout_s) {
  auto m =
      control_request(runtime_dir, RestartRequestMessage::kType,
                      encode(RestartRequestMessage{pool}), RestartReplyMessage::kType, timeout_s);
  if (!m) return m.error();
  auto reply = decode_restart_reply(m->body);
  if (!reply) return Error(ErrorCode::kProtocolMismatch, reply.error().message());
  return reply->generation;
}

Result<std::vector<std::string>> daemon_reload(const std::string& runtime_dir, uint32_t timeout_s) {
  auto m = control_request(runtime_dir, ReloadRequestMessage::kType, encode(ReloadRequestMessage{}),
                           ReloadReplyMessage::kType, timeout_s);
  if (!m) return m.error();
  auto reply = decode_reload_reply(m->body);
  if (!reply) return Error(ErrorCode::kProtocolMismatch, reply.error().message());
  return std::move(reply->changes);
}

Result<void> daemon_stop(const std::string& runtime_dir) {
  auto m = control_request(runtime_dir, StopRequestMessage::kType, encode(StopRequestMessage{}),
                           StopReplyMessage::kType);
  if (!m) return m.error();
  return {};
}

}  // namespace gpuq
