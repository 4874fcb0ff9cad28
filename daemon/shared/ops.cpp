#include "ops.hpp"

#include <nlohmann/json.hpp>

#include <time.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>

#include "gpuq/common/assert.hpp"
#include "gpuq/common/clock.hpp"
#include "gpuq/common/crc32c.hpp"

namespace gpuq::daemon {
namespace {

Result<OpOutput> op_noop(const OpContext&) {
  return OpOutput{};
}

// Work on large buffers is done in chunks of this size, with a look at the cancel flag between.
constexpr uint64_t kChunkBytes = 1 << 20;

Error cancelled_error(const char* op) {
  return Error(ErrorCode::kCancelled, std::string(op) + ": cancelled while running");
}

// Copies the input to the output. output_capacity must be >= input_bytes.
Result<OpOutput> op_echo(const OpContext& c) {
  if (c.output_capacity < c.input_bytes) {
    return Error(ErrorCode::kInvalidArgument,
                 "echo: output buffer holds " + std::to_string(c.output_capacity) +
                     " bytes, input is " + std::to_string(c.input_bytes));
  }
  const bool overlap =
      c.input_bytes > 0 && c.output < c.input + c.input_bytes && c.input < c.output + c.input_bytes;
  if (overlap) {
    std::memmove(c.output, c.input, c.input_bytes);  // one piece: chunks could clobber input
  } else {
    for (uint64_t done = 0; done < c.input_bytes; done += kChunkBytes) {
      if (done > 0 && c.cancel_requested.load(std::memory_order_relaxed) != 0) {
        return cancelled_error("echo");
      }
      std::memcpy(c.output + done, c.input + done, std::min(kChunkBytes, c.input_bytes - done));
    }
  }
  return OpOutput{c.input_bytes, c.input_bytes};
}

// Sleeps `us` microseconds, waking every millisecond to honour a cancel (false: cancelled).
bool sleep_unless_cancelled(const OpContext& c, uint64_t us) {
  const uint64_t end = monotonic_ns() + us * 1000;
  for (;;) {
    uint64_t now = monotonic_ns();
    if (now >= end) return true;
    if (c.cancel_requested.load(std::memory_order_relaxed) != 0) return false;
    uint64_t step = end - now < 1'000'000 ? end - now : 1'000'000;
    timespec ts{0, static_cast<long>(step)};
    nanosleep(&ts, nullptr);
  }
}

// Sleeps for param "us" microseconds (0..60 s), waking every millisecond to honour a cancel.
Result<OpOutput> op_sleep(const OpContext& c) {
  auto us = c.params.get_int("us", 0, 0, 60'000'000);
  if (!us) return us.error();
  if (!sleep_unless_cancelled(c, static_cast<uint64_t>(*us))) return cancelled_error("sleep");
  return OpOutput{0, static_cast<uint64_t>(*us)};
}

// The numbers 0 to param "n" - 1 (at most 1000000) as 8-byte little-endian integers, param
// "us" microseconds apart (0..60 s, before each but the first): one part each for a streaming
// job, all of them in the output buffer otherwise. The value is how many were made.
Result<OpOutput> op_count(const OpContext& c) {
  auto n = c.params.get_int("n", 0, 0, 1'000'000);
  if (!n) return n.error();
  auto us = c.params.get_int("us", 0, 0, 60'000'000);
  if (!us) return us.error();
  const auto count = static_cast<uint64_t>(*n);
  if (c.parts == nullptr && c.output_capacity < count * 8) {
    return Error(ErrorCode::kInvalidArgument,
                 "count: output buffer holds " + std::to_string(c.output_capacity) +
                     " bytes, n = " + std::to_string(count) + " needs " +
                     std::to_string(count * 8) + " (or submit it as a stream)");
  }
  for (uint64_t i = 0; i < count; ++i) {
    if (i > 0 && !sleep_unless_cancelled(c, static_cast<uint64_t>(*us))) {
      return cancelled_error("count");
    }
    if (c.parts == nullptr) {
      std::memcpy(c.output + i * 8, &i, 8);
      continue;
    }
    auto cell = c.parts->next_cell();
    if (!cell) return cell.error();
    std::memcpy(cell->data(), &i, 8);
    c.parts->publish(8);
  }
  return OpOutput{c.parts == nullptr ? count * 8 : 0, count};
}

// CRC32C of the input into `value`; also written little-endian to the output if it has room
// for 4 bytes.
Result<OpOutput> op_checksum(const OpContext& c) {
  uint32_t crc = 0;
  for (uint64_t done = 0; done < c.input_bytes; done += kChunkBytes) {
    if (done > 0 && c.cancel_requested.load(std::memory_order_relaxed) != 0) {
      return cancelled_error("checksum");
    }
    crc = crc32c(c.input + done, std::min(kChunkBytes, c.input_bytes - done), crc);
  }
  OpOutput out{0, crc};
  if (c.output_capacity >= 4) {
    std::memcpy(c.output, &crc, 4);
    out.output_bytes = 4;
  }
  return out;
}

constexpr OpInfo kOps[] = {
    {1, "noop", "does nothing; measures the round trip", op_noop},
    {2, "echo", "copies the input buffer to the output buffer", op_echo},
    {3, "sleep", "sleeps for param us microseconds", op_sleep},
    {4, "checksum", "CRC32C of the input into the result value", op_checksum},
    // The catalog's tensor ops (gpuq/common/tensor_ops.hpp): each backend runs them its own way.
    {5, "conv2d", "2-D convolution, NCHW (groups, stride, pad, dilation, bias, fused ReLU)",
     nullptr, tensor::OpKind::kConv2d},
    {6, "activation", "elementwise relu, sigmoid or tanh", nullptr, tensor::OpKind::kActivation},
    {7, "softmax", "softmax or log-softmax over dimension 1", nullptr, tensor::OpKind::kSoftmax},
    {8, "pool2d", "2-D max or average pooling, NCHW", nullptr, tensor::OpKind::kPool2d},
    {9, "batchnorm", "inference batch normalization per channel (fused ReLU)", nullptr,
     tensor::OpKind::kBatchNorm},
    {10, "gemm", "y = alpha op(a) op(b) + beta c, row-major", nullptr, tensor::OpKind::kGemm},
    {11, "count", "0 to param n - 1, param us apart (a part each when streamed)", op_count},
    // Test only: on a GPU worker started with GPUQ_TEST_HOOKS=1, a kernel that writes far out
    // of bounds (a real sticky CUDA error); UnknownOp everywhere else. No CPU implementation.
    {1000, "gpu_fault_test", "test only (GPUQ_TEST_HOOKS=1, gpu pools): a sticky CUDA error",
     nullptr},
};

std::vector<OpInfo>& registry() {
  static std::vector<OpInfo> ops(std::begin(kOps), std::end(kOps));
  return ops;
}

// Owns the plug-in ops the registry's entries point into.
std::vector<std::unique_ptr<PluginOp>>& plugin_ops() {
  static std::vector<std::unique_ptr<PluginOp>> ops;
  return ops;
}

}  // namespace

bool valid_op_name(std::string_view name) {
  if (name.empty() || name.size() > 48) return false;
  return std::all_of(name.begin(), name.end(), [](char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_';
  });
}

Result<void> add_plugin_ops(std::vector<PluginOp> ops) {
  auto& reg = registry();
  for (auto& op : ops) {
    if (!valid_op_name(op.name)) {
      return Error(ErrorCode::kInvalidArgument, "plug-in " + op.library + ": op name '" + op.name +
                                                    "' is not 1-48 characters of [a-z0-9_]");
    }
    for (const auto& have : reg) {
      if (op.name == have.name) {
        return Error(ErrorCode::kInvalidArgument,
                     "plug-in " + op.library + ": op name '" + op.name + "' is already taken" +
                         (have.plugin != nullptr ? " by plug-in " + have.plugin->library
                                                 : std::string(" by a built-in op")));
      }
    }
    const uint32_t id = kFirstPluginOpId + static_cast<uint32_t>(plugin_ops().size());
    plugin_ops().push_back(std::make_unique<PluginOp>(std::move(op)));
    const PluginOp* p = plugin_ops().back().get();
    reg.push_back(OpInfo{id, p->name.c_str(), p->summary.c_str(), nullptr, std::nullopt, p});
  }
  return {};
}

Result<uint32_t> add_python_op(const std::string& name, const std::string& summary, uint32_t pool,
                               std::optional<uint32_t> id, BatchSettings batching) {
  static std::vector<std::unique_ptr<PythonOp>> owned;
  auto& reg = registry();
  const std::string where = "python pool " + std::to_string(pool) + ": op '" + name + "'";
  if (!valid_op_name(name)) {
    return Error(ErrorCode::kInvalidArgument,
                 where + ": the name is not 1-48 characters of [a-z0-9_]");
  }
  if (batching.max_batch_size < 1 || batching.max_batch_size > kMaxBatchSize) {
    return Error(ErrorCode::kInvalidArgument,
                 where + ": max_batch_size " + std::to_string(batching.max_batch_size) +
                     " is not from 1 to " + std::to_string(kMaxBatchSize));
  }
  if (batching.max_queue_delay_us > kMaxQueueDelayUs) {
    return Error(ErrorCode::kInvalidArgument,
                 where + ": max_queue_delay_us " + std::to_string(batching.max_queue_delay_us) +
                     " is more than " + std::to_string(kMaxQueueDelayUs));
  }
  uint32_t next = kFirstPluginOpId;
  for (auto& have : reg) {
    next = std::max(next, have.id + 1);
    if (name != have.name) continue;
    if (have.python == nullptr) {
      return Error(ErrorCode::kInvalidArgument,
                   where + ": the name is taken by " +
                       (have.plugin != nullptr ? "plug-in " + have.plugin->library
                                               : std::string("a built-in op")));
    }
    if (id && *id != have.id) {
      return Error(ErrorCode::kInvalidArgument, where + ": registered twice");
    }
    // The registry is immutable once jobs run: this is still start-up.
    auto* p = const_cast<PythonOp*>(have.python);
    if (std::find(p->pools.begin(), p->pools.end(), pool) == p->pools.end()) {
      p->pools.push_back(pool);
      p->batching.resize(p->pools.size() - 1);
      p->batching.push_back(batching);
    }
    return have.id;
  }
  if (id && *id < next) {
    return Error(ErrorCode::kInvalidArgument,
                 where + ": id " + std::to_string(*id) + " is below the next free one");
  }
  owned.push_back(std::make_unique<PythonOp>(PythonOp{name, summary, {pool}, {batching}}));
  const PythonOp* p = owned.back().get();
  reg.push_back(OpInfo{id.value_or(next), p->name.c_str(), p->summary.c_str(), nullptr,
                       std::nullopt, nullptr, p});
  return reg.back().id;
}

Result<bool> set_python_pool_ops(uint32_t pool, std::vector<ListedPythonOp>& ops) {
  auto& reg = registry();
  auto has_pool = [&](const OpInfo& op) {
    return op.python != nullptr && std::find(op.python->pools.begin(), op.python->pools.end(),
                                             pool) != op.python->pools.end();
  };
  // Checked whole before anything changes.
  for (size_t i = 0; i < ops.size(); ++i) {
    const ListedPythonOp& op = ops[i];
    const std::string where = "python pool " + std::to_string(pool) + ": op '" + op.name + "'";
    for (size_t j = 0; j < i; ++j) {
      if (ops[j].name == op.name)
        return Error(ErrorCode::kInvalidArgument, where + ": listed twice");
    }
    if (!valid_op_name(op.name)) {
      return Error(ErrorCode::kInvalidArgument,
                   where + ": the name is not 1-48 characters of [a-z0-9_]");
    }
    const BatchSettings& b = op.batching;
    if (b.max_batch_size < 1 || b.max_batch_size > kMaxBatchSize ||
        b.max_queue_delay_us > kMaxQueueDelayUs) {
      return Error(ErrorCode::kInvalidArgument,
                   where + ": max_batch_size " + std::to_string(b.max_batch_size) + " (1 to " +
                       std::to_string(kMaxBatchSize) + ") or max_queue_delay_us " +
                       std::to_string(b.max_queue_delay_us) + " (at most " +
                       std::to_string(kMaxQueueDelayUs) + ") out of range");
    }
    for (const OpInfo& have : reg) {
      if (op.name == have.name && have.python == nullptr) {
        return Error(ErrorCode::kInvalidArgument,
                     where + ": the name is taken by " +
                         (have.plugin != nullptr ? "plug-in " + have.plugin->library
                                                 : std::string("a built-in op")));
      }
    }
  }
  std::vector<std::string> before, after;
  for (const OpInfo& op : reg) {
    if (has_pool(op)) before.emplace_back(op.name);
  }
  forget_python_pool(pool);
  for (ListedPythonOp& op : ops) {
    auto id = add_python_op(op.name, op.summary, pool, std::nullopt, op.batching);
    GPUQ_ASSERT(id.ok());  // checked above
    op.id = *id;
    after.push_back(op.name);
  }
  std::sort(before.begin(), before.end());
  std::sort(after.begin(), after.end());
  return before != after;
}

std::vector<ListedPythonOp> python_pool_ops(uint32_t pool) {
  std::vector<ListedPythonOp> out;
  for (const OpInfo& op : registry()) {
    if (op.python == nullptr) continue;
    const auto& pools = op.python->pools;
    if (std::find(pools.begin(), pools.end(), pool) == pools.end()) continue;
    out.push_back({op.name, op.summary, op.python->batching_on(pool), op.id});
  }
  return out;
}

void forget_python_pool(uint32_t pool) {
  for (const OpInfo& op : registry()) {
    if (op.python == nullptr) continue;
    auto& pools = const_cast<PythonOp*>(op.python)->pools;  // start-up: see add_python_op
    auto& batching = const_cast<PythonOp*>(op.python)->batching;
    for (size_t i = pools.size(); i-- > 0;) {
      if (pools[i] != pool) continue;
      pools.erase(pools.begin() + static_cast<std::ptrdiff_t>(i));
      if (i < batching.size()) batching.erase(batching.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
}

uint64_t python_rows(const ParamBlock& params) {
  auto r = params.get_int(kPythonRowsParam, 1, 0, kMaxBatchSize);
  return r ? static_cast<uint64_t>(*r) : 1;
}

std::string python_op_list(uint32_t pool) {
  nlohmann::json list = nlohmann::json::array();
  for (const OpInfo& op : op_registry()) {
    if (op.python != nullptr && std::find(op.python->pools.begin(), op.python->pools.end(), pool) !=
                                    op.python->pools.end()) {
      list.push_back({op.id, op.name});
    }
  }
  return list.dump();
}

std::span<const OpInfo> op_registry() {
  return registry();
}

const OpInfo* find_op(uint32_t id) {
  for (const auto& op : registry()) {
    if (op.id == id) return &op;
  }
  return nullptr;
}

std::string plugin_op_list() {
  nlohmann::json list = nlohmann::json::array();
  for (const OpInfo& op : op_registry()) {
    if (op.plugin != nullptr) list.push_back({op.id, op.name});
  }
  return list.dump();
}

}  // namespace gpuq::daemon
