// FakeGpuTree: a directory laid out like the parts of /proc and /sys that GPU discovery reads
// (daemon/supervisor/gpu_discovery.hpp), for tests on machines without a GPU:
//   <root>/proc/driver/nvidia/gpus/<bus id>/information
//   <root>/sys/bus/pci/devices/<bus id>/local_cpulist, numa_node
// Give the root to read_procfs_gpus()/discover_gpus() (GpuDiscoveryOptions::root), or to gpuqd
// as GPUQ_TEST_GPU_ROOT with GPUQ_TEST_HOOKS=1. The directory is removed with the object.
//
// Test-only code. Not thread-safe.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

namespace gpuq::test {

struct FakeGpu {
  std::string bus_id;  // as the driver names its directory: "0000:3b:00.0"
  std::string model = "NVIDIA H100 80GB HBM3";
  std::string uuid;              // "GPU-...", or "GPU-????..." as a driver hides it
  std::string local_cpulist;     // empty: no sysfs entry at all
  std::string numa_node = "-1";  // written with local_cpulist
  bool excluded = false;
};

class FakeGpuTree {
 public:
  FakeGpuTree() {
    char pattern[] = "/tmp/gpuq-fake-gpu-XXXXXX";
    if (::mkdtemp(pattern) == nullptr) throw std::runtime_error("mkdtemp failed");
    root_ = pattern;
  }
  FakeGpuTree(const FakeGpuTree&) = delete;
  FakeGpuTree& operator=(const FakeGpuTree&) = delete;
  ~FakeGpuTree() {
    std::error_code ignored;
    std::filesystem::remove_all(root_, ignored);
  }

  const std::string& root() const noexcept { return root_; }

  // Creates <root>/proc/driver/nvidia (a loaded driver) with no GPU yet.
  void add_driver() { std::filesystem::create_directories(root_ + "/proc/driver/nvidia/gpus"); }

  // Adds `gpu` (and the driver directory) in the format of the NVIDIA driver's files.
  void add_gpu(const FakeGpu& gpu) {
    add_driver();
    const std::string dir = root_ + "/proc/driver/nvidia/gpus/" + gpu.bus_id;
    std::filesystem::create_directories(dir);
    write(dir + "/information", "Model: \t\t " + gpu.model + "\nIRQ:   \t\t 59\nGPU UUID: \t " +
                                    gpu.uuid +
                                    "\nVideo BIOS: \t 96.00.99.00.01\nBus Type: \t PCIe\n"
                                    "DMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\n"
                                    "Bus Location: \t " +
                                    gpu.bus_id + "\nDevice Minor: \t 0\nGPU Excluded:\t " +
                                    (gpu.excluded ? "Yes" : "No") + "\n");
    if (!gpu.local_cpulist.empty()) {
      const std::string sys = root_ + "/sys/bus/pci/devices/" + gpu.bus_id;
      std::filesystem::create_directories(sys);
      write(sys + "/local_cpulist", gpu.local_cpulist + "\n");
      write(sys + "/numa_node", gpu.numa_node + "\n");
    }
  }

  static void write(const std::string& path, const std::string& text) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out) throw std::runtime_error("cannot write " + path);
  }

 private:
  std::string root_;
};

}  // namespace gpuq::test
