// The HTTP listener Prometheus scrapes (config key metrics_listen): GET /metrics answers with the
// text the supervisor renders on its own loop; every socket is served asynchronously on one
// thread of the listener's own (Boost.Beast on one io_context), so no client, however slow or
// malformed, can block or stop the supervisor.
//
//   GET|HEAD /metrics[?...]  200, Content-Type: text/plain; version=0.0.4; charset=utf-8
//   GET|HEAD /               200, a small HTML page linking /metrics
//   other paths              404
//   other methods            405, Allow: GET, HEAD
//   a request with a body    413, then the connection is closed
//   header block over 8 KiB  431, then closed
//   malformed request        400, then closed
//   no Reply in time         503 "metrics not available: the daemon did not answer in time"
//   past max_connections     503 written without waiting (best effort), then closed
// Keep-alive is supported; a request must arrive in full within request_timeout of the connection
// or of the previous response, or the connection is closed. Every response has Server: gpuqd and
// Content-Length, and Connection: close where the server then closes. Every descriptor is opened
// close-on-exec (the supervisor forks workers).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "gpuq/error.hpp"

namespace gpuq::daemon {

// A listen address from the config key metrics_listen: an IP address and a port. host is the
// address in its canonical text form, without brackets ("127.0.0.1", "::1").
struct ListenAddress {
  std::string host;
  uint16_t port = 0;
};

// Parses metrics_listen: "127.0.0.1:9464", "[::1]:9464", "0.0.0.0:9464", or only a port
// ("9464", ":9464"), which means 127.0.0.1 (loopback unless the config names another address).
// Port 0 asks for any free port. Errors: kInvalidArgument naming the text and what is wrong
// ('metrics_listen "abc": ...'): empty, not an IP address (host names are refused), an IPv6
// address without brackets, the port missing or not a number 0-65535. Thread-safe.
Result<ListenAddress> parse_listen_address(std::string_view text);

// "127.0.0.1:9464", "[::1]:9464". Thread-safe.
std::string to_string(const ListenAddress& at);

class MetricsHttpServer {
 public:
  // Hands the rendered metrics text to the request waiting for it. Callable from any thread;
  // the first call counts and later ones are ignored. It never blocks (it takes a mutex held
  // only for a post to the server's queue) and may be called after the server is destroyed, or
  // after the request has timed out: the text is then dropped. Destroying every copy of a Reply
  // without calling it answers the request at once with 503 (the daemon dropped it).
  using Reply = std::function<void(std::string text)>;
  // Called on the server's thread for each GET or HEAD /metrics; must arrange for the Reply to
  // be called once, later or at once, from any thread. It must return quickly (it holds up every
  // other connection) and must not destroy the server. An exception it throws answers 500.
  using RenderRequest = std::function<void(Reply)>;

  // Limits; each must be positive (start() aborts otherwise: a bug, not a config error).
  struct Options {
    // A request must arrive in full within this of the connection or of the previous response
    // (and a response must be taken by the client within it), else the connection is closed.
    std::chrono::milliseconds request_timeout{10'000};
    // How long a /metrics request waits for its Reply before it is answered 503.
    std::chrono::milliseconds render_timeout{10'000};
    // Connections served at once; past it a new connection is answered 503 and closed.
    uint32_t max_connections = 64;
  };

  // Binds and listens on `at`, then serves on a thread of its own, started with every signal
  // blocked (the supervisor takes its signals through signalfd). Errors, synchronously, all
  // naming the address ("metrics_listen 127.0.0.1:9464: cannot listen: bind failed: Address
  // already in use (errno 98, ...)"): kInvalidArgument for a host that is not an IP address or
  // not on this machine (EADDRNOTAVAIL), kPermissionDenied for a port the user may not bind
  // (EACCES), kSystemError for the rest (EADDRINUSE, EMFILE, thread creation). Thread-safe; it
  // blocks every signal in the calling thread only while it creates the server's thread.
  static Result<std::unique_ptr<MetricsHttpServer>> start(const ListenAddress& at,
                                                          RenderRequest render);
  static Result<std::unique_ptr<MetricsHttpServer>> start(const ListenAddress& at,
                                                          RenderRequest render, Options options);

  // Stops the thread (joins it) and closes every socket; requests still waiting for their Reply
  // are dropped without an answer, and Replies called later are ignored. Blocks only for the
  // server's thread to finish the handler it is in. Must not be called on the server's thread
  // (from inside RenderRequest): that aborts.
  ~MetricsHttpServer();

  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // The bound port (the real one when port 0 was asked). Thread-safe.
  uint16_t port() const noexcept;

 private:
  struct Impl;  // metrics_http.cpp
  explicit MetricsHttpServer(std::unique_ptr<Impl> impl);

  std::unique_ptr<Impl> impl_;
};

}  // namespace gpuq::daemon
