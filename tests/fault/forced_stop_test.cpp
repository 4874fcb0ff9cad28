// Fault injection: the supervisor (gpuqd) dies with SIGKILL in the middle of stopping a job that
// did not end (docs/design/faults.md, "Jobs that do not end"): right after it raised the job's
// time-limit flag, and right after it raised the worker's `hold`, before its kill. Nothing may
// be lost or hang: the caller waiting on the job gets Disconnected, the dead daemon's workers
// exit with it (the hung one included), and a new gpuqd starts over the leftovers and serves
// the same client after its reconnect().
#include <signal.h>

#include <string>
#include <vector>

#include "fault/fault_support.hpp"
#include "integration/integration_support.hpp"

namespace gpuq::test::fault {
namespace {

using nlohmann::json;

void supervisor_dies_at(const std::string& point) {
  INFO("fault point " << point);
  DaemonOptions o;
  o.config_json =
      json{{"cancel_grace_ms", 200},
           {"plugins", json::array({GPUQ_TEST_PLUGIN})},
           {"pools", json::array({{{"name", "cpu"}, {"workers", 1}, {"job_time_limit_ms", 200}}})}}
          .dump();
  o.env = {"GPUQ_FAULT_POINT=" + point};
  DaemonProcess daemon(o);
  const std::vector<pid_t> workers = daemon.worker_pids();
  Client client = connect_client(daemon);
  check_echo_works(client);
  Job job = submit_ok(client, job_spec("plugin_spin"));

  const ChildExit died = daemon.wait_exit(20s);
  REQUIRE_MESSAGE(!died.timed_out, "gpuqd never reached " << point << "\n" << daemon.log());
  CHECK(died.signal == SIGKILL);
  auto r = job.wait(5s);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code() == ErrorCode::kDisconnected);
  CHECK(wait_until(
      [&] {
        for (pid_t w : workers) {
          if (!process_gone(w)) return false;
        }
        return true;
      },
      2s));

  daemon.kill_and_restart();  // the point stays armed; nothing below reaches it
  REQUIRE(client.reconnect().ok());
  check_echo_works(client);
  CHECK(daemon.terminate().ok());
}

TEST_CASE("the supervisor killed after raising a job's time-limit flag") {
  supervisor_dies_at("supervisor.time_limit_flagged");
}

TEST_CASE("the supervisor killed between holding a worker and killing it") {
  supervisor_dies_at("supervisor.before_forced_stop");
}

}  // namespace
}  // namespace gpuq::test::fault
