#include "plugins.hpp"

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string_view>
#include <variant>

#include "child_output.hpp"
#include "gpuq/common/clock.hpp"
#include "gpuq/common/log.hpp"
#include "gpuq/common/posix_call.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "gpuq/common/unique_fd.hpp"
#include "gpuq/plugin.h"

namespace gpuq::daemon {
namespace {

using nlohmann::json;

Error plugin_error(const std::string& path, const std::string& why) {
  return Error(ErrorCode::kInvalidArgument, "plug-in " + path + ": " + why);
}

struct Collector {
  std::string path;
  std::vector<PluginOp> ops;
  std::string problem;
};

int collect_op(gpuq_plugin_registrar* r, const char* name, const char* summary,
               gpuq_plugin_op_fn cpu_fn, gpuq_plugin_op_fn gpu_fn) {
  auto* c = static_cast<Collector*>(r->internal);
  const std::string n = name != nullptr ? name : "";
  std::string why;
  if (!valid_op_name(n)) {
    why = "op name '" + n + "' is not 1-48 characters of [a-z0-9_]";
  } else if (cpu_fn == nullptr && gpu_fn == nullptr) {
    why = "op '" + n + "' has neither a cpu nor a gpu function";
  } else {
    for (const auto& op : c->ops) {
      if (op.name == n) why = "op '" + n + "' is added twice";
    }
  }
  if (!why.empty()) {
    if (c->problem.empty()) c->problem = why;
    return GPUQ_INVALID_ARGUMENT;
  }
  PluginOp op;
  op.name = n;
  op.summary = summary != nullptr ? summary : "";
  op.library = c->path;
  op.has_cpu = cpu_fn != nullptr;
  op.has_gpu = gpu_fn != nullptr;
  op.cpu_fn = reinterpret_cast<void*>(cpu_fn);
  op.gpu_fn = reinterpret_cast<void*>(gpu_fn);
  c->ops.push_back(std::move(op));
  return 0;
}

struct JobState {
  const OpContext* ctx;
};

const ParamValue* find_param(const gpuq_plugin_job* job, const char* key) {
  if (key == nullptr) return nullptr;
  return static_cast<const JobState*>(job->internal)->ctx->params.find(key);
}

gpuq_plugin_param_status get_int(const gpuq_plugin_job* job, const char* key, int64_t* out) {
  const ParamValue* v = find_param(job, key);
  if (v == nullptr) return GPUQ_PLUGIN_PARAM_NOT_FOUND;
  const auto* i = std::get_if<int64_t>(v);
  if (i == nullptr) return GPUQ_PLUGIN_PARAM_WRONG_TYPE;
  if (out != nullptr) *out = *i;
  return GPUQ_PLUGIN_PARAM_FOUND;
}

// An integer param is also a float (a client writing a=2 means 2.0).
gpuq_plugin_param_status get_float(const gpuq_plugin_job* job, const char* key, double* out) {
  const ParamValue* v = find_param(job, key);
  if (v == nullptr) return GPUQ_PLUGIN_PARAM_NOT_FOUND;
  if (const auto* d = std::get_if<double>(v)) {
    if (out != nullptr) *out = *d;
    return GPUQ_PLUGIN_PARAM_FOUND;
  }
  if (const auto* i = std::get_if<int64_t>(v)) {
    if (out != nullptr) *out = static_cast<double>(*i);
    return GPUQ_PLUGIN_PARAM_FOUND;
  }
  return GPUQ_PLUGIN_PARAM_WRONG_TYPE;
}

gpuq_plugin_param_status get_string(const gpuq_plugin_job* job, const char* key, const char** out) {
  const ParamValue* v = find_param(job, key);
  if (v == nullptr) return GPUQ_PLUGIN_PARAM_NOT_FOUND;
  const auto* s = std::get_if<std::string>(v);
  if (s == nullptr) return GPUQ_PLUGIN_PARAM_WRONG_TYPE;
  if (out != nullptr) *out = s->c_str();
  return GPUQ_PLUGIN_PARAM_FOUND;
}

}  // namespace

Result<std::vector<PluginOp>> load_plugin(const std::string& path) {
  // The library stays loaded, also when it is rejected below: the process that loads a
  // plug-in either serves its ops or exits.
  auto handle = GPUQ_DL_CALL(::dlopen, path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) return plugin_error(path, handle.error().message());
  auto sym = GPUQ_DL_CALL(::dlsym, *handle, "gpuq_plugin_register");
  if (!sym) return plugin_error(path, "does not export gpuq_plugin_register");
  Collector c;
  c.path = path;
  gpuq_plugin_registrar r{GPUQ_PLUGIN_ABI_VERSION, collect_op, &c};
  const int code = reinterpret_cast<gpuq_plugin_register_fn>(*sym)(&r);
  if (code != 0) {
    return plugin_error(path, "gpuq_plugin_register returned " + std::to_string(code) +
                                  (c.problem.empty() ? std::string() : " (" + c.problem + ")"));
  }
  if (!c.problem.empty()) return plugin_error(path, c.problem);
  if (c.ops.empty()) return plugin_error(path, "gpuq_plugin_register added no op");
  return std::move(c.ops);
}

int list_plugin_ops_main(const std::string& path) {
  auto ops = load_plugin(path);
  if (!ops) {
    std::fprintf(stderr, "%s\n", ops.error().message().c_str());
    return 1;
  }
  json out = json::array();
  for (const auto& op : *ops) {
    out.push_back({{"name", op.name},
                   {"summary", op.summary},
                   {"has_cpu", op.has_cpu},
                   {"has_gpu", op.has_gpu}});
  }
  std::printf("%s\n", out.dump().c_str());
  // The parent reads the list from the pipe: an unwritten list is this command's failure.
  return std::fflush(stdout) == 0 ? 0 : 1;
}

Result<std::vector<PluginOp>> list_plugin_ops_isolated(const std::string& worker_path,
                                                       const std::string& plugin_path,
                                                       uint32_t timeout_ms) {
  // The child sees no GPU, as a CPU worker: a plug-in whose register touched CUDA would find
  // none rather than create a context.
  std::vector<std::string> env = environment_without({"CUDA_VISIBLE_DEVICES"});
  env.emplace_back("CUDA_VISIBLE_DEVICES=-1");
  auto child =
      run_child_for_output({worker_path, "--list-plugin-ops", plugin_path}, env, timeout_ms);
  if (!child) {
    return plugin_error(plugin_path, child.error().code() == ErrorCode::kTimeout
                                         ? "listing its ops " + child.error().message()
                                         : child.error().message());
  }
  const int status = child->status;
  const std::string& errors = child->err;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    if (!errors.empty() && errors.rfind("plug-in ", 0) == 0) {
      return Error(ErrorCode::kInvalidArgument, errors);
    }
    return plugin_error(plugin_path, "listing its ops failed (" + describe_child_status(status) +
                                         ")" + (errors.empty() ? std::string() : ": " + errors));
  }
  const std::string& answer = child->out;
  std::vector<PluginOp> ops;
  try {
    for (const auto& j : json::parse(answer)) {
      PluginOp op;
      op.name = j.at("name").get<std::string>();
      op.summary = j.at("summary").get<std::string>();
      op.has_cpu = j.at("has_cpu").get<bool>();
      op.has_gpu = j.at("has_gpu").get<bool>();
      op.library = plugin_path;
      ops.push_back(std::move(op));
    }
  } catch (const std::exception& e) {
    return plugin_error(plugin_path, std::string("malformed op list: ") + e.what());
  }
  return ops;
}

Result<OpOutput> run_plugin_op(const OpInfo& op, void* fn, const OpContext& ctx, const void* input,
                               void* output, const PluginDeviceHandles& device) {
  JobState state{&ctx};
  // What the op says when it fails, whole up to a job's message (kMessageBytes); written only
  // then, so not cleared per job.
  char message[kMessageBytes];
  message[0] = '\0';
  gpuq_plugin_job job{};
  job.abi_version = GPUQ_PLUGIN_ABI_VERSION;
  job.op_id = op.id;
  job.input = input;
  job.input_bytes = ctx.input_bytes;
  job.output = output;
  job.output_capacity = ctx.output_capacity;
  job.get_int = get_int;
  job.get_float = get_float;
  job.get_string = get_string;
  job.cuda_stream = device.stream;
  job.cudnn_handle = device.cudnn;
  job.cublas_handle = device.cublas;
  // std::atomic<uint32_t> is lock-free and has uint32_t's layout (static_assert below).
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
  job.cancel_requested = reinterpret_cast<const volatile uint32_t*>(&ctx.cancel_requested);
  job.error_message = message;
  job.error_message_capacity = sizeof message;
  job.internal = &state;
  const int code = reinterpret_cast<gpuq_plugin_op_fn>(fn)(&job);
  message[sizeof message - 1] = '\0';
  if (code != 0) {
    const ErrorCode ec =
        code > 0 && code <= kMaxErrorCode ? static_cast<ErrorCode>(code) : ErrorCode::kOpFailed;
    return Error(ec,
                 std::string(op.name) + ": " +
                     (message[0] != '\0' ? message : "failed with code " + std::to_string(code)));
  }
  if (job.output_bytes > ctx.output_capacity) {
    return Error(ErrorCode::kInvalidArgument, std::string(op.name) + ": the op reported " +
                                                  std::to_string(job.output_bytes) +
                                                  " output bytes, more than the output's " +
                                                  std::to_string(ctx.output_capacity));
  }
  return OpOutput{job.output_bytes, job.value};
}

}  // namespace gpuq::daemon
