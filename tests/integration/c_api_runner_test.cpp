// Integration: the C ABI, through tests/integration/c_api_test.c (a plain C program linked with
// the shared libgpuq), run against a real daemon.
#include "integration/integration_support.hpp"

#ifndef GPUQ_TEST_C_API_CLIENT
#error "build with -DGPUQ_TEST_C_API_CLIENT=<path of the c_api_test program>"
#endif

namespace gpuq::test {
namespace {

TEST_CASE("the C ABI test program passes against a real daemon") {
  DaemonProcess daemon(one_pool_config(2));
  const CommandResult run = run_command(std::string("'") + GPUQ_TEST_C_API_CLIENT + "' '" +
                                        daemon.runtime_dir() + "' 2>&1");
  INFO("c_api_test output:\n" << run.output);
  CHECK(run.exit_code == 0);
  CHECK(run.output.find(" 0 failed") != std::string::npos);
  // The daemon served it and is still fine.
  Client client = connect_client(daemon);
  check_echo_works(client);
}

TEST_CASE("the C ABI: a job past its time_limit_ms is stopped and ends GPUQ_TIMED_OUT") {
  DaemonProcess daemon(one_pool_config(2));
  const CommandResult run = run_command(std::string("'") + GPUQ_TEST_C_API_CLIENT + "' '" +
                                        daemon.runtime_dir() + "' time-limit 2>&1");
  INFO("c_api_test time-limit output:\n" << run.output);
  CHECK(run.exit_code == 0);
  CHECK(run.output.find(" 0 failed") != std::string::npos);
  Client client = connect_client(daemon);
  check_echo_works(client);
}

#ifdef GPUQ_TEST_PLUGIN
TEST_CASE("the C ABI: a 2000-byte failure message arrives whole, and cut in a revision-1 result") {
  nlohmann::json config = nlohmann::json::parse(one_pool_config(1));
  config["plugins"] = nlohmann::json::array({GPUQ_TEST_PLUGIN});
  DaemonProcess daemon(config.dump());
  const CommandResult run = run_command(std::string("'") + GPUQ_TEST_C_API_CLIENT + "' '" +
                                        daemon.runtime_dir() + "' long-message 2>&1");
  INFO("c_api_test long-message output:\n" << run.output);
  CHECK(run.exit_code == 0);
  CHECK(run.output.find(" 0 failed") != std::string::npos);
}
#endif

TEST_CASE("the C ABI test program fails cleanly without a daemon") {
  // A directory with no daemon: the program must report the failure, not pass or hang.
  char dir[] = "/tmp/gpuqt-XXXXXX";
  REQUIRE(::mkdtemp(dir) != nullptr);
  const CommandResult run =
      run_command(std::string("'") + GPUQ_TEST_C_API_CLIENT + "' '" + dir + "' 2>&1");
  ::rmdir(dir);
  INFO("c_api_test output:\n" << run.output);
  CHECK(run.exit_code == 1);
}

}  // namespace
}  // namespace gpuq::test
