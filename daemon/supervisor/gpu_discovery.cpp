#include "gpu_discovery.hpp"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "gpuq/common/clock.hpp"
#include "gpuq/common/log.hpp"
#include "gpuq/common/posix_call.hpp"
#include "gpuq/common/unique_fd.hpp"

namespace gpuq::daemon {
namespace {

using nlohmann::json;

// ---- NVML, declared here: the build has no nvml.h, and must not need one --------------------
//
// Only the handful of entry points discovery uses, with the types of nvml.h (NVML API version
// 11 and later; every function used has existed since driver 390). Each is looked up with
// dlsym, so a missing one is an error, not a crash.
namespace nvml {

using Return = int;  // nvmlReturn_t; NVML_SUCCESS is 0
constexpr Return kSuccess = 0;
struct DeviceSt;
using Device = DeviceSt*;  // nvmlDevice_t

constexpr unsigned kUuidBytes = 96;  // NVML_DEVICE_UUID_V2_BUFFER_SIZE
constexpr unsigned kNameBytes = 96;  // NVML_DEVICE_NAME_V2_BUFFER_SIZE

struct PciInfo {  // nvmlPciInfo_t
  char bus_id_legacy[16];
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pci_device_id;
  unsigned int pci_subsystem_id;
  char bus_id[32];
};
static_assert(offsetof(PciInfo, domain) == 16 && offsetof(PciInfo, bus_id) == 36);

struct Memory {  // nvmlMemory_t
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};

struct Utilization {  // nvmlUtilization_t: percent of the last sample period
  unsigned int gpu;
  unsigned int memory;
};

}  // namespace nvml

// dlopen'ed NVML; unloaded (after nvmlShutdown) when it goes out of scope.
class NvmlLibrary {
 public:
  NvmlLibrary() = default;
  NvmlLibrary(const NvmlLibrary&) = delete;
  NvmlLibrary& operator=(const NvmlLibrary&) = delete;
  ~NvmlLibrary() {
    // Best effort: a library that cannot be shut down or unloaded leaves nothing to undo.
    if (initialized_ && shutdown_ != nullptr) (void)shutdown_();
    if (handle_ != nullptr) (void)dlclose(handle_);
  }

  Result<void> load(const std::string& library) {
    // RTLD_LOCAL: NVML's symbols stay out of the global namespace of this process.
    auto handle = GPUQ_DL_CALL(::dlopen, library.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      return Error(ErrorCode::kNoDevice,
                   library + " cannot be loaded: " + handle.error().message());
    }
    handle_ = *handle;
    if (auto r = bind(init_, "nvmlInit_v2"); !r) return r;
    if (auto r = bind(shutdown_, "nvmlShutdown"); !r) return r;
    if (auto r = bind(error_string_, "nvmlErrorString"); !r) return r;
    if (auto r = bind(get_count_, "nvmlDeviceGetCount_v2"); !r) return r;
    if (auto r = bind(get_handle_, "nvmlDeviceGetHandleByIndex_v2"); !r) return r;
    if (auto r = bind(get_uuid_, "nvmlDeviceGetUUID"); !r) return r;
    if (auto r = bind(get_name_, "nvmlDeviceGetName"); !r) return r;
    if (auto r = bind(get_memory_, "nvmlDeviceGetMemoryInfo"); !r) return r;
    // The _v3 PCI query fills busId in full; older drivers have only _v2, with the same struct.
    if (!bind(get_pci_, "nvmlDeviceGetPciInfo_v3")) {
      if (auto r = bind(get_pci_, "nvmlDeviceGetPciInfo_v2"); !r) return r;
    }
    // Optional: locality comes from sysfs first; utilisation is only for metrics.
    (void)bind(get_affinity_, "nvmlDeviceGetCpuAffinity");
    (void)bind(get_utilization_, "nvmlDeviceGetUtilizationRates");
    const nvml::Return rc = init_();
    if (rc != nvml::kSuccess) return failed("nvmlInit", rc);
    initialized_ = true;
    return {};
  }

  Result<std::vector<GpuInfo>> gpus() {
    unsigned int count = 0;
    if (nvml::Return rc = get_count_(&count); rc != nvml::kSuccess) {
      return failed("nvmlDeviceGetCount", rc);
    }
    std::vector<GpuInfo> out;
    for (unsigned int i = 0; i < count; ++i) {
      nvml::Device device = nullptr;
      if (nvml::Return rc = get_handle_(i, &device); rc != nvml::kSuccess) {
        return failed("nvmlDeviceGetHandleByIndex(" + std::to_string(i) + ")", rc);
      }
      GpuInfo g;
      char uuid[nvml::kUuidBytes] = "";
      if (nvml::Return rc = get_uuid_(device, uuid, sizeof uuid); rc != nvml::kSuccess) {
        return failed("nvmlDeviceGetUUID(" + std::to_string(i) + ")", rc);
      }
      g.uuid = uuid;
      nvml::PciInfo pci{};
      if (nvml::Return rc = get_pci_(device, &pci); rc != nvml::kSuccess) {
        return failed("nvmlDeviceGetPciInfo(" + std::to_string(i) + ")", rc);
      }
      pci.bus_id[sizeof pci.bus_id - 1] = '\0';
      auto bus = normalize_pci_bus_id(pci.bus_id);
      if (!bus)
        return Error(ErrorCode::kNoDevice,
                     "NVML: GPU " + std::to_string(i) + ": " + bus.error().message());
      g.pci_bus_id = *bus;
      char name[nvml::kNameBytes] = "";
      if (get_name_(device, name, sizeof name) == nvml::kSuccess) g.name = name;
      nvml::Memory memory{};
      if (get_memory_(device, &memory) == nvml::kSuccess) g.memory_bytes = memory.total;
      if (get_affinity_ != nullptr) {
        unsigned long mask[16] = {};  // 1024 CPUs
        if (get_affinity_(device, std::size(mask), mask) == nvml::kSuccess) {
          constexpr int kBits = 8 * sizeof(unsigned long);
          for (int c = 0; c < static_cast<int>(std::size(mask)) * kBits; ++c) {
            if ((mask[c / kBits] >> (c % kBits)) & 1ul) g.local_cpus.push_back(c);
          }
        }
      }
      out.push_back(std::move(g));
    }
    return out;
  }

  // One sample of every GPU NVML sees: utilisation and memory, by UUID. A field NVML cannot
  // read (a GPU fallen off the bus) is left out.
  Result<std::vector<GpuSample>> samples() {
    unsigned int count = 0;
    if (nvml::Return rc = get_count_(&count); rc != nvml::kSuccess) {
      return failed("nvmlDeviceGetCount", rc);
    }
    std::vector<GpuSample> out;
    for (unsigned int i = 0; i < count; ++i) {
      nvml::Device device = nullptr;
      char uuid[nvml::kUuidBytes] = "";
      if (get_handle_(i, &device) != nvml::kSuccess ||
          get_uuid_(device, uuid, sizeof uuid) != nvml::kSuccess) {
        continue;
      }
      GpuSample s;
      s.uuid = uuid;
      nvml::Utilization u{};
      if (get_utilization_ != nullptr && get_utilization_(device, &u) == nvml::kSuccess) {
        s.utilization = std::min(u.gpu, 100u) / 100.0;
      }
      nvml::Memory memory{};
      if (get_memory_(device, &memory) == nvml::kSuccess) {
        s.memory_used_bytes = memory.used;
        s.memory_total_bytes = memory.total;
      }
      out.push_back(std::move(s));
    }
    return out;
  }

 private:
  template <typename Fn>
  Result<void> bind(Fn*& fn, const char* symbol) {
    auto sym = GPUQ_DL_CALL(::dlsym, handle_, symbol);
    if (!sym) {
      fn = nullptr;
      return Error(ErrorCode::kNoDevice,
                   std::string("NVML has no ") + symbol + " (driver too old?)");
    }
    fn = reinterpret_cast<Fn*>(*sym);
    return {};
  }

  Error failed(const std::string& call, nvml::Return rc) const {
    const char* text = error_string_ != nullptr ? error_string_(rc) : nullptr;
    return Error(ErrorCode::kNoDevice, "NVML: " + call +
                                           " failed: " + (text != nullptr ? text : "error") + " (" +
                                           std::to_string(rc) + ")");
  }

  void* handle_ = nullptr;
  bool initialized_ = false;
  nvml::Return (*init_)() = nullptr;
  nvml::Return (*shutdown_)() = nullptr;
  const char* (*error_string_)(nvml::Return) = nullptr;
  nvml::Return (*get_count_)(unsigned int*) = nullptr;
  nvml::Return (*get_handle_)(unsigned int, nvml::Device*) = nullptr;
  nvml::Return (*get_uuid_)(nvml::Device, char*, unsigned int) = nullptr;
  nvml::Return (*get_name_)(nvml::Device, char*, unsigned int) = nullptr;
  nvml::Return (*get_memory_)(nvml::Device, nvml::Memory*) = nullptr;
  nvml::Return (*get_pci_)(nvml::Device, nvml::PciInfo*) = nullptr;
  nvml::Return (*get_affinity_)(nvml::Device, unsigned int, unsigned long*) = nullptr;
  nvml::Return (*get_utilization_)(nvml::Device, nvml::Utilization*) = nullptr;
};

// ---- Files -----------------------------------------------------------------------------------

std::string join(const std::string& root, const std::string& relative) {
  if (root.empty()) return "/" + relative;
  return root.back() == '/' ? root + relative : root + "/" + relative;
}

// A probe: whatever stat's failure (ENOENT, EACCES), the path is not a directory to use.
bool is_directory(const std::string& path) {
  struct stat st {};
  return GPUQ_POSIX_CALL(::stat, path.c_str(), &st).ok() && S_ISDIR(st.st_mode);
}

bool read_file(const std::string& path, std::string& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  out.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return true;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() &&
         (s.back() == ' ' || s.back() == '\t' || s.back() == '\n' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  return s;
}

Result<int> parse_int(std::string_view s) {
  int v = 0;
  auto r = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || r.ec != std::errc() || r.ptr != s.data() + s.size() || v < 0) {
    return Error(ErrorCode::kInvalidArgument, "'" + std::string(s) + "' is not a CPU number");
  }
  return v;
}

// {domain, bus, device, function} of a normalized bus id, for PCI bus order.
std::tuple<unsigned long, unsigned long, unsigned long, unsigned long> pci_order(
    const std::string& bus_id) {
  unsigned long d = 0, b = 0, s = 0, f = 0;
  std::sscanf(bus_id.c_str(), "%lx:%lx:%lx.%lx", &d, &b, &s, &f);
  return {d, b, s, f};
}

void sort_and_number(std::vector<GpuInfo>& gpus) {
  std::sort(gpus.begin(), gpus.end(), [](const GpuInfo& a, const GpuInfo& b) {
    return pci_order(a.pci_bus_id) < pci_order(b.pci_bus_id);
  });
  for (size_t i = 0; i < gpus.size(); ++i) gpus[i].index = static_cast<uint32_t>(i);
}

json to_json(const GpuDiscovery& d) {
  json j{{"source", d.source}, {"problem", d.problem}, {"gpus", json::array()}};
  for (const GpuInfo& g : d.gpus) {
    j["gpus"].push_back({{"index", g.index},
                         {"uuid", g.uuid},
                         {"pci_bus_id", g.pci_bus_id},
                         {"name", g.name},
                         {"memory_bytes", g.memory_bytes},
                         {"local_cpus", g.local_cpus},
                         {"numa_node", g.numa_node}});
  }
  return j;
}

GpuDiscovery from_json(const json& j) {
  GpuDiscovery d;
  d.source = j.at("source").get<std::string>();
  d.problem = j.at("problem").get<std::string>();
  for (const auto& g : j.at("gpus")) {
    GpuInfo info;
    info.index = g.at("index").get<uint32_t>();
    info.uuid = g.at("uuid").get<std::string>();
    info.pci_bus_id = g.at("pci_bus_id").get<std::string>();
    info.name = g.at("name").get<std::string>();
    info.memory_bytes = g.at("memory_bytes").get<uint64_t>();
    info.local_cpus = g.at("local_cpus").get<std::vector<int>>();
    info.numa_node = g.at("numa_node").get<int>();
    d.gpus.push_back(std::move(info));
  }
  return d;
}

GpuDiscovery none(std::string problem) {
  GpuDiscovery d;
  d.source = "none";
  d.problem = std::move(problem);
  return d;
}

}  // namespace

// ---- Parsers ---------------------------------------------------------------------------------

Result<std::vector<int>> parse_cpu_list(std::string_view text) {
  std::vector<int> cpus;
  text = trim(text);
  if (text.empty()) return cpus;
  while (!text.empty()) {
    const size_t comma = text.find(',');
    const std::string_view part = trim(text.substr(0, comma));
    const size_t dash = part.find('-');
    if (dash == std::string_view::npos) {
      auto c = parse_int(part);
      if (!c) return c.error();
      cpus.push_back(*c);
    } else {
      auto a = parse_int(part.substr(0, dash));
      if (!a) return a.error();
      auto b = parse_int(part.substr(dash + 1));
      if (!b) return b.error();
      if (*b < *a || *b - *a > 65536) {
        return Error(ErrorCode::kInvalidArgument, "bad CPU range '" + std::string(part) + "'");
      }
      for (int c = *a; c <= *b; ++c) cpus.push_back(c);
    }
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

Result<std::string> normalize_pci_bus_id(std::string_view text) {
  text = trim(text);
  const Error bad(ErrorCode::kInvalidArgument, "'" + std::string(text) + "' is not a PCI bus id");
  // domain:bus:device.function, each field hex of at most `digits` digits, nothing else.
  unsigned long fields[4] = {};
  const size_t digits[4] = {8, 2, 2, 1};
  const char separators[4] = {':', ':', '.', '\0'};
  std::string_view rest = text;
  for (int i = 0; i < 4; ++i) {
    const size_t end = separators[i] == '\0' ? rest.size() : rest.find(separators[i]);
    if (end == std::string_view::npos || end == 0 || end > digits[i]) return bad;
    const std::string_view field = rest.substr(0, end);
    auto r = std::from_chars(field.data(), field.data() + field.size(), fields[i], 16);
    if (r.ec != std::errc() || r.ptr != field.data() + field.size()) return bad;
    rest.remove_prefix(separators[i] == '\0' ? end : end + 1);
  }
  if (fields[2] > 0x1F || fields[3] > 7) return bad;
  char out[32];
  // sysfs writes the domain with 4 digits when it fits (it nearly always does), else all 8.
  std::snprintf(out, sizeof out,
                fields[0] <= 0xFFFF ? "%04lx:%02lx:%02lx.%lx" : "%08lx:%02lx:%02lx.%lx", fields[0],
                fields[1], fields[2], fields[3]);
  return std::string(out);
}

Result<ProcGpuInformation> parse_proc_gpu_information(std::string_view text) {
  ProcGpuInformation info;
  while (!text.empty()) {
    const size_t nl = text.find('\n');
    const std::string_view line = text.substr(0, nl);
    text.remove_prefix(nl == std::string_view::npos ? text.size() : nl + 1);
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos) continue;
    const std::string_view key = trim(line.substr(0, colon));
    const std::string_view value = trim(line.substr(colon + 1));
    if (key == "Model") {
      info.model = value;
    } else if (key == "GPU UUID") {
      // Some drivers hide the UUID from unprivileged readers as "GPU-????????-...".
      if (value.find('?') == std::string_view::npos) info.uuid = value;
    } else if (key == "Bus Location") {
      info.bus_location = value;
    } else if (key == "GPU Excluded") {
      info.excluded = value == "Yes";
    }
  }
  if (info.model.empty()) return Error(ErrorCode::kInvalidArgument, "no \"Model:\" line");
  if (info.bus_location.empty()) {
    return Error(ErrorCode::kInvalidArgument, "no \"Bus Location:\" line");
  }
  return info;
}

void read_sysfs_locality(const std::string& root, GpuInfo& gpu) {
  const std::string dir = join(root, "sys/bus/pci/devices/" + gpu.pci_bus_id);
  std::string text;
  if (read_file(dir + "/local_cpulist", text)) {
    if (auto cpus = parse_cpu_list(text); cpus && !cpus->empty()) gpu.local_cpus = *cpus;
  }
  if (read_file(dir + "/numa_node", text)) {
    int node = -1;
    const std::string_view t = trim(text);
    auto r = std::from_chars(t.data(), t.data() + t.size(), node);
    if (r.ec == std::errc() && r.ptr == t.data() + t.size()) gpu.numa_node = node;
  }
}

Result<std::vector<GpuInfo>> read_procfs_gpus(const std::string& root) {
  const std::string driver = join(root, "proc/driver/nvidia");
  if (!is_directory(driver)) {
    return Error(ErrorCode::kNoDevice, driver + " not found");
  }
  const std::string gpus_dir = driver + "/gpus";
  std::vector<std::string> entries;
  // No gpus directory (or none readable) is a driver that lists no GPU: the error below says so.
  if (auto d = GPUQ_NONNULL_CALL(::opendir, gpus_dir.c_str()); d) {
    // readdir's null is the end of the directory (an error, EBADF, needs a bad stream).
    while (const dirent* e = ::readdir(*d)) {
      if (e->d_name[0] != '.') entries.emplace_back(e->d_name);
    }
    // A read-only stream: closing it cannot lose anything.
    (void)::closedir(*d);
  }
  std::vector<GpuInfo> gpus;
  uint32_t excluded = 0;
  for (const std::string& entry : entries) {
    const std::string path = gpus_dir + "/" + entry + "/information";
    std::string text;
    if (!read_file(path, text)) {
      return Error(ErrorCode::kNoDevice, "cannot read " + path + ": " + std::strerror(errno));
    }
    auto info = parse_proc_gpu_information(text);
    if (!info) return Error(ErrorCode::kNoDevice, path + ": " + info.error().message());
    if (info->excluded) {
      ++excluded;
      continue;
    }
    // The directory's name is the bus id too; the file's own line is the authority.
    auto bus = normalize_pci_bus_id(info->bus_location);
    if (!bus) return Error(ErrorCode::kNoDevice, path + ": Bus Location: " + bus.error().message());
    GpuInfo g;
    g.uuid = info->uuid;
    g.pci_bus_id = *bus;
    g.name = info->model;
    read_sysfs_locality(root, g);
    gpus.push_back(std::move(g));
  }
  if (gpus.empty()) {
    return Error(
        ErrorCode::kNoDevice,
        "the NVIDIA driver is loaded but " + gpus_dir + " lists no GPU" +
            (excluded > 0 ? " that is not excluded (" + std::to_string(excluded) + " excluded)"
                          : std::string()));
  }
  sort_and_number(gpus);
  return gpus;
}

// ---- Discovery -------------------------------------------------------------------------------

GpuDiscovery discover_gpus(const GpuDiscoveryOptions& options) {
  std::string nvml_problem = "NVML was not tried (a fake /proc and /sys tree is in use)";
  if (options.use_nvml) {
    NvmlLibrary nvml;
    auto loaded = nvml.load(options.nvml_library);
    auto gpus = loaded ? nvml.gpus() : Result<std::vector<GpuInfo>>(loaded.error());
    if (gpus && !gpus->empty()) {
      GpuDiscovery d;
      d.source = "nvml";
      d.gpus = std::move(*gpus);
      for (GpuInfo& g : d.gpus) {
        // sysfs is the kernel's own view of locality; NVML's affinity mask stays where sysfs
        // has none.
        std::vector<int> from_nvml = std::move(g.local_cpus);
        g.local_cpus.clear();
        read_sysfs_locality(options.root, g);
        if (g.local_cpus.empty()) g.local_cpus = std::move(from_nvml);
      }
      sort_and_number(d.gpus);
      return d;
    }
    nvml_problem = gpus ? "NVML reports no GPU" : gpus.error().message();
  }
  auto procfs = read_procfs_gpus(options.root);
  if (procfs) {
    GpuDiscovery d;
    d.source = "procfs";
    d.gpus = std::move(*procfs);
    return d;
  }
  const bool no_driver = !is_directory(join(options.root, "proc/driver/nvidia"));
  return none(std::string(no_driver ? "no NVIDIA driver: " : "no usable NVIDIA GPU: ") +
              procfs.error().message() + " and " + nvml_problem);
}

GpuDiscovery discover_gpus_isolated(const GpuDiscoveryOptions& options, uint32_t timeout_ms) {
  int fds[2];
  if (auto r = GPUQ_POSIX_CALL(::pipe2, fds, O_CLOEXEC); !r) {
    return none("GPU discovery could not start: " + r.error().message());
  }
  UniqueFd read_end(fds[0]), write_end(fds[1]);
  auto forked = GPUQ_POSIX_CALL(::fork);
  if (!forked) return none("GPU discovery could not start: " + forked.error().message());
  const auto pid = static_cast<pid_t>(*forked);
  if (pid == 0) {
    // The child: the parent is single-threaded (see the contract), so anything may run here,
    // the checked wrappers included. It ends with _exit: no destructor of the parent's objects
    // runs twice.
    read_end.reset();
    const std::string answer = to_json(discover_gpus(options)).dump();
    size_t at = 0;
    while (at < answer.size()) {
      auto n = GPUQ_POSIX_CALL(::write, write_end.get(), answer.data() + at, answer.size() - at);
      if (!n || *n == 0) _exit(1);  // the parent gave up (EPIPE): nobody to tell
      at += static_cast<size_t>(*n);
    }
    _exit(0);
  }
  write_end.reset();
  std::string answer;
  std::string poll_failure;
  const uint64_t deadline = monotonic_ns() + uint64_t{timeout_ms} * 1'000'000;
  bool timed_out = false;
  for (;;) {
    const uint64_t now = monotonic_ns();
    if (now >= deadline) {
      timed_out = true;
      break;
    }
    // EINTR restarts the poll with the same timeout; the deadline check above bounds it.
    pollfd p{read_end.get(), POLLIN, 0};
    auto ready = GPUQ_POSIX_CALL(::poll, &p, 1, static_cast<int>((deadline - now) / 1'000'000) + 1);
    if (!ready) {
      poll_failure = ready.error().message();
      break;
    }
    if (*ready == 0) continue;  // the deadline check above ends it
    char chunk[4096];
    // A read error ends the answer as its end does; the child's exit status says the rest.
    auto n = GPUQ_POSIX_CALL(::read, read_end.get(), chunk, sizeof chunk);
    if (!n || *n == 0) break;
    answer.append(chunk, static_cast<size_t>(*n));
  }
  read_end.reset();
  if (timed_out || !poll_failure.empty()) {
    // The child is not reaped yet, so it cannot be missed; a failure would leave waitpid below
    // waiting for the child to end by itself.
    if (auto r = GPUQ_POSIX_CALL(::kill, pid, SIGKILL); !r) {
      GPUQ_LOG_WARN("GPU discovery: %s", r.error().message().c_str());
    }
  }
  int status = 0;
  if (auto r = GPUQ_POSIX_CALL(::waitpid, pid, &status, 0); !r) {
    // Not this process's child any more (ECHILD: SIGCHLD ignored, or reaped elsewhere): its
    // status is unknown, and the answer alone decides (status 0).
    GPUQ_LOG_WARN("GPU discovery: %s", r.error().message().c_str());
    status = 0;
  }
  if (!poll_failure.empty()) return none("GPU discovery failed: " + poll_failure);
  if (timed_out) {
    return none("GPU discovery did not finish within " + std::to_string(timeout_ms) +
                " ms (a wedged NVIDIA driver?)");
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return none("GPU discovery failed: its process " +
                std::string(WIFSIGNALED(status)
                                ? "was killed by signal " + std::to_string(WTERMSIG(status))
                                : "exited with status " + std::to_string(WEXITSTATUS(status))));
  }
  try {
    return from_json(json::parse(answer));
  } catch (const std::exception& e) {
    return none(std::string("GPU discovery gave a malformed answer: ") + e.what());
  }
}

Result<std::vector<uint32_t>> select_gpus(const PoolConfig& pool, const GpuDiscovery& found) {
  if (found.gpus.empty()) {
    return Error(ErrorCode::kNoDevice,
                 found.problem.empty() ? std::string("no NVIDIA GPU found") : found.problem);
  }
  std::vector<uint32_t> chosen;
  if (pool.all_gpus) {
    for (const GpuInfo& g : found.gpus) chosen.push_back(g.index);
    return chosen;
  }
  auto lower = [](std::string s) {
    std::transform(s.begin(), s.end(), s.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return s;
  };
  auto inventory = [&] {
    std::string s = std::to_string(found.gpus.size()) + " found:";
    for (const GpuInfo& g : found.gpus) {
      s += " " + std::to_string(g.index) + " " + (g.uuid.empty() ? g.pci_bus_id : g.uuid);
      if (&g != &found.gpus.back()) s += ",";
    }
    return s;
  };
  std::vector<size_t> entry_of;  // the list entry that chose each GPU in `chosen`
  for (size_t i = 0; i < pool.gpus.size(); ++i) {
    const GpuSelector& want = pool.gpus[i];
    const std::string key = "gpus[" + std::to_string(i) + "]";
    auto it = std::find_if(found.gpus.begin(), found.gpus.end(), [&](const GpuInfo& g) {
      return want.by_uuid ? !g.uuid.empty() && lower(g.uuid) == lower(want.uuid)
                          : g.index == want.index;
    });
    if (it == found.gpus.end()) {
      return Error(
          ErrorCode::kNoDevice,
          key + ": no GPU with " +
              (want.by_uuid ? "UUID " + want.uuid : "index " + std::to_string(want.index)) + " (" +
              inventory() + ")");
    }
    auto same = std::find(chosen.begin(), chosen.end(), it->index);
    if (same != chosen.end()) {
      return Error(ErrorCode::kNoDevice,
                   "gpus[" + std::to_string(entry_of[static_cast<size_t>(same - chosen.begin())]) +
                       "] and " + key + " name the same GPU (" + std::to_string(it->index) + " " +
                       it->uuid + ")");
    }
    chosen.push_back(it->index);
    entry_of.push_back(i);
  }
  return chosen;
}

std::string gpu_samples_line(const std::vector<GpuSample>& samples) {
  json gpus = json::array();
  for (const GpuSample& s : samples) {
    json g{{"uuid", s.uuid}};
    if (s.utilization) g["utilization"] = *s.utilization;
    if (s.memory_used_bytes) g["memory_used_bytes"] = *s.memory_used_bytes;
    if (s.memory_total_bytes) g["memory_total_bytes"] = *s.memory_total_bytes;
    gpus.push_back(std::move(g));
  }
  return json{{"gpus", std::move(gpus)}}.dump() + "\n";
}

Result<std::vector<GpuSample>> parse_gpu_samples_line(std::string_view line) {
  const json j = json::parse(line, nullptr, false);
  auto bad = [](const std::string& what) {
    return Error(ErrorCode::kInvalidArgument, "GPU sample: " + what);
  };
  if (!j.is_object() || !j.contains("gpus") || !j["gpus"].is_array()) {
    return bad("not an object with a \"gpus\" list");
  }
  std::vector<GpuSample> out;
  for (const json& g : j["gpus"]) {
    if (!g.is_object() || !g.contains("uuid") || !g["uuid"].is_string()) {
      return bad("a GPU without a \"uuid\" string");
    }
    GpuSample s;
    s.uuid = g["uuid"].get<std::string>();
    if (auto it = g.find("utilization"); it != g.end()) {
      if (!it->is_number() || it->get<double>() < 0 || it->get<double>() > 1) {
        return bad("utilization must be a number in [0, 1]");
      }
      s.utilization = it->get<double>();
    }
    for (auto [key, field] : {std::pair{"memory_used_bytes", &GpuSample::memory_used_bytes},
                              std::pair{"memory_total_bytes", &GpuSample::memory_total_bytes}}) {
      if (auto it = g.find(key); it != g.end()) {
        if (!it->is_number_unsigned()) return bad(std::string(key) + " must be a byte count");
        s.*field = it->get<uint64_t>();
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

int run_gpu_sampler(const std::string& nvml_library, uint32_t interval_ms, int out_fd) {
  NvmlLibrary nvml;
  if (auto r = nvml.load(nvml_library); !r) {
    GPUQ_LOG_ERROR("GPU sampler: %s", r.error().message().c_str());
    return 1;
  }
  for (;;) {
    auto samples = nvml.samples();
    if (!samples) {
      GPUQ_LOG_ERROR("GPU sampler: %s", samples.error().message().c_str());
      return 1;
    }
    const std::string line = gpu_samples_line(*samples);
    size_t at = 0;
    while (at < line.size()) {
      auto n = GPUQ_POSIX_CALL(::write, out_fd, line.data() + at, line.size() - at);
      if (!n || *n == 0) return 0;  // the supervisor has gone (EPIPE): nobody to tell
      at += static_cast<size_t>(*n);
    }
    const timespec pause{static_cast<time_t>(interval_ms / 1000),
                         static_cast<long>(interval_ms % 1000) * 1'000'000};
    (void)nanosleep(&pause, nullptr);  // a signal cutting it short only samples sooner
  }
}

GpuDiscoveryOptions gpu_discovery_options_from_environment(bool test_hooks_enabled) {
  GpuDiscoveryOptions options;
  if (!test_hooks_enabled) return options;
  if (const char* root = std::getenv("GPUQ_TEST_GPU_ROOT"); root != nullptr && *root != '\0') {
    options.root = root;
    options.use_nvml = false;
  }
  if (const char* nvml = std::getenv("GPUQ_TEST_NVML_LIBRARY"); nvml != nullptr && *nvml != '\0') {
    options.nvml_library = nvml;
  }
  return options;
}

}  // namespace gpuq::daemon
