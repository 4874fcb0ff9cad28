// gpuq/error.hpp: Result holds a value or an Error, and misusing it (the value of an error, the
// error of a value) is a bug that aborts with a message, never an exception.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <string>

#include "gpuq/error.hpp"

namespace gpuq {
namespace {

struct ChildOutcome {
  bool aborted = false;
  int status = 0;   // waitpid's
  std::string err;  // what the child wrote to stderr
};

// Runs fn in a forked child with stderr on a pipe; reports whether it died of SIGABRT.
template <typename Fn>
ChildOutcome run_in_child(Fn fn) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // The default action for SIGABRT, not the handler doctest installs for crashes (which
    // would report the abort as this test's failure, in the child).
    ::signal(SIGABRT, SIG_DFL);
    ::dup2(fds[1], STDERR_FILENO);
    ::close(fds[0]);
    fn();
    ::_exit(0);  // fn returned: not aborted
  }
  ::close(fds[1]);
  ChildOutcome out;
  char buf[512];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0) out.err.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  out.status = status;
  out.aborted = WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
  return out;
}

TEST_CASE("Result holds a value or an error") {
  Result<int> v = 7;
  CHECK(v.ok());
  CHECK(*v == 7);
  CHECK(v.value() == 7);

  Result<int> e = Error(ErrorCode::kQueueFull, "ring full");
  CHECK_FALSE(e.ok());
  CHECK(e.error().code() == ErrorCode::kQueueFull);
  CHECK(e.error().to_string() == "QueueFull: ring full");

  Result<void> done = ok_result();
  CHECK(done.ok());
  Result<void> failed = Error(ErrorCode::kTimeout, "late");
  CHECK(failed.error().code() == ErrorCode::kTimeout);
}

TEST_CASE("the value of an error Result aborts and names the error") {
  const ChildOutcome out = run_in_child([] {
    Result<int> e = Error(ErrorCode::kQueueFull, "ring full");
    (void)e.value();
  });
  INFO("child status " << out.status << ", stderr: " << out.err);
  CHECK(out.aborted);
  CHECK(out.err.find("value of a Result that holds an error") != std::string::npos);
  CHECK(out.err.find("QueueFull: ring full") != std::string::npos);
}

TEST_CASE("the error of a value Result aborts") {
  const ChildOutcome value = run_in_child([] {
    Result<std::string> v = std::string("fine");
    (void)v.error();
  });
  INFO("child status " << value.status << ", stderr: " << value.err);
  CHECK(value.aborted);
  CHECK(value.err.find("error of a Result that holds a value") != std::string::npos);

  const ChildOutcome done = run_in_child([] {
    Result<void> ok = ok_result();
    (void)ok.error();
  });
  INFO("child status " << done.status << ", stderr: " << done.err);
  CHECK(done.aborted);
  CHECK(done.err.find("error of a Result<void> that succeeded") != std::string::npos);
}

}  // namespace
}  // namespace gpuq
