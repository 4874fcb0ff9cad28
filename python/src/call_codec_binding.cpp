// gpuq._native's functions of the Python op wire format (call_codec.hpp), for gpuq._answers and
// gpuq._batching (the worker's Runtime and the client's answers). A malformed header or answer
// is a ValueError.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "call_codec.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace gpuq::python {

void bind_codec(nb::module_& m) {
  m.attr("CALL_FLAG_PICKLED_ARGS") = codec::kFlagPickledArgs;
  m.attr("CALL_FLAG_EXECUTOR_CONTEXT") = codec::kFlagExecutorContext;
  m.attr("CALL_FLAG_FETCH_SPILLED") = codec::kFlagFetchSpilled;
  m.attr("CALL_FLAG_FUNCTION_REUSED") = codec::kFlagFunctionReused;
  m.def("decode_call", &codec::decode_call, "input"_a, "h"_a, "n"_a, "buffers_as_views"_a,
        "(flags, args, kwargs) of the call header at [h, h + n) of input (arrays: views of it).");
  m.def(
      "write_answer",
      [](nb::handle out, const std::string& kind, nb::handle arrays, std::string_view extra) {
        const auto k = codec::kind_of(kind);
        if (!k) throw std::invalid_argument("write_answer: unknown kind '" + kind + "'");
        return codec::write_answer(out, *k, arrays, extra);
      },
      "out"_a, "kind"_a, "arrays"_a, "extra"_a,
      "Writes an answer into out: the bytes used, or minus the bytes needed.");
  m.def("write_result", &codec::write_result, "out"_a, "result"_a.none(),
        "write_answer for None, arrays, numpy scalars, bool/int/float and tuples of them; None "
        "for any other result.");
  m.def("read_answer", &codec::read_answer, "out"_a, "nbytes"_a,
        "(kind, arrays as views of out, extra JSON text) of an answer.");
  m.def("answer_value", &codec::answer_value, "out"_a, "nbytes"_a,
        "A named op's result from its answer.");
  m.def(
      "encode_call",
      [](nb::handle args, nb::handle kwargs, uint32_t flags, uint64_t output_bytes) {
        // For tests of the codec: the call laid out as submit_call lays it out in a segment,
        // every array copied, in a bytearray standing for the block.
        codec::CallPlan plan(args, kwargs, flags, true, nullptr, 0);
        const uint64_t need = plan.block_bytes(output_bytes);
        nb::object block =
            nb::steal(PyByteArray_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(need)));
        if (!block.is_valid()) throw nb::python_error();
        auto* base = reinterpret_cast<std::byte*>(PyByteArray_AS_STRING(block.ptr()));
        std::memset(base, 0, need);
        const codec::CallPlan::Layout at = plan.write(base, 0);
        return nb::make_tuple(block, at.span_offset, at.span_length, at.header_offset,
                              at.header_length, at.output_offset, at.rows);
      },
      "args"_a, "kwargs"_a.none(), "flags"_a, "output_bytes"_a,
      "Tests: (block, span offset, span length, h, n, output offset, rows) of a call laid out "
      "in a bytearray.");
}

}  // namespace gpuq::python
