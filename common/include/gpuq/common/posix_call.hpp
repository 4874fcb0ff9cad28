// One wrapper for every POSIX call: retries EINTR, and on failure produces an Error that names
// the call, errno and its text, and the place in the source.
//
//   auto fd = GPUQ_POSIX_CALL(::open, path, O_RDONLY);   // Result<long>
//   if (!fd) return fd.error();
#pragma once

#include <cerrno>
#include <cstring>
#include <string>

#include "gpuq/error.hpp"

namespace gpuq::detail {

// Error for a failed system call `call` with `err` (an errno value) at file:line.
inline Error system_error(const char* call, int err, const char* file, int line) {
  std::string msg = std::string(call) + " failed: " + std::strerror(err) + " (errno " +
                    std::to_string(err) + ", " + file + ":" + std::to_string(line) + ")";
  ErrorCode code = ErrorCode::kSystemError;
  if (err == EACCES || err == EPERM) code = ErrorCode::kPermissionDenied;
  if (err == ENOMEM) code = ErrorCode::kOutOfMemory;
  return Error(code, std::move(msg));
}

// Calls fn(args...) until it does not fail with EINTR. A return value of -1 is failure.
template <typename Fn, typename... Args>
Result<long> posix_call(const char* name, const char* file, int line, Fn&& fn, Args&&... args) {
  for (;;) {
    long r = static_cast<long>(fn(args...));
    if (r != -1) return r;
    if (errno == EINTR) continue;
    return system_error(name, errno, file, line);
  }
}

}  // namespace gpuq::detail

#define GPUQ_POSIX_CALL(fn, ...) \
  ::gpuq::detail::posix_call(#fn, __FILE__, __LINE__, fn, __VA_ARGS__)
#define GPUQ_SYSTEM_ERROR(name) ::gpuq::detail::system_error(name, errno, __FILE__, __LINE__)
