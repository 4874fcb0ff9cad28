// GPU discovery without CUDA: what NVIDIA GPUs this machine has (UUID, PCI bus id, name, memory,
// the CPUs local to each), found without creating a CUDA context and without linking any CUDA or
// NVIDIA library (docs/design/requirements.md, "Processes"). Two sources, in order:
//   1. NVML, loaded at run time with dlopen("libnvidia-ml.so.1"). NVML talks to the kernel
//      driver directly; it creates no CUDA context.
//   2. The driver's files: /proc/driver/nvidia/gpus/<bus id>/information, then sysfs
//      (/sys/bus/pci/devices/<bus id>/local_cpulist, numa_node) for locality.
// Either way GPUs are listed in PCI bus order, the order CUDA uses with
// CUDA_DEVICE_ORDER=PCI_BUS_ID (and nvidia-smi's indexes), so an index in the config means the
// same GPU to gpuq, to CUDA in a worker and to the operator.
//
// The readers of /proc and sysfs take a root directory ("/" in production) so that the unit
// tests, and the integration tests through GPUQ_TEST_GPU_ROOT, can point them at a fake tree.
// docs/design/gpu_discovery.md describes the choices.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "config.hpp"
#include "gpuq/error.hpp"

namespace gpuq::daemon {

struct GpuInfo {
  uint32_t index = 0;           // position in PCI bus order among the GPUs found
  std::string uuid;             // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"; empty if not readable
  std::string pci_bus_id;       // sysfs form, lower case: "0000:3b:00.0"
  std::string name;             // "NVIDIA H100 80GB HBM3"
  uint64_t memory_bytes = 0;    // total device memory; 0 when the source does not say (procfs)
  std::vector<int> local_cpus;  // CPUs near the GPU (sysfs local_cpulist); empty: unknown
  int numa_node = -1;           // -1: unknown or no NUMA
};

struct GpuDiscovery {
  std::vector<GpuInfo> gpus;
  std::string source;  // "nvml", "procfs", or "none"
  // Why no GPU was found, naming every source tried ("no NVIDIA driver: /proc/driver/nvidia not
  // found and libnvidia-ml.so.1 cannot be loaded: ..."); empty when `gpus` is not empty.
  std::string problem;
};

inline constexpr const char* kNvmlLibrary = "libnvidia-ml.so.1";
struct GpuDiscoveryOptions {
  std::string root = "/";  // where /proc and /sys are; a fake tree in tests
  bool use_nvml = true;    // false with a fake root: the real NVML would describe the real host
  std::string nvml_library = kNvmlLibrary;  // a stand-in in tests (GPUQ_TEST_NVML_LIBRARY)
  // Whether the GPUs found are real (false: a fake tree or a stand-in NVML, behind which no
  // device stands, so gpu pools run gpuq-worker).
  bool fake() const { return root != "/" || nvml_library != kNvmlLibrary; }
};

// Finds the GPUs in this process: NVML first, then /proc and sysfs. Never fails: a machine
// without GPUs gives an empty list and `problem`. Loads NVML into this process (and unloads it
// again), so the supervisor calls discover_gpus_isolated() instead. Not thread-safe.
GpuDiscovery discover_gpus(const GpuDiscoveryOptions& options);

// discover_gpus() in a short-lived child process (fork, before the supervisor starts any
// worker), whose answer comes back over a pipe: the supervisor never maps libnvidia-ml (the
// lifecycle test checks that no NVIDIA library is mapped in it), and a wedged driver that hangs
// NVML costs at most `timeout_ms`, after which the child is killed and the answer is "no GPU"
// with that reason. Call only while the process is single-threaded. Blocking.
GpuDiscovery discover_gpus_isolated(const GpuDiscoveryOptions& options, uint32_t timeout_ms);

// ---- Sampling, for metrics --------------------------------------------------------------------
//
// gpuqd keeps NVML out of its own process for sampling too: a child (`gpuqd --sample-gpus MS`,
// GpuSampler) loads NVML, and writes one line per interval on its stdout, which the supervisor
// reads in its loop (docs/metrics.md).

// One GPU as NVML saw it; a field NVML could not read is empty.
struct GpuSample {
  uint32_t index = 0;  // in PCI bus order (filled by the supervisor from discovery)
  std::string uuid;
  std::optional<double> utilization;  // 0 to 1, over NVML's last sample period
  std::optional<uint64_t> memory_used_bytes;
  std::optional<uint64_t> memory_total_bytes;
};

// The line the sampler writes ({"gpus": [{"uuid", "utilization", "memory_used_bytes",
// "memory_total_bytes"}]}, newline-terminated), and back. Errors: InvalidArgument.
std::string gpu_samples_line(const std::vector<GpuSample>& samples);
Result<std::vector<GpuSample>> parse_gpu_samples_line(std::string_view line);

// The sampler's body: loads `nvml_library`, then samples every `interval_ms` and writes a line
// to `out_fd` until a write fails (the supervisor has gone: 0) or NVML fails (1, logged).
int run_gpu_sampler(const std::string& nvml_library, uint32_t interval_ms, int out_fd);

// The discovery options for gpuqd: the real machine, unless the test hooks are on
// (GPUQ_TEST_HOOKS=1) and GPUQ_TEST_GPU_ROOT names a directory holding a fake proc/ and sys/
// tree, which is then read instead and NVML is not tried, or GPUQ_TEST_NVML_LIBRARY names a
// stand-in for libnvidia-ml.so.1 (tests/support/fake_nvml.c), loaded instead of it (by
// discovery and the GPU sampler). Not thread-safe (getenv).
GpuDiscoveryOptions gpu_discovery_options_from_environment(bool test_hooks_enabled);

// The GPUs of a gpu pool, as indexes into `found`: every GPU with "gpus": "all", else those the
// list names, in its order. Errors: NoDevice with the reason, which names the list entry at fault
// ("gpus[1]: no GPU with index 3 (1 found: 0 GPU-...)"), or `problem` when nothing was found.
Result<std::vector<uint32_t>> select_gpus(const PoolConfig& pool, const GpuDiscovery& found);

// ---- Parsers, exposed for the unit tests -----------------------------------------------------

// "0-3,8,10-11\n" -> {0, 1, 2, 3, 8, 10, 11}. Errors: InvalidArgument for anything else.
Result<std::vector<int>> parse_cpu_list(std::string_view text);

// A PCI address in any of the forms the sources use ("00000000:3B:00.0" from NVML,
// "0000:3b:00.0" from procfs and sysfs) in sysfs form. Errors: InvalidArgument.
Result<std::string> normalize_pci_bus_id(std::string_view text);

// The fields of /proc/driver/nvidia/gpus/<bus id>/information that discovery uses: "Model",
// "GPU UUID", "Bus Location" and "GPU Excluded". A UUID the driver hides from this user (shown
// as "GPU-????????-...") comes back empty. Errors: InvalidArgument when Model or Bus Location
// is missing.
struct ProcGpuInformation {
  std::string model;
  std::string uuid;
  std::string bus_location;  // as written
  bool excluded = false;     // "GPU Excluded: Yes": the driver keeps it from CUDA
};
Result<ProcGpuInformation> parse_proc_gpu_information(std::string_view text);

// The GPUs that <root>/proc/driver/nvidia/gpus lists, with locality from sysfs, in PCI bus
// order; excluded GPUs are left out. Errors: NoDevice with the reason (no driver directory, no
// GPU in it, an unreadable information file).
Result<std::vector<GpuInfo>> read_procfs_gpus(const std::string& root);

// Fills `gpu.local_cpus` and `gpu.numa_node` from <root>/sys/bus/pci/devices/<bus id>/ when
// those files exist; leaves them unknown otherwise.
void read_sysfs_locality(const std::string& root, GpuInfo& gpu);

}  // namespace gpuq::daemon
