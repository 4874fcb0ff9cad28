/* Integration test of the C ABI (gpuq/gpuq.h), as a plain C99 program.
 *
 *   c_api_test RUNTIME_DIR [time-limit | long-message]
 *
 * Connects to the daemon serving RUNTIME_DIR, runs an echo job and a checksum job and checks
 * their outputs (the checksum against a CRC32C computed here), checks that an unknown op fails
 * with GPUQ_UNKNOWN_OP, and exercises the argument checks of the C layer and the older revisions
 * of its versioned structs. With "time-limit", it runs only the checks of
 * gpuq_job_spec_t.time_limit_ms (jobs stopped at their limit end GPUQ_TIMED_OUT); with
 * "long-message", those of a 2000-byte failure message (the daemon must load the test plug-in:
 * op plugin_fail), whole in a gpuq_job_result_t and cut to 255 bytes in a revision-1 one. Prints
 * "c_api: N passed, M failed"; exits 0 when nothing failed, 1 otherwise, 2 on bad usage.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpuq/gpuq.h"
#include "gpuq/plugin.h" /* compiled as C99 here too: the plug-in ABI header is plain C */

static const int64_t kTimeoutNs = INT64_C(30000000000); /* 30 s: generous for loaded CI */

static int g_passed = 0;
static int g_failed = 0;

static void check(int ok, const char* what, int line) {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    fprintf(stderr, "c_api_test.c:%d: FAILED: %s (last error: %s)\n", line, what,
            gpuq_last_error_message());
  }
}
#define CHECK(cond) check((cond) ? 1 : 0, #cond, __LINE__)

/* CRC32C (Castagnoli): reflected polynomial 0x82F63B78, initial and final xor 0xFFFFFFFF. */
static uint32_t crc32c(const unsigned char* data, size_t size) {
  uint32_t crc = 0xFFFFFFFFu;
  size_t i;
  int k;
  for (i = 0; i < size; ++i) {
    crc ^= data[i];
    for (k = 0; k < 8; ++k) crc = (crc & 1u) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
  }
  return crc ^ 0xFFFFFFFFu;
}

static gpuq_job_result_t new_result(void) {
  gpuq_job_result_t r;
  memset(&r, 0, sizeof r);
  r.version = GPUQ_JOB_RESULT_VERSION;
  return r;
}

static gpuq_job_spec_t new_spec(const char* op) {
  gpuq_job_spec_t s;
  memset(&s, 0, sizeof s);
  s.version = GPUQ_JOB_SPEC_VERSION;
  s.op = op;
  return s;
}

/* Submits `spec` and waits for it. Returns the submit/wait status; the result in *result. */
static gpuq_status_t run_job(gpuq_client_t* client, const gpuq_job_spec_t* spec,
                             gpuq_job_result_t* result) {
  gpuq_job_t* job = NULL;
  gpuq_status_t s = gpuq_submit(client, spec, kTimeoutNs, &job);
  if (s != GPUQ_OK) return s;
  s = gpuq_job_wait(job, kTimeoutNs, result);
  gpuq_job_release(job);
  return s;
}

static void test_library_facts(void) {
  CHECK(strcmp(gpuq_status_name(GPUQ_OK), "Ok") == 0);
  CHECK(strcmp(gpuq_status_name(GPUQ_QUEUE_FULL), "QueueFull") == 0);
  CHECK(strcmp(gpuq_status_name(GPUQ_OP_FAILED), "OpFailed") == 0);
  CHECK(strcmp(gpuq_status_name(GPUQ_TIMED_OUT), "TimedOut") == 0);
  CHECK(strcmp(gpuq_status_name(GPUQ_POOL_DOWN), "PoolDown") == 0);
  CHECK(strcmp(gpuq_status_name(GPUQ_TIMEOUT), "Timeout") == 0);
  CHECK(strcmp(gpuq_status_name((gpuq_status_t)1000), "Unknown") == 0);
  CHECK(strcmp(gpuq_job_status_name(GPUQ_JOB_DONE), "done") == 0);
  CHECK(gpuq_version() != NULL && gpuq_version()[0] != '\0');
  /* The test's own CRC32C against the standard check value. */
  CHECK(crc32c((const unsigned char*)"123456789", 9) == 0xE3069283u);
}

static void test_argument_checks(gpuq_client_t* client) {
  gpuq_connect_options_t bad_options;
  gpuq_client_t* other = NULL;
  gpuq_job_spec_t spec = new_spec("echo");
  gpuq_job_t* job = NULL;
  gpuq_buffer_t buffer;

  memset(&bad_options, 0, sizeof bad_options);
  bad_options.version = GPUQ_CONNECT_OPTIONS_VERSION + 1;
  CHECK(gpuq_connect(&bad_options, &other) == GPUQ_INVALID_ARGUMENT);
  CHECK(other == NULL);
  CHECK(strlen(gpuq_last_error_message()) > 0);

  CHECK(gpuq_alloc(client, 0, &buffer) == GPUQ_INVALID_ARGUMENT);
  CHECK(gpuq_alloc(client, 64, NULL) == GPUQ_INVALID_ARGUMENT);
  CHECK(gpuq_submit(client, NULL, kTimeoutNs, &job) == GPUQ_INVALID_ARGUMENT);
  spec.version = 0;
  CHECK(gpuq_submit(client, &spec, kTimeoutNs, &job) == GPUQ_INVALID_ARGUMENT);
  CHECK(job == NULL);
  spec.version = GPUQ_JOB_SPEC_VERSION;
  spec.op = NULL;
  CHECK(gpuq_try_submit(client, &spec, &job) == GPUQ_INVALID_ARGUMENT);
  CHECK(job == NULL);
  spec.op = "noop";
  spec.flags = 0x80u; /* an unknown flag */
  CHECK(gpuq_try_submit(client, &spec, &job) == GPUQ_INVALID_ARGUMENT);
  CHECK(job == NULL);
  /* Revision 1 of the struct (no `flags`) is still accepted. */
  spec.version = GPUQ_JOB_SPEC_VERSION1;
  CHECK(gpuq_submit(client, &spec, kTimeoutNs, &job) == GPUQ_OK);
  CHECK(gpuq_job_release(job) == GPUQ_OK);
  job = NULL;
  /* So is revision 2 (no `time_limit_ms`: what is in those bytes, its padding, is not read). */
  spec.version = GPUQ_JOB_SPEC_VERSION2;
  spec.flags = GPUQ_JOB_RETRYABLE;
  spec.time_limit_ms = 0xFFFFFFFFu;
  CHECK(gpuq_submit(client, &spec, kTimeoutNs, &job) == GPUQ_OK);
  CHECK(gpuq_job_release(job) == GPUQ_OK);
  job = NULL;
  /* Revision 3: time_limit_ms is read; any value of it is valid. `priority` is not read. */
  spec.version = GPUQ_JOB_SPEC_VERSION3;
  spec.time_limit_ms = 60000;
  spec.priority = 77;
  CHECK(gpuq_submit(client, &spec, kTimeoutNs, &job) == GPUQ_OK);
  CHECK(gpuq_job_release(job) == GPUQ_OK);
  job = NULL;
  /* Revision 4: priority is read, and must be a level. */
  spec.version = GPUQ_JOB_SPEC_VERSION4;
  CHECK(gpuq_submit(client, &spec, kTimeoutNs, &job) == GPUQ_INVALID_ARGUMENT);
  CHECK(job == NULL);
  CHECK(strstr(gpuq_last_error_message(), "priority is 77") != NULL);
  spec.priority = GPUQ_PRIORITY_HIGH;
  CHECK(gpuq_submit(client, &spec, kTimeoutNs, &job) == GPUQ_OK);
  CHECK(gpuq_job_release(job) == GPUQ_OK);
  job = NULL;
  spec.priority = GPUQ_PRIORITY_LOW;
  CHECK(gpuq_submit(client, &spec, kTimeoutNs, &job) == GPUQ_OK);
  CHECK(gpuq_job_release(job) == GPUQ_OK);
  job = NULL;
  spec.priority = GPUQ_PRIORITY_NORMAL;
  /* Revision 4 has the size of revision 5: `stream_window` is its padding, not read. */
  spec.stream_window = 99;
  CHECK(gpuq_submit(client, &spec, kTimeoutNs, &job) == GPUQ_OK);
  CHECK(gpuq_job_release(job) == GPUQ_OK);
  job = NULL;
  /* Revision 5: stream_window is read, 0 to 8. */
  spec.version = GPUQ_JOB_SPEC_VERSION5;
  CHECK(gpuq_submit(client, &spec, kTimeoutNs, &job) == GPUQ_INVALID_ARGUMENT);
  CHECK(job == NULL);
  CHECK(strstr(gpuq_last_error_message(), "stream_window: 99") != NULL);
  spec.stream_window = 0;
  /* A revision from the future is refused. */
  spec.version = GPUQ_STRUCT_VERSION(gpuq_job_spec_t, 6);
  CHECK(gpuq_submit(client, &spec, kTimeoutNs, &job) == GPUQ_INVALID_ARGUMENT);
  CHECK(job == NULL);
  CHECK(gpuq_reconnect(NULL) == GPUQ_INVALID_ARGUMENT);
  CHECK(gpuq_job_release(NULL) == GPUQ_OK);
  CHECK(gpuq_disconnect(NULL) == GPUQ_OK);
}

static void test_echo(gpuq_client_t* client) {
  enum { kBytes = 1000 };
  gpuq_buffer_t in, out;
  gpuq_job_spec_t spec = new_spec("echo");
  gpuq_job_result_t result = new_result();
  gpuq_job_t* job = NULL;
  gpuq_job_status_t status = GPUQ_JOB_QUEUED;
  unsigned char* src;
  int i;

  CHECK(gpuq_alloc(client, kBytes, &in) == GPUQ_OK);
  CHECK(gpuq_alloc(client, kBytes, &out) == GPUQ_OK);
  if (in.data == NULL || out.data == NULL) return;
  CHECK(in.size == kBytes && out.size == kBytes);
  CHECK(in.offset % 64 == 0 && out.offset % 64 == 0);
  src = (unsigned char*)in.data;
  for (i = 0; i < kBytes; ++i) src[i] = (unsigned char)(i * 7 + 3);
  memset(out.data, 0, kBytes);

  spec.input = in;
  spec.output = out;
  CHECK(gpuq_submit(client, &spec, kTimeoutNs, &job) == GPUQ_OK);
  if (job == NULL) return;
  CHECK(gpuq_job_wait(job, kTimeoutNs, &result) == GPUQ_OK);
  CHECK(result.status == GPUQ_JOB_DONE);
  CHECK(result.code == GPUQ_OK);
  CHECK(result.output_size == kBytes);
  CHECK(memcmp(in.data, out.data, kBytes) == 0);
  /* A finished job: poll says so, the result reads again, and it can no longer be cancelled. */
  CHECK(gpuq_job_poll(job, &status) == GPUQ_OK);
  CHECK(status == GPUQ_JOB_DONE);
  result.output_size = 0;
  CHECK(gpuq_job_wait(job, 0, &result) == GPUQ_OK);
  CHECK(result.output_size == kBytes);
  CHECK(gpuq_job_cancel(job) == GPUQ_NOT_CANCELLABLE);
  {
    int cancelled = -1;
    CHECK(gpuq_job_cancel_queued(job, &cancelled) == GPUQ_OK);
    CHECK(cancelled == 0); /* finished: left as it is */
    CHECK(gpuq_job_cancel_queued(job, NULL) == GPUQ_INVALID_ARGUMENT);
  }
  gpuq_job_release(job);

  CHECK(gpuq_free(client, &in) == GPUQ_OK);
  CHECK(gpuq_free(client, &out) == GPUQ_OK);
}

/* A streaming job: the built-in count op makes a part per number, read as each comes. */
static void test_stream(gpuq_client_t* client) {
  gpuq_buffer_t out;
  gpuq_job_spec_t spec = new_spec("count");
  gpuq_job_result_t result = new_result();
  gpuq_job_part_t part;
  gpuq_job_t* job = NULL;
  gpuq_param_t params[2];
  uint64_t v = 0;
  uint32_t i;

  memset(params, 0, sizeof params);
  CHECK(gpuq_alloc(client, 2 * 64, &out) == GPUQ_OK);
  params[0].key = "n";
  params[0].type = GPUQ_PARAM_INT;
  params[0].i = 5;
  params[1].key = "us";
  params[1].type = GPUQ_PARAM_INT;
  params[1].i = 1000;
  spec.params = params;
  spec.param_count = 2;
  spec.output = out;
  spec.stream_window = 2;
  CHECK(gpuq_submit(client, &spec, kTimeoutNs, &job) == GPUQ_OK);
  if (job == NULL) return;
  for (i = 0; i < 5; ++i) {
    memset(&part, 0xFF, sizeof part);
    CHECK(gpuq_job_next_part(job, kTimeoutNs, &part) == GPUQ_OK);
    CHECK(part.end == 0 && part.index == i && part.size == 8 && part.data != NULL);
    if (part.data != NULL && part.size == 8) memcpy(&v, part.data, 8);
    CHECK(v == i);
  }
  CHECK(gpuq_job_next_part(job, kTimeoutNs, &part) == GPUQ_OK);
  CHECK(part.end == 1 && part.data == NULL && part.size == 0);
  CHECK(gpuq_job_wait(job, kTimeoutNs, &result) == GPUQ_OK);
  CHECK(result.status == GPUQ_JOB_DONE && result.value == 5);
  CHECK(gpuq_job_next_part(job, kTimeoutNs, NULL) == GPUQ_INVALID_ARGUMENT);
  gpuq_job_release(job);
  job = NULL;
  /* Not a stream: next_part says so. */
  spec.stream_window = 0;
  params[0].i = 2;
  CHECK(gpuq_submit(client, &spec, kTimeoutNs, &job) == GPUQ_OK);
  if (job == NULL) return;
  CHECK(gpuq_job_next_part(job, kTimeoutNs, &part) == GPUQ_INVALID_ARGUMENT);
  CHECK(strstr(gpuq_last_error_message(), "not submitted as a stream") != NULL);
  gpuq_job_release(job);
  CHECK(gpuq_free(client, &out) == GPUQ_OK);
}

static void test_checksum(gpuq_client_t* client) {
  enum { kBytes = 4099 };
  gpuq_buffer_t in;
  gpuq_job_spec_t spec = new_spec("checksum");
  gpuq_job_result_t result = new_result();
  unsigned char* src;
  uint32_t expected;
  int i;

  CHECK(gpuq_alloc(client, kBytes, &in) == GPUQ_OK);
  if (in.data == NULL) return;
  src = (unsigned char*)in.data;
  for (i = 0; i < kBytes; ++i) src[i] = (unsigned char)((i * 131) ^ (i >> 8));
  expected = crc32c(src, kBytes);

  spec.input = in;
  CHECK(run_job(client, &spec, &result) == GPUQ_OK);
  CHECK(result.status == GPUQ_JOB_DONE);
  CHECK(result.code == GPUQ_OK);
  CHECK(result.value == expected);
  if (result.value != expected) {
    fprintf(stderr, "checksum: got 0x%llx, expected 0x%08lx\n", (unsigned long long)result.value,
            (unsigned long)expected);
  }
  CHECK(gpuq_free(client, &in) == GPUQ_OK);
}

static void test_unknown_op(gpuq_client_t* client) {
  gpuq_job_spec_t spec = new_spec("no_such_op");
  gpuq_job_result_t result = new_result();
  gpuq_job_t* job = NULL;
  gpuq_status_t s = gpuq_submit(client, &spec, kTimeoutNs, &job);

  /* The library may reject the name at submit (it knows the daemon's ops from the handshake),
   * or the worker may fail the job: either way the code is GPUQ_UNKNOWN_OP. */
  if (s == GPUQ_OK) {
    CHECK(gpuq_job_wait(job, kTimeoutNs, &result) == GPUQ_OK);
    CHECK(result.status == GPUQ_JOB_FAILED);
    CHECK(result.code == GPUQ_UNKNOWN_OP);
    gpuq_job_release(job);
  } else {
    CHECK(s == GPUQ_UNKNOWN_OP);
    CHECK(job == NULL);
    CHECK(strlen(gpuq_last_error_message()) > 0);
  }
}

static void test_status_json(const char* runtime_dir) {
  char* json = NULL;
  CHECK(gpuq_daemon_status_json(runtime_dir, &json) == GPUQ_OK);
  CHECK(json != NULL && json[0] == '{');
  gpuq_string_free(json);
}

/* gpuq_connect_options_t: revision 1 (no `flags`) and revision 2 with
 * GPUQ_CONNECT_KEEP_RUNNING_JOBS connect and run jobs; an unknown flag is refused. */
static void test_connect_options(const char* runtime_dir) {
  gpuq_connect_options_t options;
  gpuq_client_t* other = NULL;
  gpuq_job_spec_t spec = new_spec("noop");
  gpuq_job_result_t result = new_result();

  memset(&options, 0, sizeof options);
  options.version = GPUQ_CONNECT_OPTIONS_VERSION1;
  options.runtime_dir = runtime_dir;
  options.name = "c_api_test_v1";
  options.flags = 0x80u; /* not read: revision 1 ends before it */
  CHECK(gpuq_connect(&options, &other) == GPUQ_OK);
  if (other != NULL) {
    CHECK(run_job(other, &spec, &result) == GPUQ_OK);
    CHECK(result.status == GPUQ_JOB_DONE);
    CHECK(gpuq_disconnect(other) == GPUQ_OK);
    other = NULL;
  }

  options.version = GPUQ_CONNECT_OPTIONS_VERSION;
  options.name = "c_api_test_bad_flags";
  CHECK(gpuq_connect(&options, &other) == GPUQ_INVALID_ARGUMENT);
  CHECK(other == NULL);
  CHECK(strstr(gpuq_last_error_message(), "gpuq_connect_options_t.flags") != NULL);

  options.name = "c_api_test_keep";
  options.flags = GPUQ_CONNECT_KEEP_RUNNING_JOBS;
  CHECK(gpuq_connect(&options, &other) == GPUQ_OK);
  if (other != NULL) {
    result = new_result();
    CHECK(run_job(other, &spec, &result) == GPUQ_OK);
    CHECK(result.status == GPUQ_JOB_DONE);
    CHECK(gpuq_disconnect(other) == GPUQ_OK);
  }
}

/* Submits a `sleep` job of `us` microseconds in a gpuq_job_spec_t of version `version` with
 * `time_limit_ms`, and waits for it; the result in *result. */
static gpuq_status_t run_sleep(gpuq_client_t* client, uint32_t version, uint32_t time_limit_ms,
                               int64_t us, gpuq_job_result_t* result) {
  gpuq_param_t param;
  gpuq_job_spec_t spec = new_spec("sleep");
  memset(&param, 0, sizeof param);
  param.key = "us";
  param.type = GPUQ_PARAM_INT;
  param.i = us;
  spec.version = version;
  spec.params = &param;
  spec.param_count = 1;
  spec.time_limit_ms = time_limit_ms;
  return run_job(client, &spec, result);
}

/* gpuq_job_spec_t.time_limit_ms (revision 3): a job past it is stopped (sleep looks at its
 * cancel flag) and ends GPUQ_JOB_FAILED with GPUQ_TIMED_OUT, long before its op would have
 * ended; a job within its limit, and a revision-2 spec whose padding holds what would be a
 * 1 ms limit, run to their end. */
static void test_time_limit(gpuq_client_t* client) {
  gpuq_job_result_t result = new_result();

  CHECK(run_sleep(client, GPUQ_JOB_SPEC_VERSION, 200, INT64_C(5000000), &result) == GPUQ_OK);
  CHECK(result.status == GPUQ_JOB_FAILED);
  CHECK(result.code == GPUQ_TIMED_OUT);
  CHECK(strcmp(gpuq_status_name(result.code), "TimedOut") == 0);
  CHECK(result.run_ns >= UINT64_C(150000000)); /* it ran until about its limit... */
  CHECK(result.run_ns < UINT64_C(4000000000)); /* ...and not for the 5 s it asked for */
  if (result.code != GPUQ_TIMED_OUT || result.run_ns >= UINT64_C(4000000000)) {
    fprintf(stderr, "time limit: status %s, code %s (%s), run %llu ns\n",
            gpuq_job_status_name(result.status), gpuq_status_name(result.code), result.message,
            (unsigned long long)result.run_ns);
  }

  result = new_result();
  CHECK(run_sleep(client, GPUQ_JOB_SPEC_VERSION, 60000, 1000, &result) == GPUQ_OK);
  CHECK(result.status == GPUQ_JOB_DONE);
  CHECK(result.value == 1000);

  result = new_result();
  CHECK(run_sleep(client, GPUQ_JOB_SPEC_VERSION2, 1, 300000, &result) == GPUQ_OK);
  CHECK(result.status == GPUQ_JOB_DONE);
  CHECK(result.value == 300000);
}

/* gpuq_job_result_t as revision 1 declared it: what a program built against it passes. */
typedef struct {
  uint32_t version;
  gpuq_job_status_t status;
  gpuq_status_t code;
  char message[256];
  uint64_t output_size;
  uint64_t value;
  uint32_t worker_id;
  uint64_t queued_ns;
  uint64_t run_ns;
} result_v1_t;

/* Submits plugin_fail with `bytes` (its message: "<bytes>:" and digits) and waits with `result`,
 * a gpuq_job_result_t of either revision. */
static gpuq_status_t run_plugin_fail(gpuq_client_t* client, int64_t bytes, void* result) {
  gpuq_param_t param;
  gpuq_job_spec_t spec = new_spec("plugin_fail");
  memset(&param, 0, sizeof param);
  param.key = "bytes";
  param.type = GPUQ_PARAM_INT;
  param.i = bytes;
  spec.params = &param;
  spec.param_count = 1;
  return run_job(client, &spec, (gpuq_job_result_t*)result);
}

/* A job's failure message of 2000 bytes (plus the op's name) arrives whole in the current
 * gpuq_job_result_t, and cut to 255 bytes, NUL-terminated, in a revision-1 struct, whose size
 * the library does not write past. */
static void test_long_message(gpuq_client_t* client) {
  const char* const expected_head = "plugin_fail: 2000:";
  gpuq_job_result_t result = new_result();
  struct {
    result_v1_t v1;
    unsigned char after[64];
  } old;
  size_t i;
  int intact = 1;

  CHECK(sizeof(result_v1_t) == (GPUQ_JOB_RESULT_VERSION1 & 0xFFFFFFu));
  CHECK(run_plugin_fail(client, 2000, &result) == GPUQ_OK);
  CHECK(result.status == GPUQ_JOB_FAILED);
  CHECK(result.code == GPUQ_OP_FAILED);
  CHECK(strlen(result.message) == strlen("plugin_fail: ") + 2000);
  CHECK(strncmp(result.message, expected_head, strlen(expected_head)) == 0);
  CHECK(result.message[strlen(result.message) - 1] == '0' + 1999 % 10); /* the last byte */

  memset(&old, 0xAB, sizeof old);
  old.v1.version = GPUQ_JOB_RESULT_VERSION1;
  CHECK(run_plugin_fail(client, 2000, &old.v1) == GPUQ_OK);
  CHECK(old.v1.status == GPUQ_JOB_FAILED);
  CHECK(old.v1.code == GPUQ_OP_FAILED);
  CHECK(strlen(old.v1.message) == 255);
  CHECK(strncmp(old.v1.message, expected_head, strlen(expected_head)) == 0);
  CHECK(old.v1.run_ns < UINT64_C(30000000000));
  for (i = 0; i < sizeof old.after; ++i) intact = intact && old.after[i] == 0xAB;
  CHECK(intact);
}

static gpuq_tensor_t new_tensor(gpuq_buffer_t buffer, uint32_t rank, const int64_t* dims) {
  gpuq_tensor_t t;
  uint32_t i;
  memset(&t, 0, sizeof t);
  t.buffer = buffer;
  t.rank = rank;
  for (i = 0; i < rank; ++i) t.dims[i] = dims[i];
  return t;
}

/* Waits for a tensor job submitted with status `s`. True if it ran (DONE); false if the build
 * has no oneDNN (the op fails with GPUQ_UNKNOWN_OP, "not in this build") or it failed. */
static int tensor_job_done(gpuq_status_t s, gpuq_job_t* job, uint64_t output_size) {
  int done = 0;
  CHECK(s == GPUQ_OK);
  if (s == GPUQ_OK) {
    gpuq_job_result_t result = new_result();
    CHECK(gpuq_job_wait(job, kTimeoutNs, &result) == GPUQ_OK);
    CHECK(result.status == GPUQ_JOB_DONE ||
          (result.status == GPUQ_JOB_FAILED && result.code == GPUQ_UNKNOWN_OP));
    if (result.status == GPUQ_JOB_DONE) {
      CHECK(result.output_size == output_size);
      done = 1;
    }
    CHECK(gpuq_job_release(job) == GPUQ_OK);
  }
  return done;
}

/* The tensor-op calls: their checks before anything is submitted, and a well-formed conv2d
 * reaching the daemon. */
static void test_tensor_ops(gpuq_client_t* client) {
  static const int64_t x_dims[4] = {1, 3, 8, 8};
  static const int64_t w_dims[4] = {4, 3, 3, 3};
  static const int64_t y_dims[4] = {1, 4, 8, 8}; /* with pad 1x1 */
  static const int64_t a_dims[2] = {2, 3};
  static const int64_t b_dims[2] = {3, 4};
  static const int64_t m_dims[2] = {2, 4};
  gpuq_buffer_t xb, wb, yb, ab, bb, mb;
  gpuq_tensor_t x, w, y, y_unpadded, a, b, m;
  gpuq_conv2d_options_t conv;
  gpuq_gemm_options_t gemm;
  gpuq_job_t* job = NULL;
  gpuq_status_t s;

  CHECK(gpuq_alloc(client, 3 * 64 * 4, &xb) == GPUQ_OK);
  CHECK(gpuq_alloc(client, 4 * 27 * 4, &wb) == GPUQ_OK);
  CHECK(gpuq_alloc(client, 4 * 64 * 4, &yb) == GPUQ_OK);
  CHECK(gpuq_alloc(client, 64, &ab) == GPUQ_OK);
  CHECK(gpuq_alloc(client, 64, &bb) == GPUQ_OK);
  CHECK(gpuq_alloc(client, 64, &mb) == GPUQ_OK);
  x = new_tensor(xb, 4, x_dims);
  w = new_tensor(wb, 4, w_dims);
  y = new_tensor(yb, 4, y_dims);
  a = new_tensor(ab, 2, a_dims);
  b = new_tensor(bb, 2, b_dims);
  m = new_tensor(mb, 2, m_dims);

  /* Without padding the result is 1x4x6x6, not y's shape. */
  CHECK(gpuq_submit_conv2d(client, &x, &w, NULL, &y, NULL, kTimeoutNs, &job) ==
        GPUQ_INVALID_ARGUMENT);
  CHECK(job == NULL);
  CHECK(strstr(gpuq_last_error_message(), "conv2d: y: shape 1x4x8x8") != NULL);
  CHECK(gpuq_submit_conv2d(client, NULL, &w, NULL, &y, NULL, kTimeoutNs, &job) ==
        GPUQ_INVALID_ARGUMENT);
  y_unpadded = y;
  y_unpadded.rank = 5;
  CHECK(gpuq_submit_conv2d(client, &x, &w, NULL, &y_unpadded, NULL, kTimeoutNs, &job) ==
        GPUQ_INVALID_ARGUMENT);
  memset(&conv, 0, sizeof conv);
  CHECK(gpuq_submit_conv2d(client, &x, &w, NULL, &y, &conv, kTimeoutNs, &job) ==
        GPUQ_INVALID_ARGUMENT); /* version not set */
  CHECK(strstr(gpuq_last_error_message(), "gpuq_conv2d_options_t.version") != NULL);

  memset(&gemm, 0, sizeof gemm);
  gemm.version = GPUQ_GEMM_OPTIONS_VERSION;
  gemm.beta = 1.0;
  CHECK(gpuq_submit_gemm(client, &a, &b, NULL, &m, &gemm, kTimeoutNs, &job) ==
        GPUQ_INVALID_ARGUMENT);
  CHECK(strstr(gpuq_last_error_message(), "gemm: c:") != NULL);

  /* Well-formed: it runs; a build without oneDNN registers the op but fails it with
   * GPUQ_UNKNOWN_OP ("not in this build"). */
  conv.version = GPUQ_CONV2D_OPTIONS_VERSION;
  conv.pad[0] = conv.pad[1] = 1;
  memset(xb.data, 0, xb.size);
  memset(wb.data, 0, wb.size);
  memset(yb.data, 0xff, yb.size); /* NaN until the op writes it */
  s = gpuq_submit_conv2d(client, &x, &w, NULL, &y, &conv, kTimeoutNs, &job);
  if (tensor_job_done(s, job, yb.size)) {
    const float* y_values = (const float*)yb.data;
    CHECK(y_values[0] == 0.0f && y_values[255] == 0.0f); /* zero x and w: zero y */
  }
  gpuq_free(client, &xb);
  gpuq_free(client, &wb);
  gpuq_free(client, &yb);
  gpuq_free(client, &ab);
  gpuq_free(client, &bb);
  gpuq_free(client, &mb);
}

static int near(float got, float want) {
  return got > want - 1e-3f && got < want + 1e-3f;
}

/* Every f32 element of `b` is `want`, give or take 1e-3. */
static void check_all_near(const gpuq_buffer_t* b, float want) {
  const float* f = (const float*)b->data;
  uint64_t i;
  for (i = 0; i < b->size / sizeof(float); ++i) CHECK(near(f[i], want));
}

/* activation, softmax, pool2d and batchnorm from C: their option checks, and each op run on
 * small inputs with known results. */
static void test_more_tensor_ops(gpuq_client_t* client) {
  static const int64_t m_dims[2] = {2, 4};
  static const int64_t img_dims[4] = {1, 1, 4, 4};
  static const int64_t pooled_dims[4] = {1, 1, 2, 2};
  static const int64_t nc_dims[2] = {1, 2};
  static const int64_t c_dims[1] = {2};
  /* x and y 2x4, the image 4x4 and its pooled 2x2, then a 1x2 input, its four per-channel
   * operands and its output. */
  static const uint64_t sizes[10] = {8 * 4, 8 * 4, 16 * 4, 4 * 4, 2 * 4,
                                     2 * 4, 2 * 4, 2 * 4,  2 * 4, 2 * 4};
  gpuq_buffer_t buffers[10];
  gpuq_buffer_t xb, yb, ib, pb, nb, sb, bb, meanb, varb, ob;
  gpuq_tensor_t x, y, img, pooled, nc, scale, bias, mean, var, nc_out;
  gpuq_activation_options_t act;
  gpuq_softmax_options_t soft;
  gpuq_pool2d_options_t pool;
  gpuq_batchnorm_options_t bn;
  gpuq_job_t* job = NULL;
  gpuq_status_t s;
  float* f;
  int i;

  for (i = 0; i < 10; ++i) {
    s = gpuq_alloc(client, sizes[i], &buffers[i]);
    CHECK(s == GPUQ_OK);
    if (s != GPUQ_OK) return;
  }
  xb = buffers[0];
  yb = buffers[1];
  ib = buffers[2];
  pb = buffers[3];
  nb = buffers[4];
  sb = buffers[5];
  bb = buffers[6];
  meanb = buffers[7];
  varb = buffers[8];
  ob = buffers[9];
  x = new_tensor(xb, 2, m_dims);
  y = new_tensor(yb, 2, m_dims);
  img = new_tensor(ib, 4, img_dims);
  pooled = new_tensor(pb, 4, pooled_dims);
  nc = new_tensor(nb, 2, nc_dims);
  scale = new_tensor(sb, 1, c_dims);
  bias = new_tensor(bb, 1, c_dims);
  mean = new_tensor(meanb, 1, c_dims);
  var = new_tensor(varb, 1, c_dims);
  nc_out = new_tensor(ob, 2, nc_dims);

  /* activation: sigmoid(0) = 0.5; a mode outside the enum is refused. */
  memset(&act, 0, sizeof act);
  act.version = GPUQ_ACTIVATION_OPTIONS_VERSION;
  act.mode = 7;
  CHECK(gpuq_submit_activation(client, &x, &y, &act, kTimeoutNs, &job) == GPUQ_INVALID_ARGUMENT);
  CHECK(strstr(gpuq_last_error_message(), "gpuq_activation_options_t.mode is 7") != NULL);
  act.version = 0;
  act.mode = GPUQ_ACTIVATION_SIGMOID;
  CHECK(gpuq_submit_activation(client, &x, &y, &act, kTimeoutNs, &job) == GPUQ_INVALID_ARGUMENT);
  act.version = GPUQ_ACTIVATION_OPTIONS_VERSION;
  CHECK(gpuq_submit_activation(client, &x, &img, &act, kTimeoutNs, &job) ==
        GPUQ_INVALID_ARGUMENT); /* y's shape is not x's */
  memset(xb.data, 0, xb.size);
  s = gpuq_submit_activation(client, &x, &y, &act, kTimeoutNs, &job);
  if (tensor_job_done(s, job, yb.size)) check_all_near(&yb, 0.5f);

  /* softmax over the rows of a 2x4 zero matrix: 1/4 each. */
  memset(&soft, 0, sizeof soft);
  soft.version = GPUQ_SOFTMAX_OPTIONS_VERSION;
  s = gpuq_submit_softmax(client, &x, &y, &soft, kTimeoutNs, &job);
  if (tensor_job_done(s, job, yb.size)) check_all_near(&yb, 0.25f);

  /* pool2d: 2x2 max windows over 0..15 (stride defaults to the window). */
  memset(&pool, 0, sizeof pool);
  pool.version = GPUQ_POOL2D_OPTIONS_VERSION;
  pool.mode = 2;
  CHECK(gpuq_submit_pool2d(client, &img, &pooled, &pool, kTimeoutNs, &job) ==
        GPUQ_INVALID_ARGUMENT);
  CHECK(strstr(gpuq_last_error_message(), "gpuq_pool2d_options_t.mode is 2") != NULL);
  pool.mode = GPUQ_POOL_MAX;
  CHECK(gpuq_submit_pool2d(client, &img, &pooled, &pool, kTimeoutNs, &job) ==
        GPUQ_INVALID_ARGUMENT); /* a 1x1 window keeps 4x4, not pooled's 2x2 */
  CHECK(strstr(gpuq_last_error_message(), "pool2d: y:") != NULL);
  pool.window[0] = pool.window[1] = 2;
  f = (float*)ib.data;
  for (i = 0; i < 16; ++i) f[i] = (float)i;
  s = gpuq_submit_pool2d(client, &img, &pooled, &pool, kTimeoutNs, &job);
  if (tensor_job_done(s, job, pb.size)) {
    f = (float*)pb.data;
    CHECK(f[0] == 5.0f && f[1] == 7.0f && f[2] == 13.0f && f[3] == 15.0f);
  }

  /* batchnorm on a 1x2 (N x C) input: y = 2 (x - 0) / sqrt(1 + 1e-5) + 1. */
  memset(&bn, 0, sizeof bn);
  bn.version = GPUQ_BATCHNORM_OPTIONS_VERSION;
  f = (float*)nb.data;
  f[0] = 1.0f;
  f[1] = 2.0f;
  for (i = 0; i < 2; ++i) {
    ((float*)sb.data)[i] = 2.0f;
    ((float*)bb.data)[i] = 1.0f;
    ((float*)meanb.data)[i] = 0.0f;
    ((float*)varb.data)[i] = 1.0f;
  }
  CHECK(gpuq_submit_batchnorm(client, &nc, &scale, NULL, &mean, &var, &nc_out, &bn, kTimeoutNs,
                              &job) == GPUQ_INVALID_ARGUMENT);
  CHECK(strstr(gpuq_last_error_message(), "batchnorm: bias is NULL") != NULL);
  s = gpuq_submit_batchnorm(client, &nc, &scale, &bias, &mean, &var, &nc_out, &bn, kTimeoutNs,
                            &job);
  if (tensor_job_done(s, job, ob.size)) {
    f = (float*)ob.data;
    CHECK(near(f[0], 3.0f) && near(f[1], 5.0f));
  }

  for (i = 0; i < 10; ++i) gpuq_free(client, &buffers[i]);
}

/* 10,000 job handles held before any is waited on: more than the client's job slots, which
 * finished jobs give back to the submits that need them (their results kept for their handles). */
static void test_many_held_jobs(gpuq_client_t* client) {
  enum { kJobs = 10000 };
  gpuq_job_t** jobs = calloc(kJobs, sizeof *jobs);
  int submitted = 0, done = 0;
  CHECK(jobs != NULL);
  if (jobs == NULL) return;
  for (int i = 0; i < kJobs; ++i) {
    gpuq_job_spec_t spec = new_spec("noop");
    if (gpuq_submit(client, &spec, kTimeoutNs, &jobs[i]) == GPUQ_OK) ++submitted;
  }
  CHECK(submitted == kJobs);
  for (int i = 0; i < submitted; ++i) {
    gpuq_job_result_t result = new_result();
    if (gpuq_job_wait(jobs[i], kTimeoutNs, &result) == GPUQ_OK && result.status == GPUQ_JOB_DONE) {
      ++done;
    }
    gpuq_job_release(jobs[i]);
  }
  CHECK(done == kJobs);
  free(jobs);
}

int main(int argc, char** argv) {
  gpuq_connect_options_t options;
  gpuq_client_t* client = NULL;
  gpuq_status_t s;

  if (argc != 2 && !(argc == 3 && (strcmp(argv[2], "time-limit") == 0 ||
                                   strcmp(argv[2], "long-message") == 0))) {
    fprintf(stderr, "usage: %s RUNTIME_DIR [time-limit | long-message]\n", argv[0]);
    return 2;
  }
  memset(&options, 0, sizeof options);
  options.version = GPUQ_CONNECT_OPTIONS_VERSION;
  options.runtime_dir = argv[1];
  options.name = "c_api_test";

  if (argc == 2) test_library_facts();
  s = gpuq_connect(&options, &client);
  CHECK(s == GPUQ_OK);
  if (s != GPUQ_OK) {
    fprintf(stderr, "c_api: cannot connect to the daemon in %s: %s: %s\n", argv[1],
            gpuq_status_name(s), gpuq_last_error_message());
  } else if (argc == 3 && strcmp(argv[2], "time-limit") == 0) {
    test_time_limit(client);
    CHECK(gpuq_disconnect(client) == GPUQ_OK);
  } else if (argc == 3) {
    test_long_message(client);
    CHECK(gpuq_disconnect(client) == GPUQ_OK);
  } else {
    test_argument_checks(client);
    test_connect_options(argv[1]);
    test_echo(client);
    test_stream(client);
    test_checksum(client);
    test_unknown_op(client);
    test_many_held_jobs(client);
    test_tensor_ops(client);
    test_more_tensor_ops(client);
    test_status_json(argv[1]);
    CHECK(gpuq_disconnect(client) == GPUQ_OK);
  }
  printf("c_api: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
