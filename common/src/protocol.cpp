#include "gpuq/common/protocol.hpp"

#include <sys/socket.h>
#include <sys/uio.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "gpuq/common/posix_call.hpp"

namespace gpuq {

Result<Message> decode_message(const uint8_t* data, size_t size) {
  if (size < sizeof(MessageHeader)) {
    return Error(ErrorCode::kInvalidArgument, "message of " + std::to_string(size) +
                                                  " bytes is shorter than its 16-byte header");
  }
  MessageHeader h;
  std::memcpy(&h, data, sizeof h);
  if (h.magic != kMessageMagic) {
    return Error(ErrorCode::kInvalidArgument, "message header has a bad magic number");
  }
  if (h.body_bytes > kMaxMessageBody) {
    return Error(ErrorCode::kInvalidArgument, "message body_bytes " + std::to_string(h.body_bytes) +
                                                  " exceeds the limit of " +
                                                  std::to_string(kMaxMessageBody));
  }
  if (h.body_bytes != size - sizeof(MessageHeader)) {
    return Error(ErrorCode::kInvalidArgument,
                 "message body_bytes " + std::to_string(h.body_bytes) + " does not match the " +
                     std::to_string(size - sizeof(MessageHeader)) + " bytes received");
  }
  Message m;
  m.version = h.version;
  m.type = static_cast<MessageType>(h.type);
  m.body.assign(reinterpret_cast<const char*>(data) + sizeof h, h.body_bytes);
  if (h.version != kProtocolVersion) {
    return Error(ErrorCode::kProtocolMismatch,
                 "peer speaks protocol version " + std::to_string(h.version) +
                     ", this side speaks version " + std::to_string(kProtocolVersion));
  }
  return m;
}

Result<void> send_message(int socket, MessageType type, const std::string& body,
                          const std::vector<int>& fds, uint16_t version) {
  if (body.size() > kMaxMessageBody || fds.size() > kMaxMessageFds) {
    return Error(ErrorCode::kInternal, "outgoing message too large");
  }
  MessageHeader h{kMessageMagic, version, static_cast<uint16_t>(type),
                  static_cast<uint32_t>(body.size()), 0};
  iovec iov[2] = {{&h, sizeof h}, {const_cast<char*>(body.data()), body.size()}};
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = body.empty() ? 1 : 2;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxMessageFds)];
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  auto r = GPUQ_POSIX_CALL(::sendmsg, socket, &msg, MSG_NOSIGNAL);
  if (!r) {
    // errno is still sendmsg's: the wrapper keeps it.
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return Error(ErrorCode::kTimeout, "the peer's receive queue is full");
    }
    if (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN) {
      return Error(ErrorCode::kDisconnected, "peer closed the control socket");
    }
    return r.error();
  }
  return {};
}

Result<Message> receive_message(int socket) {
  std::vector<uint8_t> buf(sizeof(MessageHeader) + kMaxMessageBody + 1);
  iovec iov{buf.data(), buf.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxMessageFds)];
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  auto r = GPUQ_POSIX_CALL(::recvmsg, socket, &msg, MSG_CMSG_CLOEXEC);
  if (!r) {
    // errno is still recvmsg's: the wrapper keeps it.
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return Error(ErrorCode::kTimeout, "no message waiting");
    }
    if (errno == ECONNRESET) return Error(ErrorCode::kDisconnected, "peer reset the connection");
    return r.error();
  }
  // Take ownership of any descriptors first, so that every error path closes them.
  std::vector<UniqueFd> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < n; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        fds.emplace_back(fd);
      }
    }
  }
  if (*r == 0) return Error(ErrorCode::kDisconnected, "peer closed the control socket");
  if ((msg.msg_flags & MSG_TRUNC) != 0) {
    return Error(ErrorCode::kInvalidArgument, "message was truncated (too large)");
  }
  if ((msg.msg_flags & MSG_CTRUNC) != 0) {
    // Too many descriptors attached, or none left in this process to receive them (EMFILE).
    return Error(ErrorCode::kSystemError,
                 "the descriptors sent with a message were dropped (too many, or this process is "
                 "out of file descriptors)");
  }
  auto m = decode_message(buf.data(), static_cast<size_t>(*r));
  if (!m) return m;
  m->fds = std::move(fds);
  return m;
}

std::string error_body(const Error& error) {
  nlohmann::json j{{"code", static_cast<int32_t>(error.code())},
                   {"name", std::string(error_code_name(error.code()))},
                   {"message", error.message()}};
  return j.dump();
}

Error error_from_body(const std::string& body) {
  try {
    auto j = nlohmann::json::parse(body);
    // Only an integer is a code: get<int32_t>() casts a float such as 1e300 to int32_t, which is
    // undefined behaviour (found by tests/fuzz/fuzz_protocol; regressions/fuzz_protocol/).
    const auto& c = j.at("code");
    if (!c.is_number_integer()) {
      return Error(ErrorCode::kInvalidArgument, "malformed error reply: code is not an integer");
    }
    int64_t code = c.is_number_unsigned() && c.get<uint64_t>() > uint64_t{kMaxErrorCode}
                       ? 0
                       : c.get<int64_t>();
    if (code <= 0 || code > kMaxErrorCode) code = static_cast<int64_t>(ErrorCode::kInternal);
    return Error(static_cast<ErrorCode>(code), j.at("message").get<std::string>());
  } catch (const std::exception& e) {
    return Error(ErrorCode::kInvalidArgument, std::string("malformed error reply: ") + e.what());
  }
}

}  // namespace gpuq
