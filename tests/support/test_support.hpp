// Small helpers shared by gpuq's tests: sanitizer-aware iteration counts, seeds, waiting on a
// state with a deadline, shared anonymous memory, and forked children with bounded waits.
// Test-only code; nothing here is used by the product.
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

#include "gpuq/common/clock.hpp"

#if defined(__SANITIZE_THREAD__)
#define GPUQ_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define GPUQ_TEST_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define GPUQ_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define GPUQ_TEST_ASAN 1
#endif
#endif

namespace gpuq::test {

#if defined(GPUQ_TEST_TSAN)
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif
#if defined(GPUQ_TEST_ASAN)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif

// `n` iterations in a plain build, fewer under a sanitizer (TSan costs 5-15x per operation,
// ASan about 2x), so that every label keeps its time budget in every build.
constexpr uint64_t scaled(uint64_t n) noexcept {
  if (kThreadSanitizer) return std::max<uint64_t>(n / 4, 1);
  if (kAddressSanitizer) return std::max<uint64_t>(n / 2, 1);
  return n;
}

inline constexpr uint64_t kMillisecond = 1'000'000;
inline constexpr uint64_t kSecond = 1'000'000'000;

// The seed of a randomized test: GPUQ_TEST_SEED if set, else `fallback` (a fixed value keeps
// unit tests reproducible; stress tests pass a fresh one). Always print it with the test.
inline uint64_t test_seed(uint64_t fallback) {
  if (const char* s = std::getenv("GPUQ_TEST_SEED"); s != nullptr && *s != '\0') {
    return std::strtoull(s, nullptr, 0);
  }
  return fallback;
}

inline uint64_t fresh_seed() {
  return std::random_device{}() ^ gpuq::monotonic_ns();
}

// Polls `pred` until it holds or `timeout_ns` passes; returns its last value. Waits on the state
// itself (never a fixed sleep): it spins briefly, then yields, then naps 50 us between checks.
template <typename Pred>
bool wait_until(Pred&& pred, uint64_t timeout_ns) {
  const uint64_t deadline = gpuq::monotonic_ns() + timeout_ns;
  for (uint32_t i = 0;; ++i) {
    if (pred()) return true;
    if (gpuq::monotonic_ns() >= deadline) return pred();
    if (i < 64) {
      std::this_thread::yield();
    } else {
      timespec ts{0, 50'000};
      nanosleep(&ts, nullptr);
    }
  }
}

// Aborts the test executable with a message if it is still alive `timeout_ns` after being armed:
// turns a stalled lock-free operation (an endless retry loop) into a quick, named failure
// instead of a ctest timeout. Do not fork while one is armed.
class Watchdog {
 public:
  Watchdog(const char* what, uint64_t timeout_ns)
      : thread_([this, what, timeout_ns] {
          std::unique_lock<std::mutex> lock(mutex_);
          if (!disarmed_cv_.wait_for(lock, std::chrono::nanoseconds(timeout_ns),
                                     [this] { return disarmed_; })) {
            std::fprintf(stderr, "watchdog: '%s' still running after %.1f s: stalled\n", what,
                         static_cast<double>(timeout_ns) / 1e9);
            std::abort();
          }
        }) {}
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      disarmed_ = true;
    }
    disarmed_cv_.notify_one();
    thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable disarmed_cv_;
  bool disarmed_ = false;
  std::thread thread_;  // last: starts after the members it uses
};

// Zero-filled memory shared with forked children (MAP_SHARED | MAP_ANONYMOUS), page aligned.
class SharedMemory {
 public:
  explicit SharedMemory(size_t bytes) : bytes_(bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::perror("mmap");
      std::abort();
    }
    base_ = static_cast<char*>(p);
  }
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;
  ~SharedMemory() { ::munmap(base_, bytes_); }

  char* base() const noexcept { return base_; }
  size_t bytes() const noexcept { return bytes_; }

 private:
  char* base_ = nullptr;
  size_t bytes_ = 0;
};

// Bump allocator over a SharedMemory: places arrays of T (value-initialized) at aligned offsets.
class SharedArena {
 public:
  explicit SharedArena(SharedMemory& memory) : memory_(memory) {}

  template <typename T>
  T* make_array(size_t count, size_t align = alignof(T)) {
    used_ = (used_ + align - 1) / align * align;
    if (used_ + count * sizeof(T) > memory_.bytes()) {
      std::fprintf(stderr, "SharedArena: out of space\n");
      std::abort();
    }
    T* p = reinterpret_cast<T*>(memory_.base() + used_);
    for (size_t i = 0; i < count; ++i) new (p + i) T{};
    used_ += count * sizeof(T);
    return p;
  }
  void* take_bytes(size_t bytes, size_t align) {
    used_ = (used_ + align - 1) / align * align;
    void* p = memory_.base() + used_;
    used_ += bytes;
    if (used_ > memory_.bytes()) {
      std::fprintf(stderr, "SharedArena: out of space\n");
      std::abort();
    }
    return p;
  }

 private:
  SharedMemory& memory_;
  size_t used_ = 0;
};

// Forks a child that runs fn() (returning its exit code) and then _exit()s, so that no atexit
// handler, static destructor or doctest reporter runs twice. The child must only do simple work
// (no threads, no doctest macros). Returns the child's pid, or -1 if fork failed.
template <typename Fn>
pid_t fork_child(Fn&& fn) {
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t pid = ::fork();
  if (pid == 0) {
    // Doctest's crash handlers are inherited: restore the defaults so that a child that crashes
    // or is killed by the parent's timeout does not print a second test report.
    for (int sig : {SIGABRT, SIGBUS, SIGFPE, SIGILL, SIGINT, SIGSEGV, SIGTERM}) {
      ::signal(sig, SIG_DFL);
    }
    int code = fn();
    ::_exit(code);
  }
  return pid;
}

struct ChildExit {
  bool reaped = false;     // waitpid succeeded
  bool timed_out = false;  // the deadline passed and the child was killed
  bool exited = false;     // exited normally, with `code`
  int code = -1;
  int signal = 0;  // killed by this signal

  bool ok() const noexcept { return reaped && !timed_out && exited && code == 0; }
  std::string describe() const {
    std::ostringstream s;
    if (!reaped) return "not reaped";
    if (timed_out) s << "timed out (killed); ";
    if (exited) s << "exited with " << code;
    if (signal != 0) s << "killed by signal " << signal;
    return s.str();
  }
};

// Reaps `pid`; if it has not exited after `timeout_ns`, SIGKILLs it and reports timed_out.
inline ChildExit wait_child(pid_t pid, uint64_t timeout_ns) {
  ChildExit result;
  int status = 0;
  pid_t r = 0;
  const bool done = wait_until(
      [&] {
        do {
          r = ::waitpid(pid, &status, WNOHANG);
        } while (r == -1 && errno == EINTR);
        return r != 0;
      },
      timeout_ns);
  if (!done) {
    result.timed_out = true;
    ::kill(pid, SIGKILL);
    do {
      r = ::waitpid(pid, &status, 0);
    } while (r == -1 && errno == EINTR);
  }
  if (r != pid) return result;
  result.reaped = true;
  if (WIFEXITED(status)) {
    result.exited = true;
    result.code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    result.signal = WTERMSIG(status);
  }
  return result;
}

inline pid_t current_tid() {
  return static_cast<pid_t>(::syscall(SYS_gettid));
}

// The scheduler state letter of a task ('R' running, 'S' sleeping, ...) from /proc, or '?'.
// For a thread of this process pass its tid; for another process pass its pid.
inline char task_state(pid_t pid, pid_t tid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t paren = text.rfind(')');
  if (paren == std::string::npos || paren + 2 >= text.size()) return '?';
  return text[paren + 2];
}

}  // namespace gpuq::test
