// gpuq public vocabulary: the one error enum every layer uses, and a small result type.
//
// This header has no dependencies beyond the standard library. It is the lowest layer of the
// project: the wire format, the shared-memory job slots, the daemon and the client library all
// speak in these codes, so a status written by a worker reaches the user unchanged. It lives in
// common/ and is installed with the client's public headers (<prefix>/include/gpuq/error.hpp).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace gpuq {

// Every failure in gpuq is one of these. The numeric values are part of the wire format and of
// the C ABI (gpuq.h mirrors them); append new codes, never renumber.
enum class ErrorCode : int32_t {
  kOk = 0,
  kInvalidArgument = 1,    // a field of a request is malformed; the message names the field
  kUnknownOp = 2,          // no op of that name (or id) is registered
  kUnknownPool = 3,        // no pool of that name
  kQueueFull = 4,          // try_submit: the pool's ring or this client's share of it is full
  kTimeout = 5,            // a deadline passed before the call could complete
  kCancelled = 6,          // the job was cancelled (a running one: see Job::cancel)
  kExpired = 7,            // the job's deadline passed while it was still queued
  kWorkerDied = 8,         // the worker running the job exited
  kDisconnected = 9,       // the daemon is gone (or restarted); reconnect
  kProtocolMismatch = 10,  // client and daemon speak different protocol versions
  kPermissionDenied = 11,  // the peer is not an allowed user or group
  kOutOfMemory = 12,       // no room in the payload segment (or device memory)
  kNotFound = 13,          // no such job, buffer or object
  kShuttingDown = 14,      // the daemon is draining and accepts no new jobs
  kForkedClient = 15,      // this Client was created by the parent of a fork()
  kNoDevice = 16,          // the pool has no usable device
  kInternal = 17,          // a bug in gpuq; the message says where
  kSystemError = 18,       // a system call failed; the message names it and errno
  kNotCancellable = 19,    // cancel: the job has already finished
  kTooManyClients = 20,    // the daemon serves its configured maximum of clients
  kOpFailed = 21,          // the op itself reported failure; the message says why
  kTimedOut = 22,          // the job ran past its time limit and was stopped
  // The pool has had no ready worker for pool_down_fail_ms (its workers keep failing to start):
  // its queued jobs fail, and new ones at once, until a worker is ready again. The message
  // names the pool and its last worker's exit.
  kPoolDown = 23,
};

// Stable name of a code ("QueueFull"), for logs and JSON. Thread-safe, never fails.
constexpr std::string_view error_code_name(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kOk:
      return "Ok";
    case ErrorCode::kInvalidArgument:
      return "InvalidArgument";
    case ErrorCode::kUnknownOp:
      return "UnknownOp";
    case ErrorCode::kUnknownPool:
      return "UnknownPool";
    case ErrorCode::kQueueFull:
      return "QueueFull";
    case ErrorCode::kTimeout:
      return "Timeout";
    case ErrorCode::kCancelled:
      return "Cancelled";
    case ErrorCode::kExpired:
      return "Expired";
    case ErrorCode::kWorkerDied:
      return "WorkerDied";
    case ErrorCode::kDisconnected:
      return "Disconnected";
    case ErrorCode::kProtocolMismatch:
      return "ProtocolMismatch";
    case ErrorCode::kPermissionDenied:
      return "PermissionDenied";
    case ErrorCode::kOutOfMemory:
      return "OutOfMemory";
    case ErrorCode::kNotFound:
      return "NotFound";
    case ErrorCode::kShuttingDown:
      return "ShuttingDown";
    case ErrorCode::kForkedClient:
      return "ForkedClient";
    case ErrorCode::kNoDevice:
      return "NoDevice";
    case ErrorCode::kInternal:
      return "Internal";
    case ErrorCode::kSystemError:
      return "SystemError";
    case ErrorCode::kNotCancellable:
      return "NotCancellable";
    case ErrorCode::kTooManyClients:
      return "TooManyClients";
    case ErrorCode::kOpFailed:
      return "OpFailed";
    case ErrorCode::kTimedOut:
      return "TimedOut";
    case ErrorCode::kPoolDown:
      return "PoolDown";
  }
  return "Unknown";
}

// Largest value of ErrorCode; codes read from shared memory above it are themselves invalid.
inline constexpr int32_t kMaxErrorCode = static_cast<int32_t>(ErrorCode::kPoolDown);

// An error value: a code and a human-readable message that says what was wrong.
class Error {
 public:
  Error() = default;
  Error(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}

  ErrorCode code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_; }
  // "QueueFull: pool 'cpu' ring is full (20 of 20 cells)".
  std::string to_string() const {
    std::string s(error_code_name(code_));
    if (!message_.empty()) s += ": " + message_;
    return s;
  }

 private:
  ErrorCode code_ = ErrorCode::kInternal;
  std::string message_;
};

namespace detail {
// Result misuse is a bug, not an error: it prints what was misused (and the error a value was
// asked of) to stderr and aborts. Never returns, never throws.
[[noreturn]] inline void result_misuse(const char* what, const Error* error) noexcept {
  std::fprintf(stderr, "gpuq: bug: %s%s%s\n", what, error ? ": " : "",
               error ? error->to_string().c_str() : "");
  std::abort();
}
}  // namespace detail

// Result<T>: either a T or an Error (a minimal std::expected for C++20).
// Accessing value() of an error result, or error() of a value, is a bug and aborts
// (detail::result_misuse); it never throws.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}      // NOLINT(google-explicit-constructor)
  Result(Error error) : v_(std::move(error)) {}  // NOLINT(google-explicit-constructor)

  bool ok() const noexcept { return v_.index() == 0; }
  explicit operator bool() const noexcept { return ok(); }

  T& value() & { return checked_value(); }
  const T& value() const& { return checked_value(); }
  T&& value() && { return std::move(checked_value()); }
  T* operator->() { return &checked_value(); }
  const T* operator->() const { return &checked_value(); }
  T& operator*() & { return checked_value(); }

  const Error& error() const& { return checked_error(); }
  Error&& error() && { return std::move(checked_error()); }

 private:
  T& checked_value() noexcept {
    if (T* v = std::get_if<0>(&v_)) return *v;
    detail::result_misuse("value of a Result that holds an error", std::get_if<1>(&v_));
  }
  const T& checked_value() const noexcept {
    if (const T* v = std::get_if<0>(&v_)) return *v;
    detail::result_misuse("value of a Result that holds an error", std::get_if<1>(&v_));
  }
  Error& checked_error() noexcept {
    if (Error* e = std::get_if<1>(&v_)) return *e;
    detail::result_misuse("error of a Result that holds a value", nullptr);
  }
  const Error& checked_error() const noexcept {
    if (const Error* e = std::get_if<1>(&v_)) return *e;
    detail::result_misuse("error of a Result that holds a value", nullptr);
  }

  std::variant<T, Error> v_;
};

// Result of an operation that returns nothing but may fail.
template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Error error) : error_(std::move(error)), ok_(false) {}  // NOLINT

  bool ok() const noexcept { return ok_; }
  explicit operator bool() const noexcept { return ok_; }
  const Error& error() const& {
    if (ok_) detail::result_misuse("error of a Result<void> that succeeded", nullptr);
    return error_;
  }
  Error&& error() && {
    if (ok_) detail::result_misuse("error of a Result<void> that succeeded", nullptr);
    return std::move(error_);
  }

 private:
  Error error_;
  bool ok_ = true;
};

inline Result<void> ok_result() {
  return {};
}

}  // namespace gpuq
