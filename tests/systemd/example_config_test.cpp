// Integration: the example config that `cmake --install` and the Debian package put in
// /etc/gpuq/gpuqd.json (systemd/gpuqd.json). It holds every key of docs/config.md with its
// built-in default, except the three that give the unit's access rule (group, allowed_groups:
// "gpuq"; allowed_users: root) and the pool keys whose default depends on the machine (cpus,
// workers: every CPU; max_workers: its workers); and gpuqd --check-config accepts it.
#include <grp.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <regex>
#include <set>
#include <string>

#include "config.hpp"
#include "integration/integration_support.hpp"

#ifndef GPUQ_TEST_SOURCE_DIR
#error "build with -DGPUQ_TEST_SOURCE_DIR=<the source tree>"
#endif

namespace gpuq::test {
namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot read " << path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

const std::string kExample = std::string(GPUQ_TEST_SOURCE_DIR) + "/systemd/gpuqd.json";

// The keys of the table under `heading` in docs/config.md: rows "| `key` | ...".
std::set<std::string> documented_keys(const std::string& heading) {
  const std::string doc = read_text(std::string(GPUQ_TEST_SOURCE_DIR) + "/docs/config.md");
  const size_t start = doc.find("\n## " + heading + "\n");
  REQUIRE_MESSAGE(start != std::string::npos, "docs/config.md has no '## " << heading << "'");
  size_t end = doc.find("\n## ", start + 1);
  if (end == std::string::npos) end = doc.size();
  const std::string section = doc.substr(start, end - start);
  std::set<std::string> keys;
  static const std::regex row(R"(\n\| `([a-z_]+)` \|)");
  for (auto it = std::sregex_iterator(section.begin(), section.end(), row);
       it != std::sregex_iterator(); ++it) {
    keys.insert((*it)[1].str());
  }
  REQUIRE_FALSE(keys.empty());
  return keys;
}

// The name of this process's group: exists on any machine, unlike "gpuq" before the package
// has made it.
std::string own_group_name() {
  const group* g = ::getgrgid(::getgid());
  REQUIRE(g != nullptr);
  return g->gr_name;
}

bool group_exists(const char* name) {
  return ::getgrnam(name) != nullptr;
}

// The example with the group "gpuq" replaced by `group`.
std::string with_group(const std::string& group) {
  nlohmann::json doc = nlohmann::json::parse(read_text(kExample));
  doc["group"] = group;
  doc["allowed_groups"] = nlohmann::json::array({group});
  return doc.dump();
}

TEST_CASE("example config: every documented key, with its built-in default") {
  const nlohmann::json doc = nlohmann::json::parse(read_text(kExample));
  REQUIRE(doc.is_object());
  std::set<std::string> keys;
  for (auto it = doc.begin(); it != doc.end(); ++it) keys.insert(it.key());
  CHECK(keys == documented_keys("Top-level keys"));

  std::set<std::string> pool_keys = documented_keys("Pool keys");
  pool_keys.erase("cpus");  // default: every CPU the daemon may use, which no file can name
  pool_keys.erase("workers");
  pool_keys.erase("max_workers");  // default: its workers
  // Default: the top-level key's (at least 300 for a Python pool), which a pool that names it
  // would no longer follow.
  pool_keys.erase("worker_spin_us");
  pool_keys.erase("python");  // none: the example's pool is no Python pool
  REQUIRE(doc["pools"].is_array());
  REQUIRE(doc["pools"].size() == 1);
  std::set<std::string> example_pool_keys;
  for (auto it = doc["pools"][0].begin(); it != doc["pools"][0].end(); ++it) {
    example_pool_keys.insert(it.key());
  }
  CHECK(example_pool_keys == pool_keys);

  // The values: the built-in defaults, but for the access rule.
  const std::vector<int> cpus = gpuq::daemon::allowed_cpus();
  auto parsed = gpuq::daemon::parse_config(with_group(own_group_name()), cpus);
  REQUIRE_MESSAGE(parsed.ok(), error_text(parsed));
  auto defaults = gpuq::daemon::parse_config("{}", cpus);
  REQUIRE(defaults.ok());
  const gpuq::daemon::Config& c = *parsed;
  const gpuq::daemon::Config& d = *defaults;
  CHECK(c.queue_factor == d.queue_factor);
  CHECK(c.max_clients == d.max_clients);
  CHECK(c.max_jobs_per_client == d.max_jobs_per_client);
  CHECK(c.client_queue_share == d.client_queue_share);
  CHECK(c.client_weights == d.client_weights);
  CHECK(c.client_segment_bytes == d.client_segment_bytes);
  CHECK(c.max_client_segment_bytes == d.max_client_segment_bytes);
  CHECK(c.drain_timeout_ms == d.drain_timeout_ms);
  CHECK(c.worker_spin_us == d.worker_spin_us);
  CHECK(c.job_clock == d.job_clock);
  CHECK(c.restart_backoff_initial_ms == d.restart_backoff_initial_ms);
  CHECK(c.restart_backoff_max_ms == d.restart_backoff_max_ms);
  CHECK(c.max_start_failures == d.max_start_failures);
  CHECK(c.start_backoff_initial_ms == d.start_backoff_initial_ms);
  CHECK(c.start_backoff_max_ms == d.start_backoff_max_ms);
  CHECK(c.start_timeout_ms == d.start_timeout_ms);
  CHECK(c.pool_down_fail_ms == d.pool_down_fail_ms);
  CHECK(c.log_level == d.log_level);
  REQUIRE(c.pools.size() == d.pools.size());
  CHECK(c.pools[0].name == d.pools[0].name);
  CHECK(c.pools[0].kind == d.pools[0].kind);
  CHECK(c.pools[0].cpus == d.pools[0].cpus);
  CHECK(c.pools[0].workers == d.pools[0].workers);
  // The access rule of the unit (docs/service.md): root, and the gpuq group.
  CHECK(c.allowed_uids == std::vector<uid_t>{0});
  CHECK(c.allowed_gids == std::vector<gid_t>{::getgid()});
  CHECK(c.group_set);
  CHECK(c.group == ::getgid());
  CHECK(doc["group"] == "gpuq");
  CHECK(doc["allowed_groups"] == nlohmann::json::array({"gpuq"}));
}

TEST_CASE("example config: gpuqd --check-config accepts it") {
  std::string path = kExample;
  std::string scratch;
  if (!group_exists("gpuq")) {
    // Before the package has made the gpuq group, the same file with this process's group
    // (tests/package/deb_test.sh checks the installed file as it is).
    char dir[] = "/tmp/gpuqc-XXXXXX";
    REQUIRE(::mkdtemp(dir) != nullptr);
    scratch = dir;
    path = scratch + "/gpuqd.json";
    std::ofstream(path) << with_group(own_group_name());
  }
  const CommandResult r =
      run_command(std::string(gpuqd_path()) + " --check-config --config " + path + " 2>&1");
  if (!scratch.empty()) {
    ::unlink(path.c_str());
    ::rmdir(scratch.c_str());
  }
  CHECK_MESSAGE(r.exit_code == 0, r.output);
  CHECK(r.output.find("config OK") != std::string::npos);
}

}  // namespace
}  // namespace gpuq::test
