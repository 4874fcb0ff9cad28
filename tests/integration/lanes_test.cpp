// Integration: the order a real daemon's worker takes jobs in from its pool's lanes
// (docs/design/ring.md, "Lanes"): priorities (high first, each level in its order, a waiting
// lower level still started), clients in turn (two floods alternate), and a client with one
// job taken before any flood's queue. One worker, so the start order is the run order: each
// job's start is its submit time plus its time queued.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "integration/integration_support.hpp"

namespace gpuq::test {
namespace {

// Long enough that the worker stays busy while a test queues jobs behind it.
constexpr int64_t kOccupyUs = 400'000;
constexpr int64_t kJobUs = 3'000;

struct Queued {
  Job job;
  std::string tag;
  std::chrono::steady_clock::time_point submitted;
};

Queued submit_tagged(Client& client, const JobSpec& spec, std::string tag) {
  Queued q{Job(), std::move(tag), std::chrono::steady_clock::now()};
  q.job = submit_ok(client, spec);
  return q;
}

// The tags in the order their jobs started.
std::vector<std::string> start_order(std::vector<Queued>& jobs) {
  std::vector<std::pair<std::chrono::steady_clock::time_point, std::string>> starts;
  starts.reserve(jobs.size());
  for (Queued& q : jobs) {
    const JobResult r = wait_done(q.job);
    starts.emplace_back(q.submitted + std::chrono::nanoseconds(r.queued_ns), q.tag);
  }
  std::sort(starts.begin(), starts.end());
  std::vector<std::string> order;
  order.reserve(starts.size());
  for (auto& [at, tag] : starts) order.push_back(tag);
  return order;
}

std::string joined(const std::vector<std::string>& tags) {
  std::string s;
  for (const auto& t : tags) s += (s.empty() ? "" : " ") + t;
  return s;
}

TEST_CASE("lanes: high jobs first, each level in order, a waiting lower level still starts") {
  DaemonProcess daemon(one_pool_config(1, {{"queue_factor", 32}}));
  Client client = connect_client(daemon);
  Job running = submit_ok(client, sleep_spec(kOccupyUs));
  wait_running(running);
  std::vector<Queued> jobs;
  jobs.reserve(18);
  for (const auto& [priority, name] :
       {std::pair{Priority::kLow, "L"}, std::pair{Priority::kNormal, "N"},
        std::pair{Priority::kHigh, "H"}}) {
    for (int i = 0; i < 6; ++i) {
      JobSpec spec = sleep_spec(kJobUs);
      spec.priority = priority;
      jobs.push_back(submit_tagged(client, spec, name + std::to_string(i)));
    }
  }
  // Status: the jobs queued at each level, and this client's queued and running jobs.
  const nlohmann::json status = daemon.status();
  INFO("status: " << status.dump());
  const nlohmann::json& levels = status["pools"][0]["queued_by_priority"];
  CHECK(levels["high"] == 6);
  CHECK(levels["normal"] == 6);
  CHECK(levels["low"] == 6);
  REQUIRE(status["client_jobs"].size() == 1);
  const nlohmann::json& mine = status["client_jobs"][0];
  CHECK(mine["queued"] == 18);
  CHECK(mine["running"] == 1);
  CHECK(mine["pools"]["cpu"]["queued"] == 18);
  CHECK(mine["pid"] == getpid());
  const CommandResult text = run_command(std::string("'") + gpuqctl_path() + "' --runtime-dir '" +
                                         daemon.runtime_dir() + "' status 2>&1");
  INFO(text.output);
  CHECK(text.output.find("queue 18/32 (6 high, 6 low)") != std::string::npos);
  CHECK(text.output.find("clients with jobs (most queued first):") != std::string::npos);
  wait_done(running);
  const std::vector<std::string> order = start_order(jobs);
  INFO("start order: " << joined(order));
  // Six high jobs; then the lowest level that has waited nine starts goes ahead once (low,
  // after three normal ones): each waiting level gets at least one start in ten.
  CHECK(joined(order) == "H0 H1 H2 H3 H4 H5 N0 N1 N2 L0 N3 N4 N5 L1 L2 L3 L4 L5");
}

TEST_CASE("lanes: an unknown priority is refused, naming the field") {
  DaemonProcess daemon(one_pool_config(1));
  Client client = connect_client(daemon);
  JobSpec spec = noop_spec();
  spec.priority = static_cast<Priority>(7);
  auto job = client.submit(spec);
  REQUIRE_FALSE(job.ok());
  CHECK(job.error().code() == ErrorCode::kInvalidArgument);
  CHECK(job.error().message().find("priority") != std::string::npos);
  // The client goes on.
  Job ok = submit_ok(client, noop_spec());
  CHECK(wait_done(ok).ok());
}

TEST_CASE("lanes: two floods are served in turn; a client with one job goes before their queues") {
  DaemonProcess daemon(one_pool_config(1, {{"queue_factor", 32}, {"client_queue_share", 1.0}}));
  Client occupier = connect_client(daemon);
  Client flood_a = connect_client(daemon);
  Client flood_b = connect_client(daemon);
  Client single = connect_client(daemon);
  Job running = submit_ok(occupier, sleep_spec(kOccupyUs));
  wait_running(running);
  std::vector<Queued> jobs;
  jobs.reserve(13);
  // Flood a queues all of its jobs first, then flood b: in arrival order every a would go
  // before every b.
  for (int i = 0; i < 6; ++i) jobs.push_back(submit_tagged(flood_a, sleep_spec(kJobUs), "a"));
  for (int i = 0; i < 6; ++i) jobs.push_back(submit_tagged(flood_b, sleep_spec(kJobUs), "b"));
  // Its only job in the pool: the level's fresh lane, taken before the floods' lanes.
  jobs.push_back(submit_tagged(single, sleep_spec(kJobUs), "s"));
  wait_done(running);
  const std::vector<std::string> order = start_order(jobs);
  INFO("start order: " << joined(order));
  // Each flood's first job was its only one in the pool when it came (the fresh lane, as the
  // single job); after them, their lanes in turn.
  CHECK(joined(order) == "a b s a b a b a b a b a b");
}

}  // namespace
}  // namespace gpuq::test
