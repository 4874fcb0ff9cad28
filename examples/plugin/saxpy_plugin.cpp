// gpuq_example_plugin: a plug-in op (gpuq/plugin.h) with a CPU function and, in a build with
// CUDA, a GPU function (saxpy_kernel.cu) in the same shared library.
//
//   saxpy: y = a * x + y over float32. Input: x then y, back to back (n floats each, so the
//   input is 8n bytes); param `a` (float; an integer is taken as a float); output: the new y
//   (4n bytes). The result value is n.
#include <cstdint>
#include <cstdio>

#include "gpuq/plugin.h"
#include "saxpy_plugin.hpp"

namespace {

int saxpy_cpu(gpuq_plugin_job* job) {
  gpuq_example::SaxpyArgs args;
  if (int code = gpuq_example::saxpy_args(job, &args); code != 0) return code;
  const float* x = static_cast<const float*>(job->input);
  const float* y = x + args.n;
  float* out = static_cast<float*>(job->output);
  for (uint64_t i = 0; i < args.n; ++i) out[i] = args.a * x[i] + y[i];
  job->output_bytes = args.n * sizeof(float);
  job->value = args.n;
  return 0;
}

}  // namespace

namespace gpuq_example {

int saxpy_args(gpuq_plugin_job* job, SaxpyArgs* args) {
  double a = 0;
  switch (job->get_float(job, "a", &a)) {
    case GPUQ_PLUGIN_PARAM_FOUND:
      break;
    case GPUQ_PLUGIN_PARAM_NOT_FOUND:
      std::snprintf(job->error_message, job->error_message_capacity, "param a (float) is required");
      return GPUQ_INVALID_ARGUMENT;
    case GPUQ_PLUGIN_PARAM_WRONG_TYPE:
      std::snprintf(job->error_message, job->error_message_capacity, "param a must be a number");
      return GPUQ_INVALID_ARGUMENT;
  }
  if (job->input_bytes == 0 || job->input_bytes % (2 * sizeof(float)) != 0) {
    std::snprintf(job->error_message, job->error_message_capacity,
                  "the input must be x then y, n float32 each (a non-zero multiple of 8 bytes), "
                  "got %llu bytes",
                  static_cast<unsigned long long>(job->input_bytes));
    return GPUQ_INVALID_ARGUMENT;
  }
  args->n = job->input_bytes / (2 * sizeof(float));
  if (job->output_capacity < args->n * sizeof(float)) {
    std::snprintf(job->error_message, job->error_message_capacity,
                  "the output needs %llu bytes, it has %llu",
                  static_cast<unsigned long long>(args->n * sizeof(float)),
                  static_cast<unsigned long long>(job->output_capacity));
    return GPUQ_INVALID_ARGUMENT;
  }
  args->a = static_cast<float>(a);
  return 0;
}

}  // namespace gpuq_example

extern "C" GPUQ_PLUGIN_EXPORT int gpuq_plugin_register(gpuq_plugin_registrar* registrar) {
  if (registrar->abi_version != GPUQ_PLUGIN_ABI_VERSION) return GPUQ_PROTOCOL_MISMATCH;
#if GPUQ_EXAMPLE_PLUGIN_HAVE_CUDA
  gpuq_plugin_op_fn gpu = gpuq_example::saxpy_gpu;
#else
  gpuq_plugin_op_fn gpu = nullptr;
#endif
  return registrar->add_op(registrar, "saxpy", "y = a x + y over float32 (example plug-in)",
                           saxpy_cpu, gpu);
}
