// Unit tests of the control protocol (common/include/gpuq/common/protocol.hpp): frame
// validation of untrusted datagrams, send/receive over a SOCK_SEQPACKET pair with descriptor
// passing, and the error body.
#include "gpuq/common/protocol.hpp"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gpuq/common/unique_fd.hpp"

namespace gpuq {
namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::vector<uint8_t> frame(const std::string& body, uint32_t magic = kMessageMagic,
                           uint16_t version = kProtocolVersion,
                           MessageType type = MessageType::kHello) {
  MessageHeader h{magic, version, static_cast<uint16_t>(type), static_cast<uint32_t>(body.size()),
                  0};
  std::vector<uint8_t> bytes(sizeof h + body.size());
  std::memcpy(bytes.data(), &h, sizeof h);
  if (!body.empty()) std::memcpy(bytes.data() + sizeof h, body.data(), body.size());
  return bytes;
}

void set_body_bytes(std::vector<uint8_t>& bytes, uint32_t body_bytes) {
  std::memcpy(bytes.data() + offsetof(MessageHeader, body_bytes), &body_bytes, sizeof body_bytes);
}

Result<Message> decode(const std::vector<uint8_t>& bytes) {
  return decode_message(bytes.data(), bytes.size());
}

struct SocketPair {
  SocketPair() {
    int fds[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) == 0);
    a.reset(fds[0]);
    b.reset(fds[1]);
  }
  UniqueFd a, b;
};

struct Pipe {
  Pipe() {
    int fds[2];
    REQUIRE(::pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0);
    read_end.reset(fds[0]);
    write_end.reset(fds[1]);
  }
  UniqueFd read_end, write_end;
};

// ---- decode_message -----------------------------------------------------------------------------

TEST_CASE("decode_message accepts a well-formed frame") {
  const auto bytes =
      frame(R"({"pid":1})", kMessageMagic, kProtocolVersion, MessageType::kStatusRequest);

  auto m = decode(bytes);

  REQUIRE_MESSAGE(m.ok(), m.error().to_string());
  CHECK(m->version == kProtocolVersion);
  CHECK(m->type == MessageType::kStatusRequest);
  CHECK(m->body == R"({"pid":1})");
  CHECK(m->fds.empty());
}

TEST_CASE("decode_message accepts an empty body and a body of exactly kMaxMessageBody") {
  auto empty = decode(frame(""));
  auto largest = decode(frame(std::string(kMaxMessageBody, 'x')));

  REQUIRE(empty.ok());
  CHECK(empty->body.empty());
  REQUIRE(largest.ok());
  CHECK(largest->body.size() == kMaxMessageBody);
}

TEST_CASE("decode_message rejects a frame shorter than its header") {
  const auto bytes = frame("");
  for (size_t size : {size_t{0}, size_t{1}, sizeof(MessageHeader) - 1}) {
    CAPTURE(size);

    auto m = decode_message(bytes.data(), size);

    REQUIRE_FALSE(m.ok());
    CHECK(m.error().code() == ErrorCode::kInvalidArgument);
    CHECK(contains(m.error().message(), "shorter than its 16-byte header"));
  }
}

TEST_CASE("decode_message rejects a bad magic number") {
  auto m = decode(frame("{}", 0x12345678));

  REQUIRE_FALSE(m.ok());
  CHECK(m.error().code() == ErrorCode::kInvalidArgument);
  CHECK(contains(m.error().message(), "magic"));
}

TEST_CASE("decode_message rejects body_bytes over kMaxMessageBody") {
  auto bytes = frame(std::string(kMaxMessageBody + 1, 'x'));

  auto m = decode(bytes);

  REQUIRE_FALSE(m.ok());
  CHECK(m.error().code() == ErrorCode::kInvalidArgument);
  CHECK(contains(m.error().message(), "exceeds the limit"));

  // A huge claimed length on a short datagram is rejected the same way (never trusted).
  auto small = frame("{}");
  set_body_bytes(small, UINT32_MAX);
  auto m2 = decode(small);
  REQUIRE_FALSE(m2.ok());
  CHECK(m2.error().code() == ErrorCode::kInvalidArgument);
}

TEST_CASE("decode_message rejects body_bytes that disagree with the datagram") {
  for (uint32_t claimed : {0u, 3u, 5u}) {
    CAPTURE(claimed);
    auto bytes = frame("four");
    set_body_bytes(bytes, claimed);

    auto m = decode(bytes);

    REQUIRE_FALSE(m.ok());
    CHECK(m.error().code() == ErrorCode::kInvalidArgument);
    CHECK(contains(m.error().message(), "does not match"));
  }
}

TEST_CASE("decode_message reports another protocol version as ProtocolMismatch") {
  auto m = decode(frame("{}", kMessageMagic, kProtocolVersion + 1));

  REQUIRE_FALSE(m.ok());
  CHECK(m.error().code() == ErrorCode::kProtocolMismatch);
  CHECK(contains(m.error().message(), "version " + std::to_string(kProtocolVersion + 1)));
}

TEST_CASE("decode_message checks the frame before the version") {
  // A malformed frame of another version is malformed, not a version mismatch.
  auto bad_magic = decode(frame("{}", 0, kProtocolVersion + 1));
  auto bad_length = frame("{}", kMessageMagic, kProtocolVersion + 1);
  set_body_bytes(bad_length, 1);

  CHECK(bad_magic.error().code() == ErrorCode::kInvalidArgument);
  CHECK(decode(bad_length).error().code() == ErrorCode::kInvalidArgument);
}

// ---- send_message / receive_message
// --------------------------------------------------------------

TEST_CASE("send_message and receive_message carry type, version and body") {
  SocketPair sp;

  REQUIRE(send_message(sp.a.get(), MessageType::kHello, R"({"pid":7,"name":"t"})").ok());
  REQUIRE(send_message(sp.a.get(), MessageType::kStopRequest, "").ok());
  auto first = receive_message(sp.b.get());
  auto second = receive_message(sp.b.get());

  REQUIRE_MESSAGE(first.ok(), first.error().to_string());
  CHECK(first->type == MessageType::kHello);
  CHECK(first->version == kProtocolVersion);
  CHECK(first->body == R"({"pid":7,"name":"t"})");
  CHECK(first->fds.empty());
  REQUIRE(second.ok());
  CHECK(second->type == MessageType::kStopRequest);
  CHECK(second->body.empty());
}

TEST_CASE("send_message and receive_message pass file descriptors") {
  SocketPair sp;
  Pipe pipe;

  REQUIRE(send_message(sp.a.get(), MessageType::kWelcome, "{}", {pipe.write_end.get()}).ok());
  auto m = receive_message(sp.b.get());

  REQUIRE_MESSAGE(m.ok(), m.error().to_string());
  REQUIRE(m->fds.size() == 1);
  CHECK(m->fds[0].get() != pipe.write_end.get());  // a new descriptor for the same pipe
  CHECK((::fcntl(m->fds[0].get(), F_GETFD) & FD_CLOEXEC) != 0);
  REQUIRE(::write(m->fds[0].get(), "x", 1) == 1);
  char c = 0;
  CHECK(::read(pipe.read_end.get(), &c, 1) == 1);
  CHECK(c == 'x');
}

TEST_CASE("send_message passes up to kMaxMessageFds descriptors and refuses more") {
  SocketPair sp;
  Pipe pipe;
  const std::vector<int> four(kMaxMessageFds, pipe.write_end.get());
  std::vector<int> five = four;
  five.push_back(pipe.write_end.get());

  auto too_many = send_message(sp.a.get(), MessageType::kWelcome, "{}", five);
  REQUIRE(send_message(sp.a.get(), MessageType::kWelcome, "{}", four).ok());
  auto m = receive_message(sp.b.get());

  REQUIRE_FALSE(too_many.ok());
  CHECK(too_many.error().code() == ErrorCode::kInternal);
  REQUIRE(m.ok());
  CHECK(m->fds.size() == kMaxMessageFds);
}

TEST_CASE("send_message refuses a body over kMaxMessageBody") {
  SocketPair sp;

  auto r =
      send_message(sp.a.get(), MessageType::kStatusReply, std::string(kMaxMessageBody + 1, 'x'));

  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code() == ErrorCode::kInternal);
}

TEST_CASE("send_message can speak another version, which the receiver reports") {
  SocketPair sp;

  REQUIRE(send_message(sp.a.get(), MessageType::kHello, "{}", {}, kProtocolVersion + 1).ok());
  auto m = receive_message(sp.b.get());

  REQUIRE_FALSE(m.ok());
  CHECK(m.error().code() == ErrorCode::kProtocolMismatch);
}

// Sends `bytes` as one datagram carrying `copies` copies of descriptor `fd` (SCM_RIGHTS),
// bypassing send_message's framing and limits.
bool send_with_descriptor(int socket, std::vector<uint8_t> bytes, int fd, int copies) {
  iovec iov{bytes.data(), bytes.size()};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * copies));
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * copies);
  for (int i = 0; i < copies; ++i) std::memcpy(CMSG_DATA(c) + i * sizeof(int), &fd, sizeof fd);
  return ::sendmsg(socket, &msg, 0) == static_cast<ssize_t>(bytes.size());
}

TEST_CASE("receive_message closes the descriptors of a rejected datagram") {
  SocketPair sp;
  Pipe pipe;
  // A datagram with a bad magic number, carrying the pipe's write end.
  REQUIRE(send_with_descriptor(sp.a.get(), frame("{}", 0xBAD), pipe.write_end.get(), 1));
  pipe.write_end.reset();  // now only the datagram holds the write end

  auto m = receive_message(sp.b.get());

  REQUIRE_FALSE(m.ok());
  CHECK(m.error().code() == ErrorCode::kInvalidArgument);
  char ch;
  CHECK(::read(pipe.read_end.get(), &ch, 1) == 0);  // EOF: no write end is left open
}

TEST_CASE("receive_message rejects a datagram larger than the largest frame") {
  SocketPair sp;
  int big = 1 << 20;
  ::setsockopt(sp.a.get(), SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
  std::vector<uint8_t> bytes = frame(std::string(kMaxMessageBody + 100, 'x'));
  REQUIRE(::send(sp.a.get(), bytes.data(), bytes.size(), 0) == static_cast<ssize_t>(bytes.size()));

  auto m = receive_message(sp.b.get());

  REQUIRE_FALSE(m.ok());
  CHECK(m.error().code() == ErrorCode::kInvalidArgument);
  CHECK(contains(m.error().message(), "truncated"));
}

TEST_CASE("receive_message says so when descriptors sent with a message were dropped") {
  SocketPair sp;
  Pipe pipe;
  // More descriptors than the receiver takes (kMaxMessageFds): the kernel passes those that fit,
  // drops the rest and sets MSG_CTRUNC, as it does when the receiver is out of descriptors.
  REQUIRE(send_with_descriptor(sp.a.get(), frame("{}"), pipe.write_end.get(), kMaxMessageFds + 2));
  pipe.write_end.reset();

  auto m = receive_message(sp.b.get());

  REQUIRE_FALSE(m.ok());
  CHECK(m.error().code() == ErrorCode::kSystemError);
  CHECK(contains(m.error().message(), "descriptors"));
  char ch;
  CHECK(::read(pipe.read_end.get(), &ch, 1) == 0);  // none of the copies is left open
}

TEST_CASE("receive_message reports a closed peer as Disconnected") {
  SocketPair sp;
  sp.a.reset();

  auto m = receive_message(sp.b.get());

  REQUIRE_FALSE(m.ok());
  CHECK(m.error().code() == ErrorCode::kDisconnected);
}

TEST_CASE("send_message to a closed peer is Disconnected, without SIGPIPE") {
  SocketPair sp;
  sp.b.reset();

  auto r = send_message(sp.a.get(), MessageType::kHello, "{}");

  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code() == ErrorCode::kDisconnected);
}

TEST_CASE("receive_message on an idle non-blocking socket is Timeout") {
  SocketPair sp;
  REQUIRE(::fcntl(sp.b.get(), F_SETFL, O_NONBLOCK) == 0);

  auto m = receive_message(sp.b.get());

  REQUIRE_FALSE(m.ok());
  CHECK(m.error().code() == ErrorCode::kTimeout);
}

// ---- error bodies
// --------------------------------------------------------------------------------

TEST_CASE("error_body and error_from_body round-trip every error code") {
  for (int32_t code = 1; code <= kMaxErrorCode; ++code) {
    CAPTURE(code);
    const Error sent(static_cast<ErrorCode>(code), "message with \"quotes\" and \xC3\xA9");

    const Error got = error_from_body(error_body(sent));

    CHECK(got.code() == sent.code());
    CHECK(got.message() == sent.message());
  }
}

TEST_CASE("error_body names the code") {
  const std::string body = error_body(Error(ErrorCode::kQueueFull, "full"));

  CHECK(contains(body, "\"name\":\"QueueFull\""));
  CHECK(contains(body, "\"code\":4"));
}

TEST_CASE(
    "error_from_body maps unknown codes to Internal and malformed bodies to "
    "InvalidArgument") {
  CHECK(error_from_body(R"({"code":0,"message":"m"})").code() == ErrorCode::kInternal);
  CHECK(error_from_body(R"({"code":9999,"message":"m"})").code() == ErrorCode::kInternal);
  CHECK(error_from_body(R"({"code":-1,"message":"m"})").code() == ErrorCode::kInternal);
  CHECK(error_from_body(R"({"code":18446744073709551615,"message":"m"})").code() ==
        ErrorCode::kInternal);
  CHECK(error_from_body(R"({"code":-9223372036854775808,"message":"m"})").code() ==
        ErrorCode::kInternal);
  // Malformed bodies, a float code among them (converting 1e300 to an int is undefined behaviour:
  // tests/fuzz/regressions/fuzz_protocol/error_code_float_out_of_int_range).
  for (const char* body : {"", "not json", "{}", R"({"code":"x","message":"m"})", R"({"code":1})",
                           R"({"code":1,"message":2})", "[1,2]", R"({"code":1e300,"message":"m"})",
                           R"({"code":4.0,"message":"m"})"}) {
    CAPTURE(body);

    const Error e = error_from_body(body);

    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK(contains(e.message(), "malformed error reply"));
  }
}

}  // namespace
}  // namespace gpuq
