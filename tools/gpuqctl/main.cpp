// gpuqctl: the command line of gpuq. Shows the daemon's status, submits jobs (one, or many for a
// quick throughput and latency measurement) and stops the daemon. See kUsage (cli.cpp).
//
// This file reads the global options and hands the rest of the command line to the command
// (commands.hpp: cmd_status.cpp, cmd_ready.cpp, cmd_metrics.cpp, cmd_top.cpp, cmd_submit.cpp,
// cmd_restart.cpp, cmd_reload.cpp, cmd_stop.cpp).
//
// Exit status: 0 success, 1 a daemon or job error, 2 bad usage.
#include <exception>
#include <iostream>
#include <string>
#include <string_view>

#include "cli.hpp"
#include "commands.hpp"
#include "gpuq/client.hpp"

namespace gpuq::ctl {
namespace {

// Parses and runs one command line.
int run(int argc, char** argv) {
  ArgCursor cursor(argc, argv);
  std::string runtime_dir;
  std::string error;
  while (!cursor.done() && cursor.peek().substr(0, 1) == "-") {
    std::string_view arg = cursor.peek();
    if (arg == "-h" || arg == "--help") {
      std::cout << kUsage;
      return kExitOk;
    }
    if (arg == "--version") {
      std::cout << "gpuqctl " << gpuq::version() << '\n';
      return kExitOk;
    }
    if (!cursor.take_value("--runtime-dir", runtime_dir, error)) {
      return usage_error("unknown option '" + std::string(arg) + "'");
    }
    if (!error.empty()) return usage_error(error);
  }
  if (cursor.done()) {
    return usage_error(
        "no command given (status, ready, metrics, top, submit, restart, reload or stop)");
  }
  const std::string command(cursor.next());

  if (command == "help") {
    std::cout << kUsage;
    return kExitOk;
  }
  if (command == "status") return cmd_status(cursor, runtime_dir);
  if (command == "ready") return cmd_ready(cursor, runtime_dir);
  if (command == "stop") return cmd_stop(cursor, runtime_dir);
  if (command == "restart") return cmd_restart(cursor, runtime_dir);
  if (command == "reload") return cmd_reload(cursor, runtime_dir);
  if (command == "metrics") return cmd_metrics(cursor, runtime_dir);
  if (command == "top") return cmd_top(cursor, runtime_dir);
  if (command == "submit") return cmd_submit(cursor, runtime_dir);
  return usage_error("unknown command '" + command +
                     "' (expected status, ready, metrics, top, submit, restart, reload or stop)");
}

}  // namespace
}  // namespace gpuq::ctl

int main(int argc, char** argv) {
  try {
    return gpuq::ctl::run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "gpuqctl: Internal: unexpected exception: " << e.what() << '\n';
    return gpuq::ctl::kExitFailure;
  }
}
