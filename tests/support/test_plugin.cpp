// Test-only plug-ins (gpuq/plugin.h), one source built three ways (tests/CMakeLists.txt):
// - gpuq_test_plugin: op plugin_gpu_only (a gpu function only: a job for it on a cpu pool fails
//   UnknownOp); ops plugin_spin (spins forever and never looks at its cancel flag; on a GPU, a
//   kernel that never ends) and plugin_block (sleeps in a blocking system call forever), for
//   the time-limit tests; plugin_fail (fails OpFailed with a message of exactly `bytes` bytes
//   (int param): "<bytes>:" and then the digits 0-9 over and over, so that a cut shows); and, with
//   CUDA, op plugin_oob_write (a kernel that writes far out of
//   bounds: a real sticky CUDA error, for the worker-replacement test).
// - gpuq_test_plugin_bad_register (GPUQ_TEST_PLUGIN_FAIL=1): gpuq_plugin_register returns an
//   error.
// - gpuq_test_plugin_clash (GPUQ_TEST_PLUGIN_CLASH=1): registers an op named "echo", a built-in.
#include "gpuq/plugin.h"

#ifndef GPUQ_TEST_PLUGIN_HAVE_CUDA
#define GPUQ_TEST_PLUGIN_HAVE_CUDA 0
#endif

#include <poll.h>

#include <cstdio>
#include <cstring>

#if GPUQ_TEST_PLUGIN_HAVE_CUDA
int gpuq_test_plugin_oob_write(gpuq_plugin_job* job);    // test_plugin_fault.cu
int gpuq_test_plugin_spin_kernel(gpuq_plugin_job* job);  // test_plugin_fault.cu
#endif

namespace {

[[maybe_unused]] int gpu_only_noop(gpuq_plugin_job* job) {
  job->value = 7;
  return 0;
}

// A hung op: a loop that never ends and never reads job->cancel_requested.
[[maybe_unused]] int spin_forever(gpuq_plugin_job*) {
  for (;;) {
    asm volatile("" ::: "memory");  // a side effect: the loop is not optimised away
  }
}

// A hung op in the kernel: a blocking call that never returns (no descriptor, no timeout).
[[maybe_unused]] int block_forever(gpuq_plugin_job*) {
  for (;;) (void)::poll(nullptr, 0, -1);
}

// Fails with a message of `bytes` bytes (at most the capacity the worker gives, less its NUL).
[[maybe_unused]] int fail_with_message(gpuq_plugin_job* job) {
  int64_t bytes = 0;
  if (job->get_int(job, "bytes", &bytes) != GPUQ_PLUGIN_PARAM_FOUND || bytes < 8) {
    std::snprintf(job->error_message, job->error_message_capacity, "param bytes (int >= 8)");
    return GPUQ_INVALID_ARGUMENT;
  }
  const size_t n = static_cast<size_t>(bytes) < job->error_message_capacity - 1
                       ? static_cast<size_t>(bytes)
                       : job->error_message_capacity - 1;
  const int head = std::snprintf(job->error_message, n + 1, "%lld:", static_cast<long long>(bytes));
  for (size_t i = static_cast<size_t>(head); i < n; ++i) {
    job->error_message[i] = static_cast<char>('0' + i % 10);
  }
  job->error_message[n] = '\0';
  return GPUQ_OP_FAILED;
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
  gpuq_plugin_op_fn gpu_spin = gpuq_test_plugin_spin_kernel;
#else
  gpuq_plugin_op_fn gpu_spin = spin_forever;
#endif
  if (int r = registrar->add_op(registrar, "plugin_spin",
                                "test only: never ends, never looks at its cancel flag",
                                spin_forever, gpu_spin);
      r != 0) {
    return r;
  }
  if (int r =
          registrar->add_op(registrar, "plugin_block", "test only: blocks in a system call forever",
                            block_forever, block_forever);
      r != 0) {
    return r;
  }
  if (int r = registrar->add_op(registrar, "plugin_fail",
                                "test only: fails with a message of `bytes` bytes",
                                fail_with_message, fail_with_message);
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
