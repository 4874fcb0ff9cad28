// Integration: bad input of every kind gets its own error while the daemon keeps serving: bad
// jobs, malformed control frames on a raw socket, and peers that are not allowed in.
#include <grp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "gpuq/common/protocol.hpp"
#include "gpuq/common/unique_fd.hpp"
#include "integration/integration_support.hpp"

namespace gpuq::test {
namespace {

constexpr uint64_t kArenaBytes = 1ull << 20;  // the payload arena these tests ask for

// Submits `spec` (which must be accepted) and returns its result, which must be a failure.
JobResult run_failing_job(Client& client, const JobSpec& spec) {
  Job job = submit_ok(client, spec);
  JobResult r = wait_result(job);
  CHECK(r.status == JobStatus::kFailed);
  return r;
}

TEST_CASE(
    "segment blocks: large ones from the top, small ones from the bottom; a full segment says "
    "why") {
  DaemonProcess daemon(one_pool_config(1));
  constexpr uint64_t kSegment = 64ull << 20, kLarge = 16ull << 20;
  Client client = connect_client(daemon, kSegment);
  // Small blocks kept between large ones that come and go split no large run: the large ones
  // sit at the top, the small ones at the bottom.
  Buffer small_a = allocate(client, 4096);
  Buffer large_a = allocate(client, kLarge);
  Buffer small_b = allocate(client, 4096);
  Buffer large_b = allocate(client, kLarge);
  CHECK(small_a.offset < small_b.offset);
  CHECK(small_b.offset < large_b.offset);
  CHECK(large_b.offset < large_a.offset);
  CHECK(large_a.offset + kLarge == kSegment);
  client.release(large_a);
  client.release(large_b);
  // With the small blocks kept, the rest is one run: 64 MiB less the two small blocks.
  Buffer most = allocate(client, kSegment - 2 * 4096);
  CHECK(most.offset == 2 * 4096);
  auto none = client.allocate(kLarge);
  REQUIRE_FALSE(none.ok());
  CHECK(none.error().code() == ErrorCode::kOutOfMemory);
  const std::string& message = none.error().message();
  INFO(message);
  CHECK(message.find("0 bytes free, the largest run 0, 3 blocks in use") != std::string::npos);
  client.release(most);
  client.release(small_a);
  client.release(small_b);
  check_echo_works(client);
  CHECK(daemon.terminate().ok());
}

TEST_CASE("bad jobs fail with their own error and the daemon keeps serving") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon, kArenaBytes);
  // The arena is exactly what was asked for (a multiple of 4 KiB): all of it, and no more.
  {
    Buffer whole = allocate(client, kArenaBytes);
    client.release(whole);
    auto too_big = client.allocate(kArenaBytes + 1);
    REQUIRE_FALSE(too_big.ok());
    CHECK(too_big.error().code() == ErrorCode::kOutOfMemory);
  }
  check_echo_works(client);
  Buffer good_in = allocate(client, 64);
  Buffer good_out = allocate(client, 64);
  std::memset(good_in.data(), 1, 64);

  SUBCASE("unknown op") {
    auto job = client.try_submit(job_spec("no_such_op"));
    REQUIRE_FALSE(job.ok());
    CHECK(job.error().code() == ErrorCode::kUnknownOp);
    CHECK(job.error().message().find("no_such_op") != std::string::npos);
  }

  SUBCASE("unknown pool") {
    auto job = client.try_submit(job_spec("echo", {}, {}, "no_such_pool"));
    REQUIRE_FALSE(job.ok());
    CHECK(job.error().code() == ErrorCode::kUnknownPool);
    CHECK(job.error().message().find("no_such_pool") != std::string::npos);
  }

  SUBCASE("buffers outside the arena") {
    struct Case {
      const char* what;
      Buffer input;
      Buffer output;
      const char* field;
    };
    const Case cases[] = {
        {"input runs past the end", Buffer{kArenaBytes - 8, 64, nullptr}, good_out, "input buffer"},
        {"input offset near 2^64 (offset + size overflows)", Buffer{UINT64_MAX - 8, 64, nullptr},
         good_out, "input buffer"},
        {"input size near 2^64", Buffer{64, UINT64_MAX - 32, nullptr}, good_out, "input buffer"},
        {"input starts past the end", Buffer{kArenaBytes + 4096, 1, nullptr}, good_out,
         "input buffer"},
        {"output runs past the end", good_in, Buffer{kArenaBytes - 8, 64, nullptr},
         "output buffer"},
        {"output offset near 2^64", good_in, Buffer{UINT64_MAX - 8, 64, nullptr}, "output buffer"},
    };
    for (const Case& c : cases) {
      INFO(c.what);
      JobResult r = run_failing_job(client, job_spec("echo", c.input, c.output));
      CHECK(r.code == ErrorCode::kInvalidArgument);
      CHECK_MESSAGE(r.message.find(c.field) != std::string::npos, "message: " << r.message);
      check_echo_works(client);
    }
  }

  SUBCASE("a param of the wrong type or range") {
    JobSpec text = sleep_spec(0);
    text.params = {JobParam::text("us", "1000")};
    JobResult r = run_failing_job(client, text);
    CHECK(r.code == ErrorCode::kInvalidArgument);
    CHECK_MESSAGE(r.message.find("'us'") != std::string::npos, "message: " << r.message);
    check_echo_works(client);

    JobSpec negative = sleep_spec(-1);
    JobResult n = run_failing_job(client, negative);
    CHECK(n.code == ErrorCode::kInvalidArgument);
    CHECK_MESSAGE(n.message.find("'us'") != std::string::npos, "message: " << n.message);
  }

  SUBCASE("echo into an output smaller than its input") {
    JobResult r = run_failing_job(client, job_spec("echo", good_in, good_out.slice(0, 8)));
    CHECK(r.code == ErrorCode::kInvalidArgument);
    CHECK(r.output_size == 0);
  }

  // After every kind: the same client and a new one both work.
  check_echo_works(client);
  Client other = connect_client(daemon);
  check_echo_works(other);
  CHECK(daemon.status()["pools"][0]["workers"][0]["restarts"] == 0);
}

// A raw connection to the control socket, with a receive timeout so a silent daemon fails the
// test instead of hanging it.
UniqueFd raw_connect(const DaemonProcess& daemon) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  REQUIRE(fd.valid());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string path = daemon.socket_path();
  REQUIRE(path.size() < sizeof addr.sun_path);
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  REQUIRE(::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  timeval tv{10, 0};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

// Receives the daemon's reply, which must be an Error frame; returns its error.
Error expect_error_reply(int fd) {
  auto m = receive_message(fd);
  REQUIRE_MESSAGE(m.ok(), "no reply: " << error_text(m));
  REQUIRE(m->type == MessageType::kError);
  return error_from_body(m->body);
}

// The daemon closed this connection after its Error reply.
void expect_closed(int fd) {
  auto m = receive_message(fd);
  REQUIRE_FALSE(m.ok());
  CHECK(m.error().code() == ErrorCode::kDisconnected);
}

TEST_CASE("malformed control frames get an Error reply and the daemon keeps serving") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);

  SUBCASE("a Hello in another protocol version") {
    UniqueFd fd = raw_connect(daemon);
    REQUIRE(send_message(fd.get(), MessageType::kHello, "{}", {}, 99).ok());
    Error e = expect_error_reply(fd.get());
    CHECK(e.code() == ErrorCode::kProtocolMismatch);
    CHECK(e.message().find("99") != std::string::npos);
    expect_closed(fd.get());
  }

  SUBCASE("100 random bytes") {
    std::mt19937_64 rng(test_seed(0x6761726261676521));
    uint8_t garbage[100];
    for (auto& b : garbage) b = static_cast<uint8_t>(rng());
    garbage[0] = static_cast<uint8_t>(~(kMessageMagic & 0xFF));  // never the magic by chance
    UniqueFd fd = raw_connect(daemon);
    REQUIRE(::send(fd.get(), garbage, sizeof garbage, MSG_NOSIGNAL) == sizeof garbage);
    Error e = expect_error_reply(fd.get());
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    expect_closed(fd.get());
  }

  SUBCASE("a frame cut to 8 bytes") {
    const MessageHeader h{kMessageMagic, kProtocolVersion,
                          static_cast<uint16_t>(MessageType::kStatusRequest), 2, 0};
    UniqueFd fd = raw_connect(daemon);
    REQUIRE(::send(fd.get(), &h, 8, MSG_NOSIGNAL) == 8);
    Error e = expect_error_reply(fd.get());
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    expect_closed(fd.get());
  }

  SUBCASE("a header whose body_bytes does not match the datagram") {
    uint8_t frame[sizeof(MessageHeader) + 4] = {};
    const MessageHeader h{kMessageMagic, kProtocolVersion,
                          static_cast<uint16_t>(MessageType::kStatusRequest), 1000, 0};
    std::memcpy(frame, &h, sizeof h);
    UniqueFd fd = raw_connect(daemon);
    REQUIRE(::send(fd.get(), frame, sizeof frame, MSG_NOSIGNAL) == sizeof frame);
    Error e = expect_error_reply(fd.get());
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    expect_closed(fd.get());
  }

  SUBCASE("a Hello whose body is not JSON") {
    UniqueFd fd = raw_connect(daemon);
    REQUIRE(send_message(fd.get(), MessageType::kHello, "{not json").ok());
    Error e = expect_error_reply(fd.get());
    CHECK(e.code() == ErrorCode::kInvalidArgument);
  }

  SUBCASE("a message type the daemon does not take from clients") {
    UniqueFd fd = raw_connect(daemon);
    REQUIRE(send_message(fd.get(), MessageType::kWorkerReady, R"({"worker":0})").ok());
    Error e = expect_error_reply(fd.get());
    CHECK(e.code() == ErrorCode::kInvalidArgument);
  }

  // The daemon still serves: the existing client, a new one, and status requests.
  check_echo_works(client);
  Client other = connect_client(daemon);
  check_echo_works(other);
  CHECK(daemon.status()["state"] == "running");
}

// Every attempt is refused with PermissionDenied, never a bare Disconnected: the daemon sends its
// reason and closes at once, and the client must still read that reason however the two race.
void check_refused(const DaemonProcess& daemon) {
  for (int attempt = 0; attempt < 20; ++attempt) {
    INFO("attempt " << attempt);
    auto client = Client::connect(connect_options(daemon.runtime_dir()));
    REQUIRE_FALSE(client.ok());
    CHECK(client.error().code() == ErrorCode::kPermissionDenied);
    auto status = daemon_status_json(daemon.runtime_dir());
    REQUIRE_FALSE(status.ok());
    CHECK(status.error().code() == ErrorCode::kPermissionDenied);
  }
}

TEST_CASE("a daemon that does not allow this user refuses it") {
  // Root is not "nobody"; any other user is not root.
  const nlohmann::json allowed =
      ::geteuid() == 0 ? nlohmann::json::array({"nobody"}) : nlohmann::json::array({0});
  DaemonProcess daemon(DaemonOptions{
      one_pool_config(1, {{"allowed_users", allowed}}), DaemonOptions::Readiness::kAnswering, {}});
  check_refused(daemon);
  CHECK(daemon.log().find("refused a connection") != std::string::npos);
  const ChildExit exit = daemon.terminate();
  CHECK_MESSAGE(exit.ok(), "gpuqd " << exit.describe());
}

TEST_CASE("another user cannot reach the socket; this user's client keeps working") {
  if (::geteuid() != 0) {
    MESSAGE("skipped: needs root to switch a child to uid 65534");
    return;
  }
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  Job in_flight = submit_ok(client, sleep_spec(100'000));
  // Let everyone through the directory, so that the socket's own mode (0600) is what refuses.
  REQUIRE(::chmod(daemon.runtime_dir().c_str(), 0711) == 0);
  struct stat st {};
  REQUIRE(::stat(daemon.socket_path().c_str(), &st) == 0);
  CHECK((st.st_mode & 0077) == 0);

  const std::string dir = daemon.runtime_dir();
  const pid_t child = fork_child([&]() -> int {
    if (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0) return 30;
    if (::geteuid() != 65534) return 31;
    auto c = Client::connect(connect_options(dir));
    if (c.ok()) return 32;
    if (c.error().code() != ErrorCode::kPermissionDenied) {
      return 40 + static_cast<int>(c.error().code());
    }
    auto s = daemon_status_json(dir);
    if (s.ok() || s.error().code() != ErrorCode::kPermissionDenied) return 33;
    return 0;
  });
  REQUIRE(child > 0);
  const ChildExit exit = wait_child(child, 30 * kSecond);
  CHECK_MESSAGE(exit.ok(), "child as uid 65534: " << exit.describe());

  wait_done(in_flight);
  check_echo_works(client);
}

// The lowest descriptor number free in process `pid`: with its RLIMIT_NOFILE at this number,
// its next open, accept or pidfd_open fails with EMFILE.
int lowest_free_descriptor(pid_t pid) {
  std::set<int> used;
  for (const auto& e :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
    used.insert(std::stoi(e.path().filename().string()));
  }
  int n = 0;
  while (used.count(n) != 0) ++n;
  return n;
}

TEST_CASE("one client past max_clients is refused, naming the key, its value and the maximum") {
  DaemonProcess daemon(one_pool_config(1, {{"max_clients", 2}}));
  Client first = connect_client(daemon);
  Client second = connect_client(daemon);
  auto refused = Client::connect(connect_options(daemon.runtime_dir()));
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().code() == ErrorCode::kTooManyClients);
  const std::string m = refused.error().message();
  CHECK_MESSAGE(m.find("the daemon already serves max_clients = 2 clients; raise \"max_clients\" "
                       "in its config (at most 1022") != std::string::npos,
                m);
  check_echo_works(first);
}

TEST_CASE("max_clients defaults to 8 per CPU, at least 256") {
  DaemonProcess daemon(one_pool_config(1));
  auto text = daemon_metrics_text(daemon.runtime_dir());
  REQUIRE(text.ok());
  const size_t cpus = affinity_cpus().size();
  const size_t expected = std::min<size_t>(std::max<size_t>(8 * cpus, 256), 1022);
  CHECK_MESSAGE(
      text->find("\ngpuq_clients_max " + std::to_string(expected) + "\n") != std::string::npos,
      *text);
}

TEST_CASE("a daemon out of file descriptors refuses new clients with a reason, serves the rest") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  rlimit original{};
  REQUIRE(::prlimit(daemon.pid(), RLIMIT_NOFILE, nullptr, &original) == 0);
  rlimit low = original;
  low.rlim_cur = static_cast<rlim_t>(lowest_free_descriptor(daemon.pid()));
  REQUIRE(::prlimit(daemon.pid(), RLIMIT_NOFILE, &low, nullptr) == 0);
  constexpr int kAttempts = 3;
  for (int i = 0; i < kAttempts; ++i) {
    auto refused = Client::connect(connect_options(daemon.runtime_dir()));
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.error().code() == ErrorCode::kTooManyClients);
    CHECK_MESSAGE(refused.error().message().find("out of file descriptors") != std::string::npos,
                  refused.error().message());
  }
  check_echo_works(client);
  // One warning per refused client: the listening socket did not spin the event loop.
  const std::string log = daemon.log();
  size_t warnings = 0;
  for (size_t at = log.find("out of file descriptors"); at != std::string::npos;
       at = log.find("out of file descriptors", at + 1)) {
    ++warnings;
  }
  CHECK(warnings == kAttempts);
  CHECK(log.find("accept: ") == std::string::npos);
  // With descriptors to spare again, clients get in.
  REQUIRE(::prlimit(daemon.pid(), RLIMIT_NOFILE, &original, nullptr) == 0);
  Client later = connect_client(daemon);
  check_echo_works(later);
}

}  // namespace
}  // namespace gpuq::test
