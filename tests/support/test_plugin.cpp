// Test-only plug-ins (gpuq/plugin.h), one source built three ways (tests/CMakeLists.txt):
// - gpuq_test_plugin: op plugin_gpu_only (a gpu function only: a job for it on a cpu pool fails
//   UnknownOp) and, with CUDA, op plugin_oob_write (a kernel that writes far out of bounds: a
//   real sticky CUDA error, for the worker-replacement test).
// - gpuq_test_plugin_bad_register (GPUQ_TEST_PLUGIN_FAIL=1): gpuq_plugin_register returns an
//   error.
// - gpuq_test_plugin_clash (GPUQ_TEST_PLUGIN_CLASH=1): registers an op named "echo", a built-in.
#include "gpuq/plugin.h"

#ifndef GPUQ_TEST_PLUGIN_HAVE_CUDA
#define GPUQ_TEST_PLUGIN_HAVE_CUDA 0
#endif

#if GPUQ_TEST_PLUGIN_HAVE_CUDA
int gpuq_test_plugin_oob_write(gpuq_plugin_job* job);  // test_plugin_fault.cu
#endif

namespace {

[[maybe_unused]] int gpu_only_noop(gpuq_plugin_job* job) {
  job->value = 7;
  return 0;
}

}  // namespace

extern "C" GPUQ_PLUGIN_EXPORT int gpuq_plugin_register(gpuq_plugin_registrar* registrar) {
#if defined(GPUQ_TEST_PLUGIN_FAIL)
  (void)registrar;
  return GPUQ_NO_DEVICE;
#elif defined(GPUQ_TEST_PLUGIN_CLASH)
  return registrar->add_op(registrar, "echo", "clashes with the built-in", gpu_only_noop, nullptr);
#else
  if (int r = registrar->add_op(registrar, "plugin_gpu_only", "test only: no cpu function", nullptr,
                                gpu_only_noop);
      r != 0) {
    return r;
  }
#if GPUQ_TEST_PLUGIN_HAVE_CUDA
  return registrar->add_op(registrar, "plugin_oob_write",
                           "test only: a kernel that writes far out of bounds", nullptr,
                           gpuq_test_plugin_oob_write);
#else
  return 0;
#endif
#endif
}
