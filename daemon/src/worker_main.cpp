// gpuq-worker: started by gpuqd (fork+exec), never by hand.
#include <fcntl.h>

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "gpuq/common/log.hpp"
#include "op_backend.hpp"
#include "test_hooks.hpp"
#include "worker.hpp"

namespace {

bool parse_u32(const char* s, uint32_t* out) {
  std::string_view v(s);
  auto r = std::from_chars(v.data(), v.data() + v.size(), *out);
  return r.ec == std::errc() && r.ptr == v.data() + v.size();
}

int usage() {
  std::fprintf(stderr,
               "usage: gpuq-worker --queue-segment NAME --worker-id N --pool-id N "
               "--supervisor-pid PID [--spin-us N]\n"
               "gpuq-worker is started by gpuqd; it is not meant to be run by hand.\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  gpuq::daemon::WorkerOptions o;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    if (i + 1 >= argc) return usage();
    const char* v = argv[++i];
    uint32_t n = 0;
    if (a == "--queue-segment") {
      o.queue_segment = v;
    } else if (a == "--worker-id" && parse_u32(v, &n)) {
      o.worker_id = n;
    } else if (a == "--pool-id" && parse_u32(v, &n)) {
      o.pool_id = n;
    } else if (a == "--supervisor-pid" && parse_u32(v, &n)) {
      o.supervisor_pid = static_cast<pid_t>(n);
    } else if (a == "--spin-us" && parse_u32(v, &n)) {
      o.spin_us = n;
    } else {
      return usage();
    }
  }
  if (o.queue_segment.empty() || o.supervisor_pid == 0 || fcntl(o.control_fd, F_GETFD) == -1) {
    return usage();
  }
  static char name[32];
  std::snprintf(name, sizeof name, "gpuq-worker[%u]", o.worker_id);
  gpuq::log_init(name, gpuq::LogLevel::kInfo);
  if (int status = gpuq::daemon::run_worker_test_hooks(o.worker_id); status >= 0) return status;
  return gpuq::daemon::run_worker(o, gpuq::daemon::cpu_backend());
}
