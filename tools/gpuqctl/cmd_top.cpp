// gpuqctl top [--interval S] [--count N] [--once]: a live view of the daemon's metrics
// (docs/metrics.md, "gpuqctl top"), like `nvidia-smi dmon` or htop. Every interval it fetches the
// metrics text (as `gpuqctl metrics` does) and shows what changed since the last one
// (top_report.hpp). On a terminal it redraws in place until q, Ctrl-C or the daemon goes away;
// otherwise, or with --once, it prints plain text reports.
//
// Signals: SIGINT, SIGTERM and SIGHUP set a flag and wake the loop through a pipe; the loop ends.
// A second one while the loop is stuck in a fetch (up to the client's 10 s reply timeout)
// restores the terminal in the handler and exits at once. SIGTSTP (Ctrl-Z) on the live view is
// handled by the loop: it hands the terminal back, stops, and takes it again on SIGCONT.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cli.hpp"
#include "commands.hpp"
#include "gpuq/client.hpp"
#include "gpuq/common/posix_call.hpp"
#include "prom_text.hpp"
#include "top_report.hpp"

namespace gpuq::ctl {
namespace {

using Clock = std::chrono::steady_clock;

constexpr double kMinIntervalS = 0.1;
constexpr double kMaxIntervalS = 3600;
constexpr const char* kHideCursor = "\033[?25l";
constexpr const char* kShowCursor = "\033[?25h";

// ---- Signals ---------------------------------------------------------------------------------
// State the handlers read. g_saved_termios is written only while g_terminal_taken is 0, and the
// handler reads it only while g_terminal_taken is 1; g_wake_write_fd is set before the handlers
// are installed and reset after they are gone.

volatile sig_atomic_t g_stop_signal = 0;     // the first SIGINT/SIGTERM/SIGHUP
volatile sig_atomic_t g_suspend = 0;         // SIGTSTP arrived; the loop stops the process
volatile sig_atomic_t g_terminal_taken = 0;  // g_saved_termios must be restored on exit
volatile sig_atomic_t g_cursor_hidden = 0;   // the cursor must be shown again on exit
int g_wake_write_fd = -1;
termios g_saved_termios{};

// Async-signal-safe: sets flags, writes to a non-blocking pipe; on a second stop signal,
// tcsetattr, write and _exit. Raw calls: the checked-call wrapper allocates on failure.
extern "C" void on_signal(int signal_number) {
  const int saved_errno = errno;
  if (signal_number == SIGTSTP) {
    g_suspend = 1;
  } else if (g_stop_signal != 0) {
    if (g_terminal_taken != 0) ::tcsetattr(STDIN_FILENO, TCSANOW, &g_saved_termios);
    if (g_cursor_hidden != 0) {
      [[maybe_unused]] ssize_t n = ::write(STDOUT_FILENO, "\033[?25h\n", 7);
    }
    ::_exit(128 + signal_number);
  } else {
    g_stop_signal = signal_number;
  }
  const char byte = 0;
  [[maybe_unused]] ssize_t n = ::write(g_wake_write_fd, &byte, 1);
  errno = saved_errno;
}

// The wake-up pipe and the handlers, for as long as top runs; the old dispositions come back.
class SignalWatch {
 public:
  SignalWatch() = default;
  SignalWatch(const SignalWatch&) = delete;
  SignalWatch& operator=(const SignalWatch&) = delete;

  // Errors: those of pipe2 and sigaction (posix_call.hpp).
  Result<void> start(bool suspend_too) {
    int fds[2];
    if (auto r = GPUQ_POSIX_CALL(::pipe2, fds, O_CLOEXEC | O_NONBLOCK); !r) return r.error();
    read_fd_ = fds[0];
    g_wake_write_fd = write_fd_ = fds[1];
    std::vector<int> signals = {SIGINT, SIGTERM, SIGHUP};
    if (suspend_too) signals.push_back(SIGTSTP);
    for (int s : signals) {
      struct sigaction action {};
      action.sa_handler = on_signal;
      sigemptyset(&action.sa_mask);
      action.sa_flags = SA_RESTART;
      Installed installed{s, {}};
      if (auto r = GPUQ_POSIX_CALL(::sigaction, s, &action, &installed.old); !r) {
        return r.error();
      }
      installed_.push_back(installed);
    }
    return {};
  }

  ~SignalWatch() {
    for (const Installed& i : installed_) {
      // The handler's own place: restoring it cannot fail.
      [[maybe_unused]] auto r = GPUQ_POSIX_CALL(::sigaction, i.signal, &i.old, nullptr);
    }
    g_wake_write_fd = -1;
    // Closed once, results ignored: nothing is left to flush in a pipe (posix_call.hpp on close).
    if (read_fd_ >= 0) ::close(read_fd_);
    if (write_fd_ >= 0) ::close(write_fd_);
  }

  int fd() const { return read_fd_; }

  // Empties the pipe (non-blocking: it stops at EAGAIN).
  void drain() const {
    char buffer[64];
    for (;;) {
      auto n = GPUQ_POSIX_CALL(::read, read_fd_, buffer, sizeof buffer);
      if (!n || *n <= 0) return;
    }
  }

 private:
  struct Installed {
    int signal;
    struct sigaction old;
  };

  int read_fd_ = -1;
  int write_fd_ = -1;
  std::vector<Installed> installed_;
};

// ---- The live screen ----------------------------------------------------------------------------

// The terminal while the live view runs: keys read one at a time without echo (when stdin is a
// terminal), the cursor hidden, each report drawn over the last. Restores the terminal when
// destroyed (every return path of run_top), before a stop (Ctrl-Z), and in on_signal's forced
// exit.
class LiveScreen {
 public:
  LiveScreen() { take(); }
  ~LiveScreen() { give_back(); }
  LiveScreen(const LiveScreen&) = delete;
  LiveScreen& operator=(const LiveScreen&) = delete;

  bool reads_keys() const { return reads_keys_; }

  // Draws `text` over the screen: from the top left, each line cleared to its end, the rest of
  // the screen cleared below. A line wider than the terminal wraps; lines that would not fit
  // below it are left out, so that the screen never scrolls and the next report lands on this one.
  void draw(const std::string& text) {
    last_ = text;
    winsize size{};
    size_t rows = 0, columns = 0;
    if (GPUQ_POSIX_CALL(::ioctl, STDOUT_FILENO, TIOCGWINSZ, &size)) {
      rows = size.ws_row;
      columns = size.ws_col;
    }
    std::string frame = "\033[H";
    size_t begin = 0, used = 0;
    while (begin < text.size()) {
      size_t end = text.find('\n', begin);
      if (end == std::string::npos) end = text.size();
      const size_t length = end - begin;
      const size_t height =
          columns == 0 ? 1 : std::max<size_t>(1, (length + columns - 1) / columns);
      // The row below the last line stays free: the newline after it would scroll otherwise.
      if (rows != 0 && used + height >= rows) break;
      frame.append(text, begin, length);
      // A line that ends in the last column leaves the cursor there, where "clear to the end
      // of the line" would erase its last character on some terminals; it needs no clearing.
      if (columns == 0 || length % columns != 0 || length == 0) frame += "\033[K";
      frame += '\n';
      used += height;
      begin = end + 1;
    }
    frame += "\033[J";
    write_out(frame);
  }

  // Ctrl-Z: hands the terminal back, stops the process (SIGTSTP's default action), and once
  // continued takes the terminal again and redraws the last report.
  void suspend() {
    give_back();
    struct sigaction action {};
    action.sa_handler = SIG_DFL;
    sigemptyset(&action.sa_mask);
    struct sigaction handler {};
    // Failures here cannot happen with these arguments; if one did, top would carry on unstopped.
    [[maybe_unused]] auto r1 = GPUQ_POSIX_CALL(::sigaction, SIGTSTP, &action, &handler);
    [[maybe_unused]] auto r2 = GPUQ_POSIX_CALL(::raise, SIGTSTP);  // stops here until SIGCONT
    [[maybe_unused]] auto r3 = GPUQ_POSIX_CALL(::sigaction, SIGTSTP, &handler, nullptr);
    take();
    write_out("\033[2J");
    draw(last_);
  }

 private:
  // Without a terminal on stdin (or one that refuses the mode) there are no keys: the view
  // still runs, and Ctrl-C ends it.
  void take() {
    reads_keys_ = false;
    if (::isatty(STDIN_FILENO) == 1 &&
        GPUQ_POSIX_CALL(::tcgetattr, STDIN_FILENO, &g_saved_termios)) {
      termios keys = g_saved_termios;
      keys.c_lflag &= ~static_cast<tcflag_t>(ICANON | ECHO);  // ISIG stays: Ctrl-C is SIGINT
      keys.c_cc[VMIN] = 1;
      keys.c_cc[VTIME] = 0;
      if (GPUQ_POSIX_CALL(::tcsetattr, STDIN_FILENO, TCSANOW, &keys)) {
        g_terminal_taken = 1;
        reads_keys_ = true;
      }
    }
    g_cursor_hidden = 1;
    write_out(std::string(kHideCursor) + "\033[2J");
  }

  void give_back() {
    if (g_terminal_taken != 0) {
      // Best effort: a terminal that went away (SIGHUP) has no mode left to restore.
      [[maybe_unused]] auto r =
          GPUQ_POSIX_CALL(::tcsetattr, STDIN_FILENO, TCSANOW, &g_saved_termios);
      g_terminal_taken = 0;
    }
    write_out(kShowCursor);
    g_cursor_hidden = 0;
  }

  static void write_out(const std::string& text) { std::cout << text << std::flush; }

  bool reads_keys_ = false;
  std::string last_;
};

// ---- The loop ---------------------------------------------------------------------------------

struct TopOptions {
  double interval_s = 1;
  uint64_t reports = 0;  // 0: until stopped
  bool once = false;
};

enum class Wake { kTimeUp, kQuit, kStopSignal };

// Waits until `deadline` for a key, a signal or the time. Handles Ctrl-Z itself.
Wake wait_until(Clock::time_point deadline, const SignalWatch& signals, LiveScreen* screen,
                bool& keys_open) {
  for (;;) {
    if (g_stop_signal != 0) return Wake::kStopSignal;
    if (g_suspend != 0) {
      g_suspend = 0;
      if (screen != nullptr) screen->suspend();
    }
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) return Wake::kTimeUp;
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
    pollfd fds[2] = {{signals.fd(), POLLIN, 0}, {STDIN_FILENO, POLLIN, 0}};
    const nfds_t count = keys_open ? 2 : 1;
    // A signal during poll wakes it through the pipe (poll is retried on EINTR).
    auto ready =
        GPUQ_POSIX_CALL(::poll, fds, count, static_cast<int>(std::min<int64_t>(ms, 60'000)));
    if (!ready) return Wake::kTimeUp;  // cannot wait: fetch now rather than spin
    if ((fds[0].revents & POLLIN) != 0) signals.drain();
    if (count == 2 && fds[1].revents != 0) {
      char keys[64];
      auto n = GPUQ_POSIX_CALL(::read, STDIN_FILENO, keys, sizeof keys);
      if (!n || *n == 0) {
        keys_open = false;  // end of input: only signals and time from now on
        continue;
      }
      for (long i = 0; i < *n; ++i) {
        if (keys[i] == 'q' || keys[i] == 'Q') return Wake::kQuit;
      }
    }
  }
}

// One metrics text, parsed. Errors: those of daemon_metrics_text; kProtocolMismatch for a text
// that does not parse.
Result<std::vector<PromSample>> fetch(const std::string& runtime_dir) {
  Result<std::string> text = gpuq::daemon_metrics_text(runtime_dir);
  if (!text) return std::move(text).error();
  Result<std::vector<PromSample>> samples = parse_prom_text(*text);
  if (!samples) {
    return Error(ErrorCode::kProtocolMismatch,
                 "the daemon's metrics text does not parse: " + samples.error().message());
  }
  return samples;
}

double unix_now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

int run_top(const std::string& runtime_dir, const TopOptions& options) {
  const bool live = !options.once && ::isatty(STDOUT_FILENO) == 1;
  const uint64_t reports = options.once ? 1 : options.reports;
  SignalWatch signals;
  if (Result<void> started = signals.start(/*suspend_too=*/live); !started) {
    return daemon_error(started.error());
  }

  Result<std::vector<PromSample>> previous = fetch(runtime_dir);
  if (!previous) return daemon_error(previous.error());
  Clock::time_point previous_at = Clock::now();

  std::optional<LiveScreen> screen;
  if (live) {
    screen.emplace();
    screen->draw(
        strf("gpuqctl top: the first report comes in %.1f s (q quits)\n", options.interval_s));
  }
  bool keys_open = screen && screen->reads_keys();
  const auto interval = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(options.interval_s));
  for (uint64_t shown = 0; reports == 0 || shown < reports; ++shown) {
    switch (wait_until(previous_at + interval, signals, screen ? &*screen : nullptr, keys_open)) {
      case Wake::kTimeUp:
        break;
      case Wake::kQuit:
        return kExitOk;
      case Wake::kStopSignal:
        // Leaving the live view is what Ctrl-C is for there; elsewhere it interrupts.
        return live ? kExitOk : 128 + g_stop_signal;
    }
    Result<std::vector<PromSample>> current = fetch(runtime_dir);
    if (!current) {
      screen.reset();  // the terminal back before the message
      return daemon_error(current.error());
    }
    const Clock::time_point now = Clock::now();
    const TopReport report =
        compute_top(*previous, *current, std::chrono::duration<double>(now - previous_at).count());
    const std::string text = format_top(report, unix_now_s());
    if (screen) {
      screen->draw(text + (keys_open ? "\nq: quit\n" : "\nCtrl-C: quit\n"));
    } else {
      std::cout << (shown > 0 ? "\n" : "") << text << std::flush;
    }
    previous = std::move(current);
    previous_at = now;
  }
  return kExitOk;
}

}  // namespace

int cmd_top(ArgCursor& cursor, std::string& runtime_dir) {
  TopOptions options;
  bool counted = false;
  std::string error, value;
  while (!cursor.done()) {
    std::string_view arg = cursor.peek();
    if (arg == "-h" || arg == "--help") {
      std::cout << kUsage;
      return kExitOk;
    }
    if (arg == "--once") {
      options.once = true;
      cursor.next();
    } else if (cursor.take_value("--interval", value, error)) {
      if (!error.empty()) return usage_error(error);
      auto interval = parse_seconds("--interval", value, kMinIntervalS, kMaxIntervalS, error);
      if (!interval) return usage_error(error);
      options.interval_s = *interval;
    } else if (cursor.take_value("--count", value, error)) {
      if (!error.empty()) return usage_error(error);
      auto count = parse_count("--count", value, 1, 1'000'000'000, error);
      if (!count) return usage_error(error);
      options.reports = *count;
      counted = true;
    } else if (cursor.take_value("--runtime-dir", runtime_dir, error)) {
      if (!error.empty()) return usage_error(error);
    } else {
      return usage_error("unknown argument '" + std::string(arg) + "' for top");
    }
  }
  if (options.once && counted) {
    return usage_error("--once and --count exclude each other (--once prints one report)");
  }
  return run_top(runtime_dir, options);
}

}  // namespace gpuq::ctl
