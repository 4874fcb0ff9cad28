// The CPU worker's backend (gpuq-worker): the built-in ops, run as they are.
#include <string>

#include "op_backend.hpp"

namespace gpuq::daemon {
namespace {

class CpuBackend final : public OpBackend {
 public:
  Result<OpOutput> run(const OpInfo& op, const OpContext& ctx) override {
    if (op.run != nullptr) return op.run(ctx);
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
