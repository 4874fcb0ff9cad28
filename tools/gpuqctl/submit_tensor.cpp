// gpuqctl submit of a tensor op (conv2d, gemm...): the check of the --input files and the shape
// parameters before submitting, and the size of the result.
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "gpuq/client.hpp"
#include "gpuq/common/assert.hpp"
#include "gpuq/common/params.hpp"
#include "gpuq/common/tensor_ops.hpp"
#include "submit.hpp"

namespace gpuq::ctl {
namespace {

// The operands of a parsed tensor op, in their documented order, with their names.
std::vector<std::pair<const char*, gpuq::tensor::Operand>> operands_of(
    const gpuq::tensor::TensorOp& op) {
  using namespace gpuq::tensor;
  std::vector<std::pair<const char*, Operand>> out;
  if (const auto* c = std::get_if<Conv2d>(&op)) {
    out = {{"x", c->x}, {"w", c->w}};
    if (c->b) out.emplace_back("b", *c->b);
  } else if (const auto* a = std::get_if<ActivationOp>(&op)) {
    out = {{"x", a->x}};
  } else if (const auto* s = std::get_if<Softmax>(&op)) {
    out = {{"x", s->x}};
  } else if (const auto* p = std::get_if<Pool2d>(&op)) {
    out = {{"x", p->x}};
  } else if (const auto* b = std::get_if<BatchNorm>(&op)) {
    out = {{"x", b->x}, {"scale", b->scale}, {"bias", b->bias}, {"mean", b->mean}, {"var", b->var}};
  } else if (const auto* g = std::get_if<Gemm>(&op)) {
    out = {{"a", g->a}, {"b", g->b}};
    if (g->c) out.emplace_back("c", *g->c);
  }
  return out;
}

}  // namespace

std::optional<uint64_t> check_tensor_job(const SubmitArgs& args,
                                         const std::vector<uint64_t>& input_sizes,
                                         std::string& error) {
  const gpuq::tensor::OpKind kind = *gpuq::tensor::op_kind_from_name(args.op);
  gpuq::ParamWriter writer;
  bool placed = false;  // an operand placed with "<operand>_at"
  for (const gpuq::JobParam& p : args.params) {
    gpuq::ParamValue v;
    if (p.type == gpuq::JobParam::Type::kInt) v = p.int_value;
    if (p.type == gpuq::JobParam::Type::kFloat) v = p.float_value;
    if (p.type == gpuq::JobParam::Type::kString) v = p.string_value;
    if (auto r = writer.add(p.key, v); !r) {
      error = r.error().message();
      return std::nullopt;
    }
    placed = placed || (p.key.size() > 3 && p.key.compare(p.key.size() - 3, 3, "_at") == 0);
  }
  gpuq::Result<gpuq::ParamBlock> block = gpuq::ParamBlock::parse(writer.data(), writer.size());
  if (!block) {
    error = block.error().message();
    return std::nullopt;
  }
  uint64_t input_bytes = 0;
  for (uint64_t n : input_sizes) input_bytes += n;
  const uint64_t capacity = args.output_size.value_or(gpuq::tensor::kMaxElements);
  // First with room for any operands, to name a file that does not match its operand; then
  // with the files' real size. The output as the client library allocates it: after the
  // input, 64-byte aligned.
  for (const uint64_t input_room : {gpuq::tensor::kMaxElements, input_bytes}) {
    const uint64_t output_offset = (input_room + 63) & ~uint64_t{63};
    gpuq::Result<gpuq::tensor::TensorOp> op = gpuq::tensor::parse_tensor_op(
        kind, block.value(), {0, input_room, output_offset, capacity});
    if (!op) {
      error = op.error().message();
      return std::nullopt;
    }
    if (input_room == input_bytes) return gpuq::tensor::result_bytes(op.value());
    if (placed) continue;
    const auto operands = operands_of(op.value());
    const char* dtype = gpuq::tensor::dtype_name(gpuq::tensor::result_dtype(op.value()));
    if (input_sizes.size() == operands.size()) {
      // One file per operand, in order: each must hold exactly its operand.
      for (size_t i = 0; i < operands.size(); ++i) {
        const auto& [name, operand] = operands[i];
        if (input_sizes[i] != operand.bytes) {
          error = args.op + ": --input '" + args.input_paths[i] + "' holds " +
                  std::to_string(input_sizes[i]) + " bytes, operand " + name + " (" +
                  operand.shape.to_string() + " " + dtype + ") needs " +
                  std::to_string(operand.bytes);
          return std::nullopt;
        }
      }
    } else {
      uint64_t needed = 0;
      std::string names;
      for (const auto& [name, operand] : operands) {
        needed += operand.bytes;
        names += std::string(names.empty() ? "" : ", ") + name + " " + operand.shape.to_string();
      }
      if (needed != input_bytes) {
        error = args.op + ": the " + std::to_string(input_sizes.size()) + " --input files hold " +
                std::to_string(input_bytes) + " bytes, the " + std::to_string(operands.size()) +
                " operands (" + names + ", " + dtype + ") need " + std::to_string(needed);
        return std::nullopt;
      }
    }
  }
  GPUQ_ASSERT(false);  // the loop returns on its second pass
  return std::nullopt;
}

}  // namespace gpuq::ctl
