// Runs a short-lived helper child (a plug-in's or a Python pool's op listing) and collects what
// it prints, with a time limit. The supervisor uses it at start-up, while it is single-threaded.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpuq/error.hpp"

namespace gpuq::daemon {

struct ChildOutput {
  int status = 0;   // as waitpid() reports it (0 when the child could not be waited for)
  std::string out;  // its stdout
  std::string err;  // its stderr, trailing newlines removed
};

// fork + execve of `argv` (argv[0]: a path) with exactly `env` (NAME=value), stdout and stderr
// captured, until both close or `timeout_ms` passes (the child is then killed). Errors:
// Timeout "did not finish within N ms"; Internal for a pipe, fork or poll failure.
Result<ChildOutput> run_child_for_output(const std::vector<std::string>& argv,
                                         const std::vector<std::string>& env, uint32_t timeout_ms);

// "exit status 1", "killed by signal 9".
std::string describe_child_status(int status);

// This process's environment without the variables named by `drop` (prefixes "NAME="), as
// NAME=value strings.
std::vector<std::string> environment_without(const std::vector<std::string>& drop);

}  // namespace gpuq::daemon
