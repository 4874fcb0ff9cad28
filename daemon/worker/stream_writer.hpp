// StreamWriter: the worker's side of a streaming job (docs/design/streams.md), the PartSink its
// op writes parts through. The job's output buffer is cut into `window` cells; part i goes into
// cell i % window, and is published by storing JobStream::written = i + 1 (seq_cst) and waking
// the client (the slot's `done`, and the segment's `ended` for wait_any). A part's cell is free
// again once the client has stored JobStream::read past the part `window` before it.
//
// Waiting for a free cell is where a stream meets its caller's pace: the writer sleeps on
// JobStream::room (bounded sleeps of 10 ms), and stops waiting with Cancelled when the job is
// asked to stop (its client cancelled it or left, its time limit passed: cancel_requested) or
// when the client has read no part for `reader_timeout_ms` (0: no limit). Not thread-safe:
// one per running stream job, on the worker's thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "gpuq/common/shm_layout.hpp"
#include "gpuq/error.hpp"
#include "ops.hpp"

namespace gpuq::daemon {

class StreamWriter final : public PartSink {
 public:
  // `output`/`capacity`: the job's validated output buffer; `window` from its validated flags
  // (1 to kMaxStreamWindow, and a cell of at least 64 bytes: validate_descriptor checks both).
  StreamWriter(JobSlot& slot, const ClientSegmentView& view, std::byte* output, uint64_t capacity,
               uint32_t window, uint32_t reader_timeout_ms) noexcept;

  Result<std::span<std::byte>> next_cell() override;
  // next_cell() without waiting: nullopt while the next part's cell holds an unread part (and
  // the reader's timeout has not run out). The step runner asks each live sequence's writer
  // before a step: a slow reader pauses its own sequence, not the others.
  std::optional<Result<std::span<std::byte>>> try_cell();
  void publish(uint64_t bytes) override;
  uint32_t parts() const override { return written_; }

 private:
  // True when part `written_`'s cell is free (the client gave back the part `window` before
  // it). A `read` past `written_` (a client scribbling its own slot) counts as free: the
  // client loses only its own parts.
  bool cell_free() const noexcept;
  // Why the job must stop (asked to, or its reader's timeout ran out) at `now_ns`; nullopt
  // while it may go on. Starts or restarts the reader's clock when `read` moved.
  std::optional<Error> stop_reason(uint64_t now_ns);

  JobSlot& slot_;
  const ClientSegmentView& view_;
  std::byte* output_;
  uint64_t cell_bytes_;
  uint32_t window_;
  uint64_t reader_timeout_ns_;
  uint32_t written_ = 0;
  uint64_t waiting_since_ = 0;  // since when the writer waits for a cell (0: it is not)
  uint32_t last_read_ = 0;      // `read` when that wait began or last moved
};

class OpBackend;

// Runs a streaming job's op (`window` from its validated descriptor) with a StreamWriter as
// `ctx.parts`. Out of line: the path of a job that answers once does not see it.
Result<OpOutput> run_streaming(OpBackend& backend, const OpInfo& op, OpContext& ctx, JobSlot& slot,
                               const ClientSegmentView& view, uint32_t window,
                               uint32_t reader_timeout_ms);

}  // namespace gpuq::daemon
