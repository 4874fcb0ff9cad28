#include "op_listing.hpp"

#include <fcntl.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "gpuq/common/log.hpp"
#include "gpuq/common/posix_call.hpp"

namespace gpuq::daemon {

OpListings::~OpListings() {
  stop_all();
}

OpListings::Listing* OpListings::find(uint32_t pool) {
  auto it = std::find_if(listings_.begin(), listings_.end(),
                         [&](const Listing& l) { return l.pool == pool; });
  return it == listings_.end() ? nullptr : &*it;
}

bool OpListings::running(uint32_t pool) const {
  return std::any_of(listings_.begin(), listings_.end(),
                     [&](const Listing& l) { return l.pool == pool; });
}

Result<void> OpListings::start(uint32_t pool_id, const PoolConfig& pool, uint64_t now) {
  if (running(pool_id)) {
    return Error(ErrorCode::kInvalidArgument, "pool " + pool.name + ": its ops are being listed");
  }
  Listing l;
  l.pool = pool_id;
  l.config = pool;
  // Resolved again: the interpreter may have moved (a venv rebuilt) since gpuqd started.
  if (auto r = resolve_python_interpreter(l.config); !r) return r;
  const PythonListingCommand command = python_listing_command(l.config, pool_id);
  int out_fds[2], err_fds[2];
  if (auto r = GPUQ_POSIX_CALL(::pipe2, out_fds, O_CLOEXEC | O_NONBLOCK); !r) return r.error();
  UniqueFd out_write(out_fds[1]);
  l.out.reset(out_fds[0]);
  if (auto r = GPUQ_POSIX_CALL(::pipe2, err_fds, O_CLOEXEC | O_NONBLOCK); !r) return r.error();
  UniqueFd err_write(err_fds[1]);
  l.err.reset(err_fds[0]);
  // The child's ends block (a listing that prints much waits for the loop to read).
  for (int fd : {out_write.get(), err_write.get()}) {
    if (auto r = GPUQ_POSIX_CALL(::fcntl, fd, F_SETFL, 0); !r) return r.error();
  }
  LaunchSpec spec;
  spec.argv = command.argv;
  spec.env = command.env;
  spec.stdout_fd = out_write.get();
  spec.stderr_fd = err_write.get();
  auto pid = launcher_.launch(spec);
  if (!pid) return pid.error();
  l.pid = *pid;
  l.deadline_ns = now + timeout_ns_;
  if (auto r = loop_.add(l.out.get(), make_tag(Tag::kListing, tag_id(pool_id, false)), EPOLLIN);
      !r) {
    launcher_.kill(l.pid);  // reaped as an unknown child
    return r;
  }
  if (auto r = loop_.add(l.err.get(), make_tag(Tag::kListing, tag_id(pool_id, true)), EPOLLIN);
      !r) {
    loop_.remove(l.out.get());
    launcher_.kill(l.pid);
    return r;
  }
  GPUQ_LOG_INFO("pool %s: listing its ops (pid %d)", pool.name.c_str(), l.pid);
  listings_.push_back(std::move(l));
  return {};
}

void OpListings::drain(Listing& l, bool err) {
  UniqueFd& fd = err ? l.err : l.out;
  std::string& text = err ? l.err_text : l.out_text;
  char chunk[4096];
  while (fd.valid()) {
    const ssize_t n = ::read(fd.get(), chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    if (n <= 0) {  // its end (or a failed pipe: the exit status says the rest)
      loop_.remove(fd.get());
      fd.reset();
      return;
    }
    // A listing is a line of JSON and a traceback; more than 16 MiB is no listing.
    if (text.size() < (16u << 20)) text.append(chunk, static_cast<size_t>(n));
  }
}

void OpListings::on_output(uint64_t id) {
  if (Listing* l = find(static_cast<uint32_t>(id >> 1))) drain(*l, (id & 1) != 0);
}

bool OpListings::on_exit(pid_t pid, int status) {
  auto it = std::find_if(listings_.begin(), listings_.end(),
                         [&](const Listing& l) { return l.pid == pid; });
  if (it == listings_.end()) return false;
  Listing l = std::move(*it);
  listings_.erase(it);
  // What it wrote before it exited is in the pipes (a child of its own could keep them open:
  // what is there now is all that counts).
  drain(l, false);
  drain(l, true);
  if (l.out.valid()) loop_.remove(l.out.get());
  if (l.err.valid()) loop_.remove(l.err.get());
  PythonListingDetail detail;
  Result<std::vector<ListedPythonOp>> ops =
      l.timed_out ? Result<std::vector<ListedPythonOp>>(Error(
                        ErrorCode::kTimeout, "listing its ops took more than " +
                                                 std::to_string(timeout_ns_ / 1'000'000) + " ms"))
                  : parse_python_listing(l.config, l.out_text, l.err_text, status, &detail);
  if (l.timed_out) detail.stderr_text = l.err_text;
  if (on_done_) on_done_(l.pool, std::move(ops), detail);
  return true;
}

void OpListings::tick(uint64_t now) {
  for (Listing& l : listings_) {
    if (l.timed_out || now < l.deadline_ns) continue;
    GPUQ_LOG_WARN("pool %s: listing its ops (pid %d) takes too long: stopping it",
                  l.config.name.c_str(), l.pid);
    l.timed_out = true;
    launcher_.kill(l.pid);  // its exit ends the listing
  }
}

void OpListings::cancel(uint32_t pool_id) {
  std::erase_if(listings_, [&](Listing& l) {
    if (l.pool != pool_id) return false;
    if (l.out.valid()) loop_.remove(l.out.get());
    if (l.err.valid()) loop_.remove(l.err.get());
    launcher_.kill(l.pid);  // reaped as a child nobody knows
    return true;
  });
}

void OpListings::stop_all() {
  while (!listings_.empty()) cancel(listings_.front().pool);
}

}  // namespace gpuq::daemon
