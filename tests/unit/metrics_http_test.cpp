// Unit tests of the metrics HTTP listener (daemon/supervisor/metrics_http.hpp) over real sockets:
// a server on 127.0.0.1, port 0, and a small blocking HTTP client. The render callback answers
// from threads of its own after a short delay, as the supervisor's loop does. Also the parser of
// the config key metrics_listen.
#include "metrics_http.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "support/test_support.hpp"

namespace gpuq::daemon {
namespace {

using namespace std::chrono_literals;
using namespace std::string_view_literals;
using test::kMillisecond;
using test::kSecond;
using Reply = MetricsHttpServer::Reply;

constexpr std::string_view kText = "# TYPE gpuq_up gauge\ngpuq_up 1\n";
constexpr std::string_view kMetricsType = "text/plain; version=0.0.4; charset=utf-8";

bool contains(std::string_view text, std::string_view part) {
  return text.find(part) != std::string_view::npos;
}

// ---- A blocking HTTP client ------------------------------------------------------------------

struct HttpResponse {
  int status = 0;  // 0: the connection ended or the time ran out before a whole response
  std::map<std::string, std::string> headers;  // names in lower case
  std::string body;

  std::string header(const std::string& name) const {
    auto it = headers.find(name);
    return it == headers.end() ? std::string() : it->second;
  }
};

// One connection to 127.0.0.1:port. Every wait has a deadline of `kWait`.
class TestClient {
 public:
  static constexpr uint64_t kWait = 3 * kSecond;

  explicit TestClient(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(port);
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd_, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) == 0);
  }
  ~TestClient() { close(); }
  TestClient(const TestClient&) = delete;
  TestClient& operator=(const TestClient&) = delete;

  void close() {
    if (fd_ >= 0) (void)::close(fd_);
    fd_ = -1;
  }

  void send(std::string_view data) { REQUIRE(try_send(data)); }
  // False if the connection has failed (the server reset it).
  bool try_send(std::string_view data) {
    while (!data.empty()) {
      const ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      data.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }

  // Sends a request without a body; its response, or status 0 if none came.
  HttpResponse get(std::string_view target, std::string_view method = "GET") {
    if (!try_send(std::string(method) + " " + std::string(target) +
                  " HTTP/1.1\r\nHost: localhost\r\n\r\n")) {
      return {};
    }
    return read_response(method == "HEAD");
  }

  // The next response; for the answer to a HEAD (`head`) no body is read.
  HttpResponse read_response(bool head = false) {
    const uint64_t deadline = monotonic_ns() + kWait;
    size_t end;
    while ((end = pending_.find("\r\n\r\n")) == std::string::npos) {
      if (!fill(deadline)) return {};
    }
    HttpResponse r;
    const std::string block = pending_.substr(0, end + 2);
    pending_.erase(0, end + 4);
    size_t line_end = block.find("\r\n");
    const std::string status_line = block.substr(0, line_end);
    if (status_line.rfind("HTTP/1.", 0) != 0 || status_line.size() < 12) return {};
    const int status = std::stoi(status_line.substr(9, 3));
    for (size_t at = line_end + 2; at < block.size(); at = line_end + 2) {
      line_end = block.find("\r\n", at);
      const std::string line = block.substr(at, line_end - at);
      const size_t colon = line.find(':');
      std::string name = line.substr(0, colon);
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      r.headers[name] = line.substr(line.find_first_not_of(' ', colon + 1));
    }
    const size_t length = head ? 0 : std::stoul(r.header("content-length"));
    while (pending_.size() < length) {
      if (!fill(deadline)) return {};
    }
    r.body = pending_.substr(0, length);
    pending_.erase(0, length);
    r.status = status;
    return r;
  }

  // Whether the server closes the connection within `timeout_ns`, with nothing more sent.
  bool closed_by_server(uint64_t timeout_ns) { return wait_end(timeout_ns) && pending_.empty(); }
  // Whether the connection ends within `timeout_ns`; what arrives until then is dropped.
  bool wait_end(uint64_t timeout_ns) {
    const uint64_t deadline = monotonic_ns() + timeout_ns;
    while (fill(deadline)) {
    }
    return eof_;
  }

 private:
  // Reads what is there into pending_; false at the end of the stream or past `deadline`.
  bool fill(uint64_t deadline) {
    const uint64_t now = monotonic_ns();
    if (eof_ || now >= deadline) return false;
    pollfd p{fd_, POLLIN, 0};
    const int ms = static_cast<int>((deadline - now + kMillisecond - 1) / kMillisecond);
    if (::poll(&p, 1, ms) <= 0) return false;
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n <= 0) {  // 0: FIN; -1: ECONNRESET
      eof_ = true;
      return false;
    }
    pending_.append(buf, static_cast<size_t>(n));
    return true;
  }

  int fd_ = -1;
  std::string pending_;
  bool eof_ = false;
};

// ---- Render callbacks ------------------------------------------------------------------------

// Answers each request with `text` from a thread of its own after `delay` (the supervisor's
// loop, which renders when it comes round), counts the requests, and records whether the
// server's thread has every signal blocked. Joins its threads when destroyed: declare it before
// the server, so that Replies may also arrive after the server is gone.
class DelayedRenderer {
 public:
  explicit DelayedRenderer(std::string text = std::string(kText),
                           std::chrono::milliseconds delay = 20ms)
      : text_(std::move(text)), delay_(delay) {}
  ~DelayedRenderer() {
    std::lock_guard lock(mu_);
    for (std::thread& t : threads_) t.join();
  }
  DelayedRenderer(const DelayedRenderer&) = delete;
  DelayedRenderer& operator=(const DelayedRenderer&) = delete;

  MetricsHttpServer::RenderRequest callback() {
    return [this](Reply reply) {
      sigset_t mask;
      pthread_sigmask(SIG_BLOCK, nullptr, &mask);
      if (!sigismember(&mask, SIGTERM) || !sigismember(&mask, SIGINT) ||
          !sigismember(&mask, SIGCHLD) || !sigismember(&mask, SIGPIPE)) {
        signals_open_.store(true);
      }
      calls_.fetch_add(1);
      std::lock_guard lock(mu_);
      threads_.emplace_back([reply = std::move(reply), text = text_, delay = delay_] {
        std::this_thread::sleep_for(delay);
        reply(text);
      });
    };
  }
  int calls() const { return calls_.load(); }
  bool signals_open() const { return signals_open_.load(); }

 private:
  const std::string text_;
  const std::chrono::milliseconds delay_;
  std::atomic<int> calls_{0};
  std::atomic<bool> signals_open_{false};
  std::mutex mu_;
  std::vector<std::thread> threads_;
};

// Keeps every Reply it is given and never calls one (a daemon that does not answer).
class SilentRenderer {
 public:
  MetricsHttpServer::RenderRequest callback() {
    return [this](Reply reply) {
      std::lock_guard lock(mu_);
      replies_.push_back(std::move(reply));
    };
  }
  size_t count() {
    std::lock_guard lock(mu_);
    return replies_.size();
  }
  Reply take(size_t i) {
    std::lock_guard lock(mu_);
    return replies_.at(i);
  }

 private:
  std::mutex mu_;
  std::vector<Reply> replies_;
};

MetricsHttpServer::Options fast_options() {
  MetricsHttpServer::Options o;
  o.request_timeout = 2000ms;
  o.render_timeout = 2000ms;
  return o;
}

std::unique_ptr<MetricsHttpServer> start_server(MetricsHttpServer::RenderRequest render,
                                                MetricsHttpServer::Options options = {}) {
  auto server = MetricsHttpServer::start({"127.0.0.1", 0}, std::move(render), options);
  if (!server) FAIL(server.error().to_string());
  REQUIRE(server.value()->port() != 0);
  return std::move(server).value();
}

// ---- parse_listen_address --------------------------------------------------------------------

TEST_CASE("parse_listen_address reads an IP address and port, or a port on loopback") {
  struct Case {
    std::string_view text;
    std::string host;
    uint16_t port;
  };
  const Case cases[] = {
      {"127.0.0.1:9464", "127.0.0.1", 9464}, {"[::1]:9464", "::1", 9464},
      {"0.0.0.0:9464", "0.0.0.0", 9464},     {"192.168.1.5:9464", "192.168.1.5", 9464},
      {"9464", "127.0.0.1", 9464},           {":9464", "127.0.0.1", 9464},
      {"127.0.0.1:0", "127.0.0.1", 0},       {"0", "127.0.0.1", 0},
      {"[::]:65535", "::", 65535},           {"[0:0:0:0:0:0:0:1]:80", "::1", 80}};
  for (const Case& c : cases) {
    CAPTURE(c.text);
    auto at = parse_listen_address(c.text);
    REQUIRE(at.ok());
    CHECK(at->host == c.host);
    CHECK(at->port == c.port);
  }
  CHECK(to_string(ListenAddress{"127.0.0.1", 9464}) == "127.0.0.1:9464");
  CHECK(to_string(ListenAddress{"::1", 9464}) == "[::1]:9464");
}

TEST_CASE("parse_listen_address refuses host names, bad ports and unbracketed IPv6") {
  struct Case {
    std::string_view text;
    std::string_view why;  // a part of the message
  };
  const Case cases[] = {{"", "empty"},
                        {"abc", "neither a port"},
                        {"localhost:9464", "host names are not accepted"},
                        {"example.com:80", "\"example.com\" is not an IP address"},
                        {"256.1.1.1:80", "is not an IP address"},
                        {"127.0.0.1", "port missing"},
                        {"127.0.0.1:", "port missing"},
                        {"[::1]", "port missing"},
                        {"[::1]:", "port missing"},
                        {"127.0.0.1:65536", "is not a number 0-65535"},
                        {"127.0.0.1:-1", "is not a number 0-65535"},
                        {"127.0.0.1:94a", "is not a number 0-65535"},
                        {"127.0.0.1:99999999999999999999", "is not a number 0-65535"},
                        {"99999", "is not a number 0-65535"},
                        {" 9464", "neither a port"},
                        {"::1:9464", "in brackets"},
                        {"1.2.3.4:5:6", "in brackets"},
                        {"[::1:9464", "no ']'"},
                        {"[::1]9464", "expected ':'"},
                        {"[127.0.0.1]:80", "not an IPv6 address"}};
  for (const Case& c : cases) {
    CAPTURE(c.text);
    auto at = parse_listen_address(c.text);
    REQUIRE_FALSE(at.ok());
    CHECK(at.error().code() == ErrorCode::kInvalidArgument);
    const std::string& message = at.error().message();
    CHECK(message.rfind("metrics_listen \"" + std::string(c.text) + "\": ", 0) == 0);
    CHECK_MESSAGE(contains(message, c.why), message);
  }
}

// ---- Responses -------------------------------------------------------------------------------

TEST_CASE("GET /metrics answers the rendered text, and the connection is kept alive") {
  DelayedRenderer renderer;
  auto server = start_server(renderer.callback());
  TestClient client(server->port());

  const HttpResponse r = client.get("/metrics");

  CHECK(r.status == 200);
  CHECK(r.body == kText);
  CHECK(r.header("content-type") == kMetricsType);
  CHECK(r.header("content-length") == std::to_string(kText.size()));
  CHECK(r.header("server") == "gpuqd");
  CHECK(r.header("connection").empty());
  CHECK(renderer.calls() == 1);
  // Same connection again, with a query string (ignored).
  const HttpResponse again = client.get("/metrics?name[]=gpuq_up");
  CHECK(again.status == 200);
  CHECK(again.body == kText);
  CHECK(renderer.calls() == 2);
  // The render callback ran on a thread that has every signal blocked; the caller's mask was
  // given back as it was.
  CHECK_FALSE(renderer.signals_open());
  sigset_t mask;
  pthread_sigmask(SIG_BLOCK, nullptr, &mask);
  CHECK_FALSE(sigismember(&mask, SIGTERM));
}

TEST_CASE("HEAD /metrics has the headers of GET and no body") {
  DelayedRenderer renderer;
  auto server = start_server(renderer.callback());
  TestClient client(server->port());

  const HttpResponse head = client.get("/metrics", "HEAD");

  CHECK(head.status == 200);
  CHECK(head.header("content-type") == kMetricsType);
  CHECK(head.header("content-length") == std::to_string(kText.size()));
  CHECK(head.body.empty());
  // No stray body bytes: the next response on the connection parses.
  const HttpResponse next = client.get("/metrics");
  CHECK(next.status == 200);
  CHECK(next.body == kText);
}

TEST_CASE("GET / links /metrics; another path is 404; another method is 405") {
  DelayedRenderer renderer;
  auto server = start_server(renderer.callback());
  TestClient client(server->port());

  const HttpResponse index = client.get("/");
  CHECK(index.status == 200);
  CHECK(contains(index.header("content-type"), "text/html"));
  CHECK(contains(index.body, "href=\"/metrics\""));

  const HttpResponse missing = client.get("/metric");
  CHECK(missing.status == 404);
  CHECK(missing.header("server") == "gpuqd");

  const HttpResponse missing_head = client.get("/nope", "HEAD");
  CHECK(missing_head.status == 404);
  CHECK(missing_head.body.empty());

  for (std::string_view method : {"POST", "DELETE", "PUT", "OPTIONS"}) {
    CAPTURE(method);
    const HttpResponse r = client.get("/metrics", method);
    CHECK(r.status == 405);
    CHECK(r.header("allow") == "GET, HEAD");
  }
  CHECK(client.get("/metrics").status == 200);  // still open after all of them
  CHECK(renderer.calls() == 1);
}

TEST_CASE("pipelined requests are answered in order") {
  DelayedRenderer renderer;
  auto server = start_server(renderer.callback());
  TestClient client(server->port());

  client.send(
      "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n"
      "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");

  CHECK(client.read_response().body == kText);
  CHECK(client.read_response().status == 200);
  CHECK(client.read_response().body == kText);
  CHECK(renderer.calls() == 2);
}

TEST_CASE("an HTTP/1.0 request is answered with Connection: close, and the server closes") {
  DelayedRenderer renderer;
  auto server = start_server(renderer.callback());
  TestClient client(server->port());

  client.send("GET /metrics HTTP/1.0\r\n\r\n");
  const HttpResponse r = client.read_response();

  CHECK(r.status == 200);
  CHECK(r.body == kText);
  CHECK(r.header("connection") == "close");
  CHECK(client.closed_by_server(TestClient::kWait));
}

// ---- Bad requests ----------------------------------------------------------------------------

TEST_CASE("a request with a body is refused with 413, then the connection is closed") {
  DelayedRenderer renderer;
  auto server = start_server(renderer.callback());

  SUBCASE("Content-Length") {
    TestClient client(server->port());
    client.send("POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello");
    const HttpResponse r = client.read_response();
    CHECK(r.status == 413);
    CHECK(r.header("connection") == "close");
    CHECK(client.closed_by_server(TestClient::kWait));
  }
  SUBCASE("chunked") {
    TestClient client(server->port());
    client.send(
        "GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0"
        "\r\n\r\n");
    const HttpResponse r = client.read_response();
    CHECK(r.status == 413);
    CHECK(client.closed_by_server(TestClient::kWait));
  }
  CHECK(renderer.calls() == 0);
}

TEST_CASE("a header block over 8 KiB is refused with 431, then the connection is closed") {
  DelayedRenderer renderer;
  auto server = start_server(renderer.callback());
  TestClient client(server->port());

  client.send("GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(16 * 1024, 'a') +
              "\r\n\r\n");
  const HttpResponse r = client.read_response();

  CHECK(r.status == 431);
  CHECK(r.header("connection") == "close");
  CHECK(r.header("server") == "gpuqd");
  CHECK(client.closed_by_server(TestClient::kWait));
  CHECK(renderer.calls() == 0);
}

TEST_CASE("a malformed request is answered 400, then the connection is closed") {
  DelayedRenderer renderer;
  auto server = start_server(renderer.callback());
  for (std::string_view junk :
       {"GET /metrics\r\n\r\n"sv, "GET /metrics HTTP/1.1\r\nNo colon here\r\n\r\n"sv,
        "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n"sv}) {
    CAPTURE(junk);
    TestClient client(server->port());
    client.send(junk);
    const HttpResponse r = client.read_response();
    CHECK(r.status == 400);
    CHECK(r.header("connection") == "close");
    CHECK(client.closed_by_server(TestClient::kWait));
  }
  // The server still serves.
  TestClient client(server->port());
  CHECK(client.get("/metrics").status == 200);
}

// ---- Slow clients and limits -----------------------------------------------------------------

TEST_CASE("a slow client does not hold up another, and is closed after request_timeout") {
  DelayedRenderer renderer;
  MetricsHttpServer::Options options = fast_options();
  options.request_timeout = 500ms;
  auto server = start_server(renderer.callback(), options);
  TestClient slow(server->port());
  slow.send("GET /metr");
  const uint64_t slow_start = monotonic_ns();

  TestClient fast(server->port());
  const uint64_t fast_start = monotonic_ns();
  const HttpResponse r = fast.get("/metrics");
  const uint64_t fast_ns = monotonic_ns() - fast_start;

  CHECK(r.status == 200);
  CHECK(fast_ns < 400 * kMillisecond);  // long before the slow client's request times out
  CHECK(slow.closed_by_server(TestClient::kWait));
  CHECK(monotonic_ns() - slow_start >= 450 * kMillisecond);
  // An idle keep-alive connection is closed too, request_timeout after its response.
  CHECK(fast.closed_by_server(TestClient::kWait));
}

TEST_CASE("past max_connections a new connection is answered 503 and closed") {
  DelayedRenderer renderer;
  MetricsHttpServer::Options options = fast_options();
  options.max_connections = 2;
  auto server = start_server(renderer.callback(), options);
  auto first = std::make_unique<TestClient>(server->port());
  TestClient second(server->port());
  REQUIRE(first->get("/metrics").status == 200);  // both accepted and served
  REQUIRE(second.get("/metrics").status == 200);

  TestClient third(server->port());
  const HttpResponse refused = third.read_response();
  CHECK(refused.status == 503);
  CHECK(refused.header("connection") == "close");
  CHECK(third.closed_by_server(TestClient::kWait));

  // One leaves; the server notices, and a new connection is served.
  first.reset();
  CHECK(test::wait_until(
      [&] {
        TestClient next(server->port());
        return next.get("/metrics").status == 200;
      },
      TestClient::kWait));
  CHECK(second.get("/metrics").status == 200);
}

// ---- Replies late, dropped, or never -----------------------------------------------------------

TEST_CASE("a render that never replies is answered 503 after render_timeout") {
  SilentRenderer renderer;
  MetricsHttpServer::Options options = fast_options();
  options.render_timeout = 200ms;
  auto server = start_server(renderer.callback(), options);
  TestClient client(server->port());

  const uint64_t start = monotonic_ns();
  const HttpResponse r = client.get("/metrics");

  CHECK(r.status == 503);
  CHECK(r.body == "metrics not available: the daemon did not answer in time\n");
  CHECK(monotonic_ns() - start >= 150 * kMillisecond);
  // The late Reply is ignored; it does not answer the next request on the connection.
  REQUIRE(renderer.count() == 1);
  renderer.take(0)("late");
  client.send("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  REQUIRE(test::wait_until([&] { return renderer.count() == 2; }, TestClient::kWait));
  renderer.take(1)("on time");
  const HttpResponse next = client.read_response();
  CHECK(next.status == 200);
  CHECK(next.body == "on time");
}

TEST_CASE("a Reply dropped uncalled answers 503 at once; a throwing render answers 500") {
  int calls = 0;
  auto server = start_server([&](Reply reply) {
    if (++calls == 1) return;  // drops it
    (void)reply;
    throw std::runtime_error("render failed");
  });  // default timeouts (10 s): the answers come without waiting for them
  TestClient client(server->port());

  const HttpResponse dropped = client.get("/metrics");
  CHECK(dropped.status == 503);
  CHECK(contains(dropped.body, "dropped"));

  const HttpResponse threw = client.get("/metrics");
  CHECK(threw.status == 500);
  CHECK(client.get("/").status == 200);  // the connection is still served
}

TEST_CASE("a Reply called after the server is destroyed is dropped safely") {
  SilentRenderer renderer;
  auto server = start_server(renderer.callback(), fast_options());
  TestClient client(server->port());
  client.send("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  REQUIRE(test::wait_until([&] { return renderer.count() == 1; }, TestClient::kWait));
  Reply reply = renderer.take(0);

  server.reset();  // a request waits; its Reply is held here
  reply("too late");

  CHECK(client.closed_by_server(TestClient::kWait));
}

TEST_CASE("Replies racing the server's destruction touch no freed memory") {
  DelayedRenderer renderer("x", 1ms);  // Replies land while the server is being destroyed
  auto server = start_server(renderer.callback(), fast_options());
  std::vector<std::unique_ptr<TestClient>> clients;
  for (int i = 0; i < 8; ++i) {
    clients.push_back(std::make_unique<TestClient>(server->port()));
    clients.back()->send("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  }
  REQUIRE(test::wait_until([&] { return renderer.calls() >= 1; }, TestClient::kWait));

  server.reset();

  // Each was answered or not, and then closed with the server.
  for (auto& c : clients) CHECK(c->wait_end(TestClient::kWait));
}

// ---- start -----------------------------------------------------------------------------------

TEST_CASE("a second server on the same port fails to start, naming the address") {
  DelayedRenderer renderer;
  auto server = start_server(renderer.callback());
  const ListenAddress at{"127.0.0.1", server->port()};

  auto second = MetricsHttpServer::start(at, renderer.callback());

  REQUIRE_FALSE(second.ok());
  CHECK(second.error().code() == ErrorCode::kSystemError);
  const std::string& message = second.error().message();
  CHECK_MESSAGE(contains(message, "metrics_listen " + to_string(at) + ": cannot listen"), message);
  CHECK_MESSAGE(contains(message, "Address already in use"), message);
  // The first one still serves.
  TestClient client(server->port());
  CHECK(client.get("/metrics").status == 200);
}

TEST_CASE("start refuses a host that is not an IP address of this machine") {
  DelayedRenderer renderer;
  auto name = MetricsHttpServer::start({"localhost", 0}, renderer.callback());
  REQUIRE_FALSE(name.ok());
  CHECK(name.error().code() == ErrorCode::kInvalidArgument);
  CHECK(contains(name.error().message(), "metrics_listen localhost:0"));

  // 192.0.2.1 (TEST-NET-1) is on no interface here: EADDRNOTAVAIL.
  auto elsewhere = MetricsHttpServer::start({"192.0.2.1", 0}, renderer.callback());
  REQUIRE_FALSE(elsewhere.ok());
  CHECK(elsewhere.error().code() == ErrorCode::kInvalidArgument);
  CHECK(contains(elsewhere.error().message(), "metrics_listen 192.0.2.1:0: cannot listen"));
}

}  // namespace
}  // namespace gpuq::daemon
