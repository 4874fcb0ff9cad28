/* A stand-in for libnvidia-ml.so.1 with one GPU, for tests on machines without NVIDIA
 * hardware (GPUQ_TEST_NVML_LIBRARY, a test hook: docs/service.md, "Test hooks"). It has only
 * the entry points gpuqd's discovery and GPU sampler bind (daemon/supervisor/gpu_discovery.cpp)
 * and answers with fixed figures: 80 GiB of memory, a quarter of it used, 42 % utilisation.
 * Its types follow nvml.h (NVML API 11 and later). */
#include <stdio.h>
#include <string.h>

typedef int nvmlReturn_t; /* NVML_SUCCESS is 0 */
enum { kSuccess = 0, kInvalidArgument = 2, kUninitialized = 1 };

typedef struct {
  char bus_id_legacy[16];
  unsigned int domain, bus, device, pci_device_id, pci_subsystem_id;
  char bus_id[32];
} nvmlPciInfo_t;
typedef struct {
  unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
  unsigned int gpu, memory;
} nvmlUtilization_t;

static int initialized;
static int the_device; /* the one GPU's handle points here */
#define DEVICE ((void*)&the_device)

nvmlReturn_t nvmlInit_v2(void) {
  initialized = 1;
  return kSuccess;
}
nvmlReturn_t nvmlShutdown(void) {
  initialized = 0;
  return kSuccess;
}
const char* nvmlErrorString(nvmlReturn_t rc) {
  return rc == kSuccess ? "Success" : "fake NVML error";
}
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int* count) {
  if (!initialized) return kUninitialized;
  *count = 1;
  return kSuccess;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, void** device) {
  if (!initialized) return kUninitialized;
  if (index != 0) return kInvalidArgument;
  *device = DEVICE;
  return kSuccess;
}
nvmlReturn_t nvmlDeviceGetUUID(void* device, char* uuid, unsigned int length) {
  if (device != DEVICE) return kInvalidArgument;
  snprintf(uuid, length, "GPU-fa4e0000-0000-0000-0000-000000000001");
  return kSuccess;
}
nvmlReturn_t nvmlDeviceGetName(void* device, char* name, unsigned int length) {
  if (device != DEVICE) return kInvalidArgument;
  snprintf(name, length, "gpuq fake NVML GPU");
  return kSuccess;
}
nvmlReturn_t nvmlDeviceGetMemoryInfo(void* device, nvmlMemory_t* memory) {
  if (device != DEVICE) return kInvalidArgument;
  memory->total = 80ull << 30;
  memory->used = 20ull << 30;
  memory->free = memory->total - memory->used;
  return kSuccess;
}
nvmlReturn_t nvmlDeviceGetPciInfo_v3(void* device, nvmlPciInfo_t* pci) {
  if (device != DEVICE) return kInvalidArgument;
  memset(pci, 0, sizeof *pci);
  snprintf(pci->bus_id, sizeof pci->bus_id, "00000000:3B:00.0");
  pci->bus = 0x3b;
  return kSuccess;
}
nvmlReturn_t nvmlDeviceGetUtilizationRates(void* device, nvmlUtilization_t* utilization) {
  if (device != DEVICE) return kInvalidArgument;
  utilization->gpu = 42;
  utilization->memory = 17;
  return kSuccess;
}
