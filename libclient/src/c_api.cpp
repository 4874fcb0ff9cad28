// The C ABI (gpuq/gpuq.h) over the C++ API (gpuq/client.hpp).
//
// Every entry point runs its body inside guarded(), which turns a failed Result into a status code
// plus the thread's last-error message, and catches every exception at the boundary (GPUQ_INTERNAL
// with its what()): no C++ exception may unwind into C.
#include "gpuq/gpuq.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <new>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gpuq/client.hpp"
#include "gpuq/error.hpp"

#ifndef GPUQ_VERSION
#error "GPUQ_VERSION must be defined by the build (gpuq_common sets it)"
#endif

// The handles: a C++ object in a C-named box.
struct gpuq_client {
  gpuq::Client client;
};
struct gpuq_job {
  gpuq::Job job;
};

namespace {

// ---- The C enums mirror the C++ ones exactly -------------------------------------------------

#define GPUQ_SAME_CODE(c_name, cpp_name)                                                         \
  static_assert(static_cast<int32_t>(c_name) == static_cast<int32_t>(gpuq::ErrorCode::cpp_name), \
                #c_name " must equal gpuq::ErrorCode::" #cpp_name)
GPUQ_SAME_CODE(GPUQ_OK, kOk);
GPUQ_SAME_CODE(GPUQ_INVALID_ARGUMENT, kInvalidArgument);
GPUQ_SAME_CODE(GPUQ_UNKNOWN_OP, kUnknownOp);
GPUQ_SAME_CODE(GPUQ_UNKNOWN_POOL, kUnknownPool);
GPUQ_SAME_CODE(GPUQ_QUEUE_FULL, kQueueFull);
GPUQ_SAME_CODE(GPUQ_TIMEOUT, kTimeout);
GPUQ_SAME_CODE(GPUQ_CANCELLED, kCancelled);
GPUQ_SAME_CODE(GPUQ_EXPIRED, kExpired);
GPUQ_SAME_CODE(GPUQ_WORKER_DIED, kWorkerDied);
GPUQ_SAME_CODE(GPUQ_DISCONNECTED, kDisconnected);
GPUQ_SAME_CODE(GPUQ_PROTOCOL_MISMATCH, kProtocolMismatch);
GPUQ_SAME_CODE(GPUQ_PERMISSION_DENIED, kPermissionDenied);
GPUQ_SAME_CODE(GPUQ_OUT_OF_MEMORY, kOutOfMemory);
GPUQ_SAME_CODE(GPUQ_NOT_FOUND, kNotFound);
GPUQ_SAME_CODE(GPUQ_SHUTTING_DOWN, kShuttingDown);
GPUQ_SAME_CODE(GPUQ_FORKED_CLIENT, kForkedClient);
GPUQ_SAME_CODE(GPUQ_NO_DEVICE, kNoDevice);
GPUQ_SAME_CODE(GPUQ_INTERNAL, kInternal);
GPUQ_SAME_CODE(GPUQ_SYSTEM_ERROR, kSystemError);
GPUQ_SAME_CODE(GPUQ_NOT_CANCELLABLE, kNotCancellable);
GPUQ_SAME_CODE(GPUQ_TOO_MANY_CLIENTS, kTooManyClients);
GPUQ_SAME_CODE(GPUQ_OP_FAILED, kOpFailed);
GPUQ_SAME_CODE(GPUQ_TIMED_OUT, kTimedOut);
GPUQ_SAME_CODE(GPUQ_POOL_DOWN, kPoolDown);
#undef GPUQ_SAME_CODE
static_assert(gpuq::kMaxErrorCode == GPUQ_POOL_DOWN,
              "a code was added to gpuq::ErrorCode: add it to gpuq_status_t and above");

#define GPUQ_SAME_JOB_STATUS(c_name, cpp_name)                                           \
  static_assert(static_cast<int>(c_name) == static_cast<int>(gpuq::JobStatus::cpp_name), \
                #c_name " must equal gpuq::JobStatus::" #cpp_name)
GPUQ_SAME_JOB_STATUS(GPUQ_JOB_QUEUED, kQueued);
GPUQ_SAME_JOB_STATUS(GPUQ_JOB_RUNNING, kRunning);
GPUQ_SAME_JOB_STATUS(GPUQ_JOB_DONE, kDone);
GPUQ_SAME_JOB_STATUS(GPUQ_JOB_FAILED, kFailed);
GPUQ_SAME_JOB_STATUS(GPUQ_JOB_CANCELLED, kCancelled);
GPUQ_SAME_JOB_STATUS(GPUQ_JOB_EXPIRED, kExpired);
#undef GPUQ_SAME_JOB_STATUS

// The enums are 32-bit members of the ABI structs.
static_assert(sizeof(gpuq_status_t) == 4 && sizeof(gpuq_job_status_t) == 4);
// The structs are C structs: no constructors or hidden members.
static_assert(std::is_standard_layout_v<gpuq_connect_options_t> &&
              std::is_trivially_copyable_v<gpuq_connect_options_t>);
static_assert(std::is_standard_layout_v<gpuq_job_spec_t> &&
              std::is_trivially_copyable_v<gpuq_job_spec_t>);
static_assert(std::is_standard_layout_v<gpuq_job_result_t> &&
              std::is_trivially_copyable_v<gpuq_job_result_t>);
static_assert(std::is_standard_layout_v<gpuq_tensor_t> &&
              std::is_trivially_copyable_v<gpuq_tensor_t>);
static_assert(std::is_standard_layout_v<gpuq_conv2d_options_t> &&
              std::is_trivially_copyable_v<gpuq_conv2d_options_t> &&
              offsetof(gpuq_conv2d_options_t, version) == 0);
static_assert(std::is_standard_layout_v<gpuq_gemm_options_t> &&
              std::is_trivially_copyable_v<gpuq_gemm_options_t> &&
              offsetof(gpuq_gemm_options_t, version) == 0);
static_assert(static_cast<int>(GPUQ_DTYPE_F32) == static_cast<int>(gpuq::DType::kF32) &&
              static_cast<int>(GPUQ_DTYPE_F16) == static_cast<int>(gpuq::DType::kF16));
static_assert(offsetof(gpuq_connect_options_t, version) == 0 &&
              offsetof(gpuq_job_spec_t, version) == 0 && offsetof(gpuq_job_result_t, version) == 0);

// ---- Errors ---------------------------------------------------------------------------------

thread_local std::string t_last_error;

gpuq_status_t fail(gpuq::ErrorCode code, std::string message) noexcept {
  try {
    t_last_error = message.empty() ? std::string(gpuq::error_code_name(code)) : std::move(message);
  } catch (...) {
    t_last_error.clear();  // out of memory for the message itself: keep the code
  }
  return static_cast<gpuq_status_t>(code);
}

gpuq_status_t fail(const gpuq::Error& error) noexcept {
  return fail(error.code(), error.message());
}

gpuq_status_t invalid(std::string message) noexcept {
  return fail(gpuq::ErrorCode::kInvalidArgument, std::move(message));
}

// Runs `body` (which returns gpuq_status_t) with every exception turned into GPUQ_INTERNAL.
template <typename Body>
gpuq_status_t guarded(const char* function, Body&& body) noexcept {
  try {
    return body();
  } catch (const std::exception& e) {
    return fail(gpuq::ErrorCode::kInternal,
                std::string(function) + ": unexpected exception: " + e.what());
  } catch (...) {
    return fail(gpuq::ErrorCode::kInternal,
                std::string(function) + ": unexpected exception of unknown type");
  }
}

// Checks a versioned struct: `version` must be the one this library was built with.
bool check_version(uint32_t got, uint32_t expected, const char* struct_name, const char* macro_name,
                   gpuq_status_t& status) {
  if (got == expected) return true;
  char text[200];
  std::snprintf(text, sizeof text,
                "%s.version is 0x%08x, this library knows only %s (0x%08x, size %u, revision %u)",
                struct_name, got, macro_name, expected, expected & 0xFFFFFFu, expected >> 24);
  status = invalid(text);
  return false;
}

// ---- Conversions ----------------------------------------------------------------------------

// Hands a submitted job to the C caller: a new handle in *out, or the error.
gpuq_status_t hand_out(gpuq::Result<gpuq::Job> job, gpuq_job_t** out) {
  if (!job) return fail(job.error());
  *out = new gpuq_job{std::move(job).value()};
  return GPUQ_OK;
}

std::string text_or_empty(const char* s) {
  return s == nullptr ? std::string() : std::string(s);
}

gpuq::Buffer to_cpp(const gpuq_buffer_t& b) {
  return gpuq::Buffer{b.offset, b.size, static_cast<std::byte*>(b.data)};
}

gpuq_buffer_t to_c(const gpuq::Buffer& b) {
  gpuq_buffer_t out;
  out.offset = b.offset;
  out.size = b.size;
  out.data = b.ptr;
  return out;
}

// Older revisions of the structs are prefixes of the current ones: a field added in revision
// n is read only from a struct whose version says n or later.
static_assert(offsetof(gpuq_job_spec_t, flags) == (GPUQ_JOB_SPEC_VERSION1 & 0xFFFFFFu),
              "revision 1 of gpuq_job_spec_t must be the prefix before `flags`");
static_assert(offsetof(gpuq_job_spec_t, time_limit_ms) ==
                      offsetof(gpuq_job_spec_t, flags) + sizeof(uint32_t) &&
                  offsetof(gpuq_job_spec_t, priority) == (GPUQ_JOB_SPEC_VERSION2 & 0xFFFFFFu),
              "revision 2 of gpuq_job_spec_t must be the prefix before `time_limit_ms`, "
              "which took its tail padding");
static_assert(offsetof(gpuq_job_spec_t, priority) == (GPUQ_JOB_SPEC_VERSION3 & 0xFFFFFFu),
              "revision 3 of gpuq_job_spec_t must be the prefix before `priority`");
static_assert(sizeof(gpuq_job_spec_t) == (GPUQ_JOB_SPEC_VERSION4 & 0xFFFFFFu) &&
                  offsetof(gpuq_job_spec_t, stream_window) ==
                      offsetof(gpuq_job_spec_t, priority) + sizeof(int32_t),
              "revision 4 of gpuq_job_spec_t must be the prefix before `stream_window`, "
              "which took its tail padding");
static_assert(GPUQ_PRIORITY_NORMAL == static_cast<int>(gpuq::Priority::kNormal) &&
                  GPUQ_PRIORITY_HIGH == static_cast<int>(gpuq::Priority::kHigh) &&
                  GPUQ_PRIORITY_LOW == static_cast<int>(gpuq::Priority::kLow),
              "GPUQ_PRIORITY_* are gpuq::Priority's numbers");
static_assert(offsetof(gpuq_connect_options_t, flags) ==
                  (GPUQ_CONNECT_OPTIONS_VERSION1 & 0xFFFFFFu),
              "revision 1 of gpuq_connect_options_t must be the prefix before `flags`");

// The revision (1 to 5) of a gpuq_job_spec_t, or 0 with the InvalidArgument status in
// `status` for a version this library does not know.
int job_spec_revision(uint32_t version, gpuq_status_t& status) {
  if (version == GPUQ_JOB_SPEC_VERSION1) return 1;
  if (version == GPUQ_JOB_SPEC_VERSION2) return 2;
  if (version == GPUQ_JOB_SPEC_VERSION3) return 3;
  if (version == GPUQ_JOB_SPEC_VERSION4) return 4;
  if (!check_version(version, GPUQ_JOB_SPEC_VERSION, "gpuq_job_spec_t", "GPUQ_JOB_SPEC_VERSION",
                     status)) {
    return 0;
  }
  return 5;
}

// Fills `out` from `spec`, or returns the InvalidArgument status that names the bad field.
gpuq_status_t to_cpp(const gpuq_job_spec_t& spec, gpuq::JobSpec& out) {
  gpuq_status_t status = GPUQ_OK;
  const int revision = job_spec_revision(spec.version, status);
  if (revision == 0) return status;
  // A revision-1 struct has no `flags`, and one of revision 1 or 2 no `time_limit_ms` (in
  // revision 2 those bytes are padding, which the caller may not have zeroed).
  const uint32_t flags = revision >= 2 ? spec.flags : 0;
  const uint32_t time_limit_ms = revision >= 3 ? spec.time_limit_ms : 0;
  const int32_t priority = revision >= 4 ? spec.priority : GPUQ_PRIORITY_NORMAL;
  if (priority != GPUQ_PRIORITY_NORMAL && priority != GPUQ_PRIORITY_HIGH &&
      priority != GPUQ_PRIORITY_LOW) {
    return invalid("gpuq_job_spec_t.priority is " + std::to_string(priority) +
                   " (GPUQ_PRIORITY_NORMAL 0, GPUQ_PRIORITY_HIGH 1 or GPUQ_PRIORITY_LOW 2)");
  }
  out.priority = static_cast<gpuq::Priority>(priority);
  // Revision 4's struct has the same size: those bytes are its padding.
  out.stream_window = revision >= 5 ? spec.stream_window : 0;
  if ((flags & ~GPUQ_JOB_RETRYABLE) != 0) {
    return invalid("gpuq_job_spec_t.flags has unknown bits " + std::to_string(flags) +
                   " (known: GPUQ_JOB_RETRYABLE)");
  }
  out.retryable = (flags & GPUQ_JOB_RETRYABLE) != 0;
  out.time_limit = std::chrono::milliseconds(time_limit_ms);
  if (spec.op == nullptr) return invalid("gpuq_job_spec_t.op is NULL");
  out.op = spec.op;
  out.pool = text_or_empty(spec.pool);
  out.input = to_cpp(spec.input);
  out.output = to_cpp(spec.output);
  if (spec.input.size != 0 && spec.input.data == nullptr) {
    return invalid("gpuq_job_spec_t.input.data is NULL but input.size is not 0");
  }
  if (spec.output.size != 0 && spec.output.data == nullptr) {
    return invalid("gpuq_job_spec_t.output.data is NULL but output.size is not 0");
  }
  if (spec.param_count != 0 && spec.params == nullptr) {
    return invalid("gpuq_job_spec_t.params is NULL but param_count is " +
                   std::to_string(spec.param_count));
  }
  out.params.clear();
  out.params.reserve(spec.param_count);
  for (uint32_t i = 0; i < spec.param_count; ++i) {
    const gpuq_param_t& p = spec.params[i];
    const std::string where = "gpuq_job_spec_t.params[" + std::to_string(i) + "]";
    if (p.key == nullptr) return invalid(where + ".key is NULL");
    switch (p.type) {
      case GPUQ_PARAM_INT:
        out.params.push_back(gpuq::JobParam::integer(p.key, p.i));
        break;
      case GPUQ_PARAM_FLOAT:
        out.params.push_back(gpuq::JobParam::real(p.key, p.f));
        break;
      case GPUQ_PARAM_STRING:
        if (p.s == nullptr) return invalid(where + " ('" + p.key + "').s is NULL");
        out.params.push_back(gpuq::JobParam::text(p.key, p.s));
        break;
      default:
        return invalid(where + " ('" + p.key + "').type is " + std::to_string(p.type) +
                       ", must be GPUQ_PARAM_INT, GPUQ_PARAM_FLOAT or GPUQ_PARAM_STRING");
    }
  }
  out.expire_after = spec.expire_after_ns > 0 ? std::chrono::nanoseconds(spec.expire_after_ns)
                                              : std::chrono::nanoseconds(-1);
  return GPUQ_OK;
}

// Copies `message` into `out` (`N` bytes), truncated and NUL-terminated; the bytes after the
// NUL are left as they are (a successful job's empty message writes one byte, not N).
template <size_t N>
void copy_message(const std::string& message, char (&out)[N]) {
  const size_t n = message.size() < N - 1 ? message.size() : N - 1;
  std::memcpy(out, message.data(), n);
  out[n] = '\0';
}

// Revision 1 of gpuq_job_result_t, as programs built against it still pass it: the fields of
// revision 2 with a 256-byte message.
struct gpuq_job_result_v1 {
  uint32_t version;
  gpuq_job_status_t status;
  gpuq_status_t code;
  char message[256];
  uint64_t output_size;
  uint64_t value;
  uint32_t worker_id;
  uint64_t queued_ns;
  uint64_t run_ns;
};
static_assert(sizeof(gpuq_job_result_v1) == (GPUQ_JOB_RESULT_VERSION1 & 0xFFFFFFu),
              "GPUQ_JOB_RESULT_VERSION1 must name revision 1's size");

// Fills a result struct of either revision from `r`.
template <typename Out>
void fill_result(const gpuq::JobResult& r, Out* out) {
  out->status = static_cast<gpuq_job_status_t>(r.status);
  out->code = static_cast<gpuq_status_t>(r.code);
  copy_message(r.message, out->message);
  out->output_size = r.output_size;
  out->value = r.value;
  out->worker_id = r.worker_id;
  out->queued_ns = r.queued_ns;
  out->run_ns = r.run_ns;
}

// Shared body of gpuq_submit() and gpuq_try_submit().
template <typename Submit>
gpuq_status_t submit_with(gpuq_client_t* client, const gpuq_job_spec_t* spec, gpuq_job_t** out,
                          Submit&& submit) {
  if (client == nullptr) return invalid("client is NULL");
  if (spec == nullptr) return invalid("spec is NULL");
  if (out == nullptr) return invalid("out is NULL");
  gpuq::JobSpec cpp_spec;
  if (gpuq_status_t s = to_cpp(*spec, cpp_spec); s != GPUQ_OK) return s;
  return hand_out(submit(client->client, cpp_spec), out);
}

// A gpuq_tensor_t as a Tensor; `name` names it in errors.
gpuq_status_t to_cpp(const gpuq_tensor_t& t, const char* op, const char* name, gpuq::Tensor& out) {
  if (t.rank < 1 || t.rank > 4) {
    return invalid(std::string(op) + ": " + name + ": rank is " + std::to_string(t.rank) +
                   ", must be 1 to 4");
  }
  if (t.dtype != 0 && t.dtype != GPUQ_DTYPE_F32 && t.dtype != GPUQ_DTYPE_F16) {
    return invalid(std::string(op) + ": " + name + ": dtype is " + std::to_string(t.dtype) +
                   ", must be GPUQ_DTYPE_F32 or GPUQ_DTYPE_F16");
  }
  const gpuq::DType dtype = t.dtype == GPUQ_DTYPE_F16 ? gpuq::DType::kF16 : gpuq::DType::kF32;
  gpuq::Result<gpuq::Tensor> tensor = gpuq::Tensor::make(
      gpuq::Buffer{t.buffer.offset, t.buffer.size, static_cast<std::byte*>(t.buffer.data)},
      gpuq::Shape(t.dims, t.dims + t.rank), dtype);
  if (!tensor) return invalid(std::string(op) + ": " + name + ": " + tensor.error().message());
  out = std::move(tensor).value();
  return GPUQ_OK;
}

// Converts the required tensors of a tensor op (each non-NULL) and the optional one.
gpuq_status_t tensors_to_cpp(const char* op,
                             std::initializer_list<std::pair<const char*, const gpuq_tensor_t*>> in,
                             gpuq::Tensor* out) {
  for (const auto& [name, t] : in) {
    if (t == nullptr) return invalid(std::string(op) + ": " + name + " is NULL");
    if (gpuq_status_t s = to_cpp(*t, op, name, *out++); s != GPUQ_OK) return s;
  }
  return GPUQ_OK;
}

}  // namespace

extern "C" {

gpuq_status_t gpuq_connect(const gpuq_connect_options_t* options, gpuq_client_t** out) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (out == nullptr) return invalid("out is NULL");
    gpuq::ConnectOptions cpp;
    if (options != nullptr) {
      gpuq_status_t status = GPUQ_OK;
      const bool revision1 = options->version == GPUQ_CONNECT_OPTIONS_VERSION1;
      if (!revision1 &&
          !check_version(options->version, GPUQ_CONNECT_OPTIONS_VERSION, "gpuq_connect_options_t",
                         "GPUQ_CONNECT_OPTIONS_VERSION", status)) {
        return status;
      }
      const uint32_t flags = revision1 ? 0 : options->flags;  // revision 1 has no `flags`
      if ((flags & ~GPUQ_CONNECT_KEEP_RUNNING_JOBS) != 0) {
        return invalid("gpuq_connect_options_t.flags has unknown bits " + std::to_string(flags) +
                       " (known: GPUQ_CONNECT_KEEP_RUNNING_JOBS)");
      }
      cpp.keep_running_jobs = (flags & GPUQ_CONNECT_KEEP_RUNNING_JOBS) != 0;
      cpp.runtime_dir = text_or_empty(options->runtime_dir);
      cpp.segment_bytes = options->segment_bytes;
      cpp.name = text_or_empty(options->name);
      if (options->spin_ns < 0) {
        cpp.spin = std::chrono::nanoseconds(0);
      } else if (options->spin_ns > 0) {
        cpp.spin = std::chrono::nanoseconds(options->spin_ns);
      }  // 0: keep the C++ default
    }
    gpuq::Result<gpuq::Client> client = gpuq::Client::connect(cpp);
    if (!client) return fail(client.error());
    *out = new gpuq_client{std::move(client).value()};
    return GPUQ_OK;
  });
}

gpuq_status_t gpuq_disconnect(gpuq_client_t* client) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    delete client;
    return GPUQ_OK;
  });
}

gpuq_status_t gpuq_reconnect(gpuq_client_t* client) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (client == nullptr) return invalid("client is NULL");
    if (auto r = client->client.reconnect(); !r) return fail(r.error());
    return GPUQ_OK;
  });
}

gpuq_status_t gpuq_alloc(gpuq_client_t* client, uint64_t size, gpuq_buffer_t* out) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (client == nullptr) return invalid("client is NULL");
    if (out == nullptr) return invalid("out is NULL");
    gpuq::Result<gpuq::Buffer> buffer = client->client.allocate(size);
    if (!buffer) return fail(buffer.error());
    *out = to_c(buffer.value());
    return GPUQ_OK;
  });
}

gpuq_status_t gpuq_free(gpuq_client_t* client, const gpuq_buffer_t* buffer) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (client == nullptr) return invalid("client is NULL");
    if (buffer == nullptr) return invalid("buffer is NULL");
    client->client.release(to_cpp(*buffer));
    return GPUQ_OK;
  });
}

gpuq_status_t gpuq_submit(gpuq_client_t* client, const gpuq_job_spec_t* spec, int64_t timeout_ns,
                          gpuq_job_t** out) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    return submit_with(client, spec, out, [&](gpuq::Client& c, const gpuq::JobSpec& s) {
      return c.submit(s, std::chrono::nanoseconds(timeout_ns));
    });
  });
}

gpuq_status_t gpuq_try_submit(gpuq_client_t* client, const gpuq_job_spec_t* spec,
                              gpuq_job_t** out) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    return submit_with(client, spec, out,
                       [](gpuq::Client& c, const gpuq::JobSpec& s) { return c.try_submit(s); });
  });
}

gpuq_status_t gpuq_submit_conv2d(gpuq_client_t* client, const gpuq_tensor_t* x,
                                 const gpuq_tensor_t* w, const gpuq_tensor_t* b,
                                 const gpuq_tensor_t* y, const gpuq_conv2d_options_t* options,
                                 int64_t timeout_ns, gpuq_job_t** out) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (client == nullptr) return invalid("client is NULL");
    if (out == nullptr) return invalid("out is NULL");
    gpuq::Tensor t[3];  // x, w, y
    if (gpuq_status_t s = tensors_to_cpp("conv2d", {{"x", x}, {"w", w}, {"y", y}}, t);
        s != GPUQ_OK) {
      return s;
    }
    std::optional<gpuq::Tensor> bias;
    if (b != nullptr) {
      bias.emplace();
      if (gpuq_status_t s = to_cpp(*b, "conv2d", "b", *bias); s != GPUQ_OK) return s;
    }
    gpuq::Conv2dOptions cpp;
    std::string pool;
    if (options != nullptr) {
      gpuq_status_t status = GPUQ_OK;
      if (!check_version(options->version, GPUQ_CONV2D_OPTIONS_VERSION, "gpuq_conv2d_options_t",
                         "GPUQ_CONV2D_OPTIONS_VERSION", status)) {
        return status;
      }
      for (int i = 0; i < 2; ++i) {
        cpp.stride[i] = options->stride[i] == 0 ? 1 : options->stride[i];
        cpp.pad[i] = options->pad[i];
        cpp.dilation[i] = options->dilation[i] == 0 ? 1 : options->dilation[i];
      }
      cpp.groups = options->groups == 0 ? 1 : options->groups;
      cpp.relu = options->relu != 0;
      pool = text_or_empty(options->pool);
    }
    return hand_out(client->client.conv2d(t[0], t[1], bias, t[2], cpp, pool,
                                          std::chrono::nanoseconds(timeout_ns)),
                    out);
  });
}

gpuq_status_t gpuq_submit_gemm(gpuq_client_t* client, const gpuq_tensor_t* a,
                               const gpuq_tensor_t* b, const gpuq_tensor_t* c,
                               const gpuq_tensor_t* y, const gpuq_gemm_options_t* options,
                               int64_t timeout_ns, gpuq_job_t** out) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (client == nullptr) return invalid("client is NULL");
    if (out == nullptr) return invalid("out is NULL");
    gpuq::Tensor t[3];  // a, b, y
    if (gpuq_status_t s = tensors_to_cpp("gemm", {{"a", a}, {"b", b}, {"y", y}}, t); s != GPUQ_OK) {
      return s;
    }
    std::optional<gpuq::Tensor> addend;
    if (c != nullptr) {
      addend.emplace();
      if (gpuq_status_t s = to_cpp(*c, "gemm", "c", *addend); s != GPUQ_OK) return s;
    }
    gpuq::GemmOptions cpp;
    std::string pool;
    if (options != nullptr) {
      gpuq_status_t status = GPUQ_OK;
      if (!check_version(options->version, GPUQ_GEMM_OPTIONS_VERSION, "gpuq_gemm_options_t",
                         "GPUQ_GEMM_OPTIONS_VERSION", status)) {
        return status;
      }
      cpp.trans_a = options->trans_a != 0;
      cpp.trans_b = options->trans_b != 0;
      cpp.alpha = options->alpha == 0 ? 1.0 : options->alpha;
      cpp.beta = options->beta;
      pool = text_or_empty(options->pool);
    }
    return hand_out(client->client.gemm(t[0], t[1], addend, t[2], cpp, pool,
                                        std::chrono::nanoseconds(timeout_ns)),
                    out);
  });
}

gpuq_status_t gpuq_submit_activation(gpuq_client_t* client, const gpuq_tensor_t* x,
                                     const gpuq_tensor_t* y,
                                     const gpuq_activation_options_t* options, int64_t timeout_ns,
                                     gpuq_job_t** out) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (client == nullptr) return invalid("client is NULL");
    if (out == nullptr) return invalid("out is NULL");
    gpuq::Tensor t[2];  // x, y
    if (gpuq_status_t s = tensors_to_cpp("activation", {{"x", x}, {"y", y}}, t); s != GPUQ_OK) {
      return s;
    }
    gpuq::ActivationMode mode = gpuq::ActivationMode::kRelu;
    std::string pool;
    if (options != nullptr) {
      gpuq_status_t status = GPUQ_OK;
      if (!check_version(options->version, GPUQ_ACTIVATION_OPTIONS_VERSION,
                         "gpuq_activation_options_t", "GPUQ_ACTIVATION_OPTIONS_VERSION", status)) {
        return status;
      }
      switch (options->mode) {
        case GPUQ_ACTIVATION_RELU:
          mode = gpuq::ActivationMode::kRelu;
          break;
        case GPUQ_ACTIVATION_SIGMOID:
          mode = gpuq::ActivationMode::kSigmoid;
          break;
        case GPUQ_ACTIVATION_TANH:
          mode = gpuq::ActivationMode::kTanh;
          break;
        default:
          return invalid("gpuq_activation_options_t.mode is " + std::to_string(options->mode) +
                         ", not a gpuq_activation_mode_t (0 relu, 1 sigmoid, 2 tanh)");
      }
      pool = text_or_empty(options->pool);
    }
    return hand_out(
        client->client.activation(t[0], t[1], mode, pool, std::chrono::nanoseconds(timeout_ns)),
        out);
  });
}

gpuq_status_t gpuq_submit_softmax(gpuq_client_t* client, const gpuq_tensor_t* x,
                                  const gpuq_tensor_t* y, const gpuq_softmax_options_t* options,
                                  int64_t timeout_ns, gpuq_job_t** out) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (client == nullptr) return invalid("client is NULL");
    if (out == nullptr) return invalid("out is NULL");
    gpuq::Tensor t[2];  // x, y
    if (gpuq_status_t s = tensors_to_cpp("softmax", {{"x", x}, {"y", y}}, t); s != GPUQ_OK) {
      return s;
    }
    gpuq::SoftmaxOptions cpp;
    std::string pool;
    if (options != nullptr) {
      gpuq_status_t status = GPUQ_OK;
      if (!check_version(options->version, GPUQ_SOFTMAX_OPTIONS_VERSION, "gpuq_softmax_options_t",
                         "GPUQ_SOFTMAX_OPTIONS_VERSION", status)) {
        return status;
      }
      cpp.log = options->log != 0;
      pool = text_or_empty(options->pool);
    }
    return hand_out(
        client->client.softmax(t[0], t[1], cpp, pool, std::chrono::nanoseconds(timeout_ns)), out);
  });
}

gpuq_status_t gpuq_submit_pool2d(gpuq_client_t* client, const gpuq_tensor_t* x,
                                 const gpuq_tensor_t* y, const gpuq_pool2d_options_t* options,
                                 int64_t timeout_ns, gpuq_job_t** out) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (client == nullptr) return invalid("client is NULL");
    if (out == nullptr) return invalid("out is NULL");
    gpuq::Tensor t[2];  // x, y
    if (gpuq_status_t s = tensors_to_cpp("pool2d", {{"x", x}, {"y", y}}, t); s != GPUQ_OK) {
      return s;
    }
    gpuq::Pool2dOptions cpp;
    std::string pool;
    if (options != nullptr) {
      gpuq_status_t status = GPUQ_OK;
      if (!check_version(options->version, GPUQ_POOL2D_OPTIONS_VERSION, "gpuq_pool2d_options_t",
                         "GPUQ_POOL2D_OPTIONS_VERSION", status)) {
        return status;
      }
      switch (options->mode) {
        case GPUQ_POOL_MAX:
          cpp.mode = gpuq::PoolMode::kMax;
          break;
        case GPUQ_POOL_AVG:
          cpp.mode = gpuq::PoolMode::kAvg;
          break;
        default:
          return invalid("gpuq_pool2d_options_t.mode is " + std::to_string(options->mode) +
                         ", not a gpuq_pool_mode_t (0 max, 1 avg)");
      }
      for (int i = 0; i < 2; ++i) cpp.window[i] = options->window[i] == 0 ? 1 : options->window[i];
      if (options->stride[0] != 0 || options->stride[1] != 0) {
        cpp.stride =
            std::array<int64_t, 2>{options->stride[0] == 0 ? cpp.window[0] : options->stride[0],
                                   options->stride[1] == 0 ? cpp.window[1] : options->stride[1]};
      }
      cpp.pad = {options->pad[0], options->pad[1]};
      cpp.count_pad = options->count_pad != 0;
      pool = text_or_empty(options->pool);
    }
    return hand_out(
        client->client.pool2d(t[0], t[1], cpp, pool, std::chrono::nanoseconds(timeout_ns)), out);
  });
}

gpuq_status_t gpuq_submit_batchnorm(gpuq_client_t* client, const gpuq_tensor_t* x,
                                    const gpuq_tensor_t* scale, const gpuq_tensor_t* bias,
                                    const gpuq_tensor_t* mean, const gpuq_tensor_t* var,
                                    const gpuq_tensor_t* y, const gpuq_batchnorm_options_t* options,
                                    int64_t timeout_ns, gpuq_job_t** out) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (client == nullptr) return invalid("client is NULL");
    if (out == nullptr) return invalid("out is NULL");
    gpuq::Tensor t[6];  // x, scale, bias, mean, var, y
    if (gpuq_status_t s = tensors_to_cpp(
            "batchnorm",
            {{"x", x}, {"scale", scale}, {"bias", bias}, {"mean", mean}, {"var", var}, {"y", y}},
            t);
        s != GPUQ_OK) {
      return s;
    }
    gpuq::BatchNormOptions cpp;
    std::string pool;
    if (options != nullptr) {
      gpuq_status_t status = GPUQ_OK;
      if (!check_version(options->version, GPUQ_BATCHNORM_OPTIONS_VERSION,
                         "gpuq_batchnorm_options_t", "GPUQ_BATCHNORM_OPTIONS_VERSION", status)) {
        return status;
      }
      if (options->eps != 0) cpp.eps = options->eps;
      cpp.relu = options->relu != 0;
      pool = text_or_empty(options->pool);
    }
    return hand_out(client->client.batchnorm(t[0], t[1], t[2], t[3], t[4], t[5], cpp, pool,
                                             std::chrono::nanoseconds(timeout_ns)),
                    out);
  });
}

gpuq_status_t gpuq_job_wait(gpuq_job_t* job, int64_t timeout_ns, gpuq_job_result_t* out) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (job == nullptr) return invalid("job is NULL");
    if (out == nullptr) return invalid("out is NULL");
    gpuq_status_t status = GPUQ_OK;
    const bool revision1 = out->version == GPUQ_JOB_RESULT_VERSION1;
    if (!revision1 && !check_version(out->version, GPUQ_JOB_RESULT_VERSION, "gpuq_job_result_t",
                                     "GPUQ_JOB_RESULT_VERSION", status)) {
      return status;
    }
    gpuq::Result<gpuq::JobResult> result = job->job.wait(std::chrono::nanoseconds(timeout_ns));
    if (!result) return fail(result.error());
    if (revision1) {
      fill_result(result.value(), reinterpret_cast<gpuq_job_result_v1*>(out));
    } else {
      fill_result(result.value(), out);
    }
    return GPUQ_OK;
  });
}

gpuq_status_t gpuq_job_next_part(gpuq_job_t* job, int64_t timeout_ns, gpuq_job_part_t* out) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (job == nullptr) return invalid("job is NULL");
    if (out == nullptr) return invalid("out is NULL");
    gpuq::Result<std::optional<gpuq::JobPart>> part =
        job->job.next_part(std::chrono::nanoseconds(timeout_ns));
    if (!part) return fail(part.error());
    gpuq_job_part_t p{};
    if (part->has_value()) {
      p.index = (*part)->index;
      p.data = (*part)->data;
      p.size = (*part)->size;
    } else {
      p.end = 1;
    }
    *out = p;
    return GPUQ_OK;
  });
}

gpuq_status_t gpuq_job_poll(gpuq_job_t* job, gpuq_job_status_t* out) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (job == nullptr) return invalid("job is NULL");
    if (out == nullptr) return invalid("out is NULL");
    gpuq::Result<gpuq::JobStatus> status = job->job.poll();
    if (!status) return fail(status.error());
    *out = static_cast<gpuq_job_status_t>(status.value());
    return GPUQ_OK;
  });
}

gpuq_status_t gpuq_job_wait_any(gpuq_job_t* const* jobs, size_t count, int64_t timeout_ns,
                                uint8_t* ended) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (count > 0 && jobs == nullptr) return invalid("jobs is NULL");
    if (count > 0 && ended == nullptr) return invalid("ended is NULL");
    std::vector<const gpuq::Job*> list(count);
    for (size_t i = 0; i < count; ++i) list[i] = jobs[i] != nullptr ? &jobs[i]->job : nullptr;
    gpuq::Result<std::vector<size_t>> r =
        gpuq::Job::wait_any(list, std::chrono::nanoseconds(timeout_ns));
    if (!r) return fail(r.error());
    std::fill(ended, ended + count, uint8_t{0});
    for (size_t i : *r) ended[i] = 1;
    return GPUQ_OK;
  });
}

gpuq_status_t gpuq_job_wake_waiters(gpuq_job_t* job) {
  if (job != nullptr) job->job.wake_waiters();
  return GPUQ_OK;
}

gpuq_status_t gpuq_job_cancel(gpuq_job_t* job) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (job == nullptr) return invalid("job is NULL");
    gpuq::Result<void> r = job->job.cancel();
    if (!r) return fail(r.error());
    return GPUQ_OK;
  });
}

gpuq_status_t gpuq_job_cancel_queued(gpuq_job_t* job, int* cancelled) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (job == nullptr) return invalid("job is NULL");
    if (cancelled == nullptr) return invalid("cancelled is NULL");
    gpuq::Result<bool> r = job->job.cancel_queued();
    if (!r) return fail(r.error());
    *cancelled = *r ? 1 : 0;
    return GPUQ_OK;
  });
}

gpuq_status_t gpuq_job_release(gpuq_job_t* job) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    delete job;
    return GPUQ_OK;
  });
}

gpuq_status_t gpuq_daemon_status_json(const char* runtime_dir, char** out_json) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (out_json == nullptr) return invalid("out_json is NULL");
    gpuq::Result<std::string> json = gpuq::daemon_status_json(text_or_empty(runtime_dir));
    if (!json) return fail(json.error());
    const std::string& text = json.value();
    char* copy = static_cast<char*>(std::malloc(text.size() + 1));
    if (copy == nullptr) {
      return fail(gpuq::ErrorCode::kOutOfMemory,
                  "no memory for the " + std::to_string(text.size()) + "-byte status document");
    }
    std::memcpy(copy, text.c_str(), text.size() + 1);
    *out_json = copy;
    return GPUQ_OK;
  });
}

void gpuq_string_free(char* s) {
  std::free(s);
}

gpuq_status_t gpuq_daemon_restart_pool(const char* runtime_dir, const char* pool,
                                       uint32_t timeout_s, uint32_t* generation) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    if (pool == nullptr)
      return fail(gpuq::Error(gpuq::ErrorCode::kInvalidArgument, "pool is NULL"));
    gpuq::Result<uint32_t> r =
        gpuq::daemon_restart_pool(pool, text_or_empty(runtime_dir), timeout_s);
    if (!r) return fail(r.error());
    if (generation != nullptr) *generation = *r;
    return GPUQ_OK;
  });
}

gpuq_status_t gpuq_daemon_reload(const char* runtime_dir, uint32_t timeout_s, char** changes) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    gpuq::Result<std::vector<std::string>> r =
        gpuq::daemon_reload(text_or_empty(runtime_dir), timeout_s);
    if (!r) return fail(r.error());
    if (changes != nullptr) {
      std::string text;
      for (const std::string& line : *r) text += line + "\n";
      char* copy = static_cast<char*>(std::malloc(text.size() + 1));
      if (copy == nullptr) return fail(gpuq::ErrorCode::kOutOfMemory, "no memory for the changes");
      std::memcpy(copy, text.c_str(), text.size() + 1);
      *changes = copy;
    }
    return GPUQ_OK;
  });
}

gpuq_status_t gpuq_daemon_stop(const char* runtime_dir) {
  return guarded(__func__, [&]() -> gpuq_status_t {
    gpuq::Result<void> r = gpuq::daemon_stop(text_or_empty(runtime_dir));
    if (!r) return fail(r.error());
    return GPUQ_OK;
  });
}

const char* gpuq_status_name(gpuq_status_t code) {
  const int32_t value = static_cast<int32_t>(code);
  if (value < 0 || value > gpuq::kMaxErrorCode) return "Unknown";
  // error_code_name() returns string literals, so data() is NUL-terminated.
  return gpuq::error_code_name(static_cast<gpuq::ErrorCode>(value)).data();
}

const char* gpuq_job_status_name(gpuq_job_status_t status) {
  switch (status) {
    case GPUQ_JOB_QUEUED:
      return "queued";
    case GPUQ_JOB_RUNNING:
      return "running";
    case GPUQ_JOB_DONE:
      return "done";
    case GPUQ_JOB_FAILED:
      return "failed";
    case GPUQ_JOB_CANCELLED:
      return "cancelled";
    case GPUQ_JOB_EXPIRED:
      return "expired";
  }
  return "unknown";
}

const char* gpuq_last_error_message(void) {
  return t_last_error.c_str();
}

const char* gpuq_version(void) {
  return GPUQ_VERSION;
}

}  // extern "C"
