#include "stream_writer.hpp"

#include <string>

#include "gpuq/common/clock.hpp"
#include "gpuq/common/fault_point.hpp"
#include "op_backend.hpp"

namespace gpuq::daemon {

namespace {
constexpr uint64_t kRecheckNs = 10'000'000;  // looks at cancel_requested at least this often
}  // namespace

StreamWriter::StreamWriter(JobSlot& slot, const ClientSegmentView& view, std::byte* output,
                           uint64_t capacity, uint32_t window, uint32_t reader_timeout_ms) noexcept
    : slot_(slot),
      view_(view),
      output_(output),
      cell_bytes_(stream_cell_bytes(capacity, window)),
      window_(window),
      reader_timeout_ns_(uint64_t{reader_timeout_ms} * 1'000'000) {}

bool StreamWriter::cell_free() const noexcept {
  const uint32_t read = slot_.stream.read.load(std::memory_order_acquire);
  return read >= written_ || written_ - read < window_;
}

std::optional<Error> StreamWriter::stop_reason(uint64_t now_ns) {
  if (slot_.cancel_requested.load(std::memory_order_relaxed) != 0) {
    return Error(ErrorCode::kCancelled, "stream stopped at part " + std::to_string(written_) +
                                            ": the job was asked to stop");
  }
  const uint32_t read = slot_.stream.read.load(std::memory_order_relaxed);
  if (waiting_since_ == 0 || read != last_read_) {
    waiting_since_ = now_ns;
    last_read_ = read;
  } else if (reader_timeout_ns_ != 0 && now_ns - waiting_since_ >= reader_timeout_ns_) {
    return Error(ErrorCode::kCancelled, "stream stopped at part " + std::to_string(written_) +
                                            ": its caller read no part for " +
                                            std::to_string(reader_timeout_ns_ / 1'000'000) +
                                            " ms with " + std::to_string(window_) +
                                            " unread (the daemon's stream_reader_timeout_ms)");
  }
  return std::nullopt;
}

std::optional<Result<std::span<std::byte>>> StreamWriter::try_cell() {
  if (slot_.cancel_requested.load(std::memory_order_relaxed) == 0 && cell_free()) {
    waiting_since_ = 0;
    return std::span<std::byte>(output_ + uint64_t{written_ % window_} * cell_bytes_, cell_bytes_);
  }
  if (std::optional<Error> stop = stop_reason(monotonic_ns()))
    return Result<std::span<std::byte>>(*stop);
  return std::nullopt;
}

Result<std::span<std::byte>> StreamWriter::next_cell() {
  for (;;) {
    if (std::optional<Result<std::span<std::byte>>> cell = try_cell()) return std::move(*cell);
    const EventCount::Key key = slot_.stream.room.prepare_wait();
    if (cell_free() || slot_.cancel_requested.load(std::memory_order_relaxed) != 0) {
      slot_.stream.room.cancel_wait();
      continue;
    }
    slot_.stream.room.wait(key, monotonic_ns() + kRecheckNs);
  }
}

void StreamWriter::publish(uint64_t bytes) {
  slot_.stream.part_bytes[written_ % window_] =
      static_cast<uint32_t>(bytes < cell_bytes_ ? bytes : cell_bytes_);
  ++written_;
  GPUQ_FAULT_POINT("worker.stream.before_publish");
  // seq_cst, an exchange: the part's bytes and size before it (release), and it before the
  // notifies' loads of `waiters` (EventCount::notify_all_after_rmw).
  slot_.stream.written.exchange(written_, std::memory_order_seq_cst);
  view_.announce_part(slot_);
}

Result<OpOutput> run_streaming(OpBackend& backend, const OpInfo& op, OpContext& ctx, JobSlot& slot,
                               const ClientSegmentView& view, uint32_t window,
                               uint32_t reader_timeout_ms) {
  StreamWriter writer(slot, view, ctx.output, ctx.output_capacity, window, reader_timeout_ms);
  ctx.parts = &writer;
  Result<OpOutput> r = backend.run(op, ctx);
  ctx.parts = nullptr;
  return r;
}

}  // namespace gpuq::daemon
