// gpuqd: the gpuq supervisor. Parses arguments, loads and validates the config, runs.
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "config.hpp"
#include "gpu_discovery.hpp"
#include "gpuq/common/log.hpp"
#include "gpuq/common/posix_call.hpp"
#include "gpuq/common/runtime_dir.hpp"
#include "memory_budget.hpp"
#include "plugins.hpp"
#include "python_pool.hpp"
#include "service_notifier.hpp"
#include "supervisor.hpp"
#include "test_hooks.hpp"
#include "worker_program.hpp"

// Where gpuq-worker is installed, relative to gpuqd's directory (daemon/CMakeLists.txt derives
// it from CMAKE_INSTALL_BINDIR and CMAKE_INSTALL_LIBEXECDIR).
#ifndef GPUQ_WORKER_RELATIVE_DIR
#define GPUQ_WORKER_RELATIVE_DIR "../libexec/gpuq"
#endif

namespace {

constexpr const char* kUsage =
    "usage: gpuqd [--config FILE] [--runtime-dir DIR] [--check-config]\n"
    "\n"
    "The gpuq supervisor: runs in the foreground, pre-spawns pinned workers and serves\n"
    "local clients through shared memory. Without --config it runs with built-in defaults\n"
    "(one CPU pool, one worker per available CPU).\n"
    "\n"
    "  --config FILE      JSON config (docs/config.md lists every key and its default)\n"
    "  --runtime-dir DIR  socket directory; default: $RUNTIME_DIRECTORY, else\n"
    "                     $XDG_RUNTIME_DIR/gpuq, else /tmp/gpuq-$UID\n"
    "  --check-config     validate the config, print the effective pools (importing each\n"
    "                     Python pool's modules, as the daemon would), and exit\n"
    "  --help, --version\n"
    "\n"
    "Signals: SIGTERM or SIGINT drain (finish queued and running jobs, then exit 0).\n"
    "Under systemd (Type=notify) it sends READY=1 once every pool is up, STATUS=,\n"
    "STOPPING=1 and, with WatchdogSec=, WATCHDOG=1 (docs/service.md).\n";

// This executable's path; empty without /proc.
std::string self_executable() {
  char self[PATH_MAX];
  auto n = GPUQ_POSIX_CALL(::readlink, "/proc/self/exe", self, sizeof self - 1);
  if (!n || *n == 0) return {};
  self[*n] = '\0';
  return self;
}

// A worker executable (gpuq-worker, gpuq-gpu-worker) next to this executable (the build tree),
// else where `cmake --install` puts it (../libexec/gpuq/ with the default GNUInstallDirs
// layout); empty if it is in neither place.
std::string find_worker(const std::string& name) {
  // Without /proc (readlink fails) there is no directory to look in: not found. Each access is
  // a probe: whatever its failure, that candidate is not used.
  std::string dir = self_executable();
  if (dir.empty()) return {};
  dir = dir.substr(0, dir.rfind('/'));
  for (const std::string& c : {dir + "/" + name, dir + "/" GPUQ_WORKER_RELATIVE_DIR "/" + name}) {
    if (GPUQ_POSIX_CALL(::access, c.c_str(), X_OK).ok()) return c;
  }
  return {};
}

// gpuq-worker and gpuq-gpu-worker as find_worker finds them, and where it looked.
gpuq::daemon::WorkerExecutables worker_executables() {
  gpuq::daemon::WorkerExecutables found;
  found.worker = find_worker("gpuq-worker");
  found.gpu_worker = find_worker("gpuq-gpu-worker");  // none in a build without CUDA
  std::string dir = self_executable();
  if (!dir.empty()) {
    dir = dir.substr(0, dir.rfind('/'));
    found.searched = "next to gpuqd in " + dir + " and in " + dir + "/" GPUQ_WORKER_RELATIVE_DIR;
  }
  return found;
}

// --check-config: the effective pools. A gpu pool's GPUs are looked for as the daemon would
// (test hooks included), so that the output says whether the pool would be available.
// " and 1 spare" (nothing without spares), for --check-config.
std::string spares_text(const gpuq::daemon::PoolConfig& p) {
  if (p.spare_workers == 0) return {};
  return " and " + std::to_string(p.spare_workers) + (p.spare_workers == 1 ? " spare" : " spares");
}

// --check-config: each Python pool's modules imported as the daemon would (its interpreter, its
// time limit, the GPU hidden), and its ops printed; a pool whose listing fails is an error naming
// the pool, the module, the exception and the end of what the interpreter printed. Returns
// whether every Python pool listed. After the plug-ins (their ops take the ids first).
bool check_python_pools(const gpuq::daemon::Config& config) {
  bool ok = true;
  for (uint32_t p = 0; p < config.pools.size(); ++p) {
    gpuq::daemon::PoolConfig pool = config.pools[p];
    if (!pool.python) continue;
    gpuq::daemon::PythonListingDetail detail;
    auto ops = gpuq::daemon::learn_python_pool(pool, p, &detail);
    if (ops) {
      std::string names;
      for (const auto& op : *ops) names += (names.empty() ? "" : ", ") + op.name;
      std::printf("pool %s: python %s: ops %s\n", pool.name.c_str(),
                  pool.python->interpreter.c_str(), names.c_str());
      continue;
    }
    ok = false;
    std::fprintf(stderr, "gpuqd: pool %s: python: %s\n", pool.name.c_str(),
                 ops.error().message().c_str());
    const std::string tail = gpuq::daemon::tail_lines(detail.stderr_text, 20, 4000);
    if (!tail.empty()) {
      std::fprintf(stderr, "  the end of what %s printed:\n", pool.python->interpreter.c_str());
      std::istringstream lines(tail);
      for (std::string line; std::getline(lines, line);) {
        std::fprintf(stderr, "  | %s\n", line.c_str());
      }
    }
  }
  return ok;
}

int check_config(const gpuq::daemon::Config& config) {
  using gpuq::daemon::PoolConfig;
  const bool want_gpus =
      std::any_of(config.pools.begin(), config.pools.end(),
                  [](const PoolConfig& p) { return p.kind == gpuq::PoolKind::kGpu; });
  gpuq::daemon::GpuDiscovery found;
  const gpuq::daemon::WorkerExecutables executables = worker_executables();
  bool cpu_backend = false;  // as the supervisor: fake GPUs run the CPU backend (worker_program)
  if (want_gpus) {
    auto hooks = gpuq::daemon::read_test_hooks();
    const gpuq::daemon::TestHooks h = hooks ? *hooks : gpuq::daemon::TestHooks{};
    const gpuq::daemon::GpuDiscoveryOptions how =
        gpuq::daemon::gpu_discovery_options_from_environment(h.enabled);
    cpu_backend = gpuq::daemon::gpu_pools_on_cpu_backend(how, h);
    found = gpuq::daemon::discover_gpus_isolated(how, 30'000);
    if (found.gpus.empty()) std::printf("GPUs: none (%s)\n", found.problem.c_str());
    for (const auto& g : found.gpus) {
      std::printf("GPU %u: %s %s %s (%s)\n", g.index, g.uuid.c_str(), g.pci_bus_id.c_str(),
                  g.name.c_str(), found.source.c_str());
    }
  }
  // Each gpu pool's GPUs as the supervisor chooses them, then their memory budgets on each.
  std::vector<gpuq::Result<std::vector<uint32_t>>> chosen;
  std::vector<std::vector<uint32_t>> pool_gpus(config.pools.size());
  for (size_t i = 0; i < config.pools.size(); ++i) {
    const PoolConfig& p = config.pools[i];
    chosen.push_back(std::vector<uint32_t>{});
    if (p.kind == gpuq::PoolKind::kCpu) continue;
    chosen[i] = gpuq::daemon::select_gpus(p, found);
    const auto program = gpuq::daemon::worker_program(p, executables, cpu_backend);
    if (chosen[i] && !program) chosen[i] = program.error();
    if (chosen[i]) pool_gpus[i] = *chosen[i];
  }
  auto budgets = gpuq::daemon::plan_memory_budgets(config.pools, pool_gpus, found.gpus);
  for (size_t i = 0; i < config.pools.size(); ++i) {
    const PoolConfig& p = config.pools[i];
    if (p.kind == gpuq::PoolKind::kCpu) {
      std::printf("pool %s: %u workers%s on %zu cpus, ring capacity %u\n", p.name.c_str(),
                  p.workers, spares_text(p).c_str(), p.cpus.size(),
                  gpuq::daemon::ring_capacity(config, p));
      continue;
    }
    std::string gpus = p.all_gpus ? "all" : "";
    for (const auto& g : p.gpus) {
      if (!gpus.empty()) gpus += ',';
      gpus += g.by_uuid ? g.uuid : std::to_string(g.index);
    }
    const std::string fallback =
        p.fallback_pool >= 0 ? "pool " + config.pools[p.fallback_pool].name : "none";
    const std::string limit =
        p.memory_limit_bytes > 0 || p.memory_limit_fraction > 0
            ? gpuq::daemon::MemoryShare{p.memory_limit_bytes, p.memory_limit_fraction}.text() +
                  " per GPU"
            : "not set (a share of 0.9 of each GPU)";
    std::printf("pool %s: gpu, gpus %s, %u workers per GPU, memory_limit %s, fallback %s: ",
                p.name.c_str(), gpus.c_str(), p.workers_per_gpu, limit.c_str(), fallback.c_str());
    if (!chosen[i]) {
      std::printf("unavailable: %s\n", chosen[i].error().message().c_str());
      continue;
    }
    PoolConfig sized = p;
    sized.workers = static_cast<uint32_t>(chosen[i]->size()) * p.workers_per_gpu;
    std::printf("%u workers%s on %zu GPUs, ring capacity %u\n", sized.workers,
                spares_text(p).c_str(), chosen[i]->size(),
                gpuq::daemon::ring_capacity(config, sized));
    if (p.max_workers_setting != 0 && sized.workers > p.max_workers) {  // as plan_pools refuses
      std::fprintf(stderr,
                   "gpuqd: config: pools[%s].max_workers: %u is fewer than its workers_per_gpu x "
                   "the GPUs found, %u\n",
                   p.name.c_str(), p.max_workers, sized.workers);
      return 2;
    }
    if (!budgets) continue;
    for (const auto& b : (*budgets)[i]) {
      const uint64_t device = found.gpus[b.gpu].memory_bytes;
      std::printf("  on GPU %u: budget %s%s, %u workers (spares included): %s each\n",
                  found.gpus[b.gpu].index, b.pool.text(device).c_str(),
                  b.by_default ? " (its share of the default 0.9)" : "", b.workers,
                  b.worker.text(device).c_str());
    }
  }
  if (!budgets) {
    std::fprintf(stderr, "gpuqd: %s\n", budgets.error().message().c_str());
    return 2;
  }
  // Plug-in ops, learnt as the daemon would (a child lists them; this process never loads one).
  for (const std::string& path : config.plugins) {
    auto ops = gpuq::daemon::list_plugin_ops_isolated(executables.worker, path, 30'000);
    if (ops) {
      for (const auto& op : *ops) {
        std::printf("plug-in %s: op %s (%s%s%s)\n", path.c_str(), op.name.c_str(),
                    op.has_cpu ? "cpu" : "", op.has_cpu && op.has_gpu ? ", " : "",
                    op.has_gpu ? "gpu" : "");
      }
    }
    auto added =
        ops ? gpuq::daemon::add_plugin_ops(std::move(*ops)) : gpuq::Result<void>(ops.error());
    if (!added) {
      std::fprintf(stderr, "gpuqd: %s\n", added.error().message().c_str());
      return 2;
    }
  }
  if (!check_python_pools(config)) return 2;
  std::printf("config OK\n");
  return 0;
}

// gpuqd --sample-gpus MS [LIBRARY]: the GPU sampler child (gpu_sampler.hpp), started by gpuqd
// itself; LIBRARY: NVML's (a stand-in under the test hooks).
int sample_gpus(const char* interval, const char* library) {
  gpuq::log_init("gpuqd-gpu-sampler", gpuq::LogLevel::kInfo);
  char* end = nullptr;
  const unsigned long ms = std::strtoul(interval, &end, 10);
  if (end == interval || *end != '\0' || ms < 100 || ms > 60'000) {
    std::fprintf(stderr, "gpuqd: --sample-gpus wants milliseconds from 100 to 60000\n");
    return 2;
  }
  return gpuq::daemon::run_gpu_sampler(library, static_cast<uint32_t>(ms), 1);
}

}  // namespace

int main(int argc, char** argv) {
  if ((argc == 3 || argc == 4) && std::string_view(argv[1]) == "--sample-gpus") {
    return sample_gpus(argv[2], argc == 4 ? argv[3] : gpuq::daemon::kNvmlLibrary);
  }
  std::string config_path, runtime_dir;
  bool check_only = false;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (a == "--version") {
      std::printf("gpuqd %s\n", GPUQ_VERSION);
      return 0;
    } else if (a == "--check-config") {
      check_only = true;
    } else if ((a == "--config" || a == "--runtime-dir") && i + 1 < argc) {
      (a == "--config" ? config_path : runtime_dir) = argv[++i];
    } else {
      std::fprintf(stderr, "gpuqd: unknown or incomplete argument '%s'\n\n%s", argv[i], kUsage);
      return 2;
    }
  }
  auto config = gpuq::daemon::load_config(config_path, gpuq::daemon::allowed_cpus());
  if (!config) {
    std::fprintf(stderr, "gpuqd: %s\n", config.error().message().c_str());
    return 2;
  }
  if (check_only) return check_config(*config);
  auto hooks = gpuq::daemon::read_test_hooks();
  if (!hooks) {
    std::fprintf(stderr, "gpuqd: %s\n", hooks.error().message().c_str());
    return 2;
  }
  gpuq::log_init("gpuqd", config->log_level);
  std::shared_ptr<gpuq::daemon::ServiceNotifier> notifier = gpuq::daemon::make_systemd_notifier();
  gpuq::daemon::WorkerExecutables executables = worker_executables();
  if (executables.worker.empty()) {
    // Its workers will fail to start, with the reason in the log and the status.
    GPUQ_LOG_ERROR("cannot find gpuq-worker next to gpuqd or in %s", GPUQ_WORKER_RELATIVE_DIR);
    executables.worker = "gpuq-worker";
  }
  gpuq::daemon::SupervisorOptions options;
  options.file_config = *config;
  options.config = std::move(*config);
  options.config_path = config_path;
  options.runtime_dir = gpuq::resolve_daemon_runtime_dir(runtime_dir);
  options.executables = std::move(executables);
  options.notifier = notifier;
  // Through /proc, so that the GPU sampler runs this very binary even once a package upgrade
  // has replaced (or removed) the file it was started from.
  if (!self_executable().empty()) options.self_path = "/proc/self/exe";
  options.test_hooks = std::move(*hooks);
  gpuq::daemon::Supervisor supervisor(std::move(options));
  if (auto r = supervisor.start(); !r) {
    GPUQ_LOG_ERROR("cannot start: %s", r.error().to_string().c_str());
    notifier->status("cannot start: " + r.error().to_string());
    return 1;
  }
  return supervisor.run();
}
