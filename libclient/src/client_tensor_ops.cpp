// The Client's tensor-op calls (gpuq/client.hpp: conv2d, gemm...): a layer over the public
// Client, each a JobSpec builder of gpuq/tensor.hpp, a check that its tensors lie in this
// client's segment and that the pool can run their dtype, then submit().
#include <algorithm>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gpuq/client.hpp"

namespace gpuq {

namespace {

using NamedTensors = std::initializer_list<std::pair<std::string_view, const Tensor*>>;

// Checks that every tensor lies in `client`'s payload segment and that the pool that would run
// the job can run its dtype, then submits `spec`.
Result<Job> submit_tensor_job(Client& client, Result<JobSpec> spec, NamedTensors tensors,
                              const std::string& pool, std::chrono::nanoseconds timeout) {
  if (!spec) return std::move(spec).error();
  const std::string& op = spec->op;
  const uint64_t arena_bytes = client.arena_bytes();
  const std::byte* arena = client.arena();
  for (const auto& [name, t] : tensors) {
    const Buffer& b = t->buffer();
    const bool inside = b.offset <= arena_bytes && t->bytes() <= arena_bytes - b.offset;
    if (!inside || (b.ptr != nullptr && b.ptr != arena + b.offset)) {
      return Error(ErrorCode::kInvalidArgument,
                   op + ": " + std::string(name) + ": its buffer (offset " +
                       std::to_string(b.offset) + ", " + std::to_string(t->bytes()) +
                       " bytes) is not in this client's payload segment (" +
                       std::to_string(arena_bytes) +
                       " bytes): a Buffer of another Client, or "
                       "of this one before reconnect()?");
    }
  }
  // f16 on a cpu pool: refused by its workers anyway; say so before the job is queued.
  const DType dtype = tensors.begin()->second->dtype();
  if (dtype != DType::kF32) {
    const std::vector<PoolInfo>& pools = client.pools();
    auto find = [&](const std::string& name) {
      return std::find_if(pools.begin(), pools.end(),
                          [&](const PoolInfo& p) { return p.name == name; });
    };
    auto target = pool.empty() ? pools.begin() : find(pool);
    if (target != pools.end() && !target->runs_on.empty() && target->runs_on != target->name) {
      target = find(target->runs_on);
    }
    if (target != pools.end() && target->kind == "cpu") {
      return Error(ErrorCode::kInvalidArgument,
                   op + ": dtype: " + std::string(dtype_name(dtype)) +
                       " is not supported on cpu pools (f32 only), and pool '" + target->name +
                       "' is one; submit it to a gpu pool");
    }
  }
  spec->pool = pool;
  return client.submit(spec.value(), timeout);
}

}  // namespace

Result<Job> Client::conv2d(const Tensor& x, const Tensor& w, const std::optional<Tensor>& b,
                           const Tensor& y, const Conv2dOptions& options, const std::string& pool,
                           std::chrono::nanoseconds timeout) {
  if (b) {
    return submit_tensor_job(*this, conv2d_job(x, w, b, y, options),
                             {{"x", &x}, {"w", &w}, {"b", &*b}, {"y", &y}}, pool, timeout);
  }
  return submit_tensor_job(*this, conv2d_job(x, w, b, y, options),
                           {{"x", &x}, {"w", &w}, {"y", &y}}, pool, timeout);
}

Result<Job> Client::activation(const Tensor& x, const Tensor& y, ActivationMode mode,
                               const std::string& pool, std::chrono::nanoseconds timeout) {
  return submit_tensor_job(*this, activation_job(x, y, mode), {{"x", &x}, {"y", &y}}, pool,
                           timeout);
}

Result<Job> Client::softmax(const Tensor& x, const Tensor& y, const SoftmaxOptions& options,
                            const std::string& pool, std::chrono::nanoseconds timeout) {
  return submit_tensor_job(*this, softmax_job(x, y, options), {{"x", &x}, {"y", &y}}, pool,
                           timeout);
}

Result<Job> Client::pool2d(const Tensor& x, const Tensor& y, const Pool2dOptions& options,
                           const std::string& pool, std::chrono::nanoseconds timeout) {
  return submit_tensor_job(*this, pool2d_job(x, y, options), {{"x", &x}, {"y", &y}}, pool, timeout);
}

Result<Job> Client::batchnorm(const Tensor& x, const Tensor& scale, const Tensor& bias,
                              const Tensor& mean, const Tensor& var, const Tensor& y,
                              const BatchNormOptions& options, const std::string& pool,
                              std::chrono::nanoseconds timeout) {
  return submit_tensor_job(
      *this, batchnorm_job(x, scale, bias, mean, var, y, options),
      {{"x", &x}, {"scale", &scale}, {"bias", &bias}, {"mean", &mean}, {"var", &var}, {"y", &y}},
      pool, timeout);
}

Result<Job> Client::gemm(const Tensor& a, const Tensor& b, const std::optional<Tensor>& c,
                         const Tensor& y, const GemmOptions& options, const std::string& pool,
                         std::chrono::nanoseconds timeout) {
  if (c) {
    return submit_tensor_job(*this, gemm_job(a, b, c, y, options),
                             {{"a", &a}, {"b", &b}, {"c", &*c}, {"y", &y}}, pool, timeout);
  }
  return submit_tensor_job(*this, gemm_job(a, b, c, y, options), {{"a", &a}, {"b", &b}, {"y", &y}},
                           pool, timeout);
}

}  // namespace gpuq
