// Checked system calls: every system call in gpuq goes through one of the macros below. Each
// knows how its kind of call reports failure, and on failure returns an Error that names the
// call, the error number and its text, and the place in the source:
//
//   "open failed: No such file or directory (errno 2, /src/gpuq/common/src/shm.cpp:97)"
//
// The code follows the error number: EACCES and EPERM give kPermissionDenied, ENOMEM gives
// kOutOfMemory, any other kSystemError. After a failure errno holds the call's error number
// (for the forms that return it, too), so a caller may still branch on it.
//
// One macro per convention; fn is the function (::open, pthread_create), then its arguments:
//
//   GPUQ_POSIX_CALL(fn, args...)      -1 and errno: open, read, socket, epoll_ctl, fork, ...
//       -> Result<long>, the call's return value.
//       auto fd = GPUQ_POSIX_CALL(::open, path, O_RDONLY | O_CLOEXEC);
//       if (auto r = GPUQ_POSIX_CALL(::epoll_ctl, ep, EPOLL_CTL_ADD, fd, &ev); !r) ...
//
//   GPUQ_ERRNUM_CALL(fn, args...)     returns 0, or the error number itself (errno untouched):
//       pthread_*, posix_spawn*, posix_fallocate, posix_memalign, getpwnam_r and the like.
//       -> Result<void>.
//       if (auto r = GPUQ_ERRNUM_CALL(pthread_setname_np, pthread_self(), "worker"); !r) ...
//
//   GPUQ_NEG_ERRNO_CALL(fn, args...)  returns >= 0, or a negative error number (-ENOENT):
//       libsystemd's sd_notify, sd_watchdog_enabled. -> Result<long>, the value returned.
//       auto sent = GPUQ_NEG_ERRNO_CALL(sd_notify, 0, "READY=1");
//
//   GPUQ_NONNULL_CALL(fn, args...)    a null pointer and errno: fopen, fdopen, opendir,
//       realpath. -> Result<T*>, the pointer returned. Not for calls where null also means
//       "nothing" rather than failure (readdir, getenv).
//       auto file = GPUQ_NONNULL_CALL(std::fopen, path, "rb");
//
//   GPUQ_MMAP_CALL(fn, args...)       MAP_FAILED and errno: mmap, mremap. -> Result<void*>.
//       auto p = GPUQ_MMAP_CALL(::mmap, nullptr, n, PROT_READ, MAP_SHARED, fd, 0);
//
//   GPUQ_DL_CALL(fn, args...)         a null pointer, the reason from dlerror(): dlopen, dlsym.
//       -> Result<void*>; the message is "dlopen failed: <dlerror's text> (file:line)", the
//       code kSystemError. A symbol whose value is null counts as a failure.
//       auto lib = GPUQ_DL_CALL(::dlopen, path, RTLD_NOW | RTLD_LOCAL);
//
//   GPUQ_SYSTEM_ERROR(name)           the Error for errno as it is now, for a call checked by
//       hand (one whose failure is not a single return value).
//
// EINTR: every form except GPUQ_DL_CALL calls fn again, with the same arguments, while it fails
// with EINTR. A call with a relative timeout (poll, epoll_wait) so starts its full timeout
// again; nanosleep(&t, &t) resumes with what is left. close() is never retried (Linux releases
// the descriptor even when close reports EINTR, and a retry could close a descriptor another
// thread has just been given): call it directly, once, and say why its result is ignored.
//
// Not for the code between fork() and exec() in a child of a multi-threaded process: a failure
// builds a std::string, which is not async-signal-safe. Calls there stay raw.
//
// Header-only. Success allocates nothing; failure allocates the message. No exceptions of its
// own (std::bad_alloc aside). Thread-safe: the error text comes from strerror_r.
#pragma once

#include <dlfcn.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <type_traits>

#include "gpuq/error.hpp"

namespace gpuq::detail {

// The name a message gives a call: "open" for "::open", "fopen" for "std::fopen".
constexpr const char* call_name(const char* spelled) noexcept {
  if (spelled[0] == ':' && spelled[1] == ':') return spelled + 2;
  if (std::char_traits<char>::compare(spelled, "std::", 5) == 0) return spelled + 5;
  return spelled;
}

// strerror_r comes in two kinds: GNU (returns the text) and XSI (fills buf, returns 0).
inline const char* errno_text(const char* gnu_text, const char* /*buf*/) noexcept {
  return gnu_text;
}
inline const char* errno_text(int xsi_result, const char* buf) noexcept {
  return xsi_result == 0 ? buf : "unknown error";
}

// The ErrorCode for error number `err`.
constexpr ErrorCode error_code_for_errno(int err) noexcept {
  if (err == EACCES || err == EPERM) return ErrorCode::kPermissionDenied;
  if (err == ENOMEM) return ErrorCode::kOutOfMemory;
  return ErrorCode::kSystemError;
}

// "<file>:<line>)" appended to msg.
inline void append_place(std::string& msg, const char* file, int line) {
  msg += file;
  msg += ':';
  msg += std::to_string(line);
  msg += ')';
}

// Error for a failed system call `call` with `err` (an errno value) at file:line:
// "<call> failed: <strerror text> (errno <err>, <file>:<line>)". Leaves errno as it found it.
inline Error system_error(const char* call, int err, const char* file, int line) {
  const int saved = errno;
  char buf[128];
  std::string msg = call_name(call);
  msg += " failed: ";
  msg += errno_text(strerror_r(err, buf, sizeof buf), buf);
  msg += " (errno ";
  msg += std::to_string(err);
  msg += ", ";
  append_place(msg, file, line);
  errno = saved;
  return Error(error_code_for_errno(err), std::move(msg));
}

// -1 and errno. Calls fn(args...) until it does not fail with EINTR.
template <typename Fn, typename... Args>
Result<long> posix_call(const char* name, const char* file, int line, Fn&& fn, Args&&... args) {
  for (;;) {
    const long r = static_cast<long>(fn(args...));
    if (r != -1) return r;
    if (errno == EINTR) continue;
    return system_error(name, errno, file, line);
  }
}

// 0, or an error number returned. On failure errno is set to that number.
template <typename Fn, typename... Args>
Result<void> errnum_call(const char* name, const char* file, int line, Fn&& fn, Args&&... args) {
  for (;;) {
    const int err = static_cast<int>(fn(args...));
    if (err == 0) return {};
    if (err == EINTR) continue;
    errno = err;
    return system_error(name, err, file, line);
  }
}

// >= 0, or a negative error number returned. On failure errno is set to that number.
template <typename Fn, typename... Args>
Result<long> neg_errno_call(const char* name, const char* file, int line, Fn&& fn, Args&&... args) {
  for (;;) {
    const long r = static_cast<long>(fn(args...));
    if (r >= 0) return r;
    if (r == -EINTR) continue;
    errno = static_cast<int>(-r);
    return system_error(name, static_cast<int>(-r), file, line);
  }
}

// A null pointer and errno. Result<T*> for a call that returns T*.
template <typename Fn, typename... Args>
auto nonnull_call(const char* name, const char* file, int line, Fn&& fn, Args&&... args)
    -> Result<decltype(fn(args...))> {
  static_assert(std::is_pointer_v<decltype(fn(args...))>,
                "GPUQ_NONNULL_CALL: fn returns no pointer");
  for (;;) {
    auto r = fn(args...);
    if (r != nullptr) return r;
    if (errno == EINTR) continue;
    return system_error(name, errno, file, line);
  }
}

// `failure` (MAP_FAILED for mmap) and errno.
template <typename R, typename Fn, typename... Args>
Result<R> failure_value_call(const char* name, const char* file, int line, R failure, Fn&& fn,
                             Args&&... args) {
  for (;;) {
    R r = fn(args...);
    if (r != failure) return r;
    if (errno == EINTR) continue;
    return system_error(name, errno, file, line);
  }
}

// A null pointer, and the reason in dlerror() (errno means nothing for the dl* calls).
template <typename Fn, typename... Args>
Result<void*> dl_call(const char* name, const char* file, int line, Fn&& fn, Args&&... args) {
  (void)dlerror();  // clears an earlier failure's text, so the text read below is this call's
  void* r = fn(args...);
  if (r != nullptr) return r;
  const char* why = dlerror();
  std::string msg = call_name(name);
  msg += " failed: ";
  msg += why != nullptr ? why : "null result, no reason given";
  msg += " (";
  append_place(msg, file, line);
  return Error(ErrorCode::kSystemError, std::move(msg));
}

}  // namespace gpuq::detail

#define GPUQ_POSIX_CALL(fn, ...) \
  ::gpuq::detail::posix_call(#fn, __FILE__, __LINE__, fn __VA_OPT__(, ) __VA_ARGS__)
#define GPUQ_ERRNUM_CALL(fn, ...) \
  ::gpuq::detail::errnum_call(#fn, __FILE__, __LINE__, fn __VA_OPT__(, ) __VA_ARGS__)
#define GPUQ_NEG_ERRNO_CALL(fn, ...) \
  ::gpuq::detail::neg_errno_call(#fn, __FILE__, __LINE__, fn __VA_OPT__(, ) __VA_ARGS__)
#define GPUQ_NONNULL_CALL(fn, ...) \
  ::gpuq::detail::nonnull_call(#fn, __FILE__, __LINE__, fn __VA_OPT__(, ) __VA_ARGS__)
#define GPUQ_MMAP_CALL(fn, ...)                                           \
  ::gpuq::detail::failure_value_call(#fn, __FILE__, __LINE__, MAP_FAILED, \
                                     fn __VA_OPT__(, ) __VA_ARGS__)
#define GPUQ_DL_CALL(fn, ...) \
  ::gpuq::detail::dl_call(#fn, __FILE__, __LINE__, fn __VA_OPT__(, ) __VA_ARGS__)
#define GPUQ_SYSTEM_ERROR(name) ::gpuq::detail::system_error(name, errno, __FILE__, __LINE__)
