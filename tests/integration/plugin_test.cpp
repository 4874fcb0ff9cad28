// Integration: plug-in ops (gpuq/plugin.h) on a real gpuqd. The example plug-in's saxpy is in
// the op table and runs on the cpu pool; a plug-in op with no cpu function fails UnknownOp there;
// a bad plug-in path, a plug-in whose register fails and a name clash are clear start-up errors;
// gpuqd itself never maps the plug-in or a CUDA library.
#include <algorithm>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "gpuq/common/shm_layout.hpp"
#include "integration/integration_support.hpp"

namespace gpuq::test {
namespace {

std::string plugins_config(const std::vector<std::string>& plugins) {
  nlohmann::json c;
  c["pools"] = nlohmann::json::array({{{"name", "cpu"}, {"workers", 1}}});
  c["plugins"] = plugins;
  return c.dump();
}

std::string read_proc_file(pid_t pid, const char* name) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/" + name, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// gpuqd --check-config on `config_json`: its exit status and its stdout and stderr.
CommandResult check_config(const std::string& config_json) {
  char path[] = "/tmp/gpuq-plugin-config-XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  ::close(fd);
  {
    std::ofstream out(path);
    out << config_json;
  }
  CommandResult r = run_command(std::string("'") + gpuqd_path() + "' --check-config --config '" +
                                path + "' 2>&1");
  ::unlink(path);
  return r;
}

TEST_CASE("the example plug-in's saxpy is in the op table and runs on the cpu pool") {
  DaemonProcess daemon(plugins_config({GPUQ_TEST_EXAMPLE_PLUGIN, GPUQ_TEST_PLUGIN}));
  Client client = connect_client(daemon);

  const std::vector<std::string> ops = client.ops();
  INFO("ops: " << nlohmann::json(ops).dump());
  CHECK(std::find(ops.begin(), ops.end(), "saxpy") != ops.end());
  CHECK(std::find(ops.begin(), ops.end(), "plugin_gpu_only") != ops.end());
  CHECK(std::find(ops.begin(), ops.end(), "echo") != ops.end());

  constexpr uint64_t kN = 1000;
  Buffer in = allocate(client, 2 * kN * sizeof(float));
  Buffer out = allocate(client, kN * sizeof(float) + 16);
  auto* xy = reinterpret_cast<float*>(in.data());
  for (uint64_t i = 0; i < kN; ++i) {
    xy[i] = static_cast<float>(i) * 0.5f;       // x
    xy[kN + i] = 3.0f - static_cast<float>(i);  // y
  }
  std::memset(out.data(), 0, kN * sizeof(float) + 16);
  JobSpec spec = job_spec("saxpy", in, out);
  spec.params.push_back(JobParam::real("a", 2.5));
  Job job = submit_ok(client, spec);
  const JobResult r = wait_done(job);
  CHECK(r.output_size == kN * sizeof(float));
  CHECK(r.value == kN);
  const auto* y = reinterpret_cast<const float*>(out.data());
  uint64_t wrong = 0;
  for (uint64_t i = 0; i < kN; ++i) {
    if (y[i] != 2.5f * xy[i] + xy[kN + i]) ++wrong;
  }
  CHECK(wrong == 0);

  SUBCASE("an integer a is taken as a float") {
    JobSpec s = job_spec("saxpy", in, out);
    s.params.push_back(JobParam::integer("a", 2));
    Job j = submit_ok(client, s);
    wait_done(j);
    CHECK(y[10] == 2.0f * xy[10] + xy[kN + 10]);
  }

  SUBCASE("a missing param fails with the op's own message") {
    Job j = submit_ok(client, job_spec("saxpy", in, out));
    const JobResult f = wait_result(j);
    CHECK(f.status == JobStatus::kFailed);
    CHECK(f.code == ErrorCode::kInvalidArgument);
    CHECK(f.message.find("param a") != std::string::npos);
  }

  SUBCASE("an op with no cpu function fails UnknownOp on the cpu pool") {
    Job j = submit_ok(client, job_spec("plugin_gpu_only"));
    const JobResult f = wait_result(j);
    INFO("message: " << f.message);
    CHECK(f.status == JobStatus::kFailed);
    CHECK(f.code == ErrorCode::kUnknownOp);
    CHECK(f.message.find("no CPU implementation") != std::string::npos);
    check_echo_works(client);  // the worker is fine
  }

  SUBCASE("gpuqd maps neither a plug-in nor a CUDA library; the worker maps the plug-in") {
    const std::string maps = read_proc_file(daemon.pid(), "maps");
    REQUIRE(maps.find("gpuqd") != std::string::npos);
    CHECK(maps.find("gpuq_example_plugin") == std::string::npos);
    CHECK(maps.find("gpuq_test_plugin") == std::string::npos);
    for (const char* lib : {"libcuda", "libcudart", "libcublas", "libcudnn", "libnvidia"}) {
      INFO("library " << lib);
      CHECK(maps.find(lib) == std::string::npos);
    }
    const auto workers = daemon.worker_pids();
    REQUIRE(workers.size() == 1);
    CHECK(read_proc_file(workers[0], "maps").find("gpuq_example_plugin") != std::string::npos);
  }
  CHECK(daemon.terminate().ok());
}

// What plugin_fail says for `bytes` (test_plugin.cpp): "<bytes>:" and then the digits 0-9.
std::string plugin_fail_text(size_t bytes) {
  std::string text = std::to_string(bytes) + ":";
  for (size_t i = text.size(); i < bytes; ++i) text.push_back(static_cast<char>('0' + i % 10));
  return text;
}

TEST_CASE("a job's failure message arrives whole up to 2 KiB, and longer keeps both its ends") {
  DaemonProcess daemon(plugins_config({GPUQ_TEST_PLUGIN}));
  Client client = connect_client(daemon);
  const auto fail_with = [&](int64_t bytes) {
    JobSpec spec = job_spec("plugin_fail");
    spec.params.push_back(JobParam::integer("bytes", bytes));
    Job job = submit_ok(client, spec);
    const JobResult r = wait_result(job);
    CHECK(r.status == JobStatus::kFailed);
    CHECK(r.code == ErrorCode::kOpFailed);
    return r.message;
  };
  for (size_t bytes : {size_t{160}, size_t{2000}, size_t{kMessageBytes - 1 - 13}}) {
    CAPTURE(bytes);
    CHECK(fail_with(static_cast<int64_t>(bytes)) == "plugin_fail: " + plugin_fail_text(bytes));
  }
  // Past a job's message: the plug-in's buffer holds 2047 bytes of it, and the message, with
  // the op's name before it, keeps its beginning and its end.
  const std::string cut = fail_with(3000);
  const std::string whole = "plugin_fail: " + plugin_fail_text(kMessageBytes - 1);
  CHECK(cut.size() == kMessageBytes - 1);
  CHECK(cut.rfind("plugin_fail: 3000:5678", 0) == 0);
  CHECK(cut.find(" ... ") != std::string::npos);
  CHECK(cut.substr(cut.size() - 100) == whole.substr(whole.size() - 100));
  check_echo_works(client);
}

TEST_CASE("--check-config lists the plug-in ops") {
  const CommandResult r = check_config(plugins_config({GPUQ_TEST_EXAMPLE_PLUGIN}));
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(r.output.find(std::string("plug-in ") + GPUQ_TEST_EXAMPLE_PLUGIN + ": op saxpy") !=
        std::string::npos);
}

TEST_CASE("bad plug-ins are clear start-up errors naming them") {
  SUBCASE("a relative path") {
    const CommandResult r = check_config(plugins_config({"libfoo.so"}));
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("plugins[0]") != std::string::npos);
    CHECK(r.output.find("absolute path") != std::string::npos);
  }
  SUBCASE("a missing file") {
    const CommandResult r =
        check_config(plugins_config({GPUQ_TEST_EXAMPLE_PLUGIN, "/nonexistent/libp.so"}));
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("plugins[1]") != std::string::npos);
    CHECK(r.output.find("/nonexistent/libp.so: No such file or directory") != std::string::npos);
  }
  SUBCASE("not a shared library") {
    const CommandResult r = check_config(plugins_config({gpuqd_path()}));
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(std::string("plug-in ") + gpuqd_path() + ": dlopen") != std::string::npos);
  }
  SUBCASE("gpuq_plugin_register returns an error") {
    const CommandResult r = check_config(plugins_config({GPUQ_TEST_PLUGIN_BAD_REGISTER}));
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(std::string("plug-in ") + GPUQ_TEST_PLUGIN_BAD_REGISTER +
                        ": gpuq_plugin_register returned 16") != std::string::npos);
  }
  SUBCASE("an op name taken by a built-in op") {
    const CommandResult r = check_config(plugins_config({GPUQ_TEST_PLUGIN_CLASH}));
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(std::string("plug-in ") + GPUQ_TEST_PLUGIN_CLASH +
                        ": op name 'echo' is already taken by a built-in op") != std::string::npos);
  }
  SUBCASE("the same op from two plug-ins") {
    char copy[] = "/tmp/gpuq-plugin-copy-XXXXXX";
    const int fd = ::mkstemp(copy);
    REQUIRE(fd >= 0);
    ::close(fd);
    REQUIRE(run_command(std::string("cp '") + GPUQ_TEST_EXAMPLE_PLUGIN + "' '" + copy + "'")
                .exit_code == 0);
    const CommandResult r = check_config(plugins_config({GPUQ_TEST_EXAMPLE_PLUGIN, copy}));
    ::unlink(copy);
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find(std::string("op name 'saxpy' is already taken by plug-in ") +
                        GPUQ_TEST_EXAMPLE_PLUGIN) != std::string::npos);
  }
  SUBCASE("gpuqd itself does not start, and says why") {
    char dir[] = "/tmp/gpuq-plugin-run-XXXXXX";
    REQUIRE(::mkdtemp(dir) != nullptr);
    const std::string base = dir;
    {
      std::ofstream out(base + "/config.json");
      out << plugins_config({GPUQ_TEST_PLUGIN_BAD_REGISTER});
    }
    const CommandResult r = run_command(std::string("'") + gpuqd_path() + "' --config '" + base +
                                        "/config.json' --runtime-dir '" + base + "/run' 2>&1");
    run_command("rm -rf '" + base + "'");
    INFO(r.output);
    CHECK(r.exit_code == 1);
    CHECK(r.output.find("cannot start") != std::string::npos);
    CHECK(r.output.find("gpuq_plugin_register returned 16") != std::string::npos);
  }
}

TEST_CASE("a worker that cannot load a plug-in exits 1 before it reports ready, saying why") {
  // gpuq-worker beside gpuqd, with the arguments gpuqd passes and a control descriptor (3); it
  // loads its plug-ins before it touches the queue segment.
  const std::string gpuqd = gpuqd_path();
  const std::string worker = gpuqd.substr(0, gpuqd.rfind('/')) + "/gpuq-worker";
  const CommandResult r = run_command(
      "'" + worker +
      "' --queue-segment /gpuq-none --worker-id 3 --pool-id 0 --supervisor-pid 1 --plugin '" +
      GPUQ_TEST_PLUGIN_BAD_REGISTER + "' 3</dev/null 2>&1");
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find(std::string("plug-in ") + GPUQ_TEST_PLUGIN_BAD_REGISTER +
                      ": gpuq_plugin_register returned 16") != std::string::npos);
}

// Workers load the plug-ins again each time one starts; a plug-in file replaced on disk since
// gpuqd started would give the new worker other ops under the ids clients were given.
TEST_CASE("a worker whose plug-in file changed since gpuqd started is refused, not served") {
  char dir[] = "/tmp/gpuq-plugin-swap-XXXXXX";
  REQUIRE(::mkdtemp(dir) != nullptr);
  const std::string path = std::string(dir) + "/plugin.so";
  auto copy_to = [](const std::string& from, const std::string& to) {
    const std::string tmp = to + ".new";
    {
      std::ifstream in(from, std::ios::binary);
      std::ofstream out(tmp, std::ios::binary);
      out << in.rdbuf();
    }
    REQUIRE(::rename(tmp.c_str(), to.c_str()) == 0);  // a new file, as an upgrade installs one
  };
  copy_to(GPUQ_TEST_EXAMPLE_PLUGIN, path);
  nlohmann::json c = nlohmann::json::parse(plugins_config({path}));
  c["restart_backoff_initial_ms"] = 1;
  c["restart_backoff_max_ms"] = 8;
  c["max_start_failures"] = 2;
  c["start_backoff_initial_ms"] = 50;
  c["start_backoff_max_ms"] = 100;
  DaemonProcess daemon(c.dump());
  const pid_t first = daemon.status()["pools"][0]["workers"][0].value("pid", 0);
  REQUIRE(first > 0);

  copy_to(GPUQ_TEST_PLUGIN, path);  // other ops: saxpy's id would now name another op
  REQUIRE(::kill(first, SIGKILL) == 0);
  std::string state;
  CHECK(wait_until(
      [&] {
        state = daemon.status()["pools"][0]["workers"][0].value("state", "");
        return state == "failed";
      },
      20s));
  INFO("worker state " << state << "\n" << daemon.log());
  CHECK(daemon.log().find("loaded other plug-in ops") != std::string::npos);
  // Failed is not given up on: it is tried again after the start back-off, and refused again
  // for as long as the file differs.
  CHECK(wait_until(
      [&] { return daemon.status()["pools"][0]["workers"][0].value("start_failures", 0) >= 4; },
      20s));
  const nlohmann::json w = daemon.status()["pools"][0]["workers"][0];
  CHECK(w.value("state", "") != "ready");
  ::unlink(path.c_str());
  ::rmdir(dir);
}

}  // namespace
}  // namespace gpuq::test
