// The supervisor's clients: accepting connections on the control socket (and refusing them when
// the uid is not allowed or the process is out of descriptors), reading their messages, giving a
// client that says Hello an index, a session and its own payload segment, and, when it leaves
// (its socket closes or its pidfd says it exited), cancelling its queued jobs and holding its
// index back until no ring can still name it. What a message asks for is the Supervisor's
// business: the registry hands each one over.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config.hpp"
#include "event_loop.hpp"
#include "gpuq/common/protocol.hpp"
#include "gpuq/common/shm.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "gpuq/common/unique_fd.hpp"

namespace gpuq::daemon {

struct Client {
  uint64_t id = 0;  // the connection's id (epoll tags)
  UniqueFd fd;
  UniqueFd pidfd;  // the peer process (pidfd_open), when the kernel has it
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  bool registered = false;  // said Hello and got an index, a session and a segment
  uint32_t index = 0;
  uint64_t session = 0;
  std::string name;
  MemfdSegment segment;
  ClientSegmentGeometry geometry{};
  uint32_t slot_count = 0;
  bool keep_running_jobs = false;  // Hello: its running jobs are not cancelled when it leaves
  std::vector<gid_t> groups;       // its primary and supplementary groups, at registration
  uint32_t weight = 1;             // config client_weights (ClientRegistry::apply_weights)
  // Its ClientShm::submitted counters as last counted (jobs_submitted): the counters are in
  // memory the client writes, so only their rises are added, and the total never falls.
  mutable uint64_t submitted_seen[kMaxPools] = {};
};

class ClientRegistry {
 public:
  ClientRegistry(const Config& config, QueueView& queue, EventLoop& loop);

  // Each client costs three descriptors (socket, pidfd, segment memfd): raises the soft
  // RLIMIT_NOFILE to the hard one, warns when even that is too few for max_clients, and keeps
  // a reserve descriptor for refusing clients when they run out.
  void raise_descriptor_limit(uint64_t worker_count);

  // Handlers: a message from a connected client; a client that registered (segment made and
  // index taken; the handler sends Welcome); one that is leaving (its jobs are cancelled and
  // its shared state cleared; the handler tells the workers).
  using MessageHandler = std::function<void(Client&, Message&)>;
  void set_handlers(MessageHandler on_message, std::function<void(Client&)> on_leaving) {
    on_message_ = std::move(on_message);
    on_leaving_ = std::move(on_leaving);
  }

  // Event-loop handlers.
  void on_accept(int listen_fd);
  void on_readable(uint64_t id, uint32_t events);
  void on_exit(uint64_t id);  // the pidfd: the client process has exited

  // Hello: registers `client` (index, session, segment, ClientShm). `draining`: refused with
  // ShuttingDown. Errors: InvalidArgument (a bad Hello), TooManyClients, the segment's.
  Result<void> admit(Client& client, const std::string& hello_body, bool draining);
  void close(uint64_t id);

  // Indexes of departed clients whose last ring entries have all been popped become reusable
  // (called on the timer).
  void release_retired();
  size_t retiring() const { return retired_.size(); }
  uint32_t registered() const { return registered_; }
  // A client index in use by a connected client.
  bool index_in_use(uint32_t index) const {
    return index < index_in_use_.size() && index_in_use_[index];
  }
  // Jobs pushed to `pool`, as the clients count them (in memory they write): the sum of every
  // rise of each client's counter seen so far, so it never falls, whatever a client writes.
  uint64_t jobs_submitted(uint32_t pool) const;

  // The connection `id` (registered or not), or null when it has closed.
  Client* find(uint64_t id) {
    auto it = clients_.find(id);
    return it == clients_.end() ? nullptr : it->second.get();
  }

  // The registered client holding `index`, or null.
  const Client* by_index(uint32_t index) const {
    return index < by_index_.size() ? by_index_[index] : nullptr;
  }

  // A client's jobs queued (SUBMITTED) and running, in all and per pool (by pool id).
  struct JobCounts {
    const Client* client = nullptr;
    uint64_t queued = 0, running = 0;
    std::vector<std::pair<uint64_t, uint64_t>> pools;  // queued, running
  };
  // The clients with jobs queued or running, most queued first (then most running), at most
  // `limit`, counted over `pool_count` pools from their slots' state words (which the clients
  // write: what a client claims about itself). For status and metrics: reads every slot.
  std::vector<JobCounts> busiest(size_t pool_count, size_t limit) const;

  // Each registered client's weight from the config's `client_weights`, and each pool's lane
  // weights from them (a column shared by clients of different weights gets the largest).
  // Called as clients come and go, and after a reload.
  void apply_weights();

  // fn(client) for every registered client.
  template <typename Fn>
  void for_each(Fn&& fn) const {
    for (const auto& [id, c] : clients_) {
      if (c->registered) fn(*c);
    }
  }

 private:
  bool authorized(uid_t uid, gid_t gid) const;
  bool refuse_for_descriptors(int listen_fd);
  bool index_free(uint32_t index) const;
  void unregister(Client& client);

  // A client index whose last entries may still sit in the lanes: reusable once every lane's
  // head has passed the tail it had when the client left.
  struct Retired {
    uint32_t index;
    uint64_t tails[kMaxPools][PoolQueue::kMaxLanes];
  };

  const Config& config_;
  QueueView& queue_;
  EventLoop& loop_;
  MessageHandler on_message_;
  std::function<void(Client&)> on_leaving_;
  std::map<uint64_t, std::unique_ptr<Client>> clients_;
  std::vector<Retired> retired_;
  std::vector<bool> index_in_use_;
  std::vector<const Client*> by_index_;  // the registered client holding each index
  uint64_t next_id_ = 1;
  uint64_t next_session_ = 1;
  uint32_t next_index_ = 0;
  uint32_t registered_ = 0;
  // Adds the rise of `client`'s counters since last counted to submitted_counted_.
  void count_submitted(const Client& client, uint32_t pool) const;
  mutable uint64_t submitted_counted_[kMaxPools] = {};
  // Held open so that a connection can still be accepted, told why it is refused and closed
  // when the process is out of descriptors (EMFILE), instead of staying in the backlog.
  UniqueFd reserve_fd_;
  uint64_t descriptor_limit_ = 0;  // RLIMIT_NOFILE soft limit after raise_descriptor_limit
};

}  // namespace gpuq::daemon
