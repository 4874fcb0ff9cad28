#include "gpuq/common/fault_point.hpp"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "gpuq/common/posix_call.hpp"

namespace gpuq::fault {

namespace detail {
std::atomic<bool> g_enabled{false};
}  // namespace detail

namespace {

struct Armed {
  std::mutex mutex;
  std::string name;
  std::string once_path;
  unsigned long long remaining = 0;  // hits left before the fault fires
};

Armed& armed() {
  static Armed a;
  return a;
}

// Reads the settings before main(), so that a point reached by the first call already works.
struct ReadAtStart {
  ReadAtStart() { configure_from_env(); }
} read_at_start;

}  // namespace

void configure_from_env() noexcept {
  Armed& a = armed();
  std::lock_guard lock(a.mutex);
  const char* spec = std::getenv("GPUQ_FAULT_POINT");
  if (spec == nullptr || *spec == '\0') {
    detail::g_enabled.store(false, std::memory_order_relaxed);
    return;
  }
  std::string s(spec);
  unsigned long long n = 1;
  if (auto colon = s.rfind(':'); colon != std::string::npos) {
    char* end = nullptr;
    n = std::strtoull(s.c_str() + colon + 1, &end, 10);
    if (end == s.c_str() + colon + 1 || *end != '\0' || n == 0) n = 1;
    s.resize(colon);
  }
  a.name = s;
  a.remaining = n;
  const char* once = std::getenv("GPUQ_FAULT_ONCE");
  a.once_path = once != nullptr ? once : "";
  detail::g_enabled.store(true, std::memory_order_relaxed);
}

void detail::hit(const char* name) noexcept {
  Armed& a = armed();
  {
    std::lock_guard lock(a.mutex);
    if (a.remaining == 0 || a.name != name) return;
    if (--a.remaining != 0) return;
    if (!a.once_path.empty()) {
      // The file claims the fault for one process. EEXIST: another process took it already;
      // any other failure leaves the fault unclaimed too, so this process does not fire it.
      auto fd = GPUQ_POSIX_CALL(::open, a.once_path.c_str(),
                                O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
      if (!fd) return;
      // Only the file's existence matters; a failed close changes nothing of it.
      (void)::close(static_cast<int>(*fd));
    }
  }
  // SIGKILL to itself cannot fail, and does not return.
  (void)::raise(SIGKILL);
}

}  // namespace gpuq::fault
