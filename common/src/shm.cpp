#include "gpuq/common/shm.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <cstring>
#include <utility>

#include "gpuq/common/posix_call.hpp"

namespace bip = boost::interprocess;

namespace gpuq {

struct QueueSegment::State {
  bip::shared_memory_object object;
  bip::mapped_region region;
};

QueueSegment::QueueSegment() = default;
QueueSegment::QueueSegment(QueueSegment&&) noexcept = default;
QueueSegment& QueueSegment::operator=(QueueSegment&&) noexcept = default;
QueueSegment::~QueueSegment() = default;

Result<QueueSegment> QueueSegment::create(const std::string& name, uint64_t bytes, unsigned mode) {
  try {
    auto st = std::make_unique<State>();
    bip::permissions perm(mode);
    st->object = bip::shared_memory_object(bip::create_only, name.c_str(), bip::read_write, perm);
    // Boost applies the umask on creation; set the mode explicitly so group access is exact.
    if (auto r = GPUQ_POSIX_CALL(::fchmod, st->object.get_mapping_handle().handle, mode); !r) {
      return Error(r.error().code(),
                   "cannot create shared memory segment '" + name + "': " + r.error().message());
    }
    st->object.truncate(static_cast<bip::offset_t>(bytes));
    st->region = bip::mapped_region(st->object, bip::read_write);
    QueueSegment s;
    s.state_ = std::move(st);
    return s;
  } catch (const bip::interprocess_exception& e) {
    return Error(ErrorCode::kSystemError,
                 "cannot create shared memory segment '" + name + "': " + e.what());
  }
}

Result<QueueSegment> QueueSegment::open(const std::string& name) {
  try {
    auto st = std::make_unique<State>();
    st->object = bip::shared_memory_object(bip::open_only, name.c_str(), bip::read_write);
    st->region = bip::mapped_region(st->object, bip::read_write);
    QueueSegment s;
    s.state_ = std::move(st);
    return s;
  } catch (const bip::interprocess_exception& e) {
    ErrorCode code = e.get_error_code() == bip::security_error ? ErrorCode::kPermissionDenied
                                                               : ErrorCode::kDisconnected;
    return Error(code, "cannot open shared memory segment '" + name + "': " + e.what());
  }
}

bool QueueSegment::remove(const std::string& name) {
  return bip::shared_memory_object::remove(name.c_str());
}

void* QueueSegment::address() const noexcept {
  return state_ ? state_->region.get_address() : nullptr;
}
uint64_t QueueSegment::size() const noexcept {
  return state_ ? state_->region.get_size() : 0;
}

namespace {
// Unmaps a MemfdSegment's mapping, if it has one. munmap of a mapping this class made fails only
// for an address or length that is not one (a bug); a destructor has no one to report it to, so
// the result is ignored.
void unmap(void* address, uint64_t size) noexcept {
  if (address != nullptr) (void)::munmap(address, size);
}
}  // namespace

MemfdSegment::MemfdSegment(MemfdSegment&& o) noexcept
    : fd_(std::move(o.fd_)),
      address_(std::exchange(o.address_, nullptr)),
      size_(std::exchange(o.size_, 0)) {}

MemfdSegment& MemfdSegment::operator=(MemfdSegment&& o) noexcept {
  if (this != &o) {
    unmap(address_, size_);
    fd_ = std::move(o.fd_);
    address_ = std::exchange(o.address_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

MemfdSegment::~MemfdSegment() {
  unmap(address_, size_);
}

Result<MemfdSegment> MemfdSegment::create(const std::string& debug_name, uint64_t bytes) {
  auto fd = GPUQ_POSIX_CALL(::memfd_create, debug_name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (!fd) return fd.error();
  UniqueFd owned(static_cast<int>(*fd));
  if (auto r = GPUQ_POSIX_CALL(::ftruncate, owned.get(), static_cast<off_t>(bytes)); !r) {
    return r.error();
  }
  if (auto r = GPUQ_POSIX_CALL(::fcntl, owned.get(), F_ADD_SEALS,
                               F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
      !r) {
    return r.error();
  }
  return map(std::move(owned), bytes);
}

Result<MemfdSegment> MemfdSegment::map(UniqueFd fd, uint64_t expected_bytes) {
  struct stat st {};
  if (auto r = GPUQ_POSIX_CALL(::fstat, fd.get(), &st); !r) return r.error();
  if (static_cast<uint64_t>(st.st_size) < expected_bytes) {
    return Error(ErrorCode::kInvalidArgument, "segment is " + std::to_string(st.st_size) +
                                                  " bytes, expected " +
                                                  std::to_string(expected_bytes));
  }
  auto seals = GPUQ_POSIX_CALL(::fcntl, fd.get(), F_GET_SEALS);
  if (!seals) return seals.error();
  if ((*seals & F_SEAL_SHRINK) == 0) {
    return Error(ErrorCode::kInvalidArgument, "segment is not sealed against shrinking");
  }
  auto p = GPUQ_MMAP_CALL(::mmap, nullptr, expected_bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                          fd.get(), 0);
  if (!p) return p.error();
  MemfdSegment s;
  s.fd_ = std::move(fd);
  s.address_ = *p;
  s.size_ = expected_bytes;
  return s;
}

}  // namespace gpuq
