#include "client_registry.hpp"

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "gpuq/common/fault_point.hpp"
#include "gpuq/common/log.hpp"
#include "gpuq/common/messages.hpp"
#include "gpuq/common/posix_call.hpp"

namespace gpuq::daemon {

namespace {

// The reserve descriptor (refuse_for_descriptors). Without one, a refused client waits in the
// backlog until a descriptor frees up, and is then served or refused: worse, not wrong.
UniqueFd open_reserve() {
  auto fd = GPUQ_POSIX_CALL(::open, "/dev/null", O_RDONLY | O_CLOEXEC);
  if (!fd) {
    GPUQ_LOG_WARN("no reserve descriptor for refusing clients: %s", fd.error().to_string().c_str());
    return UniqueFd();
  }
  return UniqueFd(static_cast<int>(*fd));
}

}  // namespace

ClientRegistry::ClientRegistry(const Config& config, QueueView& queue, EventLoop& loop)
    : config_(config),
      queue_(queue),
      loop_(loop),
      index_in_use_(config.max_clients, false),
      by_index_(config.max_clients, nullptr) {}

namespace {

// `uid`'s primary group `gid` and its supplementary groups (the primary alone for an unknown
// user, or one in more than 64 groups).
// A client's weight: the first entry naming its user, else the first naming one of its
// groups, else 1.
uint32_t weight_of(const std::vector<Config::ClientWeight>& weights, const Client& client) {
  for (const Config::ClientWeight& e : weights) {
    if (!e.group && e.id == client.uid) return e.weight;
  }
  for (const Config::ClientWeight& e : weights) {
    if (e.group &&
        std::find(client.groups.begin(), client.groups.end(), e.id) != client.groups.end()) {
      return e.weight;
    }
  }
  return 1;
}

std::vector<gid_t> groups_of(uid_t uid, gid_t gid) {
  std::vector<gid_t> groups{gid};
  passwd pw{}, *res = nullptr;
  std::vector<char> buf(16384);
  // getpwuid_r returns an error number; an unknown user (res null) has only its primary group.
  if (getpwuid_r(uid, &pw, buf.data(), buf.size(), &res) == 0 && res != nullptr) {
    int n = 64;
    std::vector<gid_t> g(static_cast<size_t>(n));
    if (getgrouplist(pw.pw_name, gid, g.data(), &n) >= 0) {
      groups.assign(g.begin(), g.begin() + n);
    }
  }
  return groups;
}

}  // namespace

bool ClientRegistry::authorized(uid_t uid, gid_t gid) const {
  const Config& c = config_;
  if (c.allowed_uids.empty() && c.allowed_gids.empty()) return uid == geteuid();
  if (std::find(c.allowed_uids.begin(), c.allowed_uids.end(), uid) != c.allowed_uids.end()) {
    return true;
  }
  if (c.allowed_gids.empty()) return false;
  for (gid_t g : groups_of(uid, gid)) {
    if (std::find(c.allowed_gids.begin(), c.allowed_gids.end(), g) != c.allowed_gids.end()) {
      return true;
    }
  }
  return false;
}

// Each client costs the supervisor three descriptors (its socket, its pidfd, its segment's
// memfd, kept to hand to respawned workers); each worker three (control socket, stdout,
// stderr). The soft RLIMIT_NOFILE is often 1024 while the hard one is far higher (systemd:
// 524288), so raise the soft limit to the hard one, and say so when even that is too few.
void ClientRegistry::raise_descriptor_limit(uint64_t workers) {
  rlimit lim{};
  if (auto r = GPUQ_POSIX_CALL(::getrlimit, RLIMIT_NOFILE, &lim); !r) {
    GPUQ_LOG_WARN("cannot read the descriptor limit: %s", r.error().to_string().c_str());
    return;
  }
  if (lim.rlim_cur < lim.rlim_max) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    if (auto r = GPUQ_POSIX_CALL(::setrlimit, RLIMIT_NOFILE, &raised); r) {
      lim = raised;
    } else {
      GPUQ_LOG_WARN("cannot raise the descriptor limit: %s", r.error().to_string().c_str());
    }
  }
  descriptor_limit_ = lim.rlim_cur;
  const Config& c = config_;
  // Workers; the supervisor's own descriptors; the metrics listener's connections and its own.
  const uint64_t fixed = workers * 3 + 32 + (c.metrics_listen ? 72 : 0);
  const uint64_t needed = fixed + uint64_t{c.max_clients} * 3;
  if (lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < needed) {
    GPUQ_LOG_WARN(
        "the descriptor limit (RLIMIT_NOFILE) is %llu, but max_clients = %u needs about %llu: "
        "clients past about %llu will be refused (raise LimitNOFILE= or ulimit -Hn, or lower "
        "max_clients)",
        static_cast<unsigned long long>(lim.rlim_cur), c.max_clients,
        static_cast<unsigned long long>(needed),
        static_cast<unsigned long long>(lim.rlim_cur > fixed ? (lim.rlim_cur - fixed) / 3 : 0));
  }
  reserve_fd_ = open_reserve();
}

// accept4 failed with EMFILE or ENFILE: the connection would stay in the backlog, and the
// level-triggered listen socket would wake the loop at once, again and again. Spend the
// reserve descriptor to take it, tell the client why, and close it.
bool ClientRegistry::refuse_for_descriptors(int listen_fd) {
  const int err = errno;
  if (!reserve_fd_.valid()) {
    GPUQ_LOG_WARN("accept: %s, and no reserve descriptor to refuse the client with",
                  std::strerror(err));
    return false;
  }
  reserve_fd_.reset();
  auto accepted =
      GPUQ_POSIX_CALL(::accept4, listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
  UniqueFd fd(accepted ? static_cast<int>(*accepted) : -1);  // none waiting: EAGAIN
  if (fd.valid()) {
    Error e(ErrorCode::kTooManyClients,
            "the daemon is out of file descriptors (" + std::string(std::strerror(err)) +
                ", RLIMIT_NOFILE " + std::to_string(descriptor_limit_) + ") with " +
                std::to_string(registered_) +
                " clients; raise its LimitNOFILE= or lower max_clients");
    GPUQ_LOG_WARN("refused a connection: %s", e.message().c_str());
    (void)send_message(fd.get(), MessageType::kError, error_body(e));  // best effort
  }
  const bool refused = fd.valid();
  fd.reset();
  reserve_fd_ = open_reserve();
  return refused;
}

void ClientRegistry::on_accept(int listen_fd) {
  for (;;) {
    auto accepted =
        GPUQ_POSIX_CALL(::accept4, listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (!accepted) {
      if (errno == EMFILE || errno == ENFILE) {
        // Until a client leaves, every new one is refused; stop when none is waiting or no
        // descriptor could be had even so (the next wakeup tries again).
        if (!refuse_for_descriptors(listen_fd)) return;
        continue;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        GPUQ_LOG_WARN("accept: %s", std::strerror(errno));
      }
      return;
    }
    const int fd = static_cast<int>(*accepted);
    auto client = std::make_unique<Client>();
    client->fd.reset(fd);
    ucred cred{};
    socklen_t len = sizeof cred;
    if (auto r = GPUQ_POSIX_CALL(::getsockopt, fd, SOL_SOCKET, SO_PEERCRED, &cred, &len); !r) {
      GPUQ_LOG_WARN("SO_PEERCRED: %s", r.error().to_string().c_str());
      continue;  // `client` closes the socket
    }
    client->pid = cred.pid;
    client->uid = cred.uid;
    client->gid = cred.gid;
    if (!authorized(cred.uid, cred.gid)) {
      Error e(ErrorCode::kPermissionDenied,
              "uid " + std::to_string(cred.uid) + " (pid " + std::to_string(cred.pid) +
                  ") is not allowed to use this daemon (see allowed_users and allowed_groups)");
      GPUQ_LOG_WARN("refused a connection: %s", e.message().c_str());
      (void)send_message(fd, MessageType::kError, error_body(e));  // best effort
      continue;
    }
    client->id = next_id_++;
    GPUQ_FAULT_POINT("supervisor.client_accepted");
    if (auto r = loop_.add(fd, make_tag(Tag::kConnection, client->id), EPOLLIN | EPOLLRDHUP); !r) {
      // Never heard from again, it would hang in connect: tell it, and let it go.
      Error e(ErrorCode::kSystemError,
              "the daemon cannot watch the connection: " + r.error().message());
      GPUQ_LOG_WARN("refused a connection: %s", e.message().c_str());
      (void)send_message(fd, MessageType::kError, error_body(e));
      continue;
    }
    // The socket alone misses a client whose children inherited it (fork, exec): they keep
    // it open after the client itself has died. Its pidfd becomes readable when it exits.
    if (auto pfd = GPUQ_POSIX_CALL(::syscall, SYS_pidfd_open, cred.pid, 0); pfd) {
      client->pidfd.reset(static_cast<int>(*pfd));
      if (auto r = loop_.add(client->pidfd.get(), make_tag(Tag::kClientExit, client->id), EPOLLIN);
          !r) {
        GPUQ_LOG_WARN("cannot watch client pid %d's exit (%s); it is seen when its socket closes",
                      cred.pid, r.error().to_string().c_str());
        client->pidfd.reset();
      }
    } else if (errno != ENOSYS) {
      GPUQ_LOG_WARN("pidfd_open(%d): %s; the client's exit is seen when its socket closes",
                    cred.pid, std::strerror(errno));
    }
    clients_.emplace(client->id, std::move(client));
  }
}

void ClientRegistry::on_readable(uint64_t id, uint32_t events) {
  auto it = clients_.find(id);
  if (it == clients_.end()) return;
  Client& client = *it->second;
  if (events & EPOLLIN) {
    for (;;) {
      auto m = receive_message(client.fd.get());
      if (!m) {
        const ErrorCode code = m.error().code();
        if (code == ErrorCode::kTimeout) break;  // nothing more to read now
        if (code != ErrorCode::kDisconnected) {
          // Malformed, oversized or wrong-version input: say why, then drop this connection.
          GPUQ_LOG_WARN("client pid %d sent a bad message: %s", client.pid,
                        m.error().to_string().c_str());
          (void)send_message(client.fd.get(), MessageType::kError, error_body(m.error()));
        }
        close(id);
        return;
      }
      on_message_(client, *m);
      if (clients_.find(id) == clients_.end()) return;
    }
  }
  if (events & (EPOLLHUP | EPOLLRDHUP | EPOLLERR)) close(id);
}

void ClientRegistry::on_exit(uint64_t id) {
  auto it = clients_.find(id);
  if (it == clients_.end()) return;
  GPUQ_LOG_INFO("client pid %d has exited", it->second->pid);
  close(id);
}

bool ClientRegistry::index_free(uint32_t index) const {
  if (index_in_use_[index]) return false;
  return std::none_of(retired_.begin(), retired_.end(),
                      [index](const Retired& r) { return r.index == index; });
}

Result<void> ClientRegistry::admit(Client& client, const std::string& hello_body, bool draining) {
  const Config& c = config_;
  if (draining) return Error(ErrorCode::kShuttingDown, "the daemon is draining");
  auto hello = decode_hello(hello_body, c.max_client_segment_bytes);
  if (!hello) return hello.error();
  client.name = std::move(hello->name);
  client.keep_running_jobs = hello->keep_running_jobs;
  const uint64_t arena = hello->arena_bytes != 0 ? hello->arena_bytes : c.client_segment_bytes;
  if (registered_ >= c.max_clients) {
    return Error(ErrorCode::kTooManyClients,
                 "the daemon already serves max_clients = " + std::to_string(c.max_clients) +
                     " clients; raise \"max_clients\" in its config (at most " +
                     std::to_string(kMaxClients - 1) + "; its default, \"auto\", is 8 per CPU, " +
                     "at least " + std::to_string(kMinDefaultMaxClients) +
                     "), or have fewer processes connect (one client per process, shared by "
                     "its threads)");
  }
  uint32_t index = c.max_clients;
  for (uint32_t k = 0; k < c.max_clients; ++k) {
    const uint32_t i = (next_index_ + k) % c.max_clients;
    if (index_free(i)) {
      index = i;
      break;
    }
  }
  if (index == c.max_clients) {
    return Error(ErrorCode::kTooManyClients, "no client index is free yet; retry shortly");
  }
  next_index_ = (index + 1) % c.max_clients;

  client.slot_count = c.max_jobs_per_client;
  client.geometry = ClientSegmentGeometry::compute(client.slot_count, arena);
  auto seg =
      MemfdSegment::create("gpuq-client-" + std::to_string(index), client.geometry.segment_bytes);
  if (!seg) return seg.error();
  client.segment = std::move(*seg);
  auto* h = static_cast<ClientSegmentHeader*>(client.segment.address());
  h->magic = kClientMagic;
  h->layout_version = kLayoutVersion;
  h->client_index = index;
  h->slot_count = client.slot_count;
  h->slots_offset = client.geometry.slots_offset;
  h->arena_offset = client.geometry.arena_offset;
  h->arena_bytes = client.geometry.arena_bytes;
  h->segment_bytes = client.geometry.segment_bytes;

  client.index = index;
  client.session = next_session_++;
  client.registered = true;
  client.groups = groups_of(client.uid, client.gid);
  index_in_use_[index] = true;
  by_index_[index] = &client;
  ++registered_;
  apply_weights();
  ClientShm& cs = queue_.client(index);
  for (auto& n : cs.submitted) n.store(0, std::memory_order_relaxed);
  cs.submitting.store(0, std::memory_order_relaxed);
  cs.pid.store(client.pid, std::memory_order_relaxed);
  cs.session.store(client.session, std::memory_order_release);
  return {};
}

void ClientRegistry::unregister(Client& client) {
  GPUQ_FAULT_POINT("supervisor.client_unregistering");
  ClientSegmentView view(client.segment.address(), client.geometry, client.slot_count);
  // Jobs still queued will never be read: cancel them (a worker that pops one skips it).
  for (uint32_t s = 0; s < client.slot_count; ++s) {
    JobSlot& slot = view.slot(s);
    uint64_t word = slot.state.load(std::memory_order_acquire);
    const SlotWord sw = SlotWord::unpack(word);
    if (sw.state == JobState::kSubmitted) {
      const SlotWord cancelled{sw.generation, JobState::kCancelled, 0};
      // Lost only to a worker that claimed it meanwhile: then it runs, and ends as usual.
      slot.state.compare_exchange_strong(word, cancelled.pack(), std::memory_order_acq_rel);
    }
  }
  ClientShm& cs = queue_.client(client.index);
  for (uint32_t p = 0; p < config_.pools.size(); ++p) count_submitted(client, p);
  cs.session.store(0, std::memory_order_release);
  cs.submitting.store(0, std::memory_order_relaxed);
  if (on_leaving_) on_leaving_(client);
  Retired r{client.index, {}};
  for (uint32_t p = 0; p < config_.pools.size(); ++p) {
    const PoolQueue q = queue_.queue(p);
    for (uint32_t lane = 0; lane < q.lane_count(); ++lane) {
      r.tails[p][lane] = q.lane(lane).settled_tail();
    }
  }
  retired_.push_back(r);
  index_in_use_[client.index] = false;
  by_index_[client.index] = nullptr;
  --registered_;
  client.registered = false;
  apply_weights();
  GPUQ_LOG_INFO("client %u (pid %d) disconnected", client.index, client.pid);
}

void ClientRegistry::close(uint64_t id) {
  auto it = clients_.find(id);
  if (it == clients_.end()) return;
  Client& client = *it->second;
  loop_.remove(client.fd.get());
  loop_.remove(client.pidfd.get());
  if (client.registered) unregister(client);
  clients_.erase(it);
}

void ClientRegistry::release_retired() {
  std::erase_if(retired_, [&](const Retired& r) {
    for (uint32_t p = 0; p < config_.pools.size(); ++p) {
      const PoolQueue q = queue_.queue(p);
      for (uint32_t lane = 0; lane < q.lane_count(); ++lane) {
        if (q.lane(lane).head_position() < r.tails[p][lane]) return false;
      }
    }
    return true;
  });
}

void ClientRegistry::count_submitted(const Client& client, uint32_t pool) const {
  const uint64_t now = queue_.client(client.index).submitted[pool].load(std::memory_order_relaxed);
  uint64_t& seen = client.submitted_seen[pool];
  if (now > seen) submitted_counted_[pool] += now - seen;
  seen = now;  // a counter that fell (a scribble) counts again only from here
}

uint64_t ClientRegistry::jobs_submitted(uint32_t pool) const {
  for_each([&](const Client& c) { count_submitted(c, pool); });
  return submitted_counted_[pool];
}

std::vector<ClientRegistry::JobCounts> ClientRegistry::busiest(size_t pool_count,
                                                               size_t limit) const {
  std::vector<JobCounts> rows;
  for_each([&](const Client& conn) {
    JobCounts r;
    r.client = &conn;
    r.pools.assign(pool_count, {0, 0});
    ClientSegmentView view(conn.segment.address(), conn.geometry, conn.slot_count);
    for (uint32_t slot = 0; slot < conn.slot_count; ++slot) {
      const JobSlot& js = view.slot(slot);
      const SlotWord w = SlotWord::unpack(js.state.load(std::memory_order_acquire));
      if (w.state != JobState::kSubmitted && w.state != JobState::kRunning) continue;
      const uint32_t pool = js.desc.pool_id;
      if (pool >= pool_count) continue;  // forged
      if (w.state == JobState::kSubmitted) {
        ++r.queued;
        ++r.pools[pool].first;
      } else {
        ++r.running;
        ++r.pools[pool].second;
      }
    }
    if (r.queued + r.running != 0) rows.push_back(std::move(r));
  });
  std::sort(rows.begin(), rows.end(), [](const JobCounts& a, const JobCounts& b) {
    return a.queued != b.queued ? a.queued > b.queued : a.running > b.running;
  });
  if (rows.size() > limit) rows.resize(limit);
  return rows;
}

void ClientRegistry::apply_weights() {
  const Config& c = config_;
  uint32_t columns[PoolQueue::kMaxClientLanes];
  for (uint32_t p = 0; p < queue_.layout().pool_count; ++p) {
    const PoolQueue q = queue_.queue(p);
    std::fill(std::begin(columns), std::end(columns), 1u);
    for (const auto& entry : clients_) {
      Client& client = *entry.second;
      if (!client.registered) continue;
      client.weight = weight_of(c.client_weights, client);
      uint32_t& column = columns[q.column_of(client.index)];
      column = std::max(column, client.weight);
    }
    for (uint32_t j = 0; j < q.client_lanes(); ++j) q.set_weight(j, columns[j]);
  }
}

}  // namespace gpuq::daemon
