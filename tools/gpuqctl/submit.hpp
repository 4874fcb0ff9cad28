// The submit command's parts (cmd_submit.cpp), shared by its source files: the parsed
// arguments, the session (connection and buffers) and the job spec; a run of many jobs
// (submit_load.cpp); the check of a tensor op's files and shapes (submit_tensor.cpp).
// Private to gpuqctl.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gpuq/client.hpp"

namespace gpuq::ctl {

using Clock = std::chrono::steady_clock;

struct SubmitArgs {
  std::string op;
  std::vector<std::string> input_paths;
  std::string output_path;
  std::optional<uint64_t> output_size;
  std::vector<gpuq::JobParam> params;
  std::string pool;
  std::optional<uint64_t> count;
  uint64_t concurrency = 1;
  std::optional<uint64_t> timeout_ms;
  uint64_t time_limit_ms = 0;  // 0: none of the job's own
  gpuq::Priority priority = gpuq::Priority::kNormal;
  uint32_t stream_window = 0;  // --stream N; 0: not a stream
};

// The connection and buffers a submit run uses: `pairs` input/output buffer pairs, each input
// holding a copy of the input file.
struct Session {
  gpuq::Client client;
  std::vector<gpuq::Buffer> inputs;
  std::vector<gpuq::Buffer> outputs;
};

gpuq::Result<Session> open_session(const std::string& runtime_dir, const std::string& input,
                                   uint64_t output_size, uint64_t pairs);

// The spec of the jobs of `args`, without their buffers.
gpuq::JobSpec make_spec(const SubmitArgs& args);

// "queued", "running", "done"...
const char* status_word(gpuq::JobStatus status);

// Time left until `deadline` as a timeout for the client API (negative: no deadline).
std::chrono::nanoseconds time_left(std::optional<Clock::time_point> deadline);

// Cancels `job`, which --timeout-ms left unfinished: a queued job ends at once, a running one
// is asked to stop (and its worker stopped if its op has not ended within the daemon's
// cancel_grace_ms). Returns what happened, as a note for stderr.
std::string cancel_unfinished(gpuq::Job& job);

// Runs args.count jobs keeping args.concurrency in flight and reports throughput and latency
// (submit_load.cpp). Returns the exit status.
int run_load(const SubmitArgs& args, Session& session);

// Parses a tensor op's parameters as its worker will, against an input buffer of the --input
// files and the output buffer (--output-size, or room for any result), and checks each file
// against the operand it holds. Returns the result's size in bytes, or nullopt with `error`
// (submit_tensor.cpp).
std::optional<uint64_t> check_tensor_job(const SubmitArgs& args,
                                         const std::vector<uint64_t>& input_sizes,
                                         std::string& error);

}  // namespace gpuq::ctl
