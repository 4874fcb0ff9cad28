/* gpuq client library, C ABI.
 *
 * A C99 interface over the C++ API in <gpuq/client.hpp>, for C programs and for language bindings
 * (Python ctypes/cffi). It is a thin layer: the semantics of each call are those of the C++ call
 * it names.
 *
 *   gpuq_client_t* client;
 *   if (gpuq_connect(NULL, &client) != GPUQ_OK) {
 *     fprintf(stderr, "gpuq: %s\n", gpuq_last_error_message());
 *     return 1;
 *   }
 *   gpuq_buffer_t in, out;
 *   gpuq_alloc(client, 4096, &in);
 *   gpuq_alloc(client, 4096, &out);
 *   memcpy(in.data, src, 4096);
 *
 *   gpuq_job_spec_t spec = {0};
 *   spec.version = GPUQ_JOB_SPEC_VERSION;
 *   spec.op = "echo";
 *   spec.input = in;
 *   spec.output = out;
 *   gpuq_job_t* job;
 *   gpuq_submit(client, &spec, -1, &job);
 *
 *   gpuq_job_result_t result = {0};
 *   result.version = GPUQ_JOB_RESULT_VERSION;
 *   gpuq_job_wait(job, -1, &result);     // result.status == GPUQ_JOB_DONE
 *   gpuq_job_release(job);
 *   gpuq_disconnect(client);
 *
 * Conventions
 * - Every function that can fail returns a gpuq_status_t; GPUQ_OK (0) is success. On failure the
 *   OUT arguments are left unchanged, and gpuq_last_error_message() returns the message of the
 *   failure on this thread.
 * - Versioned structs: the first field, `version`, must be set by the caller to the struct's
 *   GPUQ_..._VERSION macro, which encodes the struct's size and a revision number
 *   (sizeof | revision << 24, as in DCGM). A struct whose version the library does not know is
 *   rejected with GPUQ_INVALID_ARGUMENT. Zero-initialise the struct, then set `version`: every
 *   field's zero value means "the default".
 * - Fields are marked IN (read by the library) or OUT (written by the library).
 * - Timeouts are in nanoseconds; a negative timeout waits forever.
 * - No C++ exception crosses this interface: an unexpected one becomes GPUQ_INTERNAL.
 * - A client never touches CUDA, and the library links no CUDA library.
 *
 * Thread-safety: a gpuq_client_t may be used from many threads at once. gpuq_job_wait,
 * gpuq_job_poll and gpuq_job_cancel of one gpuq_job_t may run in several threads at once (as
 * gpuq::Job's wait, poll and cancel); gpuq_job_release must not overlap any call on it. Neither
 * survives fork(): in the child every call on them returns GPUQ_FORKED_CLIENT; connect a new
 * client there.
 */
#ifndef GPUQ_GPUQ_H_
#define GPUQ_GPUQ_H_

#include <stddef.h>
#include <stdint.h>

#include "gpuq/export.hpp"

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes. The values are those of gpuq::ErrorCode (gpuq/error.hpp) and of the wire
 * format: new codes are appended, never renumbered. */
typedef enum gpuq_status {
  GPUQ_OK = 0,
  GPUQ_INVALID_ARGUMENT = 1,   /* a field of a request is malformed; the message names it */
  GPUQ_UNKNOWN_OP = 2,         /* no op of that name is registered */
  GPUQ_UNKNOWN_POOL = 3,       /* no pool of that name */
  GPUQ_QUEUE_FULL = 4,         /* try_submit: the pool's ring or this client's share is full */
  GPUQ_TIMEOUT = 5,            /* a deadline passed before the call could complete */
  GPUQ_CANCELLED = 6,          /* the job was cancelled before it started */
  GPUQ_EXPIRED = 7,            /* the job's deadline passed while it was still queued */
  GPUQ_WORKER_DIED = 8,        /* the worker running the job exited */
  GPUQ_DISCONNECTED = 9,       /* the daemon is gone (or restarted); reconnect */
  GPUQ_PROTOCOL_MISMATCH = 10, /* client and daemon speak different protocol versions */
  GPUQ_PERMISSION_DENIED = 11, /* this process is not an allowed user or group */
  GPUQ_OUT_OF_MEMORY = 12,     /* no room in the payload segment, or no free job slot */
  GPUQ_NOT_FOUND = 13,         /* no such job, buffer or object */
  GPUQ_SHUTTING_DOWN = 14,     /* the daemon is draining and accepts no new jobs */
  GPUQ_FORKED_CLIENT = 15,     /* this handle was created by the parent of a fork() */
  GPUQ_NO_DEVICE = 16,         /* the pool has no usable device */
  GPUQ_INTERNAL = 17,          /* a bug in gpuq; the message says where */
  GPUQ_SYSTEM_ERROR = 18,      /* a system call failed; the message names it and errno */
  GPUQ_NOT_CANCELLABLE = 19,   /* cancel: the job has already finished */
  GPUQ_TOO_MANY_CLIENTS = 20,  /* the daemon serves its configured maximum of clients */
  GPUQ_OP_FAILED = 21,         /* the op itself reported failure; the message says why */
  GPUQ_TIMED_OUT = 22,         /* the job ran past its time limit and was stopped */
  GPUQ_POOL_DOWN = 23          /* the pool has had no ready worker for pool_down_fail_ms; the
                                  message names it and its last worker's exit */
} gpuq_status_t;

/* The state of a job. */
typedef enum gpuq_job_status {
  GPUQ_JOB_QUEUED = 0,
  GPUQ_JOB_RUNNING = 1,
  GPUQ_JOB_DONE = 2,      /* finished successfully */
  GPUQ_JOB_FAILED = 3,    /* finished with an error: see gpuq_job_result_t.code */
  GPUQ_JOB_CANCELLED = 4, /* cancelled (gpuq_job_cancel()) */
  GPUQ_JOB_EXPIRED = 5    /* its expire_after_ns passed while it was still queued */
} gpuq_job_status_t;

/* Type of a job parameter (gpuq_param_t.type). */
typedef enum gpuq_param_type {
  GPUQ_PARAM_INT = 1,   /* gpuq_param_t.i */
  GPUQ_PARAM_FLOAT = 2, /* gpuq_param_t.f */
  GPUQ_PARAM_STRING = 3 /* gpuq_param_t.s, NUL-terminated, at most 64 bytes */
} gpuq_param_type_t;

/* Builds a struct version: the struct's size and a revision number (DCGM style). */
#define GPUQ_STRUCT_VERSION(type, revision) \
  ((uint32_t)(sizeof(type) | ((uint32_t)(revision) << 24)))

/* Opaque handles. */
typedef struct gpuq_client gpuq_client_t; /* a connection to the daemon */
typedef struct gpuq_job gpuq_job_t;       /* a submitted job */

/* Options of gpuq_connect(). */
typedef struct gpuq_connect_options {
  uint32_t version;        /* IN: GPUQ_CONNECT_OPTIONS_VERSION */
  const char* runtime_dir; /* IN: the daemon's runtime directory. NULL or "": $GPUQ_RUNTIME_DIR,
                              else the user's own ($RUNTIME_DIRECTORY, else
                              $XDG_RUNTIME_DIR/gpuq, else /tmp/gpuq-$UID) if a socket is
                              there, else /run/gpuq if it exists (docs/service.md) */
  uint64_t segment_bytes;  /* IN: size of this client's payload segment (rounded up to 4 KiB);
                              0: the daemon's default */
  const char* name;        /* IN: a name for the daemon's logs and status. NULL: the program name */
  int64_t spin_ns;         /* IN: how long gpuq_job_wait() spins before it sleeps.
                              0: the library default (50 us); negative: never spin */
  uint32_t flags;          /* IN (revision 2): GPUQ_CONNECT_* flags, or 0 */
} gpuq_connect_options_t;
/* Revision 1 ended at spin_ns (40 bytes); the library still accepts it (flags 0). */
#define GPUQ_CONNECT_OPTIONS_VERSION1 ((uint32_t)(40u | (1u << 24)))
#define GPUQ_CONNECT_OPTIONS_VERSION2 GPUQ_STRUCT_VERSION(gpuq_connect_options_t, 2)
#define GPUQ_CONNECT_OPTIONS_VERSION GPUQ_CONNECT_OPTIONS_VERSION2

/* gpuq_connect_options_t.flags */
/* Jobs still running when this client disconnects or exits run to their end, their results
 * dropped. Without it the daemon cancels them, and stops (and replaces) the worker of one whose
 * op has not ended cancel_grace_ms later (docs/config.md), so that they stop holding workers. */
#define GPUQ_CONNECT_KEEP_RUNNING_JOBS 0x1u

/* A buffer in the client's payload segment, where workers read inputs and write outputs in
 * place. Filled in by gpuq_alloc(); a part of one (same offset + k, data + k, smaller size) is a
 * buffer too. Valid until gpuq_free() or gpuq_disconnect(). */
typedef struct gpuq_buffer {
  uint64_t offset; /* OUT: offset from the start of the payload segment */
  uint64_t size;   /* OUT: bytes */
  void* data;      /* OUT: this process's address of the first byte */
} gpuq_buffer_t;

/* A small job parameter. Keys are 1-32 characters of [a-z0-9_.]; all of a job's parameters
 * together take at most 192 bytes encoded. */
typedef struct gpuq_param {
  const char* key; /* IN: the name */
  int type;        /* IN: a gpuq_param_type_t; selects which of i, f, s is read */
  int64_t i;       /* IN: value of a GPUQ_PARAM_INT */
  double f;        /* IN: value of a GPUQ_PARAM_FLOAT */
  const char* s;   /* IN: value of a GPUQ_PARAM_STRING */
} gpuq_param_t;

/* What to run: the argument of gpuq_submit(). */
typedef struct gpuq_job_spec {
  uint32_t version;           /* IN: GPUQ_JOB_SPEC_VERSION */
  const char* op;             /* IN: op name ("noop", "echo", "sleep", "checksum", ...) */
  const char* pool;           /* IN: pool name. NULL or "": the first pool */
  gpuq_buffer_t input;        /* IN: from gpuq_alloc() (or a part of one); size 0: none */
  gpuq_buffer_t output;       /* IN: from gpuq_alloc() (or a part of one); size 0: none */
  const gpuq_param_t* params; /* IN: param_count parameters (NULL when param_count is 0) */
  uint32_t param_count;       /* IN */
  int64_t expire_after_ns;    /* IN: if still queued this long after submission, the job ends
                                 GPUQ_JOB_EXPIRED without running. 0 or negative: never */
  uint32_t flags;             /* IN (revision 2): GPUQ_JOB_* flags, or 0 */
  uint32_t time_limit_ms;     /* IN (revision 3): the longest the job may run once started.
                                 0: no limit of its own. The smaller of it and the pool's
                                 job_time_limit_ms applies: past it the op is asked to stop,
                                 and cancel_grace_ms later its worker is stopped (and replaced);
                                 either way the job ends GPUQ_JOB_FAILED with GPUQ_TIMED_OUT */
  int32_t priority;           /* IN (revision 4): GPUQ_PRIORITY_NORMAL (0), _HIGH or _LOW.
                                 Higher levels are taken first; a lower level that waits still
                                 gets at least a tenth of the pool's starts */
  uint32_t stream_window;     /* IN (revision 5): 0, or a streaming job whose op makes its
                                 answer in parts, each read with gpuq_job_next_part() as soon as
                                 it is made: `output` is cut into stream_window (1 to 8) equal
                                 cells of 64 bytes or more, and at most that many parts wait
                                 unread (the op waits for room). Not with GPUQ_JOB_RETRYABLE */
} gpuq_job_spec_t;
/* Revision 1 ended at expire_after_ns (96 bytes); the library still accepts it (flags 0,
 * time_limit_ms 0). Revision 2 ended at flags: the same 104 bytes as revision 3 (time_limit_ms
 * took padding), so its revision number alone tells them apart; it is still accepted
 * (time_limit_ms 0, whatever those bytes hold). Revision 3 ended at time_limit_ms (104 bytes;
 * priority normal). Revision 4 ended at priority: the same 112 bytes as revision 5
 * (stream_window took padding), told apart by the revision number (not a stream). */
#define GPUQ_JOB_SPEC_VERSION1 ((uint32_t)(96u | (1u << 24)))
#define GPUQ_JOB_SPEC_VERSION2 ((uint32_t)(104u | (2u << 24)))
#define GPUQ_JOB_SPEC_VERSION3 ((uint32_t)(104u | (3u << 24)))
#define GPUQ_JOB_SPEC_VERSION4 ((uint32_t)(112u | (4u << 24)))
#define GPUQ_JOB_SPEC_VERSION5 GPUQ_STRUCT_VERSION(gpuq_job_spec_t, 5)
#define GPUQ_JOB_SPEC_VERSION GPUQ_JOB_SPEC_VERSION5

/* gpuq_job_spec_t.priority (gpuq::Priority in C++, the same numbers) */
#define GPUQ_PRIORITY_NORMAL 0
#define GPUQ_PRIORITY_HIGH 1
#define GPUQ_PRIORITY_LOW 2

/* gpuq_job_spec_t.flags */
#define GPUQ_JOB_RETRYABLE 0x1u /* if its worker dies while running it, run it again (once) */

/* A job's failure message, NUL included: a worker's whole message (revision 1 of
 * gpuq_job_result_t had 256 bytes; the library still fills such a struct, truncated). */
#define GPUQ_MESSAGE_BYTES 2048

/* The outcome of a finished job. */
typedef struct gpuq_job_result {
  uint32_t version;                 /* IN: GPUQ_JOB_RESULT_VERSION */
  gpuq_job_status_t status;         /* OUT: GPUQ_JOB_DONE, _FAILED, _CANCELLED or _EXPIRED */
  gpuq_status_t code;               /* OUT: GPUQ_OK when done; why, otherwise */
  char message[GPUQ_MESSAGE_BYTES]; /* OUT: the worker's message for a failure, NUL-terminated
                                       (truncated to GPUQ_MESSAGE_BYTES - 1 bytes) */
  uint64_t output_size;             /* OUT: bytes the op wrote to the output buffer */
  uint64_t value;                   /* OUT: the op's scalar result (checksum: the CRC32C) */
  uint32_t worker_id;               /* OUT: the worker that ran it */
  uint64_t queued_ns;               /* OUT: submission -> start */
  uint64_t run_ns;                  /* OUT: start -> finish */
} gpuq_job_result_t;
/* Revision 1: the same fields with a 256-byte message (312 bytes in all). */
#define GPUQ_JOB_RESULT_VERSION1 ((uint32_t)(312u | (1u << 24)))
#define GPUQ_JOB_RESULT_VERSION2 GPUQ_STRUCT_VERSION(gpuq_job_result_t, 2)
#define GPUQ_JOB_RESULT_VERSION GPUQ_JOB_RESULT_VERSION2

/* ---- Connection ------------------------------------------------------------------------------ */

/* Connects to the daemon: checks the protocol version, is authenticated by the daemon and maps
 * this client's payload segment. `options` may be NULL (all defaults). On success *out is a new
 * client, to be closed with gpuq_disconnect().
 * Errors: GPUQ_INVALID_ARGUMENT (out NULL, unknown options->version, unknown flags, bad option),
 * GPUQ_DISCONNECTED (no daemon at the socket), GPUQ_PROTOCOL_MISMATCH, GPUQ_PERMISSION_DENIED,
 * GPUQ_TOO_MANY_CLIENTS, GPUQ_SYSTEM_ERROR, GPUQ_INTERNAL.
 * Blocking. Thread-safe. */
GPUQ_API gpuq_status_t gpuq_connect(const gpuq_connect_options_t* options, gpuq_client_t** out);

/* Closes a client and unmaps its payload segment: its buffers become invalid. Jobs not yet
 * released keep what they need alive; release them too. NULL is ignored.
 * Errors: none (always GPUQ_OK).
 * Blocking (briefly). Not thread-safe with other calls on the same client: call it last. */
GPUQ_API gpuq_status_t gpuq_disconnect(gpuq_client_t* client);

/* Connects again with the same options (after GPUQ_DISCONNECTED: the daemon died or stopped and
 * a new one started; or in a forked child, for a connection of its own). On success the client
 * uses the new connection: unreleased jobs of the old one return GPUQ_DISCONNECTED and its
 * buffers are invalid (allocate new ones). On failure nothing changes.
 * Errors: as gpuq_connect(), and GPUQ_INVALID_ARGUMENT (client NULL).
 * Blocking. Not thread-safe with other calls on the same client. */
GPUQ_API gpuq_status_t gpuq_reconnect(gpuq_client_t* client);

/* ---- Payload buffers --------------------------------------------------------------------------
 */

/* Allocates `size` bytes, 64-byte aligned, in the client's payload segment.
 * Errors: GPUQ_INVALID_ARGUMENT (client or out NULL, size 0), GPUQ_OUT_OF_MEMORY (segment
 * full), GPUQ_FORKED_CLIENT, GPUQ_INTERNAL.
 * Thread-safe. */
GPUQ_API gpuq_status_t gpuq_alloc(gpuq_client_t* client, uint64_t size, gpuq_buffer_t* out);

/* Returns a buffer from gpuq_alloc(). Freeing a buffer that a queued or running job uses is the
 * caller's bug: the job may read or write freed memory (only this client's own).
 * Errors: GPUQ_INVALID_ARGUMENT (client or buffer NULL), GPUQ_INTERNAL.
 * Thread-safe. */
GPUQ_API gpuq_status_t gpuq_free(gpuq_client_t* client, const gpuq_buffer_t* buffer);

/* ---- Jobs ---------------------------------------------------------------------------------------
 */

/* Submits a job, waiting up to `timeout_ns` for room in the pool's ring (negative: forever).
 * On success *out is a new job handle, to be released with gpuq_job_release().
 * Errors: GPUQ_INVALID_ARGUMENT (a NULL argument, unknown spec->version, a bad field or
 * parameter: the message names it), GPUQ_UNKNOWN_OP, GPUQ_UNKNOWN_POOL, GPUQ_TIMEOUT (the ring
 * stayed full, or every one of this client's job slots held an unfinished job), GPUQ_NO_DEVICE
 * (the pool is unavailable and has no fallback), GPUQ_SHUTTING_DOWN, GPUQ_POOL_DOWN (the pool
 * has had no ready worker for pool_down_fail_ms), GPUQ_DISCONNECTED, GPUQ_FORKED_CLIENT,
 * GPUQ_INTERNAL. A finished job gives its slot back when a
 * submit needs it (its result stays with its handle), so any number of handles may be held.
 * Blocking while the ring is full. Thread-safe; lock-free when there is room. */
GPUQ_API gpuq_status_t gpuq_submit(gpuq_client_t* client, const gpuq_job_spec_t* spec,
                                   int64_t timeout_ns, gpuq_job_t** out);

/* Like gpuq_submit() but fails with GPUQ_QUEUE_FULL at once when there is no room.
 * Errors: those of gpuq_submit(), with GPUQ_QUEUE_FULL instead of GPUQ_TIMEOUT.
 * Never blocks. Thread-safe. */
GPUQ_API gpuq_status_t gpuq_try_submit(gpuq_client_t* client, const gpuq_job_spec_t* spec,
                                       gpuq_job_t** out);

/* Waits until the job is finished or `timeout_ns` passes (negative: forever): spins briefly,
 * then sleeps. GPUQ_OK means the job finished, successfully or not: *out says how (status, code,
 * message). The result stays readable: waiting again returns it again.
 * Errors: GPUQ_INVALID_ARGUMENT (job or out NULL, unknown out->version), GPUQ_TIMEOUT (the job
 * is still pending; wait again), GPUQ_DISCONNECTED (the daemon died), GPUQ_FORKED_CLIENT,
 * GPUQ_INTERNAL.
 * Blocking. One thread at a time per job. */
GPUQ_API gpuq_status_t gpuq_job_wait(gpuq_job_t* job, int64_t timeout_ns, gpuq_job_result_t* out);

/* A part of a streaming job's answer (gpuq_job_next_part()). */
typedef struct gpuq_job_part {
  uint32_t index;   /* OUT: 0 for the first part, then 1, 2, ... */
  uint32_t end;     /* OUT: 1 when the stream has ended well (no part: data NULL, size 0) */
  const void* data; /* OUT: the part's bytes, in the job's output buffer: valid until the next
                       gpuq_job_next_part() on this job (which gives its cell back) or its
                       release */
  uint64_t size;    /* OUT: the part's size in bytes */
} gpuq_job_part_t;

/* A streaming job's next part (gpuq_job_spec_t.stream_window > 0), as soon as its op has made
 * it: waits until the part comes, the job ends, or `timeout_ns` passes (negative: forever).
 * Parts come in order, each once. GPUQ_OK with out->end 0: a part; with out->end 1: the stream
 * ended well (gpuq_job_wait() returns the job's result). After the last part it made, a job
 * that failed or was cancelled returns its error code (GPUQ_CANCELLED, GPUQ_TIMED_OUT,
 * GPUQ_OP_FAILED, ...; gpuq_last_error_message() has its message).
 * Errors besides: GPUQ_INVALID_ARGUMENT (job or out NULL, not a stream job), GPUQ_TIMEOUT (no
 * part yet: call again), GPUQ_DISCONNECTED, GPUQ_FORKED_CLIENT, GPUQ_INTERNAL.
 * Blocking. One thread at a time per job. */
GPUQ_API gpuq_status_t gpuq_job_next_part(gpuq_job_t* job, int64_t timeout_ns,
                                          gpuq_job_part_t* out);

/* The job's current status, without blocking.
 * Errors: GPUQ_INVALID_ARGUMENT (job or out NULL), GPUQ_DISCONNECTED, GPUQ_FORKED_CLIENT,
 * GPUQ_INTERNAL.
 * Lock-free. One thread at a time per job. */
GPUQ_API gpuq_status_t gpuq_job_poll(gpuq_job_t* job, gpuq_job_status_t* out);

/* Waits until one or more of the `count` jobs in `jobs` have ended, or `timeout_ns` passes
 * (negative: forever), or gpuq_job_wake_waiters() is called on their connection: one thread
 * watches many jobs without polling them (gpuq::Job::wait_any). On GPUQ_OK, ended[i] is set to 1
 * for each job that has ended (NULL entries count as ended) and to 0 for the others; all 0 when
 * the timeout passed or a wake-up came first. Read the ended ones with gpuq_job_wait().
 * Errors: GPUQ_INVALID_ARGUMENT (jobs or ended NULL with count > 0, jobs of two connections),
 * GPUQ_DISCONNECTED (seen within a second of the daemon's end), GPUQ_FORKED_CLIENT,
 * GPUQ_INTERNAL.
 * Blocking. Thread-safe; no gpuq_job_release of these jobs meanwhile. */
GPUQ_API gpuq_status_t gpuq_job_wait_any(gpuq_job_t* const* jobs, size_t count, int64_t timeout_ns,
                                         uint8_t* ended);

/* Wakes every thread in gpuq_job_wait_any() on this job's connection, whichever jobs it waits
 * on (for a watcher whose set of jobs changed). NULL is ignored.
 * Errors: none (always GPUQ_OK).
 * Lock-free. */
GPUQ_API gpuq_status_t gpuq_job_wake_waiters(gpuq_job_t* job);

/* Cancels the job. A queued job finishes GPUQ_JOB_CANCELLED at once. A running job is asked to
 * stop: an op that checks for cancellation (sleep, echo and checksum do) ends it
 * GPUQ_JOB_CANCELLED; an op that finishes first ends it with its result; an op that does
 * neither within the daemon's cancel_grace_ms has its worker stopped (and replaced), and the
 * job ends GPUQ_JOB_CANCELLED. gpuq_job_wait() returns the one terminal state.
 * Errors: GPUQ_INVALID_ARGUMENT (job NULL), GPUQ_NOT_CANCELLABLE (already finished),
 * GPUQ_DISCONNECTED, GPUQ_FORKED_CLIENT, GPUQ_INTERNAL.
 * Non-blocking. One thread at a time per job. */
GPUQ_API gpuq_status_t gpuq_job_cancel(gpuq_job_t* job);

/* Cancels the job only if no worker has started it (what concurrent.futures' cancel() means):
 * a queued job finishes GPUQ_JOB_CANCELLED at once and *cancelled (OUT) is 1; a running or
 * finished job is left as it is and *cancelled is 0.
 * Errors: GPUQ_INVALID_ARGUMENT (job or cancelled NULL), GPUQ_FORKED_CLIENT, GPUQ_INTERNAL.
 * Lock-free. */
GPUQ_API gpuq_status_t gpuq_job_cancel_queued(gpuq_job_t* job, int* cancelled);

/* Releases a job handle. An unfinished job is cancelled if it has not started, and otherwise
 * asked to stop as by gpuq_job_cancel(), its result discarded; its slot returns to the client
 * once it has ended. NULL is ignored. The handle is invalid afterwards.
 * Errors: none (always GPUQ_OK).
 * Non-blocking. One thread at a time per job. */
GPUQ_API gpuq_status_t gpuq_job_release(gpuq_job_t* job);

/* ---- Tensor ops (docs/ops.md) -------------------------------------------------------------- */

/* Element type of a tensor. CPU pools run GPUQ_DTYPE_F32 only. */
typedef enum gpuq_dtype {
  GPUQ_DTYPE_F32 = 1, /* IEEE binary32 */
  GPUQ_DTYPE_F16 = 2  /* IEEE binary16 */
} gpuq_dtype_t;

/* A dense, row-major tensor (NCHW when 4-D) at the start of a buffer. Plain data, as
 * gpuq_buffer_t. Zero-initialise it, then set its fields. */
typedef struct gpuq_tensor {
  gpuq_buffer_t buffer; /* IN: from gpuq_alloc() (or a part of one); holds the tensor's bytes */
  uint32_t rank;        /* IN: 1 to 4 */
  int32_t dtype;        /* IN: a gpuq_dtype_t; 0: GPUQ_DTYPE_F32 */
  int64_t dims[4];      /* IN: dims[0 .. rank), outermost first, each in [1, 2^31 - 1] */
} gpuq_tensor_t;

/* Options of gpuq_submit_conv2d(). NULL, or a zero-initialised struct with `version` set: the
 * defaults. */
typedef struct gpuq_conv2d_options {
  uint32_t version;    /* IN: GPUQ_CONV2D_OPTIONS_VERSION */
  uint32_t relu;       /* IN: nonzero: ReLU after the bias */
  int64_t stride[2];   /* IN: {SH, SW}; 0: 1 */
  int64_t pad[2];      /* IN: {PH, PW}; default 0 */
  int64_t dilation[2]; /* IN: {DH, DW}; 0: 1 */
  int64_t groups;      /* IN: 0: 1 */
  const char* pool;    /* IN: pool name. NULL or "": the first pool */
} gpuq_conv2d_options_t;
#define GPUQ_CONV2D_OPTIONS_VERSION1 GPUQ_STRUCT_VERSION(gpuq_conv2d_options_t, 1)
#define GPUQ_CONV2D_OPTIONS_VERSION GPUQ_CONV2D_OPTIONS_VERSION1

/* Options of gpuq_submit_gemm(). NULL, or a zero-initialised struct with `version` set: the
 * defaults. */
typedef struct gpuq_gemm_options {
  uint32_t version; /* IN: GPUQ_GEMM_OPTIONS_VERSION */
  uint32_t trans_a; /* IN: nonzero: op(a) is a transposed */
  uint32_t trans_b; /* IN: nonzero: op(b) is b transposed */
  double alpha;     /* IN: 0: 1 (an alpha of 0 would ignore a and b) */
  double beta;      /* IN: default 0; nonzero needs c */
  const char* pool; /* IN: pool name. NULL or "": the first pool */
} gpuq_gemm_options_t;
#define GPUQ_GEMM_OPTIONS_VERSION1 GPUQ_STRUCT_VERSION(gpuq_gemm_options_t, 1)
#define GPUQ_GEMM_OPTIONS_VERSION GPUQ_GEMM_OPTIONS_VERSION1

/* Submits y = conv(x, w) (+ b) (then ReLU), as Client::conv2d(): x N x C x H x W, w
 * K x C/groups x R x S, b (NULL: none) K elements, y N x K x OH x OW (docs/ops.md). The
 * tensors may lie in separate buffers of this client. Waits up to `timeout_ns` for room
 * (negative: forever). On success *out is a new job handle (gpuq_job_release()).
 * Errors: GPUQ_INVALID_ARGUMENT (a NULL argument, unknown options->version, an invalid or
 * inconsistent shape, y's shape not the result's, mixed dtypes, y overlapping an operand, a
 * tensor outside this client's segment, f16 for a cpu pool: the message names the operand or
 * key), then those of gpuq_submit().
 * Blocking while the ring is full. Thread-safe. */
GPUQ_API gpuq_status_t gpuq_submit_conv2d(gpuq_client_t* client, const gpuq_tensor_t* x,
                                          const gpuq_tensor_t* w, const gpuq_tensor_t* b,
                                          const gpuq_tensor_t* y,
                                          const gpuq_conv2d_options_t* options, int64_t timeout_ns,
                                          gpuq_job_t** out);

/* Submits y = alpha op(a) op(b) + beta c, as Client::gemm(): a and b 2-D as stored, op(a)
 * M x K, op(b) K x N, y M x N, c (NULL: none) M x N, given exactly when beta != 0.
 * Errors: as gpuq_submit_conv2d().
 * Blocking while the ring is full. Thread-safe. */
GPUQ_API gpuq_status_t gpuq_submit_gemm(gpuq_client_t* client, const gpuq_tensor_t* a,
                                        const gpuq_tensor_t* b, const gpuq_tensor_t* c,
                                        const gpuq_tensor_t* y, const gpuq_gemm_options_t* options,
                                        int64_t timeout_ns, gpuq_job_t** out);

/* Modes of gpuq_submit_activation(). */
typedef enum gpuq_activation_mode {
  GPUQ_ACTIVATION_RELU = 0,
  GPUQ_ACTIVATION_SIGMOID = 1,
  GPUQ_ACTIVATION_TANH = 2
} gpuq_activation_mode_t;

/* Options of gpuq_submit_activation(). NULL, or a zero-initialised struct with `version` set:
 * ReLU on the first pool. */
typedef struct gpuq_activation_options {
  uint32_t version; /* IN: GPUQ_ACTIVATION_OPTIONS_VERSION */
  int32_t mode;     /* IN: a gpuq_activation_mode_t; default GPUQ_ACTIVATION_RELU */
  const char* pool; /* IN: pool name. NULL or "": the first pool */
} gpuq_activation_options_t;
#define GPUQ_ACTIVATION_OPTIONS_VERSION1 GPUQ_STRUCT_VERSION(gpuq_activation_options_t, 1)
#define GPUQ_ACTIVATION_OPTIONS_VERSION GPUQ_ACTIVATION_OPTIONS_VERSION1

/* Options of gpuq_submit_softmax(). NULL, or a zero-initialised struct with `version` set: the
 * defaults. */
typedef struct gpuq_softmax_options {
  uint32_t version; /* IN: GPUQ_SOFTMAX_OPTIONS_VERSION */
  uint32_t log;     /* IN: nonzero: log-softmax */
  const char* pool; /* IN: pool name. NULL or "": the first pool */
} gpuq_softmax_options_t;
#define GPUQ_SOFTMAX_OPTIONS_VERSION1 GPUQ_STRUCT_VERSION(gpuq_softmax_options_t, 1)
#define GPUQ_SOFTMAX_OPTIONS_VERSION GPUQ_SOFTMAX_OPTIONS_VERSION1

/* Modes of gpuq_submit_pool2d(). */
typedef enum gpuq_pool_mode { GPUQ_POOL_MAX = 0, GPUQ_POOL_AVG = 1 } gpuq_pool_mode_t;

/* Options of gpuq_submit_pool2d(). NULL, or a zero-initialised struct with `version` set: the
 * defaults (a 1x1 max window). */
typedef struct gpuq_pool2d_options {
  uint32_t version;   /* IN: GPUQ_POOL2D_OPTIONS_VERSION */
  int32_t mode;       /* IN: a gpuq_pool_mode_t; default GPUQ_POOL_MAX */
  int64_t window[2];  /* IN: {R, S}; 0: 1 */
  int64_t stride[2];  /* IN: {SH, SW}; 0: the window's */
  int64_t pad[2];     /* IN: {PH, PW}; default 0, less than the window */
  uint32_t count_pad; /* IN: avg: nonzero divides by the whole window, padding included */
  uint32_t reserved;  /* IN: 0 */
  const char* pool;   /* IN: pool name. NULL or "": the first pool */
} gpuq_pool2d_options_t;
#define GPUQ_POOL2D_OPTIONS_VERSION1 GPUQ_STRUCT_VERSION(gpuq_pool2d_options_t, 1)
#define GPUQ_POOL2D_OPTIONS_VERSION GPUQ_POOL2D_OPTIONS_VERSION1

/* Options of gpuq_submit_batchnorm(). NULL, or a zero-initialised struct with `version` set:
 * the defaults. */
typedef struct gpuq_batchnorm_options {
  uint32_t version; /* IN: GPUQ_BATCHNORM_OPTIONS_VERSION */
  uint32_t relu;    /* IN: nonzero: ReLU after the normalization */
  double eps;       /* IN: 0: 1e-5; else > 0 */
  const char* pool; /* IN: pool name. NULL or "": the first pool */
} gpuq_batchnorm_options_t;
#define GPUQ_BATCHNORM_OPTIONS_VERSION1 GPUQ_STRUCT_VERSION(gpuq_batchnorm_options_t, 1)
#define GPUQ_BATCHNORM_OPTIONS_VERSION GPUQ_BATCHNORM_OPTIONS_VERSION1

/* Submits y = f(x) elementwise, as Client::activation(): y has x's shape (rank 1 to 4).
 * Errors: as gpuq_submit_conv2d(), and GPUQ_INVALID_ARGUMENT for a mode that is not a
 * gpuq_activation_mode_t. Blocking while the ring is full. Thread-safe. */
GPUQ_API gpuq_status_t gpuq_submit_activation(gpuq_client_t* client, const gpuq_tensor_t* x,
                                              const gpuq_tensor_t* y,
                                              const gpuq_activation_options_t* options,
                                              int64_t timeout_ns, gpuq_job_t** out);

/* Submits y = softmax(x) (or log-softmax) over dimension 1, as Client::softmax(): x rank 2 to
 * 4, y x's shape. Errors: as gpuq_submit_conv2d(). Blocking while the ring is full.
 * Thread-safe. */
GPUQ_API gpuq_status_t gpuq_submit_softmax(gpuq_client_t* client, const gpuq_tensor_t* x,
                                           const gpuq_tensor_t* y,
                                           const gpuq_softmax_options_t* options,
                                           int64_t timeout_ns, gpuq_job_t** out);

/* Submits max or average pooling, as Client::pool2d(): x N x C x H x W, y N x C x OH x OW with
 * OH = (H + 2 PH - R) / SH + 1 (docs/ops.md). Errors: as gpuq_submit_conv2d(), and
 * GPUQ_INVALID_ARGUMENT for a mode that is not a gpuq_pool_mode_t. Blocking while the ring is
 * full. Thread-safe. */
GPUQ_API gpuq_status_t gpuq_submit_pool2d(gpuq_client_t* client, const gpuq_tensor_t* x,
                                          const gpuq_tensor_t* y,
                                          const gpuq_pool2d_options_t* options, int64_t timeout_ns,
                                          gpuq_job_t** out);

/* Submits inference batch normalization, as Client::batchnorm(): y = scale (x - mean) /
 * sqrt(var + eps) + bias per channel; x N x C x H x W or N x C, scale, bias, mean and var C
 * elements each, y x's shape. Errors: as gpuq_submit_conv2d(). Blocking while the ring is full.
 * Thread-safe. */
GPUQ_API gpuq_status_t gpuq_submit_batchnorm(gpuq_client_t* client, const gpuq_tensor_t* x,
                                             const gpuq_tensor_t* scale, const gpuq_tensor_t* bias,
                                             const gpuq_tensor_t* mean, const gpuq_tensor_t* var,
                                             const gpuq_tensor_t* y,
                                             const gpuq_batchnorm_options_t* options,
                                             int64_t timeout_ns, gpuq_job_t** out);

/* ---- Daemon control ------------------------------------------------------------------------- */

/* The daemon's status document (the JSON of `gpuqctl status --json`), over a short control
 * connection that registers no client. `runtime_dir` as in gpuq_connect_options_t (NULL: the
 * default). On success *out_json is a NUL-terminated string to be freed with gpuq_string_free().
 * Errors: GPUQ_INVALID_ARGUMENT (out_json NULL), GPUQ_DISCONNECTED (no daemon),
 * GPUQ_PERMISSION_DENIED, GPUQ_PROTOCOL_MISMATCH, GPUQ_OUT_OF_MEMORY, GPUQ_INTERNAL.
 * Blocking. Thread-safe. */
GPUQ_API gpuq_status_t gpuq_daemon_status_json(const char* runtime_dir, char** out_json);

/* Frees a string returned by this library. NULL is ignored. Thread-safe. */
GPUQ_API void gpuq_string_free(char* s);

/* A rolling restart of pool `pool`: its workers are replaced one by one by new processes, each
 * made ready before the one it replaces stops taking jobs; no queued job is failed or reordered.
 * Returns once every worker runs the new generation, stored in `*generation` (when not NULL).
 * `timeout_s`: how long to wait for that (0: no limit; the rollout goes on after
 * GPUQ_TIMEOUT). `runtime_dir` as in gpuq_daemon_status_json(). Errors: GPUQ_UNKNOWN_POOL;
 * GPUQ_WORKER_DIED when a new worker did not start (gpuq_last_error_message() has its error;
 * the old workers serve on); GPUQ_INVALID_ARGUMENT when the pool has no seat for a new worker
 * or a NULL pool; GPUQ_SHUTTING_DOWN; those of gpuq_daemon_stop().
 * Blocking. Thread-safe. */
GPUQ_API gpuq_status_t gpuq_daemon_restart_pool(const char* runtime_dir, const char* pool,
                                                uint32_t timeout_s, uint32_t* generation);

/* Asks the daemon to read its config file again and apply what changed (docs/service.md,
 * "Config reload"). Returns once applied and the rolling restarts it started have ended; when
 * `changes` is not NULL, `*changes` gets one line per change, newline-separated, to be freed
 * with gpuq_string_free(). `timeout_s`: how long to wait (0: no limit). Errors:
 * GPUQ_INVALID_ARGUMENT (keys that cannot change live, a bad file: nothing changed),
 * GPUQ_WORKER_DIED (a rollout it started failed), GPUQ_SHUTTING_DOWN, those of
 * gpuq_daemon_stop(). Blocking. Thread-safe. */
GPUQ_API gpuq_status_t gpuq_daemon_reload(const char* runtime_dir, uint32_t timeout_s,
                                          char** changes);

/* Asks the daemon to drain (finish queued and running jobs, accept no new ones) and exit.
 * Returns once the daemon has acknowledged. `runtime_dir` as in gpuq_daemon_status_json().
 * Errors: GPUQ_DISCONNECTED (no daemon), GPUQ_PERMISSION_DENIED, GPUQ_PROTOCOL_MISMATCH,
 * GPUQ_INTERNAL.
 * Blocking. Thread-safe. */
GPUQ_API gpuq_status_t gpuq_daemon_stop(const char* runtime_dir);

/* ---- Diagnostics ------------------------------------------------------------------------------
 */

/* Stable name of a status code ("QueueFull"); "Unknown" for a value outside the enum. Never
 * NULL. Thread-safe. */
GPUQ_API const char* gpuq_status_name(gpuq_status_t code);

/* Name of a job status ("done"); "unknown" for a value outside the enum. Never NULL.
 * Thread-safe. */
GPUQ_API const char* gpuq_job_status_name(gpuq_job_status_t status);

/* The message of the last call on this thread that failed ("" if none has). Calls that succeed
 * leave it as it was. The string belongs to the library and stays valid until the next failing
 * call on this thread. Never NULL. Thread-safe (per thread). */
GPUQ_API const char* gpuq_last_error_message(void);

/* Library version ("0.1.0"). Never NULL. Thread-safe. */
GPUQ_API const char* gpuq_version(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GPUQ_GPUQ_H_ */
