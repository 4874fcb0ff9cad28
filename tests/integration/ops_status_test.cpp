// Integration: every op end to end on a real daemon, jobs routed to their pool, and the status
// document (library and `gpuqctl status --json`).
#include <algorithm>
#include <map>
#include <set>

#include "gpuq/common/crc32c.hpp"
#include "integration/integration_support.hpp"

namespace gpuq::test {
namespace {

TEST_CASE("every op runs end to end on the cpu pool") {
  DaemonProcess daemon;
  Client client = connect_client(daemon, 8ull << 20);
  std::mt19937_64 rng(test_seed(0x6f70735f74657374));

  SUBCASE("noop") {
    Job job = submit_ok(client, noop_spec());
    JobResult r = wait_done(job);
    CHECK(r.output_size == 0);
    CHECK(r.message.empty());
  }

  SUBCASE("echo copies its input byte for byte, and no further") {
    for (uint64_t size : {uint64_t{1}, uint64_t{4096}, (uint64_t{1} << 20) + 3}) {
      INFO("size " << size);
      constexpr uint64_t kGuard = 64;  // bytes past the input that echo must not touch
      Buffer in = allocate(client, size);
      Buffer out = allocate(client, size + kGuard);
      fill_random(in.data(), size, rng);
      std::memset(out.data(), 0xA5, size + kGuard);
      const JobSpec spec = job_spec("echo", in, out);
      Job job = submit_ok(client, spec);
      JobResult r = wait_done(job);
      CHECK(r.output_size == size);
      CHECK(std::memcmp(in.data(), out.data(), size) == 0);
      const bool guard_intact = std::all_of(out.data() + size, out.data() + size + kGuard,
                                            [](std::byte b) { return b == std::byte{0xA5}; });
      CHECK(guard_intact);
      client.release(in);
      client.release(out);
    }
  }

  SUBCASE("sleep runs for at least its us") {
    Job job = submit_ok(client, sleep_spec(2000));
    JobResult r = wait_done(job);
    CHECK(r.run_ns >= 2'000'000);
    CHECK(r.value == 2000);
  }

  SUBCASE("checksum is the CRC32C of the input, as a value and 4 little-endian bytes") {
    // The oracle itself: the standard CRC32C check value.
    REQUIRE(gpuq::crc32c("123456789", 9) == 0xE3069283u);
    constexpr uint64_t kSize = 10007;
    Buffer in = allocate(client, kSize);
    Buffer out = allocate(client, 16);
    fill_random(in.data(), kSize, rng);
    std::memset(out.data(), 0, 16);
    const uint32_t expected = gpuq::crc32c(in.data(), kSize);
    Job job = submit_ok(client, job_spec("checksum", in, out));
    JobResult r = wait_done(job);
    CHECK(r.value == expected);
    CHECK(r.output_size == 4);
    const auto* o = reinterpret_cast<const unsigned char*>(out.data());
    const uint32_t le =
        uint32_t{o[0]} | uint32_t{o[1]} << 8 | uint32_t{o[2]} << 16 | uint32_t{o[3]} << 24;
    CHECK(le == expected);

    // Without an output buffer: only the value.
    Job job2 = submit_ok(client, job_spec("checksum", in));
    JobResult r2 = wait_done(job2);
    CHECK(r2.value == expected);
    CHECK(r2.output_size == 0);
  }
}

TEST_CASE("job timings are right with either job clock") {
  // "auto" is the TSC where the kernel keeps time with it (clock.hpp); "monotonic" always works.
  for (const char* clock : {"auto", "monotonic"}) {
    CAPTURE(clock);
    DaemonProcess daemon(one_pool_config(1, {{"job_clock", clock}}));
    Client client = connect_client(daemon);
    for (int64_t us : {2000, 30000}) {
      CAPTURE(us);
      Job job = submit_ok(client, sleep_spec(us));
      JobResult r = wait_done(job);
      CHECK(r.run_ns >= static_cast<uint64_t>(us) * 1000);
      CHECK(r.run_ns < static_cast<uint64_t>(us) * 1000 + 1'000'000'000);
      CHECK(r.queued_ns < 1'000'000'000);
    }
    // Behind a running job, a queued one waits about as long as that one has left to run.
    Job first = submit_ok(client, sleep_spec(50'000));
    wait_running(first);
    Job second = submit_ok(client, noop_spec());
    JobResult a = wait_done(first);
    JobResult b = wait_done(second);
    CHECK(a.run_ns >= 50'000'000);
    CHECK(b.queued_ns > 10'000'000);  // the 50 ms sleep less the wait_running spin
    CHECK(b.queued_ns < 1'000'000'000);
  }
}

TEST_CASE("Jobs keep their connection: they outlive their Client, and the last one closes it") {
  using namespace std::chrono_literals;
  DaemonProcess daemon(one_pool_config(1));
  std::vector<Job> jobs;
  {
    Client client = connect_client(daemon);
    jobs.push_back(submit_ok(client, sleep_spec(20'000)));
    jobs.push_back(submit_ok(client, noop_spec()));
    jobs.push_back(submit_ok(client, sleep_spec(200'000)));  // dropped queued or running
  }
  CHECK(daemon.status()["clients"] == 1);  // the Jobs hold the connection
  JobResult a = wait_done(jobs[0]);
  CHECK(a.value == 20'000);
  JobResult b = wait_done(jobs[1]);
  CHECK(b.ok());
  jobs.clear();  // the last Jobs: the connection closes and the daemon sees the client go
  CHECK(wait_until([&] { return daemon.status()["clients"] == 0; }, 10s));
  // Another client is served as usual.
  Client other = connect_client(daemon);
  Job job = submit_ok(other, noop_spec());
  CHECK(wait_done(job).ok());
}

TEST_CASE("jobs run on a worker of the pool they were submitted to") {
  const std::vector<int> cpus = affinity_cpus();
  REQUIRE(!cpus.empty());
  nlohmann::json config = {
      {"pools",
       {{{"name", "a"}, {"kind", "cpu"}, {"workers", 1}, {"cpus", {cpus.front()}}},
        {{"name", "b"}, {"kind", "cpu"}, {"workers", 1}, {"cpus", {cpus.back()}}}}}};
  DaemonProcess daemon(config.dump());

  std::map<std::string, std::set<uint32_t>> ids;
  const nlohmann::json status = daemon.status();
  REQUIRE(status["pools"].size() == 2);
  for (const auto& pool : status["pools"]) {
    for (const auto& w : pool["workers"]) {
      ids[pool["name"].get<std::string>()].insert(w["id"].get<uint32_t>());
    }
  }
  REQUIRE(ids["a"].size() == 1);
  REQUIRE(ids["b"].size() == 1);
  REQUIRE(ids["a"] != ids["b"]);

  Client client = connect_client(daemon);
  REQUIRE(client.pools().size() == 2);
  CHECK(client.pools()[0].name == "a");
  CHECK(client.pools()[1].name == "b");

  // Several in flight on both pools at once; the empty name means the first pool.
  struct Pending {
    std::string pool;
    Job job;
  };
  std::vector<Pending> pending;
  for (int i = 0; i < 12; ++i) {
    const std::string pool = i % 3 == 0 ? "a" : i % 3 == 1 ? "b" : "";
    pending.push_back({pool.empty() ? "a" : pool, submit_ok(client, sleep_spec(200, pool))});
  }
  for (auto& p : pending) {
    INFO("pool " << p.pool);
    JobResult r = wait_done(p.job);
    CHECK(ids[p.pool].count(r.worker_id) == 1);
  }
}

TEST_CASE("status of a daemon with the default config, from the library and from gpuqctl") {
  const std::vector<int> cpus = affinity_cpus();
  REQUIRE(!cpus.empty());
  DaemonProcess daemon;  // no config file
  const nlohmann::json s = daemon.status();

  CHECK(s["state"] == "running");
  CHECK(s["clients"] == 0);
  CHECK(s["pid"] == daemon.pid());
  REQUIRE(s["pools"].size() == 1);
  const nlohmann::json& pool = s["pools"][0];
  CHECK(pool["name"] == "cpu");
  CHECK(pool["kind"] == "cpu");
  CHECK(pool["status"] == "ready");
  CHECK(pool["workers_total"] == cpus.size());
  CHECK(pool["workers_ready"] == cpus.size());
  CHECK(pool["capacity"] == 10 * cpus.size());
  CHECK(pool["queue_depth"] == 0);
  REQUIRE(pool["workers"].size() == cpus.size());
  std::set<int> seen_cpus;
  std::set<pid_t> seen_pids;
  for (const auto& w : pool["workers"]) {
    INFO("worker " << w.dump());
    CHECK(w["state"] == "ready");
    CHECK(w["busy"] == false);
    CHECK(w["restarts"] == 0);
    CHECK(w["pid"].get<pid_t>() > 0);
    seen_pids.insert(w["pid"].get<pid_t>());
    REQUIRE(w["cpus"].size() == 1);
    const int cpu = w["cpus"][0].get<int>();
    CHECK(std::find(cpus.begin(), cpus.end(), cpu) != cpus.end());
    seen_cpus.insert(cpu);
  }
  CHECK(seen_cpus.size() == cpus.size());  // each worker on its own CPU
  CHECK(seen_pids.size() == cpus.size());

  // The same facts through the command line.
  const CommandResult json_run =
      run_command(std::string("'") + gpuqctl_path() + "' --runtime-dir '" + daemon.runtime_dir() +
                  "' status --json");
  REQUIRE(json_run.exit_code == 0);
  const nlohmann::json c = nlohmann::json::parse(json_run.output, nullptr, false);
  REQUIRE_MESSAGE(!c.is_discarded(), "gpuqctl status --json printed: " << json_run.output);
  CHECK(c["pid"] == s["pid"]);
  CHECK(c["epoch"] == s["epoch"]);
  REQUIRE(c["pools"].size() == s["pools"].size());
  for (const char* key :
       {"name", "kind", "capacity", "client_share", "workers_total", "workers_ready", "status"}) {
    INFO("pool key " << key);
    CHECK(c["pools"][0][key] == pool[key]);
  }
  REQUIRE(c["pools"][0]["workers"].size() == pool["workers"].size());
  for (size_t i = 0; i < pool["workers"].size(); ++i) {
    for (const char* key : {"id", "pid", "cpus", "state"}) {
      INFO("worker " << i << " key " << key);
      CHECK(c["pools"][0]["workers"][i][key] == pool["workers"][i][key]);
    }
  }

  const CommandResult table_run = run_command(
      std::string("'") + gpuqctl_path() + "' --runtime-dir '" + daemon.runtime_dir() + "' status");
  CHECK(table_run.exit_code == 0);
  CHECK(table_run.output.find("cpu") != std::string::npos);
}

}  // namespace
}  // namespace gpuq::test
