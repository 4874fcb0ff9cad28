#include "config.hpp"

#include <grp.h>
#include <pwd.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "gpuq/common/posix_call.hpp"

namespace gpuq::daemon {
namespace {

using nlohmann::json;

Error bad(const std::string& path, const std::string& what) {
  return Error(ErrorCode::kInvalidArgument, "config: " + path + ": " + what);
}

// Each reader checks one value and stores it; the table below maps keys to readers.
Result<uint64_t> read_uint(const json& v, const std::string& path, uint64_t min, uint64_t max) {
  if (!v.is_number_integer() && !v.is_number_unsigned()) {
    return bad(path, "must be an integer, got " + v.dump());
  }
  if (v.is_number_integer() && v.get<int64_t>() < 0) {
    return bad(path, "must be in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " +
                         v.dump());
  }
  uint64_t x = v.get<uint64_t>();
  if (x < min || x > max) {
    return bad(path, "must be in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " +
                         std::to_string(x));
  }
  return x;
}

Result<int> parse_cpu_number(std::string_view s, const std::string& path) {
  int v = -1;
  auto r = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || r.ec != std::errc() || r.ptr != s.data() + s.size() || v < 0) {
    return bad(path, std::string("'").append(s) + "' is not a CPU number");
  }
  return v;
}

// "0-3,6" or [0, 1, 2]. Every CPU must be one the daemon may run on.
Result<std::vector<int>> read_cpus(const json& v, const std::string& path,
                                   const std::vector<int>& available) {
  std::vector<int> cpus;
  if (v.is_string()) {
    std::string s = v.get<std::string>();
    std::stringstream ss(s);
    std::string part;
    while (std::getline(ss, part, ',')) {
      size_t dash = part.find('-');
      if (dash == std::string::npos) {
        auto c = parse_cpu_number(part, path);
        if (!c) return c.error();
        cpus.push_back(*c);
      } else {
        auto a = parse_cpu_number(std::string_view(part).substr(0, dash), path);
        if (!a) return a.error();
        auto b = parse_cpu_number(std::string_view(part).substr(dash + 1), path);
        if (!b) return b.error();
        if (*b < *a) return bad(path, "range '" + part + "' runs backwards");
        for (int c = *a; c <= *b; ++c) cpus.push_back(c);
      }
    }
  } else if (v.is_array()) {
    for (size_t i = 0; i < v.size(); ++i) {
      std::string p = path + "[" + std::to_string(i) + "]";
      auto c = read_uint(v[i], p, 0, 4095);
      if (!c) return c.error();
      cpus.push_back(static_cast<int>(*c));
    }
  } else {
    return bad(path, "must be a list of CPU numbers or a string like \"0-3,6\"");
  }
  if (cpus.empty()) return bad(path, "must name at least one CPU");
  std::set<int> seen;
  for (int c : cpus) {
    if (!seen.insert(c).second) return bad(path, "CPU " + std::to_string(c) + " is listed twice");
    if (std::find(available.begin(), available.end(), c) == available.end()) {
      return bad(path, "CPU " + std::to_string(c) + " is not available to the daemon (available: " +
                           std::to_string(available.size()) + " CPUs)");
    }
  }
  return cpus;
}

// Looks `name` up with getpwnam_r or getgrnam_r (`lookup`), growing the buffer while the entry
// does not fit (ERANGE; a group with many members can pass 16 KiB). Finds null in *found when
// there is no such entry: 0 with no result, or one of the numbers the man page lists for "not
// found" (ENOENT, ESRCH, EBADF, EPERM, as some NSS modules report it). Other failures (EIO,
// EMFILE, ENOMEM) are errors naming the lookup.
template <typename Entry, typename Lookup>
Result<void> lookup_entry(Lookup lookup, const char* call, const std::string& name, Entry* entry,
                          std::vector<char>& buf, Entry** found) {
  constexpr size_t kMaxBuffer = size_t{1} << 24;
  for (buf.resize(16384);; buf.resize(buf.size() * 2)) {
    *found = nullptr;
    // Returns the error number (errno is not set): the GPUQ_ERRNUM_CALL convention.
    Result<void> r = detail::errnum_call(call, __FILE__, __LINE__, lookup, name.c_str(), entry,
                                         buf.data(), buf.size(), found);
    if (r) return {};
    if (errno == ERANGE && buf.size() < kMaxBuffer) continue;
    if (errno == ENOENT || errno == ESRCH || errno == EBADF || errno == EPERM) {
      *found = nullptr;
      return {};
    }
    return r;
  }
}

Result<uid_t> resolve_user(const json& v, const std::string& path) {
  if (v.is_number_unsigned() || v.is_number_integer()) {
    auto u = read_uint(v, path, 0, 0xFFFFFFFEu);
    if (!u) return u.error();
    return static_cast<uid_t>(*u);
  }
  if (!v.is_string()) return bad(path, "must be a user name or a numeric uid");
  std::string name = v.get<std::string>();
  passwd pw{}, *res = nullptr;
  std::vector<char> buf;
  if (auto r = lookup_entry(getpwnam_r, "getpwnam_r", name, &pw, buf, &res); !r) {
    return bad(path, "cannot look up user '" + name + "': " + r.error().message());
  }
  if (res == nullptr) return bad(path, "no user named '" + name + "'");
  return pw.pw_uid;
}

Result<gid_t> resolve_group(const json& v, const std::string& path) {
  if (v.is_number_unsigned() || v.is_number_integer()) {
    auto g = read_uint(v, path, 0, 0xFFFFFFFEu);
    if (!g) return g.error();
    return static_cast<gid_t>(*g);
  }
  if (!v.is_string()) return bad(path, "must be a group name or a numeric gid");
  std::string name = v.get<std::string>();
  group gr{}, *res = nullptr;
  std::vector<char> buf;
  if (auto r = lookup_entry(getgrnam_r, "getgrnam_r", name, &gr, buf, &res); !r) {
    return bad(path, "cannot look up group '" + name + "': " + r.error().message());
  }
  if (res == nullptr) return bad(path, "no group named '" + name + "'");
  return gr.gr_gid;
}

bool valid_pool_name(const std::string& n) {
  if (n.empty() || n.size() >= kPoolNameBytes) return false;
  return std::all_of(n.begin(), n.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
}

// The most workers one GPU may have: each holds a CUDA context (hundreds of MB) on it.
constexpr uint64_t kMaxWorkersPerGpu = 64;
// The most spare workers a pool may have.
constexpr uint64_t kMaxSpareWorkers = 64;
// The most surge seats a pool may have (one per GPU is what a gpu pool's rollouts need).
constexpr uint64_t kMaxSurgeWorkers = 64;
// GPU indexes are positions in PCI bus order; no machine has more GPUs than this.
constexpr uint64_t kMaxGpuIndex = 255;

// "GPU-" and a UUID in its canonical 8-4-4-4-12 hex form, as nvidia-smi -L prints it.
bool valid_gpu_uuid(const std::string& s) {
  if (s.size() != 40 || s.rfind("GPU-", 0) != 0) return false;
  for (size_t i = 4; i < s.size(); ++i) {
    const size_t at = i - 4;
    const bool dash = at == 8 || at == 13 || at == 18 || at == 23;
    const char c = s[i];
    if (dash != (c == '-')) return false;
    if (!dash && !std::isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// "all", or a list of GPU indexes (PCI bus order) and UUIDs.
Result<void> read_gpus(const json& v, const std::string& path, PoolConfig& p) {
  if (v.is_string() && v.get<std::string>() == "all") {
    p.all_gpus = true;
    p.gpus.clear();
    return {};
  }
  if (!v.is_array() || v.empty()) {
    return bad(path,
               "must be \"all\" or a non-empty list of GPU indexes and UUIDs, got " + v.dump());
  }
  std::vector<GpuSelector> gpus;
  std::set<uint64_t> indexes;
  std::set<std::string> uuids;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string ip = path + "[" + std::to_string(i) + "]";
    GpuSelector g;
    if (v[i].is_string()) {
      g.by_uuid = true;
      g.uuid = v[i].get<std::string>();
      if (!valid_gpu_uuid(g.uuid)) {
        return bad(ip, "must be a GPU index or a UUID like \"GPU-" +
                           std::string("0b7e1c3a-5d2f-4a61-9c8e-2f4b6d8a0c1e") + "\", got " +
                           v[i].dump());
      }
      if (!uuids.insert(g.uuid).second) return bad(ip, "GPU " + g.uuid + " is listed twice");
    } else {
      auto x = read_uint(v[i], ip, 0, kMaxGpuIndex);
      if (!x) return x.error();
      g.index = static_cast<uint32_t>(*x);
      if (!indexes.insert(*x).second) {
        return bad(ip, "GPU " + std::to_string(*x) + " is listed twice");
      }
    }
    gpus.push_back(std::move(g));
  }
  p.all_gpus = false;
  p.gpus = std::move(gpus);
  return {};
}

bool valid_module_name(const std::string& m) {
  if (m.empty() || m.size() > 200 || m.front() == '.' || m.back() == '.' ||
      m.find("..") != std::string::npos) {
    return false;
  }
  return std::all_of(m.begin(), m.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' || c == '.';
  });
}

bool valid_env_name(const std::string& n) {
  if (n.empty() || std::isdigit(static_cast<unsigned char>(n[0])) != 0) return false;
  return std::all_of(n.begin(), n.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_';
  });
}

Result<std::vector<std::string>> read_strings(
    const json& v, const std::string& path,
    const std::function<const char*(const std::string&)>& check) {
  if (!v.is_array()) return bad(path, "must be a list of strings, got " + v.dump());
  std::vector<std::string> out;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string ip = path + "[" + std::to_string(i) + "]";
    if (!v[i].is_string()) return bad(ip, "must be a string, got " + v[i].dump());
    std::string s = v[i].get<std::string>();
    if (const char* why = check(s); why != nullptr) return bad(ip, "'" + s + "' " + why);
    out.push_back(std::move(s));
  }
  return out;
}

// A pool's "python" section.
Result<PythonPoolConfig> read_python(const json& v, const std::string& path) {
  if (!v.is_object()) return bad(path, "must be an object");
  PythonPoolConfig py;
  bool have_interpreter = false, have_venv = false, have_modules = false;
  for (auto it = v.begin(); it != v.end(); ++it) {
    const std::string& key = it.key();
    const std::string kp = path + "." + key;
    const json& val = it.value();
    if (key == "interpreter" || key == "venv") {
      if (!val.is_string() || val.get<std::string>().empty() ||
          val.get<std::string>().find('\0') != std::string::npos) {
        return bad(kp, "must be a non-empty string, got " + val.dump());
      }
      const std::string s = val.get<std::string>();
      if (key == "venv") {
        if (s.front() != '/') return bad(kp, "must be an absolute path, got " + val.dump());
        py.interpreter = s + (s.back() == '/' ? "" : "/") + "bin/python";
        have_venv = true;
      } else {
        if (s.find('/') != std::string::npos && s.front() != '/') {
          return bad(kp, "must be an absolute path or a name looked up in PATH, got " + val.dump());
        }
        py.interpreter = s;
        have_interpreter = true;
      }
    } else if (key == "modules") {
      auto m = read_strings(val, kp, [](const std::string& s) -> const char* {
        return valid_module_name(s) ? nullptr : "is not a module name (like \"pkg.models\")";
      });
      if (!m) return m.error();
      if (m->empty()) return bad(kp, "must name at least one module");
      py.modules = std::move(*m);
      have_modules = true;
    } else if (key == "path") {
      auto p = read_strings(val, kp, [](const std::string& s) -> const char* {
        return !s.empty() && s.front() == '/' ? nullptr : "is not an absolute path";
      });
      if (!p) return p.error();
      py.path = std::move(*p);
    } else if (key == "env") {
      if (!val.is_object()) return bad(kp, "must be an object of strings, got " + val.dump());
      for (auto e = val.begin(); e != val.end(); ++e) {
        const std::string ep = kp + "." + e.key();
        if (!valid_env_name(e.key()))
          return bad(ep, "is not a variable name ([A-Za-z_][A-Za-z0-9_]*)");
        if (e.key() == "CUDA_VISIBLE_DEVICES" || e.key() == "CUDA_DEVICE_ORDER" ||
            e.key() == "GPUQ_WORKER_ID") {
          return bad(ep, "is set by gpuqd for each worker (the pool's GPUs decide it)");
        }
        if (!e.value().is_string()) return bad(ep, "must be a string, got " + e.value().dump());
        py.env.emplace_back(e.key(), e.value().get<std::string>());
      }
    } else if (key == "allow_callables") {
      if (!val.is_boolean()) return bad(kp, "must be true or false, got " + val.dump());
      py.allow_callables = val.get<bool>();
    } else {
      return bad(kp, "unknown key (known: interpreter, venv, modules, path, env, allow_callables)");
    }
  }
  if (have_interpreter && have_venv) {
    return bad(path, "give \"interpreter\" or \"venv\", not both");
  }
  if (!have_modules && !py.allow_callables) {
    return bad(path + ".modules",
               "is required (the modules whose @gpuq.op functions the pool runs), unless "
               "allow_callables is true");
  }
  return py;
}

Result<PoolConfig> read_pool(const json& v, const std::string& path,
                             const std::vector<int>& available) {
  if (!v.is_object()) return bad(path, "must be an object");
  PoolConfig p;
  // The kind first: it decides which other keys the pool may have (and a JSON object's keys
  // come in no useful order).
  if (auto k = v.find("kind"); k != v.end()) {
    if (*k == "cpu") {
      p.kind = PoolKind::kCpu;
    } else if (*k == "gpu") {
      p.kind = PoolKind::kGpu;
    } else {
      return bad(path + ".kind", "must be \"cpu\" or \"gpu\", got " + k->dump());
    }
  }
  const bool gpu = p.kind == PoolKind::kGpu;
  bool have_workers = false;
  p.rollout_surge_workers = gpu ? 0 : 1;
  for (auto it = v.begin(); it != v.end(); ++it) {
    const std::string& key = it.key();
    const std::string kp = path + "." + key;
    const json& val = it.value();
    if (key == "kind") continue;
    if (key == "name") {
      if (!val.is_string() || !valid_pool_name(val.get<std::string>())) {
        return bad(kp, "must be 1-31 characters of [a-z0-9_-]");
      }
      p.name = val.get<std::string>();
    } else if (key == "workers" && !gpu) {
      auto w = read_uint(val, kp, 1, kMaxWorkers);
      if (!w) return w.error();
      p.workers = static_cast<uint32_t>(*w);
      have_workers = true;
    } else if (key == "max_workers") {
      auto w = read_uint(val, kp, 1, kMaxWorkers);
      if (!w) return w.error();
      p.max_workers = p.max_workers_setting = static_cast<uint32_t>(*w);
    } else if (key == "spare_workers") {
      auto w = read_uint(val, kp, 0, kMaxSpareWorkers);
      if (!w) return w.error();
      p.spare_workers = static_cast<uint32_t>(*w);
    } else if (key == "rollout_surge_workers") {
      auto w = read_uint(val, kp, 0, kMaxSurgeWorkers);
      if (!w) return w.error();
      p.rollout_surge_workers = static_cast<uint32_t>(*w);
    } else if (key == "cpus" && !gpu) {
      auto c = read_cpus(val, kp, available);
      if (!c) return c.error();
      p.cpus = std::move(*c);
    } else if (key == "gpus" && gpu) {
      if (auto r = read_gpus(val, kp, p); !r) return r.error();
    } else if (key == "workers_per_gpu" && gpu) {
      auto w = read_uint(val, kp, 1, kMaxWorkersPerGpu);
      if (!w) return w.error();
      p.workers_per_gpu = static_cast<uint32_t>(*w);
    } else if (key == "fallback" && gpu) {
      if (val == "none") {
        p.fallback = PoolFallback::kNone;
      } else if (val == "cpu") {
        p.fallback = PoolFallback::kCpu;
      } else {
        return bad(kp, "must be \"none\" or \"cpu\", got " + val.dump());
      }
    } else if (key == "memory_limit" && gpu) {
      // An integer is bytes; any other number (1.0 included) a fraction of the device.
      if (val.is_number_integer() || val.is_number_unsigned()) {
        auto b = read_uint(val, kp, uint64_t{1} << 20, uint64_t{1} << 50);
        if (!b) return b.error();
        p.memory_limit_bytes = *b;
        p.memory_limit_fraction = 0;
      } else if (val.is_number_float() && val.get<double>() > 0 && val.get<double>() <= 1) {
        p.memory_limit_fraction = val.get<double>();
        p.memory_limit_bytes = 0;
      } else {
        return bad(kp,
                   "must be bytes (an integer of at least 1048576) or a fraction of the "
                   "device's memory (a number in (0, 1]), got " +
                       val.dump());
      }
    } else if (key == "job_time_limit_ms") {
      auto ms = read_uint(val, kp, 0, UINT32_MAX);
      if (!ms) return ms.error();
      p.job_time_limit_ms = static_cast<uint32_t>(*ms);
    } else if (key == "worker_spin_us") {
      auto us = read_uint(val, kp, 0, 100000);
      if (!us) return us.error();
      p.worker_spin_us = static_cast<uint32_t>(*us);
    } else if (key == "python") {
      auto py = read_python(val, kp);
      if (!py) return py.error();
      p.python = std::move(*py);
    } else if (gpu && (key == "workers" || key == "cpus")) {
      return bad(kp, key != "cpus"
                         ? "is not a gpu pool key: a gpu pool has workers_per_gpu workers on "
                           "each of its GPUs"
                         : "is not a gpu pool key: a gpu pool's workers run on the CPUs local to "
                           "their GPU");
    } else if (!gpu && (key == "gpus" || key == "workers_per_gpu" || key == "fallback" ||
                        key == "memory_limit")) {
      return bad(kp, "is a key of \"kind\": \"gpu\" pools only");
    } else {
      return bad(kp, gpu ? "unknown key (known for a gpu pool: name, kind, gpus, "
                           "workers_per_gpu, max_workers, spare_workers, rollout_surge_workers, "
                           "fallback, memory_limit, job_time_limit_ms, worker_spin_us, python)"
                         : "unknown key (known: name, kind, workers, max_workers, spare_workers, "
                           "rollout_surge_workers, cpus, job_time_limit_ms, worker_spin_us, "
                           "python; gpus, workers_per_gpu, "
                           "fallback and "
                           "memory_limit with \"kind\": "
                           "\"gpu\")");
    }
  }
  if (p.name.empty()) return bad(path + ".name", "is required");
  if (gpu) {
    // Known now only for a list of GPUs; with "all", once the supervisor has found them
    // (plan_pools checks max_workers then, and sets it when not said).
    p.workers = p.all_gpus ? 0 : static_cast<uint32_t>(p.gpus.size()) * p.workers_per_gpu;
    if (p.workers != 0 && p.max_workers != 0 && p.max_workers < p.workers) {
      return bad(path + ".max_workers", std::to_string(p.max_workers) +
                                            " is fewer than its workers_per_gpu x its GPUs, " +
                                            std::to_string(p.workers));
    }
    if (p.max_workers == 0) p.max_workers = p.workers;
    return p;
  }
  if (p.cpus.empty()) p.cpus = available;
  if (!have_workers) p.workers = static_cast<uint32_t>(p.cpus.size());
  if (p.max_workers != 0 && p.max_workers < p.workers) {
    return bad(path + ".max_workers", std::to_string(p.max_workers) + " is fewer than its " +
                                          std::to_string(p.workers) + " workers");
  }
  if (p.max_workers == 0) p.max_workers = p.workers;
  return p;
}

struct Key {
  const char* name;
  std::function<Result<void>(Config&, const json&, const std::string&)> read;
};

template <typename T>
Key uint_key(const char* name, T Config::*field, uint64_t min, uint64_t max) {
  return {name, [field, min, max](Config& c, const json& v, const std::string& p) -> Result<void> {
            auto x = read_uint(v, p, min, max);
            if (!x) return x.error();
            c.*field = static_cast<T>(*x);
            return {};
          }};
}

// Every config key, one row each (redis's config table habit).
const std::vector<Key>& key_table() {
  static const std::vector<Key> kKeys = {
      uint_key("queue_factor", &Config::queue_factor, 1, 1024),
      {"max_clients",
       [](Config& c, const json& v, const std::string& p) -> Result<void> {
         // "auto": the default, already set from the CPUs (parse_config).
         if (v.is_string() && v.get<std::string>() == "auto") return {};
         if (!v.is_number_integer()) {
           return bad(p, "must be \"auto\" or an integer in [1, " +
                             std::to_string(kMaxClients - 1) + "], got " + v.dump());
         }
         auto x = read_uint(v, p, 1, kMaxClients - 1);
         if (!x) return x.error();
         c.max_clients = static_cast<uint32_t>(*x);
         return {};
       }},
      uint_key("max_jobs_per_client", &Config::max_jobs_per_client, 1, kMaxSlotsPerClient),
      {"client_queue_share",
       [](Config& c, const json& v, const std::string& p) -> Result<void> {
         if (!v.is_number() || v.get<double>() <= 0.0 || v.get<double>() > 1.0) {
           return bad(p, "must be a number in (0, 1], got " + v.dump());
         }
         c.client_queue_share = v.get<double>();
         return {};
       }},
      uint_key("client_segment_bytes", &Config::client_segment_bytes, 4096, 1ull << 40),
      uint_key("max_client_segment_bytes", &Config::max_client_segment_bytes, 4096, 1ull << 40),
      uint_key("drain_timeout_ms", &Config::drain_timeout_ms, 0, 3600000),
      uint_key("cancel_grace_ms", &Config::cancel_grace_ms, 0, 600000),
      uint_key("stream_reader_timeout_ms", &Config::stream_reader_timeout_ms, 0, 86400000),
      uint_key("worker_spin_us", &Config::worker_spin_us, 0, 100000),
      {"job_clock",
       [](Config& c, const json& v, const std::string& p) -> Result<void> {
         if (v.is_string() && v.get<std::string>() == "auto") {
           c.job_clock.reset();
           return {};
         }
         auto clock = v.is_string() ? parse_stamp_clock(v.get<std::string>())
                                    : Result<StampClock>(Error(ErrorCode::kInvalidArgument, ""));
         if (!clock) return bad(p, "must be \"auto\", \"tsc\" or \"monotonic\", got " + v.dump());
         c.job_clock = *clock;
         return {};
       }},
      uint_key("restart_backoff_initial_ms", &Config::restart_backoff_initial_ms, 1, 600000),
      uint_key("restart_backoff_max_ms", &Config::restart_backoff_max_ms, 1, 3600000),
      uint_key("max_start_failures", &Config::max_start_failures, 1, 1000),
      uint_key("start_backoff_initial_ms", &Config::start_backoff_initial_ms, 1, 3600000),
      uint_key("start_backoff_max_ms", &Config::start_backoff_max_ms, 1, 86400000),
      uint_key("start_timeout_ms", &Config::start_timeout_ms, 0, 86400000),
      uint_key("pool_down_fail_ms", &Config::pool_down_fail_ms, 0, 86400000),
      {"max_pools",
       [](Config& c, const json& v, const std::string& p) -> Result<void> {
         if (v.is_string() && v.get<std::string>() == "auto") return {};  // resolved later
         auto x = read_uint(v, p, 1, kMaxPools);
         if (!x) return x.error();
         c.max_pools = c.max_pools_setting = static_cast<uint32_t>(*x);
         return {};
       }},
      {"added_pool_workers",
       [](Config& c, const json& v, const std::string& p) -> Result<void> {
         if (v.is_string() && v.get<std::string>() == "auto") return {};  // resolved later
         auto x = read_uint(v, p, 1, kMaxWorkers);
         if (!x) return x.error();
         c.added_pool_workers = c.added_pool_workers_setting = static_cast<uint32_t>(*x);
         return {};
       }},
      {"allowed_users",
       [](Config& c, const json& v, const std::string& p) -> Result<void> {
         if (!v.is_array()) return bad(p, "must be a list of user names or uids");
         for (size_t i = 0; i < v.size(); ++i) {
           auto u = resolve_user(v[i], p + "[" + std::to_string(i) + "]");
           if (!u) return u.error();
           c.allowed_uids.push_back(*u);
         }
         return {};
       }},
      {"allowed_groups",
       [](Config& c, const json& v, const std::string& p) -> Result<void> {
         if (!v.is_array()) return bad(p, "must be a list of group names or gids");
         for (size_t i = 0; i < v.size(); ++i) {
           auto g = resolve_group(v[i], p + "[" + std::to_string(i) + "]");
           if (!g) return g.error();
           c.allowed_gids.push_back(*g);
         }
         return {};
       }},
      {"client_weights",
       [](Config& c, const json& v, const std::string& p) -> Result<void> {
         if (!v.is_array()) {
           return bad(p,
                      "must be a list of {\"user\": NAME or uid, \"weight\": N} and "
                      "{\"group\": NAME or gid, \"weight\": N}");
         }
         for (size_t i = 0; i < v.size(); ++i) {
           const std::string at = p + "[" + std::to_string(i) + "]";
           const json& e = v[i];
           if (!e.is_object()) return bad(at, "must be an object with \"user\" or \"group\"");
           for (const auto& [key, value] : e.items()) {
             if (key != "user" && key != "group" && key != "weight") {
               return bad(at + "." + key, "is not a key of a client weight (user, group, weight)");
             }
           }
           if (e.contains("user") == e.contains("group")) {
             return bad(at, "must name one \"user\" or one \"group\"");
           }
           if (!e.contains("weight")) return bad(at + ".weight", "is missing (1 to 16)");
           Config::ClientWeight w;
           w.group = e.contains("group");
           if (w.group) {
             auto g = resolve_group(e["group"], at + ".group");
             if (!g) return g.error();
             w.id = *g;
           } else {
             auto u = resolve_user(e["user"], at + ".user");
             if (!u) return u.error();
             w.id = *u;
           }
           auto n = read_uint(e["weight"], at + ".weight", 1, PoolQueue::kMaxWeight);
           if (!n) return n.error();
           w.weight = static_cast<uint32_t>(*n);
           c.client_weights.push_back(w);
         }
         return {};
       }},
      {"group",
       [](Config& c, const json& v, const std::string& p) -> Result<void> {
         auto g = resolve_group(v, p);
         if (!g) return g.error();
         c.group = *g;
         c.group_set = true;
         return {};
       }},
      {"plugins",
       [](Config& c, const json& v, const std::string& p) -> Result<void> {
         if (!v.is_array()) return bad(p, "must be a list of absolute paths to shared libraries");
         for (size_t i = 0; i < v.size(); ++i) {
           const std::string at = p + "[" + std::to_string(i) + "]";
           if (!v[i].is_string() || v[i].get<std::string>().empty() ||
               v[i].get<std::string>().front() != '/') {
             return bad(at, "must be an absolute path, got " + v[i].dump());
           }
           const std::string path = v[i].get<std::string>();
           // The message keeps the form "<path>: <strerror>" (errno is still access's).
           if (!GPUQ_POSIX_CALL(::access, path.c_str(), R_OK)) {
             return bad(at, path + ": " + std::strerror(errno));
           }
           if (std::find(c.plugins.begin(), c.plugins.end(), path) != c.plugins.end()) {
             return bad(at, path + " is listed twice");
           }
           c.plugins.push_back(path);
         }
         return {};
       }},
      {"log_level",
       [](Config& c, const json& v, const std::string& p) -> Result<void> {
         static const std::map<std::string, LogLevel> kLevels = {{"debug", LogLevel::kDebug},
                                                                 {"info", LogLevel::kInfo},
                                                                 {"warning", LogLevel::kWarn},
                                                                 {"error", LogLevel::kError}};
         auto it = v.is_string() ? kLevels.find(v.get<std::string>()) : kLevels.end();
         if (it == kLevels.end()) return bad(p, "must be one of debug, info, warning, error");
         c.log_level = it->second;
         return {};
       }},
      {"job_metrics",
       [](Config& c, const json& v, const std::string& p) -> Result<void> {
         if (!v.is_boolean()) return bad(p, "must be true or false, got " + v.dump());
         c.job_metrics = v.get<bool>();
         return {};
       }},
      {"metrics_listen",
       [](Config& c, const json& v, const std::string& p) -> Result<void> {
         if (v.is_null()) {
           c.metrics_listen.reset();
           return {};
         }
         if (!v.is_string()) {
           return bad(p, "must be an address and port such as \"127.0.0.1:9464\", or null");
         }
         auto at = parse_listen_address(v.get<std::string>());
         if (!at) return bad(p, at.error().message());
         c.metrics_listen = *at;
         return {};
       }},
  };
  return kKeys;
}

}  // namespace

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  // Should the affinity be unreadable, every online CPU counts as allowed.
  if (GPUQ_POSIX_CALL(::sched_getaffinity, 0, sizeof set, &set).ok()) {
    for (int i = 0; i < CPU_SETSIZE; ++i) {
      if (CPU_ISSET(i, &set)) cpus.push_back(i);
    }
  }
  if (cpus.empty()) {
    // -1 (failure, or no answer) counts as one CPU.
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    for (long i = 0; i < (n > 0 ? n : 1); ++i) cpus.push_back(static_cast<int>(i));
  }
  return cpus;
}

Result<Config> parse_config(const std::string& json_text, const std::vector<int>& available_cpus) {
  json doc;
  try {
    doc = json::parse(json_text);
  } catch (const json::parse_error& e) {
    return Error(ErrorCode::kInvalidArgument, std::string("config: not valid JSON: ") + e.what());
  }
  if (!doc.is_object()) return bad("(top level)", "must be a JSON object");
  Config c;
  c.max_clients = default_max_clients(available_cpus.size());
  bool have_pools = false;
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    const std::string& key = it.key();
    if (key == "pools") {
      if (!it.value().is_array() || it.value().empty()) {
        return bad("pools", "must be a non-empty list of pool objects");
      }
      if (it.value().size() > kMaxPools) {
        return bad("pools", "at most " + std::to_string(kMaxPools) + " pools");
      }
      for (size_t i = 0; i < it.value().size(); ++i) {
        auto p = read_pool(it.value()[i], "pools[" + std::to_string(i) + "]", available_cpus);
        if (!p) return p.error();
        c.pools.push_back(std::move(*p));
      }
      have_pools = true;
      continue;
    }
    const auto& table = key_table();
    auto k = std::find_if(table.begin(), table.end(), [&](const Key& x) { return key == x.name; });
    if (k == table.end()) return bad(key, "unknown key");
    if (auto r = k->read(c, it.value(), key); !r) return r.error();
  }
  if (!have_pools) {
    PoolConfig p;
    p.name = "cpu";
    p.cpus = available_cpus;
    p.workers = static_cast<uint32_t>(available_cpus.size());
    c.pools.push_back(p);
  }
  // "auto" sizes of what a reload may add.
  const auto configured = static_cast<uint32_t>(c.pools.size());
  if (c.max_pools == 0) c.max_pools = std::min(kMaxPools, configured + kAutoSpareRecords);
  if (c.max_pools < configured) {
    return bad("max_pools", std::to_string(c.max_pools) + " is fewer than the " +
                                std::to_string(configured) + " pools configured");
  }
  if (c.added_pool_workers == 0) {
    c.added_pool_workers = std::min<uint32_t>(kMaxAutoAddedPoolWorkers,
                                              static_cast<uint32_t>(available_cpus.size()) + 2);
  }
  // Cross-key checks.
  std::set<std::string> names;
  for (size_t i = 0; i < c.pools.size(); ++i) {
    auto& p = c.pools[i];
    if (!names.insert(p.name).second) {
      return bad("pools[" + std::to_string(i) + "].name", "'" + p.name + "' is used twice");
    }
    if (p.kind == PoolKind::kGpu && p.fallback == PoolFallback::kCpu) {
      // A Python pool's jobs go to the first Python cpu pool (its ops are Python ops), any
      // other pool's to the first cpu pool that is not one.
      const bool py = p.python.has_value();
      auto cpu = std::find_if(c.pools.begin(), c.pools.end(), [py](const PoolConfig& q) {
        return q.kind == PoolKind::kCpu && q.python.has_value() == py;
      });
      if (cpu == c.pools.end()) {
        return bad("pools[" + std::to_string(i) + "].fallback",
                   py ? "\"cpu\" sends a Python pool's jobs to the first Python cpu pool, and "
                        "this config has none"
                      : "\"cpu\" sends jobs to the first cpu pool, and this config has none");
      }
      p.fallback_pool = static_cast<int>(cpu - c.pools.begin());
    }
  }
  if (auto r = check_pool_sizes(c); !r) return r.error();
  if (c.client_segment_bytes > c.max_client_segment_bytes) {
    return bad("client_segment_bytes", "exceeds max_client_segment_bytes");
  }
  if (c.restart_backoff_initial_ms > c.restart_backoff_max_ms) {
    return bad("restart_backoff_initial_ms", "exceeds restart_backoff_max_ms");
  }
  if (c.start_backoff_initial_ms > c.start_backoff_max_ms) {
    return bad("start_backoff_initial_ms", "exceeds start_backoff_max_ms");
  }
  return c;
}

Result<void> check_pool_sizes(const Config& c) {
  uint64_t total_workers = 0;
  for (size_t i = 0; i < c.pools.size(); ++i) {
    const auto& p = c.pools[i];
    uint64_t cap = uint64_t{c.queue_factor} * p.most_workers();
    // A ring entry carries 14 bits of the slot generation; a ring far larger than that could
    // let a stale entry match a reused slot (docs/design/job_states.md).
    if (cap > 8192) {
      return bad("pools[" + std::to_string(i) + "]",
                 "queue_factor x workers (max_workers) = " + std::to_string(cap) +
                     " exceeds 8192 ring cells");
    }
    // Spares are workers too (processes, WorkerShm slots); a pool whose count is not known
    // yet (a gpu pool with "gpus": "all") is checked again once it is.
    total_workers += p.workers == 0 ? 0 : p.entries();
  }
  // The free pool records' rings and worker entries (a pool a reload adds).
  const uint32_t free = free_pool_records(c);
  if (free > 0 && uint64_t{c.queue_factor} * c.added_pool_workers > 8192) {
    return bad("added_pool_workers",
               "queue_factor x added_pool_workers = " +
                   std::to_string(uint64_t{c.queue_factor} * c.added_pool_workers) +
                   " exceeds 8192 ring cells");
  }
  total_workers += uint64_t{free} * c.added_pool_workers;
  if (total_workers > kMaxWorkers) {
    return bad("pools", "more than " + std::to_string(kMaxWorkers) +
                            " workers in all (spare_workers included, rollout_surge_workers, "
                            "and added_pool_workers for each free record of max_pools)");
  }
  return {};
}

Result<Config> load_config(const std::string& path, const std::vector<int>& available_cpus) {
  if (path.empty()) return parse_config("{}", available_cpus);
  std::ifstream in(path);
  if (!in) {
    return Error(ErrorCode::kInvalidArgument, "config: cannot read '" + path + "'");
  }
  std::stringstream ss;
  ss << in.rdbuf();
  auto c = parse_config(ss.str(), available_cpus);
  if (!c) return Error(c.error().code(), c.error().message() + " (in " + path + ")");
  return c;
}

}  // namespace gpuq::daemon
