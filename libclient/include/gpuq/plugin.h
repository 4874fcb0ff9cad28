/* gpuq plug-in ops, C ABI.
 *
 * A plug-in is a shared library that adds ops to gpuq without rebuilding it. The config key
 * `plugins` names it (an absolute path); every worker dlopens it (RTLD_NOW | RTLD_LOCAL) at start,
 * before it reports ready, and calls its exported gpuq_plugin_register() once. The supervisor
 * never loads a plug-in: it learns the ops from a child (`gpuq-worker --list-plugin-ops PATH`).
 *
 *   static int scale_cpu(gpuq_plugin_job* job) {
 *     double k;
 *     if (job->get_float(job, "k", &k) != GPUQ_PLUGIN_PARAM_FOUND) {
 *       snprintf(job->error_message, job->error_message_capacity, "param k (float) is required");
 *       return GPUQ_INVALID_ARGUMENT;
 *     }
 *     ...
 *     job->output_bytes = job->input_bytes;
 *     return 0;
 *   }
 *   GPUQ_PLUGIN_EXPORT int gpuq_plugin_register(gpuq_plugin_registrar* r) {
 *     if (r->abi_version != GPUQ_PLUGIN_ABI_VERSION) return GPUQ_PROTOCOL_MISMATCH;
 *     return r->add_op(r, "scale", "multiplies float32 by param k", scale_cpu, NULL);
 *   }
 *
 * Contract
 * - Op ids: 2000 + the op's index over all plug-ins, in config order then registration order.
 *   Names: 1-48 characters of [a-z0-9_], unique across built-in and plug-in ops; a clash is a
 *   start-up error of gpuqd naming the plug-in.
 * - Threading: gpuq_plugin_register and every op function are called from one worker thread,
 *   one job at a time; a worker process runs its jobs in sequence. Several worker processes may
 *   run the same op at once (each has its own copy of the library's globals).
 * - Buffers, the params accessors and the job struct are valid only during the call.
 * - On a CPU worker, `input`/`output` are host pointers into the client's shared memory.
 * - On a GPU worker, `input`/`output` are DEVICE pointers from the worker's budgeted pool (the
 *   input is already copied there). The op enqueues its work on `cuda_stream` and returns; the
 *   worker synchronizes the stream and copies `output_bytes` back to the client. A failing CUDA
 *   call should be reported as GPUQ_OP_FAILED; if the context is poisoned (a sticky error), only
 *   this job fails and the worker is replaced.
 * - An op returns 0 on success, else a gpuq_status_t code (gpuq.h), with a NUL-terminated reason
 *   in `error_message` (GPUQ_OP_FAILED if the code is not a known one).
 * - No C++ exception may leave an op or the register function.
 */
#ifndef GPUQ_PLUGIN_H_
#define GPUQ_PLUGIN_H_

#include <stddef.h>
#include <stdint.h>

#include "gpuq/gpuq.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped on any incompatible change to the structs or functions below. */
#define GPUQ_PLUGIN_ABI_VERSION 1u

#if defined(__GNUC__)
#define GPUQ_PLUGIN_EXPORT __attribute__((visibility("default")))
#else
#define GPUQ_PLUGIN_EXPORT
#endif

/* What a params accessor returns. */
typedef enum gpuq_plugin_param_status {
  GPUQ_PLUGIN_PARAM_FOUND = 0,
  GPUQ_PLUGIN_PARAM_NOT_FOUND = 1, /* the job has no param of that key */
  GPUQ_PLUGIN_PARAM_WRONG_TYPE = 2 /* it has one, of another type; *out is untouched */
} gpuq_plugin_param_status;

typedef struct gpuq_plugin_job gpuq_plugin_job;

/* One job, as an op function sees it. Fields IN unless marked OUT. */
struct gpuq_plugin_job {
  uint32_t abi_version; /* GPUQ_PLUGIN_ABI_VERSION of the worker */
  uint32_t op_id;       /* the op's id (2000 + ...) */

  const void* input; /* host (CPU pool) or device (GPU pool) pointer */
  uint64_t input_bytes;
  void* output; /* host or device pointer, `output_capacity` bytes */
  uint64_t output_capacity;
  uint64_t output_bytes; /* OUT: bytes written to output (<= output_capacity); 0 on entry */
  uint64_t value;        /* OUT: the job's result value; 0 on entry */

  /* Params by key. `out` is written only when GPUQ_PLUGIN_PARAM_FOUND is returned. A string
   * is NUL-terminated and valid during the call. */
  gpuq_plugin_param_status (*get_int)(const gpuq_plugin_job* job, const char* key, int64_t* out);
  gpuq_plugin_param_status (*get_float)(const gpuq_plugin_job* job, const char* key, double* out);
  gpuq_plugin_param_status (*get_string)(const gpuq_plugin_job* job, const char* key,
                                         const char** out);

  /* GPU pools only (NULL on a CPU pool): cudaStream_t, cudnnHandle_t and cublasHandle_t, as
   * void*. The handles are bound to the stream. */
  void* cuda_stream;
  void* cudnn_handle;
  void* cublas_handle;

  /* Non-zero once the client asked to cancel; a long op may poll it and return GPUQ_CANCELLED.
   * Read it with a relaxed atomic load (it is a std::atomic<uint32_t> in the worker). */
  const volatile uint32_t* cancel_requested;

  /* OUT: the reason of a failure, NUL-terminated, at most capacity - 1 bytes (2047: a job's
   * whole message). */
  char* error_message;
  size_t error_message_capacity;

  void* internal; /* the worker's; do not touch */
};

/* An op: returns 0, or a gpuq_status_t code with error_message filled. */
typedef int (*gpuq_plugin_op_fn)(gpuq_plugin_job* job);

typedef struct gpuq_plugin_registrar gpuq_plugin_registrar;

struct gpuq_plugin_registrar {
  uint32_t abi_version; /* GPUQ_PLUGIN_ABI_VERSION of the loading worker */
  /* Registers one op. `name` and `summary` are copied. `cpu_fn` runs it on cpu pools,
   * `gpu_fn` on gpu pools; either may be NULL (a job on that pool kind fails
   * GPUQ_UNKNOWN_OP), not both. Returns 0, or GPUQ_INVALID_ARGUMENT (bad name, both NULL,
   * a name already added by this plug-in). */
  int (*add_op)(gpuq_plugin_registrar* registrar, const char* name, const char* summary,
                gpuq_plugin_op_fn cpu_fn, gpuq_plugin_op_fn gpu_fn);
  void* internal; /* the worker's; do not touch */
};

/* Exported by every plug-in. Returns 0, or a non-zero code: the plug-in fails to load and
 * gpuqd does not start (its error names the plug-in and the code). */
GPUQ_PLUGIN_EXPORT int gpuq_plugin_register(gpuq_plugin_registrar* registrar);

typedef int (*gpuq_plugin_register_fn)(gpuq_plugin_registrar* registrar);

#ifdef __cplusplus
}
#endif

#endif /* GPUQ_PLUGIN_H_ */
