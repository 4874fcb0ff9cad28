// The CPU worker's backend (gpuq-worker): the built-in ops, run as they are, and the catalog's
// tensor ops, parsed against the job's buffers and run on oneDNN (cpu_tensor_ops.hpp).
#include <string>

#include "cpu_tensor_ops.hpp"
#include "op_backend.hpp"
#include "plugins.hpp"

namespace gpuq::daemon {
namespace {

class CpuBackend final : public OpBackend {
 public:
  Result<void> start() override { return cpu_tensor_ops_start(); }

  nlohmann::json describe() const override {
    return {{"tensor_ops", cpu_tensor_ops_available() ? "onednn" : "none"}};
  }

  Result<OpOutput> run(const OpInfo& op, const OpContext& ctx) override {
    if (op.run != nullptr) return op.run(ctx);
    if (op.plugin != nullptr) {
      if (op.plugin->cpu_fn == nullptr) {
        return Error(ErrorCode::kUnknownOp, std::string(op.name) + ": plug-in " +
                                                op.plugin->library +
                                                " has no CPU implementation of this op");
      }
      return run_plugin_op(op, op.plugin->cpu_fn, ctx, ctx.input, ctx.output);
    }
    if (op.tensor) {
      const tensor::JobBuffers buffers{ctx.input_offset, ctx.input_bytes, ctx.output_offset,
                                       ctx.output_capacity};
      auto parsed = tensor::parse_tensor_op(*op.tensor, ctx.params, buffers);
      if (!parsed) return parsed.error();
      return run_cpu_tensor_op(*parsed, ctx.input, ctx.output, ctx.cancel_requested);
    }
    return Error(ErrorCode::kUnknownOp,
                 std::string(op.name) + ": this op has no CPU implementation in this build");
  }
};

}  // namespace

OpBackend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

}  // namespace gpuq::daemon
