// The wire format of a Python op's job (docs/python.md, "Wire format"), both ends of it, in C++:
// the client lays a call's arguments out in its segment (CallPlan), the worker turns them into
// Python objects (decode_call) and writes what the op returned (write_answer, write_result), and
// the client reads that answer back (read_answer, answer_value). One implementation for both
// ends and for the Python fallbacks (gpuq._answers and gpuq._batching call these through
// gpuq._native).
//
// A call's header, little-endian, at an offset of the job's input span given by its params py.h
// (offset) and py.n (length):
//
//   "GQC2" | u32 flags | u32 positional count | u32 keyword count | entries
//   entry:  [keyword: u16 name length, UTF-8 name] u8 tag, then by tag:
//           0 None, 1 False, 2 True, 3 int: i64, 4 float: f64, 5 str: u32 length + UTF-8,
//           6 JSON: u32 length + text, 7 array: u16 dtype length + dtype text (numpy's
//           dtype.str, or a structured dtype's descr as JSON), u8 ndim, u64 shape[ndim],
//           u64 offset in the span, 8 bytes: u64 offset in the span, u64 length
//
// An answer, at the start of the job's output buffer:
//
//   "GQR2" | u32 header length | u32 kind | u32 array count | u32 extra length | extra (a JSON
//   object: "value" of a JSON result, "error" of a failure) | array entries (as a call's, the
//   offset from the answer's start) | the arrays' bytes at 64-byte aligned offsets
//
// Everything read is bounds-checked before use: a malformed header is a ValueError naming what
// is wrong, never a read outside the buffer.
#pragma once

#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace gpuq::python::codec {

namespace nb = nanobind;

inline constexpr uint64_t kAlign = 64;
inline constexpr uint64_t kMaxHeaderBytes = 4 << 20;  // larger data goes in arrays
inline constexpr uint32_t kMaxDims = 64;

// A callable's job (gpuq.Executor): positional 0 is the function's pickle; with
// kFlagExecutorContext, the next positional is the pickle of its executor's context (a token,
// the initializer, its arguments and the caller's multiprocessing authkey); with
// kFlagPickledArgs, the next is the pickle of (args, kwargs) and the rest its out-of-band
// buffers, else the rest are the arguments themselves. A job with kFlagFetchSpilled fetches a
// piece of a result too large for its task's answer room (gpuq/_spill.py): its positionals are
// (token, offset, length, last), and it has no function. With kFlagFunctionReused, the
// function's pickle is one the client sends again unchanged (gpuq/_pickles.py): the worker
// keeps what it unpickled; any other pickle (a joblib batch, which holds its data) is
// unpickled for its task alone. gpuq._native exports each flag (CALL_FLAG_PICKLED_ARGS,
// CALL_FLAG_EXECUTOR_CONTEXT, CALL_FLAG_FETCH_SPILLED, CALL_FLAG_FUNCTION_REUSED).
inline constexpr uint32_t kFlagPickledArgs = 1;
inline constexpr uint32_t kFlagExecutorContext = 2;
inline constexpr uint32_t kFlagFetchSpilled = 4;
inline constexpr uint32_t kFlagFunctionReused = 8;

// Answer kinds (their names, kKindNames, are what gpuq._answers passes as "kind").
enum class Kind : uint32_t {
  kNone = 0,
  kArray = 1,
  kScalar = 2,
  kTuple = 3,
  kJson = 4,
  kPickle = 5,
  kException = 6,
  kError = 7,
};
inline constexpr uint32_t kKindCount = 8;
const char* kind_name(Kind k);
std::optional<Kind> kind_of(std::string_view name);

uint64_t align(uint64_t n);

// ---- the client's side ----------------------------------------------------------------------

// One call measured before its block is allocated: each argument classified (JSON texts made,
// arrays' buffers held), the header's size and the bytes to copy known. Raises
// std::invalid_argument for an argument that cannot travel (the caller's InvalidArgument).
class CallPlan {
 public:
  // `args`: a tuple; `kwargs`: a dict or None. Arrays that lie in [arena, arena + arena_bytes)
  // and are C-contiguous are passed in place unless `copy_all`.
  CallPlan(nb::handle args, nb::handle kwargs, uint32_t flags, bool copy_all,
           const std::byte* arena, uint64_t arena_bytes);
  ~CallPlan();
  CallPlan(const CallPlan&) = delete;
  CallPlan& operator=(const CallPlan&) = delete;

  // The block the call needs: the header's room, the copies, then `output_bytes`.
  uint64_t block_bytes(uint64_t output_bytes) const;

  struct Layout {
    uint64_t span_offset;  // the job's input span, in the arena
    uint64_t span_length;
    uint64_t header_offset;  // py.h: within the span
    uint64_t header_length;  // py.n
    uint64_t output_offset;  // the answer's room, in the arena
    uint64_t rows;           // py.r: the first axis the arrays share, 0 when none
  };
  // Writes the header and the copies into the block at `block_offset` of `arena` (at least
  // block_bytes() long). Copies of more than a few MiB run with the GIL released.
  Layout write(std::byte* arena, uint64_t block_offset);

  // The arrays passed in place: the job reads them, so its future keeps them alive.
  nb::list in_place() const;

 private:
  struct Entry;
  void add(nb::handle key, nb::handle value, const std::string& what);
  std::vector<std::unique_ptr<Entry>> entries_;  // each holds its argument's buffer
  uint32_t flags_;
  uint32_t positional_ = 0;
  uint32_t keywords_ = 0;
  bool copy_all_;
  const std::byte* arena_;
  uint64_t arena_bytes_;
  uint64_t header_bytes_ = 16;
  uint64_t copy_bytes_ = 0;
};

// The answer's value for a named op's job (None, an array as a view of `out`, a numpy scalar,
// a tuple, a JSON value). `out`: a uint8 numpy array holding the answer's `nbytes`.
nb::object answer_value(nb::handle out, uint64_t nbytes);

// (kind name, [arrays as views of out], extra JSON text) of any answer.
nb::tuple read_answer(nb::handle out, uint64_t nbytes);

// ---- the worker's side ----------------------------------------------------------------------

// (flags, args: list, kwargs: dict) of the header at [h, h + n) of `input` (a memoryview of the
// job's input span, which arrays are made over, zero copy: read-only when it is). Bytes entries
// become memoryviews of it when `buffers_as_views`, else bytes.
nb::tuple decode_call(nb::handle input, uint64_t h, uint64_t n, bool buffers_as_views);

// Writes an answer into `out` (a writable buffer): `arrays` (a sequence of numpy arrays) and
// `extra` (JSON object text, or empty). The bytes used, or minus the bytes needed when it does
// not fit.
int64_t write_answer(nb::handle out, Kind kind, nb::handle arrays, std::string_view extra);

// write_answer for the common results (None, a numpy array or scalar, a bool, int or float, a
// tuple or list of those); nullopt for any other (gpuq._answers.write_result converts those).
std::optional<int64_t> write_result(nb::handle out, nb::handle result);

}  // namespace gpuq::python::codec
