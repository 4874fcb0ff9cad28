// The tensor ops in a build without oneDNN (GPUQ_WITH_ONEDNN=OFF, or AUTO without libdnnl-dev):
// every op fails with UnknownOp, "not in this build".
#include <string>

#include "cpu_tensor_ops.hpp"

namespace gpuq::daemon {

bool cpu_tensor_ops_available() noexcept {
  return false;
}

Result<void> cpu_tensor_ops_start() {
  return {};
}

Result<OpOutput> run_cpu_tensor_op(const tensor::TensorOp& op, const std::byte* /*input*/,
                                   std::byte* /*output*/, const std::atomic<uint32_t>& /*cancel*/) {
  // TensorOp's alternatives are in OpKind's order (checked in cpu_tensor_ops.hpp).
  const char* name = tensor::op_kind_name(static_cast<tensor::OpKind>(op.index()));
  return Error(ErrorCode::kUnknownOp,
               std::string(name) +
                   ": tensor ops on cpu pools are not in this build (gpuq was built without "
                   "oneDNN, GPUQ_WITH_ONEDNN); submit it to a gpu pool");
}

}  // namespace gpuq::daemon
