#include "gpuq/common/shm_layout.hpp"

#include <string>

namespace gpuq {

namespace {

// One read of a field that another process may be writing: the value is used from a local copy
// after it has been checked, never read again from shared memory.
template <typename T>
T read_once(const T& field) noexcept {
  return *static_cast<const volatile T*>(&field);
}

QueueLayout read_header_fields(const QueueHeader& h) noexcept {
  QueueLayout l;
  l.pools_offset = read_once(h.pools_offset);
  l.workers_offset = read_once(h.workers_offset);
  l.clients_offset = read_once(h.clients_offset);
  l.pool_count = read_once(h.pool_count);
  l.worker_count = read_once(h.worker_count);
  l.max_clients = read_once(h.max_clients);
  return l;
}

// Reads the pool array at l.pools_offset (which the caller trusts or has checked).
void read_pools(const char* base, QueueLayout& l) noexcept {
  const auto* pools = reinterpret_cast<const PoolShm*>(base + l.pools_offset);
  for (uint32_t p = 0; p < l.pool_count; ++p) {
    l.pools[p] = {read_once(pools[p].queue_offset), read_once(pools[p].capacity),
                  read_once(pools[p].client_lanes), read_once(pools[p].first_worker),
                  read_once(pools[p].worker_count)};
  }
}

}  // namespace

QueueView::QueueView(void* base) noexcept : base_(static_cast<char*>(base)) {
  layout_ = read_header_fields(header());
  if (layout_.pool_count > kMaxPools) layout_.pool_count = kMaxPools;
  if (layout_.pools_offset == 0) return;  // not laid out yet (the supervisor, before writing it)
  read_pools(base_, layout_);
}

Result<QueueView> QueueView::attach(void* base, uint64_t mapped_bytes) {
  auto bad = [](const std::string& what) {
    return Error(ErrorCode::kProtocolMismatch, "queue segment: " + what);
  };
  if (mapped_bytes < sizeof(QueueHeader)) return bad("smaller than its header");
  const QueueHeader& h = *static_cast<const QueueHeader*>(base);
  if (read_once(h.magic) != kQueueMagic) return bad("bad magic");
  if (const uint32_t version = read_once(h.layout_version); version != kLayoutVersion) {
    return bad("layout version " + std::to_string(version) + ", this build knows " +
               std::to_string(kLayoutVersion));
  }
  QueueLayout l = read_header_fields(h);
  if (l.pool_count == 0 || l.pool_count > kMaxPools) return bad("bad pool count");
  if (l.max_clients > kMaxClients) return bad("bad client count");
  if (l.worker_count > kMaxWorkers) return bad("bad worker count");
  // [offset, offset + count * size) lies inside the mapping; no overflow (counts are 32-bit,
  // sizes small, so count * size fits in 64 bits).
  auto inside = [&](uint64_t offset, uint64_t count, uint64_t size) {
    return offset % 64 == 0 && offset <= mapped_bytes && count * size <= mapped_bytes - offset;
  };
  if (!inside(l.pools_offset, l.pool_count, sizeof(PoolShm)) ||
      !inside(l.workers_offset, l.worker_count, sizeof(WorkerShm)) ||
      !inside(l.clients_offset, l.max_clients, sizeof(ClientShm))) {
    return bad("an array lies outside the segment");
  }
  read_pools(static_cast<const char*>(base), l);
  QueueView v;
  v.base_ = static_cast<char*>(base);
  v.layout_ = l;
  for (uint32_t p = 0; p < l.pool_count; ++p) {
    const QueueLayout::Pool& lp = l.pools[p];
    if (lp.capacity == 0 || lp.capacity > JobRing::kMaxCapacity ||
        !PoolQueue::valid_client_lanes(lp.client_lanes) ||
        !inside(lp.queue_offset, 1, PoolQueue::bytes_for(lp.capacity, lp.client_lanes))) {
      return bad("the queue of pool " + std::to_string(p) + " lies outside the segment");
    }
    if (lp.first_worker > l.worker_count || lp.worker_count > l.worker_count - lp.first_worker) {
      return bad("the workers of pool " + std::to_string(p) + " lie outside the worker array");
    }
    const PoolQueue q = v.queue(p);
    bool agree = read_once(q.header().capacity) == lp.capacity &&
                 read_once(q.header().client_lanes) == lp.client_lanes;
    for (uint32_t i = 0; agree && i < q.lane_count(); ++i) {
      agree = read_once(q.lane(i).header().capacity) == lp.capacity;
    }
    if (!agree) {
      return bad("the queue of pool " + std::to_string(p) + " disagrees on its geometry");
    }
  }
  return v;
}

void QueueView::restore_shared_layout() const noexcept {
  QueueHeader& h = header();
  h.pools_offset = layout_.pools_offset;
  h.workers_offset = layout_.workers_offset;
  h.clients_offset = layout_.clients_offset;
  h.pool_count = layout_.pool_count;
  h.worker_count = layout_.worker_count;
  h.max_clients = layout_.max_clients;
  h.magic = kQueueMagic;
  h.layout_version = kLayoutVersion;
  for (uint32_t p = 0; p < layout_.pool_count; ++p) {
    const QueueLayout::Pool& lp = layout_.pools[p];
    PoolShm& ps = pool(p);
    ps.queue_offset = lp.queue_offset;
    ps.capacity = lp.capacity;
    ps.client_lanes = lp.client_lanes;
    ps.first_worker = lp.first_worker;
    ps.worker_count = lp.worker_count;
    const PoolQueue q = queue(p);
    q.header().capacity = lp.capacity;
    q.header().client_lanes = lp.client_lanes;
    for (uint32_t i = 0; i < q.lane_count(); ++i) q.lane(i).header().capacity = lp.capacity;
  }
}

}  // namespace gpuq
