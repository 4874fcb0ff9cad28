// The supervisor's epoll set: which descriptor wakes the loop, and what the loop is told when it
// does (a tag: the kind of source and its id). Every component that owns a descriptor the loop
// watches registers it here; Supervisor::step() waits on it and dispatches by tag.
#pragma once

#include <sys/epoll.h>

#include <cerrno>
#include <cstdint>

#include "gpuq/common/log.hpp"
#include "gpuq/common/posix_call.hpp"
#include "gpuq/common/unique_fd.hpp"
#include "gpuq/error.hpp"

namespace gpuq::daemon {

// epoll tags: {kind:8 | id:56}.
enum class Tag : uint64_t {
  kListen = 1,
  kSignal,
  kTimer,
  kConnection,  // a client's socket; id: the connection id
  kClientExit,  // a client's pidfd (the process has exited); id: the connection id
  kWorkerControl,
  kWorkerOut,   // id: {worker id << 1 | 1 for stderr}
  kWatchdog,    // the watchdog keep-alive timer (service_link.cpp)
  kTestHook,    // SIGUSR2 with GPUQ_TEST_HOOKS=1 (service_link.cpp)
  kMetrics,     // the HTTP listener's eventfd: scrapes waiting for the metrics text
  kGpuSampler,  // the GPU sampler's stdout (gpu_sampler.hpp)
  kListing,     // a Python pool's op listing's output (op_listing.hpp); id: OpListings::tag_id
};
constexpr uint64_t make_tag(Tag t, uint64_t id) {
  return (static_cast<uint64_t>(t) << 56) | id;
}
constexpr Tag tag_kind(uint64_t tag) {
  return static_cast<Tag>(tag >> 56);
}
constexpr uint64_t tag_id(uint64_t tag) {
  return tag & ((uint64_t{1} << 56) - 1);
}

class EventLoop {
 public:
  Result<void> open() {
    auto fd = GPUQ_POSIX_CALL(::epoll_create1, EPOLL_CLOEXEC);
    if (!fd) return fd.error();
    fd_.reset(static_cast<int>(*fd));
    return {};
  }

  // Watches `fd` for `events` (EPOLLIN...), reported with `tag`. Errors: the failed epoll_ctl
  // (ENOMEM, ENOSPC past max_user_watches): the caller must not count on hearing from `fd`.
  Result<void> add(int fd, uint64_t tag, uint32_t events) {
    return control(EPOLL_CTL_ADD, fd, tag, events);
  }
  Result<void> modify(int fd, uint64_t tag, uint32_t events) {
    return control(EPOLL_CTL_MOD, fd, tag, events);
  }
  // Stops watching `fd` (before it is closed). A descriptor that was never added, or whose
  // add failed, is not an error here: ENOENT is ignored.
  void remove(int fd) {
    if (fd < 0 || !fd_.valid()) return;
    if (auto r = GPUQ_POSIX_CALL(::epoll_ctl, fd_.get(), EPOLL_CTL_DEL, fd, nullptr);
        !r && errno != ENOENT) {
      log_failure(r.error());
    }
  }

  // Waits up to `timeout_ms` (-1: no limit) for events; returns how many were stored (0 on
  // timeout or EINTR). Errors: epoll_wait's, other than EINTR.
  Result<int> wait(epoll_event* events, int max_events, int timeout_ms) {
    // Not through GPUQ_POSIX_CALL, which would retry EINTR with the whole timeout again: the
    // caller's round ends instead, and it decides whether to wait again.
    const int n = ::epoll_wait(fd_.get(), events, max_events, timeout_ms);
    if (n >= 0) return n;
    if (errno == EINTR) return 0;
    return GPUQ_SYSTEM_ERROR("epoll_wait");
  }

 private:
  Result<void> control(int op, int fd, uint64_t tag, uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = tag;
    if (auto r = GPUQ_POSIX_CALL(::epoll_ctl, fd_.get(), op, fd, &ev); !r) return r.error();
    return {};
  }
  static void log_failure(const Error& e) {
    GPUQ_LOG_WARN("cannot stop watching a descriptor: %s", e.to_string().c_str());
  }

  UniqueFd fd_;
};

}  // namespace gpuq::daemon
