#include "gpuq/common/log.hpp"

#include <unistd.h>

#include <atomic>
#include <cstdio>

#include "gpuq/common/posix_call.hpp"

namespace gpuq {
namespace {
const char* g_program = "gpuq";
// Atomic: a reload changes it (set_log_level) while other threads log.
std::atomic<LogLevel> g_min_level{LogLevel::kInfo};
}  // namespace

void log_init(const char* program, LogLevel min_level) {
  g_program = program;
  g_min_level.store(min_level, std::memory_order_relaxed);
}

void set_log_level(LogLevel min_level) {
  g_min_level.store(min_level, std::memory_order_relaxed);
}

void log_message(LogLevel level, const char* fmt, ...) {
  if (level < g_min_level.load(std::memory_order_relaxed)) return;
  static const char* const kNames[] = {"debug", "info", "warning", "error"};
  char line[2048];
  int n = std::snprintf(line, sizeof line, "%s[%d] %s: ", g_program, static_cast<int>(getpid()),
                        kNames[static_cast<int>(level)]);
  va_list ap;
  va_start(ap, fmt);
  int m = std::vsnprintf(line + n, sizeof line - static_cast<size_t>(n) - 1, fmt, ap);
  va_end(ap);
  size_t len = static_cast<size_t>(n) + (m < 0 ? 0 : static_cast<size_t>(m));
  if (len > sizeof line - 2) len = sizeof line - 2;
  line[len++] = '\n';
  // One write, so that lines of concurrent processes do not interleave (EINTR is retried). A
  // line that cannot be written has nowhere to be reported: the failure is ignored.
  (void)GPUQ_POSIX_CALL(::write, STDERR_FILENO, line, len);
}

}  // namespace gpuq
