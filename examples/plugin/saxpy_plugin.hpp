// The example plug-in's pieces shared by its CPU (saxpy_plugin.cpp) and GPU (saxpy_kernel.cu)
// functions.
#pragma once

#include <cstdint>

#include "gpuq/plugin.h"

namespace gpuq_example {

struct SaxpyArgs {
  uint64_t n = 0;  // elements of x, of y and of the result
  float a = 0;
};

// Checks the job's param `a` and buffer sizes; 0, or a gpuq code with error_message filled.
int saxpy_args(gpuq_plugin_job* job, SaxpyArgs* args);

// The CUDA function: device pointers, enqueued on the job's stream.
int saxpy_gpu(gpuq_plugin_job* job);

}  // namespace gpuq_example
