// Round-trip latency and throughput of gpuq jobs, side by side with two IPC baselines, measured
// in one run on one machine:
//   gpuq: a `noop` job through the real daemon (started here, default config);
//   gpuq-nometrics: the same through a second daemon whose workers count no job metrics
//         (config job_metrics false; docs/metrics.md): only when --systems names it, to
//         measure what the metrics cost;
//   uds:  a 64-byte request and a 64-byte response over a Unix SOCK_STREAM socket, served by a
//         thread per connection;
//   mq:   the same over a pair of Boost.Interprocess message_queues per client (request and
//         response), served by a thread per pair.
// Shapes: round trip with one request in flight, back to back ("hot"); round trip after a pause
// long enough for every side to fall asleep ("sleeping"); throughput with 1, 2 and 4 client
// processes, each keeping K requests in flight. BENCHMARKS.md describes the method and results.
//
// One binary, three roles, chosen by the arguments:
//   (default)              the orchestrator: starts the servers, measures, prints, writes JSON;
//   --server uds|mq        a baseline server process (the orchestrator fork+execs itself);
//   --child gpuq|uds|mq    a throughput client process (likewise). Children talk to the
//                          orchestrator through their stdin ("go") and stdout ("ready", "done").
// Exit status: 0 when every measurement ran and every job succeeded (targets missed or not);
// 1 on any failure; 2 on bad arguments.

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/date_time/posix_time/posix_time_types.hpp>
#include <boost/interprocess/ipc/message_queue.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gpuq/client.hpp"
#include "gpuq/common/detail/spin.hpp"  // GPUQ_CPU_RELAX, as the library spins

#ifndef GPUQ_SOURCE_DIR
#define GPUQ_SOURCE_DIR "."
#endif

namespace {

using Clock = std::chrono::steady_clock;
using gpuq::Error;
using gpuq::ErrorCode;
using gpuq::Result;
using std::chrono::duration_cast;
using std::chrono::nanoseconds;
namespace bip = boost::interprocess;

constexpr size_t kMessageBytes = 64;  // request and response size of the baselines
constexpr auto kJobTimeout = std::chrono::seconds(10);  // a job or message slower than this fails
constexpr auto kProcessTimeout = std::chrono::seconds(30);  // a child's start or report

// The median of `v` (0 when empty).
double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 != 0 ? v[m] : (v[m - 1] + v[m]) / 2;
}

// The second daemon's system name (--systems gpuq-nometrics): job metrics off.
constexpr const char* kNoMetrics = "gpuq-nometrics";

// ---- Small system helpers -----------------------------------------------------------------

Error sys_error(const std::string& call) {
  return Error(ErrorCode::kSystemError, call + ": " + std::strerror(errno));
}

Error bench_error(ErrorCode code, std::string message) {
  return Error(code, std::move(message));
}

Result<void> write_all(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return sys_error("write");
    p += n;
    size -= static_cast<size_t>(n);
  }
  return {};
}

Result<void> write_line(int fd, const std::string& line) {
  std::string s = line + "\n";
  return write_all(fd, s.data(), s.size());
}

// Reads one '\n'-terminated line from `fd`, or fails at `deadline` or end of file.
Result<std::string> read_line(int fd, Clock::time_point deadline) {
  std::string line;
  for (;;) {
    auto left = duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return bench_error(ErrorCode::kTimeout, "no answer from a child process");
    pollfd pfd{fd, POLLIN, 0};
    int r = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return sys_error("poll");
    if (r == 0) continue;
    char c;
    ssize_t n = ::read(fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return sys_error("read");
    if (n == 0) return bench_error(ErrorCode::kDisconnected, "child process closed its pipe");
    if (c == '\n') return line;
    line.push_back(c);
  }
}

void sleep_for_ns(int64_t ns) {
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  while (::nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

std::string self_exe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("/proc/self/exe") : p.string();
}

// A process started by spawn(): its pid and, when asked for, pipes on its stdin and stdout.
struct Process {
  pid_t pid = -1;
  int to_child = -1;    // our end of the child's stdin
  int from_child = -1;  // our end of the child's stdout

  Process() = default;
  Process(Process&& o) noexcept { *this = std::move(o); }
  Process& operator=(Process&& o) noexcept {
    std::swap(pid, o.pid);
    std::swap(to_child, o.to_child);
    std::swap(from_child, o.from_child);
    return *this;
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  ~Process() {
    close_pipes();
    kill_and_reap();
  }

  void close_pipes() {
    if (to_child >= 0) ::close(to_child);
    if (from_child >= 0) ::close(from_child);
    to_child = from_child = -1;
  }
  // Waits for the process to exit until `deadline`; its wait status, or nothing on timeout.
  std::optional<int> wait_until(Clock::time_point deadline) {
    for (;;) {
      int status = 0;
      pid_t r = ::waitpid(pid, &status, WNOHANG);
      if (r == pid) {
        pid = -1;
        return status;
      }
      if (r < 0 && errno != EINTR) {
        pid = -1;
        return std::nullopt;
      }
      if (Clock::now() >= deadline) return std::nullopt;
      sleep_for_ns(1000000);
    }
  }
  void kill_and_reap() {
    if (pid <= 0) return;
    ::kill(pid, SIGKILL);
    while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    pid = -1;
  }
};

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

// fork+exec `path` with `args`. With `output_fd` < 0 the child's stdin and stdout are pipes to
// us; otherwise stdin is /dev/null and stdout and stderr go to `output_fd`. The child gets
// `death_signal` when we die, so nothing outlives a crashed benchmark.
Result<Process> spawn(const std::string& path, const std::vector<std::string>& args, int output_fd,
                      int death_signal) {
  std::vector<std::string> all;
  all.push_back(path);
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);

  int in_pipe[2] = {-1, -1};
  int out_pipe[2] = {-1, -1};
  int devnull = -1;
  if (output_fd < 0) {
    if (::pipe2(in_pipe, O_CLOEXEC) != 0) return sys_error("pipe2");
    if (::pipe2(out_pipe, O_CLOEXEC) != 0) {
      ::close(in_pipe[0]);
      ::close(in_pipe[1]);
      return sys_error("pipe2");
    }
  } else {
    devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull < 0) return sys_error("open /dev/null");
  }
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid == 0) {
    // Only async-signal-safe calls from here to exec.
    ::prctl(PR_SET_PDEATHSIG, death_signal);
    if (::getppid() != parent) ::_exit(127);
    if (output_fd < 0) {
      ::dup2(in_pipe[0], 0);
      ::dup2(out_pipe[1], 1);
    } else {
      ::dup2(devnull, 0);
      ::dup2(output_fd, 1);
      ::dup2(output_fd, 2);
    }
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  int fork_errno = errno;
  Process p;
  if (output_fd < 0) {
    ::close(in_pipe[0]);
    ::close(out_pipe[1]);
    p.to_child = in_pipe[1];
    p.from_child = out_pipe[0];
  } else {
    ::close(devnull);
  }
  if (pid < 0) {
    errno = fork_errno;
    return sys_error("fork");
  }
  p.pid = pid;
  return p;
}

// ---- Statistics -------------------------------------------------------------------------------

struct LatencyStats {
  uint64_t count = 0;
  double p50_us = 0, p99_us = 0, p999_us = 0, mean_us = 0, min_us = 0, max_us = 0;
};

// Percentiles by nearest rank over the sorted samples.
LatencyStats summarize(std::vector<int64_t> samples_ns) {
  LatencyStats s;
  if (samples_ns.empty()) return s;
  std::sort(samples_ns.begin(), samples_ns.end());
  auto rank = [&](double q) {
    auto n = static_cast<double>(samples_ns.size());
    auto idx = static_cast<size_t>(std::max(1.0, std::ceil(q * n))) - 1;
    return static_cast<double>(samples_ns[std::min(idx, samples_ns.size() - 1)]) / 1000.0;
  };
  s.count = samples_ns.size();
  s.p50_us = rank(0.50);
  s.p99_us = rank(0.99);
  s.p999_us = rank(0.999);
  double sum = 0;
  for (int64_t v : samples_ns) sum += static_cast<double>(v);
  s.mean_us = sum / static_cast<double>(samples_ns.size()) / 1000.0;
  s.min_us = static_cast<double>(samples_ns.front()) / 1000.0;
  s.max_us = static_cast<double>(samples_ns.back()) / 1000.0;
  return s;
}

nlohmann::json to_json(const LatencyStats& s) {
  return {{"count", s.count},     {"p50_us", s.p50_us},   {"p99_us", s.p99_us},
          {"p999_us", s.p999_us}, {"mean_us", s.mean_us}, {"min_us", s.min_us},
          {"max_us", s.max_us}};
}

// ---- Options ----------------------------------------------------------------------------------

struct Options {
  std::string server;  // --server SYSTEM: run as a baseline server
  std::string child;   // --child SYSTEM: run as a throughput client

  bool quick = false;
  uint64_t jobs = 20000;          // hot round trips measured
  uint64_t warmup_jobs = 2000;    // hot round trips before measuring
  uint64_t sleeping_jobs = 2000;  // round trips after a pause
  uint64_t pause_us = 2000;       // the pause before each "sleeping" round trip
  double duration_s = 2.0;        // throughput: measured time per run
  double warmup_s = 0.25;         // throughput: time before measuring, in each round
  uint32_t rounds = 4;            // every phase is split into rounds that visit every system
  uint32_t inflight = 8;          // throughput: requests in flight per client
  std::vector<uint32_t> clients = {1, 2, 4};
  std::vector<std::string> systems = {"gpuq", "uds", "mq"};
  std::string gpuqd;
  std::string daemon_config;  // passed to gpuqd as --config; empty: its defaults
  std::string gpuq_op = "noop";
  std::string json_path;
  bool no_json = false;
  double startup_timeout_s = 30;

  // Server and child roles.
  std::string runtime_dir;
  std::string socket_path;
  std::string mq_prefix;
  uint32_t mq_index = 0;
  uint32_t mq_count = 0;
};

void print_usage() {
  std::fprintf(stderr,
               "usage: gpuq_bench_roundtrip [options]\n"
               "  --quick            small counts for a smoke run (< 10 s)\n"
               "  --jobs N           hot round trips measured per system (default 20000)\n"
               "  --warmup-jobs N    hot round trips before measuring (default 2000)\n"
               "  --sleeping-jobs N  round trips after a pause (default 2000)\n"
               "  --pause-us US      pause before each sleeping round trip (default 2000)\n"
               "  --duration S       throughput: seconds measured per system and client count\n"
               "                     (default 2, split over the rounds)\n"
               "  --warmup S         throughput: seconds before measuring, each round (0.25)\n"
               "  --rounds R         split every phase into R rounds, each visiting every\n"
               "                     system in turn, so drift hits all alike (default 4)\n"
               "  --inflight K       throughput: requests in flight per client (default 8)\n"
               "  --clients LIST     throughput: client process counts (default 1,2,4)\n"
               "  --systems LIST     of gpuq,uds,mq,gpuq-nometrics (default gpuq,uds,mq)\n"
               "  --gpuqd PATH       daemon binary (default <build>/daemon/gpuqd)\n"
               "  --daemon-config F  config file for gpuqd (default: none, its defaults)\n"
               "  --gpuq-op NAME     op of the gpuq jobs (default noop)\n"
               "  --startup-timeout S  longest wait for the daemon's workers (default 30)\n"
               "  --json FILE        results file (default "
               "<repo>/bench/results/roundtrip-<date>.json)\n"
               "  --no-json          write no results file\n");
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

Result<Options> parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--quick") {
      o.quick = true;
      o.jobs = 500;
      o.warmup_jobs = 100;
      o.sleeping_jobs = 100;
      o.duration_s = 0.2;
      o.warmup_s = 0.05;
      o.rounds = 2;
    }
  }
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> Result<std::string> {
      if (i + 1 >= argc) return bench_error(ErrorCode::kInvalidArgument, a + " needs a value");
      return std::string(argv[++i]);
    };
    auto number = [&](double min) -> Result<double> {
      auto v = value();
      if (!v) return v.error();
      char* end = nullptr;
      double d = std::strtod(v->c_str(), &end);
      if (end == v->c_str() || *end != '\0' || !(d >= min))
        return bench_error(ErrorCode::kInvalidArgument, a + ": bad value '" + *v + "'");
      return d;
    };
    auto set_u64 = [&](uint64_t& dst, double min) -> Result<void> {
      auto d = number(min);
      if (!d) return d.error();
      dst = static_cast<uint64_t>(*d);
      return {};
    };
    auto set_double = [&](double& dst, double min) -> Result<void> {
      auto d = number(min);
      if (!d) return d.error();
      dst = *d;
      return {};
    };
    auto set_string = [&](std::string& dst) -> Result<void> {
      auto v = value();
      if (!v) return v.error();
      dst = *v;
      return {};
    };
    Result<void> r;
    uint64_t tmp = 0;
    if (a == "--quick") {
    } else if (a == "--jobs") {
      r = set_u64(o.jobs, 1);
    } else if (a == "--warmup-jobs") {
      r = set_u64(o.warmup_jobs, 0);
    } else if (a == "--sleeping-jobs") {
      r = set_u64(o.sleeping_jobs, 1);
    } else if (a == "--pause-us") {
      r = set_u64(o.pause_us, 0);
    } else if (a == "--duration") {
      r = set_double(o.duration_s, 0.01);
    } else if (a == "--warmup") {
      r = set_double(o.warmup_s, 0);
    } else if (a == "--inflight") {
      r = set_u64(tmp, 1);
      o.inflight = static_cast<uint32_t>(std::min<uint64_t>(tmp, 4096));
    } else if (a == "--rounds") {
      r = set_u64(tmp, 1);
      o.rounds = static_cast<uint32_t>(std::min<uint64_t>(tmp, 1000));
    } else if (a == "--clients") {
      std::string v;
      r = set_string(v);
      o.clients.clear();
      for (auto& s : split(v, ',')) {
        int n = std::atoi(s.c_str());
        if (n < 1 || n > 256) {
          r = bench_error(ErrorCode::kInvalidArgument, "--clients: bad count '" + s + "'");
          break;
        }
        o.clients.push_back(static_cast<uint32_t>(n));
      }
      if (r && o.clients.empty()) r = bench_error(ErrorCode::kInvalidArgument, "--clients: empty");
    } else if (a == "--systems") {
      std::string v;
      r = set_string(v);
      o.systems = split(v, ',');
      for (auto& s : o.systems)
        if (s != "gpuq" && s != "uds" && s != "mq" && s != kNoMetrics)
          r = bench_error(ErrorCode::kInvalidArgument, "--systems: unknown system '" + s + "'");
      if (r && o.systems.empty()) r = bench_error(ErrorCode::kInvalidArgument, "--systems: empty");
    } else if (a == "--gpuqd") {
      r = set_string(o.gpuqd);
    } else if (a == "--daemon-config") {
      r = set_string(o.daemon_config);
    } else if (a == "--gpuq-op") {
      r = set_string(o.gpuq_op);
    } else if (a == "--startup-timeout") {
      r = set_double(o.startup_timeout_s, 0.1);
    } else if (a == "--json") {
      r = set_string(o.json_path);
    } else if (a == "--no-json") {
      o.no_json = true;
    } else if (a == "--server") {
      r = set_string(o.server);
    } else if (a == "--child") {
      r = set_string(o.child);
    } else if (a == "--runtime-dir") {
      r = set_string(o.runtime_dir);
    } else if (a == "--socket") {
      r = set_string(o.socket_path);
    } else if (a == "--mq-prefix") {
      r = set_string(o.mq_prefix);
    } else if (a == "--mq-index") {
      r = set_u64(tmp, 0);
      o.mq_index = static_cast<uint32_t>(tmp);
    } else if (a == "--mq-count") {
      r = set_u64(tmp, 1);
      o.mq_count = static_cast<uint32_t>(tmp);
    } else if (a == "--help" || a == "-h") {
      print_usage();
      std::exit(0);
    } else {
      r = bench_error(ErrorCode::kInvalidArgument, "unknown option '" + a + "'");
    }
    if (!r) return r.error();
  }
  return o;
}

// ---- Endpoints: one request/response channel per system -----------------------------------

// A client's channel to one system. Requests are answered in order; several may be in flight.
class Endpoint {
 public:
  virtual ~Endpoint() = default;
  // Sends one request; does not wait for its response.
  virtual Result<void> issue() = 0;
  // Waits for the response to the oldest outstanding request and checks it.
  virtual Result<void> complete() = 0;
};

// gpuq: each request is a `noop` job with no buffers.
class GpuqEndpoint final : public Endpoint {
 public:
  static Result<std::unique_ptr<Endpoint>> connect(const std::string& runtime_dir,
                                                   const std::string& op, nanoseconds spin) {
    gpuq::ConnectOptions co;
    co.runtime_dir = runtime_dir;
    co.name = "gpuq_bench_roundtrip";
    co.spin = spin;
    auto client = gpuq::Client::connect(co);
    if (!client) return client.error();
    return std::unique_ptr<Endpoint>(new GpuqEndpoint(std::move(client).value(), op));
  }

  Result<void> issue() override {
    auto job = client_.submit(spec_, kJobTimeout);
    if (!job) return job.error();
    jobs_.push_back(std::move(job).value());
    return {};
  }

  Result<void> complete() override {
    // The Job is destroyed (its slot returned) before this returns: part of the round trip.
    gpuq::Job job = std::move(jobs_.front());
    jobs_.pop_front();
    auto r = job.wait(kJobTimeout);
    if (!r) return r.error();
    if (!r->ok()) {
      return Error(r->code, "noop job ended " + std::string(gpuq::job_status_name(r->status)) +
                                ": " + r->message);
    }
    return {};
  }

 private:
  GpuqEndpoint(gpuq::Client client, const std::string& op) : client_(std::move(client)) {
    spec_.op = op;
  }

  gpuq::Client client_;
  gpuq::JobSpec spec_;
  std::deque<gpuq::Job> jobs_;  // in flight, oldest first; destroyed before client_
};

// A 64-byte message carrying a sequence number, so every response is checked against its
// request.
struct Message {
  uint64_t seq;
  char pad[kMessageBytes - sizeof(uint64_t)];
};
static_assert(sizeof(Message) == kMessageBytes);

// Unix SOCK_STREAM: a request is 64 bytes written, a response 64 bytes read. A read takes all
// the bytes available (up to 4 KiB), so pipelined responses that arrive together cost one call.
class UdsEndpoint final : public Endpoint {
 public:
  static Result<std::unique_ptr<Endpoint>> connect(const std::string& path) {
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return sys_error("socket");
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      Error e = sys_error("connect " + path);
      ::close(fd);
      return e;
    }
    return std::unique_ptr<Endpoint>(new UdsEndpoint(fd));
  }
  ~UdsEndpoint() override { ::close(fd_); }

  Result<void> issue() override {
    Message m{};
    m.seq = sent_++;
    return write_all(fd_, &m, sizeof m);
  }

  Result<void> complete() override {
    while (end_ - begin_ < kMessageBytes) {
      if (begin_ > 0) {
        std::memmove(buf_, buf_ + begin_, end_ - begin_);
        end_ -= begin_;
        begin_ = 0;
      }
      ssize_t n = ::read(fd_, buf_ + end_, sizeof buf_ - end_);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return sys_error("read");
      if (n == 0) return bench_error(ErrorCode::kDisconnected, "uds server closed the connection");
      end_ += static_cast<size_t>(n);
    }
    Message m;
    std::memcpy(&m, buf_ + begin_, sizeof m);
    begin_ += kMessageBytes;
    if (m.seq != received_++) return bench_error(ErrorCode::kInternal, "uds response out of order");
    return {};
  }

 private:
  explicit UdsEndpoint(int fd) : fd_(fd) {}
  int fd_;
  uint64_t sent_ = 0, received_ = 0;
  char buf_[4096];
  size_t begin_ = 0, end_ = 0;
};

std::string mq_name(const std::string& prefix, uint32_t index, const char* dir) {
  return prefix + "_" + std::to_string(index) + "_" + dir;
}

// Boost.Interprocess message_queue: this client's own request and response queue.
class MqEndpoint final : public Endpoint {
 public:
  static Result<std::unique_ptr<Endpoint>> connect(const std::string& prefix, uint32_t index) {
    try {
      auto ep = std::unique_ptr<MqEndpoint>(new MqEndpoint(prefix, index));
      return std::unique_ptr<Endpoint>(std::move(ep));
    } catch (const std::exception& e) {
      return bench_error(ErrorCode::kSystemError,
                         "message_queue " + mq_name(prefix, index, "req") + ": " + e.what());
    }
  }

  Result<void> issue() override {
    Message m{};
    m.seq = sent_++;
    try {
      request_.send(&m, sizeof m, 0);
    } catch (const std::exception& e) {
      return bench_error(ErrorCode::kSystemError, std::string("message_queue send: ") + e.what());
    }
    return {};
  }

  Result<void> complete() override {
    Message m{};
    bip::message_queue::size_type got = 0;
    unsigned int priority = 0;
    try {
      auto deadline = boost::posix_time::microsec_clock::universal_time() +
                      boost::posix_time::seconds(kJobTimeout.count());
      if (!response_.timed_receive(&m, sizeof m, got, priority, deadline))
        return bench_error(ErrorCode::kTimeout, "message_queue: no response");
    } catch (const std::exception& e) {
      return bench_error(ErrorCode::kSystemError,
                         std::string("message_queue receive: ") + e.what());
    }
    if (got != sizeof m || m.seq != received_++)
      return bench_error(ErrorCode::kInternal, "message_queue response out of order");
    return {};
  }

 private:
  MqEndpoint(const std::string& prefix, uint32_t index)
      : request_(bip::open_only, mq_name(prefix, index, "req").c_str()),
        response_(bip::open_only, mq_name(prefix, index, "resp").c_str()) {}

  bip::message_queue request_;
  bip::message_queue response_;
  uint64_t sent_ = 0, received_ = 0;
};

// The daemon without job metrics (--systems gpuq-nometrics): its runtime directory beside the
// first daemon's, and its config: --daemon-config's (or the defaults) with job_metrics false.
std::string no_metrics_runtime_dir(const std::string& runtime_dir) {
  return runtime_dir + "-nometrics";
}
Result<std::string> config_without_job_metrics(const std::string& config, const std::string& out) {
  nlohmann::json j = nlohmann::json::object();
  if (!config.empty()) {
    std::ifstream in(config);
    j = nlohmann::json::parse(in, nullptr, false);
    if (!j.is_object()) {
      return bench_error(ErrorCode::kInvalidArgument, config + ": not a JSON object");
    }
  }
  j["job_metrics"] = false;
  std::ofstream f(out);
  f << j.dump(2) << '\n';
  if (!f) return sys_error("write " + out);
  return out;
}

// Where each system's server is, for endpoints made here and in child processes.
struct Servers {
  std::string runtime_dir;  // gpuq
  std::string socket_path;  // uds
  std::string mq_prefix;    // mq
  std::string gpuq_op;      // op of the gpuq jobs
};

Result<std::unique_ptr<Endpoint>> make_endpoint(const std::string& system, const Servers& s,
                                                nanoseconds spin, uint32_t mq_index) {
  if (system == "gpuq") return GpuqEndpoint::connect(s.runtime_dir, s.gpuq_op, spin);
  if (system == kNoMetrics) {
    return GpuqEndpoint::connect(no_metrics_runtime_dir(s.runtime_dir), s.gpuq_op, spin);
  }
  if (system == "uds") return UdsEndpoint::connect(s.socket_path);
  return MqEndpoint::connect(s.mq_prefix, mq_index);
}

// ---- Baseline servers (--server) ----------------------------------------------------------

// Echoes every whole 64-byte request as its response. Reads what is available and answers all
// the whole requests in it with one write: a reasonable server, not a handicapped one.
void serve_uds_connection(int fd) {
  std::vector<char> buf(64 * 1024);
  size_t have = 0;
  for (;;) {
    ssize_t n = ::read(fd, buf.data() + have, buf.size() - have);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    have += static_cast<size_t>(n);
    size_t whole = have / kMessageBytes * kMessageBytes;
    if (!write_all(fd, buf.data(), whole)) break;
    std::memmove(buf.data(), buf.data() + whole, have - whole);
    have -= whole;
  }
  ::close(fd);
}

int run_uds_server(const Options& o) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::perror("socket"), 1;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (o.socket_path.size() >= sizeof addr.sun_path) return std::fputs("path too long\n", stderr), 1;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", o.socket_path.c_str());
  ::unlink(o.socket_path.c_str());
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    return std::perror("bind"), 1;
  if (::listen(fd, 128) != 0) return std::perror("listen"), 1;
  if (!write_line(1, "ready")) return 1;
  for (;;) {
    int c = ::accept4(fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0 && errno == EINTR) continue;
    if (c < 0) return std::perror("accept4"), 1;
    std::thread(serve_uds_connection, c).detach();
  }
}

int run_mq_server(const Options& o) {
  // Room for every request a client keeps in flight, with margin.
  const bip::message_queue::size_type capacity = std::max<uint32_t>(2 * o.inflight, 16);
  std::vector<std::unique_ptr<bip::message_queue>> queues;
  try {
    for (uint32_t i = 0; i < o.mq_count; ++i) {
      for (const char* dir : {"req", "resp"}) {
        std::string name = mq_name(o.mq_prefix, i, dir);
        bip::message_queue::remove(name.c_str());
        queues.push_back(std::make_unique<bip::message_queue>(bip::create_only, name.c_str(),
                                                              capacity, kMessageBytes));
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mq server: %s\n", e.what());
    return 1;
  }
  for (uint32_t i = 0; i < o.mq_count; ++i) {
    bip::message_queue* req = queues[2 * i].get();
    bip::message_queue* resp = queues[2 * i + 1].get();
    std::thread([req, resp] {
      Message m{};
      bip::message_queue::size_type got = 0;
      unsigned int priority = 0;
      try {
        for (;;) {
          req->receive(&m, sizeof m, got, priority);
          resp->send(&m, got, 0);
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "mq server: %s\n", e.what());
        std::_Exit(1);
      }
    }).detach();
  }
  if (!write_line(1, "ready")) return 1;
  for (;;) ::pause();  // until the orchestrator kills us
}

// ---- Throughput client (--child) ------------------------------------------------------------

struct PipelineCount {
  uint64_t completed = 0;  // responses received inside the measured window
  std::optional<Error> failure;
};

// Keeps `inflight` requests outstanding: wait for the oldest, send one more. Counts responses
// that arrive in [start + warmup, start + warmup + duration), then drains. The clock is read
// once every kClockEvery responses, the same for every system: at millions of responses a
// second a read per response (about 25 ns here) was a sizeable part of a gpuq client's work,
// while it moves the window's edges by at most kClockEvery responses (microseconds).
PipelineCount run_pipeline(Endpoint& ep, uint32_t inflight, nanoseconds warmup,
                           nanoseconds duration) {
  PipelineCount pc;
  uint32_t outstanding = 0;
  auto fail = [&](Error e) {
    if (!pc.failure) pc.failure = std::move(e);
  };
  for (; outstanding < inflight; ++outstanding) {
    if (auto r = ep.issue(); !r) {
      fail(r.error());
      break;
    }
  }
  const auto measure_from = Clock::now() + warmup;
  const auto measure_to = measure_from + duration;
  constexpr uint32_t kClockEvery = 16;
  bool measuring = false;
  uint32_t since_clock = 0;
  while (outstanding > 0 && !pc.failure) {
    auto r = ep.complete();
    --outstanding;
    if (!r) {
      fail(r.error());
      break;
    }
    if (++since_clock == kClockEvery) {
      since_clock = 0;
      auto now = Clock::now();
      if (now >= measure_to) break;
      measuring = now >= measure_from;
    }
    if (measuring) ++pc.completed;
    if (auto s = ep.issue(); !s) {
      fail(s.error());
      break;
    }
    ++outstanding;
  }
  while (outstanding > 0) {
    --outstanding;
    if (auto r = ep.complete(); !r) fail(r.error());
  }
  return pc;
}

int run_child(const Options& o) {
  Servers s{o.runtime_dir, o.socket_path, o.mq_prefix, o.gpuq_op};
  auto ep = make_endpoint(o.child, s, std::chrono::microseconds(50), o.mq_index);
  if (!ep) {
    (void)write_line(1, "error " + ep.error().to_string());
    return 1;
  }
  if (!write_line(1, "ready")) return 1;
  char go = 0;
  ssize_t n;
  do {
    n = ::read(0, &go, 1);
  } while (n < 0 && errno == EINTR);
  if (n != 1) return 1;
  auto pc = run_pipeline(**ep, o.inflight,
                         duration_cast<nanoseconds>(std::chrono::duration<double>(o.warmup_s)),
                         duration_cast<nanoseconds>(std::chrono::duration<double>(o.duration_s)));
  std::string line = "done " + std::to_string(pc.completed);
  if (pc.failure) line += " " + pc.failure->to_string();
  if (!write_line(1, line)) return 1;
  return pc.failure ? 1 : 0;
}

// ---- The orchestrator -----------------------------------------------------------------------

struct SystemResults {
  std::optional<LatencyStats> hot;
  std::optional<LatencyStats> sleeping;
  std::map<uint32_t, double> throughput;  // client processes -> jobs/s
  // Per round, to show drift during the run.
  std::vector<double> hot_round_p50_us;
  std::vector<double> sleeping_round_p50_us;
  std::map<uint32_t, std::vector<double>> throughput_rounds;
  std::vector<std::string> failures;
};

// One request at a time; `pause_ns` before each (outside the timed part). Each round trip is
// timed from before issue() to after complete(), with steady_clock.
Result<std::vector<int64_t>> measure_latency(Endpoint& ep, uint64_t warmup, uint64_t count,
                                             int64_t pause_ns) {
  std::vector<int64_t> samples;
  samples.reserve(count);
  for (uint64_t i = 0; i < warmup + count; ++i) {
    if (pause_ns > 0) sleep_for_ns(pause_ns);
    auto t0 = Clock::now();
    if (auto r = ep.issue(); !r) return r.error();
    if (auto r = ep.complete(); !r) return r.error();
    auto t1 = Clock::now();
    if (i >= warmup) samples.push_back(duration_cast<nanoseconds>(t1 - t0).count());
  }
  return samples;
}

// Starts `clients` child processes of `system`, lets them run together for a warm-up and then
// `duration_s`, and returns the number of responses they received in that measured window.
// Round trip of one cache line between the first two CPUs this process may use, in ns: two
// threads pinned one per CPU pass a flag back and forth. gpuq's throughput is bound by such
// transfers (ring cells, slot state words, share counters move between a client's core and a
// worker's), and on a VM the hypervisor may move the vCPUs closer or farther apart between two
// runs (this 2-vCPU guest showed about 100 ns and about 450 ns at different times): the
// figure is taken before each throughput round and kept with it. 0 if fewer than two CPUs.
double core_to_core_round_trip_ns() {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return 0;
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE && cpus.size() < 2; ++c) {
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  }
  if (cpus.size() < 2) return 0;
  auto pin = [](int cpu) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    pthread_setaffinity_np(pthread_self(), sizeof one, &one);
  };
  constexpr int kPasses = 100'000;
  alignas(64) std::atomic<int> flag{0};
  std::thread partner([&] {
    pin(cpus[1]);
    for (int i = 0; i < kPasses; ++i) {
      while (flag.load(std::memory_order_acquire) != 1) GPUQ_CPU_RELAX();
      flag.store(0, std::memory_order_release);
    }
  });
  cpu_set_t before;
  pthread_getaffinity_np(pthread_self(), sizeof before, &before);
  pin(cpus[0]);
  const auto start = Clock::now();
  for (int i = 0; i < kPasses; ++i) {
    flag.store(1, std::memory_order_release);
    while (flag.load(std::memory_order_acquire) != 0) GPUQ_CPU_RELAX();
  }
  const double ns =
      std::chrono::duration<double, std::nano>(Clock::now() - start).count() / kPasses;
  partner.join();
  pthread_setaffinity_np(pthread_self(), sizeof before, &before);
  return ns;
}

Result<uint64_t> measure_throughput(const Options& o, const std::string& exe,
                                    const std::string& system, const Servers& s, uint32_t clients,
                                    double duration_s) {
  std::vector<Process> children;
  for (uint32_t i = 0; i < clients; ++i) {
    std::vector<std::string> args = {"--child",       system,
                                     "--inflight",    std::to_string(o.inflight),
                                     "--duration",    std::to_string(duration_s),
                                     "--warmup",      std::to_string(o.warmup_s),
                                     "--runtime-dir", s.runtime_dir,
                                     "--socket",      s.socket_path,
                                     "--mq-prefix",   s.mq_prefix,
                                     "--mq-index",    std::to_string(i),
                                     "--gpuq-op",     s.gpuq_op};
    auto p = spawn(exe, args, -1, SIGKILL);
    if (!p) return p.error();
    children.push_back(std::move(p).value());
  }
  for (auto& c : children) {
    auto line = read_line(c.from_child, Clock::now() + kProcessTimeout);
    if (!line) return line.error();
    if (*line != "ready") return bench_error(ErrorCode::kInternal, "client process: " + *line);
  }
  for (auto& c : children)
    if (auto r = write_all(c.to_child, "g", 1); !r) return r.error();
  const auto report_deadline =
      Clock::now() + kProcessTimeout +
      duration_cast<Clock::duration>(std::chrono::duration<double>(duration_s + o.warmup_s));
  uint64_t total = 0;
  std::optional<Error> failure;
  for (auto& c : children) {
    auto line = read_line(c.from_child, report_deadline);
    if (!line) return line.error();
    if (line->rfind("done ", 0) != 0)
      return bench_error(ErrorCode::kInternal, "client process: " + *line);
    char* end = nullptr;
    total += std::strtoull(line->c_str() + 5, &end, 10);
    if (end != nullptr && *end == ' ' && !failure)
      failure = bench_error(ErrorCode::kInternal, "client process: " + std::string(end + 1));
  }
  for (auto& c : children) {
    auto status = c.wait_until(Clock::now() + kProcessTimeout);
    if (!status) return bench_error(ErrorCode::kTimeout, "client process did not exit");
    if (*status != 0 && !failure)
      failure = bench_error(ErrorCode::kInternal, "client process: " + describe_status(*status));
  }
  if (failure) return *failure;
  if (total == 0) {
    return bench_error(ErrorCode::kTimeout,
                       "no response arrived during the measured window (requests stalled)");
  }
  return total;
}

// Collects the state of every entry of every "workers" array in the status document.
void collect_worker_states(const nlohmann::json& j, std::vector<std::string>& states) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it.key() == "workers" && it.value().is_array()) {
        for (const auto& w : it.value()) {
          std::string st = "?";
          for (const char* k : {"state", "status"})
            if (w.is_object() && w.contains(k) && w[k].is_string()) st = w[k].get<std::string>();
          states.push_back(st);
        }
      } else {
        collect_worker_states(it.value(), states);
      }
    }
  } else if (j.is_array()) {
    for (const auto& e : j) collect_worker_states(e, states);
  }
}

// The real daemon, started with its default config in a private runtime directory.
class Daemon {
 public:
  Result<void> start(const std::string& path, const std::string& config,
                     const std::string& runtime_dir, const std::string& log_path,
                     double timeout_s) {
    runtime_dir_ = runtime_dir;
    log_path_ = log_path;
    if (::access(path.c_str(), X_OK) != 0)
      return bench_error(ErrorCode::kNotFound, "no daemon binary at " + path + " (use --gpuqd)");
    int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (log < 0) return sys_error("open " + log_path);
    std::vector<std::string> args = {"--runtime-dir", runtime_dir};
    if (!config.empty()) args.insert(args.end(), {"--config", config});
    auto p = spawn(path, args, log, SIGTERM);
    ::close(log);
    if (!p) return p.error();
    process_ = std::move(p).value();

    const auto deadline =
        Clock::now() + duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
    std::string last = "no answer";
    for (;;) {
      if (auto st = process_.wait_until(Clock::now()); st) {
        return bench_error(ErrorCode::kDisconnected,
                           "gpuqd exited during start-up (" + describe_status(*st) + ")");
      }
      auto doc = gpuq::daemon_status_json(runtime_dir);
      if (doc) {
        try {
          auto j = nlohmann::json::parse(*doc);
          std::vector<std::string> states;
          collect_worker_states(j, states);
          bool ready =
              !states.empty() && std::all_of(states.begin(), states.end(),
                                             [](const std::string& st) { return st == "ready"; });
          if (ready) {
            status_ = std::move(j);
            workers_ = states.size();
            return {};
          }
          last = std::to_string(states.size()) + " workers, not all ready";
        } catch (const std::exception& e) {
          last = std::string("bad status JSON: ") + e.what();
        }
      } else {
        last = doc.error().to_string();
      }
      if (Clock::now() >= deadline)
        return bench_error(
            ErrorCode::kTimeout,
            "gpuqd workers not ready after " + std::to_string(timeout_s) + " s (" + last + ")");
      sleep_for_ns(20'000'000);
    }
  }

  // Asks the daemon to stop and reaps it. Errors when it does not stop by itself, or exits
  // with a failure status.
  Result<void> stop() {
    if (process_.pid <= 0) return {};
    auto r = gpuq::daemon_stop(runtime_dir_);
    auto st = process_.wait_until(Clock::now() + std::chrono::seconds(15));
    if (!st) {
      ::kill(process_.pid, SIGTERM);
      st = process_.wait_until(Clock::now() + std::chrono::seconds(5));
      process_.kill_and_reap();
      return bench_error(ErrorCode::kTimeout,
                         "gpuqd did not exit after daemon_stop" +
                             (r ? std::string() : " (" + r.error().to_string() + ")"));
    }
    if (!r) return bench_error(r.error().code(), "daemon_stop: " + r.error().to_string());
    if (*st != 0) return bench_error(ErrorCode::kInternal, "gpuqd " + describe_status(*st));
    return {};
  }

  const nlohmann::json& status() const { return status_; }
  size_t workers() const { return workers_; }

 private:
  Process process_;
  std::string runtime_dir_;
  std::string log_path_;
  nlohmann::json status_;
  size_t workers_ = 0;
};

Result<Process> start_baseline_server(const std::string& exe, std::vector<std::string> args) {
  auto p = spawn(exe, args, -1, SIGKILL);
  if (!p) return p.error();
  auto line = read_line(p->from_child, Clock::now() + kProcessTimeout);
  if (!line) return line.error();
  if (*line != "ready") return bench_error(ErrorCode::kInternal, "server: " + *line);
  return p;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

// "0.52 0.58 0.59" (1, 5 and 15 minute load averages): other work on the machine during a run.
std::string load_average() {
  std::string text = read_text("/proc/loadavg");
  size_t end = 0;
  for (int fields = 0; fields < 3 && end != std::string::npos; ++fields)
    end = text.find(' ', end == 0 ? 0 : end + 1);
  return end == std::string::npos ? trim(text) : text.substr(0, end);
}

// The source tree's commit, when the benchmark runs from a build of a git checkout.
std::string source_commit() {
  std::string cmd = "git -C '" + std::string(GPUQ_SOURCE_DIR) + "' rev-parse HEAD 2>/dev/null";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return "unknown";
  char buf[64] = {};
  size_t n = std::fread(buf, 1, sizeof buf - 1, p);
  ::pclose(p);
  std::string out = trim(std::string(buf, n));
  return out.empty() ? "unknown" : out;
}

// CPU time of the whole machine, from /proc/stat, in seconds: busy (not idle or iowait) and
// stolen by the hypervisor.
struct MachineCpu {
  double busy_s = 0;
  double steal_s = 0;
};

MachineCpu machine_cpu() {
  std::ifstream f("/proc/stat");
  std::string label;
  uint64_t user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  f >> label >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
  const double tick = static_cast<double>(::sysconf(_SC_CLK_TCK));
  return {static_cast<double>(user + nice + system + irq + softirq) / tick,
          static_cast<double>(steal) / tick};
}

// CPU time of this process and of every descendant it has reaped (the daemon and its workers,
// the servers, the client processes), in seconds.
double own_cpu_s() {
  auto seconds = [](const rusage& r) {
    return static_cast<double>(r.ru_utime.tv_sec + r.ru_stime.tv_sec) +
           static_cast<double>(r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1e6;
  };
  rusage self{}, children{};
  ::getrusage(RUSAGE_SELF, &self);
  ::getrusage(RUSAGE_CHILDREN, &children);
  return seconds(self) + seconds(children);
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto pos = line.find(':');
      if (pos != std::string::npos) return line.substr(pos + 2);
    }
  }
  return "unknown";
}

std::string time_string(const char* format, bool utc) {
  time_t now = ::time(nullptr);
  tm t{};
  if (utc)
    ::gmtime_r(&now, &t);
  else
    ::localtime_r(&now, &t);
  char buf[64];
  std::strftime(buf, sizeof buf, format, &t);
  return buf;
}

struct Target {
  std::string name;
  double value;
  bool upper_bound;  // value <= bound, else value >= bound
  double bound;
  bool pass() const { return upper_bound ? value <= bound : value >= bound; }
};

// "<= 0.1", ">= 10".
std::string goal_text(const Target& t) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%s %g", t.upper_bound ? "<=" : ">=", t.bound);
  return buf;
}

bool has(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

int run_orchestrator(const Options& o) {
  const std::string exe = self_exe();
  const std::string date = time_string("%Y-%m-%d", false);
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  utsname uts{};
  ::uname(&uts);
  const long nproc = ::sysconf(_SC_NPROCESSORS_ONLN);

  char tmpl[] = "/tmp/gpuq-bench-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return std::perror("mkdtemp"), 1;
  const std::string tmpdir = tmpl;
  Servers servers{tmpdir + "/run", tmpdir + "/uds.sock", "gpuq_bench_" + std::to_string(::getpid()),
                  o.gpuq_op};
  const uint32_t max_clients = *std::max_element(o.clients.begin(), o.clients.end());

  std::string gpuqd = o.gpuqd;
  if (gpuqd.empty())
    gpuqd = (std::filesystem::path(exe).parent_path().parent_path() / "daemon" / "gpuqd").string();

  const std::string load_at_start = load_average();
  const MachineCpu cpu_at_start = machine_cpu();
  const double own_at_start = own_cpu_s();
  const auto wall_start = Clock::now();
  std::printf("gpuq_bench_roundtrip %s  host %s  %ld cpus (%s)  kernel %s  gpuq %s\n", date.c_str(),
              host, nproc, cpu_model().c_str(), uts.release, std::string(gpuq::version()).c_str());
  std::printf("load average at start %s\n", load_at_start.c_str());
  std::printf(
      "%u rounds; hot: %llu round trips (+%llu warm-up); sleeping: %llu, pause %llu us; "
      "throughput: %.2f s (+%.2f s warm-up per round), %u in flight per client%s\n",
      o.rounds, static_cast<unsigned long long>(o.jobs),
      static_cast<unsigned long long>(o.warmup_jobs),
      static_cast<unsigned long long>(o.sleeping_jobs), static_cast<unsigned long long>(o.pause_us),
      o.duration_s, o.warmup_s, o.inflight,
      o.quick ? "  [--quick: smoke run, figures not meaningful]" : "");
  std::fflush(stdout);

  std::map<std::string, SystemResults> results;
  std::vector<std::string> active;
  for (const auto& sys : o.systems) results[sys];

  // Start every server first; all of them sit idle (asleep) while another is measured.
  Daemon daemon, daemon_no_metrics;
  Process uds_server, mq_server;
  for (const auto& sys : o.systems) {
    Result<void> started;
    if (sys == "gpuq") {
      started = daemon.start(gpuqd, o.daemon_config, servers.runtime_dir, tmpdir + "/gpuqd.log",
                             o.startup_timeout_s);
    } else if (sys == kNoMetrics) {
      auto config = config_without_job_metrics(o.daemon_config, tmpdir + "/gpuqd-nometrics.json");
      started = config ? daemon_no_metrics.start(
                             gpuqd, *config, no_metrics_runtime_dir(servers.runtime_dir),
                             tmpdir + "/gpuqd-nometrics.log", o.startup_timeout_s)
                       : Result<void>(config.error());
    } else if (sys == "uds") {
      auto p = start_baseline_server(exe, {"--server", "uds", "--socket", servers.socket_path});
      if (p)
        uds_server = std::move(p).value();
      else
        started = p.error();
    } else {
      auto p = start_baseline_server(
          exe, {"--server", "mq", "--mq-prefix", servers.mq_prefix, "--mq-count",
                std::to_string(max_clients), "--inflight", std::to_string(o.inflight)});
      if (p)
        mq_server = std::move(p).value();
      else
        started = p.error();
    }
    if (started) {
      active.push_back(sys);
    } else {
      results[sys].failures.push_back("start: " + started.error().to_string());
      std::fprintf(stderr, "%s: start failed: %s\n", sys.c_str(),
                   started.error().to_string().c_str());
    }
  }

  auto record = [&](const std::string& sys, const std::string& what, const Error& e) {
    results[sys].failures.push_back(what + ": " + e.to_string());
    std::fflush(stdout);
    std::fprintf(stderr, "%s: %s failed: %s\n", sys.c_str(), what.c_str(), e.to_string().c_str());
  };

  // Every phase runs in rounds; each round measures every system in turn, so that drift in the
  // machine (other guests on the host, clock frequency) hits all of them alike.
  auto latency_phase = [&](const std::string& what, nanoseconds spin, uint64_t count,
                           uint64_t warmup_first, uint64_t warmup_later, int64_t pause_ns,
                           std::optional<LatencyStats> SystemResults::*out,
                           std::vector<double> SystemResults::*round_p50) {
    const uint64_t rounds = std::max<uint64_t>(1, std::min<uint64_t>(o.rounds, count));
    std::map<std::string, std::unique_ptr<Endpoint>> endpoints;
    std::map<std::string, std::vector<int64_t>> samples;
    for (const auto& sys : active) {
      auto ep = make_endpoint(sys, servers, spin, 0);
      if (ep)
        endpoints[sys] = std::move(ep).value();
      else
        record(sys, what + ": connect", ep.error());
    }
    for (uint64_t r = 0; r < rounds; ++r) {
      const uint64_t n = count / rounds + (r < count % rounds ? 1 : 0);
      for (const auto& sys : active) {
        auto it = endpoints.find(sys);
        if (it == endpoints.end()) continue;
        auto got = measure_latency(*it->second, r == 0 ? warmup_first : warmup_later, n, pause_ns);
        if (!got) {
          record(sys, what, got.error());
          endpoints.erase(it);
          continue;
        }
        (results[sys].*round_p50).push_back(summarize(*got).p50_us);
        samples[sys].insert(samples[sys].end(), got->begin(), got->end());
      }
    }
    for (auto& [sys, v] : samples)
      if (endpoints.count(sys) != 0) results[sys].*out = summarize(std::move(v));
  };
  // Hot round trips: default spin, back to back.
  latency_phase("hot latency", std::chrono::microseconds(50), o.jobs, o.warmup_jobs,
                o.warmup_jobs / o.rounds, 0, &SystemResults::hot, &SystemResults::hot_round_p50_us);
  // Sleeping round trips: no spin in the client, a pause before each so every side sleeps.
  latency_phase("sleeping latency", nanoseconds(0), o.sleeping_jobs, 10, 2,
                static_cast<int64_t>(o.pause_us) * 1000, &SystemResults::sleeping,
                &SystemResults::sleeping_round_p50_us);
  // Throughput: for each client count, rounds of every system in turn.
  const double round_s = o.duration_s / o.rounds;
  std::map<uint32_t, std::vector<double>> core_to_core_ns;  // per client count, per round
  for (uint32_t n : o.clients) {
    std::map<std::string, uint64_t> counts;
    std::vector<std::string> failed;
    for (uint32_t r = 0; r < o.rounds; ++r) {
      core_to_core_ns[n].push_back(core_to_core_round_trip_ns());
      // Every other round in the reverse order (ABBA): drift within a round pair hits both.
      std::vector<std::string> order = active;
      if (r % 2 == 1) std::reverse(order.begin(), order.end());
      for (const auto& sys : order) {
        if (has(failed, sys)) continue;
        auto got = measure_throughput(o, exe, sys, servers, n, round_s);
        if (!got) {
          record(sys, "throughput with " + std::to_string(n) + " clients", got.error());
          failed.push_back(sys);
          continue;
        }
        counts[sys] += *got;
        results[sys].throughput_rounds[n].push_back(static_cast<double>(*got) / round_s);
      }
    }
    for (const auto& [sys, c] : counts)
      if (!has(failed, sys)) results[sys].throughput[n] = static_cast<double>(c) / o.duration_s;
  }

  // Stop the servers.
  if (has(active, "gpuq")) {
    if (auto r = daemon.stop(); !r) record("gpuq", "stop", r.error());
  }
  if (has(active, kNoMetrics)) {
    if (auto r = daemon_no_metrics.stop(); !r) record(kNoMetrics, "stop", r.error());
  }
  uds_server.kill_and_reap();
  mq_server.kill_and_reap();
  for (uint32_t i = 0; i < max_clients; ++i)
    for (const char* dir : {"req", "resp"})
      bip::message_queue::remove(mq_name(servers.mq_prefix, i, dir).c_str());

  // ---- Report ----
  // Other work on the machine during the run: busy CPU time not spent by us or our children.
  const std::string load_at_end = load_average();
  const MachineCpu cpu_at_end = machine_cpu();
  const double wall_s = std::chrono::duration<double>(Clock::now() - wall_start).count();
  const double own_s = own_cpu_s() - own_at_start;
  const double other_s = std::max(0.0, cpu_at_end.busy_s - cpu_at_start.busy_s - own_s);
  const double steal_s = cpu_at_end.steal_s - cpu_at_start.steal_s;
  std::printf("load average at end %s\n", load_at_end.c_str());
  std::printf(
      "run %.1f s wall; CPU time: this benchmark and its processes %.1f s, other "
      "processes %.1f s (%.0f%% of the machine), stolen by the hypervisor %.1f s\n\n",
      wall_s, own_s, other_s, 100.0 * other_s / (wall_s * static_cast<double>(nproc)), steal_s);
  auto row = [&](const char* title, std::optional<LatencyStats> SystemResults::*field) {
    std::printf("%-44s %9s %9s %9s %9s %8s\n", title, "p50", "p99", "p99.9", "mean", "n");
    for (const auto& sys : o.systems) {
      const auto& st = results[sys].*field;
      if (st) {
        std::printf("  %-42s %9.2f %9.2f %9.2f %9.2f %8llu\n", sys.c_str(), st->p50_us, st->p99_us,
                    st->p999_us, st->mean_us, static_cast<unsigned long long>(st->count));
      } else {
        std::printf("  %-42s %9s\n", sys.c_str(), "failed");
      }
    }
    std::printf("\n");
  };
  row("Round trip, 1 in flight, hot (us)", &SystemResults::hot);
  char title[128];
  std::snprintf(title, sizeof title, "Round trip after %llu us pause, spin 0 (us)",
                static_cast<unsigned long long>(o.pause_us));
  row(title, &SystemResults::sleeping);
  std::printf("Throughput, %u in flight per client (jobs/s)", o.inflight);
  for (uint32_t n : o.clients) std::printf(" %11u cl", n);
  std::printf("\n");
  for (const auto& sys : o.systems) {
    std::printf("  %-43s", sys.c_str());
    for (uint32_t n : o.clients) {
      auto it = results[sys].throughput.find(n);
      if (it == results[sys].throughput.end())
        std::printf(" %14s", "failed");
      else
        std::printf(" %14.0f", it->second);
    }
    std::printf("\n");
  }
  // The machine's core-to-core cache-line round trip before each round (see
  // core_to_core_round_trip_ns): it moves gpuq's throughput, which is bound by such transfers.
  std::printf("  %-43s", "core-to-core round trip, ns, per round");
  for (uint32_t n : o.clients) {
    std::string per_round;
    for (double ns : core_to_core_ns[n]) {
      if (!per_round.empty()) per_round += '/';
      per_round += std::to_string(std::lround(ns));
    }
    std::printf(" %14s", per_round.c_str());
  }
  std::printf("\n\n");

  std::vector<Target> targets;
  for (const char* base : {"uds", "mq"}) {
    if (!has(o.systems, "gpuq") || !has(o.systems, base)) continue;
    const auto& g = results["gpuq"];
    const auto& b = results[base];
    std::string bs = base;
    if (g.hot && b.hot && b.hot->p50_us > 0)
      targets.push_back({"gpuq_p50/" + bs + "_p50", g.hot->p50_us / b.hot->p50_us, true, 0.1});
    if (g.sleeping && b.sleeping && b.sleeping->p50_us > 0)
      targets.push_back({"gpuq_sleeping_p50/" + bs + "_sleeping_p50",
                         g.sleeping->p50_us / b.sleeping->p50_us, true, 1.0});
    if (g.sleeping && b.sleeping && b.sleeping->p99_us > 0)
      targets.push_back({"gpuq_sleeping_p99/" + bs + "_sleeping_p99",
                         g.sleeping->p99_us / b.sleeping->p99_us, true, 1.0});
    for (uint32_t n : o.clients) {
      auto gi = g.throughput.find(n);
      auto bi = b.throughput.find(n);
      if (gi != g.throughput.end() && bi != b.throughput.end() && bi->second > 0)
        targets.push_back({"gpuq_throughput_" + std::to_string(n) + "c/" + bs + "_throughput_" +
                               std::to_string(n) + "c",
                           gi->second / bi->second, false, 10.0});
    }
  }
  // What the job metrics cost: gpuq (counting) against gpuq-nometrics. Throughput by the
  // median of the rounds: on a VM a round's figure moves by 2x with where the host runs the
  // two vCPUs (core_to_core_round_trip_ns), which a mean over few rounds does not wash out.
  if (has(o.systems, "gpuq") && has(o.systems, kNoMetrics)) {
    const SystemResults& g = results["gpuq"];
    const SystemResults& b = results[kNoMetrics];
    if (g.hot && b.hot && g.hot->p50_us > 0) {
      targets.push_back({"nometrics_p50/gpuq_p50", b.hot->p50_us / g.hot->p50_us, false, 0.97});
    }
    // Each round's pair of figures, measured back to back, gives one ratio; the median of
    // those is the figure (a pair mostly sees one placement of the vCPUs).
    for (uint32_t n : o.clients) {
      auto gi = g.throughput_rounds.find(n);
      auto bi = b.throughput_rounds.find(n);
      if (gi == g.throughput_rounds.end() || bi == b.throughput_rounds.end() ||
          gi->second.size() != bi->second.size()) {
        continue;
      }
      std::vector<double> ratios;
      for (size_t r = 0; r < gi->second.size(); ++r) {
        if (bi->second[r] > 0) ratios.push_back(gi->second[r] / bi->second[r]);
      }
      if (!ratios.empty()) {
        targets.push_back({"gpuq_throughput_" + std::to_string(n) + "c/nometrics_throughput_" +
                               std::to_string(n) + "c (median of " + std::to_string(ratios.size()) +
                               " round pairs)",
                           median_of(ratios), false, 0.97});
      }
    }
  }
  if (!targets.empty()) {
    std::printf("%-48s %9s %9s  %s\n", "Target", "ratio", "goal", "result");
    for (const auto& t : targets) {
      std::printf("  %-46s %9.3f %3s %5.2f  %s\n", t.name.c_str(), t.value,
                  t.upper_bound ? "<=" : ">=", t.bound, t.pass() ? "pass" : "MISS");
    }
    std::printf("\n");
  }

  size_t failure_count = 0;
  for (const auto& [sys, r] : results) {
    failure_count += r.failures.size();
    for (const auto& f : r.failures) std::printf("FAILURE %s: %s\n", sys.c_str(), f.c_str());
  }

  // ---- JSON ----
  nlohmann::json j;
  j["benchmark"] = "bench_roundtrip";
  j["date"] = date;
  j["timestamp_utc"] = time_string("%Y-%m-%dT%H:%M:%SZ", true);
  j["hostname"] = host;
  j["nproc"] = nproc;
  j["cpu_model"] = cpu_model();
  j["load_average_start"] = load_at_start;
  j["load_average_end"] = load_at_end;
  for (const auto& [n, v] : core_to_core_ns) j["core_to_core_round_trip_ns"][std::to_string(n)] = v;
  j["interference"] = {{"wall_s", wall_s},
                       {"own_cpu_s", own_s},
                       {"other_processes_cpu_s", other_s},
                       {"other_processes_share", other_s / (wall_s * static_cast<double>(nproc))},
                       {"steal_s", steal_s}};
  j["kernel"] = std::string(uts.sysname) + " " + uts.release + " " + uts.version;
  j["gpuq_version"] = std::string(gpuq::version());
  j["source_commit"] = source_commit();
  j["parameters"] = {{"quick", o.quick},
                     {"jobs", o.jobs},
                     {"warmup_jobs", o.warmup_jobs},
                     {"sleeping_jobs", o.sleeping_jobs},
                     {"pause_us", o.pause_us},
                     {"duration_s", o.duration_s},
                     {"warmup_s", o.warmup_s},
                     {"rounds", o.rounds},
                     {"inflight", o.inflight},
                     {"clients", o.clients},
                     {"systems", o.systems},
                     {"message_bytes", kMessageBytes},
                     {"gpuq_op", o.gpuq_op},
                     {"gpuq_hot_spin_us", 50},
                     {"gpuq_sleeping_spin_us", 0},
                     {"gpuqd", gpuqd},
                     {"gpuqd_config", o.daemon_config.empty() ? "default" : o.daemon_config}};
  if (has(active, "gpuq")) {
    j["gpuq_daemon"] = {{"workers", daemon.workers()}, {"status_at_start", daemon.status()}};
  }
  for (const auto& sys : o.systems) {
    const auto& r = results[sys];
    nlohmann::json s;
    s["latency_hot"] = r.hot ? to_json(*r.hot) : nlohmann::json();
    s["latency_sleeping"] = r.sleeping ? to_json(*r.sleeping) : nlohmann::json();
    nlohmann::json tp = nlohmann::json::object();
    for (const auto& [n, v] : r.throughput) tp[std::to_string(n)] = v;
    s["throughput_jobs_per_s"] = tp;
    nlohmann::json rounds = {{"latency_hot_p50_us", r.hot_round_p50_us},
                             {"latency_sleeping_p50_us", r.sleeping_round_p50_us}};
    for (const auto& [n, v] : r.throughput_rounds)
      rounds["throughput_jobs_per_s"][std::to_string(n)] = v;
    s["per_round"] = rounds;
    s["failures"] = r.failures;
    j["results"][sys] = s;
  }
  nlohmann::json tj = nlohmann::json::array();
  bool all_pass = !targets.empty();
  for (const auto& t : targets) {
    tj.push_back({{"name", t.name},
                  {"value", t.value},
                  {"goal", goal_text(t)},
                  {"result", t.pass() ? "pass" : "miss"}});
    all_pass = all_pass && t.pass();
  }
  j["targets"] = tj;
  j["all_targets_met"] = all_pass;
  j["failures"] = failure_count;

  if (!o.no_json) {
    std::string path = o.json_path;
    if (path.empty())
      path = std::string(GPUQ_SOURCE_DIR) + "/bench/results/roundtrip-" + date + ".json";
    std::error_code ec;
    auto parent = std::filesystem::path(path).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    std::ofstream f(path);
    f << j.dump(2) << "\n";
    f.close();
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      ++failure_count;
    } else {
      std::printf("results: %s\n", path.c_str());
    }
  }

  // Show the end of the daemon's log when gpuq failed; then remove the scratch directory.
  const std::string log = tmpdir + "/gpuqd.log";
  if (!results["gpuq"].failures.empty() && std::filesystem::exists(log)) {
    std::string text = read_text(log);
    if (text.size() > 4000) text = "...\n" + text.substr(text.size() - 4000);
    std::fflush(stdout);
    std::fprintf(stderr, "---- end of the gpuqd log ----\n%s\n", trim(text).c_str());
  }
  std::error_code ec;
  std::filesystem::remove_all(tmpdir, ec);
  return failure_count == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  ::signal(SIGPIPE, SIG_IGN);
  auto o = parse_options(argc, argv);
  if (!o) {
    std::fprintf(stderr, "gpuq_bench_roundtrip: %s\n", o.error().to_string().c_str());
    print_usage();
    return 2;
  }
  if (o->server == "uds") return run_uds_server(*o);
  if (o->server == "mq") return run_mq_server(*o);
  if (!o->server.empty()) return 2;
  if (!o->child.empty()) {
    if (o->child != "gpuq" && o->child != "uds" && o->child != "mq" && o->child != kNoMetrics) {
      return 2;
    }
    return run_child(*o);
  }
  return run_orchestrator(*o);
}
