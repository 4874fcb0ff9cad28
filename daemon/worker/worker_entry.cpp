// worker_main(): the command line shared by gpuq-worker and gpuq-gpu-worker.
#include <fcntl.h>

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "gpuq/common/log.hpp"
#include "gpuq/common/posix_call.hpp"
#include "op_backend.hpp"
#include "plugins.hpp"
#include "test_hooks.hpp"
#include "worker_loop.hpp"

namespace gpuq::daemon {
namespace {

template <typename T>
bool parse_number(const char* s, T* out) {
  std::string_view v(s);
  auto r = std::from_chars(v.data(), v.data() + v.size(), *out);
  return r.ec == std::errc() && r.ptr == v.data() + v.size();
}

int usage(const char* program) {
  std::fprintf(stderr,
               "usage: %s --queue-segment NAME --worker-id N --pool-id N "
               "--supervisor-pid PID [--spin-us N] [--job-clock tsc|monotonic]\n"
               "       --private-fd FD [--job-time-limit-ms N] "
               "[--memory-limit-bytes N | "
               "--memory-limit-fraction F] [--plugin PATH]...\n"
               "       %s --list-plugin-ops PATH\n"
               "%s is started by gpuqd; it is not meant to be run by hand.\n",
               program, program, program);
  return 2;
}

}  // namespace

int worker_main(int argc, char** argv, const char* program,
                OpBackend& (*backend_for)(const WorkerOptions&)) {
  if (argc == 3 && std::string_view(argv[1]) == "--list-plugin-ops") {
    return list_plugin_ops_main(argv[2]);
  }
  WorkerOptions o;
  std::vector<std::string> plugins;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    if (i + 1 >= argc) return usage(program);
    const char* v = argv[++i];
    uint32_t n = 0;
    if (a == "--plugin") {
      plugins.emplace_back(v);
    } else if (a == "--queue-segment") {
      o.queue_segment = v;
    } else if (a == "--worker-id" && parse_number(v, &n)) {
      o.worker_id = n;
    } else if (a == "--pool-id" && parse_number(v, &n)) {
      o.pool_id = n;
    } else if (a == "--supervisor-pid" && parse_number(v, &n)) {
      o.supervisor_pid = static_cast<pid_t>(n);
    } else if (a == "--spin-us" && parse_number(v, &n)) {
      o.spin_us = n;
    } else if (a == "--private-fd" && parse_number(v, &n)) {
      o.private_fd = static_cast<int>(n);
    } else if (a == "--job-time-limit-ms" && parse_number(v, &n)) {
      o.job_time_limit_ms = n;
    } else if (a == "--stream-reader-timeout-ms" && parse_number(v, &n)) {
      o.stream_reader_timeout_ms = n;
    } else if (a == "--job-clock" && parse_stamp_clock(v)) {
      o.job_clock = parse_stamp_clock(v).value();
    } else if (a == "--memory-limit-bytes" && parse_number(v, &o.memory_limit_bytes) &&
               o.memory_limit_bytes > 0) {
      o.memory_limit_fraction = 0;
    } else if (a == "--memory-limit-fraction" && parse_number(v, &o.memory_limit_fraction) &&
               o.memory_limit_fraction > 0 && o.memory_limit_fraction <= 1) {
      o.memory_limit_bytes = 0;
    } else {
      return usage(program);
    }
  }
  // F_GETFD is a probe: it fails (EBADF) when the supervisor passed no control socket.
  if (o.queue_segment.empty() || o.supervisor_pid == 0 ||
      !GPUQ_POSIX_CALL(::fcntl, o.control_fd, F_GETFD)) {
    return usage(program);
  }
  static char name[48];
  std::snprintf(name, sizeof name, "%s[%u]", program, o.worker_id);
  log_init(name, LogLevel::kInfo);
  if (int status = run_worker_test_hooks(o.worker_id); status >= 0) return status;
  // Plug-ins, before the backend starts and the worker reports ready; ids follow the order of
  // --plugin, which is the config's (the supervisor's rule too).
  for (const auto& path : plugins) {
    auto ops = load_plugin(path);
    Result<void> added = ops ? add_plugin_ops(std::move(*ops)) : Result<void>(ops.error());
    if (!added) {
      GPUQ_LOG_ERROR("%s", added.error().message().c_str());
      return 1;
    }
  }
  return run_worker(o, backend_for(o));
}

}  // namespace gpuq::daemon
