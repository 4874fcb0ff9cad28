// The metrics listener (metrics_http.hpp) on Boost.Beast.
//
// Threads and ownership. Everything but a Reply runs on the server's thread, which runs the one
// io_context. Each connection is a Session owned by shared_ptrs held in its pending handlers: it
// lives while it has an operation in flight and is destroyed when it has none (closed, or the
// io_context destroyed with the server). A Reply holds a PendingRender: the Session's weak_ptr,
// the number of the request it answers, and the ReplyGate, through which it posts the text to
// the io_context. The server's destructor closes the gate first (under its mutex) and only then
// stops and destroys the io_context, so a Reply called at any time, on any thread, either posts
// into a live io_context or does nothing; the posted handler finds the Session through the
// weak_ptr and gives the text to it only if that very request still waits.
//
// Descriptors. Asio opens and accepts sockets without SOCK_CLOEXEC, and the supervisor forks
// workers: the listening socket is made here with socket(SOCK_CLOEXEC) and handed to the
// acceptor, and connections are taken with accept4(SOCK_CLOEXEC) when the acceptor reports
// itself readable; asio does the rest of the I/O.
#include "metrics_http.hpp"

#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>

#include <array>
#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/empty_body.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/write.hpp>
#include <cerrno>
#include <charconv>
#include <exception>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>

#include "gpuq/common/assert.hpp"
#include "gpuq/common/log.hpp"
#include "gpuq/common/posix_call.hpp"
#include "gpuq/common/unique_fd.hpp"

namespace gpuq::daemon {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using Tcp = net::ip::tcp;

constexpr uint32_t kHeaderLimit = 8 * 1024;          // request line and fields; past it 431
constexpr std::size_t kReadBufferLimit = 64 * 1024;  // what one connection may have buffered
// After a response that closes the connection the server stops sending and reads (and drops)
// what the client still sends, for at most this long or this much, before it closes: a close
// with unread data would send a reset, which can destroy the response before the client reads
// it (a 431 or 413 sent while the client is still writing).
constexpr auto kLingerTime = std::chrono::seconds(1);
constexpr std::size_t kLingerBytes = 1 << 20;
// How long the accept loop rests after accept4 failed for want of descriptors or memory
// (EMFILE, ENFILE, ENOBUFS, ENOMEM): the pending connection keeps the socket readable.
constexpr auto kAcceptRetryDelay = std::chrono::milliseconds(100);
// Connections taken per readiness report, so that a burst does not hold up the sessions.
constexpr int kAcceptBatch = 64;

constexpr std::string_view kMetricsType = "text/plain; version=0.0.4; charset=utf-8";
constexpr std::string_view kTextType = "text/plain; charset=utf-8";
constexpr std::string_view kHtmlType = "text/html; charset=utf-8";
constexpr std::string_view kIndexPage =
    "<!DOCTYPE html>\n<html><head><title>gpuqd</title></head>\n"
    "<body><h1>gpuqd</h1><p><a href=\"/metrics\">Metrics</a></p></body></html>\n";
constexpr std::string_view kRenderTimedOut =
    "metrics not available: the daemon did not answer in time\n";
constexpr std::string_view kRenderDropped =
    "metrics not available: the daemon dropped the request\n";

beast::string_view bsv(std::string_view s) {
  return {s.data(), s.size()};
}

Error invalid(std::string_view text, const std::string& what) {
  return Error(ErrorCode::kInvalidArgument,
               "metrics_listen \"" + std::string(text) + "\": " + what);
}

// The post of a Reply into the server's io_context, from any thread, for as long as the server
// lives; afterwards nothing. post() takes the mutex only around net::post (which never runs the
// handler inline), close() waits for a post in progress.
class ReplyGate {
 public:
  explicit ReplyGate(net::io_context& ioc) : ioc_(&ioc) {}

  template <typename Fn>
  void post(Fn&& fn) noexcept {
    std::lock_guard lock(mu_);
    if (ioc_ == nullptr) return;
    try {
      net::post(*ioc_, std::forward<Fn>(fn));
    } catch (const std::exception& e) {  // bad_alloc: the request times out instead
      GPUQ_LOG_WARN("metrics: cannot hand over a reply: %s", e.what());
    }
  }
  void close() noexcept {
    std::lock_guard lock(mu_);
    ioc_ = nullptr;
  }

 private:
  std::mutex mu_;
  net::io_context* ioc_;  // null once closed
};

// What the sessions share with the server. `connections` is touched on the server's thread only
// (and, once that thread has ended, by the server's destructor, which destroys the sessions).
struct ServerState {
  MetricsHttpServer::RenderRequest render;
  MetricsHttpServer::Options options;
  std::shared_ptr<ReplyGate> gate;
  uint32_t connections = 0;
};

using Response = http::response<http::string_body>;

// A response with Server, Content-Type and Content-Length set, and Connection: close when
// `close`. For HEAD (`head`), Content-Length is the size the body would have, and no body.
Response make_response(http::status status, unsigned version, std::string_view content_type,
                       std::string body, bool head, bool close) {
  Response res(status, version);
  res.set(http::field::server, "gpuqd");
  res.set(http::field::content_type, bsv(content_type));
  res.content_length(body.size());
  if (!head) res.body() = std::move(body);
  if (close) {
    res.set(http::field::connection, "close");
  } else if (version < 11) {
    res.set(http::field::connection, "keep-alive");
  }
  return res;
}

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(Tcp::socket socket, std::shared_ptr<ServerState> state)
      : stream_(std::move(socket)),
        render_timer_(stream_.get_executor()),
        state_(std::move(state)) {
    ++state_->connections;
  }
  ~Session() { --state_->connections; }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  void start() { read_request(); }

  // The Reply of request number `seq` (no text: every copy of the Reply was destroyed uncalled).
  void on_rendered(uint64_t seq, std::optional<std::string> text) {
    if (!awaiting_render_ || seq != render_seq_) return;  // timed out, or a later request
    awaiting_render_ = false;
    render_timer_.cancel();
    if (text) {
      respond(http::status::ok, kMetricsType, std::move(*text));
    } else {
      respond(http::status::service_unavailable, kTextType, std::string(kRenderDropped));
    }
  }

 private:
  void read_request() {
    parser_.emplace();
    parser_->header_limit(kHeaderLimit);
    stream_.expires_after(state_->options.request_timeout);
    http::async_read_header(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_header(ec); });
  }

  void on_header(beast::error_code ec) {
    if (ec) {
      on_read_error(ec);
      return;
    }
    const auto& req = parser_->get();
    version_ = req.version();
    head_ = req.method() == http::verb::head;
    close_ = !req.keep_alive();
    if (!parser_->is_done()) {  // Content-Length > 0, or chunked: the body is not read
      close_ = true;
      respond(http::status::payload_too_large, kTextType, "a request body is not accepted\n");
      return;
    }
    if (req.method() != http::verb::get && !head_) {
      respond(http::status::method_not_allowed, kTextType, "method not allowed\n",
              /*allow=*/true);
      return;
    }
    const std::string_view target(req.target().data(), req.target().size());
    const std::string_view path = target.substr(0, target.find('?'));
    if (path == "/metrics") {
      request_metrics();
    } else if (path == "/") {
      respond(http::status::ok, kHtmlType, std::string(kIndexPage));
    } else {
      respond(http::status::not_found, kTextType, "not found; the metrics are at /metrics\n");
    }
  }

  void on_read_error(beast::error_code ec) {
    static const auto& http_category = http::make_error_code(http::error::need_more).category();
    version_ = 11;
    head_ = false;
    close_ = true;
    if (ec == http::error::header_limit || ec == http::error::buffer_overflow) {
      respond(
          http::status::request_header_fields_too_large, kTextType,
          "request header fields too large (limit " + std::to_string(kHeaderLimit) + " bytes)\n");
    } else if (ec.category() == http_category && ec != http::error::end_of_stream &&
               ec != http::error::partial_message) {
      respond(http::status::bad_request, kTextType, "malformed request: " + ec.message() + "\n");
    } else {
      // The client closed (between requests or within one), timed out, or the socket failed:
      // nobody to answer.
      close_now();
    }
  }

  void request_metrics() {
    const uint64_t seq = ++render_seq_;
    awaiting_render_ = true;
    render_timer_.expires_after(state_->options.render_timeout);
    render_timer_.async_wait([self = shared_from_this(), seq](beast::error_code ec) {
      if (!ec) self->on_render_timeout(seq);
    });
    auto pending = std::make_shared<PendingRender>(state_->gate, weak_from_this(), seq);
    MetricsHttpServer::Reply reply = [pending](std::string text) {
      pending->deliver(std::move(text));
    };
    pending.reset();  // the Reply's copies alone own it: their end means "dropped"
    const char* failure = nullptr;
    std::string what;
    try {
      state_->render(std::move(reply));
    } catch (const std::exception& e) {
      failure = "an exception";
      what = e.what();
    } catch (...) {
      failure = "an exception";
      what = "not a std::exception";
    }
    if (failure != nullptr && awaiting_render_ && seq == render_seq_) {
      GPUQ_LOG_WARN("metrics: the render callback threw %s: %s", failure, what.c_str());
      awaiting_render_ = false;
      render_timer_.cancel();
      respond(http::status::internal_server_error, kTextType,
              "metrics not available: the daemon failed to render them\n");
    }
  }

  void on_render_timeout(uint64_t seq) {
    if (!awaiting_render_ || seq != render_seq_) return;
    awaiting_render_ = false;
    respond(http::status::service_unavailable, kTextType, std::string(kRenderTimedOut));
  }

  void respond(http::status status, std::string_view content_type, std::string body,
               bool allow = false) {
    res_ = make_response(status, version_, content_type, std::move(body), head_, close_);
    if (allow) res_.set(http::field::allow, "GET, HEAD");
    stream_.expires_after(state_->options.request_timeout);  // for the client to take it
    http::async_write(
        stream_, res_,
        [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_written(ec); });
  }

  void on_written(beast::error_code ec) {
    if (ec) {
      close_now();
    } else if (close_) {
      linger();
    } else {
      read_request();
    }
  }

  // Sends FIN, then drops what the client still sends until it closes (kLingerTime and
  // kLingerBytes at most), then closes.
  void linger() {
    beast::error_code ignored;
    stream_.socket().shutdown(Tcp::socket::shutdown_send, ignored);
    stream_.expires_after(kLingerTime);
    linger_read();
  }
  void linger_read() {
    stream_.async_read_some(net::buffer(discard_),
                            [self = shared_from_this()](beast::error_code ec, std::size_t n) {
                              self->discarded_ += n;
                              if (ec || self->discarded_ > kLingerBytes) {
                                self->close_now();
                              } else {
                                self->linger_read();
                              }
                            });
  }

  void close_now() {
    beast::error_code ignored;
    stream_.socket().close(ignored);
  }

  // The state behind a Reply and its copies (see the comment at the top of the file).
  class PendingRender {
   public:
    PendingRender(std::shared_ptr<ReplyGate> gate, std::weak_ptr<Session> session, uint64_t seq)
        : gate_(std::move(gate)), session_(std::move(session)), seq_(seq) {}
    ~PendingRender() { deliver(std::nullopt); }
    PendingRender(const PendingRender&) = delete;
    PendingRender& operator=(const PendingRender&) = delete;

    void deliver(std::optional<std::string> text) noexcept {
      if (delivered_.exchange(true, std::memory_order_acq_rel)) return;
      gate_->post([session = session_, seq = seq_, text = std::move(text)]() mutable {
        if (auto s = session.lock()) s->on_rendered(seq, std::move(text));
      });
    }

   private:
    std::shared_ptr<ReplyGate> gate_;
    std::weak_ptr<Session> session_;
    uint64_t seq_;
    std::atomic<bool> delivered_{false};
  };

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_{kReadBufferLimit};
  std::optional<http::request_parser<http::empty_body>> parser_;  // one per request
  Response res_;                                                  // the one being written
  net::steady_timer render_timer_;
  std::shared_ptr<ServerState> state_;
  uint64_t render_seq_ = 0;  // number of the latest /metrics request
  bool awaiting_render_ = false;
  unsigned version_ = 11;  // of the request being answered
  bool head_ = false;
  bool close_ = false;  // close after this response
  std::array<char, 4096> discard_{};
  std::size_t discarded_ = 0;
};

// The 503 for a connection past max_connections, written without waiting (best effort).
const std::string& too_many_connections_response() {
  static const std::string kText = [] {
    const std::string body = "too many connections to the metrics listener\n";
    return "HTTP/1.1 503 Service Unavailable\r\nServer: gpuqd\r\nContent-Type: " +
           std::string(kTextType) + "\r\nContent-Length: " + std::to_string(body.size()) +
           "\r\nConnection: close\r\n\r\n" + body;
  }();
  return kText;
}

}  // namespace

// ---- parse_listen_address ----------------------------------------------------------------------

namespace {

Result<uint16_t> parse_port(std::string_view text, std::string_view port, std::string_view form) {
  if (port.empty()) return invalid(text, "port missing (expected " + std::string(form) + ")");
  unsigned value = 0;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (ec != std::errc() || end != port.data() + port.size() || value > 65535) {
    return invalid(text, "port \"" + std::string(port) + "\" is not a number 0-65535");
  }
  return static_cast<uint16_t>(value);
}

bool all_digits(std::string_view s) {
  return !s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos;
}

}  // namespace

Result<ListenAddress> parse_listen_address(std::string_view text) {
  boost::system::error_code ec;
  if (text.empty()) {
    return invalid(text, "empty (expected an address and port such as 127.0.0.1:9464, or a port)");
  }
  if (text.front() == '[') {  // [IPv6]:port
    const size_t close = text.find(']');
    if (close == std::string_view::npos) return invalid(text, "no ']' after the IPv6 address");
    const std::string host(text.substr(1, close - 1));
    const auto address = net::ip::make_address_v6(host, ec);
    if (ec) return invalid(text, "\"" + host + "\" is not an IPv6 address");
    const std::string_view rest = text.substr(close + 1);
    if (!rest.empty() && rest.front() != ':') {
      return invalid(text, "expected ':' and a port after ']'");
    }
    auto port = parse_port(text, rest.empty() ? rest : rest.substr(1), "[<address>]:<port>");
    if (!port) return std::move(port).error();
    return ListenAddress{address.to_string(), *port};
  }
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos) {
    if (all_digits(text)) {
      auto port = parse_port(text, text, "a port");
      if (!port) return std::move(port).error();
      return ListenAddress{"127.0.0.1", *port};
    }
    net::ip::make_address_v4(std::string(text), ec);
    if (!ec) return invalid(text, "port missing (expected <address>:<port>)");
    return invalid(text,
                   "neither a port (0-65535) nor <IP address>:<port> (host names are not "
                   "accepted; an IPv6 address goes in brackets, as in [::1]:9464)");
  }
  const std::string host(text.substr(0, colon));
  if (host.find(':') != std::string::npos) {
    return invalid(text, "an IPv6 address goes in brackets, as in [::1]:9464");
  }
  std::string canonical = "127.0.0.1";
  if (!host.empty()) {
    const auto address = net::ip::make_address_v4(host, ec);
    if (ec) {
      return invalid(text, "\"" + host +
                               "\" is not an IP address (host names are not accepted: use "
                               "127.0.0.1, 0.0.0.0 or an address of this machine)");
    }
    canonical = address.to_string();
  }
  auto port = parse_port(text, text.substr(colon + 1), "<address>:<port>");
  if (!port) return std::move(port).error();
  return ListenAddress{std::move(canonical), *port};
}

std::string to_string(const ListenAddress& at) {
  const std::string port = std::to_string(at.port);
  if (at.host.find(':') != std::string::npos) return "[" + at.host + "]:" + port;
  return at.host + ":" + port;
}

// ---- MetricsHttpServer -------------------------------------------------------------------------

struct MetricsHttpServer::Impl {
  Impl(const ListenAddress& at, RenderRequest render, Options options)
      : where("metrics_listen " + to_string(at)),
        state(std::make_shared<ServerState>(
            ServerState{std::move(render), options, std::make_shared<ReplyGate>(ioc), 0})) {}

  // Waits for the listening socket to be readable, then takes what connections there are.
  void wait_accept() {
    acceptor.async_wait(Tcp::acceptor::wait_read, [this](beast::error_code ec) {
      if (ec == net::error::operation_aborted) return;
      if (ec) {
        report_accept_failure("waiting for connections failed: " + ec.message());
        retry_accept_later();
        return;
      }
      accept_ready();
    });
  }

  void accept_ready() {
    for (int i = 0; i < kAcceptBatch; ++i) {
      auto fd = GPUQ_POSIX_CALL(::accept4, acceptor.native_handle(), nullptr, nullptr,
                                SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (!fd) {
        const int err = errno;
        if (err == EAGAIN || err == EWOULDBLOCK) break;
        if (err == ECONNABORTED || err == EPROTO || err == EPERM) continue;  // that one is gone
        report_accept_failure(fd.error().to_string());  // EMFILE, ENFILE, ENOBUFS, ENOMEM
        retry_accept_later();
        return;
      }
      accept_failure.clear();
      serve(UniqueFd(static_cast<int>(*fd)));
    }
    wait_accept();
  }

  void serve(UniqueFd fd) {
    if (state->connections >= state->options.max_connections) {
      if (!at_limit_reported) {
        GPUQ_LOG_WARN("%s: %u connections, the most allowed: refusing more", where.c_str(),
                      state->connections);
        at_limit_reported = true;
      }
      const std::string& text = too_many_connections_response();
      // Best effort: a fresh socket's send buffer takes these few bytes, or the client sees
      // only the close.
      (void)GPUQ_POSIX_CALL(::send, fd.get(), text.data(), text.size(),
                            MSG_NOSIGNAL | MSG_DONTWAIT);
      return;  // closes
    }
    at_limit_reported = false;
    Tcp::socket socket(ioc);
    beast::error_code ec;
    socket.assign(protocol, fd.get(), ec);
    if (ec) {
      GPUQ_LOG_WARN("%s: cannot serve a connection: %s", where.c_str(), ec.message().c_str());
      return;
    }
    (void)fd.release();  // the socket owns it now
    try {
      std::make_shared<Session>(std::move(socket), state)->start();
    } catch (const std::exception& e) {  // bad_alloc; the socket closes
      GPUQ_LOG_WARN("%s: cannot serve a connection: %s", where.c_str(), e.what());
    }
  }

  void report_accept_failure(std::string what) {
    if (what == accept_failure) return;  // said once until an accept succeeds
    GPUQ_LOG_WARN("%s: %s", where.c_str(), what.c_str());
    accept_failure = std::move(what);
  }

  void retry_accept_later() {
    retry_timer.expires_after(kAcceptRetryDelay);
    retry_timer.async_wait([this](beast::error_code ec) {
      if (!ec) wait_accept();
    });
  }

  // The server's thread.
  void run() {
    (void)GPUQ_ERRNUM_CALL(pthread_setname_np, pthread_self(), "gpuqd-metrics");
    auto work = net::make_work_guard(ioc);
    while (!ioc.stopped()) {
      try {
        ioc.run();
      } catch (const std::exception& e) {  // a handler threw (bad_alloc): its session is gone
        GPUQ_LOG_WARN("%s: %s", where.c_str(), e.what());
      }
    }
  }

  const std::string where;  // "metrics_listen 127.0.0.1:9464", for messages
  // Declared before everything that uses it, so destroyed after: its destruction destroys the
  // handlers still pending, and with them the sessions.
  net::io_context ioc;
  Tcp::acceptor acceptor{ioc};
  Tcp protocol = Tcp::v4();
  net::steady_timer retry_timer{ioc};
  std::shared_ptr<ServerState> state;
  uint16_t port = 0;
  std::string accept_failure;  // the last one reported
  bool at_limit_reported = false;
  std::thread thread;
};

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

MetricsHttpServer::~MetricsHttpServer() {
  GPUQ_ASSERT(std::this_thread::get_id() != impl_->thread.get_id());
  impl_->state->gate->close();  // from here no Reply reaches the io_context
  impl_->ioc.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
  // impl_'s destruction closes the acceptor, then destroys the io_context and so every session.
}

uint16_t MetricsHttpServer::port() const noexcept {
  return impl_->port;
}

Result<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::start(const ListenAddress& at,
                                                                    RenderRequest render) {
  return start(at, std::move(render), Options{});
}

Result<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::start(const ListenAddress& at,
                                                                    RenderRequest render,
                                                                    Options options) {
  GPUQ_ASSERT(render);
  GPUQ_ASSERT(options.request_timeout.count() > 0 && options.render_timeout.count() > 0);
  GPUQ_ASSERT(options.max_connections > 0);
  auto impl = std::make_unique<Impl>(at, std::move(render), options);
  const std::string& where = impl->where;

  boost::system::error_code ec;
  const auto address = net::ip::make_address(at.host, ec);
  if (ec) {
    return Error(ErrorCode::kInvalidArgument, where + ": \"" + at.host + "\" is not an IP address");
  }
  const Tcp::endpoint endpoint(address, at.port);
  impl->protocol = endpoint.protocol();
  auto cannot_listen = [&](const Error& e) {
    const int err = errno;
    const ErrorCode code =
        err == EADDRNOTAVAIL || err == EAFNOSUPPORT ? ErrorCode::kInvalidArgument : e.code();
    return Error(code, where + ": cannot listen: " + e.message());
  };
  auto fd = GPUQ_POSIX_CALL(::socket, endpoint.protocol().family(),
                            SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, IPPROTO_TCP);
  if (!fd) return cannot_listen(fd.error());
  UniqueFd socket(static_cast<int>(*fd));
  const int one = 1;
  // A restarted daemon binds again at once, despite connections of the last one in TIME_WAIT;
  // a second listener on the port is still refused (EADDRINUSE).
  if (auto r =
          GPUQ_POSIX_CALL(::setsockopt, socket.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      !r) {
    return cannot_listen(r.error());
  }
  if (auto r = GPUQ_POSIX_CALL(::bind, socket.get(), endpoint.data(),
                               static_cast<socklen_t>(endpoint.size()));
      !r) {
    return cannot_listen(r.error());
  }
  if (auto r = GPUQ_POSIX_CALL(::listen, socket.get(), SOMAXCONN); !r) {
    return cannot_listen(r.error());
  }
  impl->acceptor.assign(endpoint.protocol(), socket.get(), ec);
  if (ec) return Error(ErrorCode::kSystemError, where + ": cannot listen: " + ec.message());
  (void)socket.release();  // the acceptor owns it now
  const Tcp::endpoint bound = impl->acceptor.local_endpoint(ec);
  if (ec) return Error(ErrorCode::kSystemError, where + ": cannot listen: " + ec.message());
  impl->port = bound.port();
  impl->wait_accept();

  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer(std::move(impl)));
  // The thread inherits the mask: every signal blocked, so that none is delivered to it (the
  // supervisor reads its signals from a signalfd, which needs them blocked in every thread).
  sigset_t all, previous;
  sigfillset(&all);
  if (auto r = GPUQ_ERRNUM_CALL(pthread_sigmask, SIG_SETMASK, &all, &previous); !r) {
    return Error(r.error().code(), server->impl_->where + ": " + r.error().message());
  }
  Impl* const raw = server->impl_.get();
  std::string thread_failure;
  try {
    raw->thread = std::thread([raw] { raw->run(); });
  } catch (const std::system_error& e) {
    thread_failure = e.what();
  }
  (void)GPUQ_ERRNUM_CALL(pthread_sigmask, SIG_SETMASK, &previous, nullptr);
  if (!thread_failure.empty()) {
    return Error(ErrorCode::kSystemError,
                 raw->where + ": cannot start the listener's thread: " + thread_failure);
  }
  return server;
}

}  // namespace gpuq::daemon
