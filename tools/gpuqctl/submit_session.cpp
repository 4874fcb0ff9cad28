// What a submit run shares between one job (cmd_submit.cpp) and many (submit_load.cpp): the
// session, the job spec, status words and deadlines.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "gpuq/client.hpp"
#include "submit.hpp"

namespace gpuq::ctl {

const char* status_word(gpuq::JobStatus status) {
  switch (status) {
    case gpuq::JobStatus::kQueued:
      return "queued";
    case gpuq::JobStatus::kRunning:
      return "running";
    case gpuq::JobStatus::kDone:
      return "done";
    case gpuq::JobStatus::kFailed:
      return "failed";
    case gpuq::JobStatus::kCancelled:
      return "cancelled";
    case gpuq::JobStatus::kExpired:
      return "expired";
  }
  return "unknown";
}

std::chrono::nanoseconds time_left(std::optional<Clock::time_point> deadline) {
  if (!deadline) return std::chrono::nanoseconds(-1);
  return std::max(std::chrono::nanoseconds(0), *deadline - Clock::now());
}

gpuq::Result<Session> open_session(const std::string& runtime_dir, const std::string& input,
                                   uint64_t output_size, uint64_t pairs) {
  gpuq::ConnectOptions options;
  options.runtime_dir = runtime_dir;
  options.name = "gpuqctl";
  gpuq::Result<gpuq::Client> client = gpuq::Client::connect(options);
  if (!client) return std::move(client).error();
  Session session{std::move(client).value(), {}, {}};
  for (uint64_t i = 0; i < pairs; ++i) {
    gpuq::Buffer in;
    if (!input.empty()) {
      gpuq::Result<gpuq::Buffer> b = session.client.allocate(input.size());
      if (!b) return std::move(b).error();
      in = b.value();
      std::memcpy(in.data(), input.data(), input.size());
    }
    gpuq::Buffer out;
    if (output_size > 0) {
      gpuq::Result<gpuq::Buffer> b = session.client.allocate(output_size);
      if (!b) return std::move(b).error();
      out = b.value();
    }
    session.inputs.push_back(in);
    session.outputs.push_back(out);
  }
  return session;
}

gpuq::JobSpec make_spec(const SubmitArgs& args) {
  gpuq::JobSpec spec;
  spec.op = args.op;
  spec.pool = args.pool;
  spec.params = args.params;
  spec.time_limit = std::chrono::milliseconds(args.time_limit_ms);
  spec.priority = args.priority;
  spec.stream_window = args.stream_window;
  return spec;
}

std::string cancel_unfinished(gpuq::Job& job) {
  gpuq::Result<void> cancelled = job.cancel();
  if (!cancelled) {
    if (cancelled.error().code() == gpuq::ErrorCode::kNotCancellable) {
      return "the job finished as the timeout passed; its result is dropped";
    }
    return "could not cancel the job: " + cancelled.error().to_string();
  }
  // A queued job is cancelled at once; a running one only asked to stop.
  gpuq::Result<gpuq::JobStatus> after = job.poll();
  if (after && after.value() == gpuq::JobStatus::kCancelled) {
    return "cancelled the job (it was still queued)";
  }
  return "cancelled the job (it was running: its op is asked to stop, and the daemon stops its "
         "worker if it does not within cancel_grace_ms)";
}

}  // namespace gpuq::ctl
