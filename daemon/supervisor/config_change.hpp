// ConfigChange: what a config reload changes (docs/design/live_changes.md, "Config reload"),
// decided whole before anything is touched. diff_configs() compares the config gpuqd runs on
// (as its file said, before the supervisor resolved anything) with the file as it is now, both
// parsed and checked by the same code as at start and `gpuqd --check-config` (load_config), and
// sorts every difference:
//   - daemon keys that take effect at once (log_level, time limits, back-offs, who may connect);
//   - pools added (each in a free pool record of max_pools with at most added_pool_workers
//     entries), pools removed (they drain), pools whose changes take effect by a rolling restart
//     (a Python pool's modules and environment, worker_spin_us, a cpu pool's cpus), a gpu pool's
//     gpus and memory_limit (ConfigReload plans every gpu pool again and decides what rolls), and
//     pool keys that take effect at once (job_time_limit_ms);
//   - what cannot change while gpuqd runs: the queue layout every client copied once (ring
//     sizes, worker and pool records) and the files and ids fixed at start. Any of these makes
//     the reload fail whole, naming each key, and nothing changes.
// Pure: no state, no I/O. The Supervisor applies the result.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "config.hpp"

namespace gpuq::daemon {

struct PoolChange {
  std::string name;
  uint32_t pool = 0;              // its index in the running config
  std::vector<std::string> keys;  // the keys that changed ("python.modules", "job_time_limit_ms")
  bool rollout = false;           // a rolling restart makes them take effect
  uint32_t workers = 0;           // a cpu pool's new `workers` (within max_workers); 0: same
};

struct ConfigChange {
  // Keys that cannot change while gpuqd runs, as the file names them ("queue_factor",
  // "pools[classify].workers"), each with why; the reload fails whole when there is one.
  std::vector<std::string> fixed;
  std::vector<std::string> daemon_keys;  // daemon keys that take effect at once
  std::vector<PoolChange> pools;         // running pools that changed
  std::vector<uint32_t> removed;         // running pools the file no longer has (they drain)
  std::vector<uint32_t> added;           // pools new to the file (their index in it), in its order
  bool empty() const {
    return fixed.empty() && daemon_keys.empty() && pools.empty() && removed.empty() &&
           added.empty();
  }
  // One line per change, for the reply, the log and `gpuqctl reload`.
  std::vector<std::string> describe(const Config& running, const Config& next) const;
};

// A daemon key that takes effect at once when a reload changes it: its name in the file, whether
// two configs agree on it, and how the running config takes the new value. The one list of them
// (diff_configs compares with it, ConfigReload copies with it). The components read the running
// Config; those that keep a copy are told apart (the log level, PoolOutage).
struct LiveKey {
  const char* name;
  std::function<bool(const Config&, const Config&)> same;
  std::function<void(Config& to, const Config& from)> take;
};
const std::vector<LiveKey>& live_daemon_keys();

// What reloading `next` over `running` changes. `running`: the config as the file said when
// gpuqd started or last reloaded (pools it removed since are marked `removed` and stay out of
// the comparison).
ConfigChange diff_configs(const Config& running, const Config& next);

}  // namespace gpuq::daemon
