// OpListings: a Python pool's op listing run while gpuqd serves. A rolling restart lists the
// pool's ops anew (its modules may have changed) before it starts a new worker
// (docs/design/live_changes.md, "Python pools' ops"). The listing child is python_pool.hpp's,
// as at start, but it is not waited for: it is started through the ProcessLauncher, its output
// read by the supervisor's loop (Tag::kListing), its exit reaped with the workers', so that the
// loop keeps serving while a module imports a framework for seconds.
// Not thread-safe: the supervisor's loop owns it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "config.hpp"
#include "event_loop.hpp"
#include "gpuq/common/unique_fd.hpp"
#include "gpuq/error.hpp"
#include "process_launcher.hpp"
#include "python_pool.hpp"

namespace gpuq::daemon {

class OpListings {
 public:
  // A listing's end: its pool, the ops it printed (python_call first, not registered yet), or
  // why not (parse_python_listing's one line; `detail` has the whole stderr).
  using Done = std::function<void(uint32_t pool, Result<std::vector<ListedPythonOp>> ops,
                                  const PythonListingDetail& detail)>;

  OpListings(EventLoop& loop, ProcessLauncher& launcher, uint64_t timeout_ns)
      : loop_(loop), launcher_(launcher), timeout_ns_(timeout_ns) {}
  ~OpListings();
  OpListings(const OpListings&) = delete;
  OpListings& operator=(const OpListings&) = delete;

  void set_on_done(Done fn) { on_done_ = std::move(fn); }

  // Starts listing pool `pool_id`'s ops (`pool` must have `python`). Errors: InvalidArgument
  // when one runs for the pool already, or its interpreter is gone; the launcher's.
  Result<void> start(uint32_t pool_id, const PoolConfig& pool, uint64_t now);
  bool running(uint32_t pool_id) const;

  // The loop's events: output on a listing's pipe (the tag's id), a child reaped (true when it
  // was a listing's: on_done has run), the periodic tick (a listing past its time is killed).
  void on_output(uint64_t id);
  bool on_exit(pid_t pid, int status);
  void tick(uint64_t now);
  // Kills the pool's listing, if one runs; no on_done.
  void cancel(uint32_t pool_id);
  // Kills every listing; no on_done (the daemon stops).
  void stop_all();

  // Tag ids: {pool << 1 | 1 for stderr}.
  static uint64_t tag_id(uint32_t pool, bool err) { return uint64_t{pool} << 1 | (err ? 1 : 0); }

 private:
  struct Listing {
    uint32_t pool = 0;
    PoolConfig config;  // as when it started
    pid_t pid = 0;
    UniqueFd out, err;
    std::string out_text, err_text;
    uint64_t deadline_ns = 0;
    bool timed_out = false;
  };
  Listing* find(uint32_t pool);
  // Reads what `fd` has now; closes it at its end.
  void drain(Listing& l, bool err);

  EventLoop& loop_;
  ProcessLauncher& launcher_;
  uint64_t timeout_ns_;
  std::vector<Listing> listings_;
  Done on_done_;
};

}  // namespace gpuq::daemon
