// gpuq._native's constants: the facts the Python package shares with C++, exported from their
// C++ definitions so that Python never retypes them (docs/design/architecture.md, "Facts shared
// with C++"). gpuq._errors numbers its classes from ERROR_CODES, gpuq._future its statuses from
// JOB_STATUS; the others are used as they are.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>

#include "gpuq/client.hpp"
#include "gpuq/common/shm_layout.hpp"
#include "gpuq/error.hpp"
#include "gpuq/priority.hpp"
#include "ops.hpp"

namespace nb = nanobind;

namespace gpuq::python {

void bind_facts(nb::module_& m) {
  // gpuq::ErrorCode: name -> value, every code but kOk.
  nb::dict codes;
  for (int32_t c = 1; c <= kMaxErrorCode; ++c) {
    codes[std::string(error_code_name(static_cast<ErrorCode>(c))).c_str()] = c;
  }
  m.attr("ERROR_CODES") = codes;
  m.attr("MAX_ERROR_CODE") = kMaxErrorCode;

  // gpuq::JobStatus: name ("queued"...) -> value, in order.
  nb::dict status;
  for (JobStatus s : {JobStatus::kQueued, JobStatus::kRunning, JobStatus::kDone, JobStatus::kFailed,
                      JobStatus::kCancelled, JobStatus::kExpired}) {
    status[std::string(job_status_name(s)).c_str()] = static_cast<int>(s);
  }
  m.attr("JOB_STATUS") = status;

  // gpuq::Priority: name ("high"...) -> value, from the highest level to the lowest.
  nb::dict priorities;
  for (uint32_t rank = 0; rank < kPriorityLevels; ++rank) {
    const Priority p = priority_at_rank(rank);
    priorities[std::string(priority_name(p)).c_str()] = static_cast<int>(p);
  }
  m.attr("PRIORITIES") = priorities;

  // The op gpuq.Executor's jobs name, and the bounds of a Python op's batching.
  m.attr("CALL_OP") = daemon::kPythonCallOp;
  m.attr("MAX_BATCH_SIZE") = daemon::kMaxBatchSize;
  m.attr("MAX_QUEUE_DELAY_US") = daemon::kMaxQueueDelayUs;

  // A stream's window bound, and where its parts lie: the output buffer cut into equal cells
  // (docs/design/streams.md).
  m.attr("MAX_STREAM_WINDOW") = kMaxStreamWindow;
  m.def("stream_cell_bytes", &stream_cell_bytes, nb::arg("output_bytes"), nb::arg("window"),
        "The size of each part cell of a stream's output buffer (0: too small).");

  // The params of a Python op's job: its call header's offset and length, its rows.
  m.attr("PARAM_HEADER") = daemon::kPythonHeaderParam;
  m.attr("PARAM_HEADER_BYTES") = daemon::kPythonHeaderBytesParam;
  m.attr("PARAM_ROWS") = daemon::kPythonRowsParam;
}

}  // namespace gpuq::python
